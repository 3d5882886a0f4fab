"""Replica groups on this host, for the tests and the benchmark of :mod:`trainguard.replicas`: a torchft
lighthouse and one ``torchrun`` per group running ``examples/replicas`` (each group's rank with its own step
records), a rank killed the way a machine loses it, and what the step records say afterwards."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil

from trainguard.emulation.standalone import free_port

REPO = Path(__file__).resolve().parent.parent


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """The step records of a group's rank 0 (a torn last line left out)."""
    path = run_dir / "ranks" / "rank0.steps.jsonl"
    out = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


class Lighthouse:
    """A ``torchft_lighthouse`` on this host at ``address`` (the cluster's bridge address, where every machine's
    namespace reaches it), as a deployment runs one outside a job's machines; its output goes to ``log``."""

    def __init__(self, address: str, log: Path, *, heartbeat_timeout_ms: int = 2000, join_timeout_ms: int = 1000
                 ) -> None:
        self.address, self.port, self.log = address, free_port(), log
        self.heartbeat_ms, self.join_ms = heartbeat_timeout_ms, join_timeout_ms
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.address}:{self.port}"

    def start(self) -> Lighthouse:
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(
                [str(Path(sys.executable).parent / "torchft_lighthouse"), "--min_replicas", "1", "--quorum_tick_ms",
                 "100", "--join_timeout_ms", str(self.join_ms), "--heartbeat_timeout_ms", str(self.heartbeat_ms),
                 "--bind", f"{self.address}:{self.port}"],
                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def rank_digests(run_dir: Path) -> dict[int, str]:
    """The state digests (``digest STEP HEX`` lines of ``examples/replicas``) a job's ranks printed on this machine
    (its ``logs/`` under ``run_dir``), by step."""
    found: dict[int, str] = {}
    for log in sorted(run_dir.glob("logs/**/stdout.log")):
        found.update(digests_in(log.read_text(errors="replace")))
    return found


def digests_in(text: str) -> dict[int, str]:
    """The ``digest STEP HEX`` lines of a log (torchrun may prefix each line with the rank's tag), by step."""
    found: dict[int, str] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[-3] == "digest" and parts[-2].isdigit():
            found[int(parts[-2])] = parts[-1]
    return found


class ReplicaRun:
    """``groups`` replica groups of ``examples/replicas`` under one lighthouse, in ``folder``."""

    def __init__(self, folder: Path, *, groups: int = 2, steps: int = 150, step_s: float = 0.05,
                 heartbeat_timeout_ms: int = 2000, digest_every: int = 10, args: list[str] | None = None,
                 env: dict[int, dict[str, str]] | None = None) -> None:
        self.folder, self.n, self.steps = folder, groups, steps
        self.args, self.env = list(args or []), dict(env or {})  # more arguments for every group; a group's variables
        self.step_s, self.heartbeat_ms, self.digest_every = step_s, heartbeat_timeout_ms, digest_every
        self.runs = {i: folder / f"replica{i}" for i in range(groups)}
        self.lighthouse: Lighthouse | None = None
        self.groups: dict[int, subprocess.Popen[bytes]] = {}
        self._logs: list[Any] = []

    def start(self) -> None:
        self.lighthouse = Lighthouse("127.0.0.1", self.folder / "lighthouse.log",
                                     heartbeat_timeout_ms=self.heartbeat_ms).start()
        for i in range(self.n):
            env = {**os.environ, "TORCHFT_LIGHTHOUSE": self.lighthouse.url, "TG_REPLICA": str(i),
                   "TG_REPLICA_HOST": "127.0.0.1", "TG_RUN_DIR": str(self.runs[i]), "PYTHONPATH": str(REPO),
                   "OMP_NUM_THREADS": "1"}
            env.pop("TG_FAULT_FILE", None)
            env.update(self.env.get(i, {}))
            self.groups[i] = subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1",
                 "--max-restarts", "3", "--monitor-interval", "0.5", "--master-addr", "127.0.0.1",
                 "--master-port", str(free_port()), "-m", "examples.replicas.train", "--steps", str(self.steps),
                 "--step-time-s", str(self.step_s), "--digest-every", str(self.digest_every), *self.args],
                env=env, cwd=REPO, stdout=self._open(self.log(i)), stderr=subprocess.STDOUT, start_new_session=True)

    def _open(self, path: Path) -> Any:
        fh = open(path, "wb")  # noqa: SIM115 - the child's output, closed in stop()
        self._logs.append(fh)
        return fh

    def log(self, i: int) -> Path:
        return self.folder / f"group{i}.log"

    def records(self, i: int) -> list[dict[str, Any]]:
        return read_records(self.runs[i])

    def kill(self, i: int) -> float:
        """SIGKILL group ``i``'s training rank (torchrun restarts it); returns when (wall clock)."""
        workers = [c for c in psutil.Process(self.groups[i].pid).children(recursive=True)
                   if "examples.replicas.train" in " ".join(c.cmdline())]
        if len(workers) != 1:
            raise RuntimeError(f"group {i} runs {len(workers)} training ranks, not 1: {workers}")
        at = time.time()
        workers[0].send_signal(signal.SIGKILL)
        return at

    def finish(self, timeout: float = 180.0) -> dict[int, int]:
        """Wait for every group to end; their exit codes."""
        return {i: p.wait(timeout=timeout) for i, p in self.groups.items()}

    def stop(self) -> None:
        if self.lighthouse is not None:
            self.lighthouse.stop()
        for p in self.groups.values():
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
        for fh in self._logs:
            fh.close()
        self._logs.clear()

    def digests(self, i: int) -> dict[int, str]:
        """The state digests group ``i`` logged, by step."""
        return digests_in(self.log(i).read_text(errors="replace"))
