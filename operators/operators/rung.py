"""The base of ``tg_incident``'s deferrable rungs (:mod:`trainguard.operators.operators.vote`,
:mod:`trainguard.operators.operators.replay`): a rung as an operator of its own, taking the triage's decision and
returning its :class:`~trainguard.operators.models.RungResult`, its waits deferred to the triggerer."""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseOperator

if TYPE_CHECKING:
    from trainguard.operators.control import Controller


class RungOperator(BaseOperator):
    """A rung of the ladder whose waits run in the triggerer.

    :param decision: the triage's :class:`~trainguard.operators.models.IncidentDecision` (an XCom reference)
    """

    template_fields = ("decision",)

    def __init__(self, *, decision: Any, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.decision = decision

    @cached_property
    def controller(self) -> Controller:
        """This try's controller (made where it runs: in the worker, again after each deferral)."""
        from trainguard.operators.hooks.fleet import task_controller

        return task_controller()
