"""The ladder against faults it was not built around, on a scripted fleet (tests/fakes.py): every rung runs
through the real controller and task bodies, machines answer from a script. Each test names the failure it
guards against."""

from __future__ import annotations

import json
import time

from tests.fakes import alert, fleet_controller, run_incident, use_controller
from trainguard.core.topology import Topology
from trainguard.node_tools.transport import RunResult


def test_a_stopped_rank_the_stacks_see_running_is_not_evicted_on_the_alerts_word(tmp_path, monkeypatch):
    """Heartbeats an hour behind made the agent report rank_stopped, and runtime analysis trusted the alert
    over the process it could see running: two healthy machines evicted."""
    c, fleet = fleet_controller(tmp_path)
    out = run_incident(c, [alert("rank_stopped", "m1", rank=1), alert("rank_stopped", "m2", rank=2)], monkeypatch)
    assert out["decision"]["action"] == "analyze"
    analysis = out["result"]["analysis"]
    assert analysis["claimed_stopped"] == [1, 2] and analysis["refuted"] == [1, 2] and analysis["machines"] == []
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]
    assert not fleet.sent("job", "stop") and not [a for a in c.fleet.actions() if a.kind == "evict"]
    assert out["closed"]["state"] == "resolved" and "seen running" in c.fleet.incident(out["incident"]).summary


def test_a_rank_the_stacks_see_stopped_is_proof(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, topology=Topology(tp=1, pp=2, dp=2))
    fleet.process_state[3] = "T"
    fleet.frames[3] = ["wait", "step", "main"]
    out = run_incident(c, [alert("rank_stopped", "m3", rank=3)], monkeypatch)
    analysis = out["result"]["analysis"]
    assert analysis["claimed_stopped"] == [3] and analysis["refuted"] == []
    # rank 3 (dp 1, stage 1) on m3: its pipeline (m2, m3) is over-evicted
    assert sorted(analysis["machines"]) == ["m2", "m3"]
    assert out["closed"]["state"] == "resolved" and c.fleet.job("j").machine_list == ["m0", "m1", "m4", "m5"]


def test_a_hung_pipeline_larger_than_the_pool_swaps_its_stopped_ranks_machine_and_the_job_resumes(
        tmp_path, monkeypatch):
    """A hang over-evicts its pipeline; with fewer standbys than the pipeline's machines the whole incident
    waited for a human (every hang at PP >= 6 with a pool sized for single failures). Now the machine of the
    stopped rank is swapped, the rest of the pipeline kept (recorded as deferred), and the job resumes."""
    c, fleet = fleet_controller(tmp_path, machines=5, active=4, topology=Topology(tp=1, pp=2, dp=2))
    fleet.process_state[3] = "T"
    fleet.frames[3] = ["wait", "step", "main"]
    out = run_incident(c, [alert("rank_stopped", "m3", rank=3)], monkeypatch)
    analysis = out["result"]["analysis"]
    assert sorted(analysis["machines"]) == ["m2", "m3"] and analysis["culprits"] == ["m3"]
    assert out["closed"]["state"] == "resolved", c.fleet.incident(out["incident"]).summary
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m4"]  # m3 out, m2 kept in its place
    [ev] = [a for a in c.fleet.actions(out["incident"]) if a.kind == "evict"]
    assert ev.outcome == "done" and ev.evidence["deferred"] == ["m2"] and json.loads(ev.detail) == {"m3": "m4"}
    from trainguard.operators.tasks.incident import incident_note

    assert "evicted m3 -> standby m4; kept m2 of the group (too few standbys)" in incident_note(c, out["incident"])
    # asked again (the task cleared and run again), it does nothing more
    again = c.evict(out["incident"], ["m2", "m3"], reason="again", priority=["m3"])
    assert again["reason"] == "done before" and again["deferred"] == ["m2"]
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m4"]


def test_a_short_pool_without_evidence_for_any_one_machine_still_waits_for_a_human(tmp_path):
    c, _fleet = fleet_controller(tmp_path, machines=5, active=4, topology=Topology(tp=1, pp=2, dp=2))
    inc = c.ingest([alert("gpu_lost", "m2"), alert("gpu_lost", "m3")])[0]["incident"]
    out = c.evict(inc, ["m2", "m3"], reason="two lost GPUs")  # no priority: the whole set or nothing
    assert out.get("waiting_human") and "2 machines to replace (m2, m3), 1 standbys answer" in out["reason"]
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]
    out = c.evict(inc, ["m2", "m3"], reason="two lost GPUs", priority=["m1"])  # evidence outside the set
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]


def _crashed_first_on(fleet, machine: str) -> None:
    """The logs after the stop: ``machine``'s rank died first (killed); its peers' ranks only echo it."""
    t = 1000.0
    fleet.logs = {m: {"class": "infrastructure", "kind": "peer_connection", "first_failure": {"ts": t + 1.0}}
                  for m in ("m0", "m1", "m2", "m3")}
    fleet.logs[machine] = {"class": "infrastructure", "kind": "signal", "evidence": "killed by SIGKILL",
                           "first_failure": {"ts": t}}


def test_a_machine_whose_rank_keeps_crashing_with_clean_diagnoses_is_swapped_at_its_next_failure(tmp_path, monkeypatch):
    """A machine whose rank crashed three times in three minutes, each diagnosis clean, was never singled
    out: nothing counted failures per machine."""
    c, fleet = fleet_controller(tmp_path, escalation_window_s=0.0)
    for n in range(2):
        _crashed_first_on(fleet, "m2")
        out = run_incident(c, [alert("rank_exit", "m2", rank=2), alert("rank_exit", "m0", rank=0)], monkeypatch)
        assert out["decision"]["action"] == "restart" and out["closed"]["state"] == "resolved", n
        assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]  # every machine passed: in place
        assert [a.machines for a in c.fleet.actions(out["incident"]) if a.kind == "implicate"] == [["m2"]]
    _crashed_first_on(fleet, "m2")
    fleet.commands.clear()
    out = run_incident(c, [alert("rank_exit", "m2", rank=2)], monkeypatch)
    assert out["result"]["repeat_offender"] == "m2" and "repeat offender" in out["result"]["evict"]["reason"]
    assert not fleet.sent("diag")  # swapped at once, no third diagnosis
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m4", "m3"] and out["closed"]["state"] == "resolved"


# ---- the restart at once ---------------------------------------------------------------------------------------
def _launches(c, incident: int) -> list:
    return [a for a in c.fleet.actions(incident) if a.kind == "launch" and a.outcome == "done"]


def test_a_first_crash_is_restarted_at_once_by_its_rung_with_only_the_crashed_machines_l1_beside_it(
        tmp_path, monkeypatch):
    """Every crash paid a stop-time diagnosis of every machine (L2 and L3 on all of them, 7.5 s of an 11.5 s
    recovery) before a restart in place that changed nothing."""
    c, fleet = fleet_controller(tmp_path)
    _crashed_first_on(fleet, "m2")
    out = run_incident(c, [alert("rank_exit", "m2", rank=2)], monkeypatch)
    assert out["decision"]["action"] == "restart" and out["result"]["rung"] == "restart_at_once"
    assert out["result"]["check"]["machines"] == ["m2"] and not out["result"]["check"]["failed"]
    assert fleet.sent("diag") == ["m2"]  # L1 of the crashed machine, nothing of the others
    diag = [argv for m, argv in fleet.commands if argv[:1] == ["diag"]]
    assert diag == [["diag", "--level", "1"]]
    # the rung stopped and started the job itself: stop_job left it, restart_job took the rung's restart as its own
    assert out["result"]["stop"]["by_rung"] and out["result"]["stop"]["skipped"]
    assert out["result"]["recovery"]["by_rung"] == "restart_at_once" and len(_launches(c, out["incident"])) == 1
    start_at = next(i for i, (_m, argv) in enumerate(fleet.commands) if argv[:2] == ["job", "start"])
    diag_at = next(i for i, (_m, argv) in enumerate(fleet.commands) if argv[:1] == ["diag"])
    assert start_at < diag_at  # the check runs beside the restore, not before it
    assert out["closed"]["state"] == "resolved" and c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]


def test_a_failed_check_beside_the_restore_takes_the_stop_time_diagnosis_which_evicts(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path)
    _crashed_first_on(fleet, "m2")
    fleet.l1["m2"] = "gpu: 1 of 1 GPUs answer no query"
    out = run_incident(c, [alert("rank_exit", "m2", rank=2)], monkeypatch)
    assert out["result"]["check"]["failed"].keys() == {"m2"}
    assert out["result"]["diagnosis"]["failed"].keys() == {"m2"}  # every machine diagnosed, m2 failed
    assert set(fleet.sent("diag", "--level", "2")) == {"m0", "m1", "m2", "m3"}
    assert out["result"]["evict"]["machines"] == ["m2"] and out["result"]["relaunched"] is None
    # two launches: the rung's, which the diagnosis stopped, and restart_job's with the standby (not a re-run of it)
    assert len(_launches(c, out["incident"])) == 2 and not out["result"]["recovery"].get("again")
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m4", "m3"] and out["closed"]["state"] == "resolved"


def test_a_crash_again_after_its_restart_at_once_reaches_the_stop_time_diagnosis(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, escalation_window_s=600.0)
    _crashed_first_on(fleet, "m1")
    first = run_incident(c, [alert("rank_exit", "m1", rank=1)], monkeypatch)
    assert first["decision"]["action"] == "restart" and first["closed"]["state"] == "resolved"
    fleet.commands.clear()
    _crashed_first_on(fleet, "m3")  # the same crash again, first on another rank
    again = run_incident(c, [alert("rank_exit", "m3", rank=3)], monkeypatch)
    assert (again["decision"]["level"], again["decision"]["action"]) == (1, "diagnose")
    assert again["result"]["rung"] == "stop_time_diagnosis"
    assert set(fleet.sent("diag", "--level", "2")) == {"m0", "m1", "m2", "m3"}


def test_restart_job_run_again_after_it_took_the_rungs_restart_restarts_the_job_again(tmp_path, monkeypatch):
    """Cleared in the UI, restart_job does what it says: it starts the job again, not hands back the rung's
    restart a second time."""
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path)
    _crashed_first_on(fleet, "m2")
    out = run_incident(c, [alert("rank_exit", "m2", rank=2)], monkeypatch)
    result = {k: v for k, v in out["result"].items() if k not in ("stop", "swap", "recovery")}
    again = steps.restart_job(c, out["incident"], [result], out["result"]["stop"], out["result"]["swap"])
    assert again["again"] and again["restarted"] and len(_launches(c, out["incident"])) == 2


def test_crashes_that_start_on_different_machines_make_no_repeat_offender(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, escalation_window_s=0.0)
    for first in ("m1", "m2", "m3"):
        _crashed_first_on(fleet, first)
        out = run_incident(c, [alert("rank_exit", first, rank=int(first[1]))], monkeypatch)
        assert out["closed"]["state"] == "resolved" and "repeat_offender" not in out["result"]
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]


def test_a_rank_slowed_by_a_third_of_its_step_is_voted_out_after_the_throughput_declines(tmp_path, monkeypatch):
    """A rank slowed by 30% of a step raised nothing (rank_slow needs 2.5x the median): the agents now report
    the job's throughput decline, and the vote localises the rank by its compute time."""
    c, fleet = fleet_controller(tmp_path, slow_rounds=5, slow_interval_s=0.0)
    fleet.compute = {r: 0.36 for r in range(4)} | {1: 0.36 + 0.18}  # 0.18 s = 30% of a 0.6 s step
    declines = [alert("throughput_decline", f"m{r}", rank=r, decline=0.22) for r in range(4)]
    out = run_incident(c, declines, monkeypatch)
    assert (out["decision"]["category"], out["decision"]["action"]) == ("slow", "vote")
    vote = out["result"]["vote"]
    assert all(r == [1] for r in vote["rounds"]) and vote["machines"] == ["m1"]
    assert c.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"] and out["closed"]["state"] == "resolved"


def test_a_slow_group_that_cannot_be_replaced_is_not_stopped_and_later_alerts_open_incidents_of_their_own(
        tmp_path, monkeypatch):
    """A slow job still trains: with no standby to take the slow machine (or the breaker against it), the
    vote's eviction cannot happen, so the job is neither stopped nor left to a human behind a waiting
    incident that would swallow the next fault; the incident closes failed and says why."""
    c, fleet = fleet_controller(tmp_path, machines=4, active=4, slow_rounds=5, slow_interval_s=0.0)
    fleet.compute = {r: 0.36 for r in range(4)} | {1: 0.6}
    out = run_incident(c, [alert("throughput_decline", f"m{r}", rank=r) for r in range(4)], monkeypatch)
    assert out["result"]["vote"]["machines"] == ["m1"] and not fleet.sent("job", "stop")
    inc = c.fleet.incident(out["incident"])
    assert inc.state == "failed" and c.fleet.job("j").state == "running", (inc.state, inc.summary)
    assert "(m1) was not evicted: 1 machines to replace (m1), 0 standbys in the pool" in inc.summary, inc.summary
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]
    assert not [a for a in c.fleet.actions(inc.id) if a.kind == "evict"]
    # the next fault is an incident of its own, acted on
    [later] = c.ingest([alert("gpu_lost", "m2")])
    assert later["incident"] != inc.id


def test_a_decline_every_rank_shares_evicts_nothing(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, slow_rounds=5, slow_interval_s=0.0)
    fleet.compute = {r: 0.5 + 0.01 * r for r in range(4)}  # the whole job slowed (a slow file system ...)
    use_controller(monkeypatch, c)
    assert c.ingest([alert("throughput_decline", f"m{r}", rank=r) for r in range(4)]) == []  # no incident opens
    assert c.fleet.incidents("j") == [] and not fleet.sent("job", "stop")
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]
    # nor does the vote evict anyone when one opened (a rank stood out for a moment, then the whole job slowed)
    fleet.compute[3] = 0.9
    [item] = c.ingest([alert("throughput_decline", f"m{r}", rank=r, ts=time.time() + 1) for r in range(4)])
    fleet.compute[3] = 0.53
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    decision = steps.triage(c, item["incident"])
    vote = rungs.handle(c, steps.choose(decision), decision)
    assert vote["vote"]["machines"] == [] and not fleet.sent("job", "stop")


DEMO = Topology(tp=2, pp=2, dp=2)  # m0..m3 hold ranks 0,1 | 2,3 | 4,5 | 6,7; m0 and m3 keep each other's replicas


def _two_fail_l2(tmp_path, *, remote: bool = True, older_in_remote: int | None = None):
    from tests.fakes import replicated_copies
    from trainguard.checkpoint.s3 import open_tier

    url = f"file://{tmp_path / 'remote'}"
    c, fleet = fleet_controller(tmp_path, topology=DEMO,
                                train_args=["--checkpoint", *(["--checkpoint-remote", url] if remote else [])])
    fleet.copies = replicated_copies(DEMO, ["m0", "m1", "m2", "m3"], [237, 238])
    if older_in_remote is not None:
        for r in range(DEMO.world_size):
            open_tier(url).upload_copy(older_in_remote, r, [], b"{}")
    fleet.l2 = {"m0": "3 wrong results", "m3": "3 wrong results"}  # they fail diagnosis together
    return c, fleet, url


def test_an_eviction_that_would_take_every_copy_of_a_rank_rescues_them_to_the_remote_tier_first(tmp_path, monkeypatch):
    """Two machines that held each other's replicas failed L2 and were both evicted: the restart found no
    copy of ranks 0, 1, 6, 7 and the job died with all its progress, while the copies sat on their disks."""
    from trainguard.checkpoint.s3 import open_tier

    c, fleet, url = _two_fail_l2(tmp_path)
    out = run_incident(c, [alert("nan_loss", "m1", rank=2)], monkeypatch)  # diagnosed at once
    evict = next(a for a in c.fleet.actions(out["incident"]) if a.kind == "evict")
    kept = evict.evidence["checkpoint"]
    assert evict.outcome == "done" and sorted(evict.machines) == ["m0", "m3"]
    assert kept["step"] == 238 and kept["safe"]
    assert kept["rescued"] == {"m0": [0, 1, 6, 7]}  # one source per rank is enough
    assert {(s, r) for s, r in open_tier(url).list_copies()} >= {(238, r) for r in (0, 1, 6, 7)}
    rescue_at = next(i for i, (m, argv) in enumerate(fleet.commands) if argv[:2] == ["ckpt", "rescue"])
    start_at = next(i for i, (m, argv) in enumerate(fleet.commands) if argv[:2] in (["job", "start"],
                                                                                  ["standby", "activate"]))
    assert rescue_at < start_at  # the copies left before their machines did
    assert out["closed"]["state"] == "resolved" and c.fleet.job("j").machine_list == ["m4", "m1", "m2", "m5"]


def test_the_eviction_reads_and_rescues_to_s3_through_the_s3_connection_not_the_processs_environment(
        tmp_path, monkeypatch, s3_endpoint):
    """The control plane's S3 keys and endpoint are its Airflow connection's (``tg_s3``): the listing of the
    remote copies and the rescue command handed to the machines use them, whatever the Airflow process's own
    ``AWS_*`` variables and ``TG_S3_ENDPOINT_URL`` say (here: other keys and an endpoint nobody listens on)."""
    import json

    import boto3

    from tests.fakes import replicated_copies
    from trainguard.checkpoint.s3 import open_tier

    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="evict-rescue")
    url = "s3://evict-rescue/j"
    monkeypatch.setenv("AIRFLOW_CONN_TG_S3", json.dumps({
        "conn_type": "aws", "login": "conn-key", "password": "conn-secret",
        "extra": {"endpoint_url": s3_endpoint, "region_name": "eu-west-1"}}))
    monkeypatch.setenv("TG_S3_ENDPOINT_URL", "http://127.0.0.1:9")  # discard port: nothing answers
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "process-key")
    c, fleet = fleet_controller(tmp_path, topology=DEMO, train_args=["--checkpoint", "--checkpoint-remote", url])
    fleet.copies = replicated_copies(DEMO, ["m0", "m1", "m2", "m3"], [237, 238])
    fleet.l2 = {"m0": "3 wrong results", "m3": "3 wrong results"}
    out = run_incident(c, [alert("nan_loss", "m1", rank=2)], monkeypatch)  # diagnosed at once
    kept = next(a for a in c.fleet.actions(out["incident"]) if a.kind == "evict").evidence["checkpoint"]
    assert kept["safe"] and kept["rescued"] == {"m0": [0, 1, 6, 7]}, kept
    [(_m, argv, env)] = [e for e in fleet.envs if e[1][:2] == ["ckpt", "rescue"]]
    assert argv[argv.index("--endpoint-url") + 1] == s3_endpoint
    assert env == {"AWS_ACCESS_KEY_ID": "conn-key", "AWS_SECRET_ACCESS_KEY": "conn-secret",
                   "AWS_DEFAULT_REGION": "eu-west-1"}
    assert {(238, r) for r in (0, 1, 6, 7)} <= set(open_tier(url, endpoint_url=s3_endpoint).list_copies())


def test_an_eviction_that_cannot_rescue_falls_back_to_the_newest_step_complete_without_the_machines(
        tmp_path, monkeypatch):
    c, fleet, _url = _two_fail_l2(tmp_path, older_in_remote=230)
    fleet.rescue_fails = True
    out = run_incident(c, [alert("nan_loss", "m1", rank=2)], monkeypatch)  # diagnosed at once
    kept = next(a for a in c.fleet.actions(out["incident"]) if a.kind == "evict").evidence["checkpoint"]
    assert not kept["safe"] and kept["fallback"] == 230 and "restarts from step 230" in kept["reason"]
    assert c.fleet.job("j").machine_list == ["m4", "m1", "m2", "m5"]


def test_an_eviction_that_would_destroy_the_jobs_progress_is_refused_and_waits_for_a_human(tmp_path, monkeypatch):
    c, _fleet, _url = _two_fail_l2(tmp_path, remote=False)
    out = run_incident(c, [alert("nan_loss", "m1", rank=2)], monkeypatch)  # diagnosed at once
    inc = c.fleet.incident(out["incident"])
    assert inc.state == "waiting_human" and "would destroy the job's progress" in inc.summary
    assert "rank(s) [0, 1, 6, 7] have copies only on m0, m3" in inc.summary
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]  # nothing evicted: the copies stay
    assert c.fleet.machine("m0").state == "active" and c.fleet.machine("m4").state == "standby"


def test_a_single_eviction_keeps_every_replica_and_rescues_nothing(tmp_path, monkeypatch):
    from tests.fakes import replicated_copies

    c, fleet = fleet_controller(tmp_path, topology=DEMO)
    fleet.copies = replicated_copies(DEMO, ["m0", "m1", "m2", "m3"], [238])
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    kept = next(a for a in c.fleet.actions(out["incident"]) if a.kind == "evict").evidence["checkpoint"]
    assert kept == {"step": 238, "safe": True, "unanswered": [], "reason": kept["reason"]}
    assert not fleet.sent("ckpt", "rescue") and not fleet.sent("ckpt", "list")  # the stop's answer said it all


def test_a_two_two_split_of_the_alignment_test_is_broken_by_a_standbys_digest_not_by_order(tmp_path, monkeypatch):
    """Two machines computing wrong out of four: the digests split 2-2, and the two healthy machines were
    evicted as "different from the rest"."""
    c, fleet = fleet_controller(tmp_path, topology=DEMO)
    fleet.digests = {"m0": "good", "m1": "bad", "m2": "bad", "m3": "good", "m4": "good", "m5": "good"}
    out = run_incident(c, [alert("nan_loss", f"m{i}", rank=2 * i) for i in range(4)], monkeypatch)
    diag = out["result"]["diagnosis"]
    assert diag["report"]["align_reference"] == "good" and sorted(diag["failed"]) == ["m1", "m2"]
    assert sorted(fleet.sent("align")) == ["m4", "m5"]  # the reference: self-checked standbys
    assert c.fleet.job("j").machine_list == ["m0", "m4", "m5", "m3"]


def test_a_tie_with_no_reference_evicts_nobody(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, topology=DEMO, machines=4)  # no standby to ask
    fleet.digests = {"m0": "good", "m1": "bad", "m2": "bad", "m3": "good"}
    out = run_incident(c, [alert("nan_loss", f"m{i}", rank=2 * i) for i in range(4)], monkeypatch)
    diag = out["result"]["diagnosis"]
    assert diag["failed"] == {} and "never by order" in diag["report"]["align_inconclusive"]
    assert not [a for a in c.fleet.actions() if a.kind == "evict"]
    assert c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]


def test_the_alignment_verdict_trusts_a_strict_majority_or_a_matching_reference():
    from trainguard.operators.policy.sdc import align_outliers

    assert align_outliers({"a": "x", "b": "x", "c": "y"})[:2] == ("x", ["c"])
    assert align_outliers({"a": "x", "b": "y"})[:2] == (None, [])
    assert align_outliers({"a": "x", "b": "x", "c": "y", "d": "y"}, reference="y")[:2] == ("y", ["a", "b"])
    assert align_outliers({"a": "x", "b": "x", "c": "y", "d": "y"}, reference="z")[:2] == (None, [])
    assert align_outliers({"a": None, "b": None, "c": "x"})[:2] == (None, [])  # two failed runs are no majority


# ---- a recovery that fails climbs on; it never leaves a job dead and unreported ----------------------------
def test_a_standby_that_does_not_answer_is_sent_to_repair_and_the_next_one_taken(tmp_path, monkeypatch):
    """With the first standby's sshd gone, a lost GPU was evicted onto it without a check; the launch
    failed, the incident ended failed, the job stopped training."""
    c, fleet = fleet_controller(tmp_path)
    fleet.unreachable.add("m4")
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    assert out["closed"]["state"] == "resolved" and c.fleet.job("j").machine_list == ["m0", "m5", "m2", "m3"]
    assert c.fleet.machine("m4").state == "repair" and "did not answer" in c.fleet.machine("m4").reason
    assert not fleet.sent("job", "start") or "m4" not in fleet.sent("job", "start")


def test_a_silent_standby_is_passed_over_at_the_speed_of_a_probe_and_judged_when_the_incident_closes(
        tmp_path, monkeypatch):
    """A standby whose NIC died as it was called: its probe got no answer until the SSH connection timed out
    (14.8 s of a 25.7 s recovery, against 8.9 s for a clean lost GPU). The standbys are asked at once; once
    enough answered, the silent one is passed over and the job restarts on the next; the incident's close
    asks it again with the whole timeout and sends it to repair."""
    import threading

    from trainguard.operators.control import evictions

    c, fleet = fleet_controller(tmp_path)
    released, answered = threading.Event(), threading.Event()
    launched_while_silent: list[bool] = []
    real = fleet.run

    def run(machine, argv, **kw):
        if machine.name == "m4" and list(argv[1:3]) == ["standby", "status"]:
            released.wait(10)  # no answer until its connection gives up: what a dead NIC does
            answered.set()
            return RunResult("m4", list(argv), 255, "", "m4: TimeoutError: timed out", 0.01, reachable=False)
        if list(argv[1:3]) == ["job", "start"]:
            launched_while_silent.append(not answered.is_set())
            released.set()  # from now on m4's connection fails at once
        return real(machine, argv, **kw)

    monkeypatch.setattr(fleet, "run", run)
    monkeypatch.setattr(evictions, "PROBE_GRACE_S", 0.05)
    try:
        out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    finally:
        released.set()
    assert launched_while_silent[:1] == [True]  # the restart began before m4 answered: it did not wait for it
    assert out["closed"]["state"] == "resolved" and c.fleet.job("j").machine_list == ["m0", "m5", "m2", "m3"]
    [evict] = [a for a in c.fleet.actions(out["incident"]) if a.kind == "evict"]
    assert evict.evidence["passed_over"] == ["m4"] and evict.evidence["standbys"] == ["m5"]
    m4 = c.fleet.machine("m4")
    assert m4.state == "repair" and "passed over" in m4.reason and "timed out" in m4.reason


def test_the_standbys_probe_settles_on_the_order_when_it_can_and_on_the_grace_when_one_is_silent():
    from trainguard.operators.control.evictions import probe_settled

    order = ["s0", "s1", "s2", "s3"]
    assert probe_settled(order, {}, 2, 0.0) == 15.0  # nothing in: wait for answers
    assert probe_settled(order, {"s0": True, "s1": True}, 2, 0.1) is None  # the first two answered well
    assert probe_settled(order, {"s1": True, "s2": True}, 2, 0.5) == 1.5  # s0 silent: its grace
    assert probe_settled(order, {"s1": True, "s2": True}, 2, 2.0) is None  # past it: s0 passed over
    assert probe_settled(order, {"s0": False, "s1": True, "s2": True}, 2, 0.1) is None  # s0 answered badly
    assert probe_settled(order, {"s0": False, "s1": False, "s2": True}, 2, 3.0) == 12.0  # one good: wait
    assert probe_settled(order, dict.fromkeys(order, False), 2, 0.1) is None  # all in
    assert probe_settled(order, {"s2": True}, 1, 20.0) is None  # past the timeout


def test_a_standby_that_breaks_as_it_joins_is_replaced_and_the_launch_tried_again(tmp_path, monkeypatch):
    """A standby whose NIC went down as it was swapped in: the launch failed and the incident ended failed
    while four healthy standbys were parked."""
    c, fleet = fleet_controller(tmp_path, machines=8)
    fleet.start_fails["m4"] = "machine m4: job j exited at once (code 1): NIC eth0 is down"
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    assert out["closed"]["state"] == "resolved", c.timeline(out["incident"])
    assert c.fleet.job("j").machine_list == ["m0", "m5", "m2", "m3"]
    evictions = [(a.machines, a.outcome, a.evidence["breaker"]) for a in c.fleet.actions(out["incident"])
                 if a.kind == "evict"]
    assert evictions[0][:2] == (["m1"], "done") and evictions[1] == (["m4"], "done", "not applied (failed to start)")
    assert c.fleet.machine("m4").state == "evicted" and out["result"]["recovery"]["replaced"] == {"m4": "m5"}


def test_a_benign_alert_while_the_job_is_down_is_handled_as_the_crash_it_is(tmp_path, monkeypatch):
    """The broken standby's own network alert was tolerated as the job's first network alert, and its
    incident closed resolved while the job was not running."""
    c, fleet = fleet_controller(tmp_path)
    fleet.running.pop("m2")  # its part of the job is gone
    fleet.l1["m2"] = "nic_down: eth0 has no carrier"  # L1 runs the real-time checks: the link among them
    out = run_incident(c, [alert("nic_down", "m2", rank=None, job="j", iface="eth0")], monkeypatch)
    # a first crash: restarted at once, but L1 of m2 beside the restore failed, so the stop-time diagnosis decided
    assert (out["decision"]["category"], out["decision"]["action"]) == ("crash", "restart")
    assert out["result"]["check"]["failed"] == {"m2": "L1: quick: nic_down: eth0 has no carrier"}
    assert out["result"]["diagnosis"]["failed"].keys() == {"m2"}
    assert "but the job does not run on m2" in c.fleet.incident(out["incident"]).summary
    assert out["closed"]["state"] == "resolved" and c.fleet.job("j").machine_list == ["m0", "m1", "m4", "m3"]


def test_a_restart_that_finds_no_step_to_restore_rescues_the_copies_and_restarts(tmp_path, monkeypatch):
    """The restart failed on every rank ('no step can be restored'), the incident ended failed, a second
    incident did the same, then nothing: the job was dead, the fleet database said running, and copies
    that would have restored it sat on the evicted machines."""
    from tests.fakes import replicated_copies

    url = f"file://{tmp_path / 'remote'}"
    c, fleet = fleet_controller(tmp_path, topology=DEMO, train_args=["--checkpoint", "--checkpoint-remote", url])
    fleet.copies = replicated_copies(DEMO, ["m0", "m1", "m2", "m3"], [238])
    fleet.restore_fails = True  # whatever the check before the eviction said, the restore finds nothing
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    assert out["resumed"]["failed"].startswith("job j ended on every machine after the restart without a step")
    inc = c.fleet.incident(out["incident"])
    assert inc.state == "resolved" and "after 1 more restart(s)" in inc.summary and "rescued" in inc.summary
    assert fleet.rescued and {m for m, _s, _r in fleet.rescued} == {"m1"}
    assert c.fleet.job("j").state == "running"


def test_a_recovery_that_keeps_failing_waits_for_a_human_and_says_so(tmp_path, monkeypatch):
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path, restart_attempts=2)
    fleet.restore_fails = True  # and there is nothing to rescue: no remote tier, no copies
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    inc = c.fleet.incident(out["incident"])
    assert inc.state == "waiting_human" and c.fleet.job("j").state == "waiting_human"
    assert "no step can be restored" in inc.summary and "next:" in inc.summary
    note = steps.incident_note(c, inc.id)
    assert note.startswith(f"incident {inc.id} waiting human (machine_fault)") and "next:" in note


# ---- alerts that join an incident are triaged again ------------------------------------------------------
def test_a_second_lost_gpu_that_joins_the_incident_is_evicted_in_the_same_restart(tmp_path, monkeypatch):
    """Two GPUs lost on two machines 0.2 s apart: both machines' alerts joined one incident, only the first
    was evicted, and the job restarted onto the second machine with its lost GPU."""
    c, fleet = fleet_controller(tmp_path)
    out = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch, joined=[alert("gpu_lost", "m2")])
    assert out["decision"]["machines"] == ["m1"]
    assert out["result"]["swap"]["joined"] == {"m2": "gpu_lost"}  # swap_machines evicts it with the rung's
    assert out["result"]["swap"]["swaps"] == {"m1": "m4", "m2": "m5"}
    assert c.fleet.job("j").machine_list == ["m0", "m4", "m5", "m3"] and out["closed"]["state"] == "resolved"
    assert len(fleet.sent("job", "start")) + len(fleet.sent("standby", "activate")) == 4  # one restart


def test_an_explicit_fault_that_joins_after_the_restart_is_acted_on_before_the_incident_closes(tmp_path, monkeypatch):
    """A full disk made the job look hung; a GPU lost on another machine joined the incident and was never
    acted on."""
    c, fleet = fleet_controller(tmp_path, machines=8, breaker_share=0.75)  # the hang's pipeline, then m2
    fleet.process_state[1] = "T"
    out = run_incident(c, [alert("rank_stopped", "m1", rank=1)], monkeypatch,
                       joined_late=[alert("gpu_lost", "m2")])
    assert out["decision"]["action"] == "analyze" and out["resumed"] == {"pending": {"m2": "gpu_lost"}}
    inc = c.fleet.incident(out["incident"])
    assert inc.state == "resolved", c.timeline(inc.id)
    machines = c.fleet.job("j").machine_list
    assert "m2" not in machines and "m1" not in machines and "evicted m2" in inc.summary


# ---- diagnosis that is robust to load -----------------------------------------------------------------
def test_healthy_machines_measured_under_load_pass_by_their_peers_and_a_failed_reading_is_repeated(
        tmp_path, monkeypatch):
    """Two healthy machines failed L2 on a 0.5 GB/s floor measured while four diagnoses shared two cores,
    and the ladder evicted them on that one reading."""
    c, fleet = fleet_controller(tmp_path)
    fleet.gbps = {"m0": [0.3, 2.6], "m1": [0.35], "m2": [0.32], "m3": [0.04, 2.4]}  # all slow; m3 far below
    out = c.diagnose("j", levels=(1, 2, 3))
    l2 = out["report"]["L2"]
    assert out["failed"] == {}, out
    assert "peers' median" in l2["m1"]["forgiven"] and "peers' median" in l2["m0"]["forgiven"]
    assert l2["m3"]["again"] and l2["m3"]["healthy"]  # 0.04 is far below its peers: run again alone, passed
    alone = [m for m, argv in fleet.commands if argv[:3] == ["diag", "--level", "2"] and "--rank" not in argv]
    assert alone == ["m3"]


def test_a_machine_far_below_its_peers_twice_or_computing_wrong_twice_fails(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path)
    fleet.gbps = {"m0": [0.05], "m1": [2.5], "m2": [2.7], "m3": [2.6]}
    fleet.l2 = {"m2": "cpu: 3 of 40 float32 matmul results wrong"}
    fleet.l2_once = {"m1": "cpu: 1 of 40 float32 matmul results wrong"}  # once only: passes when repeated
    out = c.diagnose("j", levels=(1, 2, 3))
    assert sorted(out["failed"]) == ["m0", "m2"], out
    assert "below the floor" in out["failed"]["m0"] and "matmul results wrong" in out["failed"]["m2"]
    assert out["report"]["L2"]["m1"]["healthy"] and out["report"]["L2"]["m1"]["again"]


def test_diagnosis_runs_at_most_diag_concurrency_machines_at_once(tmp_path, monkeypatch):
    c, fleet = fleet_controller(tmp_path, diag_concurrency=2)
    batches: list[list[str]] = []
    real = fleet.run_many

    def counted(machines, argv_for, **kwargs):
        batches.append(sorted(m.name for m in machines))
        return real(machines, argv_for, **kwargs)

    monkeypatch.setattr(fleet, "run_many", counted)
    assert c.diagnose("j", levels=(1,))["failed"] == {}
    assert batches == [["m0", "m1"], ["m2", "m3"]]
    batches.clear()
    assert c.diagnose("j", levels=(2, 3))["failed"] == {}
    assert batches == [["m0", "m1"], ["m2", "m3"]]  # whole pairs: each meets at its collective


def test_the_peer_judgement_forgives_shared_slowness_only():
    from trainguard.operators.control.diagnosis import forgiven_by_peers

    def doc(gbps: float, *, wrong: bool = False) -> dict:
        return {"tests": [{"name": "compute", "ok": not wrong, "reason": "2 results wrong" if wrong else ""},
                          {"name": "memory", "ok": gbps >= 0.5, "details": {"gbps": gbps},
                           "reason": "" if gbps >= 0.5 else f"cpu: copy bandwidth {gbps} GB/s is below the floor"}]}

    assert sorted(forgiven_by_peers({"a": doc(0.3), "b": doc(0.4), "c": doc(0.35)})) == ["a", "b", "c"]
    assert forgiven_by_peers({"a": doc(0.1), "b": doc(2.0), "c": doc(2.2)}) == {}  # far below its peers
    assert forgiven_by_peers({"a": doc(0.3, wrong=True), "b": doc(0.3)}) == {"b": forgiven_by_peers(
        {"a": doc(0.3, wrong=True), "b": doc(0.3)})["b"]}  # a wrong result is never forgiven
    assert forgiven_by_peers({"a": doc(0.3)}) == {}  # no peer: the floor stands


def test_an_explicit_fault_that_joins_before_the_rung_acts_decides_the_incident(tmp_path, monkeypatch):
    """A full disk made ranks look hung; its explicit alert joined the hang's incident before the analysis
    acted: the first rung decides, and only the faulty machine is evicted."""
    c, fleet = fleet_controller(tmp_path)
    out = run_incident(c, [alert("rank_hang", "m1", rank=1), alert("rank_hang", "m3", rank=3)], monkeypatch,
                       joined=[alert("disk_full", "m1")])
    assert out["decision"]["action"] == "analyze"
    assert out["result"]["swap"]["swaps"] == {"m1": "m4"} and not fleet.sent("stacks")  # no analysis: the fault
    # explains it
    inc = c.fleet.incident(out["incident"])
    assert inc.category == "machine_fault" and inc.state == "resolved"
    assert c.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"]


def test_an_update_that_skipped_its_rearm_for_an_open_incident_is_rearmed_when_that_incident_ends(
        tmp_path, monkeypatch):
    """A hot update consumed the job's warm interpreters while a slowdown's incident was open: the update's
    run left the re-arm to the incident's run, which re-armed only after a restart of its own. The
    incident closed without one, and the job's next restart would have started cold."""
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path)
    use_controller(monkeypatch, c)
    c.fleet.set_job_state("j", "running")
    fleet.compute[1] = 0.9
    [opened] = c.ingest([alert("rank_slow", "m1", rank=1)])
    fleet.parked -= {"m0", "m1", "m2", "m3"}  # the update restarted the job on them
    from trainguard.operators.tasks import code_update

    skipped = code_update.code_rearm(c, {"restarts": [{"job": "j"}]})["j"]
    assert skipped == {"skipped": f"incident {opened['incident']} of job j is open; its run re-arms when it ends"}
    assert not fleet.sent("standby", "park")
    # a second incident opened before the first run's re-arm: that one re-arms when it ends, not both at once
    c.close(opened["incident"], outcome="resolved", note="nothing evicted")
    [second] = c.ingest([alert("kernel_xid", "m2", xid=79)])
    assert second["incident"] != opened["incident"]
    assert steps.rearm(c, opened["incident"]) == {
        "skipped": f"incident {second['incident']} of job j is open; its run re-arms when it ends"}
    c.close(second["incident"], outcome="resolved", note="nothing evicted")
    armed = steps.rearm(c, second["incident"])  # no restart in this run either
    assert armed["parked"] == ["m0", "m1", "m2", "m3"] and armed["failed"] == {}
    assert sorted(fleet.sent("standby", "park")) == ["m0", "m1", "m2", "m3"]
    # repeating it parks nothing more
    steps.rearm(c, second["incident"])
    assert len(fleet.sent("standby", "park")) == 4


def test_clearing_restart_job_of_an_incident_the_breaker_stopped_judges_the_eviction_again_and_acts(
        tmp_path, monkeypatch):
    """Clearing restart_job of an incident that waited for a human (the docs' remedy once the breaker's share was
    raised) only replayed the decision it had recorded: 'restarted: False, waiting_human: True'."""
    from trainguard.operators.control import Controller
    from trainguard.operators.tasks import incident as steps

    c, fleet = fleet_controller(tmp_path, breaker_share=0.25)  # one machine of four an hour, or one per spare
    first = run_incident(c, [alert("gpu_lost", "m1")], monkeypatch)
    assert first["closed"]["state"] == "resolved" and c.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"]
    out = run_incident(c, [alert("gpu_lost", "m2")], monkeypatch)  # one standby left: the breaker says no
    inc = c.fleet.incident(out["incident"])
    assert inc.state == "waiting_human" and "raise TG_BREAKER_SHARE" in inc.summary
    assert c.fleet.job("j").machine_list == ["m0", "m4", "m2", "m3"]
    # the operator raises the share and clears restart_job: the eviction is judged again, and the job restarts
    raised = Controller(c.cfg.model_copy(update={"breaker_share": 1.0}), inventory=c.inventory, transport=fleet)
    use_controller(monkeypatch, raised)
    result = {k: v for k, v in out["result"].items() if k not in ("stop", "swap", "recovery")}
    recovery = steps.restart_job(raised, out["incident"], [result], out["result"]["stop"], out["result"]["swap"])
    assert recovery["restarted"] and raised.fleet.job("j").machine_list == ["m0", "m4", "m5", "m3"]
    resumed = next(r for r in (steps.resumed(raised, out["incident"], recovery) for _ in range(20)) if r is not None)
    closed = steps.close(raised, out["incident"], None, recovery, resumed)
    assert closed["state"] == "resolved" and raised.fleet.job("j").state == "running"


def test_a_pause_of_the_jobs_own_that_passed_before_the_stacks_is_left_alone(tmp_path, monkeypatch):
    """A job's first evaluation on rank 1, outside a step, outlasted the agents' 3 s floor: every rank reported a hang
    at step 10, rank 1's stack stood out (the others waited in the all-reduce). By the time the stacks were taken,
    every rank had stepped on: no eviction, no stop, the incident resolved."""
    c, fleet = fleet_controller(tmp_path)
    fleet.frames[1] = ["evaluate", "main"]
    fleet.step = 12
    out = run_incident(c, [alert("rank_hang", f"m{r}", rank=r, step=10) for r in range(4)], monkeypatch)
    assert out["decision"]["action"] == "analyze" and fleet.sent("stacks")
    assert out["result"]["analysis"]["passed"] == 12 and "at step 12" in out["result"]["resolved"]
    assert out["result"]["no_restart"] and out["result"]["evict"] is None
    assert not fleet.sent("job", "stop") and c.fleet.job("j").machine_list == ["m0", "m1", "m2", "m3"]
    assert c.fleet.incident(out["incident"]).state == "resolved"


def test_a_stall_still_on_its_step_or_with_a_rank_unseen_is_a_hang(tmp_path):
    """The same stacks with the ranks still on the reported step (a hang), or with every seen rank past it but one
    machine not answering (a lost machine): the standing-out rank's group is evicted, as before."""
    from trainguard.operators.policy import ladder

    for step, unreachable in ((10, set()), (12, {"m3"})):
        c, fleet = fleet_controller(tmp_path / f"{step}")
        fleet.frames[1] = ["evaluate", "main"]
        fleet.step = step
        fleet.unreachable |= unreachable
        [item] = c.ingest([alert("rank_hang", f"m{r}", rank=r, step=10) for r in range(3)])
        a = c.analysis.analyze("j", item["incident"])
        assert a["passed"] is None and ladder.after_analysis("hang", a).kind == "evict", (step, a)
