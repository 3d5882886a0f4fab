"""The manifest of one rank's copy of one checkpoint step.

``manifest.json`` says what the copy is and how to check it without trusting
anything else in it:

* ``step``, ``rank``, ``world_size``, ``topology`` (tp/pp/dp/ranks per machine),
  ``coords``, ``machine`` that wrote it, ``job``, ``incarnation``, ``created_ts``;
* ``data_position``: where the data loader resumes (``next_step``);
* ``state``: the JSON part of the training state (optimizer parameter groups,
  Python and NumPy RNG);
* ``files``: for each tensor file its ``size`` in bytes, ``sha256``, and its
  tensors' names, dtypes and shapes;
* ``manifest_sha256``: a hash of the manifest itself (all keys but this one,
  canonical JSON), so a damaged manifest is told apart from a damaged shard.

The manifest is written after the files it describes; a copy without one is
incomplete and ignored.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

FORMAT = "trainguard.checkpoint"
VERSION = 1
MANIFEST = "manifest.json"


class ManifestInvalid(ValueError):
    """A manifest that cannot be parsed or does not hash to its own ``manifest_sha256``."""


def _canonical(doc: dict[str, Any]) -> bytes:
    body = {k: v for k, v in doc.items() if k != "manifest_sha256"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode("utf-8")


def seal(doc: dict[str, Any]) -> bytes:
    """The manifest's bytes: its canonical JSON with its self-hash added as the last key."""
    body = _canonical(doc)
    digest = hashlib.sha256(body).hexdigest()
    return body[:-1] + b',"manifest_sha256":"' + digest.encode("ascii") + b'"}\n'



def parse(data: bytes) -> dict[str, Any]:
    """The manifest in ``data``; :class:`ManifestInvalid` saying why when it cannot be trusted."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise ManifestInvalid(f"manifest is not valid JSON ({exc})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise ManifestInvalid("manifest is not a trainguard checkpoint manifest")
    if doc.get("version") != VERSION:
        raise ManifestInvalid(f"manifest version {doc.get('version')!r} is not {VERSION}")
    expected = doc.get("manifest_sha256")
    if expected != hashlib.sha256(_canonical(doc)).hexdigest():
        raise ManifestInvalid("manifest does not match its own sha256 (edited or damaged)")
    for key in ("step", "rank", "world_size", "topology", "files"):
        if key not in doc:
            raise ManifestInvalid(f"manifest lacks {key!r}")
    if not isinstance(doc["files"], list) or not all(
            isinstance(f, dict) and {"name", "size", "sha256", "tensors"} <= set(f) for f in doc["files"]):
        raise ManifestInvalid("manifest 'files' is malformed")
    return doc


def file_names(data: bytes | None) -> list[str]:
    """The file names a manifest lists, in order; [] for a missing or unreadable one (the copy's check
    then says why)."""
    if data is None:
        return []
    try:
        return [e["name"] for e in parse(data)["files"]]
    except ManifestInvalid:
        return []


def build(*, step: int, rank: int, world_size: int, topology: dict[str, int], coords: dict[str, int],
          machine: str, job: str, incarnation: int, created_ts: float, data_position: dict[str, Any],
          state: dict[str, Any], files: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "format": FORMAT, "version": VERSION, "step": step, "rank": rank, "world_size": world_size,
        "topology": topology, "coords": coords, "machine": machine, "job": job, "incarnation": incarnation,
        "created_ts": created_ts, "data_position": data_position, "state": state, "files": files,
    }


def topology_key(doc: dict[str, Any]) -> str:
    """The layout a copy belongs to, as ``tp=..,pp=..,dp=..`` (ranks per machine does not matter to restore)."""
    t = doc["topology"]
    return f"tp={t['tp']},pp={t['pp']},dp={t['dp']}"
