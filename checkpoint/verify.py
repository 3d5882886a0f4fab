"""Verification of checkpoint copies: plain functions the control plane calls, and the restore path uses.

A copy passes when

* its manifest parses and matches its own hash, and names the step and rank its
  location says;
* every file the manifest lists exists with the manifest's size and sha256;
* (deep) every file loads as safetensors with exactly the manifest's tensor
  names, dtypes and shapes, and every floating-point value is finite.

A step passes when every copy of it in a checkpoint root (``local`` and
``replica`` tiers) and, if given, in S3 passes. The training metrics around it
(every rank's step records: loss, grad_norm, step_time_s) are checked by the
control plane's verification task, over the records it gathers from the machines
(:func:`check_metrics`, a great-expectations suite: not null (a NaN is null),
within range, steps strictly increasing, the step itself present), not on the
training machines. A passing step is marked (``verified.json`` in each copy; an
object in S3); retention never deletes the newest marked step.

Every problem names machine, rank, step, tier and path (:class:`Problem`).
Nothing here raises on bad data; an unreachable S3 endpoint is a problem too.
Command line: ``python -m trainguard.checkpoint.verify --root DIR [--step N]
[--s3 URL] [--endpoint-url E]`` prints one JSON document; exit 0 when every
copy passed, 1 when something did not, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from trainguard.checkpoint import layout
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.errors import S3TierError


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a copy (or with the metrics of a step), and where."""

    machine: str
    rank: int | None
    step: int | None
    tier: str
    path: str
    what: str

    def line(self) -> str:
        rank = "?" if self.rank is None else self.rank
        step = "?" if self.step is None else self.step
        return f"machine {self.machine} rank {rank} step {step} tier {self.tier}: {self.what} ({self.path})"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class CopyCheck:
    """The verdict on one copy. ``files`` keeps the checked bytes when the caller asked for them."""

    machine: str
    rank: int
    step: int
    tier: str
    path: str
    problems: list[Problem] = field(default_factory=list)
    manifest: dict[str, Any] | None = None
    files: dict[str, bytes] = field(default_factory=dict, repr=False)
    manifest_bytes: bytes = field(default=b"", repr=False)
    deep: bool = True

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"machine": self.machine, "rank": self.rank, "step": self.step, "tier": self.tier, "path": self.path,
                "ok": self.ok, "deep": self.deep, "problems": [p.what for p in self.problems],
                "incarnation": (self.manifest or {}).get("incarnation")}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def check_data(manifest_bytes: bytes | None, files: Mapping[str, bytes | None], *, machine: str, rank: int,
               step: int, tier: str, path: str, deep: bool = True, keep_files: bool = False) -> CopyCheck:
    """Check one copy given its bytes (read from disk, received from a peer, or downloaded)."""
    check = CopyCheck(machine=machine, rank=rank, step=step, tier=tier, path=path, deep=deep)

    def bad(what: str) -> CopyCheck:
        check.problems.append(Problem(machine, rank, step, tier, path, what))
        return check

    if manifest_bytes is None:
        return bad("manifest missing")
    try:
        doc = mf.parse(manifest_bytes)
    except mf.ManifestInvalid as exc:
        return bad(str(exc))
    check.manifest = doc
    if doc["step"] != step or doc["rank"] != rank:
        return bad(f"manifest describes step {doc['step']} rank {doc['rank']}, not this location's")
    for entry in doc["files"]:
        name = entry["name"]
        data = files.get(name)
        if data is None:
            bad(f"{name} missing")
            continue
        if len(data) != entry["size"]:
            bad(f"{name} has {len(data)} bytes, manifest says {entry['size']} (truncated, or the manifest lies)")
            continue
        if _sha256(data) != entry["sha256"]:
            bad(f"{name} sha256 mismatch (corrupt)")
            continue
        if deep:
            for what in _check_tensors(data, entry["tensors"]):
                bad(f"{name}: {what}")
    if keep_files and check.ok:
        check.files = {e["name"]: files[e["name"]] for e in doc["files"]}  # type: ignore[misc]
        check.manifest_bytes = manifest_bytes
    return check


def _check_tensors(data: bytes, expected: Mapping[str, Mapping[str, Any]]) -> Iterable[str]:
    import torch
    from safetensors.torch import load

    try:
        tensors = load(data if isinstance(data, bytes) else bytes(data))
    except Exception as exc:  # safetensors raises its own error types for malformed files
        yield f"not a readable safetensors file ({type(exc).__name__}: {str(exc)[:120]})"
        return
    from trainguard.checkpoint.shards import dtype_code

    if set(tensors) != set(expected):
        missing = sorted(set(expected) - set(tensors))[:3]
        extra = sorted(set(tensors) - set(expected))[:3]
        yield f"tensor names differ from the manifest (missing {missing}, unexpected {extra})"
        return
    for name, t in tensors.items():
        want = expected[name]
        if dtype_code(t.dtype) != want["dtype"] or list(t.shape) != list(want["shape"]):
            yield (f"tensor {name} is {dtype_code(t.dtype)}{list(t.shape)}, manifest says "
                   f"{want['dtype']}{list(want['shape'])}")
        elif t.is_floating_point() and t.numel() and not bool(torch.isfinite(t).all()):
            bad = int((~torch.isfinite(t)).sum())
            yield f"tensor {name} has {bad} non-finite values"


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _locate(path: Path, machine: str) -> tuple[Path, str, int, int, str]:
    """``(path, tier, step, rank, machine)`` of a copy directory ``<root>/<tier>/step_<N>/rank_<R>``."""
    path = Path(path)
    where = layout.parse_copy_path(path)
    if where is None:
        raise ValueError(f"{path} is not a checkpoint copy directory (<root>/<tier>/step_<N>/rank_<R>)")
    tier, step, rank = where
    return path, tier, step, rank, machine or layout.machine_name(path.parents[2])


def verify_copy(path: Path, *, machine: str = "", deep: bool = True, keep_files: bool = False) -> CopyCheck:
    """Verify one copy directory (``<root>/<tier>/step_<N>/rank_<R>``); location comes from the path."""
    path, tier, step, rank, machine = _locate(path, machine)
    manifest_bytes = _read(path / mf.MANIFEST)
    files = {name: _read(path / name) for name in mf.file_names(manifest_bytes)}
    return check_data(manifest_bytes, files, machine=machine, rank=rank, step=step, tier=tier, path=str(path),
                      deep=deep, keep_files=keep_files)


def inspect_copy(path: Path, *, machine: str = "") -> CopyCheck:
    """The cheap check: manifest valid and every file present with its size (no hashing, no loading)."""
    path, tier, step, rank, machine = _locate(path, machine)
    check = CopyCheck(machine=machine, rank=rank, step=step, tier=tier, path=str(path), deep=False)
    data = _read(path / mf.MANIFEST)
    try:
        doc = mf.parse(data) if data is not None else None
    except mf.ManifestInvalid as exc:
        check.problems.append(Problem(machine, rank, step, tier, str(path), str(exc)))
        return check
    if doc is None:
        check.problems.append(Problem(machine, rank, step, tier, str(path), "manifest missing"))
        return check
    check.manifest = doc
    if doc["step"] != step or doc["rank"] != rank:
        check.problems.append(Problem(machine, rank, step, tier, str(path),
                                      f"manifest describes step {doc['step']} rank {doc['rank']}"))
    for entry in doc["files"]:
        try:
            size = (path / entry["name"]).stat().st_size
        except OSError:
            check.problems.append(Problem(machine, rank, step, tier, str(path), f"{entry['name']} missing"))
            continue
        if size != entry["size"]:
            check.problems.append(Problem(
                machine, rank, step, tier, str(path),
                f"{entry['name']} has {size} bytes, manifest says {entry['size']} (truncated, or the manifest lies)"))
    return check


# ---------------------------------------------------------------------------------------
# Whole roots and S3 prefixes
# ---------------------------------------------------------------------------------------
@dataclass
class Report:
    """The verdicts on a set of copies (a root, an S3 prefix, a step)."""

    copies: list[CopyCheck] = field(default_factory=list)
    extra_problems: list[Problem] = field(default_factory=list)
    marked: list[str] = field(default_factory=list)

    @property
    def problems(self) -> list[Problem]:
        return [p for c in self.copies for p in c.problems] + self.extra_problems

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "copies": [c.as_dict() for c in self.copies],
                "problems": [p.as_dict() for p in self.problems],
                "problem_lines": [p.line() for p in self.problems], "marked": self.marked}


def verify_root(root: Path, *, machine: str = "", steps: Iterable[int] | None = None,
                tiers: Iterable[str] = layout.TIERS, deep: bool = True) -> Report:
    """Verify every copy (or those of ``steps``) in a machine's checkpoint root, in every local tier."""
    root = Path(root)
    machine = machine or layout.machine_name(root)
    wanted = set(steps) if steps is not None else None
    report = Report()
    for tier in tiers:
        for step, _rank, path in layout.list_copies(root, tier):
            if wanted is None or step in wanted:
                report.copies.append(verify_copy(path, machine=machine, deep=deep))
        # copy directories without a manifest are incomplete writes or damaged copies: say so
        for step_dir in sorted((root / tier).glob("step_*")):
            for rank_dir in sorted(step_dir.glob("rank_*")):
                where = layout.parse_copy_path(rank_dir)
                if where and (wanted is None or where[1] in wanted) and not (rank_dir / mf.MANIFEST).exists():
                    report.extra_problems.append(Problem(machine, where[2], where[1], tier, str(rank_dir),
                                                         "manifest missing"))
    return report


def verify_s3(url: str, *, endpoint_url: str = "", steps: Iterable[int] | None = None,
              ranks: Iterable[int] | None = None, deep: bool = True, timeout_s: float = 5.0,
              keep_files: bool = False) -> Report:
    """Verify every copy (or those of ``steps`` / ``ranks``) under an S3 prefix. An unreachable endpoint
    is reported as a problem of tier ``s3``."""
    from trainguard.checkpoint.s3 import open_tier

    tier = open_tier(url, endpoint_url=endpoint_url, timeout_s=timeout_s)
    report = Report()
    wanted_steps = set(steps) if steps is not None else None
    wanted_ranks = set(ranks) if ranks is not None else None
    try:
        listing = tier.list_copies()
    except S3TierError as exc:
        report.extra_problems.append(Problem("s3", None, None, "s3", url, str(exc)))
        return report
    for (step, rank) in sorted(listing, reverse=True):
        if (wanted_steps is not None and step not in wanted_steps) or (
                wanted_ranks is not None and rank not in wanted_ranks):
            continue
        report.copies.append(check_s3_copy(tier, step, rank, deep=deep, keep_files=keep_files))
    return report


def check_s3_copy(tier: Any, step: int, rank: int, *, deep: bool = True, keep_files: bool = False) -> CopyCheck:
    """Download and check one S3 copy (``tier`` is a :class:`trainguard.checkpoint.s3.S3Tier`)."""
    where = tier.copy_url(step, rank)
    try:
        manifest_bytes = tier.get(step, rank, mf.MANIFEST)
        files = {name: tier.get(step, rank, name) for name in mf.file_names(manifest_bytes)}
    except S3TierError as exc:
        check = CopyCheck(machine="s3", rank=rank, step=step, tier="s3", path=where, deep=deep)
        check.problems.append(Problem("s3", rank, step, "s3", where, str(exc)))
        return check
    return check_data(manifest_bytes, files, machine="s3", rank=rank, step=step, tier="s3", path=where,
                      deep=deep, keep_files=keep_files)


# ---------------------------------------------------------------------------------------
# Training metrics around a step (great-expectations core)
# ---------------------------------------------------------------------------------------
@dataclass
class MetricLimits:
    """Ranges the step records around a checkpoint must stay in.

    Attributes:
        window: steps before the checkpointed one that are checked too. Steps.
        loss_max: largest plausible loss (a cross-entropy over the vocabulary is ~ln(vocab)). Nats.
        grad_norm_max: largest plausible gradient norm (before clipping).
        step_time_max_s: longest plausible step. Seconds.
    """

    window: int = 20
    loss_max: float = 100.0
    grad_norm_max: float = 1e6
    step_time_max_s: float = 3600.0


def window_records(records: Sequence[Mapping[str, Any]], step: int, window: int, incarnation: int | None = None
                   ) -> list[Mapping[str, Any]]:
    """A rank's step records of the ``window`` steps ending at ``step``, of one incarnation (None: the one
    that last recorded ``step``, which wrote the checkpoint)."""
    if incarnation is None:
        at = [r for r in records if r.get("step") == step]
        incarnation = at[-1].get("incarnation") if at else None
    return [r for r in records if r.get("incarnation") == incarnation and step - window < r.get("step", -1) <= step]


def check_metrics(records: Mapping[int, Sequence[Mapping[str, Any]]], *, step: int,
                  machines: Mapping[int, str] | None = None, limits: MetricLimits | None = None,
                  incarnation: int | None = None, where: str = "step records") -> list[Problem]:
    """Check loss, grad_norm and step_time_s of each rank's step ``records`` (rank -> its records, as the
    control plane gathered them) over the window ending at ``step`` with a great-expectations suite.
    ``machines``: rank -> the machine it ran on (for the problems' lines). Returns the problems (empty when
    the metrics pass)."""
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "False")
    import great_expectations as gx
    import pandas as pd
    from great_expectations.data_context.types.base import ProgressBarsConfig

    limits = limits or MetricLimits()
    ctx = gx.get_context(mode="ephemeral")
    ctx.variables.progress_bars = ProgressBarsConfig(globally=False, metric_calculations=False)
    batch = ctx.data_sources.add_pandas("trainguard_steps").add_dataframe_asset("steps") \
        .add_batch_definition_whole_dataframe("window")
    suite = ctx.suites.add(gx.ExpectationSuite(name="checkpoint_step_metrics"))
    E = gx.expectations
    for column in ("step", "loss", "grad_norm", "step_time_s"):
        suite.add_expectation(E.ExpectColumnValuesToNotBeNull(column=column))
    suite.add_expectation(E.ExpectColumnValuesToBeBetween(column="loss", min_value=0, max_value=limits.loss_max))
    suite.add_expectation(E.ExpectColumnValuesToBeBetween(column="grad_norm", min_value=0,
                                                          max_value=limits.grad_norm_max))
    suite.add_expectation(E.ExpectColumnValuesToBeBetween(column="step_time_s", min_value=0,
                                                          max_value=limits.step_time_max_s))
    suite.add_expectation(E.ExpectColumnValuesToBeIncreasing(column="step", strictly=True))
    suite.add_expectation(E.ExpectColumnMaxToBeBetween(column="step", min_value=step, max_value=step))
    validation = ctx.validation_definitions.add(gx.ValidationDefinition(name="window", data=batch, suite=suite))

    problems: list[Problem] = []
    machines = machines or {}
    for rank, rank_records in sorted(records.items()):
        machine = machines.get(rank, "")
        window = window_records(rank_records, step, limits.window, incarnation)
        if not window:
            problems.append(Problem(machine, rank, step, "metrics", where, "no step records for this step"))
            continue
        records_ = window
        frame = pd.DataFrame({
            col: pd.to_numeric(pd.Series([r.get(col) for r in records_], dtype="object"), errors="coerce")
            for col in ("step", "loss", "grad_norm", "step_time_s")})
        result = validation.run(batch_parameters={"dataframe": frame}, result_format="SUMMARY")
        for r in result.results:
            if r.success:
                continue
            cfg = r.expectation_config
            sample = [v if not (isinstance(v, float) and math.isnan(v)) else "nan"
                      for v in (r.result.get("partial_unexpected_list") or [])][:3]
            detail = f" (e.g. {sample})" if sample else ""
            problems.append(Problem(machine, rank, step, "metrics", where,
                                    f"{cfg.type} failed on {cfg.kwargs.get('column')}{detail}"))
    return problems


# ---------------------------------------------------------------------------------------
# A whole step, and its marker
# ---------------------------------------------------------------------------------------
def verify_step(root: Path, step: int, *, s3_url: str = "", endpoint_url: str = "", machine: str = "",
                mark: bool = True, s3_timeout_s: float = 5.0) -> Report:
    """Verify every copy of ``step`` in ``root`` (and the S3 copies of the ranks whose own copies are
    here); if all pass and ``mark``, mark them verified."""
    root = Path(root)
    machine = machine or layout.machine_name(root)
    # a verification reads for seconds to minutes; the job's retention must not remove the step meanwhile
    # (a newer candidate verified by another run would otherwise release it). The pin stays between the
    # control plane's check and mark calls; the marking call, or a failed check, lifts it.
    held = [p for tier in layout.TIERS for s, _r, p in layout.list_copies(root, tier) if s == step]
    layout.pin(held)
    try:
        report = _verify_step(root, step, s3_url=s3_url, endpoint_url=endpoint_url, machine=machine, mark=mark,
                              s3_timeout_s=s3_timeout_s)
    except BaseException:
        layout.unpin(held)
        raise
    if mark or not report.ok:
        layout.unpin(held)
    return report


def _identity(copy: Path | str) -> tuple[int, int] | None:
    """Which write of a copy directory this is (its manifest's inode and mtime), None when it has none."""
    try:
        st = (Path(copy) / mf.MANIFEST).stat()
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def _reread_replaced(report: Report, before: Mapping[str, tuple[int, int] | None], *, machine: str,
                     attempts: int = 3) -> None:
    """A job restored from an older step writes the newer steps again, replacing their copies (atomically:
    :func:`trainguard.checkpoint.layout.write_copy`); a verification reading one meanwhile sees files vanish or change.
    A copy that failed and was replaced while it was read is the job's newer write, not damage: read it
    again (``attempts`` times at most), so only a copy that fails as it stands is reported."""
    for _ in range(attempts):
        again = [i for i, c in enumerate(report.copies)
                 if not c.ok and c.tier != "s3" and _identity(c.path) != before.get(c.path)]
        if not again:
            return
        for i in again:
            path = Path(report.copies[i].path)
            before = {**before, str(path): _identity(path)}
            report.copies[i] = verify_copy(path, machine=machine)


def _verify_step(root: Path, step: int, *, s3_url: str, endpoint_url: str, machine: str, mark: bool,
                 s3_timeout_s: float) -> Report:
    before = {str(p): _identity(p) for tier in layout.TIERS for s, _r, p in layout.list_copies(root, tier)
              if s == step}
    report = verify_root(root, machine=machine, steps=[step])
    _reread_replaced(report, before, machine=machine)
    own_ranks = sorted({c.rank for c in report.copies if c.tier == "local"})
    if s3_url:
        s3 = verify_s3(s3_url, endpoint_url=endpoint_url, steps=[step], ranks=own_ranks, timeout_s=s3_timeout_s)
        report.copies += s3.copies
        report.extra_problems += s3.extra_problems
    if not report.copies and not report.extra_problems:
        report.extra_problems.append(Problem(machine, None, step, "local", str(root), "no copy of this step here"))
    if mark and report.ok:
        doc = {"step": step, "verified_ts": time.time(), "checks": ["sha256", "tensors", "finite"]}
        for c in report.copies:
            if c.tier == "s3":
                from trainguard.checkpoint.s3 import open_tier

                try:
                    open_tier(s3_url, endpoint_url=endpoint_url, timeout_s=s3_timeout_s).put(
                        step, c.rank, layout.VERIFIED, json.dumps(doc | {"rank": c.rank}).encode())
                    report.marked.append(c.path)
                except S3TierError as exc:
                    report.extra_problems.append(Problem("s3", c.rank, step, "s3", c.path, str(exc)))
            elif layout.write_marker(Path(c.path), layout.VERIFIED, doc | {"rank": c.rank, "tier": c.tier}):
                report.marked.append(c.path)
            else:
                report.extra_problems.append(Problem(machine, c.rank, step, c.tier, c.path,
                                                     "copy removed before it could be marked (retention)"))
    return report


def newest_verified(root: Path, tier: str, rank: int) -> int | None:
    """The newest step of ``rank`` in ``tier`` that carries a verified marker."""
    for step, _r, path in layout.list_copies(root, tier, rank=rank):
        if (path / layout.VERIFIED).exists():
            return step
    return None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trainguard.checkpoint.verify", description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, required=True, help="a machine's checkpoint root")
    p.add_argument("--step", type=int, help="verify (and mark) this step; default: every copy, no marking")
    p.add_argument("--s3", default="", help="s3://bucket/prefix of the S3 tier")
    p.add_argument("--endpoint-url", default=os.environ.get("TG_S3_ENDPOINT_URL", ""))
    p.add_argument("--machine", default="")
    p.add_argument("--no-mark", action="store_true")
    ns = p.parse_args(argv)
    if not ns.root.is_dir():
        print(json.dumps({"error": f"checkpoint root {ns.root} does not exist"}))
        return 2
    if ns.step is None:
        report = verify_root(ns.root, machine=ns.machine)
        if ns.s3:
            s3 = verify_s3(ns.s3, endpoint_url=ns.endpoint_url)
            report.copies += s3.copies
            report.extra_problems += s3.extra_problems
    else:
        report = verify_step(ns.root, ns.step, s3_url=ns.s3, endpoint_url=ns.endpoint_url,
                             machine=ns.machine, mark=not ns.no_mark)
    print(json.dumps(report.as_dict(), indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
