"""The deferrable ``ResumeSensor``: ``wait_for_resume`` of ``tg_incident``. Both sensors here defer from their
first moment: they never poke, and hold no worker slot while they wait. Its ``execute`` only reads its
input (``restart_job``'s :class:`~trainguard.operators.models.Restart`) and defers to
:class:`trainguard.operators.triggers.resume.ResumeTrigger`; while an incident waits for its job to train again, no
worker slot is held, so a fleet with many incidents at once keeps its slots for the rungs. The deferrable
``CodeResumeSensor`` (``training_resumed`` of ``tg_code_update``) waits the same way for the jobs a code
update restarted.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from airflow.sdk import BaseSensorOperator

from trainguard.operators.triggers.resume import DEFAULT_POLL_S, CodeResumeTrigger, ResumeTrigger

# a guard against a trigger that never answers: the resume check itself answers "failed" after the
# control plane's resume_timeout_s
MAX_WAIT = timedelta(hours=1)


class ResumeSensor(BaseSensorOperator):
    """Waits, deferred, until the restarted job trains past its restored step (or the restart failed);
    returns the :class:`~trainguard.operators.models.Resume`. Nothing restarted: answers ``skipped`` at once.

    :param incident_id: the incident (templated: ``{{ params.incident_id }}``)
    :param recovery: ``restart_job``'s result (an XCom reference)
    :param poll_s: seconds between the trigger's checks
    """

    template_fields = ("incident_id", "recovery")

    def __init__(self, *, incident_id: Any, recovery: Any, poll_s: float = DEFAULT_POLL_S, **kwargs: Any) -> None:
        super().__init__(timeout=MAX_WAIT.total_seconds(), **kwargs)
        self.incident_id = incident_id
        self.recovery = recovery
        self.poll_s = poll_s

    def execute(self, context: Any) -> dict[str, Any]:
        from trainguard.operators.models import Restart, Resume

        rec = Restart.read(self.recovery)
        if not rec.restarted:
            return Resume(skipped=True).dump()
        self.defer(trigger=ResumeTrigger(int(self.incident_id), rec.dump(), poll_s=self.poll_s),
                   method_name="execute_complete", timeout=timedelta(seconds=self.timeout))

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        from trainguard.operators.models import Resume

        event = dict(event or {})
        checks = event.pop("checks", None)
        info = Resume.read(event)
        self.log.info("resume of incident %s after %s checks in the triggerer: %s", self.incident_id, checks,
                      info.dump())
        return info.dump()


class CodeResumeSensor(BaseSensorOperator):
    """Waits, deferred, until every job the code update restarted trained past its restored step or ended
    without one (the ladder then handles it); returns ``{"resumed": {job: ...}, "ended": {job: why}}``.
    Nothing restarted (a lazy update, the hourly sweep): answers at once. The run fails after ``timeout``.

    :param update: the ``update`` task's result (an XCom reference)
    :param timeout: how long to wait for the restarted jobs
    :param poll_s: seconds between the trigger's checks
    """

    template_fields = ("update",)

    def __init__(self, *, update: Any, timeout: timedelta = timedelta(minutes=10), poll_s: float = 2.0,
                 **kwargs: Any) -> None:
        super().__init__(timeout=timeout.total_seconds(), **kwargs)
        self.update = update
        self.poll_s = poll_s

    def execute(self, context: Any) -> dict[str, Any]:
        update = dict(self.update or {})
        if not update.get("restarts"):
            return {"resumed": {}, "ended": {}}
        self.defer(trigger=CodeResumeTrigger(update, poll_s=self.poll_s), method_name="execute_complete",
                   timeout=timedelta(seconds=self.timeout))

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        event = dict(event or {})
        checks = event.pop("checks", None)
        self.log.info("the code update's restarted jobs after %s checks in the triggerer: %s", checks, event)
        return {"resumed": event.get("resumed", {}), "ended": event.get("ended", {})}
