"""``slow_vote`` of ``tg_incident`` as a deferrable operator: it takes the first round and defers to
:class:`trainguard.operators.triggers.vote.SlowVoteTrigger`, which takes the other rounds in the triggerer on the
first round's clock (the triggerer's pickup hides inside the first interval), and
resumes with them to decide (:func:`trainguard.operators.tasks.rungs.vote_end`: the verdict claimed on the
incident, the slow group to evict or nothing). An explicit machine fault that joined the incident before
the vote began decides it instead (evict that machine), with no rounds."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from trainguard.operators.operators.rung import RungOperator


class SlowVoteOperator(RungOperator):
    """The slow vote: rounds of compute times in the triggerer, then the verdict; returns the rung's
    :class:`~trainguard.operators.models.RungResult`."""

    def execute(self, context: Any) -> dict[str, Any] | None:
        from trainguard.operators.models import IncidentDecision
        from trainguard.operators.settings import ControlSettings
        from trainguard.operators.tasks import rungs
        from trainguard.operators.triggers.vote import SlowVoteTrigger

        begun = rungs.vote_begin(self.controller, self.decision)
        if "result" in begun:
            return begun["result"]
        cfg = ControlSettings.from_env()
        d = IncidentDecision.model_validate(self.decision)
        # a guard against a trigger that never fires: the rounds take rounds x interval, plus their reads
        limit = timedelta(seconds=cfg.slow_rounds * (cfg.slow_interval_s + 60) + 60)
        self.defer(trigger=SlowVoteTrigger(d.incident, cfg.slow_rounds, cfg.slow_interval_s,
                                           taken=[begun["first"]], started=begun["started"]),
                   method_name="execute_complete", timeout=limit)
        return None

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None) -> dict[str, Any]:
        from trainguard.operators.tasks import rungs

        event = dict(event or {})
        self.log.info("vote: %d rounds in the triggerer%s", len(event.get("rounds") or []),
                      " (superseded)" if event.get("superseded") else "")
        return rungs.vote_end(self.controller, self.decision, list(event.get("rounds") or []),
                                 superseded=bool(event.get("superseded")))
