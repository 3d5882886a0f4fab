"""The emulated NVML backend: the state of a machine's GPUs in a JSON file.

The fault injector (:mod:`trainguard.emulation.inject`) changes that file (GPU lost, Xid, uncorrectable ECC,
overheating), so the agent's checks run unchanged on machines without GPUs. A machine whose configuration says
``nvml_backend: "emulated"`` gets it through the ``trainguard.nvml_backends`` entry point
(:func:`trainguard.node_tools.nvml.backend_for`); a node installed without the emulation has no such backend
and says so.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trainguard.core.errors import FaultError, TrainguardError
from trainguard.core.files import write_json_atomic
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.nvml import GpuBackend, NvmlUnavailable

THERMAL_REASONS = ["hw_thermal_slowdown", "sw_thermal_slowdown"]


# ---------------------------------------------------------------------------------------
def healthy_device(machine: str, index: int) -> dict[str, Any]:
    return {
        "index": index,
        "uuid": f"GPU-emulated-{machine}-{index}",
        "name": "Emulated GPU",
        "present": True,
        "temperature_c": 42,
        "throttle_reasons": [],
        "ecc_uncorrectable": 0,
        "remap_pending": False,
        "pcie_gen": 5,
        "pcie_width": 16,
        "pcie_max_gen": 5,
        "pcie_max_width": 16,
    }


def healthy_state(machine: str, gpus: int) -> dict[str, Any]:
    return {
        "driver_version": "emulated",
        "devices": [healthy_device(machine, i) for i in range(gpus)],
        "xid_events": [],
    }


class EmulatedNvml(GpuBackend):
    """GPU state read from (and faults written to) a JSON file."""

    name = "emulated"

    def __init__(self, state_file: Path, *, machine: str = "machine", gpus: int = 8) -> None:
        self.state_file = Path(state_file)
        self.machine = machine
        self.gpus = gpus

    def _read(self) -> dict[str, Any]:
        try:
            return json.loads(self.state_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return healthy_state(self.machine, self.gpus)
        except (OSError, ValueError) as exc:
            raise NvmlUnavailable(f"emulated NVML state {self.state_file} is unreadable: {exc}") from None

    def _write(self, state: dict[str, Any]) -> None:
        write_json_atomic(self.state_file, state, indent=1, make_parent=False)

    def reset(self) -> None:
        self._write(healthy_state(self.machine, self.gpus))

    def snapshot(self) -> dict[str, Any]:
        state = self._read()
        devices = [
            {k: v for k, v in d.items() if k != "present"} for d in state["devices"] if d.get("present", True)
        ]
        return {
            "backend": self.name,
            "driver_version": state.get("driver_version", "emulated"),
            "device_count": len(devices),
            "devices": devices,
            "xid_events": list(state.get("xid_events", [])),
        }

    def inject(self, kind: str, params: dict[str, Any]) -> dict[str, Any]:
        """Apply a GPU fault; returns what changed."""
        state = self._read()
        gpu = int(params.get("gpu", 0))
        devices = state["devices"]
        if not 0 <= gpu < len(devices):
            raise FaultError(f"machine {self.machine} has GPUs 0..{len(devices) - 1}; there is no GPU {gpu}")
        dev = devices[gpu]
        now = time.time()
        if kind == "gpu_lost":
            dev["present"] = False
            state["xid_events"].append({"gpu": gpu, "xid": 79, "ts": now})
        elif kind == "xid":
            state["xid_events"].append({"gpu": gpu, "xid": int(params.get("xid", 79)), "ts": now})
        elif kind == "ecc":
            dev["ecc_uncorrectable"] = int(dev.get("ecc_uncorrectable", 0)) + 1
            dev["remap_pending"] = True
            state["xid_events"].append({"gpu": gpu, "xid": 48, "ts": now})
        elif kind == "thermal":
            dev["temperature_c"] = int(params.get("temperature_c", 96))
            dev["throttle_reasons"] = list(THERMAL_REASONS)
        else:
            raise FaultError(f"{kind!r} is not a GPU fault")
        self._write(state)
        return {"gpu": gpu, "kind": kind, "device": dev}


def backend(config: NodeConfig) -> EmulatedNvml:
    """The backend of a machine whose configuration selects ``emulated`` (the entry point's target)."""
    if config.nvml_state is None:
        raise TrainguardError(f"machine {config.machine}: emulated NVML needs nvml_state in its node config")
    return EmulatedNvml(config.nvml_state, machine=config.machine, gpus=config.gpus)
