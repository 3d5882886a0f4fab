"""How far one decision walks: the rooms (source files of the decision's layers) a rung's task passes through
from its entry to its result, counted from a trace of a real run.

The run: a rank of a four-machine job exits again soon after its first crash was restarted (``rank_exit`` on m1),
the guardian records it, ``triage`` decides the stop-time diagnosis, and its task (``tasks/rungs.py:handle``, what
the DAG's rung task calls) runs it against the fake fleet of the unit tests (``tests/fakes.py``: real controller,
policy and fleet database; the machines' answers scripted), with m3's level-2 diagnosis failing so that the ladder
evicts.

Only the decision's own layers count as rooms: ``operators/tasks``, ``operators/control``, ``operators/policy``,
``operators/models.py``; what they stand on (the fleet database, hooks, transports, settings, the node tools, the
standard library) is left out of the walk, a call into it and back staying where it was. Every Python call and
return is an event (``sys.setprofile``); a *stay* is a run of consecutive events in one room; a *return* is a stay
in a room the walk had already left once; a *climb* is a call from a lower layer into a higher one (the layers, top
down: tasks, control, policy, models): policy calling a service, a service calling a task.

    python scripts/walk.py [--json] [--show]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

LAYERS = ("operators/tasks/", "operators/control/", "operators/policy/", "operators/models.py")


def room_of(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return None
    return rel if rel.startswith(LAYERS) else None


def layer(room: str) -> int:
    """A room's layer, top down (0: tasks ... 3: models)."""
    return next(i for i, prefix in enumerate(LAYERS) if room.startswith(prefix))


def walk(events: list[str], calls: list[tuple[str, str]] | None = None) -> dict[str, object]:
    """Stays, rooms and returns of a sequence of rooms (one per trace event); ``calls``: ``(caller's room, callee's
    room)`` of every call between rooms, whose climbs are counted."""
    stays: list[str] = []
    for room in events:
        if not stays or stays[-1] != room:
            stays.append(room)
    seen: set[str] = set()
    returns = 0
    for i, room in enumerate(stays):
        if room in seen and stays[i - 1] != room:
            returns += 1
        seen.add(room)
    climbs = [f"{a} -> {b}" for a, b in calls or () if layer(b) < layer(a)]
    return {"stays": len(stays), "rooms": len(seen), "returns": returns, "climbs": len(climbs),
            "climbed": climbs, "path": stays}


def trace_decision() -> tuple[list[str], list[tuple[str, str]]]:
    """The rooms, event by event, of one stop-time diagnosis's ``handle`` (see the module), and each call between
    rooms as ``(the caller's room, the callee's)``."""
    import pytest

    from tests.fakes import alert, fleet_controller, use_controller
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    events: list[str] = []
    calls: list[tuple[str, str]] = []

    def caller_room(frame):
        frame = frame.f_back
        while frame is not None:
            room = room_of(frame.f_code.co_filename)
            if room is not None:
                return room
            frame = frame.f_back
        return None

    def profile(frame, event, _arg):
        if event in ("call", "return"):
            room = room_of(frame.f_code.co_filename)
            if room is not None:
                events.append(room)
                if event == "call":
                    before = caller_room(frame)
                    if before is not None and before != room:
                        calls.append((before, room))

    with tempfile.TemporaryDirectory() as tmp, pytest.MonkeyPatch.context() as mp:
        c, fleet = fleet_controller(Path(tmp))
        fleet.l2 = {"m3": "3 wrong results"}
        use_controller(mp, c)
        # a rank exits again soon after its first crash's restart: the crash's second rung, the stop-time diagnosis
        [first] = c.ingest([alert("rank_exit", "m1", rank=2)])
        c.fleet.update_incident(first["incident"], state="resolved", resumed_ts=time.time(), closed_ts=time.time())
        [item] = c.ingest([alert("rank_exit", "m1", rank=2)])
        decision = steps.triage(c, item["incident"])
        branch = steps.choose(decision)
        if branch != "stop_time_diagnosis":
            raise SystemExit(f"the scripted incident went to {branch}, not stop_time_diagnosis")
        sys.setprofile(profile)
        try:
            result = rungs.handle(c, branch, decision)
        finally:
            sys.setprofile(None)
        if not (result.get("evict") or {}).get("machines"):
            raise SystemExit(f"the scripted diagnosis evicted nothing: {result}")
    return events, calls


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    ap.add_argument("--show", action="store_true", help="print the walk, one stay a line")
    args = ap.parse_args(argv)
    figures = walk(*trace_decision())
    if args.json:
        print(json.dumps(figures, indent=2))
        return 0
    print(f"stop-time diagnosis, handle(): {figures['stays']} stays in {figures['rooms']} rooms, "
          f"{figures['returns']} returns to a room already left, {figures['climbs']} climbs back up")
    for climb in figures["climbed"]:  # type: ignore[union-attr]
        print(f"  climb: {climb}")
    if args.show:
        for room in figures["path"]:  # type: ignore[union-attr]
            print(f"  {room}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
