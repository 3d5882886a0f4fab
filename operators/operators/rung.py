"""The base of ``tg_incident``'s deferrable rungs (:mod:`trainguard.operators.operators.vote`,
:mod:`trainguard.operators.operators.replay`): a rung as an operator of its own, taking the triage's decision and
returning its :class:`~trainguard.operators.models.RungResult`, its waits deferred to the triggerer."""

from __future__ import annotations

from typing import Any

from airflow.sdk import BaseOperator


class RungOperator(BaseOperator):
    """A rung of the ladder whose waits run in the triggerer.

    :param decision: the triage's :class:`~trainguard.operators.models.IncidentDecision` (an XCom reference)
    """

    template_fields = ("decision",)

    def __init__(self, *, decision: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.decision = decision
