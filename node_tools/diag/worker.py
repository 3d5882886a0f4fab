"""``python -m trainguard.node_tools.diag --worker ARGS.json``: a worker process runs the tests listed in ARGS."""

from __future__ import annotations

import json
import signal
import sys
import time
import traceback
from pathlib import Path

from trainguard.core.errors import EXIT_USAGE
from trainguard.node_tools.diag.alignment import run_align
from trainguard.node_tools.diag.collectives import run_collective, run_collective_threads
from trainguard.node_tools.diag.common import (
    WORKER_GRACE_S,
    done,
    emit,
)
from trainguard.node_tools.diag.levels import (
    run_checks,
    run_compute,
    run_disk,
    run_gpu,
    run_memory,
    run_torch,
    run_workdir,
)

WORKERS = {
    "checks": run_checks, "gpu": run_gpu, "torch": run_torch, "workdir": run_workdir, "compute": run_compute,
    "memory": run_memory, "disk": run_disk, "collective": run_collective, "align": run_align,
    "collective_threads": run_collective_threads,
}


def worker_main(argv: list[str]) -> int:
    """``python -m trainguard.node_tools.diag --worker ARGS.json``: run the tests listed in ARGS, in order."""
    if len(argv) != 2 or argv[0] != "--worker":
        print("usage: python -m trainguard.node_tools.diag --worker ARGS.json", file=sys.stderr)
        return EXIT_USAGE
    args = json.loads(Path(argv[1]).read_text(encoding="utf-8"))
    # our own end, should the parent die before it can kill us: SIGALRM's default action ends the process
    remaining = float(args.get("deadline_unix", time.time() + 600)) - time.time()
    signal.setitimer(signal.ITIMER_REAL, max(0.5, remaining + WORKER_GRACE_S))
    common = {k: v for k, v in args.items() if k != "tests"}
    for name, targs in args["tests"]:
        emit("start", test=name)
        t0 = time.monotonic()
        try:
            if name not in WORKERS:
                raise ValueError(f"no diagnostic test is called {name!r}")
            result = WORKERS[name]({**common, **targs})
        except Exception as exc:
            result = done(False, {"traceback": traceback.format_exc(limit=6)[-2000:]},
                           f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}")
        emit("result", test=name, duration_s=round(time.monotonic() - t0, 3), **result)
    return 0
