"""What the checkpointer reports to the training loop: a step's snapshot, a finished restore."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class SnapshotInfo:
    """What one step's checkpointing cost and did.

    Attributes:
        blocking_s: time the training thread spent in the checkpointer this step. Seconds.
        taken: a snapshot of this step was copied and queued.
        skipped: the step was due but both buffers stayed busy (back-pressure: the wait ran out, or the
            persister had not freed a buffer since a wait ran out).
        waited_s: of ``blocking_s``, the time the step waited for the persister to free a buffer (0 when
            one was free, the normal case). Seconds.
        refused: the step was due but its state is not worth keeping (its gradients were not finite, or
            its data-parallel replicas disagree): not snapshotted, so the newest committed step stays the
            last good one and retention keeps it.
        memcpy_s: time of a plain copy of the same state (only with ``measure_memcpy``). Seconds.
    """

    blocking_s: float = 0.0
    taken: bool = False
    skipped: bool = False
    refused: bool = False
    memcpy_s: float | None = None
    waited_s: float = 0.0


@dataclass
class RestoreResult:
    """A finished restore.

    Attributes:
        step: the restored step (training resumes at ``data_position["next_step"]``).
        tier: where this rank's state came from: "local", "replica" or "s3".
        holder: the rank that sent it (for "replica"), else -1.
        seconds: wall time of the whole restore on this rank (inventory, plan, transfer, verify, load).
        counts: ranks per source tier, over the whole job.
        rounds: plans made (1 unless a copy failed verification on the way).
        problems: one line per copy found bad.
        data_position: the data loader position saved with the step.
    """

    step: int
    tier: str
    holder: int
    seconds: float
    counts: dict[str, int]
    rounds: int
    problems: list[str] = field(default_factory=list)
    data_position: dict[str, Any] = field(default_factory=dict)
