"""Per-machine configuration of the node tools.

``tg-node`` and the training processes it starts read ``$TG_NODE_CONFIG`` (a
JSON file). The emulated cluster writes one per machine and points every ssh
session at it (sshd ``SetEnv``); a real machine can do without one, and then the
defaults below apply (real NVML, work directory ``/var/lib/trainguard``).
"""

from __future__ import annotations

import json
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from trainguard.core.errors import TrainguardError
from trainguard.core.files import write_json_atomic


def tg_home() -> Path:
    """Where trainguard keeps this host's local state (the emulated cluster, a kept demo's Airflow):
    ``$TG_HOME``, else ``./.tg``."""
    return Path(os.environ.get("TG_HOME", ".tg")).resolve()

NVML_BACKENDS = ("auto", "real", "emulated", "none")


@dataclass
class NodeConfig:
    """What a machine knows about itself.

    Attributes:
        machine: the machine's name in the inventory.
        workdir: local disk for run directories, logs and checkpoints.
        install_dir: where trainguard (and its ``examples/``) is installed.
        gpus: GPUs the machine is expected to have (a smaller count is "GPU lost").
        nvml_backend: "real" (pynvml), "emulated" (a JSON state file), "auto"
            (real if the NVML library loads, else none) or "none".
        nvml_state: the emulated backend's state file.
        fault_file: control file of the in-job fault points (emulated cluster only).
        netns: the network namespace of an emulated machine ("" elsewhere).
        iface: the network interface collectives use (GLOO/NCCL_SOCKET_IFNAME); "" lets them choose.
        bus_url: where the agent publishes alerts (``spool:///dir`` or ``s3://bucket/prefix``).
        kmsg_path: the kernel log the agent follows (``/dev/kmsg``; a file on emulated machines).
        status_path: the agent's status file (default ``<workdir>/agent/status.json``).
        agent_intervals: per-check interval overrides in seconds, by check name.
        job_nice: the scheduling niceness (0-19) of the job's processes and of the warm interpreters
            parked for it. 0 leaves them as started. Where training shares few CPU cores with the node's
            agent and tools (the emulated cluster runs several machines' ranks on one host), a positive
            value keeps detection, stops and diagnosis as quick as on a GPU machine whose ranks leave
            the CPU mostly idle; the job still gets every cycle nothing else asks for.
    """

    machine: str
    workdir: Path
    install_dir: Path
    gpus: int = 0
    nvml_backend: str = "auto"
    nvml_state: Path | None = None
    fault_file: Path | None = None
    netns: str = ""
    iface: str = ""
    bus_url: str = ""
    kmsg_path: Path | None = None
    status_path: Path | None = None
    agent_intervals: dict[str, float] | None = None
    job_nice: int = 0

    def to_dict(self) -> dict[str, object]:
        return {
            "machine": self.machine,
            "workdir": str(self.workdir),
            "install_dir": str(self.install_dir),
            "gpus": self.gpus,
            "nvml_backend": self.nvml_backend,
            "nvml_state": str(self.nvml_state) if self.nvml_state else None,
            "fault_file": str(self.fault_file) if self.fault_file else None,
            "netns": self.netns,
            "iface": self.iface,
            "bus_url": self.bus_url,
            "kmsg_path": str(self.kmsg_path) if self.kmsg_path else None,
            "status_path": str(self.status_path) if self.status_path else None,
            "agent_intervals": self.agent_intervals or {},
            "job_nice": self.job_nice,
        }

    def save(self, path: Path) -> None:
        write_json_atomic(path, self.to_dict(), indent=2)

    @classmethod
    def load(cls, path: Path) -> NodeConfig:
        try:
            raw = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise TrainguardError(f"node config {path} (from TG_NODE_CONFIG) does not exist") from None
        except (OSError, ValueError) as exc:
            raise TrainguardError(f"node config {path} is unreadable: {exc}") from None
        try:
            cfg = cls(
                machine=str(raw["machine"]),
                workdir=Path(raw["workdir"]),
                install_dir=Path(raw.get("install_dir") or Path.cwd()),
                gpus=int(raw.get("gpus", 0)),
                nvml_backend=str(raw.get("nvml_backend", "auto")),
                nvml_state=Path(raw["nvml_state"]) if raw.get("nvml_state") else None,
                fault_file=Path(raw["fault_file"]) if raw.get("fault_file") else None,
                netns=str(raw.get("netns", "")),
                iface=str(raw.get("iface", "")),
                bus_url=str(raw.get("bus_url") or ""),
                kmsg_path=Path(raw["kmsg_path"]) if raw.get("kmsg_path") else None,
                status_path=Path(raw["status_path"]) if raw.get("status_path") else None,
                agent_intervals={str(k): float(v) for k, v in (raw.get("agent_intervals") or {}).items()},
                job_nice=int(raw.get("job_nice", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise TrainguardError(f"node config {path} lacks or mistypes a field ({exc})") from None
        if cfg.nvml_backend not in NVML_BACKENDS:
            raise TrainguardError(
                f"node config {path}: nvml_backend {cfg.nvml_backend!r} is unknown; use one of "
                f"{', '.join(NVML_BACKENDS)}"
            )
        if not 0 <= cfg.job_nice <= 19:
            raise TrainguardError(f"node config {path}: job_nice {cfg.job_nice} is outside 0..19; use 0 (as "
                                  f"started) up to 19 (lowest priority)")
        return cfg

    @classmethod
    def current(cls) -> NodeConfig:
        """This machine's configuration: ``$TG_NODE_CONFIG`` if set, else the defaults."""
        path = os.environ.get("TG_NODE_CONFIG")
        if path:
            return cls.load(Path(path))
        return cls(
            machine=socket.gethostname(),
            workdir=Path(os.environ.get("TG_WORKDIR", "/var/lib/trainguard")),
            install_dir=Path(__file__).resolve().parent.parent,
        )
