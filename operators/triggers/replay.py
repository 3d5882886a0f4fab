"""A dual-phase replay's groups, watched in the triggerer: ``ReplayTrigger`` asks every ``poll_s`` each
launched group's result (:meth:`trainguard.operators.control.replay.Replay.replay_poll`: its ranks' parameter
digests once every part ended, or why it failed), with the triggerer's one controller (one held SSH connection
per machine for every trigger, its blocking reads in a thread); once every group has one (or ``timeout_s``
passed) it fires with the results. It only reads: the operator that resumes ends the groups' sub-jobs
(:mod:`trainguard.operators.operators.replay`; a group killed with its task ends on its own after its few
steps). While the replicas compute, no worker slot is held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent

DEFAULT_TIMEOUT_S = 300.0


class ReplayTrigger(BaseTrigger):
    """Fires with each replay group's result once all have one.

    :param launched: what :meth:`trainguard.operators.control.Controller.replay_launch` started (JSON)
    :param timeout_s: seconds after which a group without a result counts as failed
    :param poll_s: seconds between two rounds of status reads
    :param incident_id: the incident whose rung replays (None: a replay by hand): an explicit machine fault that
        joins it meanwhile (a lost GPU, a fatal Xid) fires the trigger at once with ``preempted`` (the machines
        and their faults): the fault is acted on now, not after the replay's minutes
    """

    def __init__(self, launched: dict[str, Any], *, timeout_s: float = DEFAULT_TIMEOUT_S, poll_s: float = 1.0,
                 incident_id: int | None = None) -> None:
        super().__init__()
        self.launched = dict(launched)
        self.timeout_s = float(timeout_s)
        self.poll_s = float(poll_s)
        self.incident_id = None if incident_id is None else int(incident_id)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"launched": self.launched, "timeout_s": self.timeout_s, "poll_s": self.poll_s,
                 "incident_id": self.incident_id})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from trainguard.operators.tasks import common

        c = await asyncio.to_thread(common.shared_controller)
        groups = list(self.launched["groups"])
        out: dict[str, str] = {}
        deadline = time.monotonic() + self.timeout_s
        while len(out) < len(groups) and time.monotonic() < deadline:
            if self.incident_id is not None:
                faults = await asyncio.to_thread(c.incidents.unhandled_faults, self.incident_id)
                if faults:
                    self.log.info("replay of %s: preempted by %s", self.launched.get("job"), faults)
                    yield TriggerEvent({"results": out, "preempted": faults})
                    return
            polled = await asyncio.to_thread(c.replay.replay_poll, self.launched)
            out.update({t: r for t, r in polled.items() if r is not None})
            if len(out) < len(groups):
                await asyncio.sleep(self.poll_s)
        for tag in groups:
            out.setdefault(tag, f"failed: no result within {self.timeout_s:.0f}s")
        self.log.info("replay of %s: %s", self.launched.get("job"), out)
        yield TriggerEvent({"results": out})
