"""The alert bus: agents publish alerts, the control plane reads each one once.

Two backends behind one interface:

``SpoolBus`` (the embedded default)
    A directory, local or on a shared file system. An alert is written to
    ``.tmp/`` and renamed into ``alerts/``, so readers never see half a file.
``S3Bus``
    A prefix in an S3 bucket, through boto3 against any S3-compatible endpoint
    (tests use ``moto_server`` on loopback). For fleets without a shared file
    system.

Object names sort by time: ``<ns since epoch, 20 digits>-<machine>-<id>.json``.
A :class:`BusReader` keeps a cursor (optionally in a file, so a restarted reader
goes on where it stopped): it lists names after ``horizon - lookback`` and skips
the names it has already seen, so an alert written late by a machine whose clock
lags by less than the lookback is still read, and none is read twice. A document
that is not a valid alert is moved to ``quarantine/`` with the reason beside it
and never read again; the reader does not crash.

Bus locations are URLs: ``spool:///abs/dir`` (or a plain path) and
``s3://bucket/prefix`` (endpoint from ``endpoint_url=`` in the query string or
``$TG_S3_ENDPOINT_URL``; credentials from boto3's usual chain).

A bus has two folders of the same documents: ``alerts/`` (faults and warnings, the
guardian's) and ``notices/`` (``info`` events that start scheduled work, such as
``checkpoint_committed``; their own watcher reads them, the guardian never does).
"""

from __future__ import annotations

import json
import os
import urllib.parse
import uuid
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from node_tools.alerts import Alert, AlertError
from node_tools.errors import TrainguardError

#: The folders of a bus: ``alerts`` (read by the control plane's guardian) and ``notices`` (events that
#: start scheduled work, such as a committed checkpoint; read by their own watcher, never by the guardian).
ALERTS = "alerts"
NOTICES = "notices"


class BusError(TrainguardError):
    """The bus cannot be reached or used (missing directory, S3 endpoint down ...)."""


def object_name(alert: Alert) -> str:
    return f"{int(alert.ts * 1e9):020d}-{alert.machine}-{alert.id}.json"


def name_ts_ns(name: str) -> int:
    head = name.split("-", 1)[0]
    return int(head) if head.isdigit() else 0


class AlertBus(ABC):
    """Where alerts go."""

    url: str

    @abstractmethod
    def put(self, name: str, body: bytes) -> None: ...

    @abstractmethod
    def list_after(self, start_after: str) -> list[str]:
        """Alert names sorting after ``start_after``, in order."""

    @abstractmethod
    def get(self, name: str) -> bytes:
        """The body of ``name``; FileNotFoundError if it is gone, BusError if the bus fails."""

    @abstractmethod
    def quarantine(self, name: str, reason: str) -> None:
        """Move ``name`` out of the alerts, keeping the reason beside it."""

    def publish(self, alert: Alert) -> str:
        """Validate and write one alert; returns its name on the bus."""
        body = alert.to_json().encode()
        name = object_name(alert)
        self.put(name, body)
        return name


class SpoolBus(AlertBus):
    def __init__(self, root: Path, *, folder: str = ALERTS) -> None:
        self.root = Path(root)
        self.url = f"spool://{self.root}"
        self.alerts = self.root / folder
        self.tmp = self.root / ".tmp"
        self.quarantined = self.root / "quarantine"

    def _ensure(self) -> None:
        try:
            for d in (self.alerts, self.tmp, self.quarantined):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BusError(f"alert spool {self.root} is not usable: {exc.strerror}") from None

    def put(self, name: str, body: bytes) -> None:
        self._ensure()
        tmp = self.tmp / f"{name}.{uuid.uuid4().hex[:8]}"
        try:
            with open(tmp, "wb") as fh:
                fh.write(body)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.alerts / name)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise BusError(f"cannot write alert to spool {self.root}: {exc.strerror}") from None

    def list_after(self, start_after: str) -> list[str]:
        try:
            names = [n for n in os.listdir(self.alerts) if n.endswith(".json") and n > start_after]
        except FileNotFoundError:
            return []
        return sorted(names)

    def get(self, name: str) -> bytes:
        return (self.alerts / name).read_bytes()

    def quarantine(self, name: str, reason: str) -> None:
        self._ensure()
        try:
            os.replace(self.alerts / name, self.quarantined / name)
        except FileNotFoundError:
            return
        (self.quarantined / f"{name}.reason.txt").write_text(reason + "\n")


class S3Bus(AlertBus):
    def __init__(self, bucket: str, prefix: str = "", *, endpoint_url: str | None = None,
                 client: Any = None, timeout_s: float = 5.0, folder: str = ALERTS) -> None:
        self.bucket = bucket
        self.folder = folder
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or os.environ.get("TG_S3_ENDPOINT_URL") or None
        self.url = f"s3://{bucket}/{self.prefix}"
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.client(
                "s3", endpoint_url=self.endpoint_url,
                config=Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 2}),
            )
        self.s3 = client

    def _key(self, folder: str, name: str) -> str:
        return "/".join(p for p in (self.prefix, folder, name) if p)

    def _call(self, what: str, fn: Any, **kwargs: Any) -> Any:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            return fn(**kwargs)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
                raise FileNotFoundError(kwargs.get("Key", "")) from None
            raise BusError(f"S3 alert bus {self.url} ({self.endpoint_url or 'default endpoint'}): {what} failed: "
                           f"{exc}".replace("\n", " ")) from None
        except BotoCoreError as exc:
            raise BusError(f"S3 alert bus {self.url} ({self.endpoint_url or 'default endpoint'}): {what} failed: "
                           f"{exc}".replace("\n", " ")) from None

    def put(self, name: str, body: bytes) -> None:
        self._call("put", self.s3.put_object, Bucket=self.bucket, Key=self._key(self.folder, name), Body=body,
                   ContentType="application/json")

    def list_after(self, start_after: str) -> list[str]:
        base = self._key(self.folder, "") + "/"
        names: list[str] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "StartAfter": base + start_after}
        while True:
            page = self._call("list", self.s3.list_objects_v2, **kwargs)
            names += [obj["Key"][len(base):] for obj in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return names
            kwargs["ContinuationToken"] = page["NextContinuationToken"]
            kwargs.pop("StartAfter", None)

    def get(self, name: str) -> bytes:
        obj = self._call("get", self.s3.get_object, Bucket=self.bucket, Key=self._key(self.folder, name))
        return obj["Body"].read()

    def quarantine(self, name: str, reason: str) -> None:
        src = self._key(self.folder, name)
        self._call("copy", self.s3.copy_object, Bucket=self.bucket, Key=self._key("quarantine", name),
                   CopySource={"Bucket": self.bucket, "Key": src}, Metadata={"reason": reason[:1000]},
                   MetadataDirective="REPLACE")
        self._call("delete", self.s3.delete_object, Bucket=self.bucket, Key=src)


def open_bus(url: str, *, folder: str = ALERTS, **kwargs: Any) -> AlertBus:
    """The bus at ``url`` (``spool:///dir``, a plain path, or ``s3://bucket/prefix?endpoint_url=...``);
    ``folder``: :data:`ALERTS` or :data:`NOTICES`."""
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme in ("", "spool", "file"):
        path = parsed.path if parsed.scheme else url
        if not path:
            raise BusError(f"alert bus {url!r} names no directory")
        return SpoolBus(Path(path), folder=folder)
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise BusError(f"alert bus {url!r} names no bucket; write s3://bucket/prefix")
        query = urllib.parse.parse_qs(parsed.query)
        endpoint = (query.get("endpoint_url") or [None])[0]
        return S3Bus(parsed.netloc, parsed.path, endpoint_url=endpoint, folder=folder, **kwargs)
    raise BusError(f"alert bus {url!r} has an unknown scheme; use spool:///dir or s3://bucket/prefix")


@dataclass
class BusReader:
    """Reads every alert of a bus once, in time order, surviving restarts through ``cursor_path``.

    Attributes:
        bus: the bus to read.
        cursor_path: where the cursor is kept between runs (None: in memory only).
        lookback_s: how late an alert may arrive (clock skew, slow writers) and still be read.
    """

    bus: AlertBus
    cursor_path: Path | None = None
    lookback_s: float = 120.0
    horizon_ns: int = 0
    seen: dict[str, int] = field(default_factory=dict)
    quarantined: list[dict[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.cursor_path and Path(self.cursor_path).exists():
            try:
                doc = json.loads(Path(self.cursor_path).read_text())
                self.horizon_ns = int(doc.get("horizon_ns", 0))
                self.seen = {str(k): int(v) for k, v in doc.get("seen", {}).items()}
            except (OSError, ValueError, TypeError):
                self.horizon_ns, self.seen = 0, {}

    def read(self) -> list[Alert]:
        """The alerts not read before, oldest first; invalid documents are quarantined."""
        floor_ns = max(0, self.horizon_ns - int(self.lookback_s * 1e9))
        start_after = f"{floor_ns:020d}"
        fresh: list[Alert] = []
        for name in self.bus.list_after(start_after):
            if name in self.seen:
                continue
            ts = name_ts_ns(name)
            try:
                body = self.bus.get(name)
            except FileNotFoundError:
                continue  # vanished between list and get (quarantined by another reader): skip
            self.seen[name] = ts
            try:
                fresh.append(Alert.from_json(body))
            except AlertError as exc:
                reason = f"{name}: {exc}"
                self.bus.quarantine(name, reason)
                self.quarantined.append({"name": name, "reason": str(exc)})
            self.horizon_ns = max(self.horizon_ns, ts)
        keep_after = self.horizon_ns - int(self.lookback_s * 1e9)
        self.seen = {n: t for n, t in self.seen.items() if t >= keep_after}
        self._save()
        return fresh

    def _save(self) -> None:
        if not self.cursor_path:
            return
        path = Path(self.cursor_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps({"horizon_ns": self.horizon_ns, "seen": self.seen}))
        os.replace(tmp, path)
