"""The control plane's degrade path on the scripted fleet of :mod:`tests.fakes`: a job run as replica groups
(TP1 x PP2 x DP2: replica 0 on m0, m1; replica 1 on m2, m3; standbys m4, m5) whose incident is confined to one
replica takes that replica out, swaps its machines and starts its group there while the other never stops; what
must stop the world still does; the run says which path it took. The same path on a real cluster and Airflow:
bench/degrade.py and tests/e2e/test_user_jobs.py."""

from __future__ import annotations

import json
import time

import pytest

from tests.fakes import alert, fleet_controller, run_incident
from trainguard.core.errors import TrainguardError
from trainguard.core.topology import Topology
from trainguard.node_tools.inventory import Machine
from trainguard.node_tools.launcher import JobPlan, ReplicaGroups
from trainguard.operators.jobspec import JobSpecError, parse_spec

TOPO = Topology(tp=1, pp=2, dp=2)
LIGHTHOUSE = "http://10.0.0.1:29510"


def _spec(**replicas: object) -> dict:
    return parse_spec({"name": "j", "command": ["-m", "examples.replicas.train"], "machines": ["m0", "m1", "m2", "m3"],
                       "layout": {"pp": 2}, "replicas": {"lighthouse": LIGHTHOUSE, **replicas}}).document()


def _starts(fleet) -> dict[str, list[str]]:
    return {m: argv for m, argv in fleet.commands if argv[:2] in (["job", "start"], ["standby", "activate"])}


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_a_lost_gpu_in_one_replica_swaps_that_replicas_machines_alone_and_the_other_never_stops(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, topology=TOPO, spec=_spec())
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    result = out["result"]
    assert result["path"] == "degrade" and result["degraded"]["replicas"] == [0], result
    # only replica 0's machines were stopped; the whole job never was (stop_job skipped)
    assert sorted(fleet.sent("job", "stop")) == ["m0", "m1"] and result["stop"]["skipped"]
    assert c.fleet.job("j").machine_list == ["m4", "m5", "m2", "m3"]
    starts = _starts(fleet)
    assert sorted(starts) == ["m4", "m5"]  # the replica's group on the standbys, nothing else started
    for name, node_rank in (("m4", "0"), ("m5", "1")):
        argv = starts[name]
        assert _flag(argv, "--replica") == "0" and _flag(argv, "--replicas") == "2"
        assert _flag(argv, "--nnodes") == "2" and _flag(argv, "--node-rank") == node_rank
        assert _flag(argv, "--master-addr") == "10.0.0.14"  # the group's own rendezvous, on its first machine
        assert _flag(argv, "--lighthouse") == LIGHTHOUSE
        assert _flag(argv, "--replica-host") == c.inventory.machine(name).address
    recovery = result["recovery"]
    assert recovery["restarted"] and recovery["degraded"]["machines"] == ["m4", "m5"]
    assert out["resumed"]["first_step"] is not None
    inc = c.fleet.incident(out["incident"])
    assert out["closed"]["state"] == "resolved" and "path degrade" in inc.summary and "trained on" in inc.summary
    # the ledger: the incident's stretches count as reduced-width training, not as the job stopped
    kinds = {e.kind for e in c.fleet.ettr_events("j")}
    assert kinds == {"degraded"}
    widths = {json.loads(e.detail)["width"] for e in c.fleet.ettr_events("j")}
    assert widths == {0.5}
    assert [a.kind for a in c.fleet.actions(out["incident"])].count("launch") == 0  # no whole-job launch


def test_asked_again_the_degrade_does_nothing_more(tmp_path, monkeypatch):
    from trainguard.operators.tasks import rungs

    c, fleet = fleet_controller(tmp_path, topology=TOPO, spec=_spec())
    out = run_incident(c, [alert("gpu_lost", "m2")], monkeypatch)
    starts, stops = len(_starts(fleet)), len(fleet.sent("job", "stop"))
    again = rungs.handle(c, "evict_now", out["decision"])  # the rung's task cleared and run again
    assert again["degraded"] == out["result"]["degraded"]
    assert len(_starts(fleet)) == starts and len(fleet.sent("job", "stop")) == stops
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m4", "m5"]


@pytest.mark.parametrize(("alerts", "why"), [
    ([alert("nan_loss", "m1", rank=1)], "nan"),
    ([alert("gpu_lost", "m1"), alert("gpu_lost", "m3")], "spans 2 of 2"),
])
def test_what_must_stop_the_world_still_stops_the_whole_job(tmp_path, monkeypatch, alerts, why):
    c, fleet = fleet_controller(tmp_path, topology=TOPO, spec=_spec())
    out = run_incident(c, alerts, monkeypatch)
    result = out["result"]
    assert result["path"] == "stop_world" and why in result["path_reason"], result
    assert sorted(set(fleet.sent("job", "stop"))) == ["m0", "m1", "m2", "m3"]
    assert not result["recovery"].get("degraded")


def test_a_crash_the_logs_blame_on_the_jobs_own_code_stops_the_world(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, topology=TOPO, spec=_spec())
    fleet.logs["m3"] = {"class": "user_code", "kind": "python_exception",
                        "first_failure": {"ts": 1.0, "line": "ZeroDivisionError"}}
    out = run_incident(c, [alert("rank_exit", "m3", rank=3)], monkeypatch)
    result = out["result"]
    assert result["path"] == "stop_world" and "own code" in result["path_reason"], result
    assert [a.outcome for a in c.fleet.actions(out["incident"]) if a.kind == "degrade"] == ["stop_world"]
    assert "m0" in fleet.sent("job", "stop")  # the ladder's rung stopped everything


def test_a_job_whose_spec_turns_the_degrade_path_off_stops_the_world(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, topology=TOPO, spec=_spec(degrade=False))
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    assert "path" not in out["result"] and not any(a.kind == "degrade" for a in c.fleet.actions(out["incident"]))
    assert sorted(set(fleet.sent("job", "stop"))) == ["m0", "m1", "m2", "m3"]


def test_with_no_standby_free_the_replica_restarts_in_place_and_heals(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, machines=4, topology=TOPO, spec=_spec())
    out = run_incident(c, [alert("rank_exit", "m2", rank=2)], monkeypatch)
    d = out["result"]["degraded"]
    assert d["in_place"] and d["machines"] == ["m2", "m3"] and sorted(_starts(fleet)) == ["m2", "m3"]
    assert out["closed"]["state"] == "resolved"


def test_a_replica_plan_starts_one_group_per_replica_with_its_own_rendezvous():
    machines = [Machine(name=f"m{i}", address=f"10.0.0.{i}") for i in range(4)]
    plan = JobPlan(job="j", topology=TOPO, machines=machines, entry="train.py",
                   replicas=ReplicaGroups(LIGHTHOUSE, min_replicas=1))
    plan.validate()

    class Inv:
        tg_node = "tg-node"

    argv = plan.start_argv(Inv(), machines[3])
    assert (_flag(argv, "--replica"), _flag(argv, "--nnodes"), _flag(argv, "--node-rank"),
            _flag(argv, "--master-addr")) == ("1", "2", "1", "10.0.0.2")
    # two ranks a machine of a job whose replicas are one rank each: a machine would hold two replicas
    bad = JobPlan(job="j", topology=Topology(tp=1, pp=1, dp=4, ranks_per_machine=2), machines=machines[:2],
                  entry="train.py", replicas=ReplicaGroups(LIGHTHOUSE))
    with pytest.raises(TrainguardError, match="every machine inside one data-parallel replica"):
        bad.validate()


@pytest.mark.parametrize(("replicas", "error"), [
    ({"lighthouse": "10.0.0.1:29510"}, "replicas.lighthouse"),
    ({"lighthouse": LIGHTHOUSE, "min_replicas": 3}, "min_replicas 3 is more than the job's 2"),
    ({"lighthouse": LIGHTHOUSE, "min_replicas": 0}, "replicas.min_replicas"),
])
def test_a_replicas_section_that_cannot_work_is_refused_in_one_line(replicas, error):
    with pytest.raises(JobSpecError, match=error) as exc:
        parse_spec({"name": "j", "command": ["train.py"], "machines": ["m0", "m1", "m2", "m3"], "layout": {"pp": 2},
                    "replicas": replicas})
    assert "\n" not in str(exc.value)


def test_an_observation_closed_while_a_replica_group_is_down_leaves_the_group_to_its_own_incident(
        tmp_path, monkeypatch):
    """Two things at once: a loss spike was observed (no recovery) while replica 1's rank crashed, its alert still
    on its way. The job trains on replica 0, so the observation closes resolved; a restart of every group from
    here (the climb of a job found down) would throw away the state the groups that trained on hold."""
    from tests.fakes import use_controller
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path, topology=TOPO, spec=_spec())
    use_controller(monkeypatch, c)
    inc = c.fleet.open_incident("j", [alert("loss_spike", "m0", rank=0)])[0].id  # (a spike alone opens none)
    decision = steps.triage(c, inc)
    idle = steps.no_recovery(c, decision)
    recovery = steps.restart_job(c, inc, [])
    resumed = steps.resumed(c, inc, recovery)
    fleet.running.pop("m3")
    fleet.trains_without = frozenset({"m0", "m1"})
    step = steps.close_step(c, inc, idle, recovery, resumed)
    assert step.state == "done" and c.fleet.incident(inc).state == "resolved", step
    assert not _starts(fleet) and not fleet.sent("job", "stop")
    fleet.running.pop("m1")  # both groups down: the job does not train, and the climb restarts it
    inc = c.fleet.open_incident("j", [alert("loss_spike", "m0", rank=0)])[0].id  # (a spike alone opens none)
    decision = steps.triage(c, inc)
    step = steps.close_step(c, inc, steps.no_recovery(c, decision), steps.restart_job(c, inc, []), None)
    assert step.state == "watching" and "does not train" in step.watch.why, step


def test_the_fleet_page_shows_a_job_training_without_a_replica_as_degraded_and_for_how_long(tmp_path):
    from trainguard.operators import fleet_view
    from trainguard.operators.plugins import fleet as ui

    c, fleet = fleet_controller(tmp_path, topology=TOPO, spec=_spec())
    [job] = fleet_view.collect(c)["jobs"]
    assert job["state"] == "running" and job["degraded"] is None
    fleet.running.pop("m3")  # replica 1's group died; replica 0 trains on, its incident not opened yet
    fleet.trains_without = frozenset({"m0", "m1"})
    [job] = fleet_view.collect(c)["jobs"]
    assert job["state"] == "degraded" and job["degraded"]["replicas"] == [1] and job["degraded"]["width"] == 0.5
    assert job["problem"] == ""
    [item] = c.ingest([alert("rank_exit", "m3", rank=3)])
    decision = c.triage(item["incident"])
    c.degrade.take_out(item["incident"], c.degrade_plan(decision))  # its group started on standbys, healing
    doc = fleet_view.collect(c, now=time.time() + 12)
    [job] = doc["jobs"]
    d = job["degraded"]
    assert d["replicas"] == [1] and d["incident"] == item["incident"] and 11 <= d["for_s"] <= 30
    page = ui.render(doc)
    assert "replica(s) 1 out, 50% of replicas training, for 1" in page
    c.close(item["incident"], outcome="resolved")
    assert fleet_view.collect(c)["jobs"][0]["degraded"] is None  # back at full width once its incident closed


@pytest.mark.parametrize(("fields", "error"), [
    ({"replica": 2, "replicas": 2, "lighthouse": LIGHTHOUSE}, "--replica 2 is outside 0..1"),
    ({"replica": 0, "replicas": 2, "lighthouse": "10.0.0.1:29510"}, "must be http://host:port"),
    ({"replica": 0, "replicas": 2, "lighthouse": "http://h:1; rm -rf /"}, "must be http://host:port"),
    ({"replica": 0, "replicas": 2, "lighthouse": LIGHTHOUSE, "min_replicas": 3}, "--min-replicas 3 must be 1..2"),
])
def test_a_machines_part_of_a_replica_group_that_cannot_work_is_refused_before_anything_starts(fields, error):
    from trainguard.node_tools.job import JobSpec

    spec = JobSpec(job="j", nnodes=1, node_rank=0, nproc_per_node=1, master_addr="10.0.0.1", master_port=29500,
                   entry="train.py", **fields)
    with pytest.raises(TrainguardError, match=error):
        spec.validate()


def test_a_standby_that_fails_to_start_the_group_is_replaced_by_the_next_one(tmp_path, monkeypatch):
    """The fix itself fails: the first standby given the replica's group does not start it. The next standby takes
    its place, as a restart's would, and the other replica still never stops."""
    c, fleet = fleet_controller(tmp_path, machines=7, topology=TOPO, spec=_spec())
    fleet.start_fails["m4"] = "machine m4: the warm interpreters are gone"
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    d = out["result"]["degraded"]
    assert d["machines"] == ["m6", "m5"] and d["swaps"] == {"m0": "m6", "m1": "m5"}, d
    assert c.fleet.job("j").machine_list == ["m6", "m5", "m2", "m3"]
    assert not {"m2", "m3"} & set(fleet.sent("job", "stop")) and out["closed"]["state"] == "resolved"
    assert c.fleet.machine("m4").state == "evicted"


def test_when_no_standby_starts_the_group_the_whole_job_goes_the_ladders_way(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, machines=6, topology=TOPO, spec=_spec())
    fleet.start_fails["m4"] = "machine m4: the warm interpreters are gone"
    looked: list[bool] = []
    trains = c.jobs.trains

    def briefly(job: str, **kw) -> bool:  # the fake steps on each status round: 2 s tell as well as 15
        looked.append(trains(job, **{**kw, "within_s": 2.0}))
        return looked[-1]

    monkeypatch.setattr(c.jobs, "trains", briefly)
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    result = out["result"]
    assert result["path"] == "stop_world" and "did not start" in result["path_reason"], result
    assert looked == [False]  # the close looked whether the half-stopped job trains: it does not
    assert [a.outcome for a in c.fleet.actions(out["incident"]) if a.kind == "degrade"] == ["stop_world"]
    assert {"m2", "m3"} <= set(fleet.sent("job", "stop"))  # the ladder's rung stopped everything


def test_a_slow_group_the_vote_finds_in_one_replica_takes_the_degrade_path(tmp_path, monkeypatch):
    """The fail-slow vote runs while the job trains; the group it names lies in one replica, so that replica is
    taken out and healed while the other trains on, instead of the whole job stopping for the eviction."""
    c, fleet = fleet_controller(tmp_path, topology=TOPO, spec=_spec(), slow_rounds=5, slow_interval_s=0.0)
    fleet.compute = {r: 0.36 for r in range(4)} | {1: 0.54}  # rank 1, on m1 (replica 0), 50% slower
    declines = [alert("throughput_decline", f"m{r}", rank=r, decline=0.22) for r in range(4)]
    out = run_incident(c, declines, monkeypatch)
    result = out["result"]
    assert (out["decision"]["category"], out["decision"]["action"]) == ("slow", "vote")
    assert result["path"] == "degrade" and result["degraded"]["replicas"] == [0], result
    assert "m1" in result["vote"]["machines"]
    assert sorted(set(fleet.sent("job", "stop"))) == ["m0", "m1"] and result["stop"]["skipped"]
    assert c.fleet.job("j").machine_list == ["m4", "m5", "m2", "m3"] and out["closed"]["state"] == "resolved"


def test_a_lost_machine_found_by_its_silent_agent_takes_the_degrade_path(tmp_path, monkeypatch):
    """A lost machine of a replica job: the other groups' collective failed and their next quorum left its group out,
    so nothing hung; its silent agent was the only word, and the probe that found the machine unreachable stopped
    every group for a whole-job restart (5 GPU-s of each group that trained on, in bench/peers.py)."""
    c, fleet = fleet_controller(tmp_path, topology=TOPO, spec=_spec())
    fleet.unreachable = {"m3"}
    fleet.running.pop("m3")
    out = run_incident(c, [alert("agent_silent", "m3", job="j")], monkeypatch)
    result = out["result"]
    assert out["decision"]["action"] == "probe" and result["probe"]["faulty"].keys() == {"m3"}
    assert result["path"] == "degrade" and result["degraded"]["replicas"] == [1], result
    assert sorted(fleet.sent("job", "stop")) == ["m2"]  # replica 1's reachable machine; replica 0 never stopped
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m4", "m5"]
    assert sorted(_starts(fleet)) == ["m4", "m5"]
    assert out["closed"]["state"] == "resolved" and "path degrade" in c.fleet.incident(out["incident"]).summary
