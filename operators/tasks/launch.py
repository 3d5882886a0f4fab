"""The bodies of ``tg_job_launch``'s tasks: a submitted job validated, its machines reserved and checked (L1),
started and watched until its first step. A step that fails releases what the run reserved, so a failed launch
leaves no machine held; every step repeated is a no-op."""

from __future__ import annotations

from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.tasks import common

#: the form's fields that make a spec (the rest of the form, ``spec``, may hold a whole spec instead)
SPEC_FIELDS = ("name", "command", "workdir", "launcher", "machines", "processes_per_machine", "layout", "pass_layout",
               "standbys", "checkpoint", "env", "revision")


def spec_from_conf(conf: dict[str, Any]) -> dict[str, Any]:
    """The spec a run was given: ``conf["spec"]`` when it holds one (``trainguard job submit``), else the form's
    fields (``machines`` from the form's list, or its ``count`` when no machine is named)."""
    if conf.get("spec"):
        return dict(conf["spec"])
    doc = {k: conf[k] for k in SPEC_FIELDS if conf.get(k) not in (None, "", [], {})}
    if not doc.get("machines") and conf.get("count"):
        doc["machines"] = int(conf["count"])
    return doc


def validate(conf: dict[str, Any]) -> dict[str, Any]:
    """The checked spec (JSON), or the run fails with the one-line reason."""
    from trainguard.operators.jobspec import parse_spec

    spec = parse_spec(spec_from_conf(conf), source="tg_job_launch")
    common.note(f"job {spec.name}: {' '.join(spec.command)} on {spec.machines} machines")
    return spec.document()


def reserve(c: Controller, spec_doc: dict[str, Any]) -> dict[str, Any]:
    """Reserve the machines and record the job (``launching``) with its spec."""
    from trainguard.operators.jobspec import parse_spec
    spec = parse_spec(spec_doc)
    out = c.jobs.submit(spec)
    common.note(f"job {out['job']}: machines {', '.join(out['machines'])} reserved")
    # a count of machines may take other free ones in place of a machine that fails its check; named ones may not
    return {**out, "any_free": isinstance(spec.machines, int)}


def _release(c: Any, job: str, what: str, exc: BaseException, faulty: dict[str, str] | None = None) -> None:
    released = c.jobs.release(job, state="failed", reason=f"{what}: {exc}", faulty=faulty)
    common.note(f"job {job}: {what} failed ({exc}); machines {', '.join(released['released']) or 'none'} released")


def _earlier(step: dict[str, Any], what: str) -> dict[str, Any] | None:
    """What a step does for a submission that an earlier one launched already (the same spec again): nothing,
    and above all no release of the running job when something fails."""
    if step.get("submitted", True):
        return None
    common.note(f"job {step['job']}: submitted before with the same spec; {what} left to that launch")
    return {**step, "skipped": f"job {step['job']} was launched by an earlier submission"}


def check(c: Controller, reserved: dict[str, Any]) -> dict[str, Any]:
    """L1 (quick health) on every reserved machine; a machine that fails ends the launch and releases them all."""
    skipped = _earlier(reserved, "the check")
    if skipped is not None:
        return skipped
    job = reserved["job"]
    d = c.diagnosis.diagnose(job, list(reserved["machines"]), levels=(1,))
    seconds, bad, replaced = float(d["seconds"]), dict(d["failed"]), {}
    while bad:
        # a job asked for a count of machines: each machine that failed goes to repair, a free one takes its place
        # (checked in turn); a job that named its machines, or a pool with too few left, fails the launch
        free = c.fleet.free_machines() if reserved.get("any_free") else []
        if len(free) < len(bad):
            err = TrainguardError("machines failed L1: " + "; ".join(f"{n}: {why}" for n, why in bad.items())
                                  + ("" if not reserved.get("any_free") else
                                     f"; {len(free)} free machines left to take their place"))
            _release(c, job, "the machine check", err, faulty={n: f"failed L1: {why}" for n, why in bad.items()})
            raise err
        plan = dict(zip(sorted(bad), free, strict=False))
        c.fleet.swap(job, plan, reason="failed L1 at launch: " + "; ".join(f"{n}: {bad[n]}" for n in plan))
        common.note(f"job {job}: " + ", ".join(f"{old} failed L1 ({bad[old]}), {new} takes its place"
                                                for old, new in plan.items()))
        replaced |= plan
        d = c.diagnosis.diagnose(job, list(plan.values()), levels=(1,))
        seconds += float(d["seconds"])
        bad = dict(d["failed"])
    return {"job": job, "machines": list(c.fleet.job(job).machine_list), "checked": "L1",
            "seconds": round(seconds, 3), "submitted": True, **({"replaced": replaced} if replaced else {})}


def _run_releasing(c: Controller, step: dict[str, Any], what: str, act: Any) -> tuple[Any, dict[str, Any] | None]:
    """``act(controller, job)`` for a step of the launch: ``(its answer, None)``; ``(None, skipped)`` for a submission
    an earlier one launched. When it fails, the job's machines are released (state ``failed``) and it raises."""
    skipped = _earlier(step, what)
    if skipped is not None:
        return None, skipped
    try:
        return act(c, step["job"]), None
    except TrainguardError as exc:
        _release(c, step["job"], what, exc)
        raise


def start(c: Controller, checked: dict[str, Any]) -> dict[str, Any]:
    """Start the job on its machines (warm where interpreters are parked)."""
    out, skipped = _run_releasing(c, checked, "the start", lambda c, job: c.jobs.launch_submitted(job))
    if skipped is not None:
        return skipped
    job = checked["job"]
    common.note(f"job {job}: started on {', '.join(out.get('machines', []))}")
    return {"job": job, "submitted": True, **{k: out[k] for k in ("launched", "machines", "warm") if k in out}}


def first_step(c: Controller, started: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Wait for every rank's first step; the job is ``running`` from then on. A job that ends before it (or does
    not get there within ``timeout_s``) is stopped and its machines released."""
    out, skipped = _run_releasing(c, started, "the first step",
                                       lambda c, job: c.jobs.first_step(job, timeout_s=timeout_s))
    if skipped is not None:
        return skipped
    job = started["job"]
    common.note(f"job {job}: trains (step {out['step']} after {out['seconds']:.0f} s)")
    return {"job": job, "step": out["step"], "seconds": out["seconds"]}


def arm(c: Controller, trains: dict[str, Any]) -> dict[str, Any]:
    """Warm interpreters parked beside the running job, so its first restart starts warm."""
    return common.arm_unless_busy(c, trains["job"])
