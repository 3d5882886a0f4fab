"""GPU state through NVML: the real library (pynvml), or a backend another package registers.

Every backend returns the same snapshot document::

    {"backend": "real"|"emulated", "driver_version": str, "device_count": int,
     "devices": [{"index", "uuid", "name", "temperature_c", "throttle_reasons": [...],
                  "ecc_uncorrectable", "remap_pending", "pcie_gen", "pcie_width",
                  "pcie_max_gen", "pcie_max_width"}],
     "xid_events": [{"gpu", "xid", "ts"}]}

The emulated cluster's backend (``trainguard.emulation.nvml``, through the ``trainguard.nvml_backends``
entry point) keeps the state of a machine's GPUs in a JSON file that its fault injector changes, so the
checks above it run unchanged on machines without GPUs. The real backend needs the NVML library; where
it is missing it raises :class:`NvmlUnavailable`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.node_tools.config import NodeConfig


class NvmlUnavailable(TrainguardError):
    """The NVML library could not be loaded (no driver, or no GPU on this machine)."""


class GpuBackend(ABC):
    name = "abstract"

    @abstractmethod
    def snapshot(self) -> dict[str, Any]:
        """The current state of every GPU (see the module docstring)."""


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


NVML_BACKENDS_GROUP = "trainguard.nvml_backends"


def backend_for(config: NodeConfig) -> GpuBackend | None:
    """The backend this machine's configuration selects; None when it has no GPUs to watch.

    ``real`` and ``auto`` are this module's, ``none`` is no backend; ``emulated`` (the one other name a node
    configuration accepts) is looked up in the entry point group ``trainguard.nvml_backends``, which the
    emulation fills: a function of the node configuration that returns a :class:`GpuBackend`.
    """
    if config.nvml_backend not in ("real", "auto", "none"):
        from trainguard.node_tools.plugins import load_group

        make = dict(load_group(NVML_BACKENDS_GROUP)).get(config.nvml_backend)
        if make is None:
            raise TrainguardError(
                f"machine {config.machine}: nvml_backend {config.nvml_backend!r} is not installed on this node; "
                f"set nvml_backend to real, auto or none in its node config")
        return make(config)
    if config.nvml_backend == "real":
        return RealNvml()
    if config.nvml_backend == "auto":
        try:
            return RealNvml()
        except NvmlUnavailable:
            return None
    return None
