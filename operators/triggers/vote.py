"""The fail-slow vote's rounds, taken in the triggerer: ``SlowVoteTrigger`` asks every ``interval_s`` each
rank's recent compute time (:meth:`trainguard.operators.control.Controller.vote_round`, with the triggerer's one
controller: one fleet database engine and one held SSH connection per machine for every trigger, its
blocking reads in a thread), ``rounds`` times, and fires with them; at once, with the rounds so far and
``superseded``, when stronger alerts took the incident over meanwhile. Its operator is
:class:`trainguard.operators.operators.vote.SlowVoteOperator`: while the vote samples a slow job (a minute by default),
no worker slot is held.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from airflow.triggers.base import BaseTrigger, TriggerEvent


class SlowVoteTrigger(BaseTrigger):
    """Fires with ``rounds`` rounds of compute times of the incident's job, ``interval_s`` apart.

    :param incident_id: the incident whose job is sampled (a throughput decline or a slow rank)
    :param rounds: how many rounds to take in all
    :param interval_s: seconds between the starts of two rounds
    :param taken: the rounds already taken (the operator takes the first before it defers)
    :param started: when the first round began (epoch seconds): round ``k`` begins ``k * interval_s`` after
        it, whatever the triggerer's pickup and the rounds' reads took; None: now
    """

    def __init__(self, incident_id: int, rounds: int, interval_s: float,
                 taken: list[dict[str, float]] | None = None, started: float | None = None) -> None:
        super().__init__()
        self.incident_id = int(incident_id)
        self.rounds = int(rounds)
        self.interval_s = float(interval_s)
        self.taken = [dict(t) for t in taken or []]
        self.started = None if started is None else float(started)

    def serialize(self) -> tuple[str, dict[str, Any]]:
        return (f"{type(self).__module__}.{type(self).__qualname__}",
                {"incident_id": self.incident_id, "rounds": self.rounds, "interval_s": self.interval_s,
                 "taken": self.taken, "started": self.started})

    async def run(self) -> AsyncIterator[TriggerEvent]:
        from trainguard.operators.tasks import common

        c = await asyncio.to_thread(common.shared_controller)
        taken: list[dict[str, float]] = list(self.taken)
        started = time.time() if self.started is None else self.started
        while len(taken) < self.rounds:
            await asyncio.sleep(max(0.0, started + len(taken) * self.interval_s - time.time()))
            one = await asyncio.to_thread(c.analysis.vote_round, self.incident_id)
            if one.get("superseded"):
                self.log.info("incident %s: taken over by stronger alerts after %d rounds", self.incident_id,
                              len(taken))
                yield TriggerEvent({"rounds": taken, "superseded": True})
                return
            taken.append(one)
            self.log.info("incident %s: round %d of %d: %s", self.incident_id, len(taken), self.rounds, one["times"])
        yield TriggerEvent({"rounds": taken})
