"""Effective training time ratio (ETTR): the share of a job's wall time spent on steps that were kept.

A step is *kept* when no later incarnation of the job ran it again: after a restore from step ``s``,
steps ``s+1 ..`` that the failed incarnation had finished are recomputed, and their first execution is
lost work. ``productive = sum of step times of kept executions``; ``ETTR = productive / wall time``
over the job's life (cumulative) or over a trailing window (sliding). Per incident, the time is split
into detection (first alert -> incident opened), diagnosis (-> decision), recovery (-> training resumed)
and lost work (step time of executions that were recomputed).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
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


def window_end(records: Iterable[Mapping[str, Any]], now: float, *, incident_open: bool) -> float:
    """Where an ETTR window that runs "until now" ends: at the end of the last finished step while the
    job is still stepping (no incident open, and that step ended within two median step times of
    ``now``): the step in flight is neither kept nor lost yet, and counts once it finishes. Otherwise
    ``now``: a job that stopped stepping, or one in an incident, is losing that time."""
    execs = executions(records)
    if incident_open or not execs:
        return now
    last = max(e.end_ts for e in execs)
    times = sorted(e.step_time_s for e in execs)
    median = times[len(times) // 2]
    return last if 0.0 <= now - last <= 2.0 * median else now


def ettr(records: Iterable[Mapping[str, Any]], *, start_ts: float, end_ts: float) -> Ettr:
    """ETTR of the wall time ``[start_ts, end_ts]`` (the job's start and now for the cumulative value;
    ``now - window`` and now for the sliding one)."""
    if end_ts <= start_ts:
        raise ValueError(f"ETTR window is empty: {start_ts} .. {end_ts}")
    good, lost = kept(executions(records))
    productive = sum(_overlap(e, start_ts, end_ts) for e in good)
    wasted = sum(_overlap(e, start_ts, end_ts) for e in lost)
    inside = [e for e in good if _overlap(e, start_ts, end_ts) > 0]
    lost_in = [e for e in lost if _overlap(e, start_ts, end_ts) > 0]
    return Ettr(productive / (end_ts - start_ts), productive, wasted, end_ts - start_ts, len(inside), len(lost_in))


def incident_split(incident: Mapping[str, Any], records: Iterable[Mapping[str, Any]], *, since_ts: float = 0.0,
                   ) -> dict[str, float]:
    """Seconds of detection, diagnosis, recovery and lost work of one incident (fleet DB fields:
    first_alert_ts, opened_ts, diagnosis_start_ts, decided_ts, resumed_ts). Lost work: executions of the
    incarnation that failed which a later incarnation recomputed, ending after ``since_ts`` (the previous
    incident's resumption) and before this incident opened."""
    first = incident["first_alert_ts"]
    opened = incident.get("opened_ts") or first
    decided = incident.get("decided_ts") or incident.get("diagnosis_start_ts") or opened
    resumed = incident.get("resumed_ts")
    diag_start = incident.get("diagnosis_start_ts") or opened
    _good, lost = kept(executions(records))
    lost_work = sum(e.step_time_s for e in lost if since_ts < e.end_ts <= opened + 1e-6)
    return {
        "detection_s": max(0.0, opened - first),
        "diagnosis_s": max(0.0, decided - diag_start) if incident.get("diagnosis_start_ts") else 0.0,
        "recovery_s": max(0.0, resumed - decided) if resumed else 0.0,
        "lost_work_s": lost_work,
    }
