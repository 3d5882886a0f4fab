"""The ETTR report at scale: one pass over the step history, however many incidents, and the same numbers as
the record-by-record definition (kept here as the reference: every execution re-read for every incident).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.control.ettr import Ettr
from trainguard.operators.fleet import FleetStore
from trainguard.operators.fleet.states import IncidentState
from trainguard.operators.fleet.store import OPEN_INCIDENT_STATES
from trainguard.operators.policy import ettr


# ---- the reference: the definition, record by record -------------------------------------------------------
def ref_executions(records: Iterable[Mapping[str, Any]]) -> list[ettr.Execution]:
    out = [ettr.Execution(int(r["step"]), int(r.get("incarnation", 0)), float(r["ts"]), float(r["step_time_s"]))
           for r in records if isinstance(r.get("step_time_s"), int | float)]
    return sorted(out, key=lambda e: (e.end_ts, e.incarnation))


def ref_kept(execs: Iterable[ettr.Execution]) -> tuple[list[ettr.Execution], list[ettr.Execution]]:
    execs = list(execs)
    last: dict[int, ettr.Execution] = {}
    for e in execs:
        prev = last.get(e.step)
        if prev is None or (e.incarnation, e.end_ts) > (prev.incarnation, prev.end_ts):
            last[e.step] = e
    keep_ids = {id(e) for e in last.values()}
    return [e for e in execs if id(e) in keep_ids], [e for e in execs if id(e) not in keep_ids]


def ref_overlap(e: ettr.Execution, start: float, end: float) -> float:
    return max(0.0, min(e.end_ts, end) - max(e.start_ts, start))


def ref_window_end(records: Iterable[Mapping[str, Any]], now: float, *, incident_open: bool) -> float:
    execs = ref_executions(records)
    if incident_open or not execs:
        return now
    last = max(e.end_ts for e in execs)
    times = sorted(e.step_time_s for e in execs)
    median = times[len(times) // 2]
    return last if 0.0 <= now - last <= 2.0 * median else now


def ref_ettr(records: Iterable[Mapping[str, Any]], *, start_ts: float, end_ts: float) -> ettr.Ettr:
    if end_ts <= start_ts:
        raise ValueError(f"ETTR window is empty: {start_ts} .. {end_ts}")
    good, lost = ref_kept(ref_executions(records))
    productive = sum(ref_overlap(e, start_ts, end_ts) for e in good)
    wasted = sum(ref_overlap(e, start_ts, end_ts) for e in lost)
    inside = [e for e in good if ref_overlap(e, start_ts, end_ts) > 0]
    lost_in = [e for e in lost if ref_overlap(e, start_ts, end_ts) > 0]
    return ettr.Ettr(productive / (end_ts - start_ts), productive, wasted, end_ts - start_ts, len(inside),
                     len(lost_in))


def ref_incident_split(incident: Mapping[str, Any], records: Iterable[Mapping[str, Any]], *, since_ts: float = 0.0,
                       ) -> dict[str, float]:
    first = incident["first_alert_ts"]
    opened = incident.get("opened_ts") or first
    decided = incident.get("decided_ts") or incident.get("diagnosis_start_ts") or opened
    resumed = incident.get("resumed_ts")
    diag_start = incident.get("diagnosis_start_ts") or opened
    _good, lost = ref_kept(ref_executions(records))
    lost_work = sum(e.step_time_s for e in lost if since_ts < e.end_ts <= opened + 1e-6)
    return {
        "detection_s": max(0.0, opened - first),
        "diagnosis_s": max(0.0, decided - diag_start) if incident.get("diagnosis_start_ts") else 0.0,
        "recovery_s": max(0.0, resumed - decided) if resumed else 0.0,
        "lost_work_s": lost_work,
    }


def ref_report(fleet: FleetStore, job: str, records: list[dict[str, Any]], as_of: float, window_s: float = 3600.0,
               ) -> dict[str, Any]:
    """Ettr.ettr_report as it was: every incident's split re-reads the whole history."""
    now = as_of
    first = min(float(r["ts"]) - float(r.get("step_time_s") or 0.0) for r in records)
    records = ettr.continued(records)  # the definition counts a program's own pauses between its steps
    incidents, by_cause = [], {}
    since = first
    for inc in fleet.incidents(job):
        if inc.state not in (IncidentState.RESOLVED, IncidentState.FAILED) or inc.first_alert_ts is None:
            continue
        split = ref_incident_split({"first_alert_ts": inc.first_alert_ts, "opened_ts": inc.opened_ts,
                                    "diagnosis_start_ts": inc.diagnosis_start_ts, "decided_ts": inc.decided_ts,
                                    "resumed_ts": inc.resumed_ts}, records, since_ts=since)
        incidents.append({"incident": inc.id, "category": inc.category, "state": inc.state,
                          **{k: round(v, 3) for k, v in split.items()}})
        cause = by_cause.setdefault(inc.category or "unknown", {"incidents": 0, "seconds": 0.0})
        cause["incidents"] += 1
        cause["seconds"] = round(cause["seconds"] + sum(split.values()), 3)
        since = inc.resumed_ts or since
    now = ref_window_end(records, now, incident_open=any(i.state in OPEN_INCIDENT_STATES
                                                         for i in fleet.incidents(job)))
    return {"job": job, "cumulative": ref_ettr(records, start_ts=first, end_ts=now).as_dict(),
            "sliding": {"window_s": window_s,
                        **ref_ettr(records, start_ts=max(first, now - window_s), end_ts=now).as_dict()},
            "incidents": incidents, "by_cause": by_cause}


# ---- randomized histories ------------------------------------------------------------------------------------
def history(rng: random.Random, *, failures: int, steps_between: int = 40
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Rank 0's step records of a job that failed ``failures`` times, and its incidents (in opening order).
    After each failure the job restores 0-8 steps back (sometimes from a much older checkpoint) and a new
    incarnation recomputes them; step times vary (some int), some records carry no step time, some steps
    end at the same second in two incarnations, some records are duplicated; the incidents' timestamps are
    partly missing and their windows may overlap (a resumption recorded after the next failure)."""
    t, step = 1000.0 + rng.random(), 0
    records: list[dict[str, Any]] = []
    incidents: list[dict[str, Any]] = []
    for k in range(failures + 1):
        for _ in range(rng.randint(1, steps_between)):
            dt = rng.choice([1, 2, rng.uniform(0.5, 3.0), rng.uniform(0.5, 3.0)])
            t += dt
            step += 1
            r = {"step": step, "incarnation": k, "ts": t, "step_time_s": dt}
            if rng.random() < 0.03:
                r["step_time_s"] = None  # a record without a step time: no execution
            records.append(r)
            if rng.random() < 0.03:
                records.append(dict(r))  # read twice (two machines' copies)
        if k == failures:
            break
        first_alert = t + rng.uniform(0.0, 15.0)
        opened = first_alert + rng.choice([0.0, rng.uniform(0.1, 5.0)])
        diagnosed = opened + rng.uniform(0.5, 4.0) if rng.random() < 0.7 else None
        decided = (diagnosed or opened) + rng.uniform(1.0, 30.0) if rng.random() < 0.8 else None
        resumed = (decided or opened) + rng.uniform(5.0, 60.0) if rng.random() < 0.85 else None
        incidents.append({"first_alert_ts": first_alert, "opened_ts": opened, "diagnosis_start_ts": diagnosed,
                          "decided_ts": decided, "resumed_ts": resumed,
                          "state": rng.choice([IncidentState.RESOLVED] * 4 + [IncidentState.FAILED]),
                          "category": rng.choice(["hardware", "network", "user_code", ""])})
        back = rng.randint(10, 40) if rng.random() < 0.1 else rng.randint(0, 8)
        step = max(0, step - back)
        restart = resumed if resumed is not None else opened + rng.uniform(5.0, 60.0)
        # a resumption recorded late: the next failure's window starts before this one's ended
        t = restart - rng.uniform(0.0, 40.0) if rng.random() < 0.15 else restart
        if rng.random() < 0.1 and records:  # the new incarnation's first step ends with the old one's last
            t = records[-1]["ts"] - 1.0
    return records, incidents


def same(a: Any, b: Any) -> bool:
    """Equal, counting NaN equal to NaN (a history with a NaN timestamp)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def assert_same_ettr(got: ettr.Ettr, want: ettr.Ettr) -> None:
    for field in ("ratio", "productive_s", "lost_work_s", "wall_s", "kept_steps", "lost_steps"):
        assert same(getattr(got, field), getattr(want, field)), (field, getattr(got, field), getattr(want, field))


def ledger_over(tmp_path: Path, incidents: list[dict[str, Any]], *, still_open: bool = False
                ) -> tuple[Ettr, FleetStore]:
    """An ETTR ledger whose fleet database holds job ``j`` and its ``incidents`` (opened and closed through the
    fleet database's own calls, in order), the last one left open when ``still_open``."""
    clock = [0.0]
    fleet = FleetStore(tmp_path / "fleet.db", clock=lambda: clock[0], migrate=True)
    fleet.register_machine("m0", address="10.0.0.10")
    fleet.upsert_job("j", tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["m0"])
    for n, inc in enumerate(incidents):
        clock[0] = inc["opened_ts"]
        opened, _ = fleet.open_incident("j", [{"id": f"a{n}", "ts": inc["first_alert_ts"], "kind": "rank_exit",
                                               "job": "j", "machine": "m0"}], category=inc["category"])
        if still_open and n == len(incidents) - 1:
            break
        fleet.update_incident(opened.id, state=inc["state"], **{k: inc[k] for k in (
            "diagnosis_start_ts", "decided_ts", "resumed_ts") if inc[k] is not None})
    inventory = Inventory(cluster="t", transport="local", machines=[Machine(name="m0", address="10.0.0.10")])
    c = Controller(ControlConfig(fleet_url=str(tmp_path / "fleet.db"), inventory=str(tmp_path / "inventory.json")),
                   inventory=inventory, fleet=fleet)
    return c.ettr, fleet


# ---- the policy ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(30))
def test_the_step_history_gives_the_definitions_numbers_on_random_histories(seed: int):
    rng = random.Random(seed)
    records, incidents = history(rng, failures=rng.randint(0, 8))
    if seed % 3 == 1:
        rng.shuffle(records)  # records not in time order: the history orders them itself
    if seed % 5 == 2:
        for r in records:  # sparse step numbers (a table by step would be huge)
            r["step"] = r["step"] * 10**12
    steps = ettr.StepHistory(records)
    _good, lost = ref_kept(ref_executions(records))
    assert len(steps) == len(ref_executions(records))
    assert sum(1 for k in steps.kept if not k) == len(lost)
    end = max(r["ts"] for r in records)
    windows = [(990.0, end + 5.0), (end - 30.0, end), (end + 1.0, end + 9.0), (900.0, 995.0), (1000, int(end) + 1)]
    windows += [tuple(sorted(rng.uniform(995.0, end + 10.0) for _ in range(2))) for _ in range(6)]
    for start, stop in windows:
        for source in (records, steps):
            assert_same_ettr(ettr.ettr(source, start_ts=start, end_ts=stop), ref_ettr(records, start_ts=start,
                                                                                       end_ts=stop))
    for now in (end, end + 0.5, end + 2.5, end + 3.5, end + 4.5, end + 100.0, end - 3.0, 0.0):
        for incident_open in (False, True):
            want = ref_window_end(records, now, incident_open=incident_open)
            assert ettr.window_end(steps, now, incident_open=incident_open) == want
            assert ettr.window_end(records, now, incident_open=incident_open) == want
    since = 0.0
    for inc in [*incidents, {"first_alert_ts": end, "opened_ts": None}]:  # the last: timestamps missing
        for after in (since, 0.0, rng.uniform(990.0, end)):
            want = ref_incident_split(inc, records, since_ts=after)
            for source in (records, steps):
                got = ettr.incident_split(inc, source, since_ts=after)
                assert got == want and all(type(got[k]) is type(want[k]) for k in want), (got, want)
        since = inc.get("resumed_ts") or since


def test_a_nan_timestamp_gives_the_definitions_numbers_too():
    records, _ = history(random.Random(7), failures=4)
    records[len(records) // 2]["ts"] = float("nan")
    steps = ettr.StepHistory(records)
    for start, stop in ((990.0, 5000.0), (1050.0, 1100.0)):
        assert_same_ettr(steps.ettr(start_ts=start, end_ts=stop), ref_ettr(records, start_ts=start, end_ts=stop))
    assert same(steps.window_end(5000.0, incident_open=False),
                ref_window_end(records, 5000.0, incident_open=False))
    inc = {"first_alert_ts": 1100.0, "opened_ts": 1101.0}
    assert ettr.incident_split(inc, steps, since_ts=1000.0) == ref_incident_split(inc, records, since_ts=1000.0)


# ---- the ledger ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(12))
def test_the_report_has_the_numbers_of_the_record_by_record_report(tmp_path: Path, seed: int):
    rng = random.Random(100 + seed)
    records, incidents = history(rng, failures=rng.randint(1, 10))
    still_open = seed % 4 == 3
    ledger, fleet = ledger_over(tmp_path, incidents, still_open=still_open)
    last = max(r["ts"] for r in records)
    for as_of in (last + 0.5, last + 500.0):  # stepping (a step in flight), stalled
        for window_s in (3600.0, 60.0):
            got = ledger.ettr_report("j", records=records, as_of=as_of, window_s=window_s)
            assert got.pop("unanswered") == []  # records given: no machine was asked
            want = ref_report(fleet, "j", records, as_of, window_s)
            assert json.dumps(got) == json.dumps(want)  # every number, 0 and 0.0 told apart
    closed = [i for i in fleet.incidents("j") if i.state not in OPEN_INCIDENT_STATES]
    assert len(got["incidents"]) == len(closed)


class CountingRecord(dict):
    """A step record that counts the reads of its step time (a real record: a dict)."""

    reads = 0

    def get(self, key: str, default: Any = None) -> Any:
        if key == "step_time_s":
            CountingRecord.reads += 1
        return super().get(key, default)


def test_the_report_reads_each_step_record_the_same_number_of_times_whatever_the_incidents(tmp_path: Path):
    rng = random.Random(3)
    records, incidents = history(rng, failures=40, steps_between=10)
    reads = []
    for n in (1, len(incidents)):
        ledger, fleet = ledger_over(tmp_path / str(n), incidents[:n])
        counted = [CountingRecord(r) for r in records]
        CountingRecord.reads = 0
        report = ledger.ettr_report("j", records=counted, as_of=max(r["ts"] for r in records) + 0.5)
        assert len(report["incidents"]) == n
        reads.append(CountingRecord.reads)
        fleet.close()
    assert reads[0] == reads[1] <= 2 * len(records)  # not once more per incident


def test_a_report_says_which_machines_did_not_answer_for_their_step_records(tmp_path: Path, monkeypatch):
    """A machine that cannot be asked may hold part of the history: the report is marked partial, naming it,
    instead of passing a part of the history for the whole."""
    from tests.fakes import fleet_controller, use_controller
    from trainguard.operators.tasks import common
    from trainguard.operators.tasks import ettr as ettr_task

    c, fake = fleet_controller(tmp_path)
    fake.records = [{"step": s, "incarnation": 0, "ts": 1000.0 + s, "step_time_s": 1.0} for s in range(1, 30)]
    fake.unreachable = {"m3"}
    use_controller(monkeypatch, c)
    notes: list[str] = []
    monkeypatch.setattr(common, "note", notes.append)
    out = ettr_task.ettr_reports(c, "j", 3600.0)
    assert out["j"]["unanswered"] == ["m3"]
    assert notes[0].endswith("(partial: m3 did not answer)"), notes
    fake.unreachable = set()
    assert ettr_task.ettr_reports(c, "j", 3600.0)["j"]["unanswered"] == []


def test_a_programs_own_pauses_between_its_steps_are_training_and_a_restart_or_a_hold_is_not():
    """Lightning's loop and its data loading take 1.5 ms between guarded steps of 7 ms: counted as the training it
    is (the job's ETTR was read as 82% while it trained untouched). A pause of 300 s (a rank held still for the
    control plane) and the gap before a restarted incarnation's first step are not."""
    records, ts = [], 1000.0
    for step in range(1000):
        ts += 0.0015 + 0.007
        records.append({"step": step, "incarnation": 0, "ts": ts, "step_time_s": 0.007})
    plain = ettr.ettr(records, start_ts=1000.0, end_ts=ts)
    assert plain.ratio == pytest.approx(0.007 / 0.0085, abs=1e-3)
    assert ettr.ettr(ettr.continued(records), start_ts=1000.0, end_ts=ts).ratio == pytest.approx(1.0, abs=1e-3)
    held = ts + 300.0 + 0.007  # held still 300 s after step 999, then step 1000 in the same process
    restarted = held + 20.0  # a restart: incarnation 1 goes on from step 1001
    more = [{"step": 1000, "incarnation": 0, "ts": held, "step_time_s": 0.007},
            {"step": 1001, "incarnation": 1, "ts": restarted, "step_time_s": 0.007}]
    got = {r["step"]: r["step_time_s"] for r in ettr.continued(records + more)}
    assert got[1] == pytest.approx(0.0085) and got[1000] == 0.007 and got[1001] == 0.007 and got[0] == 0.007
