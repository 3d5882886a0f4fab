"""Effective training time ratio (ETTR): the share of a job's wall time spent on steps that were kept.

A step is *kept* when no later incarnation of the job ran it again: after a restore from step ``s``,
steps ``s+1 ..`` that the failed incarnation had finished are recomputed, and their first execution is
lost work. ``productive = sum of step times of kept executions``, a step's time counting the program's own
pause before it when it continues the step before (:func:`continued`, which a report applies first);
``ETTR = productive / wall time`` over the job's life (cumulative) or over a trailing window (sliding). Per
incident, the time is split into detection (first alert -> incident opened), diagnosis (-> decision),
recovery (-> training resumed) and lost work (step time of executions that were recomputed).

A report reads one :class:`StepHistory`: the executions in compact columns, ordered and marked kept or lost
once, so that every window (each incident's, the sliding one) is found by bisection on the end times and
a report is linear in the steps (plus a log factor per incident) instead of re-reading the whole history
for every incident. :func:`ettr`, :func:`window_end` and :func:`incident_split` take either the records or
a :class:`StepHistory` and give the same numbers both ways.
"""

from __future__ import annotations

import math
from array import array
from bisect import bisect_right
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import compress, islice
from operator import lt
from typing import Any


@dataclass(frozen=True)
class Execution:
    step: int
    incarnation: int
    end_ts: float
    step_time_s: float

    @property
    def start_ts(self) -> float:
        return self.end_ts - self.step_time_s


def executions(records: Iterable[Mapping[str, Any]]) -> list[Execution]:
    """One :class:`Execution` per step record (``step``, ``incarnation``, ``ts`` = end, ``step_time_s``)
    of one rank (rank 0's records stand for the job: every rank runs every step)."""
    out = [Execution(int(r["step"]), int(r.get("incarnation", 0)), float(r["ts"]), float(r["step_time_s"]))
           for r in records if isinstance(r.get("step_time_s"), int | float)]
    return sorted(out, key=lambda e: (e.end_ts, e.incarnation))


#: the longest pause between two consecutive steps of one process that still counts as training: the program's
#: own work between its guarded steps (loading the next batch, its framework's hooks, its evaluation every N steps)
CONTINUED_GAP_S = 60.0


def continued(records: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The step records (those with a step time) as the ETTR counts them: a step that continues the one before it
    (the same incarnation, the next step, at most :data:`CONTINUED_GAP_S` after it ended) covers the wall time
    since that one ended, not only its own guarded time. A program's own work between its steps is training: on a
    job of 7 ms steps, Lightning's loop and data loading between them take a fifth of the wall time, and an ETTR of
    guarded step time alone read 75% for a job that lost 3 minutes in 35. A pause longer than that (a rank held
    still for the control plane), or a restart, counts as before: only the step's own time."""
    rows = [(r, t) for r in records for t in (r.get("step_time_s"),) if isinstance(t, int | float)]
    order = sorted(range(len(rows)), key=lambda i: (float(rows[i][0]["ts"]), int(rows[i][0].get("incarnation", 0))))
    out: list[dict[str, Any]] = [{}] * len(rows)
    prev: Mapping[str, Any] | None = None
    for i in order:
        r, t = rows[i]
        ts = float(r["ts"])
        covered = float(t)
        if prev is not None and int(r.get("incarnation", 0)) == int(prev.get("incarnation", 0)) \
                and int(r["step"]) == int(prev["step"]) + 1 and 0.0 <= ts - covered - float(prev["ts"]) \
                <= CONTINUED_GAP_S:
            covered = ts - float(prev["ts"])
        out[i] = {**r, "step_time_s": covered}
        prev = r
    return out


def kept(execs: Iterable[Execution]) -> tuple[list[Execution], list[Execution]]:
    """(kept, lost): an execution is lost when a later incarnation ran the same step again."""
    execs = list(execs)
    last: dict[int, Execution] = {}
    for e in execs:
        prev = last.get(e.step)
        if prev is None or (e.incarnation, e.end_ts) > (prev.incarnation, prev.end_ts):
            last[e.step] = e
    keep_ids = {id(e) for e in last.values()}
    return [e for e in execs if id(e) in keep_ids], [e for e in execs if id(e) not in keep_ids]


def _overlap(e: Execution, start: float, end: float) -> float:
    return max(0.0, min(e.end_ts, end) - max(e.start_ts, start))


@dataclass(frozen=True)
class Ettr:
    ratio: float
    productive_s: float
    lost_work_s: float
    wall_s: float
    kept_steps: int
    lost_steps: int

    def as_dict(self) -> dict[str, Any]:
        return {"ettr": round(self.ratio, 4), "productive_s": round(self.productive_s, 3),
                "lost_work_s": round(self.lost_work_s, 3), "wall_s": round(self.wall_s, 3),
                "kept_steps": self.kept_steps, "lost_steps": self.lost_steps}


class StepHistory:
    """Rank 0's step executions of a job (see :func:`executions`), in compact columns, built once.

    Guarantees: the executions are the ones :func:`executions` makes of the same records, in its order (by
    end time, then incarnation; equal keys keep the records' order); each is kept or lost exactly as
    :func:`kept` says; every figure read from here (:meth:`ettr`, :meth:`window_end`, :meth:`lost_work`) is
    the number the record-by-record definition gives, float for float. Building costs one pass over the
    records (plus a sort only when they are not in that order already) and about 17 bytes per execution
    (the :class:`Execution` objects and :func:`kept`'s tables take some 250); a window is found by bisection
    on the end times, so a figure costs the executions of its window, not the whole history."""

    __slots__ = ("_bisectable", "_kept_count", "_lost_end_ts", "_lost_step_time_s", "end_ts", "kept", "step_time_s")

    def __init__(self, records: Iterable[Mapping[str, Any]]) -> None:
        steps, incarnations, ends, times = array("q"), array("q"), array("d"), array("d")
        for r in records:
            t = r.get("step_time_s")
            if isinstance(t, int | float):
                steps.append(int(r["step"]))
                incarnations.append(int(r.get("incarnation", 0)))
                ends.append(float(r["ts"]))
                times.append(float(t))
        order = _execution_order(ends, incarnations)
        if order is not None:
            steps, incarnations, ends, times = (array(col.typecode, map(col.__getitem__, order))
                                                for col in (steps, incarnations, ends, times))
        #: end time, step time (seconds) and kept (1) or lost (0) of each execution, in execution order
        self.end_ts, self.step_time_s = ends, times
        self.kept = _kept_marks(steps, incarnations, ends)
        self._kept_count = self.kept.count(1)
        lost = self.kept.translate(_NOT)
        self._lost_end_ts = array("d", compress(ends, lost))
        self._lost_step_time_s = array("d", compress(times, lost))
        # a NaN end time leaves the order undefined: windows are then found by reading every execution
        self._bisectable = not any(map(math.isnan, ends))

    def __len__(self) -> int:
        return len(self.end_ts)

    def ettr(self, *, start_ts: float, end_ts: float) -> Ettr:
        """ETTR of the wall time ``[start_ts, end_ts]``: see :func:`ettr`."""
        if end_ts <= start_ts:
            raise ValueError(f"ETTR window is empty: {start_ts} .. {end_ts}")
        # executions that ended by start_ts overlap nothing (0.0 each, which leaves a sum as it is); with
        # two int bounds an overlap can be an int, and Python's sum of floats and ints depends on where the
        # first float comes, so then every execution is read, as the definition does
        whole = isinstance(start_ts, int) and isinstance(end_ts, int)
        first = bisect_right(self.end_ts, start_ts) if self._bisectable and start_ts == start_ts and not whole else 0
        good: list[float] | array[float] = [] if whole else array("d")
        lost: list[float] | array[float] = [] if whole else array("d")
        into = (lost.append, good.append)
        for e, t, k in zip(memoryview(self.end_ts)[first:], memoryview(self.step_time_s)[first:],
                           memoryview(self.kept)[first:], strict=True):
            # max(0.0, min(e, end_ts) - max(e - t, start_ts)), spelled out: min and max keep their first
            # argument unless another is strictly smaller (larger), and so do these
            s = e - t
            x = (end_ts if end_ts < e else e) - (start_ts if start_ts > s else s)
            into[k](x if x > 0.0 else 0.0)
        # the skipped executions' 0.0s make a sum a float: 0.0 when nothing else is in it, as the definition has
        kept_total = self._kept_count
        productive = sum(good) if good or not kept_total else 0.0
        wasted = sum(lost) if lost or kept_total == len(self) else 0.0
        return Ettr(productive / (end_ts - start_ts), productive, wasted, end_ts - start_ts,
                    len(good) - good.count(0.0), len(lost) - lost.count(0.0))

    def window_end(self, now: float, *, incident_open: bool) -> float:
        """Where an ETTR window that runs "until now" ends: see :func:`window_end`."""
        if incident_open or not len(self):
            return now
        last = max(self.end_ts)
        since_last = now - last
        if not since_last >= 0.0:  # a NaN too
            return now
        times = self.step_time_s
        if not any(map(math.isnan, times)):  # the median lies between the shortest and the longest step
            if since_last <= 2.0 * min(times):
                return last
            if since_last > 2.0 * max(times):
                return now
        median = sorted(times)[len(self) // 2]
        return last if since_last <= 2.0 * median else now

    def lost_work(self, *, after_ts: float, until_ts: float) -> float:
        """The summed step time (summed in execution order) of the lost executions that ended after
        ``after_ts`` and by ``until_ts``: a bisection and the lost executions of that window."""
        if self._bisectable and after_ts == after_ts and until_ts == until_ts:
            ends = self._lost_end_ts
            return sum(self._lost_step_time_s[bisect_right(ends, after_ts):bisect_right(ends, until_ts)])
        return sum(t for e, t in zip(self._lost_end_ts, self._lost_step_time_s, strict=True)
                   if after_ts < e <= until_ts)


_NOT = bytes([1, 0]) + bytes(254)  # bytes.translate table: a kept mark (1) to a lost one (0) and back


def _execution_order(ends: array[float], incarnations: array[int]) -> list[int] | None:
    """The order :func:`executions` puts executions in (sorted by end time, then incarnation; stable):
    None when they are in it already (the usual case: step records are read in time order)."""
    following = islice(ends, 1, None)
    if all(map(lt, ends, following)):
        return None
    if all(a < b or (a == b and i <= j) for a, b, i, j in
           zip(ends, islice(ends, 1, None), incarnations, islice(incarnations, 1, None), strict=False)):
        return None
    return sorted(range(len(ends)), key=lambda i: (ends[i], incarnations[i]))


def _kept_marks(steps: array[int], incarnations: array[int], ends: array[float]) -> bytearray:
    """1 for each execution that :func:`kept` keeps (the highest incarnation's of its step, the later of
    equal ones, the first of identical ones), 0 for each it loses; executions in execution order."""
    n = len(steps)
    best: array[int] | defaultdict[int, int]  # step - low -> the execution kept so far (-1: none)
    low = min(steps, default=0)
    if max(steps, default=0) - low < 2 * n + 1024:  # step numbers are dense: a table, 8 bytes a step
        best = array("q", [-1]) * (max(steps, default=0) - low + 1)
    else:
        best, low = defaultdict(lambda: -1), 0
    for i, (s, c, e) in enumerate(zip(steps, incarnations, ends, strict=True)):
        b = best[s - low]
        if b < 0 or c > incarnations[b] or (c == incarnations[b] and e > ends[b]):
            best[s - low] = i
    marks = bytearray(n)
    for b in (best.values() if isinstance(best, defaultdict) else best):
        if b >= 0:
            marks[b] = 1
    return marks


def _history(records: Iterable[Mapping[str, Any]] | StepHistory) -> StepHistory:
    return records if isinstance(records, StepHistory) else StepHistory(records)


def across_replicas(each: Sequence[Ettr]) -> Ettr:
    """The ETTR of a job run as replica groups from each replica's own (its first rank's records, over the same wall
    time): the share of the job's replicas that trained, so a stretch trained by fewer replicas counts as partly
    productive (two of three replicas training for a minute: 40 of its 60 s). Productive time and lost work are
    the replicas' mean; steps are the most any replica kept or lost."""
    if not each:
        raise ValueError("no replica's ETTR to combine")
    wall = each[0].wall_s
    productive = sum(e.productive_s for e in each) / len(each)
    return Ettr(productive / wall if wall > 0 else 0.0, productive, sum(e.lost_work_s for e in each) / len(each),
                wall, max(e.kept_steps for e in each), max(e.lost_steps for e in each))


def window_end(records: Iterable[Mapping[str, Any]] | StepHistory, now: float, *, incident_open: bool) -> float:
    """Where an ETTR window that runs "until now" ends: at the end of the last finished step while the
    job is still stepping (no incident open, and that step ended within two median step times of
    ``now``): the step in flight is neither kept nor lost yet, and counts once it finishes. Otherwise
    ``now``: a job that stopped stepping, or one in an incident, is losing that time."""
    return _history(records).window_end(now, incident_open=incident_open)


def ettr(records: Iterable[Mapping[str, Any]] | StepHistory, *, start_ts: float, end_ts: float) -> Ettr:
    """ETTR of the wall time ``[start_ts, end_ts]`` (the job's start and now for the cumulative value;
    ``now - window`` and now for the sliding one): kept executions' time inside the window over its length;
    ``lost_work_s`` the lost executions' time inside it; the step counts those that overlap it."""
    return _history(records).ettr(start_ts=start_ts, end_ts=end_ts)


def incident_split(incident: Mapping[str, Any], records: Iterable[Mapping[str, Any]] | StepHistory, *,
                   since_ts: float = 0.0) -> dict[str, float]:
    """Seconds of detection, diagnosis, recovery and lost work of one incident (fleet DB fields:
    first_alert_ts, opened_ts, diagnosis_start_ts, decided_ts, resumed_ts). Lost work: executions of the
    incarnation that failed which a later incarnation recomputed, ending after ``since_ts`` (the previous
    incident's resumption) and before this incident opened. With a :class:`StepHistory` it costs a bisection
    and the lost executions of that window."""
    first = incident["first_alert_ts"]
    opened = incident.get("opened_ts") or first
    decided = incident.get("decided_ts") or incident.get("diagnosis_start_ts") or opened
    resumed = incident.get("resumed_ts")
    diag_start = incident.get("diagnosis_start_ts") or opened
    lost_work = _history(records).lost_work(after_ts=since_ts, until_ts=opened + 1e-6)
    return {
        "detection_s": max(0.0, opened - first),
        "diagnosis_s": max(0.0, decided - diag_start) if incident.get("diagnosis_start_ts") else 0.0,
        "recovery_s": max(0.0, resumed - decided) if resumed else 0.0,
        "lost_work_s": lost_work,
    }
