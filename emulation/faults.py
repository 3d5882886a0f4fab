"""The fault catalogue, and the in-job fault points of the emulated cluster.

Each fault is real where it can be: a rank is killed or stopped by a signal, a
link is set down inside the machine's network namespace, the machine's size-
limited disk is filled. Faults that only a training process can produce (a NaN in
the loss, a flipped bit in a gradient, an exception in user code, a rank that
blocks before a collective, a slow rank) are requested through a control file
that the in-job hook (:class:`InJobFaults`) polls at each step and collective.
GPU faults go to the emulated NVML backend (``trainguard.emulation.nvml``).

The control file is ``$TG_FAULT_FILE`` (set by ``tg-node job start`` from the
machine's configuration). Without it every fault point is inert, so the hook
costs nothing on a real fleet.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.core.errors import FaultError
from trainguard.core.files import write_json_atomic
from trainguard.node_tools.faultpoints import FaultPoints


@dataclass(frozen=True)
class FaultKind:
    """One injectable fault.

    Attributes:
        name: the name used on the command line.
        target: "rank" (needs a running job) or "machine".
        summary: what happens, in one line.
        in_job: True when the training process applies it through the control file.
        once: True when the fault fires once per injection and rank rather than until cleared (a
            restarted job does not see it again: it was transient).
        recurs: with ``once``, the fault fires again in every new process of the rank (a bug in the
            code: restarting the same code meets it again).
        params: parameter names with their defaults.
    """

    name: str
    target: str
    summary: str
    in_job: bool = False
    once: bool = False
    recurs: bool = False
    params: tuple[tuple[str, Any], ...] = ()


FAULT_KINDS: dict[str, FaultKind] = {
    f.name: f
    for f in (
        FaultKind("crash", "rank", "kill the rank's process with a signal (SIGKILL)", params=(("signal", "KILL"),)),
        FaultKind("exit", "rank", "the rank exits with a non-zero code at its next step", in_job=True, once=True,
                  params=(("code", 3),)),
        FaultKind("hang", "rank", "stop the rank's process with SIGSTOP (SIGCONT on clear)"),
        FaultKind("hang_collective", "rank", "the rank blocks before its next collective until cleared",
                  in_job=True, params=(("group", ""),)),
        FaultKind("slow", "rank", "the rank sleeps before every step until cleared", in_job=True,
                  params=(("seconds", 0.5),)),
        FaultKind("nan", "rank", "the rank's loss becomes NaN at its next step", in_job=True, once=True),
        FaultKind("bitflip", "rank", "the rank's GPU computes wrong in training only: one bit of the gradient "
                  "flipped after the DP all-reduce, every step, in any job using that GPU (local rank); the "
                  "alignment test's compute is unaffected", in_job=True, params=(("bit", 22),)),
        FaultKind("user_error", "rank", "the job's own code raises an exception at the rank's next step; "
                  "the bug lives in one code revision (default: the one running), so a rollback cures it",
                  in_job=True, once=True, recurs=True, params=(("revision", ""),)),
        FaultKind("clock", "rank", "the rank's clock is off by offset_s seconds: its heartbeats and step records "
                  "are stamped that far off, until cleared", in_job=True, params=(("offset_s", -3600.0),)),
        FaultKind("sdc", "machine", "the machine computes wrong: its ranks' gradients and its diagnostic "
                  "compute get one flipped bit (silent data corruption), until cleared", in_job=True,
                  params=(("bit", 22),)),
        FaultKind("nic_down", "machine", "set the machine's network link down"),
        FaultKind("disk_full", "machine", "fill the machine's local disk"),
        FaultKind("gpu_lost", "machine", "one GPU falls off the bus (emulated NVML)", params=(("gpu", 0),)),
        FaultKind("xid", "machine", "an Xid error is raised on a GPU (emulated NVML)",
                  params=(("gpu", 0), ("xid", 79))),
        FaultKind("ecc", "machine", "an uncorrectable ECC error on a GPU (emulated NVML)", params=(("gpu", 0),)),
        FaultKind("thermal", "machine", "a GPU overheats and throttles (emulated NVML)",
                  params=(("gpu", 0), ("temperature_c", 96))),
    )
}


def fault_kind(name: str) -> FaultKind:
    try:
        return FAULT_KINDS[name]
    except KeyError:
        raise FaultError(
            f"unknown fault {name!r}; choose one of: {', '.join(FAULT_KINDS)}"
        ) from None


def resolve_params(kind: FaultKind, given: dict[str, str]) -> dict[str, Any]:
    """Merge ``given`` (strings from a command line) over the kind's defaults, typed like them."""
    defaults = dict(kind.params)
    unknown = sorted(set(given) - set(defaults))
    if unknown:
        allowed = ", ".join(defaults) or "none"
        raise FaultError(f"fault {kind.name!r} takes no parameter {', '.join(unknown)}; it takes: {allowed}")
    params: dict[str, Any] = {}
    for key, default in defaults.items():
        if key not in given:
            params[key] = default
            continue
        raw = given[key]
        try:
            params[key] = type(default)(raw) if not isinstance(default, str) else raw
        except ValueError:
            raise FaultError(
                f"fault {kind.name!r} parameter {key}={raw!r} is not a {type(default).__name__}"
            ) from None
    return params


# ---------------------------------------------------------------------------------------
# Control file shared by the host-side injector and the in-job fault points.
# ---------------------------------------------------------------------------------------
def read_control(path: Path) -> list[dict[str, Any]]:
    try:
        document = json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return []
    except (OSError, ValueError):
        return []
    faults = document.get("faults", []) if isinstance(document, dict) else []
    return [f for f in faults if isinstance(f, dict) and isinstance(f.get("kind"), str)]


def write_control(path: Path, faults: list[dict[str, Any]]) -> None:
    write_json_atomic(path, {"faults": faults}, indent=1)


def flip_bit(tensor: Any, bit: int) -> None:
    """Flip ``bit`` of the first element of a float32 tensor, in place: the emulated broken ALU."""
    import torch

    with torch.no_grad():
        flat = tensor.view(-1).view(torch.int32)
        flat[0] = flat[0] ^ ((1 << bit) if bit < 31 else -(1 << 31))


# faults of a machine's hardware that a rank's number only located: they stay with the device
DEVICE_FAULTS = frozenset({"bitflip"})


class InJobFaults(FaultPoints):
    """The fault points of a rank (or, as rank -1, of a machine's diagnostics) read from the control file.
    Registered as the ``trainguard.fault_points`` entry point: the product calls them through
    :func:`trainguard.node_tools.faultpoints.load`. Inert when there is no control file."""

    #: how often a blocked rank re-reads the control file to see whether it was cleared
    poll_interval_s = 0.2

    def __init__(self, control_path: Path | None, *, rank: int, local_rank: int = 0) -> None:
        self.control_path = Path(control_path) if control_path else None
        self.rank = rank
        self.local_rank = local_rank
        self._mtime_ns = -1
        self._active: list[dict[str, Any]] = []
        # one-shot faults this rank already fired: in this process, and (transient ones) in earlier ones
        self._fired: set[str] = self._fired_before()

    @classmethod
    def from_env(cls, *, rank: int, local_rank: int = 0) -> InJobFaults:
        path = os.environ.get("TG_FAULT_FILE")
        return cls(Path(path) if path else None, rank=rank, local_rank=local_rank)

    def _refresh(self) -> None:
        if self.control_path is None:
            return
        try:
            mtime = self.control_path.stat().st_mtime_ns
        except OSError:
            mtime = 0
        if mtime == self._mtime_ns:
            return
        self._mtime_ns = mtime
        self._active = [f for f in read_control(self.control_path) if self._mine(f)]

    def _mine(self, fault: dict[str, Any]) -> bool:
        """A device fault follows the GPU (the local rank) into any job; the others target a job's rank."""
        if fault.get("kind") in DEVICE_FAULTS and fault.get("local_rank") is not None:
            return fault["local_rank"] == self.local_rank
        return fault.get("rank") is None or fault.get("rank") == self.rank

    def active(self, kind: str) -> dict[str, Any] | None:
        """The parameters of an active fault of ``kind`` for this rank, consuming one-shot faults."""
        self._refresh()
        for fault in self._active:
            if fault["kind"] != kind:
                continue
            fid = str(fault.get("id", ""))
            revision = (fault.get("params") or {}).get("revision")
            if revision and revision != os.environ.get("TG_REVISION", ""):
                continue  # a bug of another code revision than the one this rank runs
            fk = FAULT_KINDS.get(kind)
            if fk and fk.once:
                if fid in self._fired:
                    continue
                self._fired.add(fid)
                if not fk.recurs:
                    self._mark_fired(fid)
            return dict(fault.get("params") or {})
        return None

    def _fired_path(self) -> Path | None:
        return self.control_path.with_name(f"{self.control_path.name}.fired") if self.control_path else None

    def _fired_before(self) -> set[str]:
        """One-shot faults this rank fired in an earlier process (lines "rank fault-id")."""
        path = self._fired_path()
        try:
            lines = path.read_text(encoding="utf-8").splitlines() if path else []
        except OSError:
            return set()
        return {fid for rank, _, fid in (line.partition(" ") for line in lines) if rank == str(self.rank)}

    def _mark_fired(self, fid: str) -> None:
        path = self._fired_path()
        if path is None:
            return
        try:  # one short O_APPEND write: ranks of the machine may append at once
            with open(path, "a", encoding="utf-8") as fh:
                fh.write(f"{self.rank} {fid}\n")
        except OSError:
            pass  # a full disk: the fault may fire again after a restart, nothing worse

    # ---- the points the hook and the training loop call ----------------------------------
    def before_step(self, step: int) -> None:
        slow = self.active("slow")
        if slow:
            time.sleep(float(slow.get("seconds", 0.5)))
        ex = self.active("exit")
        if ex is not None:
            code = int(ex.get("code", 3))
            print(f"trainguard fault: rank {self.rank} exits with code {code} at step {step}",
                  file=sys.stderr, flush=True)
            raise SystemExit(code)

    def clock_offset(self) -> float:
        """Seconds the rank's clock is off by (a ``clock`` fault), else 0."""
        skew = self.active("clock")
        return float(skew.get("offset_s", 0.0)) if skew else 0.0

    def before_collective(self, group: str, op: str) -> None:
        while True:
            hang = self.active("hang_collective")
            if hang is None or (hang.get("group") and hang.get("group") != group):
                return
            time.sleep(self.poll_interval_s)

    def corrupt_loss(self, loss: Any) -> Any:
        """Return ``loss`` made NaN when a ``nan`` fault is active (``loss`` is a tensor)."""
        if self.active("nan") is not None:
            return loss * float("nan")
        return loss

    def corrupt_grads(self, tensors: list[Any]) -> bool:
        """Flip one bit of the first float32 gradient element when a ``bitflip`` or ``sdc`` fault is active."""
        flip = self.active("bitflip") or self.active("sdc")
        if flip is None:
            return False
        import torch

        bit = int(flip.get("bit", 22))
        for tensor in tensors:
            grad = getattr(tensor, "grad", tensor)
            if grad is None or grad.dtype != torch.float32 or grad.numel() == 0:
                continue
            flip_bit(grad, bit)
            return True
        return False

    def corrupt_compute(self, tensor: Any) -> bool:
        """Flip one bit of a diagnostic's float32 result when the machine has an ``sdc`` fault."""
        sdc = self.active("sdc")
        if sdc is None:
            return False
        flip_bit(tensor, int(sdc.get("bit", 22)))
        return True
