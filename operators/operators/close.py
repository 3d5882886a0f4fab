"""``close_incident`` of ``tg_incident`` as a deferrable operator: it closes the incident
(:func:`trainguard.operators.tasks.incident.close_step`); when the recovery did not hold, it climbs (the escalation
restarts the job after removing what stood in the way) and waits for the new restart's resume deferred,
in the triggerer (:class:`trainguard.operators.triggers.resume.ResumeTrigger`), then climbs again or closes: up to
``restart_attempts`` restarts, none of their waits holding a worker slot."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

from trainguard.operators.sensors.resume import MAX_WAIT

if TYPE_CHECKING:
    from trainguard.operators.control import Controller
    from trainguard.operators.models import Escalation


class CloseIncidentOperator(BaseOperator):
    """Closes the incident, escalating a recovery that did not hold; returns the incident's timeline.

    :param incident_id: the incident (templated: ``{{ params.incident_id }}``)
    :param decision: what ``no_recovery`` returned (None when a rung handled the incident)
    :param recovery: ``restart_job``'s :class:`~trainguard.operators.models.Restart`
    :param resume: ``wait_for_resume``'s :class:`~trainguard.operators.models.Resume`
    """

    template_fields = ("incident_id", "decision", "recovery", "resume")

    def __init__(self, *, incident_id: Any, decision: Any = None, recovery: Any = None, resume: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.incident_id = incident_id
        self.decision = decision
        self.recovery = recovery
        self.resume = resume

    def execute(self, context: Any) -> dict[str, Any] | None:
        from trainguard.operators.tasks import incident

        return self._next(incident.close_step(self.controller, int(self.incident_id), self.decision, self.recovery,
                                              self.resume, run_id=(context or {}).get("run_id")))

    def _next(self, step: Escalation) -> dict[str, Any] | None:
        from trainguard.operators.triggers.resume import ResumeTrigger

        if step.watch is None:
            return dict(step.timeline or {})
        watch = step.watch
        self.log.info("incident %s: escalation restart %s (%s); waiting for its resume in the triggerer",
                      self.incident_id, watch.attempt, "; ".join(watch.tried))
        self.defer(trigger=ResumeTrigger(int(self.incident_id), watch.recovery), method_name="resumed",
                   kwargs={"watch": watch.model_dump(mode="json")}, timeout=MAX_WAIT)
        return None

    def resumed(self, context: Any, event: dict[str, Any] | None = None, watch: dict[str, Any] | None = None
                ) -> dict[str, Any] | None:
        from trainguard.operators.tasks import incident

        info = {k: v for k, v in dict(event or {}).items() if k != "checks"}
        return self._next(incident.escalation_after(self.controller, int(self.incident_id), dict(watch or {}), info))

    @cached_property
    def controller(self) -> Controller:
        """This try's controller (made where it runs: in the worker, again after each deferral)."""
        from trainguard.operators.hooks.fleet import task_controller

        return task_controller()
