"""Runtime analysis of a hung or slow job: whose stack differs, and which parallel group to evict.

Input: ``tg-node stacks`` documents of every machine of the job (each rank's main-thread frames, and
its collective counters from the heartbeat). Each rank's stack becomes a normalised signature
(:func:`trainguard.node_tools.stacks.stack_signature`: function and file names, no lines or addresses); the
signatures are grouped by their sets of frames (stacks through the same functions in another order or
depth merge, a function only some ranks are in stands apart: what DBSCAN over the frame sets with Jaccard
distance ``eps`` 0 computes, found with dicts in time linear in the ranks). The largest group is
the healthy behaviour (1,000 ranks waiting in the same all-reduce); ranks in minority groups are the
outliers, and so are ranks whose collective counters lag behind the rest (a rank stuck before a
collective the others already entered). A rank whose stack could not be taken at all is an outlier too.

Outliers are mapped to the smallest parallel group that holds them all: the TP group (one machine),
else the PP group (one pipeline, every stage of a data-parallel replica), else the DP group; the
machines of that group are evicted together (found in time linear in the ranks, however many are
outliers). ByteRobust over-evicts this way on purpose: a whole group costs little next to a thousand GPUs
waiting for a precise diagnosis, and the checkpoint's backup placement (no rank's replica inside its own
TP, PP or DP group) means no state is lost.

Fail-slow (``rank_slow``): :class:`SlowVoter` gathers rounds (every 10 s, 5 rounds) of each rank's compute
time (its step time less the time it waited in collectives: in a synchronous job every rank's step takes
as long as the straggler's, but the straggler is the one that waits least); each round flags the ranks
well above their stage's median; the smallest group holding the ranks flagged in at least half of the
rounds is evicted. A slowdown every rank shares (load on the hosts, a slow file system) flags nobody, and one
that passes within the rounds is transient: nothing is evicted.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.topology import Topology
from trainguard.node_tools.stacks import stack_signature

STACK_DEPTH = 12
GROUP_ORDER = ("tp", "pp", "dp")
MISSING = "<no stack>"


@dataclass(frozen=True)
class RankStack:
    rank: int
    machine: str
    signature: str
    collectives: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Analysis:
    groups: list[list[int]]  # ranks grouped by identical stacks, largest first
    outliers: list[int]
    reasons: dict[int, str]
    group_kind: str  # tp, pp, dp, or "" when no single group holds the outliers
    evict_ranks: list[int]  # every rank on the machines to evict
    evict_machines: list[int]  # machine indices (node ranks) in the job


def _main_thread(process: Mapping[str, Any]) -> list[dict[str, Any]]:
    threads = process.get("threads") or []
    for t in threads:
        if t.get("name") == "MainThread" or t.get("main"):
            return list(t.get("frames") or [])
    return list(threads[0].get("frames") or []) if threads else []


def rank_stacks(documents: Mapping[str, Mapping[str, Any]], world_size: int,
                machine_of_rank: Mapping[int, str]) -> list[RankStack]:
    """One :class:`RankStack` per rank of the job from ``tg-node stacks`` documents by machine name;
    ranks of unreachable machines or failed dumps get the signature :data:`MISSING`."""
    found: dict[int, RankStack] = {}
    for machine, doc in documents.items():
        if not isinstance(doc, Mapping):
            continue
        counters = doc.get("collectives") or {}
        for p in doc.get("processes") or []:
            if p.get("role") != "rank" or not isinstance(p.get("rank"), int):
                continue
            frames = _main_thread(p)
            sig = stack_signature(frames, depth=STACK_DEPTH) if frames and not p.get("error") else MISSING
            coll = counters.get(str(p["rank"])) or {}
            started = {g: int(c.get("started", 0)) for g, c in coll.items()
                       if isinstance(c, (dict, Mapping))}  # a dict without the ABC's slow check
            found[p["rank"]] = RankStack(p["rank"], machine, sig, started)
    return [found.get(r) or RankStack(r, machine_of_rank.get(r, "?"), MISSING) for r in range(world_size)]


def process_states(documents: Mapping[str, Mapping[str, Any]]) -> dict[int, str]:
    """Each rank's process state as the stacks documents saw it (``T``: stopped; missing: not seen)."""
    out: dict[int, str] = {}
    for doc in documents.values():
        if not isinstance(doc, Mapping):
            continue
        for p in doc.get("processes") or []:
            if p.get("role") == "rank" and isinstance(p.get("rank"), int):
                out[p["rank"]] = str(p.get("process_state") or "")
    return out


def confirmed_stopped(claimed: Sequence[int], documents: Mapping[str, Mapping[str, Any]]) -> list[int]:
    """The ranks the alerts call stopped whose process the stacks saw stopped (state ``T``) or could not find
    at all: a claim the process contradicts (it runs, its stack is taken) is not proof."""
    states = process_states(documents)
    return sorted(r for r in claimed if states.get(r, "") in ("T", "t", "", "gone"))


def group_stacks(signatures: Sequence[str]) -> list[int]:
    """Group labels for ``signatures``: equal signatures share a label (a dict), then distinct ones through
    the same set of frames merge (:func:`merge_signatures`). Labels are dense, from 0, in the order each
    group is first seen; time linear in the signatures, however many are distinct."""
    exact: dict[str, int] = {}
    labels = [exact.setdefault(sig, len(exact)) for sig in signatures]
    if len(exact) < 2:
        return labels
    merged = merge_signatures(list(exact))
    return [merged[label] for label in labels]


def merge_signatures(distinct: Sequence[str]) -> list[int]:
    """A label per signature: signatures through the same set of frames share one, so signatures that call
    the same functions and differ only in their order or in how often a frame repeats (a recursion's depth,
    a re-entered wrapper) merge, and a function only some of them are in keeps them apart.

    This is exactly DBSCAN over each signature's set of frames (one-hot, Jaccard distance, ``eps`` 1e-9,
    ``min_samples`` 1): a Jaccard distance below ``eps`` means equal sets (two different sets are at least
    1 / (frames in their union) apart), every signature is a core point, so the clusters are the classes of
    equal frame sets, labelled in the order of their first member; a dict keyed by the set finds them in
    linear time where the distances were quadratic in the distinct signatures. Labels are dense, from 0."""
    by_frames: dict[frozenset[str], int] = {}
    return [by_frames.setdefault(frozenset(sig.split(" < ")), len(by_frames)) for sig in distinct]


def _lagging(stacks: Sequence[RankStack]) -> dict[int, str]:
    """Ranks whose started-collective count on some group is below that group's most common count."""
    out: dict[int, str] = {}
    kinds = {g for s in stacks for g in s.collectives}
    for g in sorted(kinds):
        counts = Counter(s.collectives[g] for s in stacks if g in s.collectives)
        if len(counts) < 2:
            continue
        top = max(counts.values())
        common = max(c for c, n in counts.items() if n == top)
        for s in stacks:
            if g in s.collectives and s.collectives[g] < common:
                out[s.rank] = f"{g} collectives started {s.collectives[g]} < {common} of the others"
    return out


def smallest_group(topo: Topology, ranks: Sequence[int], kinds: Sequence[str] = GROUP_ORDER
                   ) -> tuple[str, list[int]]:
    """The kind and machine indices of the smallest parallel group (of ``kinds``, in order) whose
    machines hold every rank in ``ranks``: the TP group (the machine), else the PP group (every stage of
    one pipeline), else the DP group; ("", the ranks' own machines) when no single group holds them all.
    Of several groups of one kind that hold them, the one of the lowest rank in ``ranks``.

    Time linear in the job's ranks however many ``ranks`` there are: each distinct group of the ranks is
    looked at once (the groups of one kind are disjoint), and a kind whose groups have fewer ranks than
    there are machines to hold is passed over."""
    ranks = sorted(set(ranks))
    needed = {topo.machine_of(r) for r in ranks}
    for kind in kinds if ranks else ():
        size = {"tp": topo.tp, "pp": topo.pp, "dp": topo.dp}.get(kind)
        if size is not None and size < len(needed):
            continue  # a group of `size` ranks is on at most `size` machines
        looked_at: set[int] = set()
        for r in ranks:  # any rank's group of this kind may be the one holding all of them
            group = topo.group_id(kind, r)
            if group in looked_at:
                continue
            looked_at.add(group)
            machines = set(topo.machines_of_group(kind, r))
            if needed <= machines:
                return kind, sorted(machines)
    return "", sorted(needed)


def analyze(topo: Topology, stacks: Sequence[RankStack], *, named: Sequence[int] = (),
            kinds: Sequence[str] = GROUP_ORDER, stopped: Sequence[int] = ()) -> Analysis:
    """Group the stacks, find the outliers, and the parallel group to evict.

    ``named``: ranks the alerts single out (a rank whose process is stopped, the first rank to stall);
    when the outliers do not fit one group of ``kinds`` (with few ranks, healthy ranks also wait in
    different collectives), the group is the one holding the named ranks among them. ``stopped``: ranks
    whose process the alerts saw stopped: that is proof, not a symptom, so the group is the smallest one
    holding them whatever the other stacks show (which of their peers stand out depends on when the stacks
    were taken: a peer still on its way into the collective it will wait in). ``kinds``: the group kinds
    eviction may choose, smallest first (a hang over-evicts at least a pipeline: ``("pp", "dp")``)."""
    labels = group_stacks([s.signature for s in stacks])
    members: dict[int, list[int]] = {}
    for s, label in zip(stacks, labels, strict=True):
        members.setdefault(label, []).append(s.rank)
    groups = sorted(members.values(), key=lambda g: (-len(g), g))
    reasons: dict[int, str] = {}
    if len(groups) > 1 and len(groups[0]) > len(groups[1]):  # a clear majority behaviour
        in_majority = set(groups[0])
        majority = next(s.signature for s in stacks if s.rank in in_majority)
        for s in stacks:
            if s.rank not in in_majority:
                reasons[s.rank] = "no stack could be taken" if s.signature == MISSING else \
                    f"stack differs from the {len(groups[0])} others' ({s.signature[:160]} vs {majority[:160]})"
    for s in stacks:
        if s.signature == MISSING and s.rank not in reasons:
            reasons[s.rank] = "no stack could be taken"
    for rank, why in _lagging(stacks).items():
        reasons.setdefault(rank, why)
    if stopped:
        for r in stopped:
            reasons[r] = "its process is stopped (the alerts)"
        kind, machines = smallest_group(topo, stopped, kinds)
        return Analysis(groups, sorted(reasons), reasons, kind,
                        sorted(r for m in machines for r in topo.ranks_on(m)), machines)
    outliers = sorted(reasons)
    if not outliers and not named:
        return Analysis(groups, [], {}, "", [], [])
    kind, machines = smallest_group(topo, outliers, kinds) if outliers else ("", [])
    if not kind and named:
        suspects = sorted(set(named) & set(outliers)) or sorted(set(named))
        for r in suspects:
            reasons.setdefault(r, "named by the alerts (stopped or first to stall)")
        kind, machines = smallest_group(topo, suspects, kinds)
        outliers = sorted(reasons)
    return Analysis(groups, outliers, reasons, kind, sorted(r for m in machines for r in topo.ranks_on(m)), machines)


#: how many standard errors of a rank's recent compute time it must stand above its stage's median to be flagged
NOISE_SIGMAS = 4.0
#: the least excess that flags a rank, as a share of the job's step (the median of its ranks' recent step times): a
#: floor under the factor and the noise rules for differences below the timers' and the scheduler's grain (a tenth
#: of a millisecond in a 7 ms step). Kept small because the compared figure is a rank's local part of its step (up
#: to its first forward's end), a fraction of the step: a 30% straggler's excess there is 30% of that fraction
MIN_STEP_SHARE = 0.02


def stall_passed(steps: Mapping[str, Any], alerted: Iterable[Any], world_size: int) -> int | None:
    """The step every rank of the job has finished past the stall its hang alerts reported (``steps``: each rank's
    step as the stacks' documents read it, ``{"rank": step}``; ``alerted``: the steps the alerts' evidence gave),
    or None while any rank was not seen or has not moved past it: a pause of the program's own (a first evaluation
    or save outside a step, a data loader starting its workers) that outlasted the agents' floor and passed before
    the analysis looked. A hang never passes: its stalled rank stays on its step."""
    stalled = [int(s) for s in alerted if isinstance(s, int) and not isinstance(s, bool)]
    if not stalled or world_size < 1:
        return None
    now = []
    for r in range(world_size):
        s = steps.get(str(r))
        if not isinstance(s, int) or isinstance(s, bool):
            return None
        now.append(s)
    return min(now) if min(now) > max(stalled) else None


def _median(values: Iterable[float]) -> float:
    """The lower median: with half the ranks slow (a whole machine of a small stage), still a normal one."""
    ordered = sorted(values)
    return ordered[(len(ordered) - 1) // 2]


@dataclass
class SlowVoter:
    """Fail-slow localisation over rounds: each round flags the ranks well above their stage's median;
    after ``rounds`` rounds, the ranks flagged in at least half of them are the persistent stragglers,
    and the smallest parallel group holding them all is the one to evict. A rank flagged now and then
    (noise on a loaded host) splits no vote: it simply does not persist."""

    topo: Topology
    rounds: int = 5
    votes: Counter[int] = field(default_factory=Counter)  # rank -> rounds it was flagged in
    seen: int = 0
    _stage: dict[int, int] = field(default_factory=dict, init=False, repr=False, compare=False)  # rank -> pp

    def add_round(self, step_times: Mapping[int, float], *, factor: float = 1.5,
                  noise: Mapping[int, float] | None = None, walls: Mapping[int, float] | None = None) -> list[int]:
        """Vote with one round of per-rank recent compute times; returns the ranks flagged this round.

        A rank is compared with the ranks doing the same work, those of its pipeline stage (the last
        stage also computes the loss, the first the embeddings: stages differ by design); a stage with
        fewer than three ranks reported is compared with the whole job. It is flagged when its time is above
        ``factor`` times that median and, where ``noise`` says how noisy each rank's figure is (the standard error
        of its recent steps' median, seconds), also :data:`NOISE_SIGMAS` times that noise (its own, or its stage's
        median noise if larger) above the median: on a busy host a healthy job's ranks differ by more than any
        fixed factor from one round to the next (a vote named a healthy machine in 3 of 5 rounds at 1.25x), by
        far less than a straggler over a few seconds of steps. Where ``walls`` gives the ranks' recent step times
        (seconds, their median), the excess must also reach :data:`MIN_STEP_SHARE` of the job's step (their
        median). Time linear in the ranks (and a sort per stage); each rank's stage is worked out once per voter."""
        if not step_times:
            return []
        everyone = _median(step_times.values())
        stage_of = self._stage
        for r in step_times:
            if r not in stage_of:
                stage_of[r] = self.topo.coords(r).pp
        stages: dict[int, list[float]] = {}
        for r, t in step_times.items():
            stages.setdefault(stage_of[r], []).append(t)
        # one median per stage per round (a median per rank would be quadratic in the job's ranks)
        base = {pp: _median(peers) if len(peers) >= 3 else everyone for pp, peers in stages.items()}
        noise = {r: n for r, n in (noise or {}).items() if r in step_times and n >= 0}
        typical: dict[int, float] = {}
        if noise:
            by_stage: dict[int, list[float]] = {}
            for r, n in noise.items():
                by_stage.setdefault(stage_of[r], []).append(n)
            overall = statistics.median(noise.values())
            typical = {pp: statistics.median(by_stage[pp]) if len(by_stage.get(pp, [])) >= 3 else overall
                       for pp in stages}
        step = [w for w in (walls or {}).values() if w > 0]
        least = MIN_STEP_SHARE * _median(step) if step else 0.0
        slow = []
        for r, t in step_times.items():
            pp = stage_of[r]
            if t <= factor * base[pp] or t - base[pp] < least:
                continue
            if noise and t - base[pp] <= NOISE_SIGMAS * max(noise.get(r, 0.0), typical.get(pp, 0.0)):
                continue  # above the factor, but within what this round's noise makes of a healthy rank
            slow.append(r)
        self.seen += 1
        self.votes.update(slow)
        return sorted(slow)

    @property
    def done(self) -> bool:
        return self.seen >= self.rounds

    def persistent(self, min_share: float = 0.5) -> list[int]:
        """Ranks flagged in at least ``min_share`` of the rounds seen."""
        return sorted(r for r, n in self.votes.items() if n >= min_share * max(self.seen, 1))

    def verdict(self, min_share: float = 0.5) -> tuple[str, list[int]] | None:
        """The smallest group holding every persistent straggler, as (kind, machine indices), or None
        when no rank was flagged in at least ``min_share`` of the rounds (a passing slowdown), or when
        the stragglers fit no single parallel group even counting only those flagged in every round: a
        slowdown spread over unrelated machines is shared (load, the network), not a straggler, and
        evicting all of them is no answer (over-eviction stays within one group)."""
        stragglers = self.persistent(min_share)
        if not stragglers:
            return None
        kind, machines = smallest_group(self.topo, stragglers)
        if kind:
            return kind, list(machines)
        always = [r for r in stragglers if self.votes[r] >= self.seen]
        kind, machines = smallest_group(self.topo, always) if always else ("", [])
        return (kind, list(machines)) if kind else None
