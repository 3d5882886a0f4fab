"""A day in the life of a job trainguard's authors did not write (``bench/day.py``, the short variant): Lightning's
own ``BoringModel`` fitted by Lightning's own loop (DDP on 2 machines, gradient accumulation, its own validation,
steps of a few milliseconds) under ``trainguard controlplane up``'s defaults, submitted, faulted, stopped and
submitted again with the command line alone.

What a team sees in its first hour: no incident while it trains healthy; a crash, a lost GPU during a fail-slow
vote and a crash after a resubmit each back without a human; a hang whose eviction the breaker refuses waits for a
person, who closes it with one command; and across every restore, the resubmit's included, no sample of an epoch
trained twice or skipped. ``python bench/day.py`` runs the whole day (30 healthy minutes first).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from bench import day

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.airflow, pytest.mark.timeout(1500)]


def test_a_strangers_lightning_job_through_a_day_of_faults_needs_a_human_only_for_the_refused_eviction():
    # the cluster's state outside pytest's basetemp, which a concurrent pytest run may prune (tests/conftest.py)
    home = Path(tempfile.mkdtemp(prefix="tg-test-day-"))
    lines: list[str] = []
    result = day.run(home, healthy_s=30.0, log=lines.append)["programs"]["stranger"]
    shutil.rmtree(home, ignore_errors=True)  # kept after a failure, for a post-mortem
    story = "\n".join(lines)
    healthy = result["healthy"]
    assert healthy["incidents"] == 0, f"false alarms on a healthy job: {healthy['opened']}\n{story}"
    assert result["not_caused"] == [], f"incidents no fault of the day opened: {result['not_caused']}\n{story}"
    assert healthy["steps"] > 1000 and healthy["step_s"] < 0.02, healthy  # steps under 20 ms
    for what in ("crash", "gpu_lost_during_vote", "crash_again"):
        assert result[what]["state"] == "resolved" and not result[what]["human"], (what, story)
    lost = result["gpu_lost_during_vote"]
    assert lost["category"] == "machine_fault" and lost["evicted"], story
    hang = result["hang_refused"]
    assert hang["human"] and "breaker" in hang["reason"].lower(), story
    assert result["resubmit"]["incidents_waiting"] == [], story
    assert all(i["state"] in ("resolved", "failed") for i in result["incidents"]), result["incidents"]
    humans = [i for i in result["incidents"] if i["state"] == "failed"]
    assert [i["id"] for i in humans] == [hang["incident"]] or all(
        "superseded" in i["summary"] or i["id"] == hang["incident"] for i in humans), humans
    samples = result["samples"]
    assert samples["problems"] == [], samples
    assert samples["restores"] >= 4 and samples["epochs_finished"] >= 10, samples
