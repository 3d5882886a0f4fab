"""The bodies of ``tg_checkpoint_verify``'s tasks: verify every copy of a committed step, promote it to S3,
retain.
"""

from __future__ import annotations

from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.tasks import common


def _payloads(asset_events: Any) -> list[dict[str, Any]]:
    """The watcher's payloads carried by the asset events that started the run (none for a scheduled or manual
    run)."""
    out: list[dict[str, Any]] = []
    for events in (dict(asset_events) if asset_events else {}).values():
        for e in events:
            extra = getattr(e, "extra", None) if not isinstance(e, dict) else e.get("extra")
            payload = (extra or {}).get("payload")
            if isinstance(payload, dict):
                out.append(payload)
    return out


def ckpt_targets(c: Controller, job: str, step: int | None, asset_events: Any = None) -> list[dict[str, Any]]:
    """The (job, step) pairs this run verifies: the form's, the notices', or the schedule's sweep. The notices'
    names are recorded as read (the watcher only reads: a notice it sent and nobody recorded is sent again), and
    names recorded long ago leave the bus's notices folder."""
    from trainguard.operators import checkpoints

    payloads = _payloads(asset_events)
    record_notices(c, payloads)
    return checkpoints.targets(c, job=(job or "").strip(), step=step,
                               announced=[n for p in payloads for n in p.get("notices", [])])


def record_notices(c: Controller, payloads: list[dict[str, Any]]) -> None:
    """The names of the notices the watcher sent (its events' payloads) recorded in its cursor, so it sends them no
    more; names recorded long ago leave the bus's notices folder."""
    from trainguard.node_tools.bus import NOTICES
    from trainguard.operators.tasks.guardian import retire
    from trainguard.operators.triggers.alerts import NOTICES_READER

    for p in payloads:
        if p.get("read") or p.get("gone"):
            c.fleet.advance_cursor(NOTICES_READER, dict(p.get("read") or {}), list(p.get("gone") or ()))
    if payloads:
        retire(c, NOTICES_READER, folder=NOTICES)


def ckpt_verify(c: Controller, target: dict[str, Any]) -> dict[str, Any]:
    from airflow.sdk import get_current_context

    from trainguard.operators import checkpoints

    get_current_context()["target"] = f"{target['job']} step {target['step']}"
    return checkpoints.verify(c, target)


def _s3() -> tuple[Any, Any, dict[str, str]]:
    """Settings, a boto3 client and the machines' credentials, from the S3 connection
    (:func:`trainguard.operators.hooks.s3.s3_access`)."""
    from trainguard.operators import checkpoints
    from trainguard.operators.hooks.s3 import s3_access

    access = s3_access(required=True)
    return checkpoints.S3Settings.from_env(endpoint_url=access.endpoint_url), access.client, access.env


def ckpt_promote(c: Controller, verdict: dict[str, Any]) -> dict[str, Any]:
    from airflow.sdk import get_current_context

    from trainguard.operators import checkpoints

    get_current_context()["target"] = f"{verdict['job']} step {verdict['step']}"
    settings, client, env = checkpoints.S3Settings.from_env(), None, {}
    if verdict.get("ok") and settings.url:  # the S3 connection only when there is something to upload
        settings, client, env = _s3()
    return checkpoints.promote(c, verdict, settings, client=client, credentials=env)


def ckpt_conclude(verdicts: list[dict[str, Any]] | None, promotions: list[dict[str, Any]] | None) -> dict[str, Any]:
    """The run's one-line note; the run fails (its ``outcome`` task) when a step was not verified or not
    promoted."""
    from trainguard.operators import checkpoints

    verdicts, promotions = list(verdicts or []), [p for p in (promotions or []) if p]
    done = {(p["job"], p["step"]) for p in promotions}
    promotions += [{"job": v["job"], "step": v["step"], "promoted": False,
                    "problems": ["the promote task failed: see its log"]}
                   for v in verdicts if v["ok"] and (v["job"], v["step"]) not in done]
    failed = [v for v in verdicts if not v["ok"]] + [p for p in promotions if p.get("problems")]
    note = checkpoints.note(verdicts, promotions)
    common.note(note)
    return {"note": note, "ok": not failed, "verdicts": verdicts,
            "promotions": promotions}


def ckpt_outcome(concluded: dict[str, Any]) -> dict[str, Any]:
    if not concluded.get("ok"):
        raise TrainguardError(concluded.get("note") or "checkpoint verification failed")
    return {"note": concluded["note"]}
