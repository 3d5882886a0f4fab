"""The checkpoint saver: one process per machine that persists what the training ranks snapshot.

The design of DLRover's flash checkpoint and NVRx's local checkpointing: a training rank only copies
its state into shared memory (files in ``/dev/shm`` the saver creates; pinned on GPU hosts) and says
so in one short message; the saver, a process of its own at a lower CPU priority, does the rest:

* checks every floating-point value is finite (a snapshot holding a NaN is never written),
* hashes the files and seals the manifest,
* writes the local copy atomically (:mod:`trainguard.checkpoint.layout`),
* sends the replica to the saver of the rank's backup rank (TCP, JSON header and raw bytes, a token
  the job's ranks share; the receiver checks every checksum before it writes and acknowledges),
* uploads to the remote tier when due,
* and reports the step done (local copy durable, replica acknowledged) to the rank, which commits it
  with its peers as before (:class:`trainguard.checkpoint.engine.Checkpointer`).

It runs at a lower CPU priority (``nice``), and when the rank says its host is about to idle
(:meth:`trainguard.checkpoint.engine.Checkpointer.host_idle`: the device computes, the host thread waits), it
persists then (waiting at most ``QUIET_WAIT_S``): its copies and hashing then do not compete for the
host's CPU, caches and memory bandwidth with the training's own busy phase. A host runs several ranks, which
do not idle at the same moment: it then also waits, at most ``HOST_WAIT_SHARE`` of its rank's usual idle
span, until no rank on the host's board is busy (:mod:`trainguard.checkpoint.hostboard`).

It keeps the newest complete snapshot of every rank in memory and outlives the training processes
(its own session): a rank restarted on this machine after its process died restores from memory
without reading the disk (tier ``memory``). It ends when no rank has been connected for ``idle_s``
or its root directory is gone.

Nothing here imports torch; nothing is pickled. The rank talks to it over the Unix socket
``<root>/saver.sock`` (one JSON document per line); the ranks' buffers are ``/dev/shm`` files named
after the root, the rank and the slot.

    python -m trainguard.checkpoint.saver --root DIR [--idle-s 600] [--nice 10]
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import queue
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.checkpoint import layout
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.hostboard import HostBoard
from trainguard.checkpoint.saverproto import (
    INFO,
    LOCK,
    SHM_DIR,
    LineReader,
    ShmFile,
    alive,
    b64,
    files_sha,
    non_finite,
    send_doc,
    shm_prefix,
    socket_address,
    unb64,
)
from trainguard.checkpoint.verify import check_data

SLOTS = 2
QUIET_WAIT_S = 2.0  # the longest a snapshot waits for its rank's host to idle before it is persisted anyway
# once its rank idles, the share of the rank's usual idle span a snapshot waits for the host's other ranks to
# idle too (trainguard.checkpoint.hostboard); what is left of the span is the saver's
HOST_WAIT_SHARE = 0.5


# ---- the saver's view of one rank ----------------------------------------------------------------------
@dataclass
class _Slot:
    files: dict[str, ShmFile]
    state: str = "free"  # free | filling | queued (written, sent, uploaded: the rank must not touch it)
    step: int = -1
    manifest: bytes = b""  # set once the snapshot in it was written: a complete copy in memory
    segment: str = ""


@dataclass
class _Rank:
    rank: int
    job: str
    static: dict[str, Any] = field(default_factory=dict)
    layouts: dict[str, dict[str, Any]] = field(default_factory=dict)
    slots: list[_Slot] = field(default_factory=list)
    generation: int = 0
    queue: queue.Queue[tuple[int, dict[str, Any]] | None] = field(default_factory=queue.Queue)
    writer: threading.Thread | None = None
    notify: Callable[[dict[str, Any]], None] | None = None
    replica: socket.socket | None = None
    replica_reader: LineReader | None = None
    replica_broken: str = ""
    s3: Any = None
    s3_next: tuple[int, bytes, list[tuple[str, bytes]]] | None = None
    s3_wake: threading.Condition = field(default_factory=lambda: threading.Condition(threading.Lock()))
    s3_thread: threading.Thread | None = None
    s3_closing: bool = False
    s3_superseded: int = 0
    # the rank says when its host is about to idle (the device computes): persisting waits for that moment,
    # at most QUIET_WAIT_S, so the saver's copies and hashing do not compete with the host's busy phase
    quiet: threading.Condition = field(default_factory=threading.Condition)
    quiets: int = 0  # how many times the rank said so
    gated: bool = False
    quiet_at: float = 0.0  # when it last said so (monotonic)
    idle_s: float = 0.0  # how long the rank said its host usually idles then

    def newest(self) -> _Slot | None:
        """The slot holding the newest complete snapshot (written here, not being refilled)."""
        done = [s for s in self.slots if s.manifest and s.state != "filling"]
        return max(done, key=lambda s: s.step, default=None)


class Saver:
    """The server. :meth:`serve` runs until idle for ``idle_s`` or the root is gone."""

    def __init__(self, root: Path, *, host: str = "127.0.0.1", idle_s: float = 600.0, nice: int = 10) -> None:
        self.root = Path(root)
        self.host = host
        self.idle_s = idle_s
        self.nice = nice
        self.prefix = shm_prefix(self.root)
        self.ranks: dict[int, _Rank] = {}
        self.lock = threading.Lock()
        self.clients = 0
        self.last_client = time.monotonic()
        self.stopping = threading.Event()
        self.port = 0
        self.board: HostBoard | None = None  # the host's ranks' busy and idle moments (opened by serve)

    # ---- life ------------------------------------------------------------------------------------
    def serve(self) -> int:
        self.root.mkdir(parents=True, exist_ok=True)
        lock_fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return 0  # another saver serves this root
            raise
        _background_priority(self.nice)
        import numpy  # noqa: F401 - imported now, not while the first snapshot waits
        self.board = HostBoard.open()
        layout.clean_temporaries(self.root)  # half-written copies of a saver of this root that was killed
        for stale in SHM_DIR.glob(f"{self.prefix}-p*"):  # buffers of this root's savers that are gone
            pid = stale.name[len(self.prefix) + 2:].partition("-")[0]
            if not pid.isdigit() or not alive(int(pid)):
                with contextlib.suppress(OSError):
                    stale.unlink()
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        address = socket_address(self.root)
        if not address.startswith("\0"):
            with contextlib.suppress(OSError):
                Path(address).unlink()
        unix.bind(address)
        unix.listen(64)
        tcp = socket.create_server((self.host, 0), backlog=64)
        self.port = tcp.getsockname()[1]
        layout.write_json(self.root / INFO, {"pid": os.getpid(), "port": self.port, "started_ts": time.time()})
        for sock, session in ((unix, self._rank_session), (tcp, self._replica_session)):
            threading.Thread(target=self._accept, args=(sock, session), daemon=True).start()
        signal.signal(signal.SIGTERM, lambda *_: self.stopping.set())
        try:
            while not self.stopping.wait(1.0):
                with self.lock:
                    idle = self.clients == 0 and time.monotonic() - self.last_client > self.idle_s
                if idle or not self.root.is_dir():
                    break
        finally:
            if not address.startswith("\0"):
                with contextlib.suppress(OSError):
                    Path(address).unlink()
            unix.close()
            tcp.close()
            with self.lock:
                ranks = list(self.ranks.values())
            for r in ranks:
                r.queue.put(None)
                if r.writer is not None:
                    r.writer.join(timeout=30)
                self._free(r)
            os.close(lock_fd)
        return 0

    def _free(self, r: _Rank) -> None:
        for slot in r.slots:
            for f in slot.files.values():
                f.close(unlink=True)
        r.slots = []

    # ---- the ranks of this machine ----------------------------------------------------------------
    @staticmethod
    def _accept(sock: socket.socket, session: Callable[[socket.socket], None]) -> None:
        """Each connection to ``sock`` served by ``session`` on a thread of its own."""
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            threading.Thread(target=session, args=(conn,), daemon=True).start()

    def _rank_session(self, conn: socket.socket) -> None:
        with self.lock:
            self.clients += 1
        send_lock = threading.Lock()
        reader = LineReader(conn)
        r: _Rank | None = None

        def notify(doc: dict[str, Any]) -> None:
            with contextlib.suppress(OSError):
                send_doc(conn, doc, send_lock)

        try:
            while True:
                msg = reader.doc()
                if msg is None:
                    break
                op = msg.get("op")
                if op == "noop":
                    continue
                if op == "hello":
                    r = self._hello(int(msg["rank"]), str(msg["job"]))
                    r.notify = notify
                    newest = r.newest()
                    notify({"op": "hello", "host": self.host, "port": self.port, "pid": os.getpid(),
                            "memory": None if newest is None else {"step": newest.step, "segment": newest.segment,
                                                                   "layout": self._layout_key(newest)}})
                elif r is None:
                    notify({"op": "error", "message": f"{op} before hello"})
                elif op == "static":
                    self._static(r, msg)
                    notify({"op": "ready", "replica": not r.replica_broken, "why": r.replica_broken})
                elif op == "configure":
                    notify({"op": "configured", "slots": self._configure(r, msg)})
                elif op == "fill":
                    r.slots[int(msg["slot"])].state = "filling"
                elif op == "snapshot":
                    slot = r.slots[int(msg["slot"])]
                    slot.state, slot.step, slot.manifest = "queued", int(msg["step"]), b""
                    msg["after_quiets"] = r.quiets  # persisted once the host idles after this hand-over
                    r.queue.put((int(msg["slot"]), msg))
                elif op == "quiet":
                    with r.quiet:
                        r.gated = True
                        r.quiets += 1
                        r.quiet_at, r.idle_s = time.monotonic(), max(0.0, float(msg.get("idle_s") or 0.0))
                        r.quiet.notify_all()
                elif op == "now":  # the rank waits for a free buffer: its host idles, persist what is queued
                    with r.quiet:
                        r.quiets += 1
                        r.quiet_at, r.idle_s = time.monotonic(), 0.0  # and hold back for no other rank
                        r.quiet.notify_all()
                elif op == "fetch":
                    notify({"op": "fetched", **self._fetch(r, int(msg["step"]))})
                elif op == "forget":
                    for slot in r.slots:
                        if slot.step > int(msg["after"]):
                            slot.manifest = b""
                elif op == "close":
                    _ungate(r)
                    if msg.get("flush"):  # every queued snapshot written and sent first
                        r.queue.join()
                        self._close_replica(r)
                        self._stop_s3(r)
                    notify({"op": "closed", "cpu_s": time.process_time()})
                else:
                    notify({"op": "error", "message": f"unknown operation {op!r}"})
        except (OSError, ValueError, KeyError, IndexError, TypeError) as exc:
            print(f"checkpoint saver {self.root}: rank session ended: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
        finally:
            if r is not None and r.notify is notify:
                r.notify = None
                _ungate(r)  # nobody will say when: what is queued is persisted now
            conn.close()
            with self.lock:
                self.clients -= 1
                self.last_client = time.monotonic()

    def _hello(self, rank: int, job: str) -> _Rank:
        with self.lock:
            r = self.ranks.get(rank)
            if r is not None and r.job != job:  # this machine now runs another job: the old state goes
                r.queue.put(None)
                self._free(r)
                r = None
            if r is None:
                r = self.ranks[rank] = _Rank(rank=rank, job=job)
            fresh = r.writer is None or not r.writer.is_alive()
            if fresh:
                r.queue = queue.Queue()
                r.writer = threading.Thread(target=self._writer, args=(r,), name=f"writer-{rank}", daemon=True)
                r.writer.start()
        if not fresh:  # the rank's last process died with snapshots still queued: they are complete, persist them
            _ungate(r)
            r.queue.join()
        return r

    @staticmethod
    def _layout_key(slot: _Slot) -> str:
        with contextlib.suppress(mf.ManifestInvalid):
            return mf.topology_key(mf.parse(slot.manifest))
        return ""

    def _static(self, r: _Rank, msg: dict[str, Any]) -> None:
        """What every snapshot of the rank shares (job, topology, backup saver, token, tiers); opens the
        replica connection and the remote tier."""
        r.queue.join()
        r.static = dict(msg["static"])
        self._open_replica(r)
        self._stop_s3(r)
        s3_url = r.static.get("s3_url") or ""
        if s3_url:
            from trainguard.checkpoint.s3 import open_tier

            r.s3 = open_tier(s3_url, endpoint_url=r.static.get("s3_endpoint_url") or "",
                             timeout_s=float(r.static.get("s3_timeout_s") or 5.0))
            r.s3_closing = False
            r.s3_thread = threading.Thread(target=self._s3_loop, args=(r,), name=f"s3-{r.rank}", daemon=True)
            r.s3_thread.start()

    def _configure(self, r: _Rank, msg: dict[str, Any]) -> list[dict[str, str]]:
        """New buffers for the rank's layout (the slots holding older snapshots go)."""
        r.queue.join()
        old = r.slots
        r.layouts = {name: {"prefix": unb64(spec["prefix"]), "size": int(spec["size"]),
                            "entries": spec["entries"], "tensors": spec["tensors"]}
                     for name, spec in msg["layouts"].items()}
        r.generation += 1
        slots = []
        for i in range(SLOTS):
            files = {name: ShmFile(SHM_DIR / f"{self.prefix}-p{os.getpid()}-r{r.rank}-g{r.generation}-s{i}-{name}",
                                   spec["size"], create=True) for name, spec in r.layouts.items()}
            slots.append(_Slot(files))
        r.slots = slots
        for slot in old:
            for f in slot.files.values():
                f.close(unlink=True)
        return [{name: str(f.path) for name, f in slot.files.items()} for slot in slots]

    def _fetch(self, r: _Rank, step: int) -> dict[str, Any]:
        newest = r.newest()
        if newest is None or newest.step != step:
            return {"ok": False, "why": f"no complete snapshot of step {step} in memory"}
        return {"ok": True, "manifest": b64(newest.manifest),
                "files": [[name, str(f.path), b64(r.layouts[name]["prefix"]), f.size]
                          for name, f in newest.files.items()]}

    # ---- persisting ----------------------------------------------------------------------------------
    def _writer(self, r: _Rank) -> None:
        while True:
            item = r.queue.get()
            try:
                if item is None:
                    return
                index, msg = item
                after = int(msg.get("after_quiets", 0))
                with r.quiet:  # a writer that fell behind finds the moment passed already: it does not wait
                    r.quiet.wait_for(lambda after=after: not r.gated or r.quiets > after, timeout=QUIET_WAIT_S)
                    idled = r.gated and r.quiets > after
                    until = r.quiet_at + HOST_WAIT_SHARE * min(r.idle_s, QUIET_WAIT_S)
                if idled and self.board is not None and r.queue.empty():  # and the host's other ranks
                    try:  # an aid, never a reason to stop persisting
                        self.board.wait_idle(until, give_up=lambda: not r.queue.empty() or not r.gated)
                    except Exception as exc:
                        self.board = None
                        print(f"checkpoint saver {self.root}: the host's board failed ({type(exc).__name__}: {exc}); "
                              f"persisting at this machine's ranks' idle moments alone", file=sys.stderr, flush=True)
                slot = r.slots[index]
                out = {"op": "done", "slot": index, "step": slot.step, "local": False, "replica": False}
                try:
                    out.update(self._persist(r, slot, msg))
                except Exception as exc:  # report and go on with the next snapshot
                    out["error"] = f"step {slot.step}: snapshot failed: {type(exc).__name__}: {exc}"
                slot.state = "free"
                out["cpu_s"] = time.process_time()
                if r.notify is not None:
                    r.notify(out)
            finally:
                r.queue.task_done()

    def _persist(self, r: _Rank, slot: _Slot, msg: dict[str, Any]) -> dict[str, Any]:
        st = r.static
        step, rank = slot.step, r.rank
        names = list(r.layouts)
        for name in names:
            bad = non_finite(slot.files[name].view(), r.layouts[name]["entries"])
            if bad:
                return {"error": f"step {step}: snapshot not kept: {bad} ({name})"}
        files = [(name, [r.layouts[name]["prefix"], slot.files[name].view()]) for name in names]
        sums = files_sha(files)
        manifest = mf.seal(mf.build(
            step=step, rank=rank, world_size=int(st["world_size"]), topology=st["topology"], coords=st["coords"],
            machine=st["machine"], job=r.job, incarnation=int(st["incarnation"]),
            created_ts=float(msg.get("created_ts") or time.time()), data_position=msg.get("data_position") or {},
            state=msg.get("meta") or {},
            files=[{"name": name, "size": size, "sha256": sha, "tensors": r.layouts[name]["tensors"]}
                   for name, (size, sha) in zip(names, sums, strict=True)]))
        out: dict[str, Any] = {}
        dest = layout.copy_dir(self.root, "local", step, rank)
        try:
            layout.write_copy(dest, manifest, files, fsync=bool(st.get("fsync", True)))
            out["local"] = True
        except OSError as exc:
            out["local"] = False
            out["error"] = (f"step {step} tier local: write to {dest} failed ({exc.strerror or exc}); this step "
                            f"has no local copy")
        slot.manifest, slot.segment = manifest, str((msg.get("meta") or {}).get("segment", ""))
        if r.s3 is not None and msg.get("s3"):
            self._queue_s3(r, step, manifest, files)
        out["replica"], why = self._send_replica(r, step, manifest, files)
        if why and "error" not in out:
            out["error"] = why
        return out

    # ---- the replica: to the saver of the backup rank -----------------------------------------------
    def _open_replica(self, r: _Rank) -> None:
        self._close_replica(r)
        backup = r.static.get("backup")
        r.replica_broken = ""
        if not backup:
            return
        host, port = backup["address"]
        try:
            r.replica = socket.create_connection((host, int(port)), timeout=float(r.static.get("replica_timeout_s",
                                                                                                  600.0)))
            r.replica_reader = LineReader(r.replica)
        except OSError as exc:
            r.replica_broken = f"connecting to rank {backup['rank']}'s saver at {host}:{port} failed ({exc})"

    def _close_replica(self, r: _Rank) -> None:
        if r.replica is not None:
            with contextlib.suppress(OSError):
                r.replica.close()
        r.replica, r.replica_reader = None, None

    def _send_replica(self, r: _Rank, step: int, manifest: bytes,
                      files: list[tuple[str, list[Any]]]) -> tuple[bool, str]:
        backup = r.static.get("backup")
        if not backup:
            return True, ""  # no replica wanted (one machine)
        if r.replica is None or r.replica_reader is None:
            return False, (f"step {step} tier replica: {r.replica_broken or 'no connection to the backup saver'}; "
                           f"this step is not committed")
        header = {"op": "replica", "token": r.static.get("token", ""), "owner": r.rank, "holder": backup["rank"],
                  "step": step, "manifest": len(manifest),
                  "files": [[name, sum(len(p) for p in parts)] for name, parts in files]}
        try:
            send_doc(r.replica, header)
            r.replica.sendall(manifest)
            for _name, parts in files:
                for p in parts:
                    r.replica.sendall(p)
            ack = r.replica_reader.doc()
        except (OSError, ValueError) as exc:
            r.replica_broken = f"sending to rank {backup['rank']} failed ({type(exc).__name__}: {exc})"
            self._close_replica(r)
            return False, f"step {step} tier replica: {r.replica_broken}; replication stops"
        if not ack or ack.get("step") != step or not ack.get("ok"):
            return False, (f"step {step} tier replica: rank {backup['rank']} refused the replica "
                           f"({(ack or {}).get('why', 'no answer')})")
        return True, ""

    def _replica_session(self, conn: socket.socket) -> None:
        reader = LineReader(conn)
        try:
            while True:
                head = reader.doc()
                if head is None:
                    return
                owner, holder, step = int(head["owner"]), int(head["holder"]), int(head["step"])
                manifest = bytes(reader.exactly(int(head["manifest"])))
                data = {str(name): reader.exactly(int(size)) for name, size in head["files"]}
                expected = self._token_of(holder)
                if expected is None or head.get("token") != expected:
                    send_doc(conn, {"step": step, "ok": False, "why": f"rank {holder} is not served here "
                                                                      f"for this job"})
                    continue
                dest = layout.copy_dir(self.root, "replica", step, owner)
                check = check_data(manifest, data, machine=str(self.root), rank=owner, step=step, tier="replica",
                                   path=str(dest), deep=False)
                why = "; ".join(p.what for p in check.problems)
                if check.ok:
                    try:
                        layout.write_copy(dest, manifest, [(n, [d]) for n, d in data.items()],
                                          extra={layout.REPLICA_INFO: json.dumps(
                                              {"holder": holder, "owner": owner}, sort_keys=True).encode()},
                                          fsync=self._fsync_of(holder))
                    except OSError as exc:
                        why = f"write to {dest} failed ({exc.strerror or exc})"
                send_doc(conn, {"step": step, "ok": not why, "why": why})
        except (OSError, ValueError, KeyError, TypeError, ConnectionError):
            return
        finally:
            conn.close()

    def _token_of(self, holder: int) -> str | None:
        with self.lock:
            r = self.ranks.get(holder)
        return None if r is None or not r.static else str(r.static.get("token", ""))

    def _fsync_of(self, holder: int) -> bool:
        with self.lock:
            r = self.ranks.get(holder)
        return bool(r.static.get("fsync", True)) if r is not None else True

    # ---- the remote tier: the newest due snapshot wins ---------------------------------------------
    def _queue_s3(self, r: _Rank, step: int, manifest: bytes, files: list[tuple[str, list[Any]]]) -> None:
        body = [(name, b"".join(bytes(p) for p in parts)) for name, parts in files]
        with r.s3_wake:
            if r.s3_next is not None:
                r.s3_superseded += 1
            r.s3_next = (step, manifest, body)
            r.s3_wake.notify_all()

    def _s3_loop(self, r: _Rank) -> None:
        from trainguard.checkpoint.errors import S3TierError

        uploaded: list[int] = []
        while True:
            with r.s3_wake:
                while r.s3_next is None and not r.s3_closing:
                    r.s3_wake.wait()
                item, r.s3_next = r.s3_next, None
                r.s3_wake.notify_all()
            if item is None:
                return
            step, manifest, body = item
            try:
                r.s3.upload_copy(step, r.rank, body, manifest)
                uploaded.append(step)
                keep = int(r.static.get("s3_keep") or 3)
                while len(uploaded) > keep:
                    old = uploaded[0]
                    if not any(r.s3.is_verified(s, r.rank) for s in uploaded[1:]) and r.s3.is_verified(old, r.rank):
                        break  # the newest verified copy stays
                    r.s3.delete_copy(old, r.rank)
                    uploaded.pop(0)
                if r.notify is not None:
                    r.notify({"op": "uploaded", "step": step})
            except S3TierError as exc:
                if r.notify is not None:
                    r.notify({"op": "error", "message": f"step {step} tier s3: {exc}"})

    def _stop_s3(self, r: _Rank) -> None:
        if r.s3_thread is None:
            return
        with r.s3_wake:
            r.s3_closing = True
            r.s3_wake.notify_all()
        r.s3_thread.join(timeout=120)
        r.s3_thread, r.s3, r.s3_next = None, None, None


def _ungate(r: _Rank) -> None:
    with r.quiet:
        r.gated = False
        r.quiet.notify_all()


def _background_priority(nice: int) -> None:
    """``nice`` steps below the training, for this thread and the threads it starts. (Linux's SCHED_IDLE was
    tried: on a host whose CPUs the training keeps busy the savers then fell so far behind that ranks
    skipped different steps and the newest step every rank held was five steps old.)"""
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, type=Path, help="the machine's checkpoint root")
    ap.add_argument("--host", default="127.0.0.1", help="the address other machines' savers reach this one at")
    ap.add_argument("--idle-s", type=float, default=600.0, help="end after this long with no rank connected")
    ap.add_argument("--nice", type=int, default=10, help="CPU priority below the training's (0..19)")
    args = ap.parse_args(argv)
    return Saver(args.root, host=args.host, idle_s=args.idle_s, nice=args.nice).serve()


if __name__ == "__main__":
    sys.exit(main())
