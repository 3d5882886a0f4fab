"""A training rank's side of its machine's checkpoint saver (:mod:`trainguard.checkpoint.saver`): starting or
reaching it, the link its requests and reports go over, and stopping it."""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.checkpoint import layout
from trainguard.checkpoint.saverproto import INFO, LineReader, ShmFile, alive, send_doc, socket_address, unb64


# ---- the rank's side ---------------------------------------------------------------------------------
def connect(root: Path, *, host: str, idle_s: float, nice: int, timeout_s: float = 30.0) -> socket.socket:
    """A connection to the saver of ``root``, starting one (in a session of its own, so that it outlives
    the rank) when none answers. Ranks of one machine starting together start one saver between them."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    path = socket_address(root)

    def attempt() -> socket.socket | None:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.connect(path)
            return s
        except OSError:
            s.close()
            return None

    sock = attempt()
    if sock is not None:
        return sock
    # not one of the job's processes: the job's stop (which finds them by TG_JOB_TOKEN) leaves it running with
    # its memory snapshots for the restart, and it never counts as a rank still alive
    env = {k: v for k, v in os.environ.items() if k not in ("TG_JOB_TOKEN", "TG_FAULT_FILE")}
    log = open(root / "saver.log", "ab")  # noqa: SIM115 - handed to the child
    try:
        subprocess.Popen([sys.executable, "-m", "trainguard.checkpoint.saver", "--root", str(root), "--host", host,
                          "--idle-s", str(idle_s), "--nice", str(nice)],
                         stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True, env=env,
                         close_fds=True,
                         cwd=str(Path(__file__).resolve().parent.parent))
    finally:
        log.close()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:  # the saver that won the lock (this one or a sibling's) answers
        sock = attempt()
        if sock is not None:
            return sock
        time.sleep(0.02)
    raise OSError(f"the checkpoint saver of {root} did not answer within {timeout_s:.0f}s (see {root}/saver.log)")


class SaverLink:
    """A rank's connection to its machine's saver (see the module). Requests that need an answer
    (``hello``, ``static``, ``configure``, ``fetch``, ``close``) wait for it; the saver's reports
    (a snapshot done, an upload, an error) go to the callbacks on a reader thread."""

    def __init__(self, root: Path, *, rank: int, job: str, host: str = "127.0.0.1", idle_s: float = 600.0,
                 nice: int = 10,
                 on_done: Callable[[dict[str, Any]], None] = lambda doc: None,
                 on_error: Callable[[str], None] = lambda line: None,
                 on_configured: Callable[[dict[str, Any]], None] = lambda doc: None, timeout_s: float = 120.0) -> None:
        self.root = Path(root)
        self.timeout_s = timeout_s
        self.on_done = on_done
        self.on_error = on_error
        self.on_configured = on_configured
        self.sock = connect(self.root, host=host, idle_s=idle_s, nice=nice)
        self._send_lock = threading.Lock()
        self._replies: queue.Queue[dict[str, Any] | None] = queue.Queue()
        self.saver_cpu_s = 0.0
        self.uploaded: list[int] = []
        self._closing = False
        self.lost = threading.Event()  # the saver closed the connection (it died): nothing more is persisted
        self._posts: queue.SimpleQueue[Callable[[], dict[str, Any]] | None] = queue.SimpleQueue()
        self._reader = threading.Thread(target=self._read, name="tg-ckpt-saver-link", daemon=True)
        self._reader.start()
        self._poster = threading.Thread(target=self._post_loop, name="tg-ckpt-saver-post", daemon=True)
        self._poster.start()
        hello = self.request({"op": "hello", "rank": rank, "job": job}, "hello")
        self.host = str(hello["host"])
        self.port = int(hello["port"])
        self.pid = int(hello["pid"])
        self.memory: dict[str, Any] | None = hello.get("memory")

    def _read(self) -> None:
        reader = LineReader(self.sock)
        try:
            while True:
                doc = reader.doc()
                if doc is None:
                    break
                op = doc.get("op")
                if "cpu_s" in doc:
                    self.saver_cpu_s = float(doc["cpu_s"])
                if op == "done":
                    self.on_done(doc)
                elif op == "configured":  # asked for without waiting (the training thread never waits)
                    self.on_configured(doc)
                elif op == "uploaded":
                    self.uploaded.append(int(doc["step"]))
                elif op == "error":
                    self.on_error(str(doc.get("message", "")))
                else:
                    self._replies.put(doc)
        except (OSError, ValueError):
            pass
        self._replies.put(None)  # the saver is gone: a waiting request fails at once
        self.lost.set()
        if not self._closing:
            self.on_error(f"the checkpoint saver of {self.root} closed the connection; snapshots stop")

    def send(self, doc: dict[str, Any]) -> None:
        send_doc(self.sock, doc, self._send_lock)

    def post(self, make: Callable[[], dict[str, Any]]) -> None:
        """Send ``make()`` from the link's own thread (the training thread only queues it)."""
        self._posts.put(make)

    def _post_loop(self) -> None:
        while True:
            make = self._posts.get()
            if make is None:
                return
            try:
                self.send(make())
            except OSError as exc:
                if not self._closing:
                    self.on_error(f"the checkpoint saver of {self.root} is gone ({exc}); snapshots stop")
                return
            except Exception as exc:  # a state that cannot be described: the saver never gets this snapshot
                self.on_error(f"a snapshot could not be handed to the saver ({type(exc).__name__}: {exc})")

    def request(self, doc: dict[str, Any], answer: str) -> dict[str, Any]:
        self._drain_posts()
        self.send(doc)
        try:
            reply = self._replies.get(timeout=self.timeout_s)
        except queue.Empty:
            raise OSError(f"the checkpoint saver of {self.root} did not answer {doc['op']} in "
                          f"{self.timeout_s:.0f}s") from None
        if reply is None or reply.get("op") != answer:
            raise OSError(f"the checkpoint saver of {self.root} answered {doc['op']} with {reply!r}")
        return reply

    def fetch(self, step: int) -> tuple[bytes, dict[str, bytes]] | None:
        """The manifest and file bytes of the rank's snapshot of ``step`` held in memory, or None."""
        reply = self.request({"op": "fetch", "step": step}, "fetched")
        if not reply.get("ok"):
            return None
        files = {}
        for name, path, prefix, size in reply["files"]:
            shm = ShmFile(Path(path), int(size), create=False)
            try:
                files[name] = unb64(prefix) + bytes(shm.view())
            finally:
                shm.close()
        return unb64(reply["manifest"]), files

    def _drain_posts(self) -> None:
        """Everything posted so far is sent (a request comes after the snapshots handed over before it)."""
        done = threading.Event()
        self._posts.put(lambda: (done.set(), {"op": "noop"})[1])
        done.wait(self.timeout_s)

    def close(self, *, flush: bool) -> None:
        try:
            if flush:  # what was posted goes first, then the saver writes and sends all of it
                self.request({"op": "close", "flush": True}, "closed")
            else:
                self._drain_posts()
                self.send({"op": "close", "flush": False})
        finally:
            self._closing = True
            self._posts.put(None)
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_RDWR)
            self.sock.close()


def stop(root: Path, *, timeout_s: float = 10.0) -> bool:
    """End the saver of ``root`` (its memory snapshots go); True if one was running."""
    info = layout.read_json(Path(root) / INFO) or {}
    pid = info.get("pid")
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return False
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not alive(pid):
            return True
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    return True
