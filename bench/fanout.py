"""The control plane's SSH fan-out as the fleet grows: stop, restart, status round and L1 diagnosis round over
namespace clusters of 16, 64, 256 ... thin machines.

    python bench/fanout.py [--sizes 16,64,256] [--trials 3] [--l1-sizes 16,64] [--max] [--out FILE]

A thin machine runs what the control plane talks to and nothing else: sshd, the agent, and a stand-in job
(``examples/standin.py`` through ``tg-node job start --launcher direct``: the trainguard hook's heartbeats and
a step record a second, no torch). Each round is the code the recovery runs (:mod:`trainguard.node_tools.launcher`'s
``launch``, ``stop`` and ``status``; ``tg-node diag --level 1`` in waves of ``TG_DIAG_CONCURRENCY`` machines)
over trainguard's SSH transport (:class:`trainguard.node_tools.transport.SshTransport`: paramiko, host keys pinned), at
the default fan-out (``trainguard.node_tools.transport.FANOUT`` sessions at once), one connection per machine
held across the rounds (the first trial's first round opens them). For each round and size: the wall time
(median of ``--trials``), the control plane's own CPU (this process: the SSH clients run in it) and peak memory,
the host's CPU in all (every machine's side of the round runs on the same cores), and the sessions refused (sshd's
``MaxStartups``, or a session that failed); for each size, the cores the idle machines keep busy
(``idle_cores``: agents and stand-ins, no round).
``--max`` adds the largest cluster the host's free memory holds (measured per machine at the first size).

The results go into the scale benchmark's file (``bench/results/scale.json``: metrics ``fanout_<round>_s.<N>``,
``fanout_stop_ratio_256_vs_16``, ``largest_fanout_machines``), beside what ``bench/scale.py`` wrote there.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from trainguard.core.errors import ClusterError  # noqa: E402
from trainguard.core.topology import Topology  # noqa: E402
from trainguard.emulation import cluster  # noqa: E402
from trainguard.node_tools import launcher  # noqa: E402
from trainguard.node_tools.inventory import Inventory  # noqa: E402
from trainguard.node_tools.transport import FANOUT, RunResult, transport_for  # noqa: E402

JOB = "fanout"
SUBNET = "10.214.0.0/22"  # room for 1,000 machines
DIAG_WAVE = 8  # TG_DIAG_CONCURRENCY's default: machines diagnosed at once
ROUNDS = ("restart", "status", "stop")


def _host_cpu_s() -> float:
    """Seconds of CPU the whole host spent so far (user + system + ..., all cores; /proc/stat)."""
    with open("/proc/stat") as fh:
        fields = fh.readline().split()[1:]
    busy = sum(int(v) for i, v in enumerate(fields) if i not in (3, 4))  # less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def _own_cpu_s() -> float:
    """This process's CPU (its SSH connections are threads of it) and its children's."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime


def _mem_available_mb() -> float:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _refused(results: dict[str, RunResult]) -> list[str]:
    """Machines whose session did not run its command (refused, reset, timed out)."""
    return sorted(name for name, r in results.items() if not r.reachable or r.timed_out)


def _timed(fn: Callable[[], Any]) -> dict[str, Any]:
    cpu0, host0, t0 = _own_cpu_s(), _host_cpu_s(), time.monotonic()
    out = fn()
    wall = time.monotonic() - t0
    return {"s": wall, "control_cpu_s": _own_cpu_s() - cpu0, "host_cpu_s": _host_cpu_s() - host0, "out": out}


def _plan(inv: Inventory) -> launcher.JobPlan:
    machines = list(inv.machines)
    return launcher.JobPlan(job=JOB, topology=Topology(tp=1, pp=1, dp=len(machines), ranks_per_machine=1),
                            machines=machines, entry="examples/standin.py", launcher="direct",
                            train_args=["--step-s", "1.0"])


def _flatten(results: Any) -> dict[str, RunResult]:
    return {k: v for k, v in results.items() if isinstance(v, RunResult)} if isinstance(results, dict) else {}


def measure(size: int, trials: int, *, l1: bool, log: Callable[[str], None], patient: float = 1.0) -> dict[str, Any]:
    """One cluster of ``size`` thin machines: bring-up, then each round ``trials`` times. ``patient``: the
    rounds' session limits times this (the recovery's own limits at 1: launch 60 s, status 20 s, stop's
    marking 30 s)."""
    state = Path(tempfile.mkdtemp(prefix="tg-fanout-")) / "state"
    spec = cluster.ClusterSpec(name="tgf", machines=size, standbys=0, subnet=SUBNET, disk_mb=16, gpus=1,
                               job_nice=0)
    cluster.down(state, name=spec.name, log=lambda *_: None)
    avail0 = _mem_available_mb()
    t0 = time.monotonic()
    out: dict[str, Any] = {"machines": size, "rounds": {r: [] for r in ROUNDS}, "refused": 0, "failed": [],
                           "limits": "the recovery's" if patient == 1 else f"the recovery's x {patient:g}"}
    inv: Inventory | None = None
    transport: Any = None
    try:
        inv = cluster.up(spec, state, log=lambda *_: None)
        out["up_s"] = round(time.monotonic() - t0, 2)
        transport = transport_for(inv)
        plan = _plan(inv)
        for trial in range(trials):
            try:
                launched = _timed(lambda: launcher.launch(inv, plan, transport=transport, timeout=60 * patient))
            except ClusterError as exc:  # all or nothing: a machine that did not start (or was refused)
                out["failed"].append(f"trial {trial}: launch: {str(exc)[:300]}")
                break
            out["rounds"]["restart"].append(launched)
            # every machine's stand-in has written a heartbeat: the job runs everywhere
            deadline = time.monotonic() + 120
            while True:
                st = _timed(lambda: launcher.status(inv, JOB, inv.machines, transport=transport, timeout=20 * patient))
                running = [n for n, d in st["out"].items() if d.get("state") == "running" and d.get("ranks")]
                if len(running) == size or time.monotonic() > deadline:
                    break
            out["rounds"]["status"].append(st)
            out["refused"] += sum(1 for d in st["out"].values() if "error" in d)
            if len(running) != size:
                out["failed"].append(f"trial {trial}: {size - len(running)} machines not running after launch")
            if trial == 0:  # what the machines cost the host's cores with no round under way (agents, jobs)
                host0, t_idle = _host_cpu_s(), time.monotonic()
                time.sleep(5.0)
                out["idle_cores"] = round((_host_cpu_s() - host0) / (time.monotonic() - t_idle), 2)
            stopped = _timed(lambda: launcher.stop_sessions(inv, JOB, inv.machines, transport=transport,
                                                            limit_s=30 * patient))
            out["rounds"]["stop"].append(stopped)
            bad = {n: r.describe() for n, r in stopped["out"].items() if not r.ok}
            if bad:
                out["failed"].append(f"trial {trial}: stop: {len(bad)} machines, e.g. {next(iter(bad.values()))}")
            log(f"  {size} machines, trial {trial + 1}: restart {launched['s']:.2f} s, status {st['s']:.2f} s, "
                f"stop {stopped['s']:.2f} s")
        out["mem_per_machine_mb"] = round((avail0 - _mem_available_mb()) / size, 1)
        if l1:
            def l1_round() -> dict[str, RunResult]:
                done: dict[str, RunResult] = {}
                ms = list(inv.machines)
                for i in range(0, len(ms), DIAG_WAVE):
                    done.update(transport.run_many(ms[i:i + DIAG_WAVE],
                                                   lambda m: [inv.tg_node, "diag", "--level", "1"], timeout=120))
                return done
            diag = _timed(l1_round)
            bad = {n: r.describe() for n, r in diag["out"].items() if not r.ok}
            if bad:
                out["failed"].append(f"L1: {len(bad)} machines failed, e.g. {next(iter(bad.values()))}")
            out["rounds"]["l1"] = [diag]
            log(f"  {size} machines: L1 diagnosis round {diag['s']:.1f} s")
    except ClusterError as exc:  # the cluster did not come up (or a round raised): what was measured stays
        out["failed"].append(str(exc)[:300])
    finally:
        if inv is not None:  # whatever still runs there ends with the cluster below anyway
            with contextlib.suppress(Exception):
                launcher.stop(inv, JOB, inv.machines, transport=transport)
        if transport is not None:
            transport.close()
        cluster.down(state, name=spec.name, log=lambda *_: None)
        import shutil

        shutil.rmtree(state.parent, ignore_errors=True)
    for name, trials_ in list(out["rounds"].items()):
        out["refused"] += sum(len(_refused(_flatten(t["out"]))) for t in trials_)
        if not trials_:
            del out["rounds"][name]
            continue
        out["rounds"][name] = {
            "s": round(statistics.median(t["s"] for t in trials_), 3),
            "trials_s": [round(t["s"], 3) for t in trials_],
            "control_cpu_s": round(statistics.median(t["control_cpu_s"] for t in trials_), 3),
            "host_cpu_s": round(statistics.median(t["host_cpu_s"] for t in trials_), 3),
        }
    out["control_peak_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    return out


def merge(path: Path, sizes: dict[int, dict[str, Any]], setup: dict[str, Any]) -> dict[str, Any]:
    """Write the fan-out's metrics into the scale benchmark's file: its other metrics stay, and so do the sizes
    an earlier run measured that this one did not (``--sizes 600`` adds a size to a run of 16, 64, 256)."""
    doc: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        doc = json.loads(path.read_text())
    old = doc.get("setup", {}).get("fanout", {}).get("sizes", {})
    every = {int(k): v for k, v in old.items() if "rounds" in v}
    for size, res in sizes.items():  # a size measured again with patient limits keeps why the recovery's failed
        before = every.get(size, {})
        if res.get("limits") != "the recovery's" and before.get("limits", "the recovery's") == "the recovery's" \
                and before.get("failed"):
            res["with_the_recoverys_limits"] = before["failed"]
    every.update(sizes)
    metrics = {k: v for k, v in doc.get("metrics", {}).items() if not k.startswith(("fanout_", "largest_fanout"))}
    for size, res in sorted(every.items()):
        for name, r in res["rounds"].items():
            metrics[f"fanout_{name}_s.{size}"] = {"median": r["s"], "n": len(r["trials_s"]), "script": "fanout",
                                                  "trials": r["trials_s"],
                                                  "control_cpu_s": r["control_cpu_s"], "host_cpu_s": r["host_cpu_s"],
                                                  "unit": "s", "limits": res.get("limits", "the recovery's"),
                                                  "failed_trials": len(res["failed"])}
    if 16 in every and 256 in every:
        for name in ROUNDS:
            a, b = every[16]["rounds"].get(name), every[256]["rounds"].get(name)
            if a and b and a["control_cpu_s"] is not None and b["control_cpu_s"] is not None:
                metrics[f"fanout_{name}_ratio_256_vs_16"] = {
                    "value": round(b["s"] / a["s"], 2), "n": 1, "unit": "ratio", "script": "fanout",
                    "control_cpu": round(b["control_cpu_s"] / max(a["control_cpu_s"], 1e-6), 2),
                    **({"target": 2.0} if name == "stop" else {})}
    ok = [s for s, r in every.items()
          if not r["failed"] and not r["refused"] and r.get("limits", "the recovery's") == "the recovery's"]
    metrics["largest_fanout_machines"] = {"value": max(ok, default=0), "n": 1, "unit": "machines", "script": "fanout",
                                          "largest_run": max(every, default=0)}
    doc["metrics"] = dict(sorted(metrics.items()))
    doc.setdefault("setup", {})["fanout"] = {**doc.get("setup", {}).get("fanout", {}), **setup,
                                             "sizes": {str(s): r for s, r in sorted(every.items())}}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="16,64,256")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--l1-sizes", default="16,64", help="sizes that also run an L1 diagnosis round")
    p.add_argument("--max", action="store_true", help="also the largest cluster the free memory holds")
    p.add_argument("--reserve-mb", type=float, default=3072.0, help="memory --max leaves free")
    p.add_argument("--patient", type=float, default=1.0,
                   help="the rounds' session limits times this (1: the recovery's own; a host whose cores the "
                        "machines share needs more to measure hundreds of them)")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "scale.json")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench/fanout.py needs root (network namespaces)", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",") if s]
    l1_sizes = {int(s) for s in args.l1_sizes.split(",") if s}
    results: dict[int, dict[str, Any]] = {}
    for size in sizes:
        print(f"{size} machines ...", file=sys.stderr, flush=True)
        results[size] = measure(size, args.trials, l1=size in l1_sizes, log=lambda m: print(m, file=sys.stderr),
                                patient=args.patient)
    if args.max and results:
        per = max(r["mem_per_machine_mb"] for r in results.values())
        biggest = min(1000, int((_mem_available_mb() - args.reserve_mb) / max(per, 1.0)))
        if biggest > max(results):
            print(f"{biggest} machines (the most {per:.0f} MB each fit) ...", file=sys.stderr, flush=True)
            results[biggest] = measure(biggest, 1, l1=False, log=lambda m: print(m, file=sys.stderr))
    setup = {"fanout_sessions": FANOUT, "diag_wave": DIAG_WAVE, "trials": args.trials, "cpus": os.cpu_count(),
             "transport": "paramiko (trainguard.node_tools.transport.SshTransport), host keys pinned, one "
                          "connection per machine held across the rounds",
             "job": "examples/standin.py (direct launcher)"}
    doc = merge(args.out, results, setup)
    for key, value in doc["metrics"].items():
        if key.startswith(("fanout_", "largest_fanout")):
            print(key, json.dumps(value))
    return 0


if __name__ == "__main__":
    sys.exit(main())
