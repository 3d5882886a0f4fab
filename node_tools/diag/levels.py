"""The tests of levels 1 and 2 that run in a worker process: the real-time checks once, the GPU snapshot,
``import torch``, the work directory; the verified compute burn, memory bandwidth and the disk."""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import random
import time
from pathlib import Path
from typing import Any

from trainguard.node_tools.diag.common import (
    RANK_FINDING_PREFIXES,
    done,
    fault_points,
    finite,
    load_cfg,
    os_error,
)


def run_checks(args: dict[str, Any]) -> dict[str, Any]:
    from trainguard.node_tools.agent import check_once

    cfg = load_cfg(args)
    _, report = check_once(cfg, "all")
    findings = report.get("findings", [])
    ignored = [f for f in findings if str(f.get("kind", "")).startswith(RANK_FINDING_PREFIXES)]
    faults = [f for f in findings if f.get("severity") == "fault" and f not in ignored]
    warnings = [f for f in findings if f.get("severity") != "fault" and f not in ignored]
    errors = {k: v for k, v in (report.get("errors") or {}).items() if k != "ranks"}
    details = {"checks": report.get("checks", []), "faults": faults, "warnings": warnings, "errors": errors,
               "ignored_rank_findings": len(ignored), "notes": report.get("notes", [])}
    reasons = [f"{f['kind']}: {f['message']}" for f in faults] + [f"check {k} failed: {v}" for k, v in errors.items()]
    return done(not reasons, details, "; ".join(reasons))


def run_gpu(args: dict[str, Any]) -> dict[str, Any]:
    from trainguard.node_tools.nvml import NvmlUnavailable, backend_for

    cfg = load_cfg(args)
    expected = cfg.gpus
    try:
        backend = backend_for(cfg)
        note = ""
    except NvmlUnavailable as exc:
        backend, note = None, str(exc)
    if backend is None:
        details = {"backend": None, "expected": expected, "nvml_backend": cfg.nvml_backend, "note": note}
        if expected > 0:
            return done(False, details, f"no GPU backend (nvml_backend={cfg.nvml_backend}"
                         f"{': ' + note if note else ''}) but {expected} GPUs are expected")
        return done(True, details)
    snap = backend.snapshot()
    devices = snap.get("devices", [])
    count = int(snap.get("device_count", len(devices)))
    present = [d.get("index") for d in devices]
    details = {"backend": snap.get("backend"), "driver_version": snap.get("driver_version"),
               "expected": expected, "device_count": count, "present": present,
               "devices": [{k: d.get(k) for k in ("index", "uuid", "name", "temperature_c")} for d in devices]}
    reasons = []
    if count != len(devices):
        reasons.append(f"the snapshot says {count} devices but lists {len(devices)}")
    uuids = [d.get("uuid") for d in devices]
    if len(set(uuids)) != len(uuids) or len(set(present)) != len(present):
        reasons.append(f"the snapshot lists a GPU twice (indices {present})")
    if expected > 0 and count != expected:
        missing = [i for i in range(expected) if i not in present]
        details["missing"] = missing
        which = f"GPU {', '.join(map(str, missing))} missing: " if missing else ""
        reasons.append(f"{which}{count} of {expected} GPUs visible")
    return done(not reasons, details, "; ".join(reasons))


def run_torch(args: dict[str, Any]) -> dict[str, Any]:
    t0 = time.monotonic()
    try:
        import torch
    except Exception as exc:
        return done(False, {}, f"import torch failed: {type(exc).__name__}: {exc}")
    import torch.distributed as dist

    cfg = load_cfg(args)
    cuda = torch.cuda.is_available()
    details = {
        "version": torch.__version__, "import_s": round(time.monotonic() - t0, 3),
        "cuda_available": cuda, "cuda_version": torch.version.cuda,
        "cuda_device_count": torch.cuda.device_count() if cuda else 0,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "threads": torch.get_num_threads(),
        "distributed": dist.is_available(),
        "gloo_available": dist.is_available() and dist.is_gloo_available(),
        "nccl_available": dist.is_available() and dist.is_nccl_available(),
    }
    if cuda and cfg.gpus > 0 and details["cuda_device_count"] != cfg.gpus:
        return done(False, details, f"torch sees {details['cuda_device_count']} CUDA devices, {cfg.gpus} expected")
    return done(True, details)


def run_workdir(args: dict[str, Any]) -> dict[str, Any]:
    cfg = load_cfg(args)
    workdir = Path(cfg.workdir)
    token = os.urandom(16).hex()
    path = workdir / f".tg-diag-{os.getpid()}-{token[:8]}.txt"
    details = {"workdir": str(workdir)}
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        path.write_text(token, encoding="utf-8")
        back = path.read_text(encoding="utf-8")
    except OSError as exc:
        return done(False, details, os_error(exc, f"write/read in {workdir}"))
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    if back != token:
        return done(False, details, f"{path} read back different bytes than were written")
    return done(True, details)


MATMUL_SIZES = (256, 384, 512)


def run_compute(args: dict[str, Any]) -> dict[str, Any]:
    """Seeded float32 matmuls on every device, each checked against a float64 CPU reference.

    The error of each result element is judged against the rounding bound of the
    product: ``|C - C64| <= tol * (|A| @ |B|)`` with ``tol = 8 sqrt(K) 2^-24``, well
    above float32 rounding (observed ~2.5 ulp) and far below a wrong bit.
    """
    import torch

    cfg = load_cfg(args)
    faults = fault_points(cfg)
    seed = int(args.get("seed", 0))
    burn_s = float(args.get("burn_s", 0.3))
    torch.set_float32_matmul_precision("highest")  # no TF32: the reference is exact float32 arithmetic
    cuda = torch.cuda.is_available()
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
    cases = []
    for n in MATMUL_SIZES:
        g = torch.Generator().manual_seed(seed * 1009 + n)
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        a64, b64 = a.double(), b.double()
        cases.append((n, a, b, a64 @ b64, a64.abs() @ b64.abs()))
    per_device, reasons = [], []
    for dev in devices:
        inputs = [(n, a.to(dev), b.to(dev), ref, bound) for n, a, b, ref, bound in cases]
        results, wrong, flops, worst_n = 0, 0, 0.0, 0
        worst_ratio = worst_err = 0.0
        first: dict[int, Any] = {}
        unrepeatable = 0
        t0 = time.monotonic()
        busy = 0.0
        while results < 2 * len(inputs) or time.monotonic() - t0 < burn_s:
            n, a, b, ref, bound = inputs[results % len(inputs)]
            s = time.monotonic()
            c = a @ b
            faults.corrupt_compute(c)  # a broken ALU, where a harness emulates one
            c = c.cpu()
            busy += time.monotonic() - s
            flops += 2.0 * n**3
            err = (c.double() - ref).abs()
            ratio = float((err / bound).max())
            if math.isnan(ratio):  # a NaN where the reference has a number is as wrong as it gets
                ratio = math.inf
            if ratio > 8 * math.sqrt(n) * 2.0**-24:
                wrong += 1
            if ratio > worst_ratio:
                worst_ratio, worst_err, worst_n = ratio, float(err.max()), n
            if n in first:
                unrepeatable += int(not torch.equal(first[n], c))
            else:
                first[n] = c
            results += 1
        info = {"device": dev, "results": results, "wrong": wrong, "max_abs_error": finite(worst_err),
                "max_error_over_bound": finite(worst_ratio), "worst_size": worst_n,
                "gflops": round(flops / busy / 1e9, 2) if busy > 0 else None,
                "not_bitwise_repeatable": unrepeatable, "duration_s": round(time.monotonic() - t0, 3)}
        per_device.append(info)
        if wrong:
            tol = 8 * math.sqrt(worst_n) * 2.0**-24
            reasons.append(f"{dev}: {wrong} of {results} float32 matmul results wrong; max error {worst_err:.6g} "
                           f"in a {worst_n}x{worst_n} product ({worst_ratio:.3g} of its rounding bound, "
                           f"tolerance {tol:.3g})")
    details = {"devices": per_device, "sizes": list(MATMUL_SIZES), "dtype": "float32", "reference": "float64 cpu"}
    return done(not reasons, details, "; ".join(reasons))



def run_memory(args: dict[str, Any]) -> dict[str, Any]:
    """Device-local buffer copies; GB/s counts the bytes copied (memory traffic is twice that)."""
    import torch

    floor = float(args.get("floor_gbps", 0.5))
    reps = int(args.get("reps", 4))
    cuda = torch.cuda.is_available()
    devices = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if cuda else ["cpu"]
    per_device, reasons = [], []
    for dev in devices:
        nbytes = 64 << 20  # host memory: well past any CPU cache, a fraction of a second per copy
        if dev.startswith("cuda"):
            free, _total = torch.cuda.mem_get_info(torch.device(dev))
            nbytes = int(min(1 << 30, free // 4)) // 4 * 4
        src = torch.arange(nbytes // 4, dtype=torch.int32, device=dev)
        dst = torch.empty_like(src)
        dst.copy_(src)  # warm-up: first touch of the pages
        sync = (lambda d=dev: torch.cuda.synchronize(d)) if dev.startswith("cuda") else (lambda: None)
        sync()
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        sync()
        dt = time.perf_counter() - t0
        gbps = reps * nbytes / dt / 1e9 if dt > 0 else float("inf")
        intact = bool(torch.equal(dst, src))
        per_device.append({"device": dev, "buffer_mib": nbytes >> 20, "copies": reps,
                           "gbps": round(gbps, 3) if math.isfinite(gbps) else None, "intact": intact})
        if not intact:
            reasons.append(f"{dev}: a {nbytes >> 20} MiB copy came back different")
        if gbps < floor:
            reasons.append(f"{dev}: copy bandwidth {gbps:.3g} GB/s is below the floor of {floor:g} GB/s")
        del src, dst
    details = {"devices": per_device, "floor_gbps": floor, "gbps": min((d["gbps"] or 0.0) for d in per_device)}
    return done(not reasons, details, "; ".join(reasons))


def run_disk(args: dict[str, Any]) -> dict[str, Any]:
    """Write seeded random bytes, fsync, drop them from the page cache, read back, compare sha256."""
    cfg = load_cfg(args)
    size = int(args.get("size_mib", 32)) << 20
    chunk = 1 << 20
    data = random.Random(int(args.get("seed", 0))).randbytes(size)  # noqa: S311 - test data, not secrets
    want = hashlib.sha256(data).hexdigest()
    workdir = Path(cfg.workdir)
    path = workdir / f".tg-diag-disk-{os.getpid()}.bin"
    details: dict[str, Any] = {"path": str(path), "bytes": size}
    step = "create"
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            step = "write"
            view = memoryview(data)
            for off in range(0, size, chunk):
                part = view[off:off + chunk]
                while part:
                    part = part[os.write(fd, part):]
            step = "fsync"
            os.fsync(fd)
            with contextlib.suppress(OSError, AttributeError):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # make the read come from the disk
        finally:
            os.close(fd)
        t1 = time.perf_counter()
        step = "read"
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as fh:
            while block := fh.read(chunk):
                digest.update(block)
        t2 = time.perf_counter()
    except OSError as exc:
        return done(False, details, os_error(exc, f"{step} of {path}"))
    finally:
        with contextlib.suppress(OSError):
            path.unlink()
    details.update(write_mbps=round(size / (t1 - t0) / 1e6, 1) if t1 > t0 else None,
                   read_mbps=round(size / (t2 - t1) / 1e6, 1) if t2 > t1 else None,
                   sha256=want)
    if digest.hexdigest() != want:
        return done(False, details, f"{path}: the {size >> 20} MiB read back differ from what was written "
                                     f"(sha256 {digest.hexdigest()[:16]}..., wrote {want[:16]}...)")
    return done(True, details)
