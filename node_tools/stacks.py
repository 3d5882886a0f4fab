"""Python stacks of every process of a job on this machine, through py-spy.

``stacks(cfg, job)`` finds the job's processes by their ``TG_JOB_TOKEN`` (the
supervisor, the torchrun agent and its workers), tells the ranks apart by the
pids in their heartbeats (``ranks/rank<R>.json``; a worker's ``RANK`` and
``LOCAL_RANK`` environment when it has not written one yet), and dumps them all
at once with ``py-spy dump --json``, each bounded by ``timeout_s``. The document
also carries each rank's collective counters and step from its heartbeat, so the
control plane can tell which ranks wait in which collective.

A process stopped with SIGSTOP (the "hang" fault, state ``T``): py-spy's default
mode attaches with ptrace to pause the threads, and on a stopped process that
fails at once ("Failed to suspend process: unexpected waitpid result
PtraceEvent(.., SIGSTOP, 128)") rather than blocking. A stopped process cannot
run, so reading its memory without pausing it (``--nonblocking``) gives a
consistent snapshot; stopped processes are dumped that way directly, and a
running process whose paused dump fails is tried once more without pausing.
py-spy refuses ``--native`` without pausing, so a stopped process's stacks are
Python-only even when native frames were asked for (said in ``note``). The
process stays stopped either way.

``stack_signature`` turns a thread's frames into a string that is equal for
equal stacks (function names and file base names, no line numbers), for grouping
thousands of ranks by where they are.
"""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from trainguard.core import procs
from trainguard.core.errors import EXIT_OK, EXIT_UNHEALTHY, TrainguardError
from trainguard.node_tools import job as jobmod
from trainguard.node_tools import monitor
from trainguard.node_tools.config import NodeConfig

STOPPED_STATES = ("T", "t")  # stopped by a signal, stopped by a tracer
_ADDRESS_RE = re.compile(r"0x[0-9a-fA-F]+")


def find_py_spy() -> str:
    """py-spy next to this interpreter (the virtual environment's bin/), else on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("py-spy")
    if found:
        return found
    raise TrainguardError(f"py-spy is not installed next to {sys.executable} nor on PATH; pip install py-spy")


def stack_signature(frames: list[dict[str, Any]], *, depth: int | None = None) -> str:
    """A comparable string for a thread's stack: ``func (file.py) < caller (file.py) < ...``.

    ``frames`` are innermost first (as py-spy gives them, raw or normalised by
    :func:`stacks`). Line numbers and directories are left out, so the same code
    path in different installs or at different lines of a loop compares equal;
    hexadecimal addresses (unsymbolised native frames) become ``0x?``. ``depth``
    keeps only the innermost ``depth`` frames.
    """
    chosen = frames if depth is None else frames[:max(depth, 0)]
    return " < ".join([_frame_part(str(frame.get("name") or "?"),
                                   str(frame.get("filename") or frame.get("short_filename") or ""))
                       for frame in chosen])


@functools.lru_cache(maxsize=1 << 16)
def _frame_part(name: str, filename: str) -> str:
    """One frame of :func:`stack_signature` from its function and file name (plain ``str``: equal arguments,
    equal part); remembered, since thousands of ranks share their frames."""
    text = _ADDRESS_RE.sub("0x?", name)
    base = filename.replace("\\", "/").rsplit("/", 1)[-1]
    return f"{text} ({_ADDRESS_RE.sub('0x?', base)})" if base else text


# ---------------------------------------------------------------------------------------
# Which processes, and what each one is
# ---------------------------------------------------------------------------------------
def _cmdline(pid: int) -> list[str]:
    return [part for part in procs.cmdline(pid) if part]


def _python_module(cmdline: list[str]) -> str | None:
    """The module of ``python [options] -m MODULE ...`` (the supervisor names torchrun's only after ``--``)."""
    i = 1
    while i < len(cmdline):
        part = cmdline[i]
        if part == "-m":
            return cmdline[i + 1] if i + 1 < len(cmdline) else None
        if part.startswith("-m"):
            return part[2:]
        if part in ("-c", "-") or not part.startswith("-"):
            return None  # a command, stdin, a script: not a module
        i += 2 if part in ("-X", "-W") else 1
    return None


def _heartbeats(rd: Path, incarnation: Any) -> dict[int, dict[str, Any]]:
    """rank -> the heartbeat of this incarnation (files of an older one are left out)."""
    beats: dict[int, dict[str, Any]] = {}
    for path in (rd / "ranks").glob("rank*.json"):
        suffix = path.name[4:-5]
        if not suffix.isdigit():
            continue
        hb = monitor.read_heartbeat(rd, int(suffix))
        if hb and (incarnation is None or hb.get("incarnation", incarnation) == incarnation):
            beats[int(suffix)] = hb
    return dict(sorted(beats.items()))


def _identify(pid: int, by_pid: dict[int, dict[str, Any]]) -> dict[str, Any]:
    cmdline = _cmdline(pid)
    hb = by_pid.get(pid)
    if hb is not None:
        return {"role": "rank", "rank": hb.get("rank"), "local_rank": hb.get("local_rank"), "cmdline": cmdline,
                "by": "heartbeat"}
    module = _python_module(cmdline)
    if module == "torch.distributed.run" or any(Path(part).name == "torchrun" for part in cmdline[:2]):
        return {"role": "agent", "rank": None, "local_rank": None, "cmdline": cmdline}
    env = procs.environ(pid)
    if env.get("RANK", "").isdigit() and env.get("LOCAL_RANK", "").isdigit():
        # a worker that has not written its first heartbeat yet (or the thin client of a warm one: see stacks())
        return {"role": "rank", "rank": int(env["RANK"]), "local_rank": int(env["LOCAL_RANK"]), "cmdline": cmdline,
                "by": "environment"}
    return {"role": "other", "rank": None, "local_rank": None, "cmdline": cmdline}


# ---------------------------------------------------------------------------------------
# py-spy
# ---------------------------------------------------------------------------------------
def _normalise(raw: Any) -> list[dict[str, Any]]:
    threads = []
    for t in raw if isinstance(raw, list) else []:
        if not isinstance(t, dict):
            continue
        threads.append({
            "thread_id": t.get("thread_id"),
            "os_thread_id": t.get("os_thread_id"),
            "name": t.get("thread_name"),
            "active": bool(t.get("active")),
            "owns_gil": bool(t.get("owns_gil")),
            "frames": [
                {"name": f.get("name"), "filename": f.get("filename"), "line": f.get("line")}
                for f in t.get("frames") or [] if isinstance(f, dict)
            ],
        })
    return threads


def _error_line(stderr: str, returncode: int) -> str:
    """py-spy's error and its causes on one line, without the Rust backtrace."""
    keep = []
    for line in stderr.splitlines():
        text = line.strip()
        if text.startswith("Stack backtrace:"):
            break
        if text and text != "Caused by:":
            keep.append(text)
    return "; ".join(keep)[:500] or f"py-spy exited with code {returncode}"


def _py_spy(py_spy: str, pid: int, *, native: bool, nonblocking: bool, timeout_s: float
            ) -> tuple[list[dict[str, Any]] | None, str | None]:
    cmd = [py_spy, "dump", "--pid", str(pid), "--json"]
    if native:
        cmd.append("--native")
    if nonblocking:
        cmd.append("--nonblocking")
    if timeout_s <= 0:
        return None, "no time left for py-spy"
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, stdin=subprocess.DEVNULL,
                              check=False)
    except subprocess.TimeoutExpired:
        return None, f"py-spy did not answer within {timeout_s:.1f}s (killed)"
    except OSError as exc:
        return None, f"py-spy could not run: {exc}"
    if done.returncode != 0:
        return None, _error_line(done.stderr, done.returncode)
    try:
        return _normalise(json.loads(done.stdout)), None
    except ValueError:
        return None, f"py-spy printed no JSON: {done.stdout[:200]!r}"


def dump_process(py_spy: str, pid: int, *, native: bool = False, timeout_s: float = 10.0) -> dict[str, Any]:
    """The stacks of one process: ``{"pid", "process_state", "mode", "threads", "error", "note"}``."""
    deadline = time.monotonic() + timeout_s
    state = procs.proc_state(pid)
    out: dict[str, Any] = {"pid": pid, "process_state": state, "mode": None, "threads": [], "error": None,
                           "note": None}
    if state is None or state in ("Z", "X"):
        out["error"] = "process exited"
        return out
    stopped = state in STOPPED_STATES
    if stopped:
        # Frozen already: read its memory without pausing. --native needs the pause (ptrace), which
        # py-spy cannot take on a stopped process, so native frames are dropped.
        threads, error = _py_spy(py_spy, pid, native=False, nonblocking=True, timeout_s=timeout_s)
        out["mode"] = "nonblocking"
        if native:
            out["note"] = "process is stopped: Python frames only (py-spy takes native frames only by pausing it)"
    else:
        threads, error = _py_spy(py_spy, pid, native=native, nonblocking=False, timeout_s=timeout_s)
        out["mode"] = "paused"
        if error is not None and procs.alive(pid) and "did not answer" not in error:
            # e.g. stopped in between, or ptrace refused: try once without pausing it
            first = error
            threads, error = _py_spy(py_spy, pid, native=False, nonblocking=True,
                                     timeout_s=deadline - time.monotonic())
            out["mode"] = "nonblocking"
            out["note"] = f"paused dump failed ({first}); dumped without pausing, Python frames only"
    out["process_state"] = procs.proc_state(pid) or state
    if error is not None:
        out["error"] = error if procs.alive(pid) else f"process exited ({error})"
    out["threads"] = threads or []
    return out


def stacks(cfg: NodeConfig, job: str, *, native: bool = False, timeout_s: float = 10.0) -> tuple[int, dict]:
    """Dump every process of ``job`` on this machine. Exit 0 if all were dumped, 1 if some were not.

    Raises TrainguardError (exit 2) if the job is unknown or has no process here.
    """
    t0 = time.monotonic()
    rd = jobmod.run_dir(cfg, job)
    try:
        record = json.loads((rd / "job.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        record = None
    if not record:
        raise TrainguardError(f"machine {cfg.machine} has no job {job}")
    pids = jobmod.job_pids(record)
    if not pids:
        raise TrainguardError(f"job {job} is not running on machine {cfg.machine}")
    py_spy = find_py_spy()
    beats = _heartbeats(rd, record.get("incarnation"))
    by_pid = {int(hb["pid"]): hb for hb in beats.values() if isinstance(hb.get("pid"), int)}
    with ThreadPoolExecutor(max_workers=min(len(pids), 64)) as pool:
        dumps = list(pool.map(lambda p: dump_process(py_spy, p, native=native, timeout_s=timeout_s), pids))
    processes = []
    identified = [(dump, _identify(dump["pid"], by_pid)) for dump in dumps]
    # a rank that runs on a warm interpreter has a thin client with its RANK in its environment too: the process
    # its heartbeat names is the rank, the client only waits for it
    beating = {who["rank"] for _d, who in identified if who.get("by") == "heartbeat"}
    for dump, who in identified:
        if who.get("by") == "environment" and who["rank"] in beating:
            who = {**who, "role": "client"}
        processes.append({
            "pid": dump["pid"], "role": who["role"], "rank": who["rank"], "local_rank": who["local_rank"],
            "process_state": dump["process_state"], "cmdline": who["cmdline"], "mode": dump["mode"],
            "threads": dump["threads"], "error": dump["error"], "note": dump["note"],
        })
    order = {"rank": 0, "agent": 1, "client": 2, "other": 3}
    processes.sort(key=lambda p: (order[p["role"]], p["rank"] if p["rank"] is not None else -1, p["pid"]))
    document = {
        "job": job,
        "machine": cfg.machine,
        "incarnation": record.get("incarnation"),
        "duration_s": round(time.monotonic() - t0, 3),
        "processes": processes,
        # JSON object keys are strings; the Python document uses them too, so it reads the same either side
        "collectives": {str(r): hb.get("collectives", {}) for r, hb in beats.items()},
        "steps": {str(r): hb.get("step") for r, hb in beats.items()},
    }
    code = EXIT_OK if all(p["error"] is None for p in processes) else EXIT_UNHEALTHY
    return code, document
