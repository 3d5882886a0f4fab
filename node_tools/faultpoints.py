"""The points where a test harness may make a training rank or a machine's diagnostics go wrong.

The in-job hook (:class:`trainguard.node_tools.monitor.JobMonitor`), the training faces and the
diagnostics call these points at each step, collective, loss and gradient. On a real fleet they are
:class:`FaultPoints`' own methods and do nothing. A harness that needs them live (the emulated
cluster: ``trainguard.emulation.faults``) registers a factory in the entry point group
``trainguard.fault_points``; :func:`load` asks it only when the machine names a fault control file
(``$TG_FAULT_FILE`` in a rank, ``fault_file`` in the node configuration). A node installed without
the harness gets the inert points and a one-line warning when a control file is named anyway.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

FAULT_POINTS_GROUP = "trainguard.fault_points"


class FaultPoints:
    """Inert fault points: every method leaves the training as it is."""

    def active(self, kind: str) -> dict[str, Any] | None:
        """The parameters of a fault of ``kind`` active for this rank now, else None."""
        return None

    def before_step(self, step: int) -> None:
        """Called before each step (a harness may sleep here, or exit)."""

    def before_collective(self, group: str, op: str) -> None:
        """Called before each collective the hook counts (a harness may block here)."""

    def clock_offset(self) -> float:
        """Seconds this rank's clock is off by."""
        return 0.0

    def corrupt_loss(self, loss: Any) -> Any:
        """The step's loss as the rank computes it."""
        return loss

    def corrupt_grads(self, tensors: list[Any]) -> bool:
        """Gradients after the all-reduce; True when a harness changed one."""
        return False

    def corrupt_compute(self, tensor: Any) -> bool:
        """A diagnostic's compute result (a matmul, a gradient) as the machine's ALU produced it; True when
        a harness changed it (silent data corruption)."""
        return False


def load(control_path: Path | str | None, *, rank: int, local_rank: int = 0) -> FaultPoints:
    """The fault points for one rank (``rank`` -1: the machine's diagnostics): inert without a control file,
    else the registered harness's."""
    if not control_path:
        return FaultPoints()
    from trainguard.node_tools.plugins import load_group

    for _name, factory in load_group(FAULT_POINTS_GROUP):
        return factory(Path(control_path), rank=rank, local_rank=local_rank)
    print(f"trainguard: fault control file {control_path} is named but no fault points are installed "
          f"(entry point group {FAULT_POINTS_GROUP}); the rank runs without them", file=sys.stderr, flush=True)
    return FaultPoints()


def from_env(*, rank: int, local_rank: int = 0) -> FaultPoints:
    """The fault points of a rank that ``tg-node job start`` launched (``$TG_FAULT_FILE``)."""
    import os

    return load(os.environ.get("TG_FAULT_FILE") or None, rank=rank, local_rank=local_rank)
