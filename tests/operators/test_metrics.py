"""The control plane's Prometheus metrics, scraped from a fleet database the way Prometheus does
(text format parsed with prometheus-client's own parser)."""

from __future__ import annotations

import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import wait_until
from trainguard.emulation.standalone import free_port
from trainguard.operators import metrics
from trainguard.operators.control import Controller


def _fleet(tmp_path: Path) -> Controller:
    """Job j (TP=1 PP=2 DP=2, revision r0) on m0..m3, standbys m4 and m5 (scripted machines: tests/fakes.py)."""
    from tests.fakes import fleet_controller

    return fleet_controller(tmp_path, train_args=(), revision="r0")[0]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_a_scrape_counts_incidents_phases_evictions_machines_and_the_pool_target(tmp_path: Path):
    c = _fleet(tmp_path)
    t0 = time.time() - 60
    [lost] = c.ingest([{"id": "a1", "job": "j", "machine": "m1", "rank": 1, "kind": "gpu_lost", "severity": "fault",
                        "ts": t0, "evidence": {}}])
    inc = lost["incident"]
    c.fleet.update_incident(inc, category="machine_fault", diagnosis_start_ts=t0 + 3)
    c.evict(inc, ["m1"], reason="gpu lost")  # decided now
    c.fleet.update_incident(inc, resumed_ts=time.time() + 1)
    c.close(inc, outcome="resolved", note="resumed")
    before = _samples(metrics.exposition(c.fleet))
    assert before[("trainguard_incidents_total", (("category", "machine_fault"), ("job", "j"),
                                                   ("outcome", "resolved")))] == 1
    assert before[("trainguard_evictions_total", (("job", "j"),))] == 1
    assert before[("trainguard_incident_phase_seconds_count", (("job", "j"), ("phase", "recovery")))] == 1
    assert before[("trainguard_incident_phase_seconds_sum", (("job", "j"), ("phase", "diagnosis")))] > 50
    assert before[("trainguard_machines", (("state", "evicted"),))] == 1
    assert before[("trainguard_machines", (("state", "standby"),))] == 1  # m4 took m1's place
    assert before[("trainguard_job_revision_info", (("job", "j"), ("pending", ""), ("revision", "r0")))] == 1
    # 4 machines at ~0.0012/day make no standby by the P99, but a hang evicts a pipeline: its 2 machines
    assert before[("trainguard_standby_pool_target", ())] == 2
    # a second eviction shows on the next scrape: nothing is cached between scrapes
    [again] = c.ingest([{"id": "a2", "job": "j", "machine": "m2", "rank": 2, "kind": "gpu_lost",
                         "severity": "fault", "ts": time.time(), "evidence": {}}])
    c.evict(again["incident"], ["m2"], reason="gpu lost")
    after = _samples(metrics.exposition(c.fleet))
    assert after[("trainguard_evictions_total", (("job", "j"),))] == 2
    assert after[("trainguard_incidents_total", (("category", "untriaged"), ("job", "j"), ("outcome", "open")))] \
        == 1


def test_a_scrape_says_how_old_the_newest_verified_checkpoint_is_and_the_newest_ettr(tmp_path: Path):
    c = _fleet(tmp_path)
    now = time.time()
    c.fleet.record_checkpoint("j", 49, committed_ts=now - 300)
    c.fleet.mark_checkpoint("j", 49, verified=True)
    c.fleet.record_checkpoint("j", 99, committed_ts=now - 200)
    c.fleet.mark_checkpoint("j", 99, verified=False, problems=["machine m1 rank 0 step 99 tier replica: ..."])
    c.fleet.record_checkpoint("j", 149, committed_ts=now - 100)  # not checked yet
    for ts, cumulative in ((now - 7200, 0.91), (now - 3600, 0.95)):
        c.fleet.record_action(f"ettr_report:j:{ts:.3f}", kind="ettr_report",
                              evidence={"cumulative": cumulative, "sliding": cumulative - 0.1, "window_s": 3600})
    got = _samples(metrics.exposition(c.fleet))
    assert got[("trainguard_checkpoint_step", (("job", "j"), ("state", "announced")))] == 149
    assert got[("trainguard_checkpoint_step", (("job", "j"), ("state", "verified")))] == 49
    assert 299 < got[("trainguard_checkpoint_verified_age_seconds", (("job", "j"),))] < 360
    assert [got[("trainguard_checkpoint_verifications_total", (("job", "j"), ("result", r)))]
            for r in ("verified", "corrupt", "pending")] == [1, 1, 1]
    assert got[("trainguard_ettr_ratio", (("job", "j"), ("window", "cumulative")))] == 0.95  # the newest report
    assert abs(got[("trainguard_ettr_ratio", (("job", "j"), ("window", "sliding")))] - 0.85) < 1e-9


def test_the_command_serves_a_scrape_over_http_and_refuses_a_bad_port(tmp_path: Path):
    c = _fleet(tmp_path)
    env = {"TG_FLEET_URL": c.cfg.fleet_url, "PATH": str(Path(sys.executable).parent)}
    bad = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", "metrics", "--port", "70000"], env=env,
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stderr.strip() == "trainguard: --port 70000 must be 1..65535"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "trainguard.operators.cli", "metrics", "--port", str(port)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def scrape() -> str | None:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    return r.read().decode()
            except OSError:
                return None

        text = wait_until(scrape, timeout=30, what="the metrics endpoint")
        assert _samples(text)[("trainguard_machines", (("state", "active"),))] == 4
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_status_and_metrics_say_when_the_guardian_is_silent_an_agent_is_silent_or_a_human_is_needed(
        tmp_path: Path, monkeypatch):
    from trainguard.operators import status

    c = _fleet(tmp_path)
    now = time.time()
    doc = status.collect(c.fleet, silent_s=15.0, now=now, beats={"guardian": None, "reconciler": None})
    assert not doc["healthy"] and any("the alert watcher has written no beat" in p for p in doc["problems"])
    doc = status.collect(c.fleet, silent_s=15.0, now=now, beats={"guardian": {"ts": now - 40}, "reconciler": None},
                         reconcile_period_s=0)
    assert any("the alert watcher last polled the bus 40s ago" in p for p in doc["problems"])
    c.fleet.beat("guardian", {"watched": 4})  # what the recording task writes with a batch
    c.fleet.ingest({}, escalation_window_s=0.0, liveness={
        "m0": {"token": "a", "changed_ts": now - 1.0, "reported_ts": None},
        "m1": {"token": "b", "changed_ts": now - 1.0, "reported_ts": None},
        "m2": {"token": "c", "changed_ts": now - 40.0, "reported_ts": now - 25.0},
        "m3": {"token": "d", "changed_ts": now - 2.0, "reported_ts": None}})
    doc = status.collect(c.fleet, silent_s=15.0, now=now + 1, beats={"guardian": {"ts": now, "watched": 4}},
                         reconcile_period_s=0)
    assert doc["guardian"]["last_poll_age_s"] < 10 and doc["agents"]["m2"]["silent"]
    assert doc["guardian"]["last_recorded_age_s"] < 10
    assert [p for p in doc["problems"] if "silent" in p] == ["agent of m2 (j) silent for 41s"]
    samples = _samples(metrics.exposition(c.fleet))
    assert samples[("trainguard_agent_heartbeat_age_seconds", (("job", "j"), ("machine", "m2")))] >= 39
    assert abs(samples[("trainguard_component_last_seen_timestamp_seconds", (("component", "guardian"),))] - now) < 10
    assert samples[("trainguard_human_needed", (("job", "j"),))] == 0
    [inc] = c.ingest([{"id": "b1", "job": "j", "machine": "m1", "rank": 1, "kind": "rank_exit", "severity": "fault",
                       "ts": now - 5, "evidence": {}}])
    c.wait_for_human(inc["incident"], "the restart failed 3 times: no step can be restored; next: bring m1 back")
    doc = status.collect(c.fleet, silent_s=15.0, now=now + 1)
    assert any(p.startswith(f"HUMAN NEEDED: incident {inc['incident']} of job j: the restart failed")
               for p in doc["problems"])
    text = status.render(doc)
    assert "!! HUMAN NEEDED" in text and "guardian   polled" in text
    samples = _samples(metrics.exposition(c.fleet))
    assert samples[("trainguard_human_needed", (("job", "j"),))] == 1
    assert samples[("trainguard_job_state", (("job", "j"), ("state", "waiting_human")))] == 1


def test_the_status_command_exits_1_when_something_needs_a_human(tmp_path: Path, monkeypatch, capsys):
    import json

    from trainguard.operators.cli import main

    c = _fleet(tmp_path)
    monkeypatch.setenv("TG_FLEET_URL", c.cfg.fleet_url)
    monkeypatch.setenv("TG_AIRFLOW_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    assert main(["--state-dir", str(tmp_path / "nocluster"), "status"]) == 1
    out = capsys.readouterr().out
    assert "airflow does not answer" in out
    assert main(["--json", "--state-dir", str(tmp_path / "nocluster"), "status"]) == 1
    assert json.loads(capsys.readouterr().out)["healthy"] is False
    monkeypatch.setenv("TG_AGENT_SILENT_S", "2")
    assert main(["status"]) == 2 and "TG_AGENT_SILENT_S=2" in capsys.readouterr().err


def test_status_finds_the_airflow_a_demo_kept_running_and_nothing_where_none_runs(tmp_path: Path):
    """``trainguard status`` finds a kept demo's api-server by the files its harness leaves (the product does
    not import the harness): its process group's pid and its URL."""
    import os

    from trainguard.operators.status import kept_airflow_url

    home = tmp_path / "control" / "airflow"
    assert kept_airflow_url(home) == ""  # nothing there
    home.mkdir(parents=True)
    (home / "standalone.url").write_text("http://127.0.0.1:8080\n")
    (home / "standalone.pid").write_text(str(os.getpgrp()))  # a process group that runs: this test's
    assert kept_airflow_url(home) == "http://127.0.0.1:8080"
    (home / "standalone.pid").write_text("999999999")  # none runs
    assert kept_airflow_url(home) == ""
