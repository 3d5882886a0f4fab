"""tg_sdc_replay: dual-phase replay by hand, to find a machine that silently computes wrong (ByteRobust
§5.3). The job stops; its machines replay the same training steps in horizontal groups (whole replicas,
beside a reference group of self-checked standbys), then in vertical groups (shifted diagonals); the
culprit is in both a failing horizontal and a failing vertical group. With "evict", culprits are replaced
by standbys; the job then restarts from its newest committed checkpoint. An incident records the run.
tg_incident runs the same replay when the alignment test finds nothing."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Param, dag, task

from trainguard.operators.operators.replay import ReplayPhaseOperator
from trainguard.operators.utils.forms import job_param


@dag(dag_id="tg_sdc_replay", is_paused_upon_creation=False,
     schedule=None, start_date=datetime(2026, 1, 1), catchup=False, tags=["trainguard"],
     doc_md=__doc__, max_active_runs=1, params={
         "job": job_param("the job whose machines are replayed"),
         "k": Param(1, type="integer", minimum=1, description="replicas per replay group (must divide DP)"),
         "evict": Param(False, type="boolean", description="replace the culprits with standbys"),
     })
def tg_sdc_replay():
    @task
    def prepare(params: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import sdc_replay

        return sdc_replay.replay_prepare(task_controller(), params["job"], int(params["k"]))


    @task(trigger_rule="all_done")
    def conclude(plan: dict, h: dict | None = None, v: dict | None = None, params: dict | None = None) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import sdc_replay

        return sdc_replay.replay_conclude(task_controller(), plan, h, v, bool(params["evict"]))

    plan = prepare()
    # each phase's groups are launched, then watched in the triggerer (no worker held while they compute)
    h = ReplayPhaseOperator(task_id="horizontal", plan=plan, phase="horizontal")
    v = ReplayPhaseOperator(task_id="vertical", plan=plan, phase="vertical")
    h >> v  # the phases share machines: one after the other
    conclude(plan, h.output, v.output)


tg_sdc_replay()
