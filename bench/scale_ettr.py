"""The ETTR report at scale: a job's whole step history (rank 0, 2-second steps) with an incident about
every hour, each restored a few steps back, read by :meth:`Ettr.ettr_report` against a fleet
database that holds the incidents.

    python bench/scale_ettr.py [DAYS ...]

Metric ``ettr_report_s``: one report, for a history of 1, 7 and 90 days (90 days: about 3.9 million step
records and 2,100 closed incidents; target <= 30 s on 2 cores). ``prepare(days)`` builds the records and the
database (untimed); the callable it returns runs the report once.
"""

from __future__ import annotations

import atexit
import random
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.control.ettr import Ettr
from trainguard.operators.fleet import FleetStore
from trainguard.operators.fleet.models import Incident
from trainguard.operators.fleet.states import IncidentState

JOB = "scale"
CAUSES = ("hardware", "network", "user_code", "infrastructure")


def job_history(days: float, *, seed: int = 0, t0: float = 1.75e9, step_s: float = 2.0,
                mtbf_s: float = 3600.0) -> tuple[list[dict[str, Any]], list[dict[str, Any]], float]:
    """Rank 0's step records of a job that ran ``days`` (steps of about ``step_s``), its closed incidents
    (one every ``mtbf_s`` on average: the step in flight dies, the job restores 1-5 steps back and a new
    incarnation recomputes them after detection, diagnosis and recovery) and the time the report is read
    (a step in flight). Deterministic for a ``seed``."""
    rng = random.Random(seed)
    records: list[dict[str, Any]] = []
    incidents: list[dict[str, Any]] = []
    t, step, incarnation = t0, 0, 0
    machine = "m0"
    horizon = t0 + days * 86400.0
    failure = t + rng.expovariate(1.0 / mtbf_s)
    while t < horizon:
        dt = rng.uniform(0.95 * step_s, 1.05 * step_s)
        if t + dt <= failure:
            t += dt
            step += 1
            records.append({"step": step, "incarnation": incarnation, "ts": t, "step_time_s": dt,
                            "machine": machine})
            continue
        # the failure: alerts, the incident's phases, a restore a few steps back, a new incarnation
        first_alert = failure + rng.uniform(1.0, 20.0)
        opened = first_alert + rng.uniform(0.5, 5.0)
        diagnosed = opened + rng.uniform(1.0, 5.0) if rng.random() < 0.8 else None
        decided = (diagnosed or opened) + rng.uniform(5.0, 60.0)
        resumed = decided + rng.uniform(30.0, 180.0)
        incidents.append({"state": IncidentState.FAILED if rng.random() < 0.05 else IncidentState.RESOLVED,
                          "category": rng.choice(CAUSES), "first_alert_ts": first_alert, "opened_ts": opened,
                          "diagnosis_start_ts": diagnosed, "decided_ts": decided, "resumed_ts": resumed,
                          "closed_ts": resumed + 1.0})
        step = max(0, step - rng.randint(1, 5))
        incarnation += 1
        if rng.random() < 0.3:  # the rank moved: its machine was evicted
            machine = f"m{incarnation % 8}"
        t = resumed
        failure = t + rng.expovariate(1.0 / mtbf_s)
    return records, incidents, t + 0.5 * step_s


def ledger_with(incidents: list[dict[str, Any]], folder: Path) -> Ettr:
    """An ETTR ledger over a fleet database in ``folder`` that holds the job and ``incidents`` (in order)."""
    fleet = FleetStore(folder / "fleet.db", migrate=True)
    fleet.register_machine("m0", address="127.0.0.1")
    fleet.upsert_job(JOB, tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["m0"])
    with fleet.tx() as s:
        s.add_all(Incident(job=JOB, summary="", **inc) for inc in incidents)
    inventory = Inventory(cluster="scale", transport="local", machines=[Machine(name="m0", address="127.0.0.1")])
    return Controller(ControlConfig(fleet_url=str(folder / "fleet.db"), inventory=str(folder / "inventory.json")),
                      inventory=inventory, fleet=fleet).ettr


def prepare_report(days: int) -> Callable[[], Any]:
    records, incidents, as_of = job_history(days)
    folder = Path(tempfile.mkdtemp(prefix="tg-scale-ettr-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    ledger = ledger_with(incidents, folder)

    def run() -> tuple[float, int, int]:
        report = ledger.ettr_report(JOB, records=records, as_of=as_of)
        return report["cumulative"]["ettr"], report["cumulative"]["lost_steps"], len(report["incidents"])

    return run


CASES: dict[str, tuple[Callable[[int], Callable[[], Any]], list[int]]] = {
    "ettr_report_s": (prepare_report, [1, 7, 90]),
}


if __name__ == "__main__":
    from bench.common import run_cases

    sys.exit(run_cases(CASES, sys.argv[1:]))
