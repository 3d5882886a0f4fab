"""Stop-time diagnostics of a machine: levels 1-3, and the bit-wise alignment test.

The real-time checks (``trainguard.node_tools.checks``) watch a machine while a job runs and
put no load on it. When a job has stopped, the control plane can afford to load a
suspect machine and ask whether it is fit to go back into service::

    diag(cfg, 1)   quick health, seconds: the real-time checks once (rank findings
                   ignored: a stopped job is not the machine's fault), the GPU
                   snapshot against the expected GPU count, ``import torch``, a tiny
                   write/read in the work directory.
    diag(cfg, 2)   level 1, plus: a verified compute burn (float32 matmuls on every
                   device checked against a float64 reference, so wrong arithmetic is
                   caught, not only crashes), memory bandwidth, a local collective
                   with exact checks (NCCL across the GPUs, one process per GPU;
                   without GPUs gloo between 2 ranks that are threads of the test
                   process), and a disk write/fsync/read/verify.
    diag(cfg, 3, l3=L3Spec(...))
                   a collective with neighbour machines: every machine runs its rank
                   at the same time; all_reduce, all_gather and all_to_all of seeded
                   tensors are checked exactly and timed. Level 3 runs only that test
                   (the machines must start it together; run level 2 first).
    align(cfg)     a fixed tiny model, one deterministic training step; reports a
                   digest of its outputs, gradients and weights. Healthy machines of
                   the same kind (``compare_key``) agree bit for bit; the control plane
                   compares the digests.

Each returns ``(exit_code, report)``: 0 healthy, 1 unhealthy (each failing test has
a reason), 2 could not run (for level 3: the peers never came). The report is one
JSON-able document ``{"machine", "level", "healthy", "tests": [{"name", "ok",
"status", "duration_s", "details", "reason"}], "reasons", "duration_s", ...}``.

The tests run in worker processes (``python -m trainguard.node_tools.diag --worker ARGS``),
each in a session of its own; the quick tests, the compute, memory and disk tests
share one worker (torch is imported once), and so does the local collective of a
machine without GPUs (its ranks are threads); each NCCL or level-3 rank has its own. This
process follows every test and kills its worker, with all its children, when the
test passes its timeout, so a test that hangs (a GPU that stops answering, a peer
that never comes, a disk that blocks) fails instead of hanging the diagnostic; the
tests after it go on in a fresh worker. A worker also arms a kernel timer that
ends it should this process die first, and every process a run starts carries
``TG_DIAG_RUN=<run id>`` in its environment, so whatever escaped its session is
found and ended when the run finishes. ``timeout_s`` bounds each test (default:
30 s at level 1, 60 s at levels 2 and 3); a level's worst case is its test count
times that.

The compute burn hands every matmul result, and ``align`` one gradient before the update, to the
machine's fault points (:mod:`trainguard.node_tools.faultpoints`): inert on a real machine; on the
emulated cluster an ``sdc`` fault flips one bit there, as it does in a training rank's gradients.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import ipaddress
import json
import math
import os
import platform
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.errors import EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE, TrainguardError
from trainguard.node_tools.faultpoints import FaultPoints

LEVELS = {1: "quick", 2: "medium", 3: "neighbours"}
DEFAULT_TIMEOUT_S = {1: 30.0, 2: 60.0, 3: 60.0}
ALIGN_TIMEOUT_S = 60.0
#: pins that make the CPU path of ``align`` independent of the x86 CPU's vector unit:
#: ATen's portable kernels (one summation order on every x86 CPU) and MKL's compatible
#: code path; one thread; deterministic cuBLAS on GPUs
ALIGN_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE", "OMP_NUM_THREADS": "1",
             "MKL_NUM_THREADS": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
#: kinds of real-time findings that are about a training job's ranks, not the machine
RANK_FINDING_PREFIXES = ("rank_", "nan_", "loss_", "grad_")
#: prefix of the lines a worker writes on its stdout for the parent
MARK = "TGDIAG "
#: seconds a worker outlives its deadline before its own timer ends it (the parent kills it first)
WORKER_GRACE_S = 3.0
#: seconds to wait for a killed worker to go
KILL_WAIT_S = 5.0
#: environment marker of every process a diagnostic starts (one value per run), to find stragglers
MARKER_ENV = "TG_DIAG_RUN"

PASSED, FAILED, NOT_RUN = "passed", "failed", "could_not_run"


@dataclass(frozen=True)
class L3Spec:
    """This machine's place in a level-3 collective with its neighbours.

    Attributes:
        rank: this machine's rank in the group (0 hosts the rendezvous store).
        world_size: machines in the group.
        master_addr: address of the machine with rank 0.
        master_port: a free TCP port on it for the rendezvous.
        iface: network interface for the collective (GLOO/NCCL_SOCKET_IFNAME);
            "" means the node config's ``iface`` ("lo" when that is empty too and
            the master address is a loopback address).
    """

    rank: int
    world_size: int
    master_addr: str
    master_port: int
    iface: str = ""

    def validate(self) -> None:
        if self.world_size < 1:
            raise TrainguardError(f"diag level 3: world size {self.world_size} must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise TrainguardError(f"diag level 3: rank {self.rank} is outside 0..{self.world_size - 1}")
        if not self.master_addr:
            raise TrainguardError("diag level 3: the master address is empty")
        if not 0 < self.master_port < 65536:
            raise TrainguardError(f"diag level 3: master port {self.master_port} is outside 1..65535")


# =======================================================================================
# Public entry points
# =======================================================================================
def diag(cfg: NodeConfig, level: int, *, timeout_s: float | None = None, l3: L3Spec | None = None,
         mem_floor_gbps: float = 0.5, seed: int = 0, align_steps: int = 0) -> tuple[int, dict[str, Any]]:
    """Run diagnostic ``level`` (1, 2 or 3) on this machine: (exit code, report).

    Args:
        cfg: this machine's configuration.
        level: 1 quick health, 2 with load (compute, memory, local collective, disk),
            3 collective with neighbour machines (needs ``l3``).
        timeout_s: limit of each test in seconds (default 30 at level 1, 60 at 2 and 3).
        l3: the group of a level-3 run. At level 2 it asks for level 3 in the same test process after
            level 2's tests (one ``import torch`` and one session for both; the machines of the group
            meet at the collective): the report's ``level`` stays 2, its tests end with
            ``collective_neighbours``.
        mem_floor_gbps: memory copy bandwidth below which level 2 fails, GB/s.
        seed: seed of every generated input.
        align_steps: with ``l3``, also the alignment test (:func:`align`, this many steps) in the same
            test process, right after the collective (one ``import torch`` for both); its digest is the
            report's ``align`` (it does not judge the level's verdict: machines are compared).
    Raises:
        TrainguardError: (exit 2) a level other than 1-3, level 3 without ``l3``, a bad
            timeout or group.
    """
    if isinstance(level, bool) or not isinstance(level, int) or level not in LEVELS:
        raise TrainguardError(f"diag level {level!r} is unknown; use 1 (quick), 2 (medium) or 3 (neighbours)")
    if level == 3 and l3 is None:
        raise TrainguardError(
            "diag level 3 runs with neighbour machines and needs the group: rank, world size, master "
            "address and port (L3Spec)"
        )
    if l3 is not None:
        if level == 1:
            raise TrainguardError("diag: a neighbour group (L3) goes with level 2 or 3, not level 1")
        l3.validate()
    if align_steps and l3 is None:
        raise TrainguardError("diag: the alignment test runs after the neighbour collective; give the group (L3)")
    timeout = _check_timeout(DEFAULT_TIMEOUT_S[level] if timeout_s is None else timeout_s)
    started, t0 = time.time(), time.monotonic()
    with _scratch("tg-diag-") as tmp:
        runner = _Runner(cfg, Path(tmp), timeout, seed)
        tests: list[dict[str, Any]] = []
        try:
            # workdir first: it creates the work directory when missing, which the disk check needs
            specs: list[tuple[str, dict[str, Any]]] = [("workdir", {}), ("checks", {}), ("gpu", {}), ("torch", {})]
            if level == 2:
                specs += [("compute", {}), ("memory", {"floor_gbps": float(mem_floor_gbps)}), ("disk", {}),
                          ("collective_threads", {"world_size": 2})]
            env: dict[str, str] | None = None
            if level == 2 and l3 is not None:  # then L3 (and align) in the same process
                l3_args, env = runner.l3_plan(l3, align_steps)
                specs.append(("collective", l3_args))
                if align_steps:
                    specs.append(("align", {"steps": align_steps}))
            if level in (1, 2):
                tests += runner.batch(specs, env=env)  # one process, one import of torch
            aligned = tests.pop() if level == 2 and align_steps else None
            neighbours = runner.l3_result(tests.pop(), l3) if level == 2 and l3 is not None else None
            if level == 2:
                local = tests.pop()
                local["name"] = "collective_local"
                if local["ok"] and local["details"].get("deferred"):  # GPUs: one process per GPU
                    torch_info = next(t["details"] for t in tests if t["name"] == "torch")
                    local = runner.local_collective(torch_info)
                tests.append(local)
            if neighbours is not None:
                tests.append(neighbours)
            if level == 3:
                assert l3 is not None
                tests += runner.neighbour_collective(l3, align_steps=align_steps)
                aligned = tests.pop() if align_steps else None
        finally:
            stragglers = runner.sweep()
    code, healthy = _verdict(tests)
    report = {
        "machine": cfg.machine,
        "level": level,
        "level_name": LEVELS[level],
        "healthy": healthy,
        "exit_code": code,
        "reasons": [f"{t['name']}: {t['reason']}" for t in tests if not t["ok"]],
        "tests": tests,
        "timeout_s": timeout,
        "started_ts": started,
        "duration_s": round(time.monotonic() - t0, 3),
    }
    if stragglers:
        report["stragglers_killed"] = stragglers
    if l3 is not None:
        report["l3"] = asdict(l3)
        if aligned is not None:
            report["align"] = _align_fields(aligned, seed, align_steps)
    return code, report


def align(cfg: NodeConfig, *, seed: int = 0, steps: int = 1,
          timeout_s: float = ALIGN_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """The bit-wise alignment test: one fixed tiny model, ``steps`` deterministic SGD steps.

    Reports ``digest`` (sha256 of the outputs, gradients and updated weights) with the
    device, the torch version and ``compare_key``: machines with the same key must
    agree exactly. The test does not judge itself (exit 0 when it ran); exit 1 when
    the step failed or timed out on this machine, 2 when it could not start.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise TrainguardError(f"align: steps {steps!r} must be an integer >= 1")
    timeout = _check_timeout(timeout_s)
    started, t0 = time.time(), time.monotonic()
    with _scratch("tg-align-") as tmp:
        runner = _Runner(cfg, Path(tmp), timeout, seed)
        try:
            test = runner.simple("align", {"steps": steps}, env=ALIGN_ENV)
        finally:
            runner.sweep()
    report = {"machine": cfg.machine, "test": "align", **_align_fields(test, seed, steps), "tests": [test],
              "started_ts": started, "duration_s": round(time.monotonic() - t0, 3)}
    return report["exit_code"], report


def _align_fields(test: dict[str, Any], seed: int, steps: int) -> dict[str, Any]:
    """What a report says of an alignment test's result."""
    code, _ = _verdict([test])
    details = test["details"]
    return {
        "healthy": code == EXIT_OK,  # it ran; agreement is judged across machines
        "exit_code": code,
        "digest": details.get("digest") if test["ok"] else None,
        "compare_key": details.get("compare_key"),
        "device": details.get("device"),
        "torch": details.get("torch"),
        "seed": seed,
        "steps": steps,
        "reasons": [] if test["ok"] else [f"align: {test['reason']}"],
    }


@contextlib.contextmanager
def _scratch(prefix: str) -> Iterator[str]:
    """A private temporary directory for the workers' arguments and output."""
    try:
        holder = tempfile.TemporaryDirectory(prefix=prefix)
    except OSError as exc:
        raise TrainguardError(f"diag could not create a scratch directory in {tempfile.gettempdir()}: {exc}") from None
    with holder as tmp:
        yield tmp


def _check_timeout(value: float) -> float:
    try:
        timeout = float(value)
    except (TypeError, ValueError):
        raise TrainguardError(f"diag timeout {value!r} is not a number of seconds") from None
    if not (math.isfinite(timeout) and timeout > 0):
        raise TrainguardError(f"diag timeout {value!r} must be a positive number of seconds")
    return timeout


def _verdict(tests: list[dict[str, Any]]) -> tuple[int, bool]:
    if any(t["status"] == FAILED for t in tests):
        return EXIT_UNHEALTHY, False
    if any(t["status"] == NOT_RUN for t in tests):
        return EXIT_USAGE, False
    return EXIT_OK, True


def _result(name: str, status: str, duration_s: float, details: dict[str, Any] | None = None,
            reason: str = "") -> dict[str, Any]:
    return {"name": name, "ok": status == PASSED, "status": status, "duration_s": round(duration_s, 3),
            "details": details or {}, "reason": reason}


# =======================================================================================
# Parent side: worker processes with deadlines
# =======================================================================================
class _Worker:
    """One ``python -m trainguard.node_tools.diag --worker ARGS`` running one or more tests in order, in a session
    of its own."""

    def __init__(self, tmp: Path, label: str, tests: list[tuple[str, dict[str, Any]]], common: dict[str, Any], *,
                 deadline: float, env: dict[str, str] | None = None) -> None:
        self.label = label
        self.names = [name for name, _ in tests]
        self.deadline = deadline  # time.monotonic(): when the whole worker must be gone
        self.out_path, self.err_path = tmp / f"{label}.out", tmp / f"{label}.err"
        argfile = tmp / f"{label}.json"
        # the worker's own timer, in wall-clock time (it cannot see our monotonic clock)
        args = dict(common, tests=[[name, targs] for name, targs in tests],
                    deadline_unix=time.time() + (deadline - time.monotonic()))
        argfile.write_text(json.dumps(args), encoding="utf-8")
        child_env = dict(os.environ)
        import trainguard

        package_root = str(Path(trainguard.__file__).resolve().parent.parent)  # where trainguard is importable
        child_env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, child_env.get("PYTHONPATH")) if p)
        child_env.update(env or {})
        self.started = time.monotonic()
        with open(self.out_path, "wb") as out, open(self.err_path, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "trainguard.node_tools.diag", "--worker", str(argfile)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=child_env, cwd=tmp,
                start_new_session=True,
            )
        self.timed_out = False
        self.aborted = ""  # why it was stopped before its deadline
        self.unkillable = False
        self.ended: float | None = None

    def wait(self) -> None:
        """Wait for the worker until its deadline; past it, kill its whole session."""
        try:
            self.proc.wait(timeout=max(0.0, self.deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.timed_out = True
            self.kill()
        self.ended = time.monotonic()

    def kill(self) -> None:
        if self.proc.poll() is None:
            # the leader is not reaped yet, so its process group id is still ours to signal
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            try:
                self.proc.wait(timeout=KILL_WAIT_S)
            except subprocess.TimeoutExpired:
                # stuck in the kernel (state D: a dead disk or GPU driver); we must not hang with it
                self.unkillable = True

    @property
    def duration_s(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def messages(self) -> list[dict[str, Any]]:
        found = []
        try:
            text = self.out_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
        for line in text.splitlines():
            if line.startswith(MARK):
                with contextlib.suppress(ValueError):
                    found.append(json.loads(line[len(MARK):]))
        return found

    def outcome(self, test: str) -> dict[str, Any] | None:
        """The worker's result for ``test``, or None when it wrote none."""
        results = [m for m in self.messages() if m.get("event") == "result" and m.get("test") == test]
        return results[-1] if results else None

    def all_ok(self) -> bool:
        return all((self.outcome(name) or {}).get("ok") for name in self.names)

    def stages(self) -> list[str]:
        return [str(m.get("stage")) for m in self.messages() if m.get("event") == "progress"]

    def stderr_tail(self, lines: int = 15) -> str:
        try:
            with open(self.err_path, "rb") as fh:
                fh.seek(0, os.SEEK_END)
                fh.seek(max(0, fh.tell() - 8192))
                text = fh.read().decode(errors="replace")
        except OSError:
            return ""
        # C++ stack frames (torch's errors carry dozens) say nothing to an operator
        kept = [ln for ln in text.strip().splitlines() if not ln.startswith(("frame #", "<omitting"))]
        return "\n".join(kept[-lines:])

    def death(self) -> str:
        """Why the worker ended without a result."""
        rc = self.proc.returncode
        if rc is not None and rc < 0:
            with contextlib.suppress(ValueError):
                return f"the test process was killed by {signal.Signals(-rc).name}"
        tail = self.stderr_tail(1)
        return f"the test process exited with code {rc} without a result" + (f": {tail}" if tail else "")


class _Runner:
    def __init__(self, cfg: NodeConfig, tmp: Path, timeout_s: float, seed: int) -> None:
        self.cfg = cfg
        self.tmp = tmp
        self.timeout_s = timeout_s
        self.seed = seed
        self.config_path = tmp / "node.json"
        cfg.save(self.config_path)
        self._count = 0
        self.marker = f"{os.getpid()}-{os.urandom(8).hex()}"

    def sweep(self) -> list[int]:
        """End whatever a worker left behind (children outside its session); returns their pids."""
        from trainguard.node_tools import procs

        return procs.terminate(procs.pids_with_env(MARKER_ENV, self.marker), grace_s=1.0)

    def _start(self, tests: list[tuple[str, dict[str, Any]]], *, env: dict[str, str] | None = None,
               deadline: float | None = None) -> _Worker:
        self._count += 1
        deadline = time.monotonic() + self.timeout_s * len(tests) if deadline is None else deadline
        common = {"config": str(self.config_path), "seed": self.seed}
        return _Worker(self.tmp, f"{self._count:02d}-{tests[0][0]}", tests, common, deadline=deadline,
                       env={**(env or {}), MARKER_ENV: self.marker})

    def _judge(self, name: str, worker: _Worker, test: str = "collective") -> dict[str, Any]:
        """The result of ``test`` (reported as ``name``) from a finished worker."""
        out = worker.outcome(test)
        if out is not None:
            status = NOT_RUN if out.get("could_not_run") else (PASSED if out.get("ok") else FAILED)
            return _result(name, status, worker.duration_s, out.get("details"), str(out.get("reason") or ""))
        details = {"stderr_tail": worker.stderr_tail()}
        if worker.unkillable:
            from trainguard.node_tools.procs import proc_state

            return _result(name, FAILED, worker.duration_s, dict(details, pid=worker.proc.pid),
                           f"did not finish within {self.timeout_s:g} s and could not be killed (pid "
                           f"{worker.proc.pid}, process state {proc_state(worker.proc.pid)})")
        if worker.aborted:
            return _result(name, FAILED, worker.duration_s, details, f"stopped: {worker.aborted}")
        if worker.timed_out or worker.proc.returncode == -signal.SIGALRM:  # SIGALRM: the worker's own timer
            return _result(name, FAILED, worker.duration_s, details,
                           f"did not finish within {self.timeout_s:g} s; killed")
        return _result(name, FAILED, worker.duration_s, details, worker.death())

    def simple(self, name: str, args: dict[str, Any] | None = None, *,
               env: dict[str, str] | None = None) -> dict[str, Any]:
        return self.batch([(name, args or {})], env=env)[0]

    def batch(self, specs: list[tuple[str, dict[str, Any]]], *,
              env: dict[str, str] | None = None) -> list[dict[str, Any]]:
        """Run tests one after the other in one worker (torch is imported once), each within the timeout.

        A test past its timeout, or one that kills its process, fails; the tests after it
        go on in a fresh worker.
        """
        results: dict[str, dict[str, Any]] = {}
        todo = list(specs)
        while todo:
            t0 = time.monotonic()
            try:
                worker = self._start(todo, env=env)
            except OSError as exc:
                for name, _ in todo:
                    results[name] = _result(name, NOT_RUN, time.monotonic() - t0,
                                            reason=f"could not start the test process: {exc}")
                break
            current, since = self._follow(worker, [name for name, _ in todo])
            for name, _ in todo:
                out = worker.outcome(name)
                if out is not None:
                    results[name] = self._judge(name, worker, name)
                    results[name]["duration_s"] = round(float(out.get("duration_s") or 0.0), 3)
            left = [spec for spec in todo if spec[0] not in results]
            if left:  # the first of them is the one that was running when the worker ended
                name = current if current in dict(left) else left[0][0]
                results[name] = self._judge(name, worker, name)
                results[name]["duration_s"] = round(time.monotonic() - since, 3)
                left = [spec for spec in left if spec[0] != name]
            todo = left
        return [results[name] for name, _ in specs]

    def _follow(self, worker: _Worker, names: list[str]) -> tuple[str, float]:
        """Wait for a batch worker, killing it when its current test passes the timeout.

        Returns the test that ran last and when it started (as seen from here).
        """
        current, since = names[0], worker.started  # the first test's clock includes the interpreter's start
        seen: set[str] = set()
        try:
            while True:
                for m in worker.messages():
                    if m.get("event") == "start" and m.get("test") not in seen:
                        seen.add(str(m.get("test")))
                        current, since = str(m.get("test")), time.monotonic()
                now = time.monotonic()
                if worker.proc.poll() is not None:
                    break
                if now - since > self.timeout_s or now > worker.deadline:
                    worker.timed_out = True
                    worker.kill()
                    break
                with contextlib.suppress(subprocess.TimeoutExpired):
                    worker.proc.wait(timeout=min(0.1, max(0.0, since + self.timeout_s - now)))
        finally:
            worker.kill()
            worker.ended = time.monotonic()
        return current, since

    # ---- level 2: local collective --------------------------------------------------------
    def local_collective(self, torch_info: dict[str, Any]) -> dict[str, Any]:
        name = "collective_local"
        gpus = int(torch_info.get("cuda_device_count") or 0)
        if gpus > 0 and torch_info.get("nccl_available"):
            backend, devices = "nccl", [f"cuda:{i}" for i in range(gpus)]
        else:
            backend, devices = "gloo", ["cpu", "cpu"]
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        port = _free_port()
        env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        workers: list[_Worker] = []
        try:
            for rank, device in enumerate(devices):
                args = {"rank": rank, "world_size": len(devices), "master_addr": "127.0.0.1", "master_port": port,
                        "backend": backend, "device": device, "all_to_all": True, "size_mib": 4, "iters": 5}
                workers.append(self._start([("collective", args)], env=env, deadline=deadline))
        except OSError as exc:
            for w in workers:
                w.kill()
            return _result(name, NOT_RUN, time.monotonic() - t0, reason=f"could not start the test processes: {exc}")
        try:
            _wait_all(workers, "rank {} failed")
        finally:
            for w in workers:
                w.kill()
        per_rank = [self._judge(f"rank {i}", w) for i, w in enumerate(workers)]
        first = per_rank[0]["details"]
        details = {
            "backend": backend, "processes": len(devices), "devices": devices,
            "allreduce_busbw_gbps": first.get("allreduce_busbw_gbps"),
            "allreduce_algbw_gbps": first.get("allreduce_algbw_gbps"),
            "allgather_algbw_gbps": first.get("allgather_algbw_gbps"),
            "bytes": first.get("bytes"),
            "ranks": [{"rank": i, "ok": r["ok"], "reason": r["reason"], "duration_s": r["duration_s"],
                       **{k: r["details"].get(k) for k in ("device", "allreduce_ok", "allgather_ok", "alltoall_ok",
                                                          "bad_peers")}} for i, r in enumerate(per_rank)],
        }
        bad = [r for r in per_rank if not r["ok"]]
        duration = time.monotonic() - t0
        if not bad:
            return _result(name, PASSED, duration, details)
        if any(w.timed_out for w in workers):
            reason = (f"the {backend} collective between {len(devices)} local processes did not finish within "
                      f"{self.timeout_s:g} s; " + "; ".join(f"{r['name']}: {r['reason']}" for r in bad))
        else:
            reason = "; ".join(f"{r['name']} ({details['ranks'][i]['device']}): {r['reason']}"
                               for i, r in enumerate(per_rank) if not r["ok"])
        return _result(name, FAILED, duration, details, reason)

    # ---- level 3: collective with the neighbours ------------------------------------------
    def _iface(self, spec: L3Spec) -> str:
        return spec.iface or self.cfg.iface or ("lo" if _is_loopback(spec.master_addr) else "")

    def l3_plan(self, spec: L3Spec, align_steps: int = 0) -> tuple[dict[str, Any], dict[str, str]]:
        """The level-3 collective's test arguments and its process's environment."""
        iface = self._iface(spec)
        env = {"OMP_NUM_THREADS": "1", **(ALIGN_ENV if align_steps else {})}
        if iface:
            env.update(GLOO_SOCKET_IFNAME=iface, NCCL_SOCKET_IFNAME=iface)
        args = {"rank": spec.rank, "world_size": spec.world_size, "master_addr": spec.master_addr,
                "master_port": spec.master_port, "backend": "auto", "device": "auto", "all_to_all": True,
                "size_mib": 4, "iters": 5}
        return args, env

    def l3_result(self, result: dict[str, Any], spec: L3Spec) -> dict[str, Any]:
        """The collective's result from a batch (after level 2's tests) as level 3's test."""
        where = f"rendezvous {spec.master_addr}:{spec.master_port}, rank {spec.rank} of {spec.world_size}"
        result["name"] = "collective_neighbours"
        result["details"].setdefault("iface", self._iface(spec))
        if result["reason"].startswith("did not finish within"):
            result["reason"] = (f"the collective with the neighbours did not finish within {self.timeout_s:g} s "
                                f"({where}): a peer never came, or a peer or the network hangs")
        elif result["status"] == NOT_RUN and result["reason"].startswith(("timed out waiting", "could not join")):
            result["reason"] = f"{result['reason'].split(': ', 1)[0]} ({where}): {result['reason'].split(': ', 1)[-1]}"
        return result

    def neighbour_collective(self, spec: L3Spec, *, align_steps: int = 0) -> list[dict[str, Any]]:
        """The level-3 collective's result; with ``align_steps``, then the alignment test's, run by the
        same worker after the collective (or by a fresh one when the collective's was killed)."""
        name = "collective_neighbours"
        iface = self._iface(spec)
        args, env = self.l3_plan(spec, align_steps)
        t0 = time.monotonic()
        tests: list[tuple[str, dict[str, Any]]] = [("collective", args)]
        if align_steps:
            tests.append(("align", {"steps": align_steps}))
        try:
            worker = self._start(tests, env=env)
        except OSError as exc:
            failed = _result(name, NOT_RUN, time.monotonic() - t0, reason=f"could not start the test process: {exc}")
            return [failed, self.simple("align", {"steps": align_steps}, env=ALIGN_ENV)] if align_steps else [failed]
        try:
            if align_steps:  # each test within the timeout
                self._follow(worker, [n for n, _ in tests])
            else:
                worker.wait()
        finally:
            worker.kill()
        result = self._judge(name, worker)
        extra: list[dict[str, Any]] = []
        if align_steps:
            if worker.outcome("align") is not None:
                extra = [self._judge("align", worker, "align")]
            else:  # the collective's worker ended first: align on its own
                extra = [self.simple("align", {"steps": align_steps}, env=ALIGN_ENV)]
        result["details"].setdefault("iface", iface)
        where = f"rendezvous {spec.master_addr}:{spec.master_port}, rank {spec.rank} of {spec.world_size}"
        joined = "joined" in worker.stages()
        waited = f"timed out waiting for peers: {where} did not complete within {self.timeout_s:g} s"
        if worker.timed_out and not joined:
            result.update(status=NOT_RUN, ok=False, reason=waited)
        elif result["status"] == NOT_RUN and result["reason"].startswith("timed out waiting for peers"):
            result["reason"] = f"{waited} ({result['reason'].split(': ', 1)[-1]})"
        elif result["status"] == NOT_RUN and result["reason"].startswith("could not join the group"):
            result["reason"] = f"could not join the group ({where}): {result['reason'].split(': ', 1)[-1]}"
        elif worker.timed_out:
            result["reason"] = (f"the collective did not finish within {self.timeout_s:g} s after every peer joined "
                                f"({where}); a peer or the network hangs")
        return [result, *extra]


def _wait_all(workers: list[_Worker], why: str, *, grace_s: float = 2.0) -> None:
    """Wait for workers that need each other; when one fails, stop the rest soon after.

    Without this, the peers of a crashed rank would sit in their collective until the
    deadline. The survivors get ``grace_s`` to write their own results first.
    """
    deadline = min(w.deadline for w in workers)
    failed: int | None = None
    while True:
        now = time.monotonic()
        for i, w in enumerate(workers):
            if w.ended is None and w.proc.poll() is not None:
                w.ended = now
                if failed is None and not w.all_ok():
                    failed, deadline = i, min(deadline, now + grace_s)
        running = [w for w in workers if w.ended is None]
        if not running:
            return
        if now >= deadline:
            for w in running:
                if failed is not None:
                    w.aborted = why.format(failed)
                else:
                    w.timed_out = True
                w.kill()
                w.ended = time.monotonic()
            return
        with contextlib.suppress(subprocess.TimeoutExpired):
            running[0].proc.wait(timeout=min(0.1, max(0.0, deadline - now)))


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False


# =======================================================================================
# Worker side: the tests, run in worker processes
# =======================================================================================
def _emit(event: str, **fields: Any) -> None:
    sys.stdout.write(MARK + json.dumps({"event": event, **fields}, default=str) + "\n")
    sys.stdout.flush()


def _done(ok: bool, details: dict[str, Any], reason: str = "", *, could_not_run: bool = False) -> dict[str, Any]:
    return {"ok": ok, "details": details, "reason": reason, "could_not_run": could_not_run}


def _load_cfg(args: dict[str, Any]) -> NodeConfig:
    return NodeConfig.load(Path(args["config"]))


def _faults(cfg: NodeConfig) -> FaultPoints:
    from trainguard.node_tools import faultpoints

    return faultpoints.load(cfg.fault_file, rank=-1)


def _os_error(exc: OSError, what: str) -> str:
    code = exc.errno
    name = errno.errorcode.get(code, "?") if code is not None else "?"
    return f"{what}: errno {code} ({name}) {exc.strerror or exc}"


# ---- level 1 --------------------------------------------------------------------------
def _w_checks(args: dict[str, Any]) -> dict[str, Any]:
    from trainguard.node_tools.agent import check_once

    cfg = _load_cfg(args)
    _, report = check_once(cfg, "all")
    findings = report.get("findings", [])
    ignored = [f for f in findings if str(f.get("kind", "")).startswith(RANK_FINDING_PREFIXES)]
    faults = [f for f in findings if f.get("severity") == "fault" and f not in ignored]
    warnings = [f for f in findings if f.get("severity") != "fault" and f not in ignored]
    errors = {k: v for k, v in (report.get("errors") or {}).items() if k != "ranks"}
    details = {"checks": report.get("checks", []), "faults": faults, "warnings": warnings, "errors": errors,
               "ignored_rank_findings": len(ignored), "notes": report.get("notes", [])}
    reasons = [f"{f['kind']}: {f['message']}" for f in faults] + [f"check {k} failed: {v}" for k, v in errors.items()]
    return _done(not reasons, details, "; ".join(reasons))


def _w_gpu(args: dict[str, Any]) -> dict[str, Any]:
    from trainguard.node_tools.nvml import NvmlUnavailable, backend_for

    cfg = _load_cfg(args)
    expected = cfg.gpus
    try:
        backend = backend_for(cfg)
        note = ""
    except NvmlUnavailable as exc:
        backend, note = None, str(exc)
    if backend is None:
        details = {"backend": None, "expected": expected, "nvml_backend": cfg.nvml_backend, "note": note}
        if expected > 0:
            return _done(False, details, f"no GPU backend (nvml_backend={cfg.nvml_backend}"
                         f"{': ' + note if note else ''}) but {expected} GPUs are expected")
        return _done(True, details)
    snap = backend.snapshot()
    devices = snap.get("devices", [])
    count = int(snap.get("device_count", len(devices)))
    present = [d.get("index") for d in devices]
    details = {"backend": snap.get("backend"), "driver_version": snap.get("driver_version"),
               "expected": expected, "device_count": count, "present": present,
               "devices": [{k: d.get(k) for k in ("index", "uuid", "name", "temperature_c")} for d in devices]}
    reasons = []
    if count != len(devices):
        reasons.append(f"the snapshot says {count} devices but lists {len(devices)}")
    uuids = [d.get("uuid") for d in devices]
    if len(set(uuids)) != len(uuids) or len(set(present)) != len(present):
        reasons.append(f"the snapshot lists a GPU twice (indices {present})")
    if expected > 0 and count != expected:
        missing = [i for i in range(expected) if i not in present]
        details["missing"] = missing
        which = f"GPU {', '.join(map(str, missing))} missing: " if missing else ""
        reasons.append(f"{which}{count} of {expected} GPUs visible")
    return _done(not reasons, details, "; ".join(reasons))


def _w_torch(args: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        import torch
    except Exception as exc:
        return _done(False, {}, f"import torch failed: {type(exc).__name__}: {exc}")
    import torch.distributed as dist

    cfg = _load_cfg(args)
    cuda = torch.cuda.is_available()
    details = {
        "version": torch.__version__, "import_s": round(time.monotonic() - t0, 3),
        "cuda_available": cuda, "cuda_version": torch.version.cuda,
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "distributed": dist.is_available(),
        "gloo_available": dist.is_available() and dist.is_gloo_available(),
        "nccl_available": dist.is_available() and dist.is_nccl_available(),
    }
    if cuda and cfg.gpus > 0 and details["cuda_device_count"] != cfg.gpus:
        return _done(False, details, f"torch sees {details['cuda_device_count']} CUDA devices, {cfg.gpus} expected")
    return _done(True, details)


def _w_workdir(args: dict[str, Any]) -> dict[str, Any]:
    cfg = _load_cfg(args)
    workdir = Path(cfg.workdir)
    token = os.urandom(16).hex()
    path = workdir / f".tg-diag-{os.getpid()}-{token[:8]}.txt"
    details = {"workdir": str(workdir)}
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(token, encoding="utf-8")
        back = path.read_text(encoding="utf-8")
    except OSError as exc:
        return _done(False, details, _os_error(exc, f"write/read in {workdir}"))
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    if back != token:
        return _done(False, details, f"{path} read back different bytes than were written")
    return _done(True, details)


# ---- level 2 --------------------------------------------------------------------------
MATMUL_SIZES = (256, 384, 512)


def _w_compute(args: dict[str, Any]) -> dict[str, Any]:
    """Seeded float32 matmuls on every device, each checked against a float64 CPU reference.

    The error of each result element is judged against the rounding bound of the
    product: ``|C - C64| <= tol * (|A| @ |B|)`` with ``tol = 8 sqrt(K) 2^-24``, well
    above float32 rounding (observed ~2.5 ulp) and far below a wrong bit.
    """
    import torch

    cfg = _load_cfg(args)
    faults = _faults(cfg)
    seed = int(args.get("seed", 0))
    burn_s = float(args.get("burn_s", 0.3))
    torch.set_float32_matmul_precision("highest")  # no TF32: the reference is exact float32 arithmetic
    cuda = torch.cuda.is_available()
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
    cases = []
    for n in MATMUL_SIZES:
        g = torch.Generator().manual_seed(seed * 1009 + n)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        a64, b64 = a.double(), b.double()
        cases.append((n, a, b, a64 @ b64, a64.abs() @ b64.abs()))
    per_device, reasons = [], []
    for dev in devices:
        inputs = [(n, a.to(dev), b.to(dev), ref, bound) for n, a, b, ref, bound in cases]
        results, wrong, flops, worst_n = 0, 0, 0.0, 0
        worst_ratio = worst_err = 0.0
        first: dict[int, Any] = {}
        unrepeatable = 0
        t0 = time.monotonic()
        busy = 0.0
        while results < 2 * len(inputs) or time.monotonic() - t0 < burn_s:
            n, a, b, ref, bound = inputs[results % len(inputs)]
            s = time.monotonic()
            c = a @ b
            faults.corrupt_compute(c)  # a broken ALU, where a harness emulates one
            c = c.cpu()
            busy += time.monotonic() - s
            flops += 2.0 * n**3
            err = (c.double() - ref).abs()
            ratio = float((err / bound).max())
            if math.isnan(ratio):  # a NaN where the reference has a number is as wrong as it gets
                ratio = math.inf
            if ratio > 8 * math.sqrt(n) * 2.0**-24:
                wrong += 1
            if ratio > worst_ratio:
                worst_ratio, worst_err, worst_n = ratio, float(err.max()), n
            if n in first:
                unrepeatable += int(not torch.equal(first[n], c))
            else:
                first[n] = c
            results += 1
        info = {"device": dev, "results": results, "wrong": wrong, "max_abs_error": _finite(worst_err),
                "max_error_over_bound": _finite(worst_ratio), "worst_size": worst_n,
                "gflops": round(flops / busy / 1e9, 2) if busy > 0 else None,
                "not_bitwise_repeatable": unrepeatable, "duration_s": round(time.monotonic() - t0, 3)}
        per_device.append(info)
        if wrong:
            tol = 8 * math.sqrt(worst_n) * 2.0**-24
            reasons.append(f"{dev}: {wrong} of {results} float32 matmul results wrong; max error {worst_err:.6g} "
                           f"in a {worst_n}x{worst_n} product ({worst_ratio:.3g} of its rounding bound, "
                           f"tolerance {tol:.3g})")
    details = {"devices": per_device, "sizes": list(MATMUL_SIZES), "dtype": "float32", "reference": "float64 cpu"}
    return _done(not reasons, details, "; ".join(reasons))


def _finite(value: float) -> float | str:
    """A number for a JSON document: inf and NaN as strings (strict JSON has neither)."""
    return value if math.isfinite(value) else str(value)


def _w_memory(args: dict[str, Any]) -> dict[str, Any]:
    """Device-local buffer copies; GB/s counts the bytes copied (memory traffic is twice that)."""
    import torch

    floor = float(args.get("floor_gbps", 0.5))
    reps = int(args.get("reps", 4))
    cuda = torch.cuda.is_available()
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
    per_device, reasons = [], []
    for dev in devices:
        nbytes = 64 << 20  # host memory: well past any CPU cache, a fraction of a second per copy
        if dev.startswith("cuda"):
            free, _total = torch.cuda.mem_get_info(torch.device(dev))
            nbytes = int(min(1 << 30, free // 4)) // 4 * 4
        src = torch.arange(nbytes // 4, dtype=torch.int32, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: first touch of the pages
        sync = (lambda d=dev: torch.cuda.synchronize(d)) if dev.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        sync()
        dt = time.perf_counter() - t0
        gbps = reps * nbytes / dt / 1e9 if dt > 0 else float("inf")
        intact = bool(torch.equal(dst, src))
        per_device.append({"device": dev, "buffer_mib": nbytes >> 20, "copies": reps,
                           "gbps": round(gbps, 3) if math.isfinite(gbps) else None, "intact": intact})
        if not intact:
            reasons.append(f"{dev}: a {nbytes >> 20} MiB copy came back different")
        if gbps < floor:
            reasons.append(f"{dev}: copy bandwidth {gbps:.3g} GB/s is below the floor of {floor:g} GB/s")
        del src, dst
    details = {"devices": per_device, "floor_gbps": floor, "gbps": min((d["gbps"] or 0.0) for d in per_device)}
    return _done(not reasons, details, "; ".join(reasons))


def _w_disk(args: dict[str, Any]) -> dict[str, Any]:
    """Write seeded random bytes, fsync, drop them from the page cache, read back, compare sha256."""
    cfg = _load_cfg(args)
    size = int(args.get("size_mib", 32)) << 20
    chunk = 1 << 20
    data = random.Random(int(args.get("seed", 0))).randbytes(size)  # noqa: S311 - test data, not secrets
    want = hashlib.sha256(data).hexdigest()
    workdir = Path(cfg.workdir)
    path = workdir / f".tg-diag-disk-{os.getpid()}.bin"
    details: dict[str, Any] = {"path": str(path), "bytes": size}
    step = "create"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            step = "write"
            view = memoryview(data)
            for off in range(0, size, chunk):
                part = view[off:off + chunk]
                while part:
                    part = part[os.write(fd, part):]
            step = "fsync"
            os.fsync(fd)
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # make the read come from the disk
        finally:
            os.close(fd)
        t1 = time.perf_counter()
        step = "read"
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as fh:
            while block := fh.read(chunk):
                digest.update(block)
        t2 = time.perf_counter()
    except OSError as exc:
        return _done(False, details, _os_error(exc, f"{step} of {path}"))
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    details.update(write_mbps=round(size / (t1 - t0) / 1e6, 1) if t1 > t0 else None,
                   read_mbps=round(size / (t2 - t1) / 1e6, 1) if t2 > t1 else None,
                   sha256=want)
    if digest.hexdigest() != want:
        return _done(False, details, f"{path}: the {size >> 20} MiB read back differ from what was written "
                                     f"(sha256 {digest.hexdigest()[:16]}..., wrote {want[:16]}...)")
    return _done(True, details)


# ---- collectives (level 2 local, level 3 neighbours) -----------------------------------
def _seeded(seed: int, key: int, n: int) -> Any:
    """Integer-valued float32 data: sums of up to 16k ranks are exact in any reduction order."""
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + key) % (2**63))
    return torch.randint(-1000, 1001, (n,), generator=g, dtype=torch.int32).to(torch.float32)


def _w_collective(args: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(args["rank"]), int(args["world_size"])
    seed = int(args.get("seed", 0))
    backend, device = args.get("backend", "auto"), args.get("device", "auto")
    if backend == "auto":
        use_nccl = torch.cuda.is_available() and dist.is_nccl_available()
        backend = "nccl" if use_nccl else "gloo"
        device = "cuda:0" if use_nccl else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # leave a second before the parent's kill, so a rendezvous timeout is reported by us
    timeout = max(1.0, float(args["deadline_unix"]) - time.time() - 1.0)
    addr, port = args["master_addr"], int(args["master_port"])
    details: dict[str, Any] = {"rank": rank, "world_size": world, "backend": backend, "device": str(dev),
                               "master": f"{addr}:{port}"}
    _emit("progress", stage="connecting")
    t0 = time.monotonic()
    try:
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
    except Exception as exc:
        text = " ".join(str(exc).split())[:400]
        waiting = any(w in text.lower() for w in ("timed out", "timeout", "waiting for"))
        why = "timed out waiting for peers" if waiting else "could not join the group"
        return _done(False, details, f"{why}: {type(exc).__name__}: {text}", could_not_run=True)
    details["rendezvous_s"] = round(time.monotonic() - t0, 3)
    _emit("progress", stage="joined")
    try:
        return _collective_checks(args, rank, world, seed, dev, details)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class _DistOps:
    """The collectives of ``_collective_checks`` on the process's default group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist

    def all_reduce(self, t: Any) -> None:
        self.dist.all_reduce(t)

    def all_gather(self, outs: list[Any], t: Any) -> None:
        self.dist.all_gather(outs, t)

    def all_to_all_single(self, recv: Any, send: Any) -> None:
        self.dist.all_to_all_single(recv, send)

    def barrier(self) -> None:
        self.dist.barrier()


class _BackendOps:
    """The same collectives on a bare gloo backend object (one per thread; no default group needed)."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg

    def all_reduce(self, t: Any) -> None:
        self.pg.allreduce([t]).wait()

    def all_gather(self, outs: list[Any], t: Any) -> None:
        self.pg.allgather([outs], [t]).wait()

    def all_to_all_single(self, recv: Any, send: Any) -> None:
        self.pg.alltoall_base(recv, send, [], []).wait()

    def barrier(self) -> None:
        self.pg.barrier().wait()


def _collective_checks(args: dict[str, Any], rank: int, world: int, seed: int, dev: Any,
                       details: dict[str, Any], ops: Any = None) -> dict[str, Any]:
    import torch

    dist = ops or _DistOps()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    n = 4096
    # all_reduce of every rank's seeded tensor
    t = _seeded(seed, rank, n).to(dev)
    dist.all_reduce(t)
    expected = sum(_seeded(seed, r, n) for r in range(world))
    allreduce_ok = bool(torch.equal(t.cpu(), expected))
    # all_gather: the chunk from each rank is checked on its own, so a wrong peer is named
    mine = _seeded(seed + 1, rank, n).to(dev)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    bad_peers = [r for r in range(world) if not torch.equal(gathered[r].cpu(), _seeded(seed + 1, r, n))]
    allgather_ok = not bad_peers
    # all_to_all_single: chunk j of rank i goes to rank j
    alltoall_ok = None
    if args.get("all_to_all", True):
        k = 1024
        send = torch.cat([_seeded(seed + 2, rank * world + j, k) for j in range(world)]).to(dev)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        want = torch.cat([_seeded(seed + 2, j * world + rank, k) for j in range(world)])
        alltoall_ok = bool(torch.equal(recv.cpu(), want))
    # bandwidth: a few MiB, a few iterations; the last result is checked too
    elems = int(args.get("size_mib", 4)) * (1 << 20) // 4
    iters = int(args.get("iters", 5))
    src = _seeded(seed + 3, rank, elems).to(dev)
    buf = torch.empty_like(src)
    buf.copy_(src)
    dist.all_reduce(buf)  # warm-up
    sync()
    dist.barrier()
    spent = 0.0
    for _ in range(iters):
        buf.copy_(src)
        sync()
        s = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        spent += time.perf_counter() - s
    want = _seeded(seed + 3, 0, elems)
    for r in range(1, world):
        want += _seeded(seed + 3, r, elems)
    bw_ok = bool(torch.equal(buf.cpu(), want))
    allreduce_ok = allreduce_ok and bw_ok
    nbytes = elems * 4
    algbw = nbytes * iters / spent / 1e9 if spent > 0 else None
    # all_gather bandwidth (each rank contributes a quarter, so the output has the same order of size)
    part = _seeded(seed + 4, rank, max(1, elems // 4)).to(dev)
    outs = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(outs, part)  # warm-up
    sync()
    spent_g = 0.0
    for _ in range(iters):
        s = time.perf_counter()
        dist.all_gather(outs, part)
        sync()
        spent_g += time.perf_counter() - s
    gathered_bytes = part.numel() * 4 * world
    ag_algbw = gathered_bytes * iters / spent_g / 1e9 if spent_g > 0 else None
    ok_local = allreduce_ok and allgather_ok and alltoall_ok is not False
    # every rank's verdict, so each machine's report says which ranks saw wrong data
    verdict = torch.tensor([int(ok_local)], dtype=torch.int32, device=dev)
    verdicts = [torch.empty_like(verdict) for _ in range(world)]
    dist.all_gather(verdicts, verdict)
    ranks = [{"rank": r, "ok": bool(int(v.item()))} for r, v in enumerate(verdicts)]
    details.update(
        allreduce_ok=allreduce_ok, allgather_ok=allgather_ok, alltoall_ok=alltoall_ok, bad_peers=bad_peers,
        ranks=ranks, bytes=nbytes, iters=iters,
        allreduce_algbw_gbps=round(algbw, 4) if algbw else None,
        allreduce_busbw_gbps=round(algbw * 2 * (world - 1) / world, 4) if algbw else None,
        allgather_algbw_gbps=round(ag_algbw, 4) if ag_algbw else None,
    )
    reasons = []
    if not allreduce_ok:
        reasons.append("all_reduce returned a wrong sum")
    if bad_peers:
        reasons.append(f"all_gather delivered wrong data from rank(s) {', '.join(map(str, bad_peers))}")
    if alltoall_ok is False:
        reasons.append("all_to_all delivered wrong data")
    others = [r["rank"] for r in ranks if not r["ok"] and r["rank"] != rank]
    if others:
        reasons.append(f"rank(s) {', '.join(map(str, others))} saw wrong results")
    return _done(not reasons, details, "; ".join(reasons))


def _w_collective_threads(args: dict[str, Any]) -> dict[str, Any]:
    """The local collective of level 2 with its ranks as threads of this process (gloo over loopback,
    each rank its own gloo context, as nccl-tests runs ranks as threads): the same exact checks as the
    one-process-per-rank test without an interpreter and an ``import torch`` per rank, which on a
    machine emulated on a few shared cores cost more than the collective. On a machine with GPUs and
    NCCL it defers (``details.deferred``) to one process per GPU."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available():
        return _done(True, {"deferred": "nccl: one process per GPU"})
    world, seed = int(args.get("world_size", 2)), int(args.get("seed", 0))
    timeout = max(1.0, float(args["deadline_unix"]) - time.time() - 1.0)
    store = dist.HashStore()
    out: dict[int, dict[str, Any]] = {}

    def rank_main(rank: int) -> None:
        details: dict[str, Any] = {"rank": rank, "world_size": world, "backend": "gloo", "device": "cpu"}
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("tg-diag-local", store), rank, world,
                                       timedelta(seconds=timeout))
            out[rank] = _collective_checks(args, rank, world, seed, torch.device("cpu"), details,
                                           _BackendOps(pg))
        except Exception as exc:
            out[rank] = _done(False, details, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread per rank, as each rank process has (OMP_NUM_THREADS=1)
    try:
        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        torch.set_num_threads(before)
    per_rank = [out.get(r) or _done(False, {"rank": r}, f"did not finish within {timeout:.0f} s")
                for r in range(world)]
    first = per_rank[0]["details"]
    details = {
        "backend": "gloo", "threads": world, "devices": ["cpu"] * world,
        **{k: first.get(k) for k in ("allreduce_busbw_gbps", "allreduce_algbw_gbps", "allgather_algbw_gbps",
                                     "bytes")},
        "ranks": [{"rank": r, "ok": d["ok"], "reason": d["reason"],
                   **{k: d["details"].get(k) for k in ("device", "allreduce_ok", "allgather_ok", "alltoall_ok",
                                                      "bad_peers")}} for r, d in enumerate(per_rank)],
    }
    bad = [f"rank {r}: {d['reason']}" for r, d in enumerate(per_rank) if not d["ok"]]
    return _done(not bad, details, "; ".join(bad))


# ---- the alignment test ------------------------------------------------------------------
def _w_align(args: dict[str, Any]) -> dict[str, Any]:
    import torch

    cfg = _load_cfg(args)
    faults = _faults(cfg)
    seed, steps = int(args.get("seed", 0)), int(args.get("steps", 1))
    torch.set_num_threads(1)
    torch.set_float32_matmul_precision("highest")
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda:0" if cuda else "cpu")
    if cuda:
        # deterministic cuBLAS/cuDNN kernels; on the CPU the pins of ALIGN_ENV do that, and the switch
        # would import torch._dynamo and torch._inductor (seconds of CPU on every machine at once)
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
    # Weights from Python's generator (the same on every platform) rounded to float32:
    # torch's own randn takes a different path on different vector units.
    rng = random.Random(seed)  # noqa: S311 - reproducible test data

    def tensor(*shape: int, scale: float) -> Any:
        count = math.prod(shape)
        return torch.tensor([rng.uniform(-1.0, 1.0) * scale for _ in range(count)],
                            dtype=torch.float32).reshape(shape).to(dev)

    d_in, d_hidden, d_out, batch = 32, 64, 16, 8
    params = {
        "w1": tensor(d_hidden, d_in, scale=0.25), "b1": tensor(d_hidden, scale=0.125),
        "w2": tensor(d_out, d_hidden, scale=0.125), "b2": tensor(d_out, scale=0.125),
    }
    for p in params.values():
        p.requires_grad_(True)
    x, target = tensor(batch, d_in, scale=1.0), tensor(batch, d_out, scale=1.0)
    lr = 0.125
    h_all, h_out, h_grad, h_weight = (hashlib.sha256() for _ in range(4))
    losses, flipped = [], 0

    def feed(hashes: tuple[Any, ...], t: Any) -> None:
        raw = bytes(t.detach().cpu().reshape(-1).contiguous().view(torch.uint8).tolist())
        for h in hashes:
            h.update(raw)

    for _ in range(steps):
        hidden = torch.relu(x @ params["w1"].T + params["b1"])
        out = hidden @ params["w2"].T + params["b2"]
        loss = ((out - target) ** 2).mean()
        for p in params.values():
            p.grad = None
        loss.backward()
        if faults.corrupt_compute(params["w1"].grad):  # a broken ALU, as in a training rank's gradients
            flipped += 1
        feed((h_all, h_out), out)
        feed((h_all, h_out), loss)
        for p in params.values():
            feed((h_all, h_grad), p.grad)
        with torch.no_grad():
            for p in params.values():
                p -= lr * p.grad
        for p in params.values():
            feed((h_all, h_weight), p)
        losses.append(_finite(float(loss.detach())))
    name = torch.cuda.get_device_name(dev) if cuda else "cpu"
    capability = torch.backends.cpu.get_cpu_capability()
    details = {
        "digest": h_all.hexdigest(),
        "parts": {"outputs": h_out.hexdigest(), "grads": h_grad.hexdigest(), "weights": h_weight.hexdigest()},
        "losses": losses, "device": str(dev), "device_name": name, "torch": torch.__version__,
        "cpu_capability": capability, "threads": torch.get_num_threads(), "steps": steps, "seed": seed,
        "compare_key": f"{platform.machine()} {dev.type}:{name}|torch {torch.__version__}|aten {capability}"
                       f"|seed {seed} steps {steps}",
        "pinned_env": {k: os.environ.get(k) for k in ALIGN_ENV},
    }
    if flipped:
        details["sdc_flips"] = flipped
    return _done(True, details)


_WORKERS = {
    "checks": _w_checks, "gpu": _w_gpu, "torch": _w_torch, "workdir": _w_workdir, "compute": _w_compute,
    "memory": _w_memory, "disk": _w_disk, "collective": _w_collective, "align": _w_align,
    "collective_threads": _w_collective_threads,
}


def _worker_main(argv: list[str]) -> int:
    """``python -m trainguard.node_tools.diag --worker ARGS.json``: run the tests listed in ARGS, in order."""
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m trainguard.node_tools.diag --worker ARGS.json", file=sys.stderr)
        return EXIT_USAGE
    args = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    # our own end, should the parent die before it can kill us: SIGALRM's default action ends the process
    remaining = float(args.get("deadline_unix", time.time() + 600)) - time.time()
    signal.setitimer(signal.ITIMER_REAL, max(0.5, remaining + WORKER_GRACE_S))
    common = {k: v for k, v in args.items() if k != "tests"}
    for name, targs in args["tests"]:
        _emit("start", test=name)
        t0 = time.monotonic()
        try:
            if name not in _WORKERS:
                raise ValueError(f"no diagnostic test is called {name!r}")
            result = _WORKERS[name]({**common, **targs})
        except Exception as exc:
            result = _done(False, {"traceback": traceback.format_exc(limit=6)[-2000:]},
                           f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}")
        _emit("result", test=name, duration_s=round(time.monotonic() - t0, 3), **result)
    return 0


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
