"""One prepared run for a machine with an NVIDIA GPU: what trainguard does there, measured in one call of at most
eight minutes, written as one JSON document (``bench/results/gpu.json``, with the GPU's name).

1. ``nvml``: the GPU state as the node agent reads it (``RealNvml.snapshot``), and each NVML call behind it, timed
   (medians of 20 reads).
2. ``ckpt``: the checkpoint library's GPU path (snapshots copied on a side stream into page-locked shared memory,
   persisted by the saver process) on the largest model that fits (an MLP of 8192-wide layers, 1.2B parameters
   when the memory allows, AdamW), a step sized to about a second. Three phases of the same steps, side by side:
   no checkpoint, trainguard every step (``measure_memcpy``: a plain device-to-host copy of the same bytes timed
   beside each snapshot), and DCP ``async_save`` every step. Per phase the step time; for trainguard the
   blocking time against the plain copy; then a restore into a fresh model, compared tensor by tensor.
3. ``recovery``: ``examples/plain/train.py`` under torchrun on this machine, guarded, its rank killed (SIGKILL)
   mid-run: torchrun starts it again, the guard restores; kill to the next step, steps lost, and every loss
   after the restore against an uninterrupted run's, bit for bit.

Every part runs on its own clock within the budget; one that fails is recorded with its error and the others
still run. ``--dry-run`` runs the same code on the CPU with a tiny model (what CI checks, so the script is known
to work before a GPU comes).

    python bench/gpu.py [--out bench/results/gpu.json] [--budget-s 480]
    python bench/gpu.py --dry-run [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import summarize, write_result

REPO = Path(__file__).resolve().parent.parent
WIDTH, TARGET_PARAMS, STEP_TARGET_S = 8192, 1_200_000_000, 1.0


class Budget:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def _median_ms(samples: list[float]) -> float:
    return round(1000 * statistics.median(samples), 4)


# ---- 1. NVML ------------------------------------------------------------------------------------------------
def nvml_part(dry_run: bool, tmp: Path) -> dict[str, Any]:
    from trainguard.emulation.nvml import EmulatedNvml
    from trainguard.node_tools.nvml import RealNvml

    backend = EmulatedNvml(tmp / "nvml.json", machine="m0", gpus=1) if dry_run else RealNvml()
    snaps = []
    for _ in range(20):
        t0 = time.perf_counter()
        doc = backend.snapshot()
        snaps.append(time.perf_counter() - t0)
    out: dict[str, Any] = {"backend": doc["backend"], "snapshot_ms": _median_ms(snaps), "snapshot": doc, "calls": {}}
    if dry_run:
        return out
    nv = backend._nvml
    h = nv.nvmlDeviceGetHandleByIndex(0)
    calls: dict[str, Callable[[], Any]] = {
        "device_count": nv.nvmlDeviceGetCount,
        "handle": lambda: nv.nvmlDeviceGetHandleByIndex(0),
        "uuid": lambda: nv.nvmlDeviceGetUUID(h),
        "name": lambda: nv.nvmlDeviceGetName(h),
        "temperature": lambda: nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
        "clocks_event_reasons": lambda: nv.nvmlDeviceGetCurrentClocksEventReasons(h),
        "ecc_uncorrected": lambda: nv.nvmlDeviceGetTotalEccErrors(h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                                  nv.NVML_VOLATILE_ECC),
        "remapped_rows": lambda: nv.nvmlDeviceGetRemappedRows(h),
        "pcie_gen": lambda: nv.nvmlDeviceGetCurrPcieLinkGeneration(h),
        "pcie_width": lambda: nv.nvmlDeviceGetCurrPcieLinkWidth(h),
        "pcie_max_gen": lambda: nv.nvmlDeviceGetMaxPcieLinkGeneration(h),
        "pcie_max_width": lambda: nv.nvmlDeviceGetMaxPcieLinkWidth(h),
        "driver_version": nv.nvmlSystemGetDriverVersion,
    }
    for name, call in calls.items():
        times, value, error = [], None, None
        for _ in range(20):
            t0 = time.perf_counter()
            try:
                value = call()
            except nv.NVMLError as exc:
                error = str(exc)
            times.append(time.perf_counter() - t0)
        out["calls"][name] = {"ms": _median_ms(times), "value": str(value)[:200], **({"error": error} if error else {})}
    return out


# ---- 2. checkpoints -----------------------------------------------------------------------------------------
def _model(width: int, layers: int, device: Any) -> Any:
    import torch

    torch.manual_seed(0)
    mods: list[Any] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(width, width, bias=False), torch.nn.GELU()]
    return torch.nn.Sequential(*mods).to(device)


def _sizes(dry_run: bool, device: Any) -> tuple[int, int]:
    """(width, layers): 1.2B parameters where four copies of them (weights, gradients, AdamW's two moments) and a
    fifth for the restore's model leave a quarter of the GPU's free memory to activations; fewer layers else."""
    if dry_run:
        return 256, 4
    import torch

    free, _total = torch.cuda.mem_get_info(device)
    per_layer = WIDTH * WIDTH * 4 * 5
    layers = max(1, min(TARGET_PARAMS // (WIDTH * WIDTH) + 1, int(0.75 * free // per_layer)))
    return WIDTH, layers


def _phase(mode: str, *, model: Any, rows: int, steps: int, root: Path, run_dir: Path, device: Any,
           budget: Budget) -> dict[str, Any]:
    """``steps`` steps of ``model`` under a guard: ``off`` (no checkpoint), ``on`` (trainguard's, every step) or
    ``dcp`` (DCP ``async_save`` every step). Step times are wall time to the step's end, the device synchronized."""
    import torch

    from examples.gpt3d.dcp_baseline import DcpCheckpointer
    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.node_tools.monitor import read_steps
    from trainguard.torch import Guard

    os.environ["TG_RUN_DIR"] = str(run_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = CheckpointConfig(root=root / "tg", every_steps=1, keep=2, replicate=False, fsync=False,
                           measure_memcpy=True) if mode == "on" else False
    guard = Guard(model, opt, checkpoint=cfg, sync=False, log=lambda _line: None)
    dcp = DcpCheckpointer(root / "dcp", rank=0, model=model, optimizer=opt) if mode == "dcp" else None
    x = torch.randn(rows, model[0].in_features, device=device, generator=torch.Generator(device).manual_seed(1))
    times, dcp_blocking = [], []
    try:
        guard.restore()
        for step in range(steps):
            if budget.left() < 30:
                break
            t0 = time.perf_counter()
            with guard.step(step, tokens=rows) as s:
                opt.zero_grad(set_to_none=True)
                loss = model(x).float().pow(2).mean()
                loss.backward()
                if s.ok(loss, sync=False):
                    opt.step()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
            if dcp is not None:
                dcp_blocking.append(dcp.save(step))
            times.append(time.perf_counter() - t0)
    finally:
        guard.close()
        if dcp is not None:
            dcp.close()
    records = [r for r in read_steps(run_dir, 0) if r.get("step", -1) >= 0]
    out: dict[str, Any] = {"steps": len(times), "step_s": times}
    if mode == "on":
        out["blocking_s"] = [float(r["ckpt_blocking_s"]) for r in records if "ckpt_blocking_s" in r]
        out["memcpy_s"] = [float(r["ckpt_memcpy_s"]) for r in records if r.get("ckpt_memcpy_s")]
        out["skipped"] = sum(1 for r in records if r.get("ckpt_skipped"))
        out["committed"] = max((r["ckpt_committed"] for r in records if isinstance(r.get("ckpt_committed"), int)),
                               default=None)
    if dcp is not None:
        out["blocking_s"] = dcp_blocking
    return out


def _restore_exact(model: Any, width: int, layers: int, root: Path, run_dir: Path, device: Any) -> dict[str, Any]:
    """A fresh model and optimizer restored from the trainguard phase's copies: every tensor equal?"""
    import torch

    from trainguard.checkpoint.config import CheckpointConfig
    from trainguard.torch import Guard

    os.environ["TG_RUN_DIR"] = str(run_dir)
    fresh = _model(width, layers, device)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)  # not the saved state by accident
    opt = torch.optim.AdamW(fresh.parameters(), lr=1e-4)
    guard = Guard(fresh, opt, checkpoint=CheckpointConfig(root=root / "tg", replicate=False, fsync=False),
                  sync=False, log=lambda _line: None)
    t0 = time.perf_counter()
    nxt = guard.restore()
    seconds = time.perf_counter() - t0
    equal = all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), fresh.state_dict().values(),
                                                    strict=True))
    guard.close()
    return {"next_step": nxt, "restore_s": round(seconds, 4), "exact": equal,
            "source": guard.restored.tier if guard.restored else None}


def ckpt_part(dry_run: bool, tmp: Path, budget: Budget) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    device = torch.device("cpu") if dry_run else torch.device("cuda", 0)
    if not dist.is_initialized():  # one rank; DCP keeps its own collectives on a gloo group of it
        dist.init_process_group("gloo", init_method=f"file://{tmp}/pg", rank=0, world_size=1)
    width, layers = _sizes(dry_run, device)
    steps = 4 if dry_run else 12
    model = _model(width, layers, device)
    params = sum(p.numel() for p in model.parameters())
    rows = 64
    if not dry_run:  # a step of about a second: scaled from a timed one, capped by a quarter of the free memory
        probe = 2048
        x = torch.randn(probe, width, device=device)
        for _ in range(2):
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            model(x).pow(2).mean().backward()
            torch.cuda.synchronize(device)
            took = time.perf_counter() - t0
        model.zero_grad(set_to_none=True)
        free, _ = torch.cuda.mem_get_info(device)
        rows = int(min(probe * STEP_TARGET_S / max(took, 1e-4), 0.25 * free / (width * 4 * 2 * layers)))
        rows = max(256, rows // 256 * 256)
    out: dict[str, Any] = {"params": params, "width": width, "layers": layers, "rows": rows,
                           "state_gib": round(params * 12 / 2**30, 2), "phases": {}}
    # the same model through the three phases: its state keeps training; what is compared is each phase's steps.
    # The restore follows trainguard's phase, while the model still holds the state its last snapshot took.
    for mode in ("off", "on", "dcp"):
        out["phases"][mode] = _phase(mode, model=model, rows=rows, steps=steps, root=tmp / "ckpt",
                                     run_dir=tmp / f"run-{mode}", device=device, budget=budget)
        if mode == "on":
            out["restore"] = _restore_exact(model, width, layers, tmp / "ckpt", tmp / "run-restore", device)
    return out


# ---- 3. a guarded job recovering from a killed rank ----------------------------------------------------------
def _torchrun(args: list[str], run_dir: Path, ckpt: Path, *, restarts: int) -> subprocess.Popen[str]:
    env = {**os.environ, "TG_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("TG_CHECKPOINT", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
           "--max-restarts", str(restarts), str(REPO / "examples" / "plain" / "train.py"),
           "--checkpoint-dir", str(ckpt), *args]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def recovery_part(dry_run: bool, tmp: Path, budget: Budget) -> dict[str, Any]:
    from trainguard.node_tools.monitor import read_steps

    steps, kill_at = (30, 12) if dry_run else (60, 25)
    args = ["--steps", str(steps), "--step-time-s", "0.05", "--width", "64" if dry_run else "1024"]
    ref_run = tmp / "rec-ref"
    ref = _torchrun(args, ref_run, tmp / "rec-ref-ckpt", restarts=0)
    _, err = ref.communicate(timeout=max(60.0, budget.left() - 60))
    if ref.returncode != 0:
        raise RuntimeError(f"the uninterrupted run failed: {err[-500:]}")
    reference = {r["step"]: r["loss"] for r in read_steps(ref_run, 0)}
    run = tmp / "rec"
    proc = _torchrun(args, run, tmp / "rec-ckpt", restarts=1)
    killed_at = victim = None
    try:
        while proc.poll() is None and budget.left() > 20:
            records = read_steps(run, 0)
            if killed_at is None and records and records[-1]["step"] >= kill_at:
                victim = _rank_pid(proc.pid)
                os.kill(victim, signal.SIGKILL)
                killed_at = (time.time(), records[-1]["step"])
            time.sleep(0.05)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    records = read_steps(run, 0)
    if killed_at is None:
        raise RuntimeError("the run ended before its rank could be killed")
    after = [r for r in records if float(r.get("ts") or 0) > killed_at[0]]
    restored = next((r for r in after if "ckpt_restored_step" in r), None)
    first = after[0] if after else None
    return {
        "killed_pid": victim, "killed_after_step": killed_at[1],
        "kill_to_step_s": round(float(first["ts"]) - killed_at[0], 3) if first else None,
        "restored_step": restored.get("ckpt_restored_step") if restored else None,
        "lost_steps": (killed_at[1] - restored["ckpt_restored_step"]) if restored else None,
        "exact": bool(after) and all(reference.get(r["step"]) == r["loss"] for r in after),
        "finished": proc.returncode == 0 and max(r["step"] for r in records) == steps - 1,
    }


def _rank_pid(torchrun_pid: int) -> int:
    import psutil

    kids = [p for p in psutil.Process(torchrun_pid).children(recursive=True) if "train.py" in " ".join(p.cmdline())]
    if not kids:
        raise RuntimeError("no rank process under torchrun")
    return kids[-1].pid


# ---- the run ------------------------------------------------------------------------------------------------
def metrics_of(parts: dict[str, Any]) -> dict[str, Any]:
    m: dict[str, Any] = {}
    nvml = parts.get("nvml") or {}
    if "snapshot_ms" in nvml:
        m["nvml.snapshot_ms"] = {"value": nvml["snapshot_ms"], "n": 20, "unit": "ms"}
    ck = parts.get("ckpt") or {}
    phases = ck.get("phases") or {}
    off = phases.get("off", {}).get("step_s", [])[1:]
    for mode, name in (("on", "trainguard"), ("dcp", "dcp")):
        ph = phases.get(mode) or {}
        steps = ph.get("step_s", [])[1:]  # the first step of a phase warms up
        if off and steps:
            ratio = statistics.median(steps) / statistics.median(off) - 1
            m[f"{name}.step_overhead_ratio"] = {"value": round(ratio, 4), "n": len(steps), "unit": "ratio"}
        if ph.get("blocking_s"):
            m[f"{name}.blocking_s"] = summarize(ph["blocking_s"][1:] or ph["blocking_s"], "s")
    on = phases.get("on") or {}
    if on.get("blocking_s") and on.get("memcpy_s"):
        m["trainguard.blocking_vs_memcpy"] = {"value": round(statistics.median(on["blocking_s"])
                                                             / statistics.median(on["memcpy_s"]), 4),
                                              "n": len(on["blocking_s"]), "unit": "ratio"}
        m["memcpy_s"] = summarize(on["memcpy_s"], "s")
    if ck.get("params"):
        m["trainguard.params"] = {"value": ck["params"], "n": 1, "unit": "parameters"}
    if ck.get("restore"):
        m["trainguard.restore_s"] = {"value": ck["restore"]["restore_s"], "n": 1, "unit": "s"}
        m["trainguard.restore_exact"] = {"value": int(ck["restore"]["exact"]), "n": 1, "unit": "restores"}
    rec = parts.get("recovery") or {}
    if rec.get("kill_to_step_s") is not None:
        m["recovery.kill_to_step_s"] = {"value": rec["kill_to_step_s"], "n": 1, "unit": "s"}
        m["recovery.lost_steps"] = {"value": rec["lost_steps"], "n": 1, "unit": "steps", "target": 1}
        m["recovery.exact"] = {"value": int(rec["exact"]), "n": 1, "unit": "runs"}
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="the prepared GPU run (see the module's docstring)")
    ap.add_argument("--dry-run", action="store_true", help="the same code on the CPU, tiny: what CI checks")
    ap.add_argument("--out", type=Path, default=None,
                    help="the JSON document (default: bench/results/gpu.json on a GPU; printed with --dry-run)")
    ap.add_argument("--budget-s", type=float, default=480.0, help="the whole run's time, seconds (default 480)")
    args = ap.parse_args(argv)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("gpu: no CUDA device here; run with --dry-run to check the script on the CPU", file=sys.stderr)
        return 2
    out = args.out or (None if args.dry_run else REPO / "bench" / "results" / "gpu.json")
    budget = Budget(args.budget_s)
    started = time.time()
    parts: dict[str, Any] = {}
    errors: dict[str, str] = {}
    gpu = {"name": torch.cuda.get_device_name(0), "memory_gib": round(torch.cuda.get_device_properties(0).total_memory
                                                                      / 2**30, 1),
           "torch": torch.__version__, "cuda": torch.version.cuda} if not args.dry_run else {"name": None}
    with tempfile.TemporaryDirectory(prefix="tg-gpu-") as tmp:
        for name, part in (("nvml", lambda: nvml_part(args.dry_run, Path(tmp))),
                           ("ckpt", lambda: ckpt_part(args.dry_run, Path(tmp), budget)),
                           ("recovery", lambda: recovery_part(args.dry_run, Path(tmp), budget))):
            if budget.left() < 45:
                errors[name] = f"not run: {budget.left():.0f} s of the budget left"
                continue
            t0 = time.perf_counter()
            try:
                parts[name] = part()
            except Exception as exc:  # recorded; the other parts still run
                errors[name] = f"{type(exc).__name__}: {exc}"[:1000]
            with contextlib.suppress(Exception):
                (parts.get(name) or {})["seconds"] = round(time.perf_counter() - t0, 2)
    text = write_result("gpu", quick=bool(args.dry_run), out=out, metrics=metrics_of(parts), setup={
        "gpu": gpu, "dry_run": args.dry_run, "budget_s": args.budget_s, "wall_s": round(time.time() - started, 1),
        "errors": errors, "parts": json.loads(json.dumps(parts, default=str))})
    if out is None:
        print(text)
    else:
        print(f"gpu: wrote {out} ({len(errors)} part(s) failed: {', '.join(errors) or 'none'})")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
