"""What every benchmark shares: machine facts, summaries, and the result document."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    mem = 0.0
    try:
        with open("/proc/meminfo") as fh:
            mem = int(fh.readline().split()[1]) / 2**20
    except OSError:
        pass
    return {"cores": os.cpu_count(), "memory_gib": round(mem, 1), "gpu": None, "python": platform.python_version()}


def summarize(values: list[float], unit: str, target: float | None = None) -> dict[str, Any]:
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]
    out: dict[str, Any] = {"median": round(statistics.median(ordered), 4), "p90": round(p90, 4),
                           "min": round(ordered[0], 4), "max": round(ordered[-1], 4), "n": len(ordered), "unit": unit}
    if target is not None:
        out["target"] = target
    return out


def write_result(name: str, *, quick: bool, setup: dict[str, Any], metrics: dict[str, Any],
                 out: Path | None) -> str:
    """The benchmark's JSON document (the format bench/table.py reads), written to ``out`` if given."""
    doc = {"name": name, "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "quick": quick,
           "machine": machine_info(), "setup": setup, "metrics": metrics}
    text = json.dumps(doc, indent=2)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text


def seconds_range(text: str) -> tuple[float, float] | None:
    """``MIN,MAX`` seconds (a quiet period's bounds), or None when the text is not that."""
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        return None
    return (lo, hi) if 0 <= lo <= hi else None


def run_cases(cases: dict[str, Any], argv: list[str]) -> int:
    """A ``bench/scale_<area>.py``'s self-check: one run of each case at each size (the sizes given as
    arguments, else the case's), its seconds and what it returned."""
    import time

    only = [int(a) for a in argv]
    for metric, (prepare, sizes) in cases.items():
        for size in [s for s in only if s in sizes] if only else sizes:
            run = prepare(size)
            t0 = time.perf_counter()
            out = run()
            print(f"{metric} {size}: {time.perf_counter() - t0:.3f} s  {out}", flush=True)
    return 0


def stop_on_sigterm() -> None:
    """A kill ends the run through its clean-up (Airflow, the job, the cluster's namespaces and mounts)."""
    import signal

    def stop(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)


@contextlib.contextmanager
def emulated_cluster(spec: Any, prefix: str) -> Iterator[tuple[Any, Path]]:
    """The benchmark's own namespace cluster and a control folder (fleet database, Airflow home) beside
    it. Brought down at the end; the folder is removed after a complete run, kept after a failed one (and after
    any run with ``TG_BENCH_KEEP`` set: the Airflow logs and database of every trial, to read where time went)."""
    import shutil
    import sys
    import tempfile

    from trainguard.emulation import cluster

    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    state = tmp / "state"
    ok = False
    try:
        cluster.down(state, name=spec.name, log=lambda *_: None)
        inv = cluster.up(spec, state, log=lambda *_: None)
        home = tmp / "control"
        home.mkdir()
        try:
            yield inv, home
            ok = True
        finally:
            cluster.down(state, name=spec.name, log=lambda *_: None)
    finally:
        if ok and not os.environ.get("TG_BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"kept {tmp} for a post-mortem (control/: fleet database, Airflow logs)", file=sys.stderr)


def timeline(tasks: dict[str, dict[str, Any]], t0: float) -> list[list[Any]]:
    """``[task_id, start - t0, duration]`` of each task of an incident's run that ran (``tasks``: as
    :meth:`~trainguard.emulation.guarded.GuardedJob.incident_run` lists them), in start order (seconds, 2
    decimals): where a recovery's seconds went."""
    ran = sorted((t for t in tasks.values() if t.get("start")), key=lambda t: t["start"])
    return [[t["task_id"], round(t["start"] - t0, 2), round(t["end"] - t["start"], 2) if t.get("end") else None]
            for t in ran]
