"""The alert bus: agents publish alerts, the control plane reads each one once.

Two backends behind one interface:

``SpoolBus`` (the embedded default)
    A directory, local or on a shared file system. An alert is written to
    ``.tmp/`` and renamed into ``alerts/``, so readers never see half a file.
``S3Bus``
    A prefix in an S3 bucket, through boto3 against any S3-compatible endpoint
    (tests use ``moto_server`` on loopback). For fleets without a shared file
    system.

Object names are ``<ns since epoch by the writer's clock, 20 digits>-<machine>-<id>.json``;
they sort roughly by time, but nothing relies on the writer's clock. The bus is an
untrusted input: a machine whose clock is an hour off, or a single forged file,
must not blind the reader. A :class:`BusReader` therefore reads *every* name present
in the folder (whatever its timestamp) that it has not read before; its cursor is
the set of names it has read, each with the time it first read it by its own
clock, and names leave the cursor when they leave the folder. The folder is kept
short by archiving: a reader that has recorded an alert moves it to ``archive/``
once it is older than its retention by the reader's clock
(:meth:`AlertBus.archive`). Before a document is read its size is checked: one over
:data:`node_tools.alerts.MAX_ALERT_BYTES` is quarantined unread. A document that is
not a valid alert is moved to ``quarantine/`` with the reason beside it and never
read again; the reader does not crash. An alert whose ``ts`` is far from the
reader's clock is kept and marked (``clock_skew_s``); the control plane handles it
by its arrival time.

Bus locations are URLs: ``spool:///abs/dir`` (or a plain path) and
``s3://bucket/prefix`` (endpoint from ``endpoint_url=`` in the query string or
``$TG_S3_ENDPOINT_URL``; credentials from boto3's usual chain).

A bus has two folders of the same documents: ``alerts/`` (faults and warnings, the
guardian's) and ``notices/`` (``info`` events that start scheduled work, such as
``checkpoint_committed``; their own watcher reads them, the guardian never does);
and ``heartbeats/``, one small document per machine that its agent rewrites every
few seconds (:meth:`AlertBus.beat`). A reader judges an agent's liveness by whether
that document *changed* (:meth:`AlertBus.heartbeats` gives a change token, never a
time the agent wrote), on its own clock.
"""

from __future__ import annotations

import json
import os
import re
import time
import urllib.parse
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from checkpoint.files import write_atomic, write_json_atomic
from node_tools.alerts import MAX_ALERT_BYTES, Alert, AlertError
from node_tools.errors import TrainguardError

#: The folders of a bus: ``alerts`` (read by the control plane's guardian) and ``notices`` (events that
#: start scheduled work, such as a committed checkpoint; read by their own watcher, never by the guardian).
ALERTS = "alerts"
NOTICES = "notices"
HEARTBEATS = "heartbeats"
ARCHIVE = "archive"
QUARANTINE = "quarantine"
#: a writer's clock this far from the reader's marks the alert ``clock_skew_s``
DEFAULT_SKEW_S = 60.0
_MACHINE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class BusError(TrainguardError):
    """The bus cannot be reached or used (missing directory, S3 endpoint down ...)."""


class Entry(NamedTuple):
    """A document in a bus folder: its name and size in bytes."""

    name: str
    size: int


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
    def entries(self) -> list[Entry]:
        """Every document in the folder (name and size), whatever its name says of its time."""

    def list_after(self, start_after: str) -> list[str]:
        """Alert names sorting after ``start_after``, in order."""
        return sorted(e.name for e in self.entries() if e.name > start_after)

    @abstractmethod
    def get(self, name: str) -> bytes:
        """The body of ``name``; FileNotFoundError if it is gone, BusError if the bus fails."""

    @abstractmethod
    def quarantine(self, name: str, reason: str) -> None:
        """Move ``name`` out of the alerts, keeping the reason beside it."""

    @abstractmethod
    def archive(self, name: str) -> None:
        """Move ``name`` (read and recorded) out of the folder into ``archive/``; gone already: no-op."""

    @abstractmethod
    def beat(self, machine: str, document: dict[str, Any]) -> None:
        """Rewrite ``machine``'s heartbeat document."""

    @abstractmethod
    def heartbeats(self) -> dict[str, str]:
        """Every machine's heartbeat as a change token: equal tokens, the same document (no time the
        writer claims is part of it)."""

    def publish(self, alert: Alert) -> str:
        """Validate and write one alert; returns its name on the bus."""
        body = alert.to_json().encode()
        name = object_name(alert)
        self.put(name, body)
        return name


def _check_machine(machine: str) -> str:
    if not _MACHINE_RE.match(machine or ""):
        raise BusError(f"heartbeat for machine {machine!r}: not a machine name (letters, digits, '.', '_', '-')")
    return machine


class SpoolBus(AlertBus):
    def __init__(self, root: Path, *, folder: str = ALERTS) -> None:
        self.root = Path(root)
        self.url = f"spool://{self.root}"
        self.alerts = self.root / folder
        self.tmp = self.root / ".tmp"
        self.quarantined = self.root / QUARANTINE
        self.archived = self.root / ARCHIVE / folder
        self.beats = self.root / HEARTBEATS

    def _ensure(self, *extra: Path) -> None:
        try:
            for d in (self.alerts, self.tmp, self.quarantined, *extra):
                d.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise BusError(f"alert spool {self.root} is not usable: {exc.strerror}") from None

    def _write(self, dest: Path, body: bytes, *, sync: bool = True) -> None:
        try:
            write_atomic(dest, body, fsync=sync, make_parent=False, tmp_dir=self.tmp)
        except OSError as exc:
            raise BusError(f"cannot write {dest.name} to spool {self.root}: {exc.strerror}") from None

    def put(self, name: str, body: bytes) -> None:
        self._ensure()
        self._write(self.alerts / name, body)

    @staticmethod
    def _scan(folder: Path, what: str) -> list[tuple[str, os.stat_result]]:
        """``(name, stat)`` of every ``.json`` document in ``folder`` (none when it does not exist yet)."""
        out = []
        try:
            with os.scandir(folder) as it:
                for e in it:
                    if not e.name.endswith(".json"):
                        continue
                    try:
                        out.append((e.name, e.stat()))
                    except FileNotFoundError:  # moved away between the listing and the stat
                        continue
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise BusError(f"{what} in spool {folder} cannot be listed: {exc.strerror}") from None
        return out

    def entries(self) -> list[Entry]:
        return [Entry(name, st.st_size) for name, st in self._scan(self.alerts, "alerts")]

    def get(self, name: str) -> bytes:
        with open(self.alerts / name, "rb") as fh:
            return fh.read(MAX_ALERT_BYTES + 1)

    def quarantine(self, name: str, reason: str) -> None:
        self._ensure()
        try:
            os.replace(self.alerts / name, self.quarantined / name)
        except FileNotFoundError:
            return
        (self.quarantined / f"{name}.reason.txt").write_text(reason[:2000] + "\n")

    def archive(self, name: str) -> None:
        self._ensure(self.archived)
        try:
            os.replace(self.alerts / name, self.archived / name)
        except FileNotFoundError:
            return
        except OSError as exc:
            raise BusError(f"cannot archive {name} in spool {self.root}: {exc.strerror}") from None

    def beat(self, machine: str, document: dict[str, Any]) -> None:
        self._ensure(self.beats)
        # a heartbeat is rewritten every few seconds and only its change matters: no fsync
        self._write(self.beats / f"{_check_machine(machine)}.json", json.dumps(document).encode(), sync=False)

    def heartbeats(self) -> dict[str, str]:
        # each rewrite is a new file (rename): a new inode, whatever the clocks say
        return {name[:-5]: f"{st.st_ino}:{st.st_mtime_ns}:{st.st_size}"
                for name, st in self._scan(self.beats, "heartbeats")}


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

    def _list(self, folder: str) -> list[dict[str, Any]]:
        base = self._key(folder, "") + "/"
        objects: list[dict[str, Any]] = []
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base}
        while True:
            page = self._call("list", self.s3.list_objects_v2, **kwargs)
            objects += [dict(obj, Name=obj["Key"][len(base):]) for obj in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return objects
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def entries(self) -> list[Entry]:
        return [Entry(o["Name"], int(o.get("Size", 0))) for o in self._list(self.folder)
                if o["Name"].endswith(".json") and "/" not in o["Name"]]

    def get(self, name: str) -> bytes:
        obj = self._call("get", self.s3.get_object, Bucket=self.bucket, Key=self._key(self.folder, name),
                         Range=f"bytes=0-{MAX_ALERT_BYTES}")
        return obj["Body"].read()

    def _move(self, name: str, to: str, what: str, metadata: dict[str, str] | None = None) -> None:
        src = self._key(self.folder, name)
        try:
            self._call(f"{what} copy", self.s3.copy_object, Bucket=self.bucket, Key=self._key(to, name),
                       CopySource={"Bucket": self.bucket, "Key": src}, Metadata=metadata or {},
                       MetadataDirective="REPLACE")
        except FileNotFoundError:
            return
        self._call(f"{what} delete", self.s3.delete_object, Bucket=self.bucket, Key=src)

    def quarantine(self, name: str, reason: str) -> None:
        self._move(name, QUARANTINE, "quarantine", {"reason": reason[:1000].encode("ascii", "replace").decode()})

    def archive(self, name: str) -> None:
        self._move(name, f"{ARCHIVE}/{self.folder}", "archive")

    def beat(self, machine: str, document: dict[str, Any]) -> None:
        self._call("heartbeat", self.s3.put_object, Bucket=self.bucket,
                   Key=self._key(HEARTBEATS, f"{_check_machine(machine)}.json"), Body=json.dumps(document).encode(),
                   ContentType="application/json")

    def heartbeats(self) -> dict[str, str]:
        return {o["Name"][:-5]: f"{o.get('ETag', '')}:{o.get('LastModified', '')}" for o in self._list(HEARTBEATS)
                if o["Name"].endswith(".json") and "/" not in o["Name"]}


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
    """Reads every alert of a bus folder once, whatever the writers' clocks say.

    Attributes:
        bus: the bus to read.
        seen: the cursor: every name read and still in the folder, with the time this reader first read it
            (its own clock). The guardian keeps it in the fleet database; ``cursor_path`` keeps it in a file.
        cursor_path: a file the cursor is saved to after each read (None: the caller keeps it).
        clock: this reader's clock (seconds since the epoch).
        skew_s: an alert whose ``ts`` is further than this from the reader's clock is marked ``clock_skew_s``.
        max_bytes: a document larger than this is quarantined unread.
        quarantined: what was quarantined so far: ``{"name", "reason", "machine"}`` each.
        gone: names that left the folder since they were read (archived, quarantined): dropped from ``seen``.
    """

    bus: AlertBus
    seen: dict[str, float] = field(default_factory=dict)
    cursor_path: Path | None = None
    clock: Callable[[], float] = time.time
    skew_s: float = DEFAULT_SKEW_S
    max_bytes: int = MAX_ALERT_BYTES
    quarantined: list[dict[str, str]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.cursor_path and Path(self.cursor_path).exists():
            try:
                doc = json.loads(Path(self.cursor_path).read_text())
                self.seen = {str(k): float(v) for k, v in doc.get("read", {}).items()}
            except (OSError, ValueError, TypeError, AttributeError):
                self.seen = {}

    @classmethod
    def from_now(cls, bus: AlertBus, **kwargs: Any) -> BusReader:
        """A reader of what arrives from now on: everything in the folder now counts as read."""
        reader = cls(bus, **kwargs)
        now = reader.clock()
        reader.seen = {e.name: now for e in bus.entries()}
        return reader

    def read(self) -> list[Alert]:
        """The alerts not read before, in name order; oversized and invalid documents are quarantined."""
        now = self.clock()
        entries = self.bus.entries()
        present = {e.name for e in entries}
        gone = [n for n in self.seen if n not in present]
        for n in gone:
            del self.seen[n]
        self.gone += gone
        fresh: list[Alert] = []
        for entry in sorted(entries):
            name = entry.name
            if name in self.seen:
                continue
            machine = name.split("-")[1] if name.count("-") >= 2 else ""
            if entry.size > self.max_bytes:
                self.seen[name] = now
                self._quarantine(name, f"{entry.size} bytes, over the limit of {self.max_bytes} bytes for one alert",
                                 machine)
                continue
            try:
                body = self.bus.get(name)
            except FileNotFoundError:
                continue  # vanished between list and get (quarantined by another reader): skip
            self.seen[name] = now
            try:
                alert = Alert.from_json(body, max_bytes=self.max_bytes)
            except AlertError as exc:
                self._quarantine(name, str(exc), machine)
                continue
            alert.received_ts, alert.bus_name = now, name
            skew = alert.ts - now
            if abs(skew) > self.skew_s:
                alert.clock_skew_s = round(skew, 3)
            fresh.append(alert)
        self._save()
        return fresh

    def _quarantine(self, name: str, reason: str, machine: str) -> None:
        self.bus.quarantine(name, f"{name}: {reason}")
        self.quarantined.append({"name": name, "reason": reason, "machine": machine[:63]})

    def _save(self) -> None:
        if not self.cursor_path:
            return
        write_json_atomic(self.cursor_path, {"read": self.seen})
