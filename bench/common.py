"""What every benchmark shares: machine facts, summaries, and the result document."""

from __future__ import annotations

import json
import os
import platform
import statistics
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
    """The benchmark's JSON document (the format of the README's table), written to ``out`` if given."""
    doc = {"name": name, "when": datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"), "quick": quick,
           "machine": machine_info(), "setup": setup, "metrics": metrics}
    text = json.dumps(doc, indent=2)
    if out:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text + "\n")
    return text
