"""Scale benchmark of the runtime analysis: every rank's stack in a hang, and the fail-slow vote.

What the control plane does once every machine's ``tg-node stacks`` document is in
(:meth:`trainguard.operators.control.analysis.Analysis.analyze` after the SSH round): each rank's
signature and collective counters (:func:`trainguard.operators.policy.runtime.rank_stacks`), the grouping, the
outliers and the parallel group to over-evict (:func:`trainguard.operators.policy.runtime.analyze`, kinds
``("pp", "dp")``); and the fail-slow vote (:class:`trainguard.operators.policy.runtime.SlowVoter`: 5 rounds of every
rank's compute time, then the verdict).

The layout is TP=8, PP=8, DP=the rest, 8 ranks per machine; DP is rounded so that the world is the
size asked for within one pipeline (100,000 ranks: 99,968 on 12,496 machines). Ranks in the same stack
share its frame list (parsed from JSON, 100,000 ranks' 25 frames each would take about a gigabyte before
the analysis starts); every other part of the documents is per machine and per rank.

* ``stack_analysis_s``: every rank waits in the data-parallel all-reduce (25 frames deep) except one
  pipeline: one machine of it still computes, the other stages wait in point-to-point send / recv, and
  its ranks have started one all-reduce fewer. The answer is that pipeline's machines (``pp``).
* ``stack_analysis_distinct_s``: as above, plus up to 5,000 ranks spread over the job each in a function
  of its own (a rank id in a generated function's name): thousands of distinct signatures and outliers
  that fit no single group; the rank the alerts name chooses the pipeline.
* ``slow_vote_s``: one machine's ranks compute 3x longer in 4 of 5 rounds, noise elsewhere; the verdict
  is that machine (``tp``).

    python bench/scale_stacks.py [SIZE ...]
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.core.topology import Topology
from trainguard.operators.policy import runtime

SIZES = [1_000, 10_000, 100_000]
TP, PP, RANKS_PER_MACHINE = 8, 8, 8
SITE = "/opt/venv/lib/python3.12/site-packages"
ALL_REDUCE_ROUNDS = 4_200  # collectives every healthy rank has started

#: outermost first; each stack is innermost first, like py-spy's
_OUTER = [("<module>", "/job/run.py", 12), ("_run_code", "/usr/lib/python3.12/runpy.py", 88),
          ("_run_module_as_main", "/usr/lib/python3.12/runpy.py", 198), ("main", "/job/train.py", 411),
          ("wrapper", f"{SITE}/torch/distributed/elastic/multiprocessing/errors/__init__.py", 355),
          ("train", "/job/train.py", 377), ("run_epoch", "/job/train.py", 302),
          ("train_step", "/job/train.py", 260), ("backward_step", "/job/pipeline.py", 140),
          ("finish_grad_sync", "/job/ddp.py", 220), ("_flush_buckets", "/job/ddp.py", 190),
          ("allreduce_bucket", "/job/ddp.py", 171), ("_reduce", "/job/ddp.py", 160),
          ("record_function", f"{SITE}/torch/autograd/profiler.py", 751)]
_ALL_REDUCE = [("wait", f"{SITE}/torch/distributed/distributed_c10d.py", 2501),
               ("_wait_work", f"{SITE}/torch/distributed/distributed_c10d.py", 2480),
               ("all_reduce", f"{SITE}/torch/distributed/distributed_c10d.py", 2455),
               ("wrapper", f"{SITE}/torch/distributed/c10d_logger.py", 83),
               ("_all_reduce_coalesced", "/job/ddp.py", 140), ("_all_reduce_flat", "/job/ddp.py", 133),
               ("_grad_buffer", "/job/ddp.py", 120), ("_coalesce", "/job/ddp.py", 110),
               ("_sync_bucket", "/job/ddp.py", 101), ("_prepare", "/job/ddp.py", 95),
               ("_bucket_ready", "/job/ddp.py", 90)]
_COMPUTE = [("linear", f"{SITE}/torch/nn/modules/linear.py", 125),
            ("_call_impl", f"{SITE}/torch/nn/modules/module.py", 1750),
            ("_wrapped_call_impl", f"{SITE}/torch/nn/modules/module.py", 1739),
            ("forward", "/job/model.py", 88), ("_call_impl", f"{SITE}/torch/nn/modules/module.py", 1750),
            ("_wrapped_call_impl", f"{SITE}/torch/nn/modules/module.py", 1739),
            ("forward", "/job/model.py", 140), ("forward_step", "/job/pipeline.py", 80),
            ("recompute", "/job/pipeline.py", 70), ("_checkpoint", "/job/pipeline.py", 66),
            ("checkpoint", f"{SITE}/torch/utils/checkpoint.py", 495)]
_P2P = [("wait", f"{SITE}/torch/distributed/distributed_c10d.py", 2501),
        ("irecv", f"{SITE}/torch/distributed/distributed_c10d.py", 2130),
        ("_p2p_ops", "/job/pipeline.py", 44), ("recv_backward", "/job/pipeline.py", 52),
        ("_communicate", "/job/pipeline.py", 58), ("_exchange", "/job/pipeline.py", 60),
        ("_recv", "/job/pipeline.py", 61), ("_grad_in", "/job/pipeline.py", 62),
        ("_stage_in", "/job/pipeline.py", 63), ("_schedule", "/job/pipeline.py", 64),
        ("_one_f_one_b", "/job/pipeline.py", 65)]


def _frames(inner: list[tuple[str, str, int]]) -> list[dict[str, Any]]:
    return [{"name": n, "filename": f, "line": line} for n, f, line in inner + _OUTER[::-1]]


def layout(size: int) -> Topology:
    """TP=8, PP=8, DP the rest: the world within one pipeline of ``size`` ranks."""
    return Topology(tp=TP, pp=PP, dp=max(1, round(size / (TP * PP))), ranks_per_machine=RANKS_PER_MACHINE)


def machine_names(topo: Topology) -> list[str]:
    return [f"gpu{i:05d}" for i in range(topo.machines)]


def stacks_documents(topo: Topology, frames_of: Callable[[int], list[dict[str, Any]]],
                     started_of: Callable[[int], int]) -> dict[str, dict[str, Any]]:
    """``tg-node stacks`` documents by machine name."""
    docs: dict[str, dict[str, Any]] = {}
    for m, name in enumerate(machine_names(topo)):
        ranks = topo.ranks_on(m)
        doc = {
            "job": "scale", "machine": name, "incarnation": 3, "duration_s": 0.8,
            "processes": [{"pid": 1000 + r % RANKS_PER_MACHINE, "role": "rank", "rank": r,
                           "local_rank": r % RANKS_PER_MACHINE, "process_state": "S", "mode": "paused",
                           "error": None, "note": None,
                           "threads": [{"thread_id": 1, "name": "MainThread", "active": True, "owns_gil": False,
                                        "frames": frames_of(r)}]} for r in ranks],
            "collectives": {str(r): {"dp": {"started": started_of(r), "completed": ALL_REDUCE_ROUNDS - 1},
                                     "pp": {"started": 2 * ALL_REDUCE_ROUNDS, "completed": 2 * ALL_REDUCE_ROUNDS}}
                            for r in ranks},
            "steps": {str(r): ALL_REDUCE_ROUNDS for r in ranks},
        }
        docs[name] = doc
    return docs


def stuck_pipeline(topo: Topology) -> int:
    """The data-parallel replica whose pipeline hangs in the synthetic job."""
    return topo.dp // 2


def hang_documents(topo: Topology, distinct: int = 0) -> dict[str, dict[str, Any]]:
    """One pipeline stuck (a machine of it computing, its other stages in send / recv, one all-reduce behind);
    ``distinct`` other ranks, spread over the job, each in a function of its own."""
    stuck = stuck_pipeline(topo)
    computing = topo.rank_of(tp=0, pp=PP // 2, dp=stuck) // RANKS_PER_MACHINE
    waiting, compute, p2p = _frames(_ALL_REDUCE), _frames(_COMPUTE), _frames(_P2P)
    odd = set(random.Random(7).sample([r for r in range(topo.world_size) if topo.coords(r).dp != stuck],
                                      distinct)) if distinct else set()

    def frames_of(r: int) -> list[dict[str, Any]]:
        if topo.coords(r).dp == stuck:
            return compute if topo.machine_of(r) == computing else p2p
        if r in odd:  # e.g. a generated function with the rank in its name
            return _frames([_ALL_REDUCE[0], (f"_fused_kernel_rank{r}", "<generated>", 1), *_ALL_REDUCE[1:]])
        return waiting

    return stacks_documents(topo, frames_of,
                            lambda r: ALL_REDUCE_ROUNDS - (topo.coords(r).dp == stuck))


def run_analysis(topo: Topology, docs: dict[str, dict[str, Any]], named: list[int]) -> runtime.Analysis:
    """What Analysis.analyze runs on the documents of the SSH round."""
    names = machine_names(topo)
    machine_of = {r: names[topo.machine_of(r)] for r in range(topo.world_size)}
    return runtime.analyze(topo, runtime.rank_stacks(docs, topo.world_size, machine_of), named=named,
                           kinds=("pp", "dp"))


def prepare_stack_analysis(size: int, distinct: int = 0) -> Callable[[], Any]:
    topo = layout(size)
    docs = hang_documents(topo, distinct)
    stuck = stuck_pipeline(topo)
    named = [topo.rank_of(tp=0, pp=PP // 2, dp=stuck)]
    expected = sorted({topo.machine_of(topo.rank_of(tp=0, pp=p, dp=stuck)) for p in range(PP)})

    def run() -> tuple[str, int]:
        a = run_analysis(topo, docs, named)
        if a.group_kind != "pp" or a.evict_machines != expected:
            raise AssertionError(f"chose {a.group_kind} {a.evict_machines[:10]}, expected pp {expected}")
        return a.group_kind, len(a.outliers)

    return run


def prepare_stack_analysis_distinct(size: int) -> Callable[[], Any]:
    return prepare_stack_analysis(size, distinct=min(5_000, size // 2))


def prepare_slow_vote(size: int) -> Callable[[], Any]:
    topo = layout(size)
    slow_machine = topo.machines // 3
    rng = random.Random(11)
    rounds = []
    for i in range(5):
        times = {r: (0.5 if topo.coords(r).pp == PP - 1 else 0.4) * rng.uniform(0.95, 1.05)
                 for r in range(topo.world_size)}
        if i != 2:
            for r in topo.ranks_on(slow_machine):
                times[r] *= 3.0
        for r in rng.sample(range(topo.world_size), 3):  # a loaded host now and then
            times[r] *= 2.0
        rounds.append(times)

    def run() -> tuple[str, list[int]] | None:
        voter = runtime.SlowVoter(topo, rounds=5)
        for times in rounds:
            voter.add_round(times)
        verdict = voter.verdict()
        if verdict != ("tp", [slow_machine]):
            raise AssertionError(f"verdict {verdict}, expected tp [{slow_machine}]")
        return verdict

    return run


CASES: dict[str, tuple[Callable[[int], Callable[[], Any]], list[int]]] = {
    "stack_analysis_s": (prepare_stack_analysis, SIZES),
    "stack_analysis_distinct_s": (prepare_stack_analysis_distinct, SIZES),
    "slow_vote_s": (prepare_slow_vote, SIZES),
}


def main(argv: list[str]) -> int:
    import resource

    sizes = [int(a) for a in argv] or None
    for metric, (prepare, default_sizes) in CASES.items():
        for size in sizes or default_sizes:
            run = prepare(size)
            t0, cpu0 = time.perf_counter(), time.process_time()
            result = run()
            took, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10
            print(f"{metric} size={size}: {took:.3f} s ({cpu:.3f} s of CPU; process peak RSS {peak:.0f} MiB) "
                  f"-> {result}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
