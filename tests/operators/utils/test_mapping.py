"""Dynamic task mapping past Airflow's ``max_map_length``: the diagnosis and the standby pool's self-check over
more machines than one expansion may hold, in batches, every machine exactly once."""

from __future__ import annotations

import pytest

from tests.fakes import FakeFleet, fleet_controller, use_controller
from trainguard.core.topology import Topology
from trainguard.operators.utils import mapping


@pytest.mark.parametrize(("n", "cap", "tasks", "largest"), [
    (0, 1024, 0, 0), (5, 1024, 5, 1), (1024, 1024, 1024, 1), (1025, 1024, 513, 2), (2000, 1024, 1000, 2),
    (100_000, 1024, 1021, 98), (7, 3, 3, 3), (7, 1, 1, 7)])
def test_batches_fit_the_limit_and_hold_every_item_once_in_order(n, cap, tasks, largest):
    items = [f"m{i}" for i in range(n)]
    out = mapping.batches(items, max_tasks=cap)
    assert len(out) == tasks <= cap
    assert [x for b in out for x in b] == items
    assert max((len(b) for b in out), default=0) == largest
    assert len({len(b) for b in out[:-1]}) <= 1  # equal sizes but the last


def test_batches_refuse_a_limit_below_one():
    with pytest.raises(ValueError, match="max_tasks=0 must be at least 1"):
        mapping.batches(["m0"], max_tasks=0)


def test_a_batch_is_named_after_its_machines():
    assert mapping.label(["m7"]) == "m7"
    assert mapping.label(["m0", "m1", "m2"]) == "m0 .. m2 (3)"
    assert mapping.flatten([{"machine": "m0"}, [{"machine": "m1"}, {"machine": "m2"}], None]) == [
        {"machine": "m0"}, {"machine": "m1"}, {"machine": "m2"}]


def test_a_diagnosis_past_one_expansions_limit_maps_in_batches_and_reports_each_machine_once(tmp_path, monkeypatch):
    from trainguard.operators.tasks import common, diagnose

    c, fleet = fleet_controller(tmp_path, machines=1100, active=1100, topology=Topology(tp=1, pp=2, dp=550))
    use_controller(monkeypatch, c)
    labels: list[str] = []
    notes: list[str] = []
    monkeypatch.setattr(common, "name_mapped_task", labels.append)
    monkeypatch.setattr(common, "note", notes.append)
    fleet.l1 = {"m1050": "gpu: device lost"}
    targets = diagnose.diagnose_targets(c, "j", [], 1, max_tasks=1024)
    assert len(targets) == 550  # Airflow refuses to expand more than its max_map_length (1,024)
    machines = list(c.fleet.job("j").machine_list)
    assert [m for t in targets for m in t["machines"]] == machines
    results = [diagnose.diagnose_machine(c, t) for t in targets]
    assert labels[0] == "m0 .. m1 (2)" and len(labels) == 550
    out = diagnose.diagnose_conclude(c, "j", results, None, evict=False)
    assert out["machines"] == machines
    assert list(out["failed"]) == ["m1050"] and "device lost" in out["failed"]["m1050"]
    assert notes == ["j: 1100 machines diagnosed; m1050 failed L1: quick: gpu: device lost"]
    # every machine was diagnosed, each in sessions of its own
    assert {m for m, argv in fleet.commands if "diag" in argv} == set(machines)


def test_a_named_machine_the_inventory_lacks_is_refused_before_any_task(tmp_path, monkeypatch):
    from trainguard.core.errors import TrainguardError
    from trainguard.operators.tasks import diagnose

    c, _fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    with pytest.raises(TrainguardError, match="nowhere"):
        diagnose.diagnose_targets(c, "j", ["m0", "nowhere"], 2)


def test_the_pool_self_checks_more_machines_than_one_expansion_holds(tmp_path, monkeypatch):
    from trainguard.node_tools.inventory import Inventory, Machine
    from trainguard.operators.control import ControlConfig, Controller
    from trainguard.operators.fleet import states
    from trainguard.operators.tasks import common, standby_pool

    roles = ["active"] * 4 + ["free"] * 7
    inv = Inventory(cluster="t", transport="local", bus_url=f"spool://{tmp_path / 'bus'}",
                    machines=[Machine(name=f"m{i}", address="127.0.0.1", role=r) for i, r in enumerate(roles)])
    inv.save(tmp_path / "inventory.json")
    c = Controller(ControlConfig(fleet_url=str(tmp_path / "fleet.db"), inventory=str(inv.path)), inventory=inv)
    topo = Topology(tp=1, pp=2, dp=2)
    fake = FakeFleet(inv, topo)
    c.transport = fake
    c.sync_inventory()
    c.fleet.upsert_job("j", tp=1, pp=2, dp=2, ranks_per_machine=1, machines=["m0", "m1", "m2", "m3"])
    fake.l1 = {"m9": "gpu: device lost"}
    use_controller(monkeypatch, c)
    labels: list[str] = []
    monkeypatch.setattr(common, "name_mapped_task", labels.append)
    monkeypatch.setattr(common, "note", lambda text: None)
    planned = standby_pool.pool_plan(c, 7, max_tasks=3)
    assert [len(b) for b in planned["targets"]] == [3, 3, 1]
    assert [t["machine"] for b in planned["targets"] for t in b] == [f"m{i}" for i in range(4, 11)]
    results = [standby_pool.pool_check(c, b) for b in planned["targets"]]
    assert labels == ["m4 .. m6 (3)", "m7 .. m9 (3)", "m10"]
    out = standby_pool.pool_conclude(planned, results)
    assert sorted(out["joined"]) == sorted(f"m{i}" for i in range(4, 11) if i != 9)
    assert list(out["failed"]) == ["m9"]
    assert c.fleet.machine("m9").state == states.REPAIR and c.fleet.machine("m10").state == states.STANDBY
    # a rerun of a batch after it concluded changes nothing
    again = standby_pool.pool_check(c, planned["targets"][0])
    assert all(r.get("skipped") for r in again)
