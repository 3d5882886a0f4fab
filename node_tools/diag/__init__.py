"""Stop-time diagnostics of a machine: levels 1-3, and the bit-wise alignment test.

The real-time checks (``trainguard.node_tools.checks``) watch a machine while a job runs and
put no load on it. When a job has stopped, the control plane can afford to load a
suspect machine and ask whether it is fit to go back into service::

    diag(cfg, 1)   quick health, seconds: the real-time checks once (rank findings
                   ignored: a stopped job is not the machine's fault), the GPU
                   snapshot against the expected GPU count, ``import torch``, a tiny
                   write/read in the work directory.
    diag(cfg, 2)   level 1, plus: a verified compute burn (float32 matmuls on every
                   device checked against a float64 reference, so wrong arithmetic is
                   caught, not only crashes), memory bandwidth, a local collective
                   with exact checks (NCCL across the GPUs, one process per GPU;
                   without GPUs gloo between 2 ranks that are threads of the test
                   process), and a disk write/fsync/read/verify.
    diag(cfg, 3, l3=L3Spec(...))
                   a collective with neighbour machines: every machine runs its rank
                   at the same time; all_reduce, all_gather and all_to_all of seeded
                   tensors are checked exactly and timed. Level 3 runs only that test
                   (the machines must start it together; run level 2 first).
    align(cfg)     a fixed tiny model, one deterministic training step; reports a
                   digest of its outputs, gradients and weights. Healthy machines of
                   the same kind (``compare_key``) agree bit for bit; the control plane
                   compares the digests.

Each returns ``(exit_code, report)``: 0 healthy, 1 unhealthy (each failing test has
a reason), 2 could not run (for level 3: the peers never came). The report is one
JSON-able document ``{"machine", "level", "healthy", "tests": [{"name", "ok",
"status", "duration_s", "details", "reason"}], "reasons", "duration_s", ...}``.

The tests run in worker processes (``python -m trainguard.node_tools.diag --worker ARGS``),
each in a session of its own; the quick tests, the compute, memory and disk tests
share one worker (torch is imported once), and so does the local collective of a
machine without GPUs (its ranks are threads); each NCCL or level-3 rank has its own. This
process follows every test and kills its worker, with all its children, when the
test passes its timeout, so a test that hangs (a GPU that stops answering, a peer
that never comes, a disk that blocks) fails instead of hanging the diagnostic; the
tests after it go on in a fresh worker. A worker also arms a kernel timer that
ends it should this process die first, and every process a run starts carries
``TG_DIAG_RUN=<run id>`` in its environment, so whatever escaped its session is
found and ended when the run finishes. ``timeout_s`` bounds each test (default:
30 s at level 1, 60 s at levels 2 and 3); a level's worst case is its test count
times that.

The compute burn hands every matmul result, and ``align`` one gradient before the update, to the
machine's fault points (:mod:`trainguard.node_tools.faultpoints`): inert on a real machine; on the
emulated cluster an ``sdc`` fault flips one bit there, as it does in a training rank's gradients.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from trainguard.core.errors import EXIT_OK, TrainguardError
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.diag.common import (
    ALIGN_ENV,
    ALIGN_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    LEVELS,
    L3Spec,
    tests_verdict,
)
from trainguard.node_tools.diag.runner import Runner, check_timeout, scratch

__all__ = ["ALIGN_ENV", "ALIGN_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "LEVELS", "L3Spec", "align", "diag"]


def diag(cfg: NodeConfig, level: int, *, timeout_s: float | None = None, l3: L3Spec | None = None,
         mem_floor_gbps: float = 0.5, seed: int = 0, align_steps: int = 0) -> tuple[int, dict[str, Any]]:
    """Run diagnostic ``level`` (1, 2 or 3) on this machine: (exit code, report).

    Args:
        cfg: this machine's configuration.
        level: 1 quick health, 2 with load (compute, memory, local collective, disk),
            3 collective with neighbour machines (needs ``l3``).
        timeout_s: limit of each test in seconds (default 30 at level 1, 60 at 2 and 3).
        l3: the group of a level-3 run. At level 2 it asks for level 3 in the same test process after
            level 2's tests (one ``import torch`` and one session for both; the machines of the group
            meet at the collective): the report's ``level`` stays 2, its tests end with
            ``collective_neighbours``.
        mem_floor_gbps: memory copy bandwidth below which level 2 fails, GB/s.
        seed: seed of every generated input.
        align_steps: with ``l3``, also the alignment test (:func:`align`, this many steps) in the same
            test process, right after the collective (one ``import torch`` for both); its digest is the
            report's ``align`` (it does not judge the level's verdict: machines are compared).
    Raises:
        TrainguardError: (exit 2) a level other than 1-3, level 3 without ``l3``, a bad
            timeout or group.
    """
    if isinstance(level, bool) or not isinstance(level, int) or level not in LEVELS:
        raise TrainguardError(f"diag level {level!r} is unknown; use 1 (quick), 2 (medium) or 3 (neighbours)")
    if level == 3 and l3 is None:
        raise TrainguardError(
            "diag level 3 runs with neighbour machines and needs the group: rank, world size, master "
            "address and port (L3Spec)"
        )
    if l3 is not None:
        if level == 1:
            raise TrainguardError("diag: a neighbour group (L3) goes with level 2 or 3, not level 1")
        l3.validate()
    if align_steps and l3 is None:
        raise TrainguardError("diag: the alignment test runs after the neighbour collective; give the group (L3)")
    timeout = check_timeout(DEFAULT_TIMEOUT_S[level] if timeout_s is None else timeout_s)
    started, t0 = time.time(), time.monotonic()
    with scratch("tg-diag-") as tmp:
        runner = Runner(cfg, Path(tmp), timeout, seed)
        tests: list[dict[str, Any]] = []
        try:
            # workdir first: it creates the work directory when missing, which the disk check needs
            specs: list[tuple[str, dict[str, Any]]] = [("workdir", {}), ("checks", {}), ("gpu", {}), ("torch", {})]
            if level == 2:
                specs += [("compute", {}), ("memory", {"floor_gbps": float(mem_floor_gbps)}), ("disk", {}),
                          ("collective_threads", {"world_size": 2})]
            env: dict[str, str] | None = None
            if level == 2 and l3 is not None:  # then L3 (and align) in the same process
                l3_args, env = runner.l3_plan(l3, align_steps)
                specs.append(("collective", l3_args))
                if align_steps:
                    specs.append(("align", {"steps": align_steps}))
            if level in (1, 2):
                tests += runner.batch(specs, env=env)  # one process, one import of torch
            aligned = tests.pop() if level == 2 and align_steps else None
            neighbours = runner.l3_result(tests.pop(), l3) if level == 2 and l3 is not None else None
            if level == 2:
                local = tests.pop()
                local["name"] = "collective_local"
                if local["ok"] and local["details"].get("deferred"):  # GPUs: one process per GPU
                    torch_info = next(t["details"] for t in tests if t["name"] == "torch")
                    local = runner.local_collective(torch_info)
                tests.append(local)
            if neighbours is not None:
                tests.append(neighbours)
            if level == 3:
                assert l3 is not None
                tests += runner.neighbour_collective(l3, align_steps=align_steps)
                aligned = tests.pop() if align_steps else None
        finally:
            stragglers = runner.sweep()
    code, healthy = tests_verdict(tests)
    report = {
        "machine": cfg.machine,
        "level": level,
        "level_name": LEVELS[level],
        "healthy": healthy,
        "exit_code": code,
        "reasons": [f"{t['name']}: {t['reason']}" for t in tests if not t["ok"]],
        "tests": tests,
        "timeout_s": timeout,
        "started_ts": started,
        "duration_s": round(time.monotonic() - t0, 3),
    }
    if stragglers:
        report["stragglers_killed"] = stragglers
    if l3 is not None:
        report["l3"] = asdict(l3)
        if aligned is not None:
            report["align"] = _align_fields(aligned, seed, align_steps)
    return code, report


def align(cfg: NodeConfig, *, seed: int = 0, steps: int = 1,
          timeout_s: float = ALIGN_TIMEOUT_S) -> tuple[int, dict[str, Any]]:
    """The bit-wise alignment test: one fixed tiny model, ``steps`` deterministic SGD steps.

    Reports ``digest`` (sha256 of the outputs, gradients and updated weights) with the
    device, the torch version and ``compare_key``: machines with the same key must
    agree exactly. The test does not judge itself (exit 0 when it ran); exit 1 when
    the step failed or timed out on this machine, 2 when it could not start.
    """
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise TrainguardError(f"align: steps {steps!r} must be an integer >= 1")
    timeout = check_timeout(timeout_s)
    started, t0 = time.time(), time.monotonic()
    with scratch("tg-align-") as tmp:
        runner = Runner(cfg, Path(tmp), timeout, seed)
        try:
            test = runner.simple("align", {"steps": steps}, env=ALIGN_ENV)
        finally:
            runner.sweep()
    report = {"machine": cfg.machine, "test": "align", **_align_fields(test, seed, steps), "tests": [test],
              "started_ts": started, "duration_s": round(time.monotonic() - t0, 3)}
    return report["exit_code"], report


def _align_fields(test: dict[str, Any], seed: int, steps: int) -> dict[str, Any]:
    """What a report says of an alignment test's result."""
    code, _ = tests_verdict([test])
    details = test["details"]
    return {
        "healthy": code == EXIT_OK,  # it ran; agreement is judged across machines
        "exit_code": code,
        "digest": details.get("digest") if test["ok"] else None,
        "compare_key": details.get("compare_key"),
        "device": details.get("device"),
        "torch": details.get("torch"),
        "seed": seed,
        "steps": steps,
        "reasons": [] if test["ok"] else [f"align: {test['reason']}"],
    }
