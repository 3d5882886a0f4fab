"""The DAG files import cleanly in Airflow's DagBag, are wired as designed, and their forms validate."""

from __future__ import annotations

import pytest

from tests import REPO


@pytest.fixture(scope="module")
def dagbag(tmp_path_factory: pytest.TempPathFactory):
    import os

    os.environ.setdefault("AIRFLOW_HOME", str(tmp_path_factory.mktemp("airflow-home")))  # not ~/airflow
    from airflow.dag_processing.dagbag import DagBag

    bag = DagBag(dag_folder=str(REPO / "dags"))
    bag.get_dag = bag.dags.get  # parsed DAGs only; no metadata database
    return bag


def test_dag_files_import_without_errors(dagbag):
    assert dagbag.import_errors == {}
    assert {"tg_incident", "tg_reconcile", "tg_diagnose", "tg_sdc_replay", "tg_ettr", "tg_standby_pool"} <= set(
        dagbag.dag_ids)
    assert "tg_guardian" not in dagbag.dag_ids  # the alert watcher is tg_incident's asset watcher


def test_every_dag_is_created_unpaused_whatever_the_deployment_says(dagbag):
    """An Airflow trainguard did not start may create DAGs paused (``dags_are_paused_at_creation``, True by
    default): a guardian, a reconciler or an incident DAG that waits paused guards nothing."""
    ours = [d for d in dagbag.dags.values() if "trainguard" in d.tags]
    assert len(ours) == len(list((REPO / "dags").glob("tg_*.py")))
    assert all(d.is_paused_upon_creation is False for d in ours), [d.dag_id for d in ours]


def test_replay_dag_runs_its_phases_in_turn_and_always_restarts_the_job(dagbag):
    dag = dagbag.get_dag("tg_sdc_replay")
    assert [t.task_id for t in dag.get_task("prepare").downstream_list] != []
    assert {t.task_id for t in dag.get_task("horizontal").downstream_list} == {"vertical", "conclude"}
    assert dag.get_task("vertical").upstream_task_ids == {"prepare", "horizontal"}
    conclude = dag.get_task("conclude")
    assert conclude.trigger_rule == "all_done" and conclude.upstream_task_ids == {"prepare", "horizontal", "vertical"}
    assert dag.max_active_runs == 1 and set(dag.params.keys()) == {"job", "k", "evict"}


def test_the_alert_bus_and_the_reconciler_are_watched_by_asset_watchers_whose_events_start_the_runs(dagbag):
    """No task waits in a sensor for alerts or findings: tg_incident runs on the ``trainguard-alerts`` asset (its
    watcher, the alert trigger, emits each batch), tg_reconcile on ``trainguard-reconcile``; each can be triggered
    by hand too (tg_incident with the incident to handle)."""
    incident = dagbag.get_dag("tg_incident")
    (alerts,) = incident.timetable.asset_condition.objects
    assert alerts.name == "trainguard-alerts"
    assert [(w.name, type(w.trigger).__name__) for w in alerts.watchers] == [("alert_bus", "AlertTrigger")]
    assert incident.max_active_runs >= 16 and incident.params["incident_id"] is None
    reconcile = dagbag.get_dag("tg_reconcile")
    (looks,) = reconcile.timetable.asset_condition.objects
    assert looks.name == "trainguard-reconcile"
    assert [type(w.trigger).__name__ for w in looks.watchers] == ["ReconcileTrigger"]
    assert reconcile.max_active_runs == 1 and [t.task_id for t in reconcile.tasks] == ["act"]


def test_incident_dag_branches_to_every_rung_of_the_registry_then_restarts_waits_and_closes(dagbag):
    from trainguard.operators.policy.rungs import BRANCHES, RUNGS
    from trainguard.operators.tasks.rungs import RUNG_ACTIONS

    dag = dagbag.get_dag("tg_incident")
    triage = dag.get_task("triage")  # records the batch and is the branch (one task hop less before every rung)
    assert type(triage).__name__ == "TriageOperator"
    rung_ids = {r.task_id for r in RUNGS}
    assert {t.task_id for t in triage.downstream_list} >= rung_ids | {"no_recovery"}
    # every rung of the registry has its function, and every function its rung
    assert set(RUNG_ACTIONS) == rung_ids and set(BRANCHES.values()) == rung_ids
    assert all(dag.get_task(r.task_id).doc_md == r.does for r in RUNGS)
    # the fast path is a rung of the graph like the others, not a side door: a first crash's branch
    assert BRANCHES["restart"] == "restart_at_once" and dag.get_task("restart_at_once") in triage.downstream_list
    # a rung whose wait runs in the triggerer is a deferrable operator (the slow vote's rounds)
    assert {r.task_id for r in RUNGS if r.deferred} == {"slow_vote", "silent_corruption"}
    assert type(dag.get_task("slow_vote")).__name__ == "SlowVoteOperator"
    assert type(dag.get_task("silent_corruption")).__name__ == "SilentCorruptionOperator"
    # stop, swap and restart are tasks of their own after every rung, each from the XCom of the ones before
    stop, swap, restart = (dag.get_task(t) for t in ("stop_job", "swap_machines", "restart_job"))
    assert stop.upstream_task_ids == rung_ids | {"triage"}
    assert swap.upstream_task_ids == rung_ids | {"stop_job", "triage"}
    assert restart.upstream_task_ids == rung_ids | {"stop_job", "swap_machines", "triage"}
    assert {t.trigger_rule for t in (stop, swap, restart)} == {"none_failed_min_one_success"}
    # the deferred tasks are tried again when the scheduler fails a deferral it raced (see the DAG file)
    assert all(dag.get_task(t).retries == 2 for t in ("slow_vote", "silent_corruption", "wait_for_resume",
                                                      "close_incident"))
    wait = dag.get_task("wait_for_resume")
    assert type(wait).__name__ == "ResumeSensor" and wait.upstream_task_ids == {"restart_job"}
    assert [t.task_id for t in wait.downstream_list] == ["close_incident"]
    assert dag.get_task("close_incident").upstream_task_ids == {"no_recovery", "restart_job", "wait_for_resume"}
    rearm = dag.get_task("rearm_job")  # warm interpreters again, once the incident is closed, whatever happened
    assert rearm.trigger_rule == "all_done" and rearm.upstream_task_ids == {"close_incident", "triage"}
    last = dag.get_task("outcome")  # the run's colour: failed when the incident failed
    assert last.trigger_rule == "all_done" and last.upstream_task_ids == {"rearm_job", "triage"}
    assert last.downstream_list == []


def test_the_diagnose_form_refuses_bad_input(dagbag):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    dag = dagbag.get_dag("tg_diagnose")
    good = ParamsDict(dag.params)
    good.update({"job": "demo", "machines": ["m1"], "level": 3, "evict": False})
    good.validate()
    for bad in ({"machines": ["m1; rm -rf /"]}, {"level": 4}, {"job": "$(id)"}):
        params = ParamsDict(dag.params)
        with pytest.raises(ParamValidationError):
            params.update(bad)
            params.validate()


def test_diagnosis_fans_out_one_mapped_task_per_machine_in_the_ssh_pool(dagbag):
    dag = dagbag.get_dag("tg_diagnose")
    check = dag.get_task("check_machine")
    assert type(check).__name__.endswith("MappedOperator") and check.pool == "tg_ssh"
    assert check.upstream_task_ids == {"targets"}
    assert dag.get_task("neighbours").pool == "tg_ssh"
    assert dag.get_task("conclude").upstream_task_ids == {"check_machine", "neighbours"}


def test_the_standby_pool_dag_checks_each_machine_in_the_ssh_pool_and_always_concludes(dagbag):
    dag = dagbag.get_dag("tg_standby_pool")
    assert dag.max_active_runs == 1 and set(dag.params.keys()) == {"target"}
    check = dag.get_task("self_check")
    assert check.pool == "tg_ssh" and check.upstream_task_ids == {"machines"}
    conclude = dag.get_task("conclude")  # also when there is nothing to check (no mapped task at all)
    assert conclude.trigger_rule == "none_failed" and conclude.upstream_task_ids == {"plan", "self_check"}
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    params = ParamsDict(dag.params)
    with pytest.raises(ParamValidationError):
        params.update({"target": -5})
        params.validate()


def test_the_code_update_form_takes_an_urgency_of_its_enum_and_waits_for_training_before_rearming(dagbag):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    dag = dagbag.get_dag("tg_code_update")
    assert set(dag.params.keys()) == {"job", "revision", "urgency", "reason"} and dag.max_active_runs == 1
    assert dag.get_task("training_resumed").upstream_task_ids == {"update"}
    assert type(dag.get_task("training_resumed")).__name__ == "CodeResumeSensor"  # deferred: no worker held
    assert dag.get_task("rearm").upstream_task_ids == {"update", "training_resumed"}
    assert dag.get_task("rearm").trigger_rule == "all_done"
    # the run's last task: a failed update (or resume) fails the run, as the UI shows it
    assert dag.get_task("conclude").upstream_task_ids == {"update", "training_resumed", "rearm"}
    assert dag.get_task("conclude").downstream_list == []
    good = ParamsDict(dag.params)
    good.update({"job": "llm", "revision": "v1.2+fix", "urgency": "urgent", "reason": "loader fix"})
    good.validate()
    for bad in ({"urgency": "asap"}, {"revision": "r1; reboot"}, {"job": "$(id)"}):
        params = ParamsDict(dag.params)
        with pytest.raises(ParamValidationError):
            params.update(bad)
            params.validate()


def test_checkpoint_verification_runs_on_commit_events_and_a_schedule_and_always_concludes(dagbag):
    from airflow.sdk.definitions.param import ParamsDict
    from airflow.sdk.exceptions import ParamValidationError

    dag = dagbag.get_dag("tg_checkpoint_verify")
    assert dag.max_active_runs == 1 and set(dag.params.keys()) == {"job", "step"}
    timetable = dag.timetable  # the asset's watcher (commit notices) or every 30 minutes
    assert type(timetable).__name__ == "AssetOrTimeSchedule" and timetable.timetable.expression == "*/30 * * * *"
    (asset,) = timetable.asset_condition.objects
    assert asset.name == "trainguard-checkpoint-committed"
    assert [type(w.trigger).__name__ for w in asset.watchers] == ["CheckpointNoticeTrigger"]
    verify = dag.get_task("verify")
    assert type(verify).__name__.endswith("MappedOperator") and verify.pool == "tg_ssh"
    assert verify.upstream_task_ids == {"pick"} and dag.get_task("promote").upstream_task_ids == {"verify"}
    conclude = dag.get_task("conclude")  # says what happened also when a step failed its verification
    assert conclude.trigger_rule == "all_done" and conclude.upstream_task_ids == {"verify", "promote"}
    assert dag.get_task("outcome").upstream_task_ids == {"conclude"} and dag.get_task("outcome").downstream_list == []
    good = ParamsDict(dag.params)
    good.update({"job": "llm", "step": 1999})
    good.validate()
    for bad in ({"step": -1}, {"job": "a b"}, {"step": "latest"}):
        params = ParamsDict(dag.params)
        with pytest.raises(ParamValidationError):
            params.update(bad)
            params.validate()


def test_the_verification_schedule_follows_the_environment():
    from airflow.sdk import Asset

    from trainguard.operators.utils.schedules import asset_or_cron

    asset = Asset("a")
    env = {"TG_X_SCHEDULE": "", "TG_X_ON": "1"}
    import os

    def schedule() -> object:
        return asset_or_cron(asset, cron_variable="TG_X_SCHEDULE", cron_default="@daily", on_variable="TG_X_ON")

    old = {k: os.environ.get(k) for k in env}
    try:
        os.environ.update(env)
        assert schedule() == [asset]
        os.environ["TG_X_ON"] = "0"
        assert schedule() is None
        os.environ["TG_X_SCHEDULE"] = "@hourly"
        assert schedule() == "@hourly"
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
