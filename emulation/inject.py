"""Fault injection: each fault kind of ``trainguard.emulation.faults`` made real on a machine.

Two halves:

* :func:`inject_on_node` / :func:`clear_on_node` run on the machine itself
  (``tg-node fault inject|clear``): signals to rank processes, the in-job control
  file, the disk filler, the emulated NVML state.
* :func:`inject` / :func:`clear` run on the host (``trainguard inject``): they
  reach the machine through its transport, except for faults that would cut
  that very transport (the network link), which the host applies from outside
  the machine's namespace.

Every injection is recorded in the machine's fault ledger (beside its control
file) before it takes effect, so ``clear`` can undo it even after the process
that injected it is gone. Injection is off on machines whose node configuration
has no ``fault_file`` (real fleets).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

from trainguard.core import procs
from trainguard.core.errors import FaultError
from trainguard.emulation import faults
from trainguard.emulation.nvml import EmulatedNvml
from trainguard.node_tools import job, monitor
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.inventory import Inventory
from trainguard.node_tools.transport import transport_for

DISK_FILLER = ".tg-disk-filler"
GPU_FAULTS = ("gpu_lost", "xid", "ecc", "thermal")


def _ledger_path(cfg: NodeConfig) -> Path:
    if cfg.fault_file is None:
        raise FaultError(
            f"fault injection is off on machine {cfg.machine} (its node config has no fault_file); "
            f"inject only on emulated or test machines"
        )
    return cfg.fault_file.with_name("faults.ledger.json")


def read_ledger(cfg: NodeConfig) -> list[dict[str, Any]]:
    path = _ledger_path(cfg)
    try:
        return list(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return []


def _write_ledger(cfg: NodeConfig, entries: list[dict[str, Any]]) -> None:
    monitor.write_json_atomic(_ledger_path(cfg), entries)


def _running_job(cfg: NodeConfig, name: str | None) -> str:
    if name:
        job.check_job_name(name)
        if job.status(cfg, name)["state"] != "running":
            raise FaultError(f"job {name!r} is not running on machine {cfg.machine}; start it first")
        return name
    jobs_dir = cfg.workdir / "jobs"
    running = [
        p.name for p in sorted(jobs_dir.glob("*")) if p.is_dir() and job.status(cfg, p.name)["state"] == "running"
    ]
    if len(running) == 1:
        return running[0]
    if not running:
        raise FaultError(f"no job is running on machine {cfg.machine}; a rank fault needs a running job")
    raise FaultError(f"several jobs run on machine {cfg.machine} ({', '.join(running)}); name one with --job")


def _rank_process(cfg: NodeConfig, job_name: str, rank: int | None) -> tuple[int, int, int]:
    rd = job.run_dir(cfg, job_name)
    ranks = sorted(int(p.stem[4:]) for p in (rd / "ranks").glob("rank*.json") if p.stem[4:].isdigit())
    if not ranks:
        raise FaultError(f"job {job_name} on machine {cfg.machine} has no rank heartbeat yet; wait for it to start")
    if rank is None:
        rank = ranks[0]
    if rank not in ranks:
        raise FaultError(
            f"rank {rank} is not on machine {cfg.machine} (it has ranks {', '.join(map(str, ranks))})"
        )
    hb = monitor.read_heartbeat(rd, rank) or {}
    pid = hb.get("pid")
    if not pid or not procs.alive(pid):
        raise FaultError(f"rank {rank} of job {job_name} on machine {cfg.machine} is not running")
    return rank, int(pid), int(hb.get("local_rank", 0))


def _fill_disk(path: Path) -> int:
    """Fill the file system holding ``path``; returns the bytes written."""
    filler = path / DISK_FILLER
    written = 0
    with open(filler, "ab", buffering=0) as fh:  # unbuffered: nothing is left to flush (and fail) at close
        st = os.statvfs(path)
        want = st.f_bavail * st.f_frsize
        if want > 0:
            with contextlib.suppress(OSError):
                os.posix_fallocate(fh.fileno(), fh.tell(), want)
                written += want
        chunk = b"\0" * (1 << 16)
        while True:
            try:
                fh.write(chunk)
                fh.flush()
                written += len(chunk)
            except OSError:
                break
        with contextlib.suppress(OSError):
            os.fsync(fh.fileno())
    return written


def _signal(name: str) -> signal.Signals:
    try:
        return signal.Signals[f"SIG{str(name).upper().removeprefix('SIG')}"]
    except KeyError:
        raise FaultError(f"crash signal={name!r} is not a signal name; use e.g. KILL, TERM, SEGV, ABRT") from None


def inject_on_node(
    cfg: NodeConfig,
    kind_name: str,
    *,
    rank: int | None = None,
    job_name: str | None = None,
    params: dict[str, str] | None = None,
) -> dict[str, Any]:
    """Apply one fault on this machine; returns a JSON-able record of what was done."""
    kind = faults.fault_kind(kind_name)
    values = faults.resolve_params(kind, params or {})
    ledger = read_ledger(cfg)
    entry: dict[str, Any] = {
        "id": uuid.uuid4().hex[:12], "kind": kind.name, "machine": cfg.machine, "params": values, "ts": time.time(),
    }
    if kind.target == "rank":
        entry["job"] = _running_job(cfg, job_name)
        entry["rank"], entry["pid"], entry["local_rank"] = _rank_process(cfg, entry["job"], rank)
    elif rank is not None:
        raise FaultError(f"fault {kind.name} acts on a whole machine; drop --rank")
    # Validate everything before recording anything: a refused fault leaves no trace.
    if kind.name == "nic_down":
        raise FaultError("nic_down cuts the machine's own network; inject it from the host with 'trainguard inject'")
    if kind.name in ("bitflip", "sdc") and not 0 <= int(values["bit"]) <= 30:
        raise FaultError(f"bitflip bit={values['bit']} must be 0..30 (a float32 bit below the sign)")
    if kind.name == "crash":
        sig = _signal(values["signal"])
    if kind.name in GPU_FAULTS:
        if cfg.nvml_backend != "emulated" or cfg.nvml_state is None:
            raise FaultError(f"machine {cfg.machine} uses real NVML; GPU faults are injected only on emulated GPUs")
        gpu = int(values["gpu"])
        if not 0 <= gpu < cfg.gpus:
            raise FaultError(f"machine {cfg.machine} has GPUs 0..{cfg.gpus - 1}; there is no GPU {gpu}")
    ledger.append(entry)
    _write_ledger(cfg, ledger)

    if kind.name == "user_error" and not values.get("revision"):  # the revision the job runs now
        record = job.read_record(cfg, entry["job"]) or {}
        values["revision"] = str((record.get("spec") or {}).get("revision") or "")
        entry["params"] = values
    if kind.in_job:
        control = faults.read_control(cfg.fault_file)
        control.append({"id": entry["id"], "kind": kind.name, "rank": entry.get("rank"),
                        "local_rank": entry.get("local_rank"), "params": values})
        faults.write_control(cfg.fault_file, control)
        who = f"rank {entry['rank']}" if kind.target == "rank" else f"every rank and diagnostic on {cfg.machine}"
        entry["effect"] = f"{who} picks it up at its next step"
    elif kind.name == "crash":
        os.kill(entry["pid"], sig)
        entry["effect"] = f"sent {sig.name} to pid {entry['pid']}"
    elif kind.name == "hang":
        os.kill(entry["pid"], signal.SIGSTOP)
        entry["effect"] = f"stopped pid {entry['pid']} (SIGSTOP)"
    elif kind.name == "disk_full":
        cfg.workdir.mkdir(parents=True, exist_ok=True)
        written = _fill_disk(cfg.workdir)
        entry["effect"] = f"filled {cfg.workdir} with {written} bytes"
    elif kind.name in GPU_FAULTS:
        change = EmulatedNvml(cfg.nvml_state, machine=cfg.machine, gpus=cfg.gpus).inject(kind.name, values)
        xid = {"gpu_lost": 79, "xid": int(values.get("xid", 79)), "ecc": 48}.get(kind.name)
        if xid is not None and cfg.kmsg_path and str(cfg.kmsg_path) != "/dev/kmsg":
            # what the driver would print: the kernel log check sees it as on a real machine
            with open(cfg.kmsg_path, "a", encoding="utf-8") as fh:
                fh.write(f"NVRM: Xid (PCI:0000:{0x18 + change['gpu']:02x}:00): {xid}, pid=0, emulated {kind.name}\n")
        entry["effect"] = f"GPU {change['gpu']}: {kind.name}"
    return entry


def clear_on_node(cfg: NodeConfig, kind_name: str | None = None) -> dict[str, Any]:
    """Undo the recorded faults of ``kind_name`` (all when None); clearing nothing is not an error."""
    if kind_name is not None:
        faults.fault_kind(kind_name)
    ledger = read_ledger(cfg)
    keep, cleared = [], []
    for entry in ledger:
        if kind_name is not None and entry["kind"] != kind_name:
            keep.append(entry)
            continue
        if entry["kind"] == "hang" and procs.alive(int(entry.get("pid", 0))):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(entry["pid"]), signal.SIGCONT)
        cleared.append(entry)
    kinds = {e["kind"] for e in cleared} | ({kind_name} if kind_name else set(faults.FAULT_KINDS))
    if "disk_full" in kinds:
        (cfg.workdir / DISK_FILLER).unlink(missing_ok=True)
    if kinds & set(GPU_FAULTS) and cfg.nvml_backend == "emulated" and cfg.nvml_state is not None:
        EmulatedNvml(cfg.nvml_state, machine=cfg.machine, gpus=cfg.gpus).reset()
        if cfg.kmsg_path and str(cfg.kmsg_path) != "/dev/kmsg" and cfg.kmsg_path.exists():
            # the repair (a driver reload or reboot) empties the kernel's ring buffer; so does ours
            cfg.kmsg_path.write_text("")
    control = faults.read_control(cfg.fault_file)
    faults.write_control(cfg.fault_file, [f for f in control if f["kind"] not in kinds])
    _write_ledger(cfg, keep)
    return {"machine": cfg.machine, "cleared": cleared, "remaining": keep}


# ---------------------------------------------------------------------------------------
# Host side
# ---------------------------------------------------------------------------------------
def _netns_link(inventory: Inventory, machine_name: str, up: bool) -> dict[str, Any]:
    machine = inventory.machine(machine_name)
    netns = machine.extra.get("netns")
    if inventory.transport != "ssh" or not netns:
        raise FaultError(
            f"machine {machine_name} has no network namespace (transport {inventory.transport}); "
            f"nic_down needs the emulated cluster with root"
        )
    iface = machine.extra.get("iface", "eth0")
    state = "up" if up else "down"
    proc = subprocess.run(
        ["ip", "netns", "exec", netns, "ip", "link", "set", iface, state], capture_output=True, text=True,
        check=False,
    )
    if proc.returncode:
        raise FaultError(f"could not set {iface} {state} on machine {machine_name}: {proc.stderr.strip()}")
    kmsg = _emulated_kmsg(machine)
    if kmsg is not None:  # what the NIC driver prints: the kernel log check sees it as on a real machine
        with open(kmsg, "a", encoding="utf-8") as fh:
            fh.write(f"emulated-nic: {iface}: Link is {'Up' if up else 'Down'}\n")
    return {"kind": "nic_down", "machine": machine_name, "effect": f"{iface} set {state} in {netns}", "ts": time.time()}


def _emulated_kmsg(machine: Any) -> Path | None:
    """The kernel log file of an emulated machine (from its node configuration), else None."""
    try:
        doc = json.loads(Path(machine.extra.get("node_config", "")).read_text())
    except (OSError, ValueError):
        return None
    path = doc.get("kmsg_path") if isinstance(doc, dict) else None
    if not path or path == "/dev/kmsg" or not Path(path).exists():
        return None
    return Path(path)


def inject(
    inventory: Inventory,
    machine_name: str,
    kind_name: str,
    *,
    rank: int | None = None,
    job_name: str | None = None,
    params: dict[str, str] | None = None,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """Inject a fault into one machine of ``inventory`` from the host."""
    kind = faults.fault_kind(kind_name)
    machine = inventory.machine(machine_name)
    faults.resolve_params(kind, params or {})  # reject bad parameters before touching anything
    if kind.name == "nic_down":
        if rank is not None:
            raise FaultError("nic_down acts on a whole machine; drop --rank")
        return _netns_link(inventory, machine_name, up=False)
    argv = ["fault", "inject", "--kind", kind.name]
    if rank is not None:
        argv += ["--rank", str(rank)]
    if job_name:
        argv += ["--job", job_name]
    for key, value in (params or {}).items():
        argv += ["--param", f"{key}={value}"]
    return _remote(inventory, machine, argv, timeout)


def clear(inventory: Inventory, machine_name: str, kind_name: str | None = None, *, timeout: float = 30.0
          ) -> dict[str, Any]:
    """Undo faults on a machine (the link first, so the machine is reachable again)."""
    machine = inventory.machine(machine_name)
    result: dict[str, Any] = {"machine": machine_name}
    if kind_name in (None, "nic_down") and machine.extra.get("netns"):
        result["link"] = _netns_link(inventory, machine_name, up=True)
    if kind_name != "nic_down":
        argv = ["fault", "clear"] + (["--kind", kind_name] if kind_name else [])
        result.update(_remote(inventory, machine, argv, timeout))
    return result


def _remote(inventory: Inventory, machine: Any, argv: list[str], timeout: float) -> dict[str, Any]:
    transport = transport_for(inventory)
    res = transport.run(machine, transport.tg_node(machine, *argv), timeout=timeout)
    doc = res.json()
    if res.ok and isinstance(doc, dict):
        return doc
    if isinstance(doc, dict) and doc.get("error"):
        raise FaultError(f"machine {machine.name}: {doc['error']}")
    raise FaultError(res.describe())
