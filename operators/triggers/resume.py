"""Waiting for a restarted job to train again without holding a worker: ``ResumeTrigger`` runs in the
triggerer and asks every ``poll_s`` whether every rank finished a step after the restart
(:func:`trainguard.operators.tasks.incident.resumed`, with the triggerer's one controller, and so one fleet database
engine and one held SSH connection per machine, for every trigger:
:func:`trainguard.operators.tasks.common.shared_controller`; its blocking reads in a thread so the triggerer's loop
goes on), and fires with the answer: resumed, failed (the job ended, or ``resume_timeout_s`` passed), or
explicit faults pending. Its sensor is :class:`trainguard.operators.sensors.resume.ResumeSensor`.
``CodeResumeTrigger`` does the same for the jobs a code update restarted
(:func:`trainguard.operators.tasks.code_update.code_resumed`), for ``tg_code_update``'s ``training_resumed``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

DEFAULT_POLL_S = 1.0


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
        from trainguard.operators.tasks import common, incident

        t0 = time.monotonic()
        c = await asyncio.to_thread(common.shared_controller)
        self.log.info("incident %s: checking its resume (controller ready in %.2fs)", self.incident_id,
                      time.monotonic() - t0)
        checks = 0
        while True:
            checks += 1
            info = await asyncio.to_thread(incident.resumed, c, self.incident_id, self.recovery)
            if info is not None:
                self.log.info("incident %s: %s after %d checks", self.incident_id, info, checks)
                yield TriggerEvent({**info, "checks": checks})
                return
            await asyncio.sleep(self.poll_s)


class CodeResumeTrigger(BaseTrigger):
    """Fires once every job a code update restarted (``update``: the ``update`` task's document, its
    ``restarts``) trained past its restored step or ended without one.

    :param update: what the ``update`` task returned
    :param poll_s: seconds between two checks
    """

    def __init__(self, update: dict[str, Any], *, poll_s: float = DEFAULT_POLL_S) -> None:
        super().__init__()
        self.update = dict(update)
        self.poll_s = float(poll_s)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}", {"update": self.update, "poll_s": self.poll_s})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from trainguard.operators.tasks import code_update, common

        c = await asyncio.to_thread(common.shared_controller)
        checks = 0
        while True:
            checks += 1
            info = await asyncio.to_thread(code_update.code_resumed, c, self.update)
            if info is not None:
                self.log.info("code update: %s after %d checks", info, checks)
                yield TriggerEvent({**info, "checks": checks})
                return
            await asyncio.sleep(self.poll_s)
