"""GPU state through NVML: the real library (pynvml) or an emulated backend.

Both backends return the same snapshot document::

    {"backend": "real"|"emulated", "driver_version": str, "device_count": int,
     "devices": [{"index", "uuid", "name", "temperature_c", "throttle_reasons": [...],
                  "ecc_uncorrectable", "remap_pending", "pcie_gen", "pcie_width",
                  "pcie_max_gen", "pcie_max_width"}],
     "xid_events": [{"gpu", "xid", "ts"}]}

The emulated backend keeps the state of a machine's GPUs in a JSON file that the
fault injector changes (GPU lost, Xid, uncorrectable ECC, overheating), so the
checks above it run unchanged on machines without GPUs. The real backend needs
the NVML library; where it is missing it raises :class:`NvmlUnavailable`.
"""

from __future__ import annotations

import json
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

from trainguard.checkpoint.files import write_json_atomic
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.errors import FaultError, TrainguardError

THERMAL_REASONS = ["hw_thermal_slowdown", "sw_thermal_slowdown"]


class NvmlUnavailable(TrainguardError):
    """The NVML library could not be loaded (no driver, or no GPU on this machine)."""


class GpuBackend(ABC):
    name = "abstract"

    @abstractmethod
    def snapshot(self) -> dict[str, Any]:
        """The current state of every GPU (see the module docstring)."""


# ---------------------------------------------------------------------------------------
# Emulated
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


# ---------------------------------------------------------------------------------------
# Real NVML
# ---------------------------------------------------------------------------------------
class RealNvml(GpuBackend):
    """pynvml (the nvidia-ml-py distribution). Xid events are read by the agent's event loop."""

    name = "real"

    def __init__(self) -> None:
        try:
            import pynvml
        except ImportError:
            raise NvmlUnavailable("pynvml is not installed; install nvidia-ml-py") from None
        try:
            pynvml.nvmlInit()
        except pynvml.NVMLError as exc:
            raise NvmlUnavailable(f"NVML could not start on this machine: {exc}") from None
        self._nvml = pynvml

    def snapshot(self) -> dict[str, Any]:
        nv = self._nvml

        def opt(fn: Any, *args: Any, default: Any = None) -> Any:
            try:
                return fn(*args)
            except nv.NVMLError:
                return default

        count = nv.nvmlDeviceGetCount()
        devices = []
        for index in range(count):
            h = nv.nvmlDeviceGetHandleByIndex(index)
            reasons_mask = opt(nv.nvmlDeviceGetCurrentClocksEventReasons, h, default=0) or 0
            reasons = []
            if reasons_mask & getattr(nv, "nvmlClocksEventReasonHwThermalSlowdown", 0x40):
                reasons.append("hw_thermal_slowdown")
            if reasons_mask & getattr(nv, "nvmlClocksEventReasonSwThermalSlowdown", 0x20):
                reasons.append("sw_thermal_slowdown")
            if reasons_mask & getattr(nv, "nvmlClocksEventReasonHwPowerBrakeSlowdown", 0x80):
                reasons.append("hw_power_brake")
            remap = opt(nv.nvmlDeviceGetRemappedRows, h, default=None)
            devices.append({
                "index": index,
                "uuid": _str(opt(nv.nvmlDeviceGetUUID, h, default="")),
                "name": _str(opt(nv.nvmlDeviceGetName, h, default="")),
                "temperature_c": opt(nv.nvmlDeviceGetTemperature, h, nv.NVML_TEMPERATURE_GPU),
                "throttle_reasons": reasons,
                "ecc_uncorrectable": opt(
                    nv.nvmlDeviceGetTotalEccErrors, h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                    nv.NVML_VOLATILE_ECC, default=0,
                ),
                "remap_pending": bool(remap[2]) if remap else False,
                "pcie_gen": opt(nv.nvmlDeviceGetCurrPcieLinkGeneration, h),
                "pcie_width": opt(nv.nvmlDeviceGetCurrPcieLinkWidth, h),
                "pcie_max_gen": opt(nv.nvmlDeviceGetMaxPcieLinkGeneration, h),
                "pcie_max_width": opt(nv.nvmlDeviceGetMaxPcieLinkWidth, h),
            })
        return {
            "backend": self.name,
            "driver_version": _str(opt(nv.nvmlSystemGetDriverVersion, default="")),
            "device_count": count,
            "devices": devices,
            "xid_events": [],
        }


def _str(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def backend_for(config: NodeConfig) -> GpuBackend | None:
    """The backend this machine's configuration selects; None when it has no GPUs to watch."""
    if config.nvml_backend == "emulated":
        if config.nvml_state is None:
            raise TrainguardError(f"machine {config.machine}: emulated NVML needs nvml_state in its node config")
        return EmulatedNvml(config.nvml_state, machine=config.machine, gpus=config.gpus)
    if config.nvml_backend == "real":
        return RealNvml()
    if config.nvml_backend == "auto":
        try:
            return RealNvml()
        except NvmlUnavailable:
            return None
    return None
