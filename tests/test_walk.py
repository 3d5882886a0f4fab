"""scripts/walk.py, the measure of how far one decision walks (issue: a decision's walk, the rooms of its layers):
its counting on a made-up walk, and the real trace of a stop-time diagnosis."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _walk_module():
    spec = importlib.util.spec_from_file_location("walk", REPO / "scripts" / "walk.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stays_rooms_and_returns_are_counted_as_defined():
    w = _walk_module()
    figures = w.walk(["a", "a", "b", "a", "c", "c", "b"])
    assert figures == {"stays": 5, "rooms": 3, "returns": 2, "path": ["a", "b", "a", "c", "b"]}
    assert w.room_of(str(REPO / "operators" / "policy" / "ladder.py")) == "operators/policy/ladder.py"
    assert w.room_of(str(REPO / "operators" / "fleet" / "store.py")) is None  # what the decision stands on


def test_the_stop_time_diagnosis_walk_is_traced_from_the_task_to_the_policy():
    w = _walk_module()
    figures = w.walk(w.trace_decision())
    path = figures["path"]
    assert path[0] == path[-1] == "operators/tasks/incident.py"
    assert {"operators/tasks/rungs.py", "operators/policy/ladder.py", "operators/control/diagnosis.py"} <= set(path)
    assert figures["stays"] >= figures["rooms"] >= 5
