"""What both sides of a diagnostic share: the levels, limits and markers, the group of a level-3 run, a test's
result document, and the helpers of the tests that run in worker processes."""

from __future__ import annotations

import errno
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.core.errors import EXIT_OK, EXIT_UNHEALTHY, EXIT_USAGE, TrainguardError
from trainguard.node_tools.config import NodeConfig
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


def tests_verdict(tests: list[dict[str, Any]]) -> tuple[int, bool]:
    if any(t["status"] == FAILED for t in tests):
        return EXIT_UNHEALTHY, False
    if any(t["status"] == NOT_RUN for t in tests):
        return EXIT_USAGE, False
    return EXIT_OK, True


def make_result(name: str, status: str, duration_s: float, details: dict[str, Any] | None = None,
            reason: str = "") -> dict[str, Any]:
    return {"name": name, "ok": status == PASSED, "status": status, "duration_s": round(duration_s, 3),
            "details": details or {}, "reason": reason}


def emit(event: str, **fields: Any) -> None:
    sys.stdout.write(MARK + json.dumps({"event": event, **fields}, default=str) + "\n")
    sys.stdout.flush()


def done(ok: bool, details: dict[str, Any], reason: str = "", *, could_not_run: bool = False) -> dict[str, Any]:
    return {"ok": ok, "details": details, "reason": reason, "could_not_run": could_not_run}


def load_cfg(args: dict[str, Any]) -> NodeConfig:
    return NodeConfig.load(Path(args["config"]))


def fault_points(cfg: NodeConfig) -> FaultPoints:
    from trainguard.node_tools import faultpoints

    return faultpoints.load(cfg.fault_file, rank=-1)


def os_error(exc: OSError, what: str) -> str:
    code = exc.errno
    name = errno.errorcode.get(code, "?") if code is not None else "?"
    return f"{what}: errno {code} ({name}) {exc.strerror or exc}"


def finite(value: float) -> float | str:
    """A number for a JSON document: inf and NaN as strings (strict JSON has neither)."""
    return value if math.isfinite(value) else str(value)

