"""The parallel layout, the inventory and the launch plan at fleet scale give exactly the old answers.

Replica placement decides where existing checkpoints' replicas live, so the linear-time placement is
compared, rank by rank, with the quadratic algorithm it replaced (kept below as the reference), on many
random layouts; groups, their order and their machines likewise.
"""

from __future__ import annotations

import random

import pytest

from trainguard.core.errors import ClusterError, InventoryError, TopologyError
from trainguard.core.topology import GROUP_KINDS, MAX_BACKUP_CANDIDATES, Topology, clear_layout_caches
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.node_tools.launcher import JobPlan
from trainguard.operators.jobspec import REFERENCE_ENTRY

# ---- the reference: the placement, groups and machines as first written (quadratic in the ranks) ----------


def reference_group(t: Topology, kind: str, rank: int) -> tuple[int, ...]:
    c = t.coords(rank)
    if kind == "tp":
        return tuple(t.rank_of(tp=i, pp=c.pp, dp=c.dp) for i in range(t.tp))
    if kind == "pp":
        return tuple(t.rank_of(tp=c.tp, pp=i, dp=c.dp) for i in range(t.pp))
    return tuple(t.rank_of(tp=c.tp, pp=c.pp, dp=i) for i in range(t.dp))


def reference_groups(t: Topology, kind: str) -> list[tuple[int, ...]]:
    seen: dict[tuple[int, ...], None] = {}
    for rank in range(t.world_size):
        seen.setdefault(reference_group(t, kind, rank), None)
    return list(seen)


def reference_machines_of_group(t: Topology, kind: str, rank: int) -> tuple[int, ...]:
    return tuple(sorted({t.machine_of(r) for r in reference_group(t, kind, rank)}))


def reference_backup_candidates(t: Topology, rank: int) -> list[tuple[tuple[int, ...], int]]:
    c = t.coords(rank)
    own_groups = [set(reference_group(t, kind, rank)) for kind in GROUP_KINDS]
    own_machine = t.machine_of(rank)
    spans = sorted(({r // t.ranks_per_machine for r in members} for members in own_groups), key=len)
    found: list[tuple[tuple[int, ...], int, int]] = []
    seen: set[int] = set()
    for shift in range(1, t.world_size):
        candidate = t.rank_of(tp=(c.tp + shift) % t.tp, pp=(c.pp + shift) % t.pp, dp=(c.dp + shift) % t.dp)
        machine = candidate // t.ranks_per_machine
        if machine == own_machine or candidate in seen or any(candidate in members for members in own_groups):
            continue
        seen.add(candidate)
        exposure = tuple(int(machine in span) for span in spans)
        found.append((exposure, len(found), candidate))
        safe = sum(1 for e, _i, _c in found if not any(e))
        if len(found) >= MAX_BACKUP_CANDIDATES or safe >= 4:
            break
    return [(exposure, cand) for exposure, _i, cand in sorted(found)]


def reference_backups(t: Topology) -> list[int]:
    out: list[int] = []
    used: set[int] = set()
    for rank in range(t.world_size):
        candidates = reference_backup_candidates(t, rank)
        if not candidates:
            next_machine = (t.machine_of(rank) + 1) % t.machines
            out.append(next_machine * t.ranks_per_machine + rank % t.ranks_per_machine)
            continue
        best = candidates[0][0]
        choice = next((cand for exposure, cand in candidates if exposure == best and cand not in used),
                      candidates[0][1])
        used.add(choice)
        out.append(choice)
    return out


# ---- layouts ------------------------------------------------------------------------------------------------


def _random_layouts(seed: int, count: int, min_ranks: int, max_ranks: int, tps: list[int], pps: list[int],
                    ) -> list[Topology]:
    """Random TP x PP x DP layouts of ``min_ranks`` to ``max_ranks`` ranks on at least two machines, ranks
    per machine a divisor of the world size (one, a TP group, several groups, or odd packings)."""
    rng = random.Random(seed)
    out: list[Topology] = []
    while len(out) < count:
        tp, pp = rng.choice(tps), rng.choice(pps)
        dp = rng.randint(max(1, min_ranks // (tp * pp)), max(1, max_ranks // (tp * pp)))
        world = tp * pp * dp
        if not min_ranks <= world <= max_ranks:
            continue
        rpm = rng.choice([d for d in range(1, min(world, 16) + 1) if world % d == 0])
        if world // rpm >= 2:
            out.append(Topology(tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm))
    return out


# chosen edge cases: one degree > 1 (no candidate at all), coprime degrees (the diagonal visits every rank),
# groups that span every machine, several groups per machine, the benchmark's shape
EDGE_LAYOUTS = [
    Topology(tp=1, pp=1, dp=7, ranks_per_machine=1), Topology(tp=6, pp=1, dp=1, ranks_per_machine=2),
    Topology(tp=1, pp=9, dp=1, ranks_per_machine=3), Topology(tp=2, pp=3, dp=5, ranks_per_machine=2),
    Topology(tp=3, pp=5, dp=7, ranks_per_machine=5), Topology(tp=2, pp=2, dp=2, ranks_per_machine=4),
    Topology(tp=8, pp=4, dp=8, ranks_per_machine=8), Topology(tp=4, pp=3, dp=4, ranks_per_machine=6),
    Topology(tp=8, pp=10, dp=5, ranks_per_machine=8), Topology(tp=2, pp=1, dp=9, ranks_per_machine=9),
]
SMALL_LAYOUTS = EDGE_LAYOUTS + _random_layouts(seed=1, count=150, min_ranks=2, max_ranks=200,
                                               tps=[1, 1, 2, 3, 4, 8], pps=[1, 1, 2, 3, 4, 5, 6, 10])
# at least two degrees > 1 (the realistic layouts; with one, the reference is quadratic and slow to run)
MEDIUM_LAYOUTS = _random_layouts(seed=2, count=12, min_ranks=500, max_ranks=3000, tps=[2, 4, 8],
                                 pps=[1, 2, 3, 4, 5, 10])


def _ids(layouts: list[Topology]) -> list[str]:
    return [f"{t}/rpm={t.ranks_per_machine}" for t in layouts]


# ---- placement ----------------------------------------------------------------------------------------------


def _check_placement_matches_reference(t: Topology) -> None:
    clear_layout_caches()
    expected = reference_backups(t)
    assert [t.backup_rank(r) for r in range(t.world_size)] == expected
    for rank in range(t.world_size):
        assert t.backed_up_by(rank) == tuple(s for s in range(t.world_size) if expected[s] == rank)


@pytest.mark.parametrize("t", SMALL_LAYOUTS, ids=_ids(SMALL_LAYOUTS))
def test_placement_is_the_reference_placement_on_small_layouts(t):
    _check_placement_matches_reference(t)


@pytest.mark.parametrize("t", MEDIUM_LAYOUTS, ids=_ids(MEDIUM_LAYOUTS))
def test_placement_is_the_reference_placement_on_medium_layouts(t):
    _check_placement_matches_reference(t)


def test_random_layouts_cover_the_cases_that_matter():
    """The layouts compared above reach every branch of the placement: ranks with no candidate, ranks whose
    safest candidates all hold a replica already, a stop at 16 candidates, groups spanning every machine."""
    no_candidate = all_taken = sixteen = spans_all = False
    for t in SMALL_LAYOUTS:
        spans_all |= any(len(reference_machines_of_group(t, k, 0)) == t.machines for k in GROUP_KINDS)
        used: set[int] = set()
        for rank in range(t.world_size):
            candidates = reference_backup_candidates(t, rank)
            no_candidate |= not candidates
            sixteen |= len(candidates) == MAX_BACKUP_CANDIDATES
            safest = [c for e, c in candidates if e == candidates[0][0]]
            all_taken |= bool(safest) and all(c in used for c in safest)
            used.add(next((c for c in safest if c not in used), safest[0]) if safest else -1)
    assert no_candidate and all_taken and sixteen and spans_all


def test_fleet_scale_placement_spreads_replicas_off_every_group():
    """At 100,000 ranks (12,500 machines of 8, TP=8, PP=10, DP=1250), beyond the reference's reach: every rank
    holds exactly one replica, and each rank's replica is off the machines of all its groups."""
    t = Topology(tp=8, pp=10, dp=1250, ranks_per_machine=8)
    clear_layout_caches()
    backups = [t.backup_rank(r) for r in range(t.world_size)]
    assert sorted(backups) == list(range(t.world_size))
    assert all(t.backed_up_by(b) == (r,) for r, b in enumerate(backups))
    for rank, backup in enumerate(backups):
        c, machine = t.coords(rank), t.machine_of(backup)
        # machine = dp * 10 + pp: the TP group is one machine, the PP group its replica's 10, the DP group
        # the machines of its stage
        assert machine // 10 != c.dp and machine % 10 != c.pp, (rank, backup)


def test_backed_up_by_is_refused_on_one_machine_and_outside_the_layout():
    with pytest.raises(TopologyError, match="a checkpoint replica needs a second machine"):
        Topology(tp=2, pp=1, dp=1).backed_up_by(0)
    with pytest.raises(TopologyError, match=r"rank 8 is outside 0\.\.7"):
        Topology(tp=2, pp=2, dp=2).backed_up_by(8)


# ---- groups and their machines ------------------------------------------------------------------------------


GROUP_LAYOUTS = SMALL_LAYOUTS[:60] + MEDIUM_LAYOUTS[:4]


@pytest.mark.parametrize("t", GROUP_LAYOUTS, ids=_ids(GROUP_LAYOUTS))
def test_groups_and_their_machines_are_the_reference_ones(t):
    for kind in GROUP_KINDS:
        assert t.groups(kind) == reference_groups(t, kind), kind
        for rank in range(t.world_size):
            assert t.group(kind, rank) == reference_group(t, kind, rank), (kind, rank)
            assert t.machines_of_group(kind, rank) == reference_machines_of_group(t, kind, rank), (kind, rank)


def test_an_unknown_group_kind_is_refused_by_every_group_query():
    t = Topology(tp=2, pp=2, dp=2)
    for query in (lambda: t.group("ep", 0), lambda: t.groups("ep"), lambda: t.machines_of_group("ep", 0)):
        with pytest.raises(TopologyError, match="unknown group kind 'ep'; use one of tp, pp, dp"):
            query()


# ---- inventory index ----------------------------------------------------------------------------------------


def _inventory(count: int) -> Inventory:
    return Inventory(cluster="c", transport="ssh",
                     machines=[Machine(name=f"m{i}", address=f"10.0.0.{i}") for i in range(count)])


def test_inventory_lookups_follow_changes_to_the_machine_list():
    inv = _inventory(4)
    assert inv.machine("m2") is inv.machines[2] and inv.names() == {"m0", "m1", "m2", "m3"}
    inv.machines.append(Machine(name="m9", address="10.0.0.9"))  # grown in place
    assert inv.machine("m9") is inv.machines[4] and "m9" in inv.names()
    gone = inv.machines.pop(0)  # shrunk, every position moved
    inv.machines.append(Machine(name="m7", address="10.0.0.7"))  # same length as before
    assert inv.machine("m3") is inv.machines[2] and inv.machine("m7") is inv.machines[-1]
    assert inv.names() == {"m1", "m2", "m3", "m9", "m7"}
    with pytest.raises(InventoryError, match=f"unknown machine {gone.name!r}; the inventory has: m1, m2"):
        inv.machine(gone.name)
    inv.machines[1] = Machine(name="m5", address="10.0.0.5")  # replaced in place
    assert inv.machine("m5") is inv.machines[1] and "m2" not in inv.names()
    with pytest.raises(InventoryError, match="unknown machine 'm2'"):
        inv.machine("m2")
    inv.machines = [Machine(name="x", address="10.0.1.1")]  # a new list
    assert inv.machine("x") is inv.machines[0] and inv.names() == {"x"}


def test_unknown_machine_error_names_some_machines_of_a_large_inventory():
    with pytest.raises(InventoryError, match=r"^unknown machine 'zz'; the inventory has: m0, m1, .*, m19 and 10 more$"):
        _inventory(30).machine("zz")


def test_inventory_with_a_repeated_name_answers_its_first_machine():
    first, second = Machine(name="m0", address="10.0.0.1"), Machine(name="m0", address="10.0.0.2")
    inv = Inventory(cluster="c", transport="ssh", machines=[first, second])
    assert inv.machine("m0") is first


# ---- launch plan --------------------------------------------------------------------------------------------


def _node_rank(argv: list[str]) -> str:
    return argv[argv.index("--node-rank") + 1]


def test_start_argv_gives_each_machine_its_node_rank():
    inv = _inventory(8)
    plan = JobPlan(job="j", topology=Topology(tp=2, pp=2, dp=4), machines=list(reversed(inv.machines)),
                   entry=REFERENCE_ENTRY, pass_layout=True)
    plan.validate()
    for expected, machine in enumerate(plan.machines):
        argv = plan.start_argv(inv, machine)
        assert _node_rank(argv) == str(expected)
        assert argv[argv.index("--master-addr") + 1] == inv.machines[-1].address
    # an equal copy of a machine (same fields, another object) is found too, as list.index finds it
    copy = Machine(**vars(plan.machines[3]))
    assert _node_rank(plan.start_argv(inv, copy)) == "3"
    plan.machines.insert(0, plan.machines.pop())  # the plan's machines reordered after a first use
    assert [_node_rank(plan.start_argv(inv, m)) for m in plan.machines] == [str(i) for i in range(8)]
    with pytest.raises(ValueError):
        plan.start_argv(inv, Machine(name="other", address="10.9.9.9"))


def test_validate_names_the_repeated_machine_only():
    inv = _inventory(40)
    machines = [*inv.machines[:31], inv.machines[1], inv.machines[7]]  # 33 machines: TP=3, PP=11
    plan = JobPlan(job="j", topology=Topology(tp=3, pp=11, dp=1, ranks_per_machine=1), machines=machines,
                   entry=REFERENCE_ENTRY)
    with pytest.raises(ClusterError, match=r"^a machine appears twice in the job's machine list: m1, m7; list each "
                                           r"machine once$"):
        plan.validate()
    plan.machines = inv.machines[:30]
    with pytest.raises(ClusterError, match=r"needs 33 machines, but 30 were given \(m0, m1, .*, m19 and 10 more\)$"):
        plan.validate()
