"""The collective test, run in worker processes: level 2's local collective (NCCL across the GPUs, or gloo
between two threads of one process) and level 3's with neighbour machines, with exact checks and timings."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from trainguard.node_tools.diag.common import (
    done,
    emit,
)


def _seeded(seed: int, key: int, n: int) -> Any:
    """Integer-valued float32 data: sums of up to 16k ranks are exact in any reduction order."""
    import torch

    g = torch.Generator().manual_seed((seed * 1_000_003 + key) % (2**63))
    return torch.randint(-1000, 1001, (n,), generator=g, dtype=torch.int32).to(torch.float32)


def run_collective(args: dict[str, Any]) -> dict[str, Any]:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    rank, world = int(args["rank"]), int(args["world_size"])
    seed = int(args.get("seed", 0))
    backend, device = args.get("backend", "auto"), args.get("device", "auto")
    if backend == "auto":
        use_nccl = torch.cuda.is_available() and dist.is_nccl_available()
        backend = "nccl" if use_nccl else "gloo"
        device = "cuda:0" if use_nccl else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    # leave a second before the parent's kill, so a rendezvous timeout is reported by us
    timeout = max(1.0, float(args["deadline_unix"]) - time.time() - 1.0)
    addr, port = args["master_addr"], int(args["master_port"])
    details: dict[str, Any] = {"rank": rank, "world_size": world, "backend": backend, "device": str(dev),
                               "master": f"{addr}:{port}"}
    emit("progress", stage="connecting")
    t0 = time.monotonic()
    try:
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout))
    except Exception as exc:
        text = " ".join(str(exc).split())[:400]
        waiting = any(w in text.lower() for w in ("timed out", "timeout", "waiting for"))
        why = "timed out waiting for peers" if waiting else "could not join the group"
        return done(False, details, f"{why}: {type(exc).__name__}: {text}", could_not_run=True)
    details["rendezvous_s"] = round(time.monotonic() - t0, 3)
    emit("progress", stage="joined")
    try:
        return collective_checks(args, rank, world, seed, dev, details)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()


class _DistOps:
    """The collectives of ``collective_checks`` on the process's default group."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.dist = dist

    def all_reduce(self, t: Any) -> None:
        self.dist.all_reduce(t)

    def all_gather(self, outs: list[Any], t: Any) -> None:
        self.dist.all_gather(outs, t)

    def all_to_all_single(self, recv: Any, send: Any) -> None:
        self.dist.all_to_all_single(recv, send)

    def barrier(self) -> None:
        self.dist.barrier()


class _BackendOps:
    """The same collectives on a bare gloo backend object (one per thread; no default group needed)."""

    def __init__(self, pg: Any) -> None:
        self.pg = pg

    def all_reduce(self, t: Any) -> None:
        self.pg.allreduce([t]).wait()

    def all_gather(self, outs: list[Any], t: Any) -> None:
        self.pg.allgather([outs], [t]).wait()

    def all_to_all_single(self, recv: Any, send: Any) -> None:
        self.pg.alltoall_base(recv, send, [], []).wait()

    def barrier(self) -> None:
        self.pg.barrier().wait()


def collective_checks(args: dict[str, Any], rank: int, world: int, seed: int, dev: Any,
                       details: dict[str, Any], ops: Any = None) -> dict[str, Any]:
    import torch

    dist = ops or _DistOps()

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    n = 4096
    # all_reduce of every rank's seeded tensor
    t = _seeded(seed, rank, n).to(dev)
    dist.all_reduce(t)
    expected = sum(_seeded(seed, r, n) for r in range(world))
    allreduce_ok = bool(torch.equal(t.cpu(), expected))
    # all_gather: the chunk from each rank is checked on its own, so a wrong peer is named
    mine = _seeded(seed + 1, rank, n).to(dev)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    bad_peers = [r for r in range(world) if not torch.equal(gathered[r].cpu(), _seeded(seed + 1, r, n))]
    allgather_ok = not bad_peers
    # all_to_all_single: chunk j of rank i goes to rank j
    alltoall_ok = None
    if args.get("all_to_all", True):
        k = 1024
        send = torch.cat([_seeded(seed + 2, rank * world + j, k) for j in range(world)]).to(dev)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        want = torch.cat([_seeded(seed + 2, j * world + rank, k) for j in range(world)])
        alltoall_ok = bool(torch.equal(recv.cpu(), want))
    # bandwidth: a few MiB, a few iterations; the last result is checked too
    elems = int(args.get("size_mib", 4)) * (1 << 20) // 4
    iters = int(args.get("iters", 5))
    src = _seeded(seed + 3, rank, elems).to(dev)
    buf = torch.empty_like(src)
    buf.copy_(src)
    dist.all_reduce(buf)  # warm-up
    sync()
    dist.barrier()
    spent = 0.0
    for _ in range(iters):
        buf.copy_(src)
        sync()
        s = time.perf_counter()
        dist.all_reduce(buf)
        sync()
        spent += time.perf_counter() - s
    want = _seeded(seed + 3, 0, elems)
    for r in range(1, world):
        want += _seeded(seed + 3, r, elems)
    bw_ok = bool(torch.equal(buf.cpu(), want))
    allreduce_ok = allreduce_ok and bw_ok
    nbytes = elems * 4
    algbw = nbytes * iters / spent / 1e9 if spent > 0 else None
    # all_gather bandwidth (each rank contributes a quarter, so the output has the same order of size)
    part = _seeded(seed + 4, rank, max(1, elems // 4)).to(dev)
    outs = [torch.empty_like(part) for _ in range(world)]
    dist.all_gather(outs, part)  # warm-up
    sync()
    spent_g = 0.0
    for _ in range(iters):
        s = time.perf_counter()
        dist.all_gather(outs, part)
        sync()
        spent_g += time.perf_counter() - s
    gathered_bytes = part.numel() * 4 * world
    ag_algbw = gathered_bytes * iters / spent_g / 1e9 if spent_g > 0 else None
    ok_local = allreduce_ok and allgather_ok and alltoall_ok is not False
    # every rank's verdict, so each machine's report says which ranks saw wrong data
    verdict = torch.tensor([int(ok_local)], dtype=torch.int32, device=dev)
    verdicts = [torch.empty_like(verdict) for _ in range(world)]
    dist.all_gather(verdicts, verdict)
    ranks = [{"rank": r, "ok": bool(int(v.item()))} for r, v in enumerate(verdicts)]
    details.update(
        allreduce_ok=allreduce_ok, allgather_ok=allgather_ok, alltoall_ok=alltoall_ok, bad_peers=bad_peers,
        ranks=ranks, bytes=nbytes, iters=iters,
        allreduce_algbw_gbps=round(algbw, 4) if algbw else None,
        allreduce_busbw_gbps=round(algbw * 2 * (world - 1) / world, 4) if algbw else None,
        allgather_algbw_gbps=round(ag_algbw, 4) if ag_algbw else None,
    )
    reasons = []
    if not allreduce_ok:
        reasons.append("all_reduce returned a wrong sum")
    if bad_peers:
        reasons.append(f"all_gather delivered wrong data from rank(s) {', '.join(map(str, bad_peers))}")
    if alltoall_ok is False:
        reasons.append("all_to_all delivered wrong data")
    others = [r["rank"] for r in ranks if not r["ok"] and r["rank"] != rank]
    if others:
        reasons.append(f"rank(s) {', '.join(map(str, others))} saw wrong results")
    return done(not reasons, details, "; ".join(reasons))


def run_collective_threads(args: dict[str, Any]) -> dict[str, Any]:
    """The local collective of level 2 with its ranks as threads of this process (gloo over loopback,
    each rank its own gloo context, as nccl-tests runs ranks as threads): the same exact checks as the
    one-process-per-rank test without an interpreter and an ``import torch`` per rank, which on a
    machine emulated on a few shared cores cost more than the collective. On a machine with GPUs and
    NCCL it defers (``details.deferred``) to one process per GPU."""
    import threading
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    if torch.cuda.is_available() and torch.cuda.device_count() > 0 and dist.is_nccl_available():
        return done(True, {"deferred": "nccl: one process per GPU"})
    world, seed = int(args.get("world_size", 2)), int(args.get("seed", 0))
    timeout = max(1.0, float(args["deadline_unix"]) - time.time() - 1.0)
    store = dist.HashStore()
    out: dict[int, dict[str, Any]] = {}

    def rank_main(rank: int) -> None:
        details: dict[str, Any] = {"rank": rank, "world_size": world, "backend": "gloo", "device": "cpu"}
        try:
            pg = dist.ProcessGroupGloo(dist.PrefixStore("tg-diag-local", store), rank, world,
                                       timedelta(seconds=timeout))
            out[rank] = collective_checks(args, rank, world, seed, torch.device("cpu"), details,
                                           _BackendOps(pg))
        except Exception as exc:
            out[rank] = done(False, details, f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # one intra-op thread per rank, as each rank process has (OMP_NUM_THREADS=1)
    try:
        threads = [threading.Thread(target=rank_main, args=(r,), name=f"rank{r}", daemon=True) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    finally:
        torch.set_num_threads(before)
    per_rank = [out.get(r) or done(False, {"rank": r}, f"did not finish within {timeout:.0f} s")
                for r in range(world)]
    first = per_rank[0]["details"]
    details = {
        "backend": "gloo", "threads": world, "devices": ["cpu"] * world,
        **{k: first.get(k) for k in ("allreduce_busbw_gbps", "allreduce_algbw_gbps", "allgather_algbw_gbps",
                                     "bytes")},
        "ranks": [{"rank": r, "ok": d["ok"], "reason": d["reason"],
                   **{k: d["details"].get(k) for k in ("device", "allreduce_ok", "allgather_ok", "alltoall_ok",
                                                      "bad_peers")}} for r, d in enumerate(per_rank)],
    }
    bad = [f"rank {r}: {d['reason']}" for r, d in enumerate(per_rank) if not d["ok"]]
    return done(not bad, details, "; ".join(bad))
