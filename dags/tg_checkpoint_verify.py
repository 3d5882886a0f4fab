"""tg_checkpoint_verify: checks committed checkpoints before anyone relies on them.

Runs when a job commits a verification candidate (the node agent's ``checkpoint_committed`` notice, turned
into an event of the asset ``trainguard-checkpoint-committed`` by its watcher in the triggerer;
``TG_VERIFY_ON_COMMIT=0`` turns that off), every 30 minutes for every running job
(``TG_VERIFY_SCHEDULE``), and by hand (job, step). For each step:

1. verify: every copy on every machine of the job (checksums, tensors, finite values; local and replica
   tiers) and the great-expectations checks of the training metrics around the step, nothing marked yet;
2. mark the step verified on every machine only if all passed (recorded in the fleet database either way,
   with each corrupt copy's machine, rank, tier and path);
3. promote: upload the verified step to the S3 tier (``TG_CHECKPOINT_S3_URL``; connection ``tg_s3``),
   check every remote object's SHA-256 against the manifest, mark the remote copies, apply S3 retention
   (never deleting the newest verified step).

A corrupt copy stops its step at 1: nothing is marked or uploaded, and the run fails with the problem in
the note of its ``conclude`` task."""

from __future__ import annotations

from datetime import datetime

from airflow.sdk import Asset, AssetWatcher, Param, dag, task

from trainguard.operators.triggers.alerts import CheckpointNoticeTrigger
from trainguard.operators.utils.schedules import asset_or_cron

checkpoint_committed = Asset("trainguard-checkpoint-committed", watchers=[
    AssetWatcher(name="checkpoint_notices", trigger=CheckpointNoticeTrigger())])


@dag(dag_id="tg_checkpoint_verify", is_paused_upon_creation=False,
     start_date=datetime(2026, 1, 1), catchup=False, max_active_runs=1,
     tags=["trainguard"], doc_md=__doc__,
     schedule=asset_or_cron(checkpoint_committed, cron_variable="TG_VERIFY_SCHEDULE", cron_default="*/30 * * * *",
                            on_variable="TG_VERIFY_ON_COMMIT"),
     params={
         "job": Param("", type="string", pattern=r"^([A-Za-z0-9][A-Za-z0-9_.-]{0,62})?$",
                      description="the job; empty = the announced steps, or every running job"),
         "step": Param(None, type=["null", "integer"], minimum=0,
                       description="the step; empty = the job's newest verification candidate"),
     })
def tg_checkpoint_verify():
    @task
    def pick(params: dict | None = None, triggering_asset_events=None) -> list:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import checkpoint_verify

        return checkpoint_verify.ckpt_targets(task_controller(), params["job"], params["step"], triggering_asset_events)

    @task(pool="tg_ssh", map_index_template="{{ target }}")
    def verify(target: dict) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import checkpoint_verify

        return checkpoint_verify.ckpt_verify(task_controller(), target)

    @task(map_index_template="{{ target }}")
    def promote(verdict: dict) -> dict:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import checkpoint_verify

        return checkpoint_verify.ckpt_promote(task_controller(), verdict)

    @task(trigger_rule="all_done")
    def conclude(verdicts: list | None = None, promotions: list | None = None) -> dict:
        from trainguard.operators.tasks import checkpoint_verify

        return checkpoint_verify.ckpt_conclude(verdicts, promotions)

    @task
    def outcome(concluded: dict) -> dict:
        from trainguard.operators.tasks import checkpoint_verify

        return checkpoint_verify.ckpt_outcome(concluded)

    verdicts = verify.expand(target=pick())
    promotions = promote.expand(verdict=verdicts)
    outcome(conclude(verdicts, promotions))


tg_checkpoint_verify()
