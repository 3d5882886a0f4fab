"""False fail-slow alarms on healthy jobs whose steps take 10 ms, 50 ms and 200 ms, beside two CPU hogs, and a 30%
straggler still voted out: the fail-slow rules judged on each job's own noise (docs/operate.md, "Fail-slow on the
job's own noise"), through ``trainguard controlplane up``'s defaults and ``trainguard job submit``.

The job is the day's program (``bench/stranger/train.py``, see ``bench/day.py``): Lightning's own ``BoringModel``
and fit loop with DDP on 2 machines, gradient accumulation over 2 micro-batches, its own validation every 200
batches, one standby. Its native step takes about 9 ms here; for the longer step times each micro-batch also waits
(``--pace-s``: a third in its forward, the rest in its backward), as a bigger model's device would keep the host
waiting. For each step time, on a control plane of its own:

1. ``--healthy-s`` seconds of healthy training with two CPU hogs on the host (the two cores the machines share;
   the hogs run for the whole benchmark): every incident that opens is a false alarm; the slow alerts recorded
   without an incident are counted beside;
2. then, under the same load, one rank sleeps 30% of the job's measured step before each of its steps: its
   incident, the vote's verdict, and whether its machine was swapped for the standby.

    python bench/false_slow.py --out bench/results/false_slow.json           # 30 min a step time
    python bench/false_slow.py --quick                                       # 2 min a step time
    python bench/false_slow.py --step-s 0.05,0.2 --parallel --out bench/results/false_slow_parallel.json
                                         # both at once, a control plane each, beside the same two hogs
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import stop_on_sigterm, write_result
from bench.day import FINAL, Day, Plane

#: the micro-batch's wait for each step time (2 micro-batches a step; the native step is about 9 ms)
PACE_S = {0.01: 0.0, 0.05: 0.02, 0.2: 0.095}
NAME, SUBNET = "tgfs", "10.213.47.0/24"
SLOW_KINDS = {"throughput_decline", "rank_slow"}


def step_s_measured(day: Day, *, last: int = 400) -> float | None:
    """The job's step as its rank 0 trained it: the median gap between its last optimizer steps' first micro-batches
    (its own evaluation's pauses included, as a person timing the job would see them)."""
    procs = day.processes()
    if not procs:
        return None
    firsts: dict[int, float] = {}
    for line in procs[-1][1].read_text().splitlines()[-4 * last:]:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        firsts.setdefault(int(rec["step"]), float(rec["ts"]))
    ts = [firsts[s] for s in sorted(firsts)][-last:]
    gaps = [b - a for a, b in itertools.pairwise(ts)]
    return round(statistics.median(gaps), 5) if gaps else None


def one(step_s: float, seconds: float, log: Any, *, name: str = NAME, subnet: str = SUBNET) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="tg-bench-slow-"))
    pace = PACE_S.get(step_s, max(0.0, (step_s - 0.01) / 2))
    day = Day(Plane(home, log=log, name=name, subnet=subnet), program_args=["--pace-s", f"{pace:g}"] if pace else [])
    out: dict[str, Any] = {"step_s_target": step_s, "pace_s": pace, "seconds": seconds, "hogs": 2}
    try:
        day.up()
        day.submit()
        t0 = time.time()
        healthy = day.healthy(seconds)
        machines = day.machines()
        shared = day.fleet.alerts_on(machines, kinds=SLOW_KINDS, since=t0)
        step = step_s_measured(day)
        out.update(healthy=healthy, step_s_measured=step, slow_alerts=len(shared),
                   slow_alerts_without_incident=sum(1 for a in shared if a.incident_id is None),
                   slow_incidents=sum(1 for line in healthy["opened"] if " slow:" in line))
        # a straggler: one rank sleeps 30% of the job's step before each of its steps, under the same load
        first, straggler = machines
        added = round(0.3 * (step or step_s), 4)
        last = day.last()
        t1 = day.inject(straggler, "slow", rank=1, seconds=added)
        try:
            inc = day.wait(lambda: next((i for i in day.incidents() if i.id > last and i.state in FINAL), None),
                           600, "the straggler's incident to close", interval=2.0)
        except AssertionError as exc:
            inc = None
            out["straggler_error"] = str(exc)[:500]
        finally:
            day.cli("inject", "--machine", straggler, "--clear", check=False)
        now = day.machines()
        out["straggler"] = {
            "machine": straggler, "added_s": added, "incident": inc.id if inc else None,
            "category": inc.category if inc else None, "state": inc.state if inc else None,
            "detected_s": round(inc.opened_ts - t1, 2) if inc else None,
            "closed_s": round(inc.closed_ts - t1, 2) if inc and inc.closed_ts else None,
            "summary": inc.summary[:400] if inc else None, "machines": now,
            "voted_out": bool(inc and inc.category == "slow" and inc.state == "resolved" and straggler not in now
                              and first in now),
            "phases": day.phases(inc.id) if inc else []}
        log(f"straggler: {out['straggler']}")
    finally:
        day.down()
        shutil.rmtree(home, ignore_errors=True)
    return out


@contextlib.contextmanager
def hogs(n: int = 2) -> Iterator[None]:
    """``n`` busy loops on the host (the cores the emulated machines share) while the block runs."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True) for _ in range(n)]
    try:
        yield
    finally:
        for h in procs:
            h.kill()
            h.wait()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2 minutes of healthy training a step time")
    ap.add_argument("--step-s", default="0.01,0.05,0.2", help="the job's step times, seconds, comma-separated")
    ap.add_argument("--healthy-s", default="1800",
                    help="healthy seconds a step time (default 1800), or one figure per step time, comma-separated")
    ap.add_argument("--parallel", action="store_true",
                    help="all step times at once, each on a control plane of its own, beside the same two hogs")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    stop_on_sigterm()
    try:
        steps = [float(x) for x in args.step_s.split(",") if x]
        windows = [float(x) for x in args.healthy_s.split(",") if x]
    except ValueError:
        print(f"--step-s {args.step_s!r} --healthy-s {args.healthy_s!r}: write seconds separated by commas, e.g. "
              f"--step-s 0.01,0.05,0.2 --healthy-s 1800", file=sys.stderr)
        return 2
    if not steps or any(s <= 0 for s in steps) or not windows or any(w <= 0 for w in windows):
        print(f"--step-s {args.step_s!r} --healthy-s {args.healthy_s!r}: every figure must be above 0",
              file=sys.stderr)
        return 2
    if len(windows) not in (1, len(steps)):
        print(f"--healthy-s {args.healthy_s!r}: give one window, or one per step time ({len(steps)})",
              file=sys.stderr)
        return 2
    windows = [120.0] * len(steps) if args.quick else windows * (len(steps) // len(windows))
    t0 = time.time()
    planes = [(f"{NAME}{i}" if args.parallel else NAME, f"10.213.{47 + i}.0/24" if args.parallel else SUBNET)
              for i in range(len(steps))]

    def run(i: int) -> dict[str, Any]:
        label = f"{steps[i] * 1000:g}ms: " if args.parallel else ""
        return one(steps[i], windows[i], lambda m: print(label + m, file=sys.stderr, flush=True),
                   name=planes[i][0], subnet=planes[i][1])

    with hogs(2):
        if args.parallel:
            with concurrent.futures.ThreadPoolExecutor(len(steps)) as pool:
                runs = list(pool.map(run, range(len(steps))))
        else:
            runs = [run(i) for i in range(len(steps))]
    metrics: dict[str, Any] = {}
    for run in runs:
        key = f"{run['step_s_target'] * 1000:g}ms"
        window = run["healthy"]["seconds"]
        metrics[f"false_slow_incidents_30min.{key}"] = {
            "value": round(run["slow_incidents"] * 1800.0 / window, 2), "n": 1, "unit": "incidents", "target": 0,
            "window_s": window}
        metrics[f"incidents_healthy.{key}"] = {"value": run["healthy"]["incidents"], "n": 1, "unit": "incidents",
                                               "target": 0, "window_s": window}
        metrics[f"step_s_measured.{key}"] = {"value": run["step_s_measured"], "n": 1, "unit": "s"}
        metrics[f"slow_rank_30pct_voted_out.{key}"] = {"value": int(run["straggler"]["voted_out"]), "n": 1,
                                                       "unit": "bool", "target": 1}
        if run["straggler"]["detected_s"] is not None:
            metrics[f"slow_rank_detected_s.{key}"] = {"value": run["straggler"]["detected_s"], "n": 1, "unit": "s"}
    text = write_result("false_slow", quick=bool(args.quick), out=args.out, metrics=metrics, setup={
        "program": "bench/stranger/train.py (Lightning BoringModel, DDP on 2 machines, accumulate_grad_batches=2, "
                   "its own validation every 200 batches), --pace-s per micro-batch for the longer steps",
        "control_plane": "trainguard controlplane up, its defaults; trainguard job submit with standbys: 1",
        "load": "two CPU hogs (busy loops) on the host, which the emulated machines share, for the whole run"
                + ("; the step times ran at once, each on a control plane of its own" if args.parallel else ""),
        "wall_s": round(time.time() - t0, 1), "runs": runs})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
