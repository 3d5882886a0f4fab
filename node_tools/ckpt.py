"""``tg-node ckpt``: a job's checkpoint copies on this machine, for the control plane's verification.

Commands (each prints one JSON document)::

    tg-node ckpt list   --job J                 the copies here: tier, step, rank, committed, verified
    tg-node ckpt verify --job J --step N [--mark]
    tg-node ckpt upload --job J --step N --s3 s3://bucket/prefix [--endpoint-url E]
    tg-node ckpt rescue --job J --step N --to URL [--endpoint-url E]

``verify`` runs :func:`trainguard.checkpoint.verify.verify_step` on every copy of the step held
here (the ranks' own copies and the replicas kept for others); it writes
``verified.json`` markers only with ``--mark`` (the control plane marks a step only
after every machine passed and the step records around it passed its
great-expectations checks). Exit 1 when a copy fails.

``upload`` puts this machine's own copies of a step that carries a verified marker
into the S3 tier, each file with an S3-side SHA-256 checksum (the store refuses a body
that does not match it). A copy without the marker, or one that no longer matches its
manifest, is refused (exit 3) and not uploaded: an unverified copy is never promoted.
S3 credentials come from the environment of the session (boto3's chain).

``rescue`` puts every copy of a step this machine holds (the ranks' own copies and the
replicas it keeps for others, verified or not) into the remote tier (``s3://`` or
``file:///``), each one checked against its manifest first: the control plane runs it
on a machine it is about to evict when that machine holds the last copy of a rank's
state (no other machine that stays, and not the remote tier, has one). A copy already
in the tier with the same manifest is left as it is. Exit 1 when a copy was found bad.

The checkpoint root of a job is its ``TG_CHECKPOINT`` path when the job was started
with one, else ``<run dir>/checkpoints``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainguard.core.errors import EXIT_OK, EXIT_REFUSED, EXIT_UNHEALTHY, TrainguardError
from trainguard.node_tools.config import NodeConfig


def checkpoint_root(cfg: NodeConfig, job: str, record: dict[str, Any] | None = None) -> Path:
    """Where job ``job`` keeps its checkpoint copies on this machine."""
    from trainguard.node_tools.job import read_record, run_dir

    record = record if record is not None else (read_record(cfg, job) or {})
    location = str((record.get("spec") or {}).get("checkpoint") or "")
    if location and not location.startswith("s3://") and "{" not in location:
        return Path(location)
    return run_dir(cfg, job) / "checkpoints"


def _root(cfg: NodeConfig, job: str) -> Path:
    from trainguard.node_tools.job import check_job_name

    root = checkpoint_root(cfg, check_job_name(job))
    if not root.is_dir():
        raise TrainguardError(f"machine {cfg.machine}: job {job} has no checkpoint root here ({root}); "
                              f"is the job started with --checkpoint?")
    return root


def newest_candidate(root: Path, rank: int = 0) -> int | None:
    """The newest step of ``rank``'s own copies that is committed and marked as a verification candidate."""
    from trainguard.checkpoint import layout

    for step, _rank, path in layout.list_copies(root, "local", rank=rank):
        doc = layout.read_json(path / layout.COMMITTED)
        if doc and doc.get("verify"):
            return step
    return None


def listing(cfg: NodeConfig, job: str) -> dict[str, Any]:
    from trainguard.checkpoint import layout

    root = _root(cfg, job)
    copies = []
    for tier in layout.TIERS:
        for step, rank, path in layout.list_copies(root, tier):
            committed = layout.read_json(path / layout.COMMITTED)
            copies.append({"tier": tier, "step": step, "rank": rank, "committed": committed is not None,
                           "candidate": bool(committed and committed.get("verify")),
                           "verified": (path / layout.VERIFIED).exists()})
    return {"machine": cfg.machine, "job": job, "root": str(root), "copies": copies}


def _size(report: Any) -> int:
    total = 0
    for c in report.copies:
        for entry in (c.manifest or {}).get("files", []):
            total += int(entry.get("size", 0))
    return total


def verify(cfg: NodeConfig, job: str, step: int, *, mark: bool) -> tuple[int, dict[str, Any]]:
    """Verify this machine's copies of ``step`` (and mark them with ``mark``); the training metrics are the
    control plane's to check, over the step records it gathers."""
    from trainguard.checkpoint.verify import verify_step

    root = _root(cfg, job)
    t0 = time.monotonic()
    report = verify_step(root, step, machine=cfg.machine, mark=mark)
    doc = report.as_dict() | {"machine": cfg.machine, "job": job, "step": step, "bytes": _size(report),
                              "seconds": round(time.monotonic() - t0, 3)}
    return (EXIT_OK if report.ok else EXIT_UNHEALTHY), doc


def upload(cfg: NodeConfig, job: str, step: int, *, s3_url: str, endpoint_url: str = "") -> tuple[int, dict[str, Any]]:
    from trainguard.checkpoint import layout
    from trainguard.checkpoint.errors import S3TierError
    from trainguard.checkpoint.s3 import open_tier

    root = _root(cfg, job)
    try:
        tier = open_tier(s3_url, endpoint_url=endpoint_url)
    except S3TierError as exc:
        raise TrainguardError(str(exc)) from None
    own = [(r, p) for s, r, p in layout.list_copies(root, "local") if s == step]
    if not own:
        raise TrainguardError(f"machine {cfg.machine}: job {job} has no own copy of step {step} here")
    t0 = time.monotonic()
    uploaded, refused, total = [], [], 0
    for rank, path in sorted(own):
        if not (path / layout.VERIFIED).exists():
            refused.append({"rank": rank, "path": str(path), "why": "not verified: run tg_checkpoint_verify first"})
            continue
        put, why = _put_checked(cfg, tier, step, rank, path)
        if put is None:
            refused.append({"rank": rank, "path": str(path), "why": why})
            continue
        total += put["bytes"]
        uploaded.append(put)
    doc = {"machine": cfg.machine, "job": job, "step": step, "uploaded": uploaded, "refused": refused,
           "bytes": total, "seconds": round(time.monotonic() - t0, 3)}
    return (EXIT_REFUSED if refused else EXIT_OK), doc


def _put_checked(cfg: NodeConfig, tier: Any, step: int, rank: int, path: Path) -> tuple[dict[str, Any] | None, str]:
    """One copy into a remote tier once it matches its manifest (its bytes as they are now): what was
    put (``{"rank", "url", "bytes", "manifest_sha256"}``, ""), or (None, why it was refused)."""
    from trainguard.checkpoint import manifest as mf
    from trainguard.checkpoint.errors import S3TierError
    from trainguard.checkpoint.verify import verify_copy

    check = verify_copy(path, machine=cfg.machine, deep=False, keep_files=True)
    if not check.ok:
        return None, "; ".join(p.what for p in check.problems)
    try:
        tier.upload_copy(step, rank, sorted(check.files.items()), (path / mf.MANIFEST).read_bytes())
    except S3TierError as exc:
        raise TrainguardError(f"machine {cfg.machine}: {exc}") from None
    return {"rank": rank, "url": tier.copy_url(step, rank), "bytes": sum(len(b) for b in check.files.values()),
            "manifest_sha256": (check.manifest or {}).get("manifest_sha256", "")}, ""


def rescue(cfg: NodeConfig, job: str, step: int, *, to_url: str, endpoint_url: str = "") -> tuple[int, dict[str, Any]]:
    """Every copy of ``step`` held here (own and replicas), checked against its manifest, into the remote tier."""
    from trainguard.checkpoint import layout
    from trainguard.checkpoint import manifest as mf
    from trainguard.checkpoint.errors import S3TierError
    from trainguard.checkpoint.s3 import open_tier

    root = _root(cfg, job)
    try:
        tier = open_tier(to_url, endpoint_url=endpoint_url)
        remote = tier.list_copies()
    except S3TierError as exc:
        raise TrainguardError(f"machine {cfg.machine}: {exc}") from None
    held = [(tier_name, r, p) for tier_name in layout.TIERS for s, r, p in layout.list_copies(root, tier_name)
            if s == step]
    if not held:
        raise TrainguardError(f"machine {cfg.machine}: job {job} has no copy of step {step} here")
    t0 = time.monotonic()
    uploaded, skipped, bad, total = [], [], [], 0
    for tier_name, rank, path in sorted(held):
        if any(u["rank"] == rank for u in uploaded):
            continue  # the rank's own copy and a replica of it: one is enough
        manifest_bytes = (path / mf.MANIFEST).read_bytes()
        if (step, rank) in remote and tier.get(step, rank, mf.MANIFEST) == manifest_bytes:
            skipped.append({"rank": rank, "tier": tier_name, "why": "already in the remote tier"})
            continue
        put, why = _put_checked(cfg, tier, step, rank, path)
        if put is None:
            bad.append({"rank": rank, "tier": tier_name, "path": str(path), "why": why})
            continue
        total += put["bytes"]
        uploaded.append({**put, "tier": tier_name})
    doc = {"machine": cfg.machine, "job": job, "step": step, "to": to_url, "uploaded": uploaded, "skipped": skipped,
           "bad": bad, "bytes": total, "seconds": round(time.monotonic() - t0, 3)}
    return (EXIT_UNHEALTHY if bad else EXIT_OK), doc
