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
from dataclasses import dataclass

from node_tools.errors import TopologyError

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
        """The ranks of ``rank``'s group of ``kind`` ("tp", "pp" or "dp"), in order."""
        c = self.coords(rank)
        if kind == "tp":
            return tuple(self.rank_of(tp=i, pp=c.pp, dp=c.dp) for i in range(self.tp))
        if kind == "pp":
            return tuple(self.rank_of(tp=c.tp, pp=i, dp=c.dp) for i in range(self.pp))
        if kind == "dp":
            return tuple(self.rank_of(tp=c.tp, pp=c.pp, dp=i) for i in range(self.dp))
        raise TopologyError(f"unknown group kind {kind!r}; use one of {', '.join(GROUP_KINDS)}")

    def groups(self, kind: str) -> list[tuple[int, ...]]:
        """Every group of ``kind``, in a fixed order that all ranks agree on."""
        seen: dict[tuple[int, ...], None] = {}
        for rank in range(self.world_size):
            seen.setdefault(self.group(kind, rank), None)
        return list(seen)

    def machine_of(self, rank: int) -> int:
        self._check_rank(rank)
        return rank // self.ranks_per_machine

    def ranks_on(self, machine: int) -> tuple[int, ...]:
        if not 0 <= machine < self.machines:
            raise TopologyError(f"machine index {machine} is outside 0..{self.machines - 1} of topology {self}")
        start = machine * self.ranks_per_machine
        return tuple(range(start, start + self.ranks_per_machine))

    def machines_of_group(self, kind: str, rank: int) -> tuple[int, ...]:
        """The machine indexes that hold ``rank``'s group of ``kind`` (what over-eviction removes)."""
        return tuple(sorted({self.machine_of(r) for r in self.group(kind, rank)}))

    def backup_rank(self, rank: int) -> int:
        """A rank that shares none of ``rank``'s TP, PP or DP groups, on another machine, and on none of the
        machines of those groups.

        The checkpoint replica of ``rank`` goes there, so no eviction the ladder makes by itself (one
        machine, or the machines of any one parallel group it over-evicts) takes both copies. When no rank is
        off every group's machines (a group that spans every machine), the machines of the smaller groups
        are avoided first; among equally safe choices each rank gets a different backup where it can (the
        replicas' load spread evenly). With a single degree > 1 (pure DP, pure PP ...) no rank off its
        groups exists; then the nearest rank on the next machine is used, which still survives the loss of
        one machine. Every rank computes the same placement.
        """
        self._check_rank(rank)
        if self.machines < 2:
            raise TopologyError(
                f"topology {self} runs on one machine; a checkpoint replica needs a second machine"
            )
        return _backups(self)[rank]

    def _backup_candidates(self, rank: int) -> list[tuple[tuple[int, ...], int]]:
        """Ranks that may back ``rank`` up, each with its exposure (for each of ``rank``'s groups, smallest
        first: 1 when the candidate sits on one of that group's machines), safest first (see
        :meth:`backup_rank`)."""
        c = self.coords(rank)
        own_groups = [set(self.group(kind, rank)) for kind in GROUP_KINDS]
        own_machine = self.machine_of(rank)
        spans = sorted(({r // self.ranks_per_machine for r in members} for members in own_groups), key=len)
        found: list[tuple[tuple[int, ...], int, int]] = []
        seen: set[int] = set()
        for shift in range(1, self.world_size):
            candidate = self.rank_of(
                tp=(c.tp + shift) % self.tp, pp=(c.pp + shift) % self.pp, dp=(c.dp + shift) % self.dp
            )
            machine = candidate // self.ranks_per_machine
            if machine == own_machine or candidate in seen or any(candidate in members for members in own_groups):
                continue
            seen.add(candidate)
            exposure = tuple(int(machine in span) for span in spans)
            found.append((exposure, len(found), candidate))
            safe = sum(1 for e, _i, _c in found if not any(e))
            if len(found) >= MAX_BACKUP_CANDIDATES or safe >= 4:  # linear in the ranks, not quadratic
                break
        return [(exposure, cand) for exposure, _i, cand in sorted(found)]


@functools.lru_cache(maxsize=64)
def _backups(topo: Topology) -> tuple[int, ...]:
    """Every rank's backup rank (:meth:`Topology.backup_rank`), chosen in rank order: the safest candidate
    not yet holding a replica, else the safest."""
    out: list[int] = []
    used: set[int] = set()
    for rank in range(topo.world_size):
        candidates = topo._backup_candidates(rank)
        if not candidates:  # no fully disjoint rank: the same local slot on the next machine
            next_machine = (topo.machine_of(rank) + 1) % topo.machines
            out.append(next_machine * topo.ranks_per_machine + rank % topo.ranks_per_machine)
            continue
        best = candidates[0][0]
        choice = next((cand for exposure, cand in candidates if exposure == best and cand not in used),
                      candidates[0][1])
        used.add(choice)
        out.append(choice)
    return tuple(out)
