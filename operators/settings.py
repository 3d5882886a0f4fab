"""The control plane's settings: one typed object, read from ``TG_*`` environment variables (the fleet database
from its Airflow connection where one is defined: :mod:`trainguard.operators.hooks.connections`).

Every setting of the control plane (the Airflow processes, ``trainguard``) that an operator may change
is a field of :class:`ControlSettings`: its type, its bounds, its default and what it does, in one
place. :class:`Settings` reads them from the environment with pydantic-settings (``TG_`` + the field's
name in capitals: ``resume_timeout_s`` is ``TG_RESUME_TIMEOUT_S``; an empty variable is unset).
A value of the wrong type or out of bounds is a one-line error naming the variable and what to do
(:class:`SettingsError`, exit code 2), never a traceback. The README's settings table is this module's
output: ``python -m trainguard.operators.settings``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, Field, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from trainguard.core.errors import EXIT_USAGE, TrainguardError
from trainguard.operators.policy.liveness import DEFAULT_SILENT_S

DEFAULT_SETTLE_S = 1.0  # the guardian's batch window, seconds

PREFIX = "TG_"


class SettingsError(TrainguardError, ValueError):
    """A ``TG_*`` variable that is not of its setting's type or is out of its bounds."""

    exit_code = EXIT_USAGE


class ControlSettings(BaseModel):
    """The control plane's settings, typed and bounded (see the module's docstring for where they come from)."""

    model_config = {"frozen": True}

    fleet_url: str = Field(".tg/fleet.db", description="the fleet database where the Airflow connection "
                                                       "TG_FLEET_CONN_ID (tg_fleet) is not defined: a SQLite path or "
                                                       "a SQLAlchemy URL")
    fleet_retry_s: float = Field(180.0, ge=0.0, le=3600.0,
                                 description="how long the control plane's tasks and triggers wait out a fleet "
                                             "database that does not answer (a restart, a network blip) before "
                                             "they fail, seconds (0: fail at once)")
    inventory: str = Field(".tg/cluster/inventory.json", description="the inventory file")
    dry_run: bool = Field(False, description="record every decision, act on nothing")
    breaker_share: float = Field(0.5, ge=0.0, le=1.0, description="at most this share of a job's machines is "
                                                                  "evicted automatically per breaker window")
    breaker_window_s: float = Field(3600.0, ge=0.0, description="the circuit breaker's window, seconds")
    resume_timeout_s: float = Field(300.0, ge=1.0, description="how long a recovery waits for training to pass "
                                                               "the restored step, seconds")
    diag_timeout_s: float = Field(120.0, ge=1.0, description="per diagnostic level, seconds")
    ssh_fanout: int = Field(256, ge=1, le=4096, description="SSH sessions a task opens at once for a fan-out "
                                                           "(stop, restart, status rounds): a fleet up to this "
                                                           "size in one wave")
    diag_concurrency: int = Field(8, ge=2, description="machines diagnosed at once (L3 pairs count as their "
                                                       "machines), so that diagnosis does not measure its own load")
    escalation_window_s: float = Field(1800.0, ge=0.0, description="a failure this soon after the job's last "
                                                                   "recovery that repeats it (same category) "
                                                                   "climbs the ladder, seconds")
    slow_rounds: int = Field(5, ge=1, description="rounds of the fail-slow vote (ByteRobust: 5)")
    slow_interval_s: float = Field(10.0, ge=0.0, description="seconds between the vote's rounds (ByteRobust: 10)")
    slow_factor: float = Field(1.25, ge=1.0, description="a rank whose recent compute time is above this multiple "
                                                         "of its stage's median is flagged in a round of the vote")
    stop_grace_s: float = Field(5.0, ge=0.0, description="a stopped job's processes get this long after SIGTERM "
                                                         "before SIGKILL, seconds")
    repeat_window_s: float = Field(3600.0, ge=0.0, description="failures of one machine within this window count "
                                                               "towards a repeat offender, seconds")
    repeat_count: int = Field(2, ge=1, description="a machine implicated in this many incidents within the window "
                                                   "(each diagnosis clean) is swapped out at its next failure")
    restart_attempts: int = Field(3, ge=1, description="restarts of an incident's recovery (another standby, "
                                                       "another copy, an older step) before it waits for a human")
    alert_settle_s: float = Field(DEFAULT_SETTLE_S, ge=0.0, le=60.0, description="how long the guardian's batch keeps "
                                                                    "collecting alerts after its first, seconds")
    agent_silent_s: float = Field(DEFAULT_SILENT_S, description="an agent of a running job silent this long is an "
                                                                "incident, seconds (0: off; at least 5, agents beat "
                                                                "every 2 s)")
    reconcile_period_s: float = Field(10.0, ge=0.0, le=300.0,
                                      description="how often the reconciler looks at every running job behind the "
                                                  "incidents (processes, progress, unhandled faults, incidents "
                                                  "without a live run), seconds (0: off)")
    reconcile_confirm_s: float = Field(15.0, ge=0.0, description="a job process found not running is an incident "
                                                                 "once a second look this much later finds the "
                                                                 "same, seconds")
    reconcile_stall_s: float = Field(300.0, ge=10.0, description="a job whose lowest step has not moved for this long "
                                                                 "(no rank holding still, no incident) is an "
                                                                 "incident, seconds")
    reconcile_grace_s: float = Field(60.0, ge=0.0, description="an open incident without a live run for this long "
                                                               "gets a new run, seconds")
    lazy_force_s: float = Field(86400.0, ge=0.0, description="a lazy code update still pending after this long is "
                                                             "applied by a hot update, seconds")
    known_good_steps: int = Field(200, ge=1, description="healthy steps after which the code-update sweep marks "
                                                         "the running revision known-good")

    @field_validator("agent_silent_s")
    @classmethod
    def _silent_off_or_above_the_beat(cls, value: float) -> float:
        if value != 0 and value < 5:
            raise ValueError("must be 0 (off) or at least 5 s (agents beat every 2 s)")
        return value

    @classmethod
    def variable(cls, name: str) -> str:
        """The environment variable of setting ``name``."""
        return PREFIX + name.upper()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **overrides: Any) -> ControlSettings:
        """The settings from ``env`` (default: this process's environment, read by :class:`Settings`);
        ``overrides`` (not None) win. Raises :class:`SettingsError` naming the variable."""
        try:
            if env is None:
                base: ControlSettings = Settings()
            else:
                base = ControlSettings.model_validate({n: env[cls.variable(n)] for n in ControlSettings.model_fields
                                                       if env.get(cls.variable(n), "") != ""})
            given = {k: v for k, v in overrides.items() if v is not None}
            if "fleet_url" not in given:  # the fleet database's connection, where it is defined, over TG_FLEET_URL
                from trainguard.operators.hooks.connections import fleet_url_from_connection

                url = fleet_url_from_connection(env)
                if url:
                    given["fleet_url"] = url
            return ControlSettings.model_validate({**base.model_dump(), **given}) if given else base
        except ValidationError as exc:
            raise _one_line(exc, os.environ if env is None else env) from None


class Settings(BaseSettings, ControlSettings):
    """:class:`ControlSettings` read from this process's ``TG_*`` environment variables (pydantic-settings)."""

    model_config = SettingsConfigDict(env_prefix=PREFIX, extra="ignore", env_ignore_empty=True, frozen=True)


_KINDS = {"int_parsing": "a whole number", "int_from_float": "a whole number", "float_parsing": "a number",
          "bool_parsing": "true or false"}


def _one_line(exc: ValidationError, env: Mapping[str, str]) -> SettingsError:
    """The first problem of ``exc`` as one line: the variable, its value, what is wrong, what to do."""
    err = exc.errors()[0]
    name = str(err["loc"][0]) if err.get("loc") else ""
    field = ControlSettings.model_fields.get(name)
    var = ControlSettings.variable(name)
    raw = env.get(var, err.get("input"))
    default = f"unset it for the default ({field.default})" if field is not None else "unset it"
    kind, ctx = err["type"], err.get("ctx") or {}
    if kind in _KINDS:
        return SettingsError(f"{var}={raw!r} is not {_KINDS[kind]}; {default}")
    if kind in ("greater_than_equal", "greater_than"):
        return SettingsError(f"{var}={raw} is below {ctx.get('ge', ctx.get('gt'))}; {default}")
    if kind in ("less_than_equal", "less_than"):
        return SettingsError(f"{var}={raw} is above {ctx.get('le', ctx.get('lt'))}; {default}")
    why = str(ctx.get("error") or err.get("msg", "is not allowed"))
    return SettingsError(f"{var}={raw} {why}; {default}")


def markdown_table() -> str:
    """The README's settings table."""
    rows = ["| variable | default | |", "|---|---|---|"]
    for name, field in ControlSettings.model_fields.items():
        default = field.default
        shown = "off" if default is False else f"`{default:g}`" if isinstance(default, float) else f"`{default}`"
        rows.append(f"| `{ControlSettings.variable(name)}` | {shown} | {field.description} |")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
