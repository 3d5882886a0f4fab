"""The parallel layout of a training job: which rank sits where, and with whom.

A job of ``world_size = tp * pp * dp`` ranks is laid out with tensor parallelism
innermost, then pipeline stages, then data-parallel replicas::

    rank = (dp_index * pp + pp_index) * tp + tp_index

Ranks are packed onto machines ``ranks_per_machine`` at a time (by default one
machine holds one TP group), so with TP=2, PP=2, DP=2 on 4 machines of 2 ranks:

    machine 0: ranks 0,1  (dp 0, stage 0)     machine 1: ranks 2,3  (dp 0, stage 1)
    machine 2: ranks 4,5  (dp 1, stage 0)     machine 3: ranks 6,7  (dp 1, stage 1)

The same model is used by the training job (to build its process groups), by the
checkpoint library (to place replicas) and by the control plane (to map a stuck
rank to the parallel group it shares with others). It is pure Python.
"""

from __future__ import annotations

import functools
import math
from array import array
from dataclasses import dataclass

from trainguard.core.errors import TopologyError

GROUP_KINDS = ("tp", "pp", "dp")
#: backup candidates looked at per rank (the diagonal shifts find safe ones within the first few)
MAX_BACKUP_CANDIDATES = 16


@dataclass(frozen=True)
class RankCoords:
    """Where one rank sits: its index inside its TP group, its pipeline stage, its DP replica."""

    tp: int
    pp: int
    dp: int


@dataclass(frozen=True)
class Topology:
    """A tensor x pipeline x data parallel layout.

    Attributes:
        tp: tensor-parallel degree (ranks that split each layer's matrices).
        pp: pipeline-parallel degree (stages the layers are split into).
        dp: data-parallel degree (replicas of the whole pipeline).
        ranks_per_machine: ranks started on each machine (torchrun's
            ``--nproc-per-node``). Defaults to ``tp``.
    """

    tp: int
    pp: int
    dp: int
    ranks_per_machine: int = 0

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "dp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise TopologyError(f"topology {name}={value!r} must be a positive integer")
        if self.ranks_per_machine == 0:
            object.__setattr__(self, "ranks_per_machine", self.tp)
        rpm = self.ranks_per_machine
        if not isinstance(rpm, int) or rpm < 1:
            raise TopologyError(f"ranks_per_machine={rpm!r} must be a positive integer")
        if self.world_size % rpm:
            raise TopologyError(
                f"topology TP={self.tp} PP={self.pp} DP={self.dp} has {self.world_size} ranks, "
                f"which do not fill machines of {rpm} ranks; choose degrees whose product "
                f"is a multiple of {rpm}"
            )

    @classmethod
    def for_machines(cls, *, machines: int, ranks_per_machine: int, tp: int, pp: int) -> Topology:
        """The layout that fills ``machines`` x ``ranks_per_machine`` ranks with the given TP and PP.

        DP is whatever is left; a layout that does not divide the ranks is refused.
        """
        if machines < 1 or ranks_per_machine < 1:
            raise TopologyError(
                f"need at least one machine and one rank per machine, got "
                f"{machines} machines x {ranks_per_machine} ranks"
            )
        world = machines * ranks_per_machine
        if tp < 1 or pp < 1 or world % (tp * pp):
            raise TopologyError(
                f"TP={tp} x PP={pp} does not divide the {world} ranks of {machines} machines x "
                f"{ranks_per_machine} ranks; pick TP and PP whose product divides {world}"
            )
        return cls(tp=tp, pp=pp, dp=world // (tp * pp), ranks_per_machine=ranks_per_machine)

    @classmethod
    def parse(cls, text: str, *, ranks_per_machine: int = 0) -> Topology:
        """Parse ``"tp=2,pp=2,dp=2"`` (the order of the parts does not matter)."""
        parts: dict[str, int] = {}
        for item in text.split(","):
            key, sep, value = item.strip().partition("=")
            key = key.strip().lower()
            if not sep or key not in GROUP_KINDS or key in parts:
                raise TopologyError(
                    f"cannot read topology {text!r}; write it as tp=N,pp=N,dp=N"
                )
            try:
                parts[key] = int(value)
            except ValueError:
                raise TopologyError(
                    f"topology {key}={value!r} is not a whole number; write it as tp=N,pp=N,dp=N"
                ) from None
        missing = [k for k in GROUP_KINDS if k not in parts]
        if missing:
            raise TopologyError(f"topology {text!r} lacks {', '.join(missing)}; write it as tp=N,pp=N,dp=N")
        return cls(ranks_per_machine=ranks_per_machine, **parts)

    def __str__(self) -> str:
        return f"tp={self.tp},pp={self.pp},dp={self.dp}"

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    @property
    def machines(self) -> int:
        return self.world_size // self.ranks_per_machine

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise TopologyError(f"rank {rank} is outside 0..{self.world_size - 1} of topology {self}")

    def coords(self, rank: int) -> RankCoords:
        self._check_rank(rank)
        tp_index = rank % self.tp
        pp_index = (rank // self.tp) % self.pp
        dp_index = rank // (self.tp * self.pp)
        return RankCoords(tp=tp_index, pp=pp_index, dp=dp_index)

    def rank_of(self, *, tp: int, pp: int, dp: int) -> int:
        if not (0 <= tp < self.tp and 0 <= pp < self.pp and 0 <= dp < self.dp):
            raise TopologyError(f"coordinates tp={tp},pp={pp},dp={dp} are outside topology {self}")
        return (dp * self.pp + pp) * self.tp + tp

    def group(self, kind: str, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s group of ``kind`` ("tp", "pp" or "dp"), in order (O(group size))."""
        c = self.coords(rank)
        start, stride, count = self._progression(kind, c)
        return tuple(range(start, start + stride * count, stride))

    def _progression(self, kind: str, c: RankCoords) -> tuple[int, int, int]:
        """The group of ``kind`` holding the rank at ``c`` as an arithmetic progression of ranks:
        ``(first rank, stride, members)``."""
        if kind == "tp":
            return (c.dp * self.pp + c.pp) * self.tp, 1, self.tp
        if kind == "pp":
            return c.dp * self.pp * self.tp + c.tp, self.tp, self.pp
        if kind == "dp":
            return c.pp * self.tp + c.tp, self.tp * self.pp, self.dp
        raise TopologyError(f"unknown group kind {kind!r}; use one of {', '.join(GROUP_KINDS)}")

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of ``kind``, in a fixed order that all ranks agree on: ordered by their lowest rank,
        each group's ranks ascending (O(world size))."""
        tp, pp, world = self.tp, self.pp, self.world_size
        if kind == "tp":
            return [tuple(range(first, first + tp)) for first in range(0, world, tp)]
        if kind == "pp":
            replica = tp * pp
            return [tuple(range(first + i, first + replica, tp)) for first in range(0, world, replica)
                    for i in range(tp)]
        if kind == "dp":
            return [tuple(range(first, world, tp * pp)) for first in range(tp * pp)]
        raise TopologyError(f"unknown group kind {kind!r}; use one of {', '.join(GROUP_KINDS)}")

    def machine_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_machine

    def ranks_on(self, machine: int) -> tuple[int, ...]:
        if not 0 <= machine < self.machines:
            raise TopologyError(f"machine index {machine} is outside 0..{self.machines - 1} of topology {self}")
        start = machine * self.ranks_per_machine
        return tuple(range(start, start + self.ranks_per_machine))

    def group_id(self, kind: str, rank: int) -> int:
        """The lowest rank of ``rank``'s group of ``kind``: equal for the members of one group, O(1)."""
        return self._progression(kind, self.coords(rank))[0]

    def machines_of_group(self, kind: str, rank: int) -> tuple[int, ...]:
        """The machine indexes that hold ``rank``'s group of ``kind``, ascending (what over-eviction removes);
        O(machines of the group)."""
        start, stride, count = self._progression(kind, self.coords(rank))
        return tuple(_machines_of_progression(start, stride, count, self.ranks_per_machine))

    def backup_rank(self, rank: int) -> int:
        """A rank that shares none of ``rank``'s TP, PP or DP groups, on another machine, and on none of the
        machines of those groups.

        The checkpoint replica of ``rank`` goes there, so no eviction the ladder makes by itself (one
        machine, or the machines of any one parallel group it over-evicts) takes both copies. When no rank is
        off every group's machines (a group that spans every machine), the machines of the smaller groups
        are avoided first; among equally safe choices each rank gets a different backup where it can (the
        replicas' load spread evenly). With a single degree > 1 (pure DP, pure PP ...) no rank off its
        groups exists; then the nearest rank on the next machine is used, which still survives the loss of
        one machine. Every rank computes the same placement. The whole placement is computed once per
        layout (linear in the ranks) and cached.
        """
        self._check_placement(rank)
        return _replica_placement(self).backups[rank]

    def backed_up_by(self, rank: int) -> tuple[int, ...]:
        """The ranks whose checkpoint replica ``rank`` holds (those whose :meth:`backup_rank` is ``rank``),
        ascending; the inverse of :meth:`backup_rank`, from the same cached placement."""
        self._check_placement(rank)
        return _replica_placement(self).backed_up_by(rank)

    def _check_placement(self, rank: int) -> None:
        self._check_rank(rank)
        if self.machines < 2:
            raise TopologyError(
                f"topology {self} runs on one machine; a checkpoint replica needs a second machine"
            )


def clear_layout_caches() -> None:
    """Forget every cached replica placement, as a fresh process starts (measurements and tests)."""
    _replica_placement.cache_clear()


def _machines_of_progression(start: int, stride: int, count: int, ranks_per_machine: int,
                             ) -> range | tuple[int, ...]:
    """The machines, ascending and distinct, of the ranks ``start, start + stride, ...`` (``count`` of
    them): a ``range`` where they are evenly spaced (the usual layouts), else a tuple."""
    first = start // ranks_per_machine
    if stride < ranks_per_machine:  # consecutive members are on the same or the next machine: no gaps
        return range(first, (start + stride * (count - 1)) // ranks_per_machine + 1)
    if stride % ranks_per_machine == 0:  # each member a whole number of machines after the one before
        step = stride // ranks_per_machine
        return range(first, first + step * count, step)
    return tuple(r // ranks_per_machine for r in range(start, start + stride * count, stride))


@functools.lru_cache(maxsize=64)
def _replica_placement(topo: Topology) -> _Placement:
    """Every rank's backup rank (:meth:`Topology.backup_rank`) and, per rank, the ranks it backs up.

    Backups are chosen in rank order: the safest candidate not yet holding a replica, else the safest.
    A rank's candidates are met along the diagonal ``(tp + s, pp + s, dp + s)`` for shifts ``s = 1, 2, ...``
    (each degree's index modulo the degree), skipping ranks on its own machine or in one of its groups, until
    :data:`MAX_BACKUP_CANDIDATES` are found or 4 of them are safe (on none of its groups' machines). A
    candidate's exposure lists, for the rank's groups from the one on fewest machines to the one on most
    (ties in the order TP, PP, DP), whether the candidate's machine is one of that group's; the safest
    candidate has the smallest exposure, ties going to the candidate met first. With no candidate at all,
    the backup is the same local slot on the next machine.

    Linear in the ranks: whether a shift lands in one of the rank's groups depends on the shift alone (those
    shifts are dropped once for all ranks); the diagonal repeats after ``lcm(tp, pp, dp)`` shifts, so the
    candidates met are distinct and at most ``ranks_per_machine - 1`` of them share the rank's machine: a
    rank looks at no more than ``ranks_per_machine - 1 + MAX_BACKUP_CANDIDATES`` shifts. Each group's
    machines are computed once.
    """
    tp, pp, dp, rpm, world = topo.tp, topo.pp, topo.dp, topo.ranks_per_machine, topo.world_size
    # a shift's candidate shares one of the rank's groups when it leaves two of the three indexes unchanged
    shifts = [s for s in range(1, math.lcm(tp, pp, dp)) if (s % tp == 0) + (s % pp == 0) + (s % dp == 0) < 2]
    # each group's machines (membership in O(1)): TP groups by rank // tp, PP groups by dp * tp + tp index,
    # DP groups by pp * tp + tp index
    tp_spans = [_span(g * tp, 1, tp, rpm) for g in range(world // tp)]
    pp_spans = [_span(c * pp * tp + a, tp, pp, rpm) for c in range(dp) for a in range(tp)]
    dp_spans = [_span(b * tp + a, tp * pp, dp, rpm) for b in range(pp) for a in range(tp)]
    backups: list[int] = []
    used = bytearray(world)  # 1: the rank holds a replica already
    for rank in range(world):
        a, q = rank % tp, rank // tp
        b, c = q % pp, q // pp
        own = rank // rpm
        span0, span1, span2 = sorted((tp_spans[q], pp_spans[c * tp + a], dp_spans[b * tp + a]), key=len)
        best = 8  # above every exposure (as bits, the first group's the most significant)
        safest = choice = -1  # the first candidate of the best exposure met; the first of them not in use
        found = safe = 0
        for s in shifts:
            candidate = (((c + s) % dp) * pp + (b + s) % pp) * tp + (a + s) % tp
            machine = candidate // rpm
            if machine == own:
                continue
            exposure = (machine in span0) * 4 + (machine in span1) * 2 + (machine in span2)
            found += 1
            if exposure < best:
                best, safest, choice = exposure, candidate, (-1 if used[candidate] else candidate)
            elif exposure == best and choice < 0 and not used[candidate]:
                choice = candidate
            if not exposure:
                if choice >= 0:  # a safe candidate not in use: no later candidate can be chosen over it
                    break
                safe += 1
            if found >= MAX_BACKUP_CANDIDATES or safe >= 4:
                break
        if not found:  # no fully disjoint rank: the same local slot on the next machine
            backups.append((own + 1) % topo.machines * rpm + rank % rpm)
            continue
        choice = choice if choice >= 0 else safest
        used[choice] = 1
        backups.append(choice)
    return _Placement(backups)


def _span(start: int, stride: int, count: int, ranks_per_machine: int) -> range | frozenset[int]:
    """The machines of a progression of ranks (:func:`_machines_of_progression`), with O(1) membership."""
    span = _machines_of_progression(start, stride, count, ranks_per_machine)
    return span if isinstance(span, range) else frozenset(span)


class _Placement:
    """A layout's replica placement in compact arrays: each rank's backup, and the inverse (the ranks that
    each rank backs up, ascending, as one array ordered by backup with each rank's offset into it)."""

    def __init__(self, backups: list[int]) -> None:
        world = len(backups)
        self.backups = array("q", backups)
        starts = [0] * (world + 1)
        for backup in backups:
            starts[backup + 1] += 1
        for rank in range(world):
            starts[rank + 1] += starts[rank]
        sources = array("q", [0]) * world
        free = starts[:-1]  # where each rank's next source goes
        for rank, backup in enumerate(backups):  # in rank order: each rank's sources ascending
            sources[free[backup]] = rank
            free[backup] += 1
        self.starts = array("q", starts)
        self.sources = sources

    def backed_up_by(self, rank: int) -> tuple[int, ...]:
        return tuple(self.sources[self.starts[rank]:self.starts[rank + 1]])
