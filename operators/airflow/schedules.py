"""Schedules of the scheduled DAGs, from the environment of the Airflow processes (read when a DAG file
is parsed; a light module, so parsing stays fast)."""

from __future__ import annotations

import os


def schedule_from_env(variable: str, default: str) -> str | None:
    """The environment variable's schedule (a cron expression or preset; empty or "none": by hand
    only), else ``default``."""
    value = os.environ.get(variable, default).strip()
    return None if value.lower() in ("", "none") else value
