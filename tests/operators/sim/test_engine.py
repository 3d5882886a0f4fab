"""The scale simulator (operators/sim): Meta's closed-form ETTR on a simple case, the same ladder decisions as
the control plane's own triage task, bad input refused in one line, and the real policy's over-eviction."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from trainguard.operators.policy import ladder
from trainguard.operators.sim import engine, model, profiles
from trainguard.operators.sim.model import DAY_S, FailureKind, Profile

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _one_kind(kind: FailureKind, rate: float) -> model.FailureModel:
    return model.FailureModel(rate_per_machine_day=rate, gpus_per_machine=8, weak_machine_share=0.0,
                              weak_rate_multiplier=1.0, repair_days=1.0, manual_share=0.0, manual_urgent_share=0.0,
                              kinds=(kind,))


def _fixed(u0: float, step_s: float, **over: float) -> Profile:
    """Every incident costs exactly ``u0`` (all of it detection); checkpoints every ``step_s``, free."""
    zero = dict.fromkeys(("diagnose", "align", "analyze", "vote", "replay", "rollback"), 0.0)
    base = dict(name="fixed", detect_s={"crash_transient": u0, "hang": u0}, diagnose_s=zero, restart_s=0.0,
                restore_s=0.0, swap_s=0.0, reschedule_s=0.0, hot_update_s=0.0, human_s=0.0, step_s=step_s,
                checkpoint_overhead=0.0, provision_s=0.0)
    return Profile(**{**base, **over})


def test_ettr_matches_metas_closed_form_on_a_single_failure_kind():
    """N machines failing at r per day, each incident costing u0 plus the work since the last checkpoint
    (uniform over the interval dt): ETTR ~ 1 - N r (u0 + dt/2). The simulator stops the failure clock while
    the job is down, so its exact value is the renewal ratio (1 - lam dt/2) / (1 + lam u0) with lam = N r;
    the tolerance is that ratio's distance from Meta's first-order formula plus four standard deviations of
    the estimate over the run's incidents (Poisson count and uniform lost work)."""
    machines, rate, u0, dt, days = 100, 0.01, 1200.0, 1200.0, 3000.0
    m = _one_kind(FailureKind("crash_transient", 1.0, "rank_exit"), rate)
    r = engine.simulate(m, _fixed(u0, dt), gpus=machines * 8, days=days, pp=4, seed=7)
    lam = machines * rate / DAY_S
    meta = 1 - lam * (u0 + dt / 2)
    exact = (1 - lam * dt / 2) / (1 + lam * u0)
    incidents = r.incidents["crash_transient"]
    assert abs(incidents - lam * days * DAY_S * exact) < 5 * math.sqrt(lam * days * DAY_S)
    horizon = days * DAY_S
    sigma = math.sqrt(incidents) * math.hypot(u0 + dt / 2, dt / math.sqrt(12)) / horizon
    assert abs(r.ettr - meta) <= abs(exact - meta) + 4 * sigma, (r.ettr, meta, exact, sigma)
    # and the ledger adds up: every unproductive second is detection or lost work
    assert r.by_phase["detection"] == pytest.approx(incidents * u0)
    assert r.ettr == pytest.approx(1 - (r.by_phase["detection"] + r.by_phase["lost_work"]) / horizon, abs=1e-9)


def test_a_hang_over_evicts_the_pipeline_the_real_runtime_analysis_chooses():
    m = _one_kind(FailureKind("hang", 1.0, "rank_hang", machine_fault=True), 0.01)
    for pp in (4, 8):
        r = engine.simulate(m, _fixed(60.0, 10.0), gpus=1600, days=30, pp=pp, seed=3)
        hangs = r.actions["analyze"]
        assert hangs > 10 and r.evictions["faulty"] == hangs
        assert r.evictions["healthy"] == hangs * (pp - 1)  # the faulty machine's whole pipeline goes


CASES = [("gpu_lost", "machine_fault"), ("nic_down", "network"), ("rank_exit", "crash_transient"),
         ("nan_loss", "nan"), ("rank_hang", "hang"), ("rank_slow", "slow"), ("sdc_suspect", "sdc")]


@pytest.mark.parametrize(("alert_kind", "sim_kind"), CASES)
def test_the_simulator_decides_what_the_control_planes_triage_task_decides(tmp_path: Path, monkeypatch,
                                                                          alert_kind: str, sim_kind: str):
    from tests.fakes import fleet_controller, use_controller
    from trainguard.operators.tasks import incident as incident_tasks

    c, fleet = fleet_controller(tmp_path, train_args=())
    fleet.compute[1] = 0.9  # the rank the alert names does stand out (a fail-slow alert is confirmed first)
    use_controller(monkeypatch, c)
    [opened] = c.ingest([{"id": f"{alert_kind}-1", "job": "j", "machine": "m1", "rank": 1, "kind": alert_kind,
                          "severity": "fault", "ts": 100.0, "evidence": {}}])
    plane = incident_tasks.triage(c, opened["incident"])  # what tg_incident's triage task returns
    sim = engine.Simulation(model.load_model(), profiles.byterobust(1200), gpus=9600, days=1)
    t, d = sim.decide(sim.kinds[sim_kind], 5, 100.0, level=0, rollback_to=plane["rollback_to"])
    assert (t.category.value, d.action.value) == (plane["category"], plane["action"])


def test_the_simulator_and_the_control_plane_share_one_ladder_and_one_escalation_rule(tmp_path: Path, monkeypatch):
    """A changed ladder changes both (the simulator has no copy of it), and a failure soon after a recovery
    is one level up in both."""
    from tests.fakes import fleet_controller

    c, _ = fleet_controller(tmp_path, train_args=())
    [first] = c.ingest([{"id": "x-1", "job": "j", "machine": "m1", "rank": 1, "kind": "rank_exit",
                         "severity": "fault", "ts": 100.0, "evidence": {}}])
    c.fleet.update_incident(first["incident"], state="resolved", resumed_ts=200.0, closed_ts=201.0)
    [second] = c.ingest([{"id": "x-2", "job": "j", "machine": "m2", "rank": 2, "kind": "rank_exit",
                          "severity": "fault", "ts": 900.0, "evidence": {}}])
    db_level = c.fleet.incident(second["incident"]).level
    sim_level = ladder.escalation_level(last_level=0, last_recovery_end_ts=200.0, failed_ts=900.0,
                                        window_s=engine._setting("escalation_window_s"), last_category="crash",
                                        last_machines=("m1",), category="crash", machines=("m2",))
    assert db_level == sim_level == 1
    sim = engine.Simulation(model.load_model(), profiles.byterobust(1200), gpus=9600, days=1)
    plane = c.triage(second["incident"])
    t, d = sim.decide(sim.kinds["crash_transient"], 5, 900.0, level=sim_level, rollback_to=plane["rollback_to"])
    assert d.action.value == plane["action"] == "diagnose"  # a crash again after its restart at once
    # all pass: no other known-good revision, so replay; with one, roll back
    assert ladder.decide(t, level=sim_level, diagnosis_done=True).action == "replay"
    assert ladder.decide(t, level=sim_level, rollback_to="r0", diagnosis_done=True).action == "rollback"
    assert sim.decide(sim.kinds["crash_transient"], 5, 900.0, level=0)[1].action == "restart"
    monkeypatch.setattr(ladder, "decide", lambda t, **kw: ladder.Decision("wait_human", (), "changed ladder"))
    assert sim.decide(sim.kinds["crash_transient"], 5, 900.0, level=0)[1].action == "wait_human"
    assert c.triage(second["incident"])["action"] == "wait_human"


@pytest.mark.parametrize(("argv", "message"), [
    (["--profile", "nope"], "unknown profile 'nope'"),
    (["--gpus", "12"], "--gpus 12 must be a positive multiple of 8"),
    (["--model", "{bad}"], "rate_per_machine_day is -0.1"),
    (["--model", "{key}"], "unknown key 'rate'"),
    (["--model", "{kind}"], "kinds.hang has unknown key 'rat'"),
])
def test_bad_input_is_refused_in_one_line_with_exit_code_2(tmp_path: Path, capsys, argv: list[str], message: str):
    from trainguard.operators import cli

    files = {"{bad}": ("bad.yaml", "rate_per_machine_day: -0.1\n"), "{key}": ("key.json", '{"rate": 1}'),
             "{kind}": ("kind.yaml", "kinds:\n  hang: {rat: 2}\n")}
    for placeholder, (name, text) in files.items():
        (tmp_path / name).write_text(text)
        argv = [str(tmp_path / name) if a == placeholder else a for a in argv]
    assert cli.main(["simulate", "--days", "1", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_model_file_overrides_only_the_keys_it_names(tmp_path: Path):
    (tmp_path / "m.yaml").write_text("rate_per_machine_day: 0.002\nkinds:\n  hang: {share: 0.5}\n")
    m = model.load_model(tmp_path / "m.yaml")
    default = model.load_model()
    assert m.rate_per_machine_day == 0.002 and default.rate_per_machine_day == 0.0065
    assert {k.name: k.share for k in m.kinds}["hang"] == 0.5
    assert {k.name: k.alert for k in m.kinds} == {k.name: k.alert for k in default.kinds}


def test_the_measured_profile_is_read_from_the_committed_benchmark_results(tmp_path: Path):
    import json
    import shutil

    for name in ("detection", "recovery", "checkpoint", "replicas"):
        shutil.copy(profiles.RESULTS / f"{name}.json", tmp_path / f"{name}.json")
    # a first crash restarts at once, its machine's L1 beside the restore: its localization may end after the resume,
    # and the restart part is then the restore's floor; read here with none, so that the part moves with the resume
    rec = json.loads((tmp_path / "recovery.json").read_text())
    rec["metrics"]["localize_s.crash"]["median"] = 0.0
    (tmp_path / "recovery.json").write_text(json.dumps(rec))
    base = profiles.measured(1200, tmp_path)
    rep = json.loads((tmp_path / "replicas.json").read_text())  # the degrade path's costs: trainguard.replicas'
    rep["metrics"]["survivor_stall_s"]["median"] = base.quorum_s + 2.0
    (tmp_path / "replicas.json").write_text(json.dumps(rep))
    assert profiles.measured(1200, tmp_path).quorum_s == pytest.approx(base.quorum_s + 2.0)
    # the restore and the restart are the benchmarks' medians, not numbers typed in: the restore is the memory
    # copy's, the restart what remains of the crash's resume (+ Table 7's growth to the job's size)
    doc = json.loads((tmp_path / "checkpoint.json").read_text())
    doc["metrics"]["restore_s.memory"]["median"] = base.restore_s + 1.0
    (tmp_path / "checkpoint.json").write_text(json.dumps(doc))
    rec = json.loads((tmp_path / "recovery.json").read_text())
    rec["metrics"]["resume_s.crash"]["median"] += 100.0
    (tmp_path / "recovery.json").write_text(json.dumps(rec))
    changed = profiles.measured(1200, tmp_path)
    assert changed.restore_s == pytest.approx(base.restore_s + 1.0)
    assert changed.restart_s + changed.restore_s == pytest.approx(base.restart_s + base.restore_s + 100.0)
    doc = json.loads((tmp_path / "checkpoint.json").read_text())
    doc["metrics"]["device.step_overhead_ratio"]["median"] = 0.5
    (tmp_path / "checkpoint.json").write_text(json.dumps(doc))
    assert profiles.measured(1200, tmp_path).checkpoint_overhead == 0.5
    (tmp_path / "recovery.json").write_text(json.dumps({"metrics": {}}))
    with pytest.raises(model.SimError, match="no metric 'alert_to_diagnosis_s"):
        profiles.measured(1200, tmp_path)
