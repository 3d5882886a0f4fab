"""The recovery benchmark's task timeline (bench/recovery.py): where a recovery's time went, task by task."""

from __future__ import annotations

from bench.recovery import timeline


def test_the_timeline_lists_the_tasks_that_ran_in_start_order_after_the_fault():
    tasks = {
        "stop_job": {"task_id": "stop_job", "start": 107.5, "end": 110.25},
        "triage": {"task_id": "triage", "start": 102.0, "end": 102.5},
        "roll_back": {"task_id": "roll_back", "start": None, "end": None},  # never ran (skipped before a start)
        "wait_for_resume": {"task_id": "wait_for_resume", "start": 111.0, "end": None},  # still running
    }
    assert timeline(tasks, 100.0) == [["triage", 2.0, 0.5], ["stop_job", 7.5, 2.75], ["wait_for_resume", 11.0, None]]
