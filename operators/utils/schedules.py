"""Schedules of the scheduled DAGs, from the environment of the Airflow processes (read when a DAG file
is parsed; a light module, so parsing stays fast)."""

from __future__ import annotations

import os


def schedule_from_env(variable: str, default: str) -> str | None:
    """The environment variable's schedule (a cron expression or preset; empty or "none": by hand
    only), else ``default``."""
    value = os.environ.get(variable, default).strip()
    return None if value.lower() in ("", "none") else value


def asset_or_cron(asset: object, *, cron_variable: str, cron_default: str, on_variable: str) -> object:
    """A schedule that runs on ``asset`` events (unless ``on_variable`` is 0/false/off) and on the
    environment's cron (unless it is empty or "none"): both, either, or None (by hand only)."""
    from airflow.sdk import AssetOrTimeSchedule, CronTriggerTimetable

    cron = schedule_from_env(cron_variable, cron_default)
    on_events = os.environ.get(on_variable, "1").strip().lower() not in ("0", "false", "off", "no")
    if cron and on_events:
        return AssetOrTimeSchedule(timetable=CronTriggerTimetable(cron, timezone="UTC"), assets=[asset])
    if on_events:
        return [asset]
    return cron
