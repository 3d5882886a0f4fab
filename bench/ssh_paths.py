"""The SSH path against the one it replaced, side by side on one namespace cluster: trainguard's transport
(:class:`trainguard.node_tools.transport.SshTransport`: paramiko in this process, host keys pinned, one held
connection per machine) and the OpenSSH client transport it replaced (one ``ssh`` process a session over a
``ControlMaster`` connection per machine), taken from the repository's history (``--before``, a commit whose
``node_tools/transport.py`` still has it).

    python bench/ssh_paths.py [--machines 16,64] [--trials 3] [--before COMMIT] [--out FILE]

On thin machines (sshd, the agent and ``examples/standin.py``, as ``bench/fanout.py``'s), each trial runs the
recovery's rounds (:mod:`trainguard.node_tools.launcher`'s launch, status and two-phase stop, and a
``tg-node version`` on every machine) once over each transport, the two alternating; both have their
connections open before the first trial. For each round and size: the wall time and the control plane's CPU
(this process, its children and the OpenSSH masters), medians of the trials, and the ratio paramiko / OpenSSH of
each trial, measured in the same run. Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import emulated_cluster, stop_on_sigterm, summarize, write_result  # noqa: E402
from bench.fanout import JOB, SUBNET, _plan  # noqa: E402
from trainguard.core import procs  # noqa: E402
from trainguard.emulation import cluster  # noqa: E402
from trainguard.node_tools import launcher  # noqa: E402
from trainguard.node_tools.transport import transport_for  # noqa: E402

#: the last commit with the OpenSSH client transport (node_tools/transport.py's SshTransport over ``ssh``)
BEFORE = "e54655e"
ROUNDS = ("restart", "status", "version", "stop")


def openssh_module(commit: str) -> ModuleType:
    """``node_tools/transport.py`` as it was at ``commit``, loaded under a name of its own."""
    text = subprocess.run(["git", "show", f"{commit}:node_tools/transport.py"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout
    path = Path(tempfile.mkdtemp(prefix="tg-ssh-before-")) / "openssh_transport.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("openssh_transport", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _cpu_s(before: ModuleType) -> float:
    """This process's CPU, its children's (ssh clients) and the live OpenSSH masters'."""
    s, c = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    folder = before.control_dir()
    masters = [p for p in procs.all_pids() if folder and " ".join(procs.cmdline(p)).startswith(f"ssh: {folder}/")]
    return s.ru_utime + s.ru_stime + c.ru_utime + c.ru_stime + sum(procs.cpu_seconds(p) or 0.0 for p in masters)


def measure(size: int, trials: int, before: ModuleType, log: Callable[[str], None]) -> dict[str, Any]:
    spec = cluster.ClusterSpec(name="tgp", machines=size, standbys=0, subnet=SUBNET, disk_mb=16, gpus=1, job_nice=0)
    runs: dict[str, list[dict[str, tuple[float, float]]]] = {"paramiko": [], "openssh": []}
    with emulated_cluster(spec, "tg-ssh-paths-") as (inv, _home):
        plan = _plan(inv)
        transports = {"paramiko": transport_for(inv), "openssh": before.SshTransport(inv)}
        try:
            for t in transports.values():  # every connection open before the first trial
                t.run_many(inv.machines, lambda m: [inv.tg_node, "version"], timeout=60)
            for trial in range(trials):
                order = list(transports) if trial % 2 == 0 else list(reversed(transports))
                for name in order:
                    t = transports[name]
                    rounds: dict[str, Callable[[], Any]] = {
                        "restart": lambda t=t: launcher.launch(inv, plan, transport=t, timeout=60),
                        "status": lambda t=t: launcher.status(inv, JOB, inv.machines, transport=t, timeout=20),
                        "version": lambda t=t: t.run_many(inv.machines, lambda m: [inv.tg_node, "version"],
                                                          timeout=30),
                        "stop": lambda t=t: launcher.stop(inv, JOB, inv.machines, transport=t),
                    }
                    got = {}
                    for rnd in ROUNDS:
                        cpu0, t0 = _cpu_s(before), time.monotonic()
                        rounds[rnd]()
                        got[rnd] = (time.monotonic() - t0, _cpu_s(before) - cpu0)
                    runs[name].append(got)
                    log(f"  {size} machines, trial {trial + 1}, {name}: "
                        + ", ".join(f"{r} {s:.2f} s ({c * 1000 / size:.1f} ms CPU a machine)"
                                    for r, (s, c) in got.items()))
        finally:
            for t in transports.values():
                getattr(t, "close", lambda: None)()  # (the OpenSSH one's masters end on their own)
    return runs


def metrics_of(results: dict[int, dict[str, list[dict[str, tuple[float, float]]]]]) -> dict[str, Any]:
    metrics: dict[str, Any] = {}
    for size, runs in sorted(results.items()):
        for rnd in ROUNDS:
            for name, trials in runs.items():
                metrics[f"{rnd}_s.{name}.{size}"] = summarize([t[rnd][0] for t in trials], "s")
                metrics[f"{rnd}_cpu_ms_per_machine.{name}.{size}"] = summarize(
                    [t[rnd][1] * 1000 / size for t in trials], "ms")
            pairs = list(zip(runs["paramiko"], runs["openssh"], strict=True))
            metrics[f"{rnd}_ratio.{size}"] = summarize([p[rnd][0] / o[rnd][0] for p, o in pairs], "ratio")
            metrics[f"{rnd}_cpu_ratio.{size}"] = summarize([p[rnd][1] / max(o[rnd][1], 1e-6) for p, o in pairs],
                                                           "ratio")
    return metrics


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--machines", default="16,64")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--before", default=BEFORE, help="a commit whose node_tools/transport.py has the OpenSSH client")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "ssh_paths.json")
    args = p.parse_args()
    if os.geteuid() != 0:
        print("bench/ssh_paths.py needs root (network namespaces)", file=sys.stderr)
        return 2
    stop_on_sigterm()
    before = openssh_module(args.before)
    sizes = [int(s) for s in args.machines.split(",") if s]
    results = {}
    for size in sizes:
        print(f"{size} machines ...", file=sys.stderr, flush=True)
        results[size] = measure(size, args.trials, before, lambda m: print(m, file=sys.stderr, flush=True))
    metrics = metrics_of(results)
    setup = {"machines": sizes, "trials": args.trials, "before": args.before,
             "paramiko": "trainguard.node_tools.transport.SshTransport, one held connection per machine",
             "openssh": f"{args.before}:node_tools/transport.py SshTransport, ssh clients over ControlMaster",
             "rounds": list(ROUNDS), "job": "examples/standin.py (direct launcher)"}
    print(write_result("ssh_paths", quick=False, setup=setup, metrics=metrics, out=args.out))
    for key in sorted(k for k in metrics if "_ratio." in k):
        print(f"{key}: {metrics[key]['median']} (paramiko / OpenSSH, median of {metrics[key]['n']})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
