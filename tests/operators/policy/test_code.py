"""Code update policy: urgent -> hot now, lazy -> pending until a restart (forced after the window),
rollback -> the last known-good revision; bad requests get one-line reasons."""

from __future__ import annotations

import pytest

from trainguard.operators.policy.code import LAZY_FORCE_S, UpdateError, becomes_known_good, lazy_due, plan_update

BASE = {"job": "llm", "current": "r1", "pending": None, "recorded": ["r0", "r1", "r2"], "known_good": ["r0", "r1"]}


def plan(**kw):
    return plan_update(**{**BASE, **kw})


def test_urgent_is_a_hot_update_and_lazy_waits_for_the_next_restart():
    assert plan(requested="r2", urgency="urgent").action == "hot"
    lazy = plan(requested="r2", urgency="lazy")
    assert (lazy.action, lazy.revision) == ("pending", "r2")
    # asking again changes nothing: it already waits; the running revision is a no-op either way
    assert plan(requested="r2", urgency="lazy", pending="r2").action == "none"
    assert plan(requested="r1", urgency="urgent").action == "none"


def test_rollback_goes_to_the_newest_known_good_revision_other_than_the_current_one():
    back = plan(requested="", urgency="rollback", current="r2")
    assert (back.action, back.revision) == ("hot", "r1")
    assert plan(requested="", urgency="rollback").revision == "r0"  # r1 runs now
    assert plan(requested="r0", urgency="rollback", current="r2").revision == "r0"


@pytest.mark.parametrize(("kw", "message"), [
    ({"requested": "r9", "urgency": "urgent"}, "has no revision 'r9'; record it first"),
    ({"requested": "r2", "urgency": "soon"}, "urgency 'soon' is not one of urgent, lazy, rollback"),
    ({"requested": "", "urgency": "lazy"}, "no revision given"),
    ({"requested": "r2", "urgency": "rollback"}, "'r2' of job llm is not known good"),
    ({"requested": "", "urgency": "rollback", "known_good": ["r1"]}, "no known-good revision other than 'r1'"),
])
def test_bad_requests_say_what_is_wrong_and_what_to_do(kw, message):
    with pytest.raises(UpdateError, match=message):
        plan(**kw)


def test_a_pending_revision_is_forced_after_the_window_and_good_after_enough_healthy_steps():
    assert not lazy_due(None, 1e9) and not lazy_due(1000.0, 1000.0 + LAZY_FORCE_S - 1)
    assert lazy_due(1000.0, 1000.0 + LAZY_FORCE_S)
    assert becomes_known_good(200) and not becomes_known_good(199) and becomes_known_good(5, threshold=5)
