"""The parent side of a diagnostic: worker processes (``python -m trainguard.node_tools.diag --worker ARGS``),
each in a session of its own, followed and killed past their deadlines; the local and neighbour collectives' ranks."""

from __future__ import annotations

import contextlib
import ipaddress
import json
import math
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.diag.common import (
    ALIGN_ENV,
    FAILED,
    KILL_WAIT_S,
    MARK,
    MARKER_ENV,
    NOT_RUN,
    PASSED,
    L3Spec,
    make_result,
)


@contextlib.contextmanager
def scratch(prefix: str) -> Iterator[str]:
    """A private temporary directory for the workers' arguments and output."""
    try:
        holder = tempfile.TemporaryDirectory(prefix=prefix)
    except OSError as exc:
        raise TrainguardError(f"diag could not create a scratch directory in {tempfile.gettempdir()}: {exc}") from None
    with holder as tmp:
        yield tmp


def check_timeout(value: float) -> float:
    try:
        timeout = float(value)
    except (TypeError, ValueError):
        raise TrainguardError(f"diag timeout {value!r} is not a number of seconds") from None
    if not (math.isfinite(timeout) and timeout > 0):
        raise TrainguardError(f"diag timeout {value!r} must be a positive number of seconds")
    return timeout


class Worker:
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


class Runner:
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
        from trainguard.core import procs

        return procs.terminate(procs.pids_with_env(MARKER_ENV, self.marker), grace_s=1.0)

    def _start(self, tests: list[tuple[str, dict[str, Any]]], *, env: dict[str, str] | None = None,
               deadline: float | None = None) -> Worker:
        self._count += 1
        deadline = time.monotonic() + self.timeout_s * len(tests) if deadline is None else deadline
        common = {"config": str(self.config_path), "seed": self.seed}
        return Worker(self.tmp, f"{self._count:02d}-{tests[0][0]}", tests, common, deadline=deadline,
                       env={**(env or {}), MARKER_ENV: self.marker})

    def _judge(self, name: str, worker: Worker, test: str = "collective") -> dict[str, Any]:
        """The result of ``test`` (reported as ``name``) from a finished worker."""
        out = worker.outcome(test)
        if out is not None:
            status = NOT_RUN if out.get("could_not_run") else (PASSED if out.get("ok") else FAILED)
            return make_result(name, status, worker.duration_s, out.get("details"), str(out.get("reason") or ""))
        details = {"stderr_tail": worker.stderr_tail()}
        if worker.unkillable:
            from trainguard.core.procs import proc_state

            return make_result(name, FAILED, worker.duration_s, dict(details, pid=worker.proc.pid),
                           f"did not finish within {self.timeout_s:g} s and could not be killed (pid "
                           f"{worker.proc.pid}, process state {proc_state(worker.proc.pid)})")
        if worker.aborted:
            return make_result(name, FAILED, worker.duration_s, details, f"stopped: {worker.aborted}")
        if worker.timed_out or worker.proc.returncode == -signal.SIGALRM:  # SIGALRM: the worker's own timer
            return make_result(name, FAILED, worker.duration_s, details,
                           f"did not finish within {self.timeout_s:g} s; killed")
        return make_result(name, FAILED, worker.duration_s, details, worker.death())

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
                    results[name] = make_result(name, NOT_RUN, time.monotonic() - t0,
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

    def _follow(self, worker: Worker, names: list[str]) -> tuple[str, float]:
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
        port = free_port()
        env = {"OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
        workers: list[Worker] = []
        try:
            for rank, device in enumerate(devices):
                args = {"rank": rank, "world_size": len(devices), "master_addr": "127.0.0.1", "master_port": port,
                        "backend": backend, "device": device, "all_to_all": True, "size_mib": 4, "iters": 5}
                workers.append(self._start([("collective", args)], env=env, deadline=deadline))
        except OSError as exc:
            for w in workers:
                w.kill()
            return make_result(name, NOT_RUN, time.monotonic() - t0,
                               reason=f"could not start the test processes: {exc}")
        try:
            wait_all(workers, "rank {} failed")
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
            return make_result(name, PASSED, duration, details)
        if any(w.timed_out for w in workers):
            reason = (f"the {backend} collective between {len(devices)} local processes did not finish within "
                      f"{self.timeout_s:g} s; " + "; ".join(f"{r['name']}: {r['reason']}" for r in bad))
        else:
            reason = "; ".join(f"{r['name']} ({details['ranks'][i]['device']}): {r['reason']}"
                               for i, r in enumerate(per_rank) if not r["ok"])
        return make_result(name, FAILED, duration, details, reason)

    # ---- level 3: collective with the neighbours ------------------------------------------
    def _iface(self, spec: L3Spec) -> str:
        return spec.iface or self.cfg.iface or ("lo" if is_loopback(spec.master_addr) else "")

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
            failed = make_result(name, NOT_RUN, time.monotonic() - t0,
                                 reason=f"could not start the test process: {exc}")
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


def wait_all(workers: list[Worker], why: str, *, grace_s: float = 2.0) -> None:
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


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def is_loopback(addr: str) -> bool:
    if addr == "localhost":
        return True
    try:
        return ipaddress.ip_address(addr).is_loopback
    except ValueError:
        return False
