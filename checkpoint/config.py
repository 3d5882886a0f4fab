"""Configuration of the checkpoint library, and where a rank's checkpoint root is.

A rank's root is a directory on its machine's local disk. It comes from, in
order: the explicit ``root`` template, ``TG_CHECKPOINT`` (set by ``tg-node job
start``; an ``s3://`` value there names the S3 tier instead), and
``<TG_RUN_DIR>/checkpoints``. The template may contain ``{machine}`` (the
machine index in the job's topology), ``{rank}`` and ``{local_rank}``, which lets
one host emulate several machines, each with a disk of its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainguard.checkpoint.errors import CheckpointError

RESTORE_MODES = ("auto", "require", "off")
SAVERS = ("process", "thread")


@dataclass
class CheckpointConfig:
    """What the checkpoint library does for one rank.

    Attributes:
        root: the rank's checkpoint root on its machine's local disk (already expanded).
        every_steps: take a snapshot after every this many steps (1 = every step). Steps.
        keep: steps kept per rank on local disk and on replica holders (the newest committed
            or in-flight ones; the newest committed and the newest verified step are always
            kept on top). Steps.
        s3_url: the remote tier: ``s3://bucket/prefix``, or ``file:///dir`` on storage every machine mounts;
            "" = no remote tier.
        s3_every_steps: upload a snapshot to S3 after every this many steps (0 = only on
            demand: :meth:`Checkpointer.request_s3` or a ``s3-request`` file in the root). Steps.
        s3_endpoint_url: endpoint of an S3-compatible store; "" = boto3's default (AWS,
            or ``AWS_ENDPOINT_URL_S3``).
        s3_keep: snapshots kept per rank in S3 (the newest verified one on top). Steps.
        verify_every_steps: every this many steps a committed snapshot is a *verification candidate*:
            its ``committed.json`` says ``"verify": true`` (the node agent announces it to the control
            plane, whose ``tg_checkpoint_verify`` checks and marks it), and retention keeps the two
            newest candidates newer than the newest verified step until then. 0 = none. Steps.
        restore: "auto" (restore the newest usable step if any copy exists; refuse to
            start from scratch when copies exist but none is usable), "require" (fail if
            nothing is restorable) or "off" (start from step 0, keep existing copies).
        restore_max_step: restore no step newer than this (None = no limit): after silent data
            corruption the newer steps hold corrupted parameters. Steps.
        replicate: send each snapshot to the rank's backup rank (off only for tests and
            single-machine jobs, where it is switched off on its own).
        fsync: fsync files and directories of local copies (off only for throwaway runs).
        ranks_per_machine: ranks sharing one machine for replica placement; 0 = torchrun's
            ``LOCAL_WORLD_SIZE``. Set it to emulate several machines on one host. Ranks.
        machine: this machine's name in reports; "" = ``TG_MACHINE`` or the host name.
        commit_interval_s: how often at most the ranks exchange which steps they hold, to learn
            which are committed everywhere (a tiny all-gather on the checkpoint group); a rank joins the
            next exchange once it has a newly persisted step to say (or after 2 s without one). Seconds.
        control_timeout_s: timeout of each collective on the checkpoint control group. Seconds.
        replica_timeout_s: timeout of each replica transfer; a dead peer is noticed at once
            (its sockets close), this only bounds a live but stuck one. Seconds.
        s3_timeout_s: connect and read timeout of each S3 request. Seconds.
        copy_at_idle: copy a CPU-resident state into its snapshot buffer while the host idles (from
            :meth:`~trainguard.checkpoint.engine.Checkpointer.host_idle` of the next step), not in ``after_step``: the
            CPU counterpart of the copy on a side CUDA stream, for a host whose training thread waits for an
            accelerator (the benchmark's emulated device). The loop must then call ``before_update()``
            before anything changes the state. When the next step never reaches its idle moment (a hang)
            the copy runs on its own deadline (twice the loop's usual time to it, at least 0.25 s); a
            failing rank's ``close(flush=False)`` still hands it to the saver process; a snapshot whose
            copy had not started by the next ``after_step`` is dropped, never taken from a changed state.
            Meant for the saver process (the reference job sets it only then). GPU states ignore it
            (their copy is already asynchronous).
        measure_memcpy: also time a plain copy of the same state into a spare buffer after
            each snapshot (the benchmark's reference; costs one extra copy per step).
        saver: where snapshots are persisted: "process" (the default: a saver process on the machine,
            outside the training process, that also keeps the newest snapshot in memory for a restart on
            this machine: :mod:`trainguard.checkpoint.saver`) or "thread" (background threads of the training process).
        backpressure_wait_s: when both snapshot buffers are still being persisted at a due step, the step
            waits this long at most for one to be freed (the saver is told to persist at once: the host
            idles); a wait that runs out skips the snapshot, and due steps skip without waiting until a buffer
            is freed. Waiting keeps the ranks' snapshots the same steps, so a persister that is merely slower
            than the steps never costs a commit; 0 = skip at once (ranks may then skip different steps). Keep
            it well below the node agent's floor for calling a rank hung (5 s): a rank waiting here makes no
            progress. Seconds.
        saver_idle_s: a saver process ends after this long with no rank connected (its memory
            snapshots with it). Seconds.
        background_nice: nice increment of the background threads (Linux: per thread), so that
            on a host whose CPUs the training itself keeps busy the scheduler runs training
            first; when the background then falls behind, the steps wait for it (``backpressure_wait_s``).
            0 = same priority as training. Nice levels (0..19).
    """

    root: Path
    every_steps: int = 1
    keep: int = 3
    s3_url: str = ""
    s3_every_steps: int = 10
    s3_endpoint_url: str = ""
    s3_keep: int = 3
    verify_every_steps: int = 0
    restore: str = "auto"
    restore_max_step: int | None = None
    replicate: bool = True
    fsync: bool = True
    ranks_per_machine: int = 0
    machine: str = ""
    commit_interval_s: float = 0.25
    control_timeout_s: float = 600.0
    replica_timeout_s: float = 3600.0
    s3_timeout_s: float = 5.0
    measure_memcpy: bool = False
    copy_at_idle: bool = False
    saver: str = "process"
    saver_idle_s: float = 600.0
    backpressure_wait_s: float = 2.0
    background_nice: int = 10

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        if self.every_steps < 1:
            raise CheckpointError(f"checkpoint every {self.every_steps} steps: must be >= 1 (or disable checkpoints)")
        if self.keep < 1 or self.s3_keep < 1:
            raise CheckpointError(f"checkpoint keep={self.keep}, s3 keep={self.s3_keep}: both must be >= 1")
        if not 0 <= self.background_nice <= 19:
            raise CheckpointError(f"checkpoint background nice {self.background_nice}: must be 0..19")
        if self.verify_every_steps < 0:
            raise CheckpointError(f"checkpoint verify every {self.verify_every_steps} steps: must be >= 0")
        if self.s3_every_steps < 0:
            raise CheckpointError(f"checkpoint S3 every {self.s3_every_steps} steps: must be >= 0")
        if self.restore_max_step is not None and self.restore_max_step < 0:
            raise CheckpointError(f"checkpoint restore max step {self.restore_max_step}: must be >= 0")
        if not self.backpressure_wait_s >= 0:  # NaN too
            raise CheckpointError(f"checkpoint back-pressure wait {self.backpressure_wait_s}s: must be >= 0 "
                                  f"(0: skip a snapshot at once when both buffers are busy)")
        if self.saver not in SAVERS:
            raise CheckpointError(f"checkpoint saver {self.saver!r}: use one of {', '.join(SAVERS)}")
        if self.restore not in RESTORE_MODES:
            raise CheckpointError(f"checkpoint restore mode {self.restore!r}: use one of {', '.join(RESTORE_MODES)}")
        if self.s3_url and not self.s3_url.startswith(("s3://", "file:///")):
            raise CheckpointError(f"checkpoint remote tier {self.s3_url!r} must look like s3://bucket/prefix or "
                                  f"file:///shared/dir")

    def is_candidate(self, step: int) -> bool:
        """Whether ``step`` is a verification candidate (see ``verify_every_steps``)."""
        return bool(self.verify_every_steps) and (step + 1) % self.verify_every_steps == 0


def default_s3_url() -> str:
    """``TG_CHECKPOINT`` when it names an S3 location, else ""."""
    value = os.environ.get("TG_CHECKPOINT", "")
    return value if value.startswith("s3://") else ""


def root_template(explicit: str = "") -> str:
    """The root template before expansion: explicit, else ``TG_CHECKPOINT`` (a path), else the run dir's."""
    if explicit:
        return explicit
    env = os.environ.get("TG_CHECKPOINT", "")
    if env and not env.startswith("s3://"):
        return env
    return str(Path(os.environ.get("TG_RUN_DIR", "tg-run")) / "checkpoints")


def expand_root(template: str, *, machine: int, rank: int, local_rank: int) -> Path:
    """Fill ``{machine}``, ``{rank}`` and ``{local_rank}`` into a root template."""
    try:
        return Path(template.format(machine=machine, rank=rank, local_rank=local_rank))
    except (KeyError, IndexError, ValueError) as exc:
        raise CheckpointError(
            f"checkpoint root {template!r} has an unknown placeholder ({exc}); use {{machine}}, {{rank}} "
            f"or {{local_rank}}"
        ) from None
