"""Checkpoint verification as plain Python for ``tg_checkpoint_verify`` (no Airflow import).

For one step of one job:

1. **verify** every copy on every machine of the job (``tg-node ckpt verify``: checksums, tensors,
   finite values of the ranks' own copies and of the replicas held for others, and the
   great-expectations checks of the step records around it), without marking anything;
2. only if every machine passed, **mark** (``tg-node ckpt verify --mark``: each machine checks its
   copies once more and writes the markers), so a step is marked everywhere or nowhere that answered;
   the fleet database records the verdict and the problems (machine, rank, tier, path, what);
3. **promote** a verified step to the S3 tier: each machine uploads its own copies (``tg-node ckpt
   upload``, S3 credentials from the control plane's connection, sent inside the SSH session), then the
   control plane checks the remote checksums of every object against the manifest (the store's SHA-256,
   no download), marks the remote copies verified, deletes a copy that does not match, and applies S3
   retention (never the newest verified step).

A corrupt copy therefore stops the step at phase 1: nothing is marked, nothing is uploaded, and the run
fails with the problems in its note.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.operators.control import Controller
from trainguard.operators.policy import checkpoints as policy


@dataclass
class S3Settings:
    """Where verified steps go. ``url``: ``s3://bucket/prefix`` (a job's copies go under ``<url>/<job>``;
    "" = no S3 tier); ``endpoint_url``: the S3-compatible endpoint the machines upload to; ``keep``: verified
    steps kept per job in S3."""

    url: str = ""
    endpoint_url: str = ""
    keep: int = 3

    @classmethod
    def from_env(cls, endpoint_url: str = "") -> S3Settings:
        """``TG_CHECKPOINT_S3_URL``, ``TG_CHECKPOINT_S3_KEEP``; the endpoint from the caller (the
        connection's), else ``TG_S3_ENDPOINT_URL``."""
        return cls(url=os.environ.get("TG_CHECKPOINT_S3_URL", "").strip().rstrip("/"),
                   endpoint_url=endpoint_url or os.environ.get("TG_S3_ENDPOINT_URL", ""),
                   keep=int(os.environ.get("TG_CHECKPOINT_S3_KEEP", "3")))

    def job_url(self, job: str) -> str:
        return f"{self.url}/{job}"


# ---- which steps ----------------------------------------------------------------------------------------
def targets(ctl: Controller, *, job: str = "", step: int | None = None,
            announced: Sequence[Mapping[str, Any]] = ()) -> list[dict[str, Any]]:
    """The (job, step) pairs to verify: the form's job (and step, else its newest candidate), else the
    newest step each ``checkpoint_committed`` notice announced, else (the schedule) the newest candidate of
    every running job not verified yet. Each is recorded in the fleet database."""
    if step is not None and step < 0:
        raise policy.VerifyError(f"step {step} is negative; give a step >= 0, or none for the newest candidate")
    if job:
        j = ctl.fleet.job(job)  # an unknown job: FleetError naming it
        if not j.machine_list:
            raise policy.VerifyError(f"job {job} has no machines; launch it before verifying its checkpoints")
        wanted = {job: step}
    elif announced:
        wanted = dict(policy.newest_per_job(announced))
    else:
        wanted = {j.name: None for j in ctl.fleet.jobs() if j.machine_list and j.state == "running"}
    out = []
    for name, s in sorted(wanted.items()):
        j = ctl.fleet.job(name)
        if not j.machine_list:
            continue
        if not (job and step is not None):
            # announced or swept: the newest candidate the job holds now (a run that waited behind another
            # verifies what is newest, not a step retention may already have dropped), unless it has its verdict
            try:
                newest = _newest_candidate(ctl, name, j.machine_list[0])
            except TrainguardError:
                newest = None
            s = max((x for x in (s, newest) if x is not None), default=None)
            if s is None or any(c.step == s and c.verified is not None for c in ctl.fleet.checkpoints(name)):
                continue
        ctl.fleet.record_checkpoint(name, s)
        out.append({"job": name, "step": s, "machines": list(j.machine_list), "world_size": j.tp * j.pp * j.dp})
    return out


def _newest_candidate(ctl: Controller, job: str, machine: str) -> int | None:
    res = ctl.transport.run(ctl.inventory.machine(machine), ctl.transport.tg_node(
        ctl.inventory.machine(machine), "ckpt", "list", "--job", job), timeout=60)
    if not res.ok:
        raise TrainguardError(f"listing job {job}'s checkpoints on {machine} failed: {res.describe()}")
    return policy.newest_candidate(res.json().get("copies", []))


# ---- verify, then mark ----------------------------------------------------------------------------------
def _on_machines(ctl: Controller, target: Mapping[str, Any], *args: str, timeout: float,
                 env: Mapping[str, str] | None = None) -> dict[str, Any]:
    machines = ctl.machines(target["machines"])
    return ctl.transport.run_many(machines, lambda m: ctl.transport.tg_node(m, "ckpt", *args), timeout=timeout,
                                  env=env)


def _doc(res: Any) -> dict[str, Any] | None:
    """A machine's JSON answer, or None when the command did not answer (unreachable, timed out, garbled)."""
    try:
        doc = res.answer()
    except Exception:
        return None
    return doc if isinstance(doc, dict) else None


def _phase(ctl: Controller, target: Mapping[str, Any], *, mark: bool, timeout: float) -> dict[str, Any]:
    args = ["verify", "--job", target["job"], "--step", str(target["step"])] + (["--mark"] if mark else [])
    results = _on_machines(ctl, target, *args, timeout=timeout)
    machines: dict[str, Any] = {}
    problems: list[str] = []
    for name, res in sorted(results.items()):
        doc = _doc(res)
        if doc is None or "ok" not in doc:
            line = f"machine {name}: verification did not run: {res.describe()}"
            machines[name] = {"ok": False, "problems": [line]}
            problems.append(line)
            continue
        machines[name] = {"ok": bool(doc["ok"]), "copies": len(doc.get("copies", [])), "bytes": doc.get("bytes", 0),
                          "seconds": doc.get("seconds", 0.0), "problems": doc.get("problem_lines", []),
                          "marked": len(doc.get("marked", [])),
                          "own": {int(c["rank"]): c.get("incarnation") for c in doc.get("copies", [])
                                  if c.get("tier") == "local"}}
        problems += doc.get("problem_lines", [])
    return {"ok": not problems, "machines": machines, "problems": problems}


def metric_problems(ctl: Controller, target: Mapping[str, Any], machines: Mapping[str, Any], *,
                    timeout: float = 60.0) -> list[str]:
    """The training metrics around the step, checked here in the control plane (great-expectations, see
    :func:`trainguard.checkpoint.verify.check_metrics`) over the step records it reads from each machine for the ranks
    whose own copies it holds (``machines``: :func:`_phase`'s per-machine verdicts), in rounds of one rank
    per machine. Returns the problems' lines."""
    from trainguard.checkpoint.verify import MetricLimits, check_metrics

    job, step = target["job"], int(target["step"])
    limits = MetricLimits()
    todo = {name: sorted(v.get("own") or {}) for name, v in machines.items()}
    records: dict[int, list[dict[str, Any]]] = {}
    where: dict[int, str] = {}
    unread: list[str] = []
    for i in range(max((len(r) for r in todo.values()), default=0)):
        rank_of = {name: ranks[i] for name, ranks in todo.items() if i < len(ranks)}
        results = ctl.transport.run_many(ctl.machines(sorted(rank_of)), lambda m, rank_of=rank_of: [
            ctl.inventory.tg_node, "job", "steps", "--job", job, "--rank", str(rank_of[m.name]),
            "--since", str(step - limits.window)], timeout=timeout)
        for name, res in sorted(results.items()):
            doc, rank = _doc(res), rank_of[name]
            where[rank] = name
            if doc is None or not isinstance(doc.get("steps"), list):
                unread.append(f"machine {name} rank {rank} step {step} tier metrics: step records not read "
                              f"({(doc or {}).get('error') or res.describe()})")
                continue
            records[rank] = doc["steps"]
    incarnations = {inc for v in machines.values() for inc in (v.get("own") or {}).values() if inc is not None}
    problems = check_metrics(records, step=step, machines=where, limits=limits,
                             incarnation=incarnations.pop() if len(incarnations) == 1 else None)
    return unread + [p.line() for p in problems]


def verify(ctl: Controller, target: Mapping[str, Any], *, timeout: float = 600.0) -> dict[str, Any]:
    """Verify the step on every machine, then mark it everywhere if all passed; record the verdict."""
    t0 = time.monotonic()
    first = _phase(ctl, target, mark=False, timeout=timeout)
    if first["ok"]:  # every copy passed: the metrics around the step, here in the control plane
        bad = metric_problems(ctl, target, first["machines"])
        first = {**first, "ok": not bad, "problems": first["problems"] + bad}
    marked = _phase(ctl, target, mark=True, timeout=timeout) if first["ok"] else None
    final = marked or first
    ok = final["ok"]
    ctl.fleet.mark_checkpoint(target["job"], int(target["step"]), verified=ok, problems=final["problems"])
    ctl.fleet.record_action(f"checkpoint_verify:{target['job']}:{target['step']}:{time.time():.3f}",
                            kind="checkpoint_verify", machines=target["machines"],
                            evidence={"step": target["step"], "ok": ok, "problems": final["problems"][:20]})
    copies = sum(m.get("copies", 0) for m in first["machines"].values())
    size = sum(m.get("bytes", 0) for m in first["machines"].values())
    return {**dict(target), "ok": ok, "copies": copies, "bytes": size, "problems": final["problems"],
            "machines": final["machines"], "marked": sum(m.get("marked", 0) for m in (marked or first)["machines"]
                                                         .values()) if marked else 0,
            "seconds": round(time.monotonic() - t0, 3)}


# ---- promote to S3 --------------------------------------------------------------------------------------
def promote(ctl: Controller, verdict: Mapping[str, Any], settings: S3Settings, *, client: Any,
            credentials: Mapping[str, str], timeout: float = 600.0) -> dict[str, Any]:
    """Upload a verified step's own copies from every machine, check every remote object's checksum,
    mark the remote copies verified and apply retention. ``client``: a boto3 S3 client (the control
    plane's); ``credentials``: the AWS_* variables the machines upload with."""
    from trainguard.checkpoint import layout
    from trainguard.checkpoint import manifest as mf
    from trainguard.checkpoint.errors import S3TierError
    from trainguard.checkpoint.s3 import S3Tier

    job, step = verdict["job"], int(verdict["step"])
    if not verdict.get("ok"):
        return {"job": job, "step": step, "promoted": False, "why": "not verified: nothing uploaded"}
    if not settings.url:
        return {"job": job, "step": step, "promoted": False, "why": "no S3 tier configured (TG_CHECKPOINT_S3_URL)"}
    tier = S3Tier(settings.job_url(job), endpoint_url=settings.endpoint_url, client_=client)
    try:
        client.head_bucket(Bucket=tier.bucket)
    except Exception as exc:
        raise TrainguardError(f"S3 tier {tier.where} is not usable ({_why(exc)}); start the endpoint or fix "
                              f"TG_CHECKPOINT_S3_URL / the S3 connection, then run tg_checkpoint_verify "
                              f"again") from None
    t0 = time.monotonic()
    args = ["upload", "--job", job, "--step", str(step), "--s3", tier.url]
    if settings.endpoint_url:
        args += ["--endpoint-url", settings.endpoint_url]
    results = _on_machines(ctl, verdict, *args, timeout=timeout, env=credentials)
    problems: list[str] = []
    uploaded: list[dict[str, Any]] = []
    for name, res in sorted(results.items()):
        doc = _doc(res)
        if doc is None or "uploaded" not in doc:
            problems.append(f"machine {name}: upload failed: {(doc or {}).get('error') or res.describe()}")
            continue
        uploaded += doc["uploaded"]
        problems += [f"machine {name} rank {r['rank']}: not uploaded: {r['why']}" for r in doc.get("refused", [])]
    upload_s = time.monotonic() - t0
    checked, deleted_bad = [], []
    for u in sorted(uploaded, key=lambda u: u["rank"]):
        rank = int(u["rank"])
        try:
            bad = _remote_mismatch(tier, step, rank, u.get("manifest_sha256", ""), mf)
            if bad:
                problems.append(f"S3 {tier.copy_url(step, rank)}: {bad}; deleted")
                tier.delete_copy(step, rank)
                deleted_bad.append(rank)
                continue
            marker = {"step": step, "rank": rank, "verified_ts": time.time(), "checks": ["remote-sha256"]}
            tier.put(step, rank, layout.VERIFIED, json.dumps(marker).encode())
            checked.append(rank)
        except S3TierError as exc:
            problems.append(str(exc))
    missing = sorted(set(range(int(verdict.get("world_size", 0)))) - set(checked))
    if missing and not problems:
        problems.append(f"ranks {', '.join(map(str, missing))} have no copy in S3 after the upload")
    deleted_steps: list[int] = []
    try:
        deleted_steps = policy.s3_deletions(tier.steps(), world_size=int(verdict.get("world_size", 1)),
                                            keep=settings.keep)
        for s in deleted_steps:
            for rank in range(int(verdict.get("world_size", 1))):
                tier.delete_copy(s, rank)
        kept = sorted(tier.steps())
    except S3TierError as exc:
        problems.append(f"S3 retention: {exc}")
        kept = []
    size = sum(int(u.get("bytes", 0)) for u in uploaded)
    return {"job": job, "step": step, "promoted": not problems, "url": tier.url, "uploaded": len(uploaded),
            "checked": len(checked), "bytes": size, "upload_s": round(upload_s, 3),
            "seconds": round(time.monotonic() - t0, 3), "deleted_bad": deleted_bad, "deleted_steps": deleted_steps,
            "kept_steps": kept, "problems": problems}


def _remote_mismatch(tier: Any, step: int, rank: int, manifest_sha256: str, mf: Any) -> str:
    """Why the S3 copy differs from the copy the machine verified ("" when every object matches)."""
    data = tier.get(step, rank, mf.MANIFEST)
    if data is None:
        return "manifest missing"
    try:
        doc = mf.parse(data)
    except mf.ManifestInvalid as exc:
        return str(exc)
    if manifest_sha256 and doc["manifest_sha256"] != manifest_sha256:
        return "manifest differs from the verified copy's"
    for entry in doc["files"]:
        remote = tier.remote_checksums(step, rank, entry["name"])
        if remote is None:
            return f"{entry['name']} missing or without a SHA-256 checksum"
        if remote != (entry["sha256"], entry["size"]):
            return f"{entry['name']} has sha256 {remote[0][:12]}.. / {remote[1]} bytes, manifest says " \
                   f"{entry['sha256'][:12]}.. / {entry['size']}"
    return ""


def _why(exc: BaseException) -> str:
    code = getattr(exc, "response", {}).get("Error", {}).get("Code") if hasattr(exc, "response") else None
    return f"{code}" if code else f"{type(exc).__name__}: {str(exc)[:200]}"


# ---- the run's note -------------------------------------------------------------------------------------
def note(verdicts: Sequence[Mapping[str, Any]], promotions: Sequence[Mapping[str, Any]]) -> str:
    """One line per job: what was verified, marked, uploaded, or what is corrupt."""
    if not verdicts:
        return "nothing to verify: no new verification candidate"
    by_job = {p["job"]: p for p in promotions}
    parts = []
    for v in verdicts:
        head = f"{v['job']} step {v['step']}"
        if not v["ok"]:
            first = v["problems"][0] if v["problems"] else "?"
            more = f" (+{len(v['problems']) - 1} more)" if len(v["problems"]) > 1 else ""
            parts.append(f"{head}: NOT verified, nothing marked or uploaded: {first}{more}")
            continue
        line = (f"{head}: {v['copies']} copies on {', '.join(v['machines'])} verified and marked "
                f"({v['bytes'] / 1e6:.1f} MB, {v['seconds']:.1f}s)")
        p = by_job.get(v["job"])
        if p and p.get("promoted"):
            line += f"; uploaded to {p['url']}, remote checksums match; S3 keeps steps " \
                    f"{', '.join(map(str, p['kept_steps']))}"
        elif p and p.get("why"):
            line += f"; {p['why']}"
        elif p:
            line += f"; S3 upload incomplete: {p['problems'][0] if p['problems'] else '?'}"
        parts.append(line)
    return "; ".join(parts)
