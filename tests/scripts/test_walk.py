"""scripts/walk.py, the measure of how far one decision walks (issue: a decision's walk, the rooms of its layers):
its counting on a made-up walk, and the real trace of a stop-time diagnosis."""

from __future__ import annotations

import importlib.util

from tests import REPO


def _walk_module():
    spec = importlib.util.spec_from_file_location("walk", REPO / "scripts" / "walk.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stays_rooms_returns_and_climbs_are_counted_as_defined():
    w = _walk_module()
    t, c, p = "operators/tasks/x.py", "operators/control/y.py", "operators/policy/z.py"
    figures = w.walk([t, t, c, t, p, p, c], [(t, c), (t, p), (p, c)])
    assert figures == {"stays": 5, "rooms": 3, "returns": 2, "climbs": 1, "climbed": [f"{p} -> {c}"],
                       "path": [t, c, t, p, c]}
    assert w.room_of(str(REPO / "operators" / "policy" / "ladder.py")) == "operators/policy/ladder.py"
    assert w.room_of(str(REPO / "operators" / "fleet" / "store.py")) is None  # what the decision stands on


def test_the_stop_time_diagnosis_walks_at_most_ten_stays_and_never_climbs_back_up():
    """The typed rung pipeline: the rung's task gathers (the job's stop and logs, the diagnosis) and the ladder
    decides, each once, straight through; no service calls back into a task, no policy into a service. (Ten: the
    eight of the pipeline, and the rung's entering its incident's reach, the machines it found gone.)"""
    w = _walk_module()
    figures = w.walk(*w.trace_decision())
    path = figures["path"]
    assert path[0] == path[-1] == "operators/tasks/rungs.py"
    assert {"operators/control/jobs.py", "operators/policy/ladder.py", "operators/control/diagnosis.py"} <= set(path)
    assert figures["stays"] <= 10 and figures["climbs"] == 0, figures
