"""The real-time checks of a machine. None of them puts load on a GPU.

Each check is an object with an interval and a ``run(now)`` that returns
:class:`Finding` objects: conditions that hold right now. The agent turns a
condition that starts into one alert (and says nothing more until it clears);
``tg-node check`` runs the checks once and reports what they find.

===============  ========  ==============================================================
check            interval  finds
===============  ========  ==============================================================
KernelLogCheck   1 s       Xid, machine checks, OOM kills, file-system errors, link downs
GpuCheck         5 s       missing GPUs, Xid events, uncorrectable ECC / pending remaps,
                           heat and thermal throttling, PCIe link below its maximum
NicCheck         5 s       no carrier / link down, growing error counters
DiskCheck        1 s       work directory nearly full, or read-only
RankCheck        0.25 s    rank exited, heartbeat stopped, no progress beyond a calibrated
                           timeout, NaN or 5x jumps in loss and gradient norm, slow steps,
                           a sustained decline of the job's throughput
===============  ========  ==============================================================

The rank check lives in :mod:`trainguard.node_tools.rankcheck`.
"""

from __future__ import annotations

import json
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.node_tools.nvml import GpuBackend


@dataclass
class Finding:
    """A condition that holds now. ``key`` identifies it across runs (same key = same condition)."""

    kind: str
    key: str
    message: str
    severity: str = "fault"
    job: str = ""
    rank: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "key": self.key, "severity": self.severity, "message": self.message,
                "job": self.job, "rank": self.rank, "evidence": self.evidence}


class Check(ABC):
    name = "check"
    group = "host"  # for 'tg-node check <group>': gpu, host, net, disk
    interval_s = 5.0

    @abstractmethod
    def run(self, now: float) -> list[Finding]: ...


# ---------------------------------------------------------------------------------------
# Kernel log
# ---------------------------------------------------------------------------------------
KERNEL_PATTERNS: list[tuple[str, re.Pattern[str]]] = [
    ("kernel_xid", re.compile(r"NVRM: Xid \(PCI:(?P<pci>[^)]*)\): (?P<xid>\d+)")),
    ("kernel_mce", re.compile(r"(Machine check events logged|mce: \[Hardware Error\])")),
    ("kernel_oom", re.compile(r"Out of memory: Killed process (?P<pid>\d+) \((?P<comm>[^)]*)\)")),
    ("kernel_fs", re.compile(r"(EXT4-fs error|XFS .*(Corruption|I/O error)|Remounting filesystem read-only)")),
    ("kernel_link", re.compile(r"(?P<iface>\S+): Link is Down")),
]


class KernelLogCheck(Check):
    """Follows the kernel log (``/dev/kmsg``, or a file on emulated machines) from where it was at start."""

    name, group, interval_s = "kernel", "host", 1.0

    def __init__(self, path: Path, *, from_start: bool = False) -> None:
        self.path = Path(path)
        self.offset = 0 if from_start else self._size()
        self.counter = 0

    def _size(self) -> int:
        try:
            return self.path.stat().st_size if self.path.is_file() else 0
        except OSError:
            return 0

    def _lines(self) -> list[str]:
        if str(self.path) == "/dev/kmsg":
            return self._kmsg_lines()
        try:
            size = self.path.stat().st_size
        except OSError:
            return []
        if size < self.offset:  # rotated or truncated
            self.offset = 0
        with open(self.path, encoding="utf-8", errors="replace") as fh:
            fh.seek(self.offset)
            data = fh.read()
        complete = data.rsplit("\n", 1)[0] if "\n" in data else ""
        self.offset += len(complete.encode()) + (1 if complete else 0)
        return complete.splitlines() if complete else []

    def _kmsg_lines(self) -> list[str]:
        lines = []
        try:
            fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return []
        try:
            if self.offset == 0:
                os.lseek(fd, 0, os.SEEK_END)
                self.offset = 1
            while True:
                try:
                    rec = os.read(fd, 8192)
                except BlockingIOError:
                    break
                except OSError:
                    continue  # EPIPE: messages were overwritten; go on with the next
                if not rec:
                    break
                lines.append(rec.decode(errors="replace").split(";", 1)[-1].rstrip("\n"))
        finally:
            os.close(fd)
        return lines

    def run(self, now: float) -> list[Finding]:
        found = []
        for line in self._lines():
            for kind, pattern in KERNEL_PATTERNS:
                m = pattern.search(line)
                if m:
                    self.counter += 1
                    # each line is its own event: a unique key, so every one is reported
                    found.append(Finding(kind, f"{kind}:{self.counter}", line.strip()[:300],
                                         evidence={"line": line.strip()[:500], **m.groupdict()}))
                    break
        return found


# ---------------------------------------------------------------------------------------
# GPU
# ---------------------------------------------------------------------------------------
class GpuCheck(Check):
    name, group, interval_s = "gpu", "gpu", 5.0

    def __init__(self, backend: GpuBackend, *, expected: int, max_temp_c: int = 87) -> None:
        self.backend = backend
        self.expected = expected
        self.max_temp_c = max_temp_c
        self.xids_seen: set[tuple[Any, Any, Any]] = set()

    def run(self, now: float) -> list[Finding]:
        snap = self.backend.snapshot()
        found: list[Finding] = []
        if snap["device_count"] < self.expected:
            present = [d["index"] for d in snap["devices"]]
            missing = [i for i in range(self.expected) if i not in present] if present or self.expected else []
            found.append(Finding("gpu_lost", "gpu_lost", f"{snap['device_count']} of {self.expected} GPUs visible",
                                 evidence={"visible": snap["device_count"], "expected": self.expected,
                                           "missing": missing}))
        events = snap.get("xid_events", [])
        current = set()
        for event in events:
            ident = (event.get("ts"), event.get("gpu"), event.get("xid"))
            current.add(ident)
            if ident not in self.xids_seen:
                found.append(Finding("gpu_xid", f"xid:{event.get('ts')}:{event.get('gpu')}",
                                     f"Xid {event.get('xid')} on GPU {event.get('gpu')}", evidence=dict(event)))
        self.xids_seen = current  # forget events the log no longer holds (driver reload, emulator reset)
        for dev in snap["devices"]:
            i = dev["index"]
            if (dev.get("ecc_uncorrectable") or 0) > 0 or dev.get("remap_pending"):
                found.append(Finding("gpu_ecc", f"ecc:{i}", f"GPU {i}: uncorrectable ECC errors "
                                     f"{dev.get('ecc_uncorrectable')}, remap pending {dev.get('remap_pending')}",
                                     evidence={"gpu": i, "ecc_uncorrectable": dev.get("ecc_uncorrectable"),
                                               "remap_pending": dev.get("remap_pending")}))
            temp = dev.get("temperature_c")
            thermal = [r for r in dev.get("throttle_reasons", []) if "thermal" in r]
            if (temp is not None and temp >= self.max_temp_c) or thermal:
                found.append(Finding("gpu_thermal", f"thermal:{i}", f"GPU {i}: {temp} C, throttle {thermal}",
                                     severity="warning" if not thermal else "fault",
                                     evidence={"gpu": i, "temperature_c": temp, "throttle_reasons": thermal}))
            gen, width = dev.get("pcie_gen"), dev.get("pcie_width")
            below = gen and width and (gen < (dev.get("pcie_max_gen") or gen)
                                       or width < (dev.get("pcie_max_width") or width))
            if below:
                found.append(Finding("gpu_pcie", f"pcie:{i}", f"GPU {i}: PCIe gen{gen} x{width} below its maximum",
                                     severity="warning", evidence={"gpu": i, "gen": gen, "width": width,
                                                                   "max_gen": dev.get("pcie_max_gen"),
                                                                   "max_width": dev.get("pcie_max_width")}))
        return found


# ---------------------------------------------------------------------------------------
# Network
# ---------------------------------------------------------------------------------------
class NicCheck(Check):
    """Link state and error counters of the interface the job's collectives use."""

    name, group, interval_s = "nic", "net", 5.0
    COUNTERS = ("rx_errors", "tx_errors", "rx_crc_errors", "rx_dropped", "tx_carrier_errors")

    def __init__(self, iface: str, *, sysfs: Path = Path("/sys/class/net")) -> None:
        self.iface = iface
        self.dir = sysfs / iface
        self.last: dict[str, int] | None = None

    def _read(self, name: str) -> str | None:
        try:
            return (self.dir / name).read_text().strip()
        except OSError:
            return None

    def run(self, now: float) -> list[Finding]:
        operstate = self._read("operstate")
        if operstate is None:
            return [Finding("nic_down", f"nic:{self.iface}", f"interface {self.iface} does not exist",
                            evidence={"iface": self.iface, "operstate": None})]
        carrier = self._read("carrier")
        found = []
        if operstate.lower() == "down" or carrier == "0":
            found.append(Finding("nic_down", f"nic:{self.iface}", f"{self.iface} is {operstate} (carrier {carrier})",
                                 evidence={"iface": self.iface, "operstate": operstate, "carrier": carrier}))
        counters = {}
        for c in self.COUNTERS:
            value = self._read(f"statistics/{c}")
            if value is not None and value.isdigit():
                counters[c] = int(value)
        if self.last is not None:
            grown = {c: counters[c] - self.last.get(c, 0) for c in counters if counters[c] > self.last.get(c, 0)}
            grown.pop("rx_dropped", None)  # drops happen on healthy links; not an error by themselves
            if grown:
                found.append(Finding("nic_errors", f"nicerr:{self.iface}",
                                     f"{self.iface} error counters grew: {grown}",
                                     evidence={"iface": self.iface, "delta": grown}))
        self.last = counters
        return found


# ---------------------------------------------------------------------------------------
# Disk
# ---------------------------------------------------------------------------------------
class DiskCheck(Check):
    """One ``statvfs`` a second (a system call, no I/O): a full disk fails the job's next checkpoint write
    within a step, and its alert should be there when the rank's exit is, so the incident is the machine's
    fault (evict at once) and not a crash to diagnose."""

    name, group, interval_s = "disk", "disk", 1.0

    def __init__(self, path: Path, *, min_free_bytes: int = 64 << 20, min_free_fraction: float = 0.02) -> None:
        self.path = Path(path)
        self.min_free_bytes = min_free_bytes
        self.min_free_fraction = min_free_fraction

    def run(self, now: float) -> list[Finding]:
        try:
            st = os.statvfs(self.path)
        except OSError as exc:
            return [Finding("disk_readonly", f"disk:{self.path}", f"{self.path} is not accessible: {exc.strerror}",
                            evidence={"path": str(self.path), "error": exc.strerror})]
        found = []
        total = st.f_blocks * st.f_frsize
        free = st.f_bavail * st.f_frsize
        limit = min(self.min_free_bytes, self.min_free_fraction * total) if total else self.min_free_bytes
        if free < limit:
            found.append(Finding("disk_full", f"diskfull:{self.path}",
                                 f"{self.path}: {free / 2**20:.1f} MiB free of {total / 2**20:.0f} MiB",
                                 evidence={"path": str(self.path), "free_bytes": free, "total_bytes": total}))
        if st.f_flag & os.ST_RDONLY:
            found.append(Finding("disk_readonly", f"diskro:{self.path}", f"{self.path} is mounted read-only",
                                 evidence={"path": str(self.path)}))
        return found


class CheckpointCheck(Check):
    """Announces verification candidates: when rank 0 of a job on this machine has committed a step its
    checkpointer marked for verification (``committed.json`` with ``"verify": true``), one
    ``checkpoint_committed`` notice (severity info) for the newest such step. Only the machine holding
    rank 0's own copy speaks, so a thousand machines make one notice per candidate, not a thousand."""

    name, group, interval_s = "checkpoints", "disk", 2.0

    def __init__(self, workdir: Path) -> None:
        self.jobs_dir = Path(workdir) / "jobs"
        self.workdir = Path(workdir)

    def run(self, now: float) -> list[Finding]:
        from trainguard.node_tools.ckpt import checkpoint_root, newest_candidate
        from trainguard.node_tools.config import NodeConfig

        found: list[Finding] = []
        try:
            entries = sorted(self.jobs_dir.iterdir())
        except OSError:
            return []
        cfg = NodeConfig(machine="", workdir=self.workdir, install_dir=self.workdir)
        for d in entries:
            record = read_json(d / "job.json")
            if not record:
                continue
            root = checkpoint_root(cfg, d.name, record)
            step = newest_candidate(root, 0)
            if step is None:
                continue
            found.append(Finding("checkpoint_committed", f"ckpt:{d.name}:{step}",
                                 f"job {d.name} committed checkpoint step {step}", severity="info", job=d.name,
                                 rank=0, evidence={"step": step, "root": str(root)}))
        return found


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None
