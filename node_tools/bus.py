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
they sort roughly by time, but nothing relies on the writer's clock. An object holds
one alert, or a batch of one machine's alerts (:func:`trainguard.node_tools.alerts.batch_document`:
an agent whose ranks time out together publishes one object, :meth:`AlertBus.publish_batch`).
The bus is an untrusted input: a machine whose clock is an hour off, or a single forged
file, must not blind the reader. A :class:`BusReader` therefore reads *every* name present
in the folder (whatever its timestamp) that it has not read before; its cursor is
the set of names it has read, each with the time it first read it by its own
clock, and names leave the cursor when they leave the folder. Before a document is read
its size is checked: one over :data:`trainguard.node_tools.alerts.MAX_ALERT_BYTES` is quarantined
unread. A document that is not a valid alert (or a batch holding one) is moved to
``quarantine/`` with the reason beside it and never read again; the reader does not
crash. An alert whose ``ts`` is far from the reader's clock is kept and marked
(``clock_skew_s``); the control plane handles it by its arrival time.

An alert storm (every rank of a 100,000-rank job alerting at once) is read in bounded
batches, the folder kept short, and no listing ever covers the bus's history:

* **Batches.** ``read(limit=...)`` stops once it holds ``limit`` alerts (or has read
  ``max_read_bytes``); what is left waits for the next read, which goes on from there.
  The guardian's trigger fires with the first full batch, so an incident opens within
  a second of a storm's first alerts however many follow, and each event stays a few
  MB whatever the storm's size. S3 bodies are fetched concurrently (:data:`S3_GETS` at
  a time; boto3's clients are thread-safe).
* **Listing in passes.** The reader lists the folder page by page (S3: 1,000 names a
  LIST) and reads the unread names of each page before it lists the next, so the
  first batch needs one page, not the whole folder. A pass ends at the folder's last
  page; only then are names it no longer holds dropped from the cursor (``gone``), and
  the next pass starts again from the first name. Every name present is therefore
  listed by every pass, whatever its writer's clock says: one that sorts before where
  a pass has got to (a clock far behind) is read by the next pass, at most one pass
  later; nothing is skipped. (Listing after the cursor's greatest name, with a sweep
  now and then, would leave such an alert unread until the sweep; with the folder
  kept short, a whole pass costs about what that would.)
* **Retention.** The folder holds only what is unread or was read recently: once a
  reader has recorded a name (its cursor committed with the batch in the fleet
  database, which keeps every alert's document) and it is older than a short retention
  by the *reader's* clock, the reader removes it in bulk (:meth:`AlertBus.retire`:
  spool, a rename into ``archive/``, as cheap as an unlink and never listed by a
  reader; S3, ``DeleteObjects``, 1,000 names a call, instead of a copy and a delete
  each). Nothing else ever removes an alert, and nothing is removed by a writer's
  clock.

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
import uuid
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from trainguard.core.errors import TrainguardError
from trainguard.core.files import write_atomic, write_json_atomic
from trainguard.node_tools.alerts import MAX_ALERT_BYTES, Alert, AlertError, batch_document, parse_document

#: The folders of a bus: ``alerts`` (read by the control plane's guardian) and ``notices`` (events that
#: start scheduled work, such as a committed checkpoint; read by their own watcher, never by the guardian).
ALERTS = "alerts"
NOTICES = "notices"
HEARTBEATS = "heartbeats"
ARCHIVE = "archive"
QUARANTINE = "quarantine"
#: a writer's clock this far from the reader's marks the alert ``clock_skew_s``
DEFAULT_SKEW_S = 60.0
#: S3 bodies fetched at once by a reader (and the client's connection pool)
S3_GETS = 16
#: names removed by one S3 ``DeleteObjects`` call (S3's own limit)
S3_DELETE_BATCH = 1000
_MACHINE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$")


class BusError(TrainguardError):
    """The bus cannot be reached or used (missing directory, S3 endpoint down ...)."""


class Entry(NamedTuple):
    """A document in a bus folder: its name and size in bytes (-1: not known from the listing, see
    :meth:`AlertBus.size`)."""

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
    #: documents a reader fetches at once (:meth:`get_many`)
    gets: int = 1

    @abstractmethod
    def put(self, name: str, body: bytes) -> None: ...

    @abstractmethod
    def entries(self) -> list[Entry]:
        """Every document in the folder (name and size), whatever its name says of its time."""

    def pages(self) -> Iterator[list[Entry]]:
        """Every document in the folder, a page at a time (a page is what one listing call returns; S3 lists in
        name order, a page's own order is not promised); a size may be -1 (not known from the listing)."""
        yield self.entries()

    def size(self, name: str) -> int:
        """The size of ``name`` in bytes; FileNotFoundError if it is gone."""
        for e in self.entries():
            if e.name == name:
                return e.size
        raise FileNotFoundError(name)

    def list_after(self, start_after: str) -> list[str]:
        """Alert names sorting after ``start_after``, in order."""
        return sorted(e.name for e in self.entries() if e.name > start_after)

    @abstractmethod
    def get(self, name: str) -> bytes:
        """The body of ``name``; FileNotFoundError if it is gone, BusError if the bus fails."""

    def get_many(self, names: Sequence[str]) -> list[bytes | Exception]:
        """The bodies of ``names``, in order; a name that is gone gives its FileNotFoundError in its place.
        BusError if the bus fails."""
        out: list[bytes | Exception] = []
        for name in names:
            try:
                out.append(self.get(name))
            except FileNotFoundError as exc:
                out.append(exc)
        return out

    @abstractmethod
    def quarantine(self, name: str, reason: str) -> None:
        """Move ``name`` out of the alerts, keeping the reason beside it."""

    @abstractmethod
    def archive(self, name: str) -> None:
        """Move ``name`` (read and recorded) out of the folder into ``archive/``; gone already: no-op."""

    def retire(self, names: Sequence[str]) -> list[str]:
        """Remove ``names`` (read and recorded) from the folder in bulk; returns those no longer in it (gone
        already counts). One the bus would not remove stays, and is not returned: a later call tries again."""
        done = []
        for name in names:
            try:
                self.archive(name)
            except (BusError, OSError):
                break
            done.append(name)
        return done

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

    def publish_batch(self, alerts: Sequence[Alert]) -> tuple[str, int]:
        """Validate and write the first alerts of ``alerts`` as one document, as many as fit its limits (one
        machine's, see :func:`trainguard.node_tools.alerts.batch_document`); returns its name and how many it holds. A
        lone alert is written as :meth:`publish` writes it."""
        count, text = batch_document(alerts)
        first = alerts[0]
        name = object_name(first) if count == 1 else \
            f"{int(first.ts * 1e9):020d}-{first.machine}-{uuid.uuid4().hex}.json"
        self.put(name, text.encode())
        return name, count


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
        for name in SpoolBus._names(folder, what):
            try:
                out.append((name, os.stat(folder / name)))
            except FileNotFoundError:  # moved away between the listing and the stat
                continue
        return out

    @staticmethod
    def _names(folder: Path, what: str) -> list[str]:
        """The name of every ``.json`` document in ``folder`` (none when it does not exist yet), unsorted."""
        try:
            with os.scandir(folder) as it:
                return [e.name for e in it if e.name.endswith(".json")]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise BusError(f"{what} in spool {folder} cannot be listed: {exc.strerror}") from None

    def entries(self) -> list[Entry]:
        return [Entry(name, st.st_size) for name, st in self._scan(self.alerts, "alerts")]

    def pages(self) -> Iterator[list[Entry]]:
        # one page, names only: a document's size is asked for (one stat) only when it is about to be read
        yield [Entry(name, -1) for name in self._names(self.alerts, "alerts")]

    def size(self, name: str) -> int:
        return os.stat(self.alerts / name).st_size

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

    def retire(self, names: Sequence[str]) -> list[str]:
        # a rename into archive/ costs what an unlink does, and no reader lists the archive
        if not names:
            return []
        self._ensure(self.archived)
        done = []
        for name in names:
            try:
                os.replace(self.alerts / name, self.archived / name)
            except FileNotFoundError:
                pass
            except OSError:
                break
            done.append(name)
        return done

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
                 client: Any = None, timeout_s: float = 5.0, folder: str = ALERTS, gets: int = S3_GETS,
                 page_size: int = 1000) -> None:
        self.bucket = bucket
        self.page_size = page_size  # names per LIST call (S3's most)
        self.folder = folder
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url or os.environ.get("TG_S3_ENDPOINT_URL") or None
        self.url = f"s3://{bucket}/{self.prefix}"
        self.gets = max(1, int(gets))
        if client is None:
            import boto3
            from botocore.config import Config

            client = boto3.client(
                "s3", endpoint_url=self.endpoint_url,
                config=Config(connect_timeout=timeout_s, read_timeout=timeout_s, retries={"max_attempts": 2},
                              max_pool_connections=self.gets),
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

    def _list_pages(self, folder: str) -> Iterator[list[dict[str, Any]]]:
        base = self._key(folder, "") + "/"
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Prefix": base, "MaxKeys": self.page_size}
        while True:
            page = self._call("list", self.s3.list_objects_v2, **kwargs)
            yield [dict(obj, Name=obj["Key"][len(base):]) for obj in page.get("Contents", [])]
            if not page.get("IsTruncated"):
                return
            kwargs["ContinuationToken"] = page["NextContinuationToken"]

    def _list(self, folder: str) -> list[dict[str, Any]]:
        return [obj for page in self._list_pages(folder) for obj in page]

    @staticmethod
    def _documents(objects: list[dict[str, Any]]) -> list[Entry]:
        return [Entry(o["Name"], int(o.get("Size", 0))) for o in objects
                if o["Name"].endswith(".json") and "/" not in o["Name"]]

    def entries(self) -> list[Entry]:
        return self._documents(self._list(self.folder))

    def pages(self) -> Iterator[list[Entry]]:
        for page in self._list_pages(self.folder):
            yield self._documents(page)

    def get(self, name: str) -> bytes:
        obj = self._call("get", self.s3.get_object, Bucket=self.bucket, Key=self._key(self.folder, name),
                         Range=f"bytes=0-{MAX_ALERT_BYTES}")
        return obj["Body"].read()

    def get_many(self, names: Sequence[str]) -> list[bytes | Exception]:
        if len(names) <= 1:
            return super().get_many(names)
        from concurrent.futures import ThreadPoolExecutor

        def one(name: str) -> bytes | Exception:
            try:
                return self.get(name)
            except (FileNotFoundError, BusError) as exc:
                return exc

        with ThreadPoolExecutor(max_workers=min(self.gets, len(names)), thread_name_prefix="s3-bus-get") as pool:
            out = list(pool.map(one, names))
        failed = next((r for r in out if isinstance(r, BusError)), None)
        if failed is not None:
            raise failed
        return out

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

    def retire(self, names: Sequence[str]) -> list[str]:
        # deleted, not copied to archive/ first (a copy is a call per alert): the fleet database keeps every
        # alert's document; deleting a name that is gone already succeeds
        done: list[str] = []
        for i in range(0, len(names), S3_DELETE_BATCH):
            chunk = list(names[i:i + S3_DELETE_BATCH])
            try:
                answer = self._call("retire", self.s3.delete_objects, Bucket=self.bucket, Delete={
                    "Objects": [{"Key": self._key(self.folder, n)} for n in chunk], "Quiet": True})
            except (BusError, FileNotFoundError):
                break
            failed = {e.get("Key") for e in answer.get("Errors", [])}
            done += [n for n in chunk if self._key(self.folder, n) not in failed]
            if failed:
                break
        return done

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
        more: whether the last read stopped at one of its limits (alerts, bytes, time) with unread documents
            left: the next read goes on from there.
        moves: whether the reader moves what it quarantines out of the folder itself; a reader that only watches
            (the control plane's, in Airflow's triggerer) leaves that to whoever records what it read
            (:meth:`AlertBus.quarantine` with each :attr:`quarantined` document's reason).
    """

    bus: AlertBus
    seen: dict[str, float] = field(default_factory=dict)
    cursor_path: Path | None = None
    clock: Callable[[], float] = time.time
    skew_s: float = DEFAULT_SKEW_S
    max_bytes: int = MAX_ALERT_BYTES
    quarantined: list[dict[str, str]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)
    moves: bool = True
    more: bool = field(default=False, init=False)
    # the pass in progress: its remaining pages, the names it listed so far, the unread names listed and not
    # read yet, and bodies fetched but not yet taken (a read that reached its limit mid-round)
    _pages: Iterator[list[Entry]] | None = field(default=None, init=False, repr=False)
    _listed: set[str] = field(default_factory=set, init=False, repr=False)
    _pending: deque[Entry] = field(default_factory=deque, init=False, repr=False)
    _fetched: deque[tuple[Entry, bytes | Exception]] = field(default_factory=deque, init=False, repr=False)
    # names forgotten to be read again (:meth:`forget` with ``again``) -> when they were first read: an alert read
    # again arrived then, not now
    _first_read: dict[str, float] = field(default_factory=dict, init=False, repr=False)

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
        reader.seen = {e.name: now for page in bus.pages() for e in page}
        return reader

    def read(self, limit: int | None = None, *, max_read_bytes: int | None = None,
             max_read_s: float | None = None) -> list[Alert]:
        """The alerts not read before: without ``limit``, every one present (in name order within each listing
        page); with it, the first ``limit`` or so (reading stops at the document that reaches it, once
        ``max_read_bytes`` of documents were read, or once it has read for ``max_read_s`` and holds something),
        the rest left to the next reads (:attr:`more`). Each quarantined document counts as one alert towards
        the limit. Oversized and invalid documents are quarantined. A read goes on with the listing pass it
        finds in progress; one without a limit then starts one more (so it reads everything present when it
        was called), one with a limit starts a pass only when none was in progress (the next read starts the
        next)."""
        now = self.clock()
        until = None if max_read_s is None else time.monotonic() + max_read_s
        fresh: list[Alert] = []
        taken = read_bytes = 0
        started = finished = False
        full = False
        while True:
            if (limit is not None and taken >= limit) or (max_read_bytes is not None and read_bytes >= max_read_bytes) \
                    or (until is not None and taken and time.monotonic() >= until):
                full = True
                break
            if self._fetched:
                entry, body = self._fetched.popleft()
                n, size = self._take(entry, body, now, fresh)
                taken, read_bytes = taken + n, read_bytes + size
                continue
            if self._pending:
                taken += self._fetch(limit - taken if limit is not None else None, now)
                continue
            if self._pages is None:
                if started or (finished and limit is not None):
                    break
                started = True
                self._pages, self._listed = iter(self.bus.pages()), set()
            try:
                page = next(self._pages, None)
            except BaseException:
                self._pages = None
                raise
            if page is None:
                self._end_pass()
                finished = True
                continue
            names = [e[0] for e in page]
            self._listed.update(names)
            seen = self.seen
            self._pending.extend(sorted(e for e, name in zip(page, names, strict=True) if name not in seen))
        self.more = full and bool(self._fetched or self._pending or self._pages is not None)
        self._save()
        return fresh

    def _fetch(self, room: int | None, now: float) -> int:
        """Fetch the next unread documents of the pass (several at once where the bus reads concurrently): an
        oversized one is quarantined unread; a vanished one is skipped. Returns how many were quarantined."""
        quarantined = 0
        want = max(1, min(room if room is not None else self.bus.gets, self.bus.gets))
        batch: list[Entry] = []
        while self._pending and len(batch) < want:
            entry = self._pending.popleft()
            if entry.name in self.seen:
                continue
            size = entry.size
            if size < 0:
                try:
                    size = self.bus.size(entry.name)
                except FileNotFoundError:
                    continue
            if size > self.max_bytes:
                self.seen[entry.name] = now
                self._quarantine(entry.name, f"{size} bytes, over the limit of {self.max_bytes} bytes for one alert",
                                 _machine_of(entry.name))
                quarantined += 1
                continue
            batch.append(Entry(entry.name, size))
        if batch:
            self._fetched.extend(zip(batch, self.bus.get_many([e.name for e in batch]), strict=True))
        return quarantined

    def _take(self, entry: Entry, body: bytes | Exception, now: float, fresh: list[Alert]) -> tuple[int, int]:
        """Turn one fetched document into alerts (appended to ``fresh``); returns how many count towards the
        limit and the bytes read."""
        name = entry.name
        if isinstance(body, Exception) or name in self.seen:
            return 0, 0  # vanished between list and get (quarantined by another reader): skipped
        self.seen[name] = now
        try:
            alerts = parse_document(body, max_bytes=self.max_bytes)
        except AlertError as exc:
            self._quarantine(name, str(exc), _machine_of(name))
            return 1, len(body)
        arrived = self._first_read.pop(name, now)
        for alert in alerts:
            alert.received_ts, alert.bus_name = arrived, name
            skew = alert.ts - arrived
            if abs(skew) > self.skew_s:
                alert.clock_skew_s = round(skew, 3)
        fresh += alerts
        return len(alerts), len(body)

    def _end_pass(self) -> None:
        """The pass listed the whole folder: names read before and no longer there leave the cursor."""
        gone = [n for n in self.seen if n not in self._listed]
        for n in gone:
            del self.seen[n]
        known = set(self.gone)
        self.gone += [n for n in gone if n not in known]
        self._pages, self._listed = None, set()

    def forget(self, names: Sequence[str], *, again: bool = False) -> None:
        """``names`` out of the cursor, not reported gone: they left the folder by this reader's own hand (retired),
        or, with ``again``, they are to be read again (their alerts keep the time they first arrived)."""
        for n in names:
            first = self.seen.pop(n, None)
            if again and first is not None:
                self._first_read.setdefault(n, first)

    def _quarantine(self, name: str, reason: str, machine: str) -> None:
        if self.moves:
            self.bus.quarantine(name, f"{name}: {reason}")
        self.quarantined.append({"name": name, "reason": reason, "machine": machine[:63]})

    def _save(self) -> None:
        if not self.cursor_path:
            return
        write_json_atomic(self.cursor_path, {"read": self.seen})


def _machine_of(name: str) -> str:
    return name.split("-")[1] if name.count("-") >= 2 else ""
