"""Dual-phase replay with its waits in the triggerer (:class:`trainguard.operators.triggers.replay.ReplayTrigger`):

- ``SilentCorruptionOperator``: ``silent_corruption`` of ``tg_incident``: the rung up to its replay in the
  worker (stop, alignment test, the horizontal phase launched), the phase watched deferred, the vertical
  phase launched and watched the same way, then the verdict and the rung's result;
- ``ReplayPhaseOperator``: one phase of ``tg_sdc_replay`` (by hand), launched, then watched deferred.

While the replicas compute (minutes on a large job), no worker slot is held.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator

from trainguard.operators.operators.rung import RungOperator
from trainguard.operators.triggers.replay import DEFAULT_TIMEOUT_S

# a guard against a trigger that never fires: it gives up on a group after DEFAULT_TIMEOUT_S itself
MAX_WAIT = timedelta(seconds=DEFAULT_TIMEOUT_S + 600)


class SilentCorruptionOperator(RungOperator):
    """The silent-corruption rung; returns its :class:`~trainguard.operators.models.RungResult`."""

    def execute(self, context: Any) -> dict[str, Any] | None:
        from trainguard.operators.tasks import rungs

        return self._next(rungs.sdc_begin(self.controller, self.decision), "horizontal")

    def _next(self, step: dict[str, Any], phase: str) -> dict[str, Any] | None:
        from trainguard.operators.triggers.replay import ReplayTrigger

        if "result" in step:
            return step["result"]
        replay = step["replay"]
        self.log.info("replay, %s phase: groups %s launched; watched in the triggerer", phase,
                      {t: g["machines"] for t, g in replay["launched"]["groups"].items()})
        incident = (self.decision or {}).get("incident") if isinstance(self.decision, dict) else None
        self.defer(trigger=ReplayTrigger(replay["launched"], incident_id=incident), method_name="phase_done",
                   kwargs={"replay": replay, "phase": phase}, timeout=MAX_WAIT)
        return None

    def phase_done(self, context: Any, event: dict[str, Any] | None = None, replay: dict[str, Any] | None = None,
                   phase: str = "horizontal") -> dict[str, Any] | None:
        from trainguard.operators.tasks import rungs

        results = dict((event or {}).get("results") or {})
        self.log.info("replay, %s phase: %s", phase, results)
        self.controller.replay.replay_stop(dict(replay or {})["launched"])  # every group's sub-job ended
        if (event or {}).get("preempted"):  # an explicit machine fault joined: it decides the incident now
            self.log.info("replay preempted by %s", event["preempted"])
            return rungs.sdc_preempted(self.controller, self.decision, dict(replay or {}))["result"]
        return self._next(rungs.sdc_phase_done(self.controller, self.decision, dict(replay or {}), phase, results),
                          "vertical")


class ReplayPhaseOperator(BaseOperator):
    """One phase of a replay by hand; returns each group's result.

    :param plan: the ``prepare`` task's plan (an XCom reference)
    :param phase: ``horizontal`` or ``vertical``
    """

    template_fields = ("plan",)

    def __init__(self, *, plan: Any, phase: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if phase not in ("horizontal", "vertical"):
            raise ValueError(f"phase {phase!r}: use horizontal or vertical")
        self.plan = plan
        self.phase = phase

    def execute(self, context: Any) -> None:
        from trainguard.operators.hooks.fleet import task_controller
        from trainguard.operators.tasks import sdc_replay
        from trainguard.operators.triggers.replay import ReplayTrigger

        launched = sdc_replay.phase_launch(task_controller(), self.plan, self.phase)
        self.defer(trigger=ReplayTrigger(launched), method_name="execute_complete", kwargs={"launched": launched},
                   timeout=MAX_WAIT)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         launched: dict[str, Any] | None = None) -> dict[str, str]:
        from trainguard.operators.hooks.fleet import task_controller

        results = dict((event or {}).get("results") or {})
        self.log.info("replay, %s phase: %s", self.phase, results)
        if launched:
            task_controller().replay.replay_stop(launched)  # every group's sub-job ended
        return results
