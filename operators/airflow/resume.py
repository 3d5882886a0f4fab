"""Waiting for a restarted job to train again without holding a worker: ``ResumeTrigger`` (runs in the
triggerer) and the deferrable ``ResumeSensor``.

The sensor's ``execute`` only reads its input (``restart_job``'s :class:`~operators.models.Restart`) and
defers; the trigger asks every ``poll_s`` whether every rank finished a step after the restart
(:func:`operators.airflow.steps.resumed`, with the triggerer's one controller, and so one fleet database
engine, for every trigger: :func:`operators.airflow.steps.shared_controller`; its blocking reads in a
thread so the triggerer's loop goes on), and fires with the
answer: resumed, failed (the job ended, or ``resume_timeout_s`` passed), or explicit faults pending. While
an incident waits for its job to train again, no worker slot is held: a fleet with many incidents at once
keeps its slots for the rungs.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from datetime import timedelta
from typing import Any

from airflow.sdk import BaseOperator
from airflow.triggers.base import BaseTrigger, TriggerEvent

DEFAULT_POLL_S = 1.0
# a guard against a trigger that never answers: the resume check itself answers "failed" after the
# control plane's resume_timeout_s
MAX_WAIT = timedelta(hours=1)


class ResumeTrigger(BaseTrigger):
    """Fires once the restart of ``incident_id`` (``recovery``: ``restart_job``'s document) has an answer.

    :param incident_id: the incident whose restart is watched
    :param recovery: what ``restart_job`` returned (its restart time and job)
    :param poll_s: seconds between two checks
    """

    def __init__(self, incident_id: int, recovery: dict[str, Any], *, poll_s: float = DEFAULT_POLL_S) -> None:
        super().__init__()
        self.incident_id = int(incident_id)
        self.recovery = dict(recovery)
        self.poll_s = float(poll_s)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"incident_id": self.incident_id, "recovery": self.recovery, "poll_s": self.poll_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from operators.airflow import steps

        t0 = time.monotonic()
        c = await asyncio.to_thread(steps.shared_controller)
        self.log.info("incident %s: checking its resume (controller ready in %.2fs)", self.incident_id,
                      time.monotonic() - t0)
        checks = 0
        while True:
            checks += 1
            info = await asyncio.to_thread(steps.resumed, self.incident_id, self.recovery, c)
            if info is not None:
                self.log.info("incident %s: %s after %d checks", self.incident_id, info, checks)
                yield TriggerEvent({**info, "checks": checks})
                return
            await asyncio.sleep(self.poll_s)


class ResumeSensor(BaseOperator):
    """Waits, deferred, until the restarted job trains past its restored step (or the restart failed);
    returns the :class:`~operators.models.Resume`. Nothing restarted: answers ``skipped`` at once.

    :param incident_id: the incident (templated: ``{{ params.incident_id }}``)
    :param recovery: ``restart_job``'s result (an XCom reference)
    :param poll_s: seconds between the trigger's checks
    """

    template_fields = ("incident_id", "recovery")

    def __init__(self, *, incident_id: Any, recovery: Any, poll_s: float = DEFAULT_POLL_S, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.incident_id = incident_id
        self.recovery = recovery
        self.poll_s = poll_s

    def execute(self, context: Any) -> dict[str, Any]:
        from operators.models import Restart, Resume

        rec = Restart.read(self.recovery)
        if not rec.restarted:
            return Resume(skipped=True).dump()
        self.defer(trigger=ResumeTrigger(int(self.incident_id), rec.dump(), poll_s=self.poll_s),
                   method_name="execute_complete", timeout=MAX_WAIT)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        from operators.models import Resume

        event = dict(event or {})
        checks = event.pop("checks", None)
        info = Resume.read(event)
        self.log.info("resume of incident %s after %s checks in the triggerer: %s", self.incident_id, checks,
                      info.dump())
        return info.dump()
