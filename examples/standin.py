"""A stand-in training job for the fan-out benchmark: no torch, no collectives, one process per machine
(``tg-node job start --launcher direct``). It does what the control plane watches a rank do: the trainguard
hook's heartbeats and one step record every ``--step-s`` seconds, until it is stopped (SIGTERM: it leaves
a final heartbeat and exits 0) or has run ``--steps`` steps.

    python examples/standin.py [--step-s 1.0] [--steps 0]
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.node_tools.monitor import JobMonitor


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--step-s", type=float, default=1.0, help="seconds a step takes")
    p.add_argument("--steps", type=int, default=0, help="steps to run (0: until stopped)")
    for dim in ("tp", "pp", "dp"):  # the layout every launch hands its job (one rank a machine here)
        p.add_argument(f"--{dim}", type=int, default=1)
    args = p.parse_args(argv)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    monitor = JobMonitor.from_env(coords={"tp": 0, "pp": 0, "dp": int(os.environ.get("RANK", "0"))})
    step = 0
    try:
        while not stop.is_set() and (not args.steps or step < args.steps):
            t0 = time.monotonic()
            stop.wait(args.step_s)
            monitor.step_end(step, loss=1.0 / (step + 1), grad_norm=1.0, step_time_s=time.monotonic() - t0,
                             tokens_per_s=0.0)
            step += 1
    finally:
        monitor.close("stopped" if stop.is_set() else "finished")
    return 0


if __name__ == "__main__":
    sys.exit(main())
