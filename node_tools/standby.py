"""Warm standby: a parked machine whose Python processes have already done the slow part.

A cold start of a job on a machine costs an interpreter start and ``import torch``
for the torchrun agent and for every rank (seconds each; on a 2-core machine
the imports of 3 processes take longer than the first training step). A
parked standby keeps ``nproc + 1`` *warm interpreters*: processes that have
imported torch, torch.distributed and the job's own modules and then wait on a
unix socket. One interpreter imports; the others are forked copies of it (the
imports start no thread, so the copies are sound), each in a session of its own.

Activation runs the job exactly as ``tg-node job start`` does, with torchrun
and its static rendezvous, but nothing is imported again:

* the job's supervisor starts a thin client (stdlib only, milliseconds) that hands
  one warm interpreter the torchrun command line, its environment and its
  stdin/stdout/stderr (file descriptors passed over the socket);
* that interpreter runs torchrun in-process (``runpy`` of torch.distributed.run);
  torchrun starts its workers as thin clients too (this file is the training
  script it is given), each handing its environment (RANK, LOCAL_RANK,
  MASTER_ADDR ... as torchrun set them) and its log files to another warm
  interpreter, which runs the real training script with ``runpy``.

A client stays until its interpreter ends and mirrors how it ended: the same
exit code, or death by the same signal; a signal to the client (torchrun's
SIGTERM to its workers) is passed on. So torchrun, the supervisor, the agent's
checks, stacks and fault injection see what they see in a cold start, except that
a rank's pid is its warm interpreter's.

Layout: ``<workdir>/standby/`` holds ``standby.json`` (state, token, slots) and
one ``slot<N>.sock`` / ``slot<N>.ready`` / ``slot<N>.log`` per interpreter.
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

STATE_FILE = "standby.json"
# torch._dynamo: building any torch.optim optimizer imports it (about a CPU-second)
PRELOAD = ("torch", "torch.distributed", "torch.distributed.run", "torch.optim", "torch._dynamo", "numpy")
MAX_MSG = 1 << 20


def standby_dir(workdir: Path) -> Path:
    return Path(workdir) / "standby"


# ---------------------------------------------------------------------------------------
# Wire format: a 4-byte length, then JSON; file descriptors ride along with the first message.
# ---------------------------------------------------------------------------------------
def _send(sock: socket.socket, doc: dict[str, Any], fds: list[int] | None = None) -> None:
    body = json.dumps(doc).encode()
    data = struct.pack("!I", len(body)) + body
    if fds:
        sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))])
    else:
        sock.sendall(data)


def _recv(sock: socket.socket, *, with_fds: int = 0) -> tuple[dict[str, Any] | None, list[int]]:
    fds: list[int] = []
    if with_fds:
        msg, fds, _flags, _addr = socket.recv_fds(sock, 4, with_fds)
        head = msg
    else:
        head = sock.recv(4)
    while head and len(head) < 4:
        more = sock.recv(4 - len(head))
        if not more:
            break
        head += more
    if len(head) < 4:
        return None, fds
    (size,) = struct.unpack("!I", head)
    if size > MAX_MSG:
        raise ValueError(f"message of {size} bytes is too large")
    body = b""
    while len(body) < size:
        chunk = sock.recv(size - len(body))
        if not chunk:
            return None, fds
        body += chunk
    return json.loads(body), fds


# ---------------------------------------------------------------------------------------
# The warm interpreter
# ---------------------------------------------------------------------------------------
# the job's own modules a parked interpreter imported from its working directory: name -> (file, mtime_ns), and the
# directory; a job run on it from another directory, or after the file changed, imports its own afresh
_LOCAL: dict[str, tuple[str, int]] = {}
_LOCAL_DIR: list[str] = []


def _preload(extra: list[str]) -> list[str]:
    import importlib

    loaded = []
    here = os.path.realpath(os.getcwd())
    for name in (*PRELOAD, *extra):
        with contextlib.suppress(Exception):
            module = importlib.import_module(name)
            loaded.append(name)
            path = os.path.realpath(getattr(module, "__file__", None) or "")
            if path and path.startswith(here + os.sep):
                _LOCAL[name] = (path, os.stat(path).st_mtime_ns)
    _LOCAL_DIR[:] = [here]
    return loaded


def _forget_stale_local_modules(cwd: str) -> list[str]:
    """Before a job runs on this interpreter: the modules it imported from the parked program's directory are
    dropped (``sys.modules``) when the job runs from another directory (its own ``model.py`` must not be the
    other program's) or when their file changed since (the code was updated); the job imports them afresh."""
    moved = os.path.realpath(cwd) != (_LOCAL_DIR or [""])[0]
    stale = set()
    for name, (path, mtime) in _LOCAL.items():
        try:
            changed = os.stat(path).st_mtime_ns != mtime
        except OSError:
            changed = True
        if moved or changed:
            stale.add(name.split(".")[0])
    dropped = [m for m in list(sys.modules) if m.split(".")[0] in stale]
    for m in dropped:
        del sys.modules[m]
    return dropped


def program_imports(workdir: str | Path, entry: str, *, module: bool = False) -> tuple[list[str], list[str]]:
    """The modules a job's program imports at its top level (its entry's own ``import`` statements, also inside a
    top-level ``try`` or ``if``; read with ``ast``, never executed): ``(third-party, local)``, local ones being the
    modules of its working directory. What a parked interpreter loads ahead of the job, so that a restart on it
    pays neither ``import torch`` nor the job's own heavy imports (Lightning, transformers). ``entry``: the script
    (relative to ``workdir``), or with ``module`` the module's dotted name. Empty lists for an entry that cannot
    be read or parsed."""
    import ast

    base = Path(workdir)
    if module:
        parts = entry.split(".")
        candidates = [base.joinpath(*parts).with_suffix(".py"), base.joinpath(*parts, "__init__.py"),
                      base.joinpath(*parts, "__main__.py")]
        path = next((c for c in candidates if c.is_file()), None)
    else:
        path = base / entry
    try:
        tree = ast.parse(Path(path).read_text(encoding="utf-8")) if path is not None else None
    except (OSError, SyntaxError, ValueError):
        tree = None
    if tree is None:
        return [], []
    names: list[str] = []

    def visit(body: list[ast.stmt]) -> None:
        for node in body:
            if isinstance(node, ast.Import):
                names.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.append(node.module)
            elif isinstance(node, ast.Try):
                for part in (node.body, *(h.body for h in node.handlers), node.orelse, node.finalbody):
                    visit(part)
            elif isinstance(node, ast.If) and not _is_main_guard(node):
                visit(node.body)
                visit(node.orelse)

    visit(tree.body)
    third, local = [], []
    for name in dict.fromkeys(n for n in names if n != "__future__"):
        top = name.split(".")[0]
        mine = (base / f"{top}.py").is_file() or (base / top / "__init__.py").is_file()
        (local if mine else third).append(name)
    return third, local


def _is_main_guard(node: Any) -> bool:
    """``if __name__ == "__main__":``: what runs the program, not what it imports to be ready."""
    import ast

    test = node.test
    return (isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__"
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators))


AUTOGROUP = Path("/proc/self/autogroup")
BACKGROUND_NICE = 19


def autogroup_nice(path: Path = AUTOGROUP) -> int | None:
    """The nice value of this process's scheduler autogroup, or None where it has none to set: a kernel
    without autogroups, or a process of the root autogroup (init's session and whatever never started a
    session of its own since: the file reads empty there)."""
    try:
        fields = path.read_text().split()
    except OSError:
        return None
    return int(fields[-1]) if len(fields) >= 3 and fields[-2] == "nice" and fields[-1].lstrip("-").isdigit() else None


@contextlib.contextmanager
def _yielding() -> Iterator[None]:
    """Run the block at the lowest CPU priority of this session's autogroup, then back to the default.

    Linux shares CPU between sessions before it shares it between a session's processes
    (``sched_autogroup_enabled``): an interpreter warming up in a session of its own weighs as much as all
    the ranks of a machine together, whatever its own nice value, and on a busy host it slows the job it
    stands beside. An autogroup's nice may be raised to 19 and set back to 0 without privileges. Only a
    session leader does it (its autogroup is its own), and only where it has an autogroup."""
    mine = os.getsid(0) == os.getpid() and autogroup_nice() is not None
    if mine:
        with contextlib.suppress(OSError):
            AUTOGROUP.write_text(str(BACKGROUND_NICE))
    try:
        yield
    finally:
        if mine:
            with contextlib.suppress(OSError):
                AUTOGROUP.write_text("0")


def serve(slot_dir: Path, slots: list[int], preload: list[str]) -> int:
    """Import once, then be the warm interpreter of every slot in ``slots``: one forked copy per slot
    but the last, which this process serves itself. Each waits for one piece of work on its
    ``slot<N>.sock``, runs it and exits as it did.

    The copies are forked after the imports (which start no thread: fork-safe), so a machine pays one
    ``import torch`` for all its interpreters instead of one each; each copy leads a session of its own,
    as a separately started interpreter would, so ending one's process group spares the others."""
    from trainguard.core import procs

    procs.nice_from_env()  # warming up is the job's work: it yields as the job does
    started = time.monotonic()
    with _yielding():  # beside a running job, the imports must not slow its ranks
        loaded = _preload(preload)
    warm_s = time.monotonic() - started
    for slot in slots[:-1]:
        if os.fork() == 0:
            os.setsid()
            return _serve_slot(slot_dir, slot, loaded, warm_s)  # the copy's own exit: os._exit there
    return _serve_slot(slot_dir, slots[-1], loaded, warm_s)


def _serve_slot(slot_dir: Path, slot: int, loaded: list[str], warm_s: float) -> int:
    sock_path = slot_dir / f"slot{slot}.sock"
    sock_path.unlink(missing_ok=True)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(sock_path))
    server.listen(1)
    from trainguard.core import procs

    me = {"pid": os.getpid(), "started": procs.started(os.getpid())}  # the pid and its start: one process for good
    ready = slot_dir / f"slot{slot}.ready"
    ready.write_text(json.dumps({**me, "warm_s": warm_s, "preloaded": loaded}))
    conn, _ = server.accept()
    server.close()
    sock_path.unlink(missing_ok=True)
    ready.unlink(missing_ok=True)
    work, fds = _recv(conn, with_fds=3)
    if work is None or len(fds) != 3:
        return 2
    for target, fd in zip((0, 1, 2), fds, strict=True):
        os.dup2(fd, target)
        os.close(fd)
    _send(conn, me)
    code = _run_work(work)
    with contextlib.suppress(OSError):
        _send(conn, {"exit": code})
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _run_work(work: dict[str, Any]) -> int:
    import runpy
    import traceback

    from trainguard.core import procs

    os.environ.clear()
    os.environ.update(work["env"])
    procs.nice_from_env()
    _forget_stale_local_modules(work["cwd"])
    with contextlib.suppress(OSError):
        os.chdir(work["cwd"])
    # a fresh stdout/stderr on the received descriptors (line buffered, as python -u would)
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115 - the process's stdout from now on
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [work["target"], *work["argv"]]
    try:
        if work["kind"] == "module":
            import importlib

            if work["cwd"] not in sys.path:  # as python -m from the job's directory would find its package
                sys.path.insert(0, work["cwd"])
            module = importlib.import_module(work["target"])
            if callable(getattr(module, "main", None)):
                module.main()  # preloaded: run its entry point instead of executing it a second time
            else:
                runpy.run_module(work["target"], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, str(Path(work["target"]).resolve().parent))
            runpy.run_path(work["target"], run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


# ---------------------------------------------------------------------------------------
# The thin client
# ---------------------------------------------------------------------------------------
def _claim_slot(slot_dir: Path, token: str) -> tuple[socket.socket, Path]:
    """Connect to a free warm interpreter of this standby (the socket disappears once claimed)."""
    for ready in sorted(slot_dir.glob("slot*.ready")):
        sock_path = ready.with_suffix(".sock")
        claim = ready.with_suffix(".claim")
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY)  # one client per slot
        except FileExistsError:
            continue
        os.write(fd, f"{os.getpid()} {token}".encode())
        os.close(fd)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(sock_path))
            return sock, claim
        except OSError:
            sock.close()
            continue
    raise RuntimeError(f"no free warm interpreter left in {slot_dir}")


def client(slot_dir: Path, kind: str, target: str, argv: list[str]) -> int:
    """Hand ``target argv`` with this process's environment and stdio to a warm interpreter; end as it ends."""
    token = os.environ.get("TG_STANDBY_TOKEN", "")
    sock, claim = _claim_slot(slot_dir, token)
    work = {"kind": kind, "target": target, "argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}
    _send(sock, work, fds=[0, 1, 2])
    hello, _ = _recv(sock)
    if not hello:
        return 2
    pid = int(hello["pid"])
    # record which interpreter serves which job, so the job's processes can be found and stopped
    claim.write_text(json.dumps({"client_pid": os.getpid(), "pid": pid, "started": hello.get("started"),
                                 "job_token": os.environ.get("TG_JOB_TOKEN", ""), "kind": kind, "target": target}))

    def forward(signum: int, _frame: Any) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, forward)
    try:
        done, _ = _recv(sock)
    except OSError:
        done = None
    if done and "exit" in done:
        return int(done["exit"])
    # the interpreter died without saying how (killed): die the same way, so torchrun sees a signal death
    os.kill(os.getpid(), signal.SIGKILL)
    return 137  # not reached


# ---------------------------------------------------------------------------------------
# park / activate / status on a machine
# ---------------------------------------------------------------------------------------
def read_state(workdir: Path) -> dict[str, Any] | None:
    try:
        return json.loads((standby_dir(workdir) / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None


def _write_state(workdir: Path, state: dict[str, Any]) -> None:
    from trainguard.node_tools.monitor import write_json_atomic

    write_json_atomic(standby_dir(workdir) / STATE_FILE, state)


def _alive(doc: dict[str, Any]) -> bool:
    """The interpreter a ready or claim file names is alive: its pid runs and, where the file says when it started,
    it is still that process (pids are reused: a dead interpreter's file left behind must not name the process
    that got its pid, another job's rank, as this job's, or to stop)."""
    from trainguard.core import procs

    try:
        state = procs.proc_state(int(doc.get("pid", 0)), doc.get("started"))
    except (TypeError, ValueError):
        return False
    return state is not None and state not in ("Z", "X")


def claimed_pids(slot_dir: Path, job_token: str) -> list[int]:
    """Warm interpreters serving the job with ``job_token`` (its torchrun agent and ranks), alive."""
    return sorted(int(doc["pid"]) for _path, doc in _claims(Path(slot_dir))
                  if doc.get("job_token") == job_token and _alive(doc))


def drop_claims(slot_dir: Path, job_token: str | None = None) -> int:
    """Remove the files of the slots whose interpreter is gone (of the job with ``job_token`` only, when given: after
    its stop): no file of a job that ended names a process later. Returns how many slots were removed."""
    dropped = 0
    for claim, doc in _claims(Path(slot_dir)):
        if (job_token is None or doc.get("job_token") == job_token) and not _alive(doc):
            for suffix in (".sock", ".ready", ".claim"):
                claim.with_suffix(suffix).unlink(missing_ok=True)
            dropped += 1
    return dropped


def _claims(slot_dir: Path) -> list[tuple[Path, dict[str, Any]]]:
    """Every slot's claim file and what it says (an unreadable one says nothing)."""
    out = []
    for path in slot_dir.glob("slot*.claim"):
        try:
            out.append((path, json.loads(path.read_text())))
        except (OSError, ValueError):
            out.append((path, {}))
    return out


def free_slots(workdir: Path) -> list[dict[str, Any]]:
    """Warm interpreters that are alive and unclaimed."""

    out = []
    for ready in sorted(standby_dir(workdir).glob("slot*.ready")):
        try:
            info = json.loads(ready.read_text())
        except (OSError, ValueError):
            continue
        if _alive(info) and not ready.with_suffix(".claim").exists():
            out.append(info | {"slot": ready.stem})
    return out


DEMO_PRELOAD = ("examples.gpt3d.train", "trainguard.node_tools.monitor")  # the reference job's program


def park(cfg: Any, *, nproc: int, preload: list[str] | None = None, timeout_s: float = 180.0, workdir: str = "",
         entry: str = "", module: bool = False, also: tuple[str, ...] = ()) -> dict[str, Any]:
    """Start warm interpreters until ``nproc + 1`` are free (ranks + the torchrun agent). Idempotent.

    What they import ahead of the job: ``preload`` when given; else the program of the job they stand by
    (``entry`` in ``workdir``: its imports and its own modules, :func:`program_imports`, imported from that
    directory) and the third-party imports of the programs in ``also`` (script paths: other jobs a pool standby may
    join); with none of these, the reference job's program (the demo)."""
    from trainguard.core import procs
    from trainguard.core.errors import TrainguardError

    if nproc < 1:
        raise TrainguardError(f"standby park: --nproc {nproc} must be >= 1")
    d = standby_dir(cfg.workdir)
    d.mkdir(parents=True, exist_ok=True)
    state = read_state(cfg.workdir) or {}
    token = state.get("token") or uuid.uuid4().hex
    want = nproc + 1
    started = time.monotonic()
    have = free_slots(cfg.workdir)
    new_pids = []
    drop_claims(d)  # claims of interpreters that are gone (a running job's stay: they name its ranks)
    next_slot = 1 + max([int(p.stem[4:]) for p in d.glob("slot*.*") if p.stem[4:].isdigit()] or [-1])
    cwd = str(cfg.install_dir)
    if preload is not None:
        modules = list(preload)
    elif entry or also:
        modules = ["trainguard.node_tools.monitor"]
        if entry:
            third, local = program_imports(workdir or cfg.install_dir, entry, module=module)
            modules += [*third, *local]
            cwd = str(workdir or cfg.install_dir)
        for path in also:
            modules += program_imports(Path(path).parent, Path(path).name)[0]
        modules = list(dict.fromkeys(modules))
    else:
        modules = list(DEMO_PRELOAD)
    env = dict(os.environ, TG_STANDBY_TOKEN=token, PYTHONPATH=os.pathsep.join(
        filter(None, [str(cfg.install_dir), os.environ.get("PYTHONPATH", "")])), OMP_NUM_THREADS="1")
    if cfg.job_nice:
        env[procs.NICE_ENV] = str(cfg.job_nice)
    parked_for = state.get("program") or {"workdir": str(cfg.install_dir), "preload": list(DEMO_PRELOAD)}
    if have and (parked_for.get("workdir"), list(parked_for.get("preload") or [])) != (cwd, modules):
        # warmed for another program (a standby parked for the demo, or for the job it served before): those
        # interpreters would start this job with the other program's imports, so they make way
        procs.terminate([int(slot["pid"]) for slot in have], grace_s=3)
        for slot in have:
            for suffix in (".sock", ".ready"):
                (d / f"{slot['slot']}{suffix}").unlink(missing_ok=True)
        have = []
    new_slots = [next_slot + i for i in range(max(0, want - len(have)))]
    if new_slots:  # one interpreter imports, then forks one copy per slot
        with open(d / f"slot{new_slots[0]}.log", "ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard.node_tools.standby", "serve", "--dir", str(d),
                 "--slot", ",".join(map(str, new_slots)), "--preload", ",".join(modules)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                cwd=cwd, env=env,
            )
        new_pids.append(proc.pid)
    deadline = time.monotonic() + timeout_s
    while len(free_slots(cfg.workdir)) < want:
        if time.monotonic() > deadline:
            procs.terminate(new_pids, grace_s=2)
            raise TrainguardError(f"machine {cfg.machine}: standby interpreters not warm after {timeout_s:.0f}s; "
                                  f"see {d}/slot*.log")
        dead = [p for p in new_pids if not procs.alive(p)]
        if dead:
            procs.terminate(new_pids, grace_s=2)
            raise TrainguardError(f"machine {cfg.machine}: a standby interpreter exited while warming; "
                                  f"see {d}/slot*.log")
        time.sleep(0.2)  # warming takes seconds; polling faster only takes CPU from the job beside it
    slots = free_slots(cfg.workdir)
    state = {"state": "parked", "token": token, "nproc": nproc, "parked_ts": time.time(),
             "park_s": round(time.monotonic() - started, 3), "slots": slots,
             "program": {"workdir": cwd, "entry": entry, "preload": modules}}
    _write_state(cfg.workdir, state)
    return {"machine": cfg.machine, **state, "started": len(new_slots)}


def unpark(cfg: Any) -> dict[str, Any]:
    """End the free warm interpreters of this machine (a no-op when none is parked). Interpreters that
    serve a job (claimed: its torchrun agent and ranks) are the job's; they end with it."""
    from trainguard.core import procs

    state = read_state(cfg.workdir) or {}
    free = free_slots(cfg.workdir)
    ended = procs.terminate([int(slot["pid"]) for slot in free], grace_s=3) if free else []
    d = standby_dir(cfg.workdir)
    for slot in free:
        for suffix in (".sock", ".ready"):
            (d / f"{slot['slot']}{suffix}").unlink(missing_ok=True)
    drop_claims(d)  # claims of interpreters that are gone
    if state:
        _write_state(cfg.workdir, {"state": "empty", "token": state.get("token")})
    return {"machine": cfg.machine, "state": "empty", "ended_pids": ended}


def status(cfg: Any) -> dict[str, Any]:
    """``parked`` (enough free warm interpreters for its nproc), ``in_use`` (a job runs on them), or ``empty``."""
    state = read_state(cfg.workdir) or {}
    free = free_slots(cfg.workdir)
    nproc = state.get("nproc")

    busy = [doc for _path, doc in _claims(standby_dir(cfg.workdir)) if _alive(doc)]
    if nproc and len(free) >= nproc + 1:
        name = "parked"
    elif busy:
        name = "in_use"
    else:
        name = "empty"
    return {"machine": cfg.machine, "state": name, "nproc": nproc, "free_slots": len(free), "slots": free,
            "in_use": busy, "token": state.get("token")}


def client_entry() -> str:
    """The path of this module, as torchrun's entry point for warm workers (``--no-python``)."""
    return str(Path(__file__).resolve())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="trainguard.node_tools.standby")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sv = sub.add_parser("serve")
    sv.add_argument("--dir", type=Path, required=True)
    sv.add_argument("--slot", required=True, help="slot number(s), comma-separated: one interpreter each")
    sv.add_argument("--preload", default="")
    cl = sub.add_parser("client")
    cl.add_argument("--dir", type=Path, required=True)
    cl.add_argument("--module", action="store_true", help="target is a module (python -m)")
    cl.add_argument("target")
    cl.add_argument("argv", nargs=argparse.REMAINDER)
    ns = ap.parse_args(argv)
    if ns.cmd == "serve":
        return serve(ns.dir, [int(x) for x in ns.slot.split(",")], [m for m in ns.preload.split(",") if m])
    rest = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    return client(ns.dir, "module" if ns.module else "path", ns.target, rest)


if __name__ == "__main__":
    sys.exit(main())
