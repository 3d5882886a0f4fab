"""The runtime analysis at fleet scale: the grouping of stacks is DBSCAN's, the parallel group chosen for
thousands of outliers is the one the per-rank definition chooses, and the work stays linear in the ranks."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence, Set
from typing import ClassVar

import pytest

from trainguard.core.topology import Topology
from trainguard.node_tools.stacks import stack_signature
from trainguard.operators.policy import runtime

FRAMES = [f"f{i} (m{i % 3}.py)" for i in range(9)]


def dbscan_labels(distinct: Sequence[str]) -> list[int]:
    """The definition: DBSCAN over each signature's one-hot set of frames, Jaccard distance, eps 1e-9,
    min_samples 1, labels made dense in the order they are first seen."""
    from sklearn.cluster import DBSCAN
    from sklearn.feature_extraction import DictVectorizer

    rows = [dict.fromkeys(sig.split(" < "), 1) for sig in distinct]
    vectors = DictVectorizer(sparse=False).fit_transform(rows) > 0
    raw = DBSCAN(eps=1e-9, min_samples=1, metric="jaccard").fit_predict(vectors)
    dense: dict[int, int] = {}
    return [dense.setdefault(int(x), len(dense)) for x in raw]


def per_rank_smallest_group(topo: Topology, ranks: Sequence[int], kinds: Sequence[str]) -> tuple[str, list[int]]:
    """The definition: every rank's group of each kind in turn, the first whose machines hold them all."""
    ranks = sorted(set(ranks))
    needed = {topo.machine_of(r) for r in ranks}
    for kind in kinds:
        for r in ranks:
            machines = set(topo.machines_of_group(kind, r))
            if needed <= machines:
                return kind, sorted(machines)
    return "", sorted(needed)


def random_signature(rng: random.Random) -> str:
    """A stack of 1-6 frames from a small vocabulary: reorderings, repeats (recursion) and missing stacks."""
    if rng.random() < 0.05:
        return runtime.MISSING
    return " < ".join(rng.choice(FRAMES[:rng.randint(1, len(FRAMES))]) for _ in range(rng.randint(1, 6)))


@pytest.mark.parametrize("seed", range(40))
def test_grouping_by_frame_sets_is_dbscans_grouping(seed):
    rng = random.Random(seed)
    distinct = list(dict.fromkeys(random_signature(rng) for _ in range(rng.randint(2, 60))))
    assert runtime.merge_signatures(distinct) == dbscan_labels(distinct)
    signatures = [rng.choice(distinct) for _ in range(200)]
    exact = list(dict.fromkeys(signatures))
    merged = dbscan_labels(exact) if len(exact) > 1 else [0]
    assert runtime.group_stacks(signatures) == [merged[exact.index(s)] for s in signatures]


def test_thousands_of_distinct_stacks_group_as_dbscan_does():
    """A rank id in a function's name makes every rank's stack its own; a recursion's depth does not."""
    waiting = "wait (c10d.py) < all_reduce (c10d.py) < step (train.py)"
    own = [f"_fused_rank{r} (<generated>) < step (train.py)" for r in range(1_500)]
    deeper = [" < ".join(["walk (tree.py)"] * depth + ["step (train.py)"]) for depth in range(1, 12)]
    distinct = [waiting, *own, *deeper]
    labels = runtime.merge_signatures(distinct)
    assert labels == dbscan_labels(distinct)
    assert len(set(labels)) == 1 + len(own) + 1  # every generated function apart, the recursions together


@pytest.mark.parametrize(("tp", "pp", "dp", "rpm"), [
    (2, 2, 2, 0), (4, 2, 3, 0), (2, 3, 4, 4), (4, 2, 2, 2), (1, 4, 6, 2), (2, 2, 6, 12), (8, 4, 5, 0),
])
def test_the_smallest_group_is_the_per_rank_definitions_choice(tp, pp, dp, rpm):
    topo = Topology(tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm)
    rng = random.Random(f"{tp}{pp}{dp}{rpm}")
    orders = [("tp", "pp", "dp"), ("pp", "dp"), ("dp",), ("dp", "pp", "tp")]
    picks = [[rng.randrange(topo.world_size) for _ in range(rng.randint(1, 6))] for _ in range(150)]
    picks += [list(topo.group(kind, r)) for kind in ("tp", "pp", "dp") for r in range(0, topo.world_size, 3)]
    picks += [[], list(range(topo.world_size))]
    for ranks in picks:
        for kinds in orders:
            assert runtime.smallest_group(topo, ranks, kinds) == per_rank_smallest_group(topo, ranks, kinds)


class CountingTopology(Topology):
    """A real topology that counts its per-rank lookups (coords, rank_of, machine_of)."""

    lookups: ClassVar[Counter[str]] = Counter()

    def coords(self, rank):
        self.lookups["coords"] += 1
        return super().coords(rank)

    def rank_of(self, *, tp, pp, dp):
        self.lookups["rank_of"] += 1
        return super().rank_of(tp=tp, pp=pp, dp=dp)

    def machine_of(self, rank):
        self.lookups["machine_of"] += 1
        return super().machine_of(rank)


BIG = CountingTopology(tp=8, pp=8, dp=200, ranks_per_machine=8)  # 12,800 ranks on 1,600 machines
WAIT = [{"name": "wait", "filename": "/x/torch/distributed/distributed_c10d.py"},
        {"name": "all_reduce", "filename": "/x/torch/distributed/distributed_c10d.py"},
        {"name": "step", "filename": "/job/train.py"}]
OTHER = [{"name": "all_reduce", "filename": "/x/c10d.py"}, {"name": "grad_norm", "filename": "/job/train.py"}]


def big_documents(odd: Set[int], *, behind: Set[int] = frozenset(), unreachable: Set[int] = frozenset()) -> dict:
    """``tg-node stacks`` documents of BIG: ranks in ``odd`` in another collective, ranks in ``behind`` one
    all-reduce behind, machines in ``unreachable`` without a document."""
    docs = {}
    for m in range(BIG.machines):
        if m in unreachable:
            continue
        ranks = BIG.ranks_on(m)
        docs[f"m{m}"] = {
            "processes": [{"role": "rank", "rank": r, "process_state": "S", "error": None,
                           "threads": [{"name": "MainThread", "frames": OTHER if r in odd else WAIT}]} for r in ranks],
            "collectives": {str(r): {"dp": {"started": 40 - (r in behind)}} for r in ranks},
        }
    return docs


def analyze_big(docs: dict, named: Sequence[int] = ()) -> runtime.Analysis:
    stacks = runtime.rank_stacks(docs, BIG.world_size, {r: f"m{BIG.machine_of(r)}" for r in range(BIG.world_size)})
    BIG.lookups.clear()
    a = runtime.analyze(BIG, stacks, named=named, kinds=("pp", "dp"))
    # linear: a few lookups per rank of the job, not one group's worth per outlier (those were millions here)
    assert sum(BIG.lookups.values()) <= 4 * BIG.world_size, BIG.lookups
    return a


def machines_of(kind: str, rank: int) -> list[int]:
    return sorted({BIG.machine_of(r) for r in BIG.group(kind, rank)})


def test_a_whole_replica_without_stacks_evicts_its_pipeline():
    replica = 123
    lost = set(machines_of("pp", BIG.rank_of(tp=0, pp=0, dp=replica)))
    a = analyze_big(big_documents(set(), unreachable=lost))
    assert len(a.outliers) == 64 and a.group_kind == "pp" and a.evict_machines == sorted(lost)


def test_a_whole_stage_behind_evicts_its_data_parallel_group():
    """1,600 outliers on 200 machines: no pipeline holds them, stage 3's data-parallel group does."""
    stage = {r for r in range(BIG.world_size) if BIG.coords(r).pp == 3}
    a = analyze_big(big_documents(set(), behind=stage))
    assert a.outliers == sorted(stage) and a.group_kind == "dp"
    assert a.evict_machines == machines_of("dp", BIG.rank_of(tp=0, pp=3, dp=0))


def test_half_the_job_in_another_collective_fits_no_group_and_the_named_rank_chooses():
    half = {r for r in range(BIG.world_size) if BIG.coords(r).dp % 2 == 1 and BIG.coords(r).dp > 10}  # 95 of 200
    assert runtime.smallest_group(BIG, sorted(half), ("pp", "dp")) == ("", sorted({BIG.machine_of(r) for r in half}))
    named = BIG.rank_of(tp=5, pp=6, dp=77)
    a = analyze_big(big_documents(half), named=[named])
    assert len(a.outliers) == len(half) and a.group_kind == "pp"
    assert a.evict_machines == machines_of("pp", named)


def test_outliers_on_two_stages_that_fit_one_data_parallel_groups_size_are_checked_per_group():
    """As many machines as a data-parallel group has, yet no group holds them: each group is looked at once."""
    split = {r for r in range(BIG.world_size) if BIG.coords(r).pp == (3 if BIG.coords(r).dp < 100 else 4)}
    BIG.lookups.clear()
    assert runtime.smallest_group(BIG, sorted(split), ("pp", "dp")) == \
        per_rank_smallest_group(Topology(tp=8, pp=8, dp=200), sorted(split), ("pp", "dp"))
    assert sum(BIG.lookups.values()) <= 4 * BIG.world_size, BIG.lookups


def test_the_slow_vote_works_out_each_ranks_stage_once():
    voter = runtime.SlowVoter(BIG, rounds=5)
    slow = BIG.ranks_on(700)
    BIG.lookups.clear()
    for i in range(5):
        times = {r: 0.4 + 0.001 * (r % 7) for r in range(BIG.world_size)}
        if i != 2:
            times.update(dict.fromkeys(slow, 1.3))
        voter.add_round(times)
    assert BIG.lookups["coords"] <= BIG.world_size + 2 * len(slow)
    assert voter.verdict() == ("tp", [700])


@pytest.mark.parametrize(("name", "expected"), [
    ("step", "step (train.py)"), (1, "1 (train.py)"), (True, "True (train.py)"), (1.0, "1.0 (train.py)"),
    (None, "? (train.py)"), (["odd"], "['odd'] (train.py)"), ("at 0x7f3a", "at 0x? (train.py)"),
])
def test_signatures_of_equal_but_different_frame_names_stay_apart(name, expected):
    """Remembered frames: 1, True and 1.0 are equal keys to a dict, but not the same name."""
    assert stack_signature([{"name": name, "filename": "/job/train.py"}]) == expected


def test_a_rank_whose_excess_is_below_the_timers_grain_is_no_straggler_and_a_30_percent_one_is():
    """Two ranks of a 7 ms job: rank 0's local part is 0.13 ms against rank 1's 0.10 ms every round (a steady
    difference far below a step's 2%), beyond the measured noise: no straggler to evict. A rank whose local part
    grew 30% (a slow GPU: 1.3 ms against 1.0 ms, 4% of its now longer step) is one."""
    topo = Topology(tp=1, pp=1, dp=2)
    voter = runtime.SlowVoter(topo, rounds=1)
    walls = {0: 0.007, 1: 0.007}
    assert voter.add_round({0: 0.00013, 1: 0.00010}, factor=1.25, noise={0: 1e-7, 1: 1e-7}, walls=walls) == []
    assert voter.add_round({0: 0.00013, 1: 0.00010}, factor=1.25, noise={0: 1e-7, 1: 1e-7}) == [0]  # no walls
    slow = runtime.SlowVoter(topo, rounds=1)
    assert slow.add_round({0: 0.0010, 1: 0.0013}, factor=1.25, noise={0: 1e-6, 1: 1e-6},
                          walls={0: 0.0073, 1: 0.0073}) == [1]


@pytest.mark.parametrize(("steps", "alerted", "passed"), [
    ({"0": 12, "1": 13, "2": 12, "3": 12}, [10, 10, 11], 12),  # every rank past the newest reported step
    ({"0": 12, "1": 11, "2": 12, "3": 12}, [10, 11], None),  # rank 1 still on the step it stalled at
    ({"0": 12, "1": 12, "2": 12}, [10], None),  # rank 3 not seen (its machine did not answer)
    ({"0": 12, "1": 12, "2": 12, "3": "12"}, [10], None),  # a step that is not a number is not seen
    ({"0": 12, "1": 12, "2": 12, "3": 12}, [], None),  # no step reported: nothing to be past
    ({"0": 12, "1": 12, "2": 12, "3": 12}, [True, "9"], None),  # nor when what was reported is not a step
    ({"0": 3, "1": 3, "2": 3, "3": 3}, [10], None),  # restarted from an older step: not past the stall
])
def test_a_stall_has_passed_only_when_every_rank_stepped_past_it(steps, alerted, passed):
    assert runtime.stall_passed(steps, alerted, 4) == passed
