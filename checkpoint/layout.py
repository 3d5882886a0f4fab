"""Where copies live on a machine's disk, and how they get there atomically.

Layout of a checkpoint root (one per machine)::

    machine.json                       which machine this root belongs to
    local/step_<N>/rank_<R>/           rank R's own copy of step N
        model.safetensors  optim.safetensors  manifest.json
        committed.json                 every rank has step N locally and its replica landed
        verified.json                  the control plane verified step N (checksums, tensors, metrics)
        verifying.json                 a verification is reading step N: retention keeps the copy while
                                       this pin is younger than PIN_TTL_S
    replica/step_<N>/rank_<R>/         rank R's copy kept here for it (this machine holds R's backup)
        ... the same files, plus replica.json (which rank holds it)
    s3-request                         touch it: the next snapshot also goes to S3

Guarantees: a copy directory appears whole or not at all. Its files are written
and fsynced in a hidden temporary directory, the manifest last, and the
directory is renamed into place (then its parent fsynced). A copy without a
manifest is never looked at. Removal renames the copy aside first, so a reader
never sees half a deletion either.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainguard.checkpoint.manifest import MANIFEST
from trainguard.core.files import write_json_atomic

TIERS = ("local", "replica")
COMMITTED = "committed.json"
VERIFIED = "verified.json"
REPLICA_INFO = "replica.json"
MACHINE_INFO = "machine.json"
VERIFYING = "verifying.json"
S3_REQUEST = "s3-request"
MARKERS = (COMMITTED, VERIFIED, REPLICA_INFO, VERIFYING)
PIN_TTL_S = 900.0  # a verification that died leaves its pin; retention ignores it after this long

_STEP_RE = re.compile(r"^step_(\d+)$")
_RANK_RE = re.compile(r"^rank_(\d+)$")


def copy_dir(root: Path, tier: str, step: int, rank: int) -> Path:
    return Path(root) / tier / f"step_{step}" / f"rank_{rank}"


def parse_copy_path(path: Path) -> tuple[str, int, int] | None:
    """``(tier, step, rank)`` of a copy directory, from its path alone (a manifest may lie)."""
    path = Path(path)
    r, s = _RANK_RE.match(path.name), _STEP_RE.match(path.parent.name)
    if not (r and s) or path.parent.parent.name not in TIERS:
        return None
    return path.parent.parent.name, int(s.group(1)), int(r.group(1))


def list_copies(root: Path, tier: str, *, rank: int | None = None) -> list[tuple[int, int, Path]]:
    """``(step, rank, path)`` of every copy directory of ``tier`` under ``root`` that has a manifest, newest first."""
    found = []
    base = Path(root) / tier
    try:
        step_dirs = list(base.iterdir())
    except OSError:
        return []
    for sd in step_dirs:
        s = _STEP_RE.match(sd.name)
        if not s:
            continue
        try:
            rank_dirs = list(sd.iterdir())
        except OSError:
            continue
        for rd in rank_dirs:
            r = _RANK_RE.match(rd.name)
            if r and (rank is None or int(r.group(1)) == rank) and (rd / MANIFEST).exists():
                found.append((int(s.group(1)), int(r.group(1)), rd))
    found.sort(key=lambda x: (-x[0], x[1]))
    return found


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _tmp_name(dest: Path, what: str) -> Path:
    return dest.parent / f".{what}-{dest.name}-{os.getpid()}-{threading.get_ident()}-{time.monotonic_ns()}"


def write_copy(dest: Path, manifest: bytes, files: Iterable[tuple[str, Iterable[Any]]], *,
               extra: dict[str, bytes] | None = None, fsync: bool = True) -> None:
    """Write a copy directory atomically: ``files`` as ``(name, parts)`` (bytes-like parts written in
    order), then ``extra`` small files, then the manifest; rename into place (replacing an older copy)."""
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _tmp_name(dest, "tmp")
    tmp.mkdir()
    try:
        for name, parts in files:
            with open(tmp / name, "wb") as fh:
                for part in parts:
                    fh.write(part)
                fh.flush()
                if fsync:
                    os.fsync(fh.fileno())
        for name, data in (extra or {}).items():
            (tmp / name).write_bytes(data)
        with open(tmp / MANIFEST, "wb") as fh:
            fh.write(manifest)
            fh.flush()
            if fsync:
                os.fsync(fh.fileno())
        if fsync:
            _fsync_dir(tmp)
        if dest.exists():  # the same step written again (after a restore from an older step)
            trash = _tmp_name(dest, "trash")
            os.replace(dest, trash)
            os.replace(tmp, dest)
            shutil.rmtree(trash, ignore_errors=True)
        else:
            os.replace(tmp, dest)
        if fsync:
            _fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def remove_copy(path: Path) -> None:
    """Delete a copy directory (renamed aside first), and its step directory once empty."""
    path = Path(path)
    trash = _tmp_name(path, "trash")
    try:
        os.replace(path, trash)
    except OSError:
        return
    shutil.rmtree(trash, ignore_errors=True)
    with contextlib.suppress(OSError):
        path.parent.rmdir()


def clean_temporaries(root: Path) -> int:
    """Remove temporaries left by a process that died mid-write. Returns how many."""
    removed = 0
    for tier in TIERS:
        for step_dir in (Path(root) / tier).glob("step_*"):
            for leftover in step_dir.glob(".tmp-*"):
                shutil.rmtree(leftover, ignore_errors=True)
                removed += 1
            for leftover in step_dir.glob(".trash-*"):
                shutil.rmtree(leftover, ignore_errors=True)
                removed += 1
    return removed


def write_json(path: Path, doc: dict[str, Any]) -> None:
    """A small JSON file written atomically (marker files, reports)."""
    write_json_atomic(path, doc, sort_keys=True)


def write_marker(copy: Path, name: str, doc: dict[str, Any]) -> bool:
    """A marker (``committed.json``, ``verified.json``) into an existing copy; False when the copy is gone
    (retention removed it meanwhile): the copy's directory is never made again around a lone marker."""
    copy = Path(copy)
    if not (copy / MANIFEST).exists():
        return False
    try:
        write_json_atomic(copy / name, doc, sort_keys=True, make_parent=False)
    except FileNotFoundError:  # removed between the check and the write
        return False
    return True


def pin(copies: Iterable[Path]) -> None:
    """Hold copies against retention while a verification reads them (``verifying.json``)."""
    for copy in copies:
        write_marker(copy, VERIFYING, {"pinned_ts": time.time(), "pid": os.getpid()})


def unpin(copies: Iterable[Path]) -> None:
    for copy in copies:
        with contextlib.suppress(OSError):
            (Path(copy) / VERIFYING).unlink()


def pinned(copy: Path, *, now: float | None = None, ttl_s: float = PIN_TTL_S) -> bool:
    """True while a verification's pin on ``copy`` is younger than ``ttl_s``."""
    try:
        age = (time.time() if now is None else now) - (Path(copy) / VERIFYING).stat().st_mtime
    except OSError:
        return False
    return age < ttl_s


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        doc = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


def machine_name(root: Path, default: str = "") -> str:
    """The machine a root belongs to (from its ``machine.json``), else ``default``, else the root's path."""
    doc = read_json(Path(root) / MACHINE_INFO) or {}
    return str(doc.get("machine") or default or root)
