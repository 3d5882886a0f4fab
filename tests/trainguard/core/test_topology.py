"""The parallel layout: placement, groups, backup ranks, and bad layouts."""

from __future__ import annotations

import itertools

import pytest

from trainguard.core.errors import TopologyError
from trainguard.core.topology import Topology


def test_demo_layout_places_tp_inside_machines_and_pp_across():
    t = Topology(tp=2, pp=2, dp=2)
    assert t.world_size == 8 and t.machines == 4
    assert [t.ranks_on(m) for m in range(4)] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert t.group("tp", 5) == (4, 5)
    assert t.group("pp", 5) == (5, 7)  # dp1, tp1: stage 0 on machine 2, stage 1 on machine 3
    assert t.group("dp", 5) == (1, 5)
    assert t.machines_of_group("pp", 6) == (2, 3)
    assert t.machines_of_group("tp", 6) == (3,)


@pytest.mark.parametrize("tp,pp,dp,rpm", [(2, 2, 2, 2), (1, 4, 2, 2), (4, 2, 3, 4), (2, 3, 4, 8), (1, 1, 6, 1)])
def test_groups_partition_the_ranks(tp, pp, dp, rpm):
    t = Topology(tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm)
    for kind in ("tp", "pp", "dp"):
        groups = t.groups(kind)
        flat = sorted(itertools.chain.from_iterable(groups))
        assert flat == list(range(t.world_size)), kind
        assert all(len(g) == getattr(t, kind) for g in groups)
    for rank in range(t.world_size):
        c = t.coords(rank)
        assert t.rank_of(tp=c.tp, pp=c.pp, dp=c.dp) == rank


@pytest.mark.parametrize("tp,pp,dp,rpm", [(2, 2, 2, 2), (2, 4, 4, 2), (4, 2, 2, 4), (2, 2, 3, 2), (1, 2, 2, 1)])
def test_backup_rank_shares_no_group_and_no_machine(tp, pp, dp, rpm):
    t = Topology(tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm)
    backups = [t.backup_rank(r) for r in range(t.world_size)]
    for rank, backup in enumerate(backups):
        assert t.machine_of(backup) != t.machine_of(rank)
        for kind in ("tp", "pp", "dp"):
            if getattr(t, kind) > 1:
                assert backup not in t.group(kind, rank), (rank, backup, kind)
    # every rank holds exactly one replica: the load is even
    assert sorted(backups) == list(range(t.world_size))


def test_backup_rank_survives_eviction_of_any_whole_group():
    t = Topology(tp=2, pp=2, dp=2)
    for kind in ("tp", "pp", "dp"):
        for group in t.groups(kind):
            evicted = set()
            for r in group:
                evicted.update(t.machines_of_group(kind, r))
            for r in range(t.world_size):
                if t.machine_of(r) in evicted:
                    assert t.machine_of(t.backup_rank(r)) not in evicted, (kind, group, r)


def test_pure_data_parallel_backs_up_on_the_next_machine():
    t = Topology(tp=1, pp=1, dp=4, ranks_per_machine=1)
    assert [t.backup_rank(r) for r in range(4)] == [1, 2, 3, 0]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"tp": 0, "pp": 1, "dp": 1}, "tp=0 must be a positive integer"),
        ({"tp": 3, "pp": 1, "dp": 1, "ranks_per_machine": 2}, "do not fill machines of 2 ranks"),
    ],
)
def test_bad_layouts_are_refused_with_a_reason(kwargs, match):
    with pytest.raises(TopologyError, match=match):
        Topology(**kwargs)


def test_for_machines_refuses_a_layout_that_does_not_divide_the_ranks():
    assert Topology.for_machines(machines=4, ranks_per_machine=2, tp=2, pp=2).dp == 2
    with pytest.raises(TopologyError, match="does not divide the 8 ranks"):
        Topology.for_machines(machines=4, ranks_per_machine=2, tp=3, pp=1)


@pytest.mark.parametrize("text", ["tp=2,pp=2", "tp=2;pp=2;dp=2", "tp=x,pp=1,dp=1", "tp=1,tp=1,dp=1", ""])
def test_parse_rejects_malformed_text(text):
    with pytest.raises(TopologyError):
        Topology.parse(text)


def test_parse_round_trips():
    assert str(Topology.parse("dp=2, tp=2, pp=2")) == "tp=2,pp=2,dp=2"


def test_out_of_range_rank_is_refused():
    with pytest.raises(TopologyError, match=r"outside 0\.\.7"):
        Topology(tp=2, pp=2, dp=2).coords(8)


@pytest.mark.parametrize("tp,pp,dp,rpm", [(2, 2, 2, 2), (1, 4, 2, 2), (2, 4, 2, 4), (1, 4, 4, 2), (2, 2, 4, 4),
                                          (8, 4, 8, 8)])
def test_no_eviction_of_one_parallel_group_takes_a_rank_and_its_replica(tp, pp, dp, rpm):
    """The replica avoids every machine of the rank's groups (a machine can hold ranks of several stages),
    whenever the group does not span every machine; each rank still holds one replica."""
    t = Topology(tp=tp, pp=pp, dp=dp, ranks_per_machine=rpm)
    for kind in ("tp", "pp", "dp"):
        for group in t.groups(kind):
            evicted = {m for r in group for m in t.machines_of_group(kind, r)}
            if len(evicted) == t.machines:
                continue
            for r in range(t.world_size):
                if t.machine_of(r) in evicted:
                    assert t.machine_of(t.backup_rank(r)) not in evicted, (kind, group, r)
    assert sorted(t.backup_rank(r) for r in range(t.world_size)) == list(range(t.world_size))
