"""``trainguard``: the host-side command line.

Commands::

    trainguard cluster up [--machines 6 --standbys 2 --free 0 --name tg --subnet ... --disk-mb 256 --gpus 8
                           --transport auto|ssh|local]
    trainguard cluster down
    trainguard cluster status
    trainguard inject --machine m2 --fault hang [--rank R] [--job J] [--param k=v ...]
    trainguard inject --machine m2 --clear [--fault K]
    trainguard job launch --job J [--topology tp=2,pp=2,dp=2] [--steps N] [--machines m0,m1,..] [-- ARGS]
    trainguard job stop --job J
    trainguard job status --job J
    trainguard demo [--faults gpu_lost,hang,nan,user_error,slow --every 90 --machines 6 --port 8080 --keep]
    trainguard revision add --job J --revision R [--reason TEXT] | list --job J
    trainguard metrics [--port 9464 --addr 127.0.0.1]   (Prometheus; without --port: print one scrape)
    trainguard ettr --job J [--window-s 3600]   (the control plane's fleet database: $TG_FLEET_URL, $TG_INVENTORY)
    trainguard status [--airflow-url URL]       trainguard's own health and its jobs, one screen (exit 1: look)

Exit codes: 0 success, 1 the job or check failed, 2 bad input or missing
prerequisite (a one-line message says what to do), 3 refused, 130 interrupted.
``--state-dir`` (or ``$TG_HOME``) chooses where the emulated cluster keeps its
state (default ``./.tg/cluster``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from node_tools.cliutil import OneLineParser, key_values
from node_tools.errors import EXIT_INTERRUPTED, EXIT_OK, TrainguardError


def build_parser() -> argparse.ArgumentParser:
    from node_tools.cluster import ClusterSpec

    d = ClusterSpec()
    p = OneLineParser(prog="trainguard", description="keep large PyTorch training jobs productive")
    p.add_argument("--state-dir", type=Path, help="emulated cluster state (default $TG_HOME/cluster or ./.tg/cluster)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    cp = sub.add_parser("cluster", help="the emulated cluster of machines")
    csub = cp.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    cu = csub.add_parser("up", help="bring the cluster up (or repair it)")
    cu.add_argument("--name", default=d.name)
    cu.add_argument("--machines", type=int, default=d.machines)
    cu.add_argument("--standbys", type=int, default=d.standbys)
    cu.add_argument("--free", type=int, default=d.free, help="unprovisioned machines for the standby pool job")
    cu.add_argument("--subnet", default=d.subnet)
    cu.add_argument("--disk-mb", type=int, default=d.disk_mb)
    cu.add_argument("--gpus", type=int, default=d.gpus)
    cu.add_argument("--transport", default=d.transport, choices=["auto", "ssh", "local"])
    cu.add_argument("--job-nice", type=int, default=d.job_nice,
                    help="niceness of jobs' processes on the machines (they share this host's cores)")
    csub.add_parser("down", help="remove every namespace, link, process and file of the cluster")
    csub.add_parser("status", help="machines, roles and reachability")

    ip = sub.add_parser("inject", help="inject a real fault into a machine or rank")
    ip.add_argument("--list", action="store_true", help="list the fault kinds, their targets and parameters")
    ip.add_argument("--machine")
    ip.add_argument("--fault", help="fault kind (see 'trainguard inject --list')")
    ip.add_argument("--rank", type=int)
    ip.add_argument("--job")
    ip.add_argument("--param", action="append", default=[], help="key=value (repeatable)")
    ip.add_argument("--clear", action="store_true", help="undo the machine's faults (of --fault only, if given)")

    jp = sub.add_parser("job", help="the training job on the cluster")
    jsub = jp.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    jl = jsub.add_parser("launch")
    jl.add_argument("--job", default="demo")
    jl.add_argument("--topology", default="tp=2,pp=2,dp=2")
    jl.add_argument("--ranks-per-machine", type=int, default=0, help="default: the TP degree")
    jl.add_argument("--steps", type=int, default=0, help="0: run until stopped")
    jl.add_argument("--machines", default="", help="comma-separated, in node-rank order (default: active machines)")
    jl.add_argument("--master-port", type=int, default=29500)
    jl.add_argument("args", nargs=argparse.REMAINDER, help="after --: more training script arguments")
    for action in ("stop", "status"):
        js = jsub.add_parser(action)
        js.add_argument("--job", default="demo")
        js.add_argument("--machines", default="")

    dp = sub.add_parser("demo", help="the main job: a guarded training run through a scripted series of faults")
    dp.add_argument("--faults", default="gpu_lost,hang,nan,user_error,slow",
                    help="the fault schedule, in order (default gpu_lost,hang,nan,user_error,slow; also nic_down, "
                         "disk_full, crash, sdc, bitflip)")
    dp.add_argument("--every", type=float, default=90.0, help="seconds between faults (default 90)")
    dp.add_argument("--first", type=float, default=20.0, help="seconds of training before the first fault")
    dp.add_argument("--machines", type=int, default=6, help="cluster size (default 6: the job's 4 and 2 standbys)")
    dp.add_argument("--standbys", type=int, default=2)
    dp.add_argument("--name", default=d.name, help="cluster name (prefixes its namespaces and links)")
    dp.add_argument("--subnet", default=d.subnet)
    dp.add_argument("--port", type=int, default=8080, help="Airflow's port (default 8080; 0: any free one)")
    dp.add_argument("--report-dir", help="where the report and the timeline chart go (default .tg/report)")
    dp.add_argument("--keep", action="store_true",
                    help="leave Airflow, the cluster and the job up at the end ('trainguard cluster down' ends them)")

    rp = sub.add_parser("revision", help="a job's code revisions: record one (before tg_code_update may use it), list")
    rsub = rp.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    ra = rsub.add_parser("add", help="record a revision of the job's code")
    ra.add_argument("--job", required=True)
    ra.add_argument("--revision", required=True)
    ra.add_argument("--reason", default="")
    rl = rsub.add_parser("list", help="the job's revisions, which one runs, which wait, which are known good")
    rl.add_argument("--job", required=True)

    mp = sub.add_parser("metrics", help="the control plane's Prometheus metrics, from the fleet database")
    mp.add_argument("--port", type=int, default=0, help="serve on this port until interrupted; 0: print once")
    mp.add_argument("--addr", default="127.0.0.1", help="address to serve on (default 127.0.0.1)")

    sp = sub.add_parser("status", help="trainguard's own health (guardian, airflow, agents) and its jobs and "
                                       "incidents, in one screen; exit 1 when something needs a human")
    sp.add_argument("--airflow-url", default="",
                    help="the api-server (default $TG_AIRFLOW_URL, else the demo's kept Airflow if it runs)")
    ep = sub.add_parser("ettr", help="a job's effective training time ratio and its losses by failure cause")
    ep.add_argument("--job", required=True)
    ep.add_argument("--window-s", type=float, default=3600.0, help="the sliding window (default 3600)")
    return p




def _machines(inv: Any, names: str, default_role: str = "active") -> list[Any]:
    if names:
        return [inv.machine(n.strip()) for n in names.split(",") if n.strip()]
    return inv.by_role(default_role)


def _print(args: argparse.Namespace, document: Any, text: str | None = None) -> None:
    if args.json or text is None:
        print(json.dumps(document, indent=2, default=str))
    else:
        print(text)


def _inventory(args: argparse.Namespace) -> Any:
    from node_tools.cluster import default_state_dir
    from node_tools.inventory import Inventory

    return Inventory.load(Path(args.state_dir or default_state_dir()) / "inventory.json")


def cmd_cluster(args: argparse.Namespace) -> int:
    from node_tools import cluster

    if args.action == "up":
        spec = cluster.ClusterSpec(
            name=args.name, machines=args.machines, standbys=args.standbys, subnet=args.subnet,
            disk_mb=args.disk_mb, gpus=args.gpus, transport=args.transport, free=args.free,
            job_nice=args.job_nice,
        )
        inv = cluster.up(spec, args.state_dir, log=lambda msg: print(msg, file=sys.stderr))
        lines = [f"cluster {inv.cluster} is up ({inv.transport}); inventory {inv.path}"]
        lines += [f"  {m.name:4} {m.role:8} {m.address}" for m in inv.machines]
        _print(args, inv.to_dict(), "\n".join(lines))
    elif args.action == "down":
        from operators.airflow.standalone import Standalone

        state = Path(args.state_dir or cluster.default_state_dir())
        airflow = Standalone.stop_kept(state.parent / "control" / "airflow")  # a demo's, kept with --keep
        report = cluster.down(args.state_dir)
        _print(args, {**report, "airflow_stopped": airflow}, (
            f"cluster down: {len(report['killed'])} processes ended, {len(report['namespaces'])} namespaces, "
            f"{len(report['links'])} links, {len(report['unmounted'])} mounts removed"
            + ("; the demo's Airflow stopped" if airflow else "")
        ))
    else:
        doc = cluster.status(args.state_dir)
        lines = [f"cluster {doc['cluster']} ({doc['transport']})"]
        lines += [
            f"  {m['name']:4} {m['role']:8} {m['address']:15} sshd={m['sshd_pid']} agent={m['agent_state']}"
            f"(pid {m['agent_pid']}, status {m['agent_status_age_s']}s old) reachable={m['reachable']} ({m['ssh_s']}s)"
            for m in doc["machines"]
        ]
        _print(args, doc, "\n".join(lines))
        return EXIT_OK if all(m["reachable"] and m["agent_state"] == "running" for m in doc["machines"]) else 1
    return EXIT_OK


def cmd_inject(args: argparse.Namespace) -> int:
    from node_tools import faults, inject

    if args.list:
        kinds = [{"kind": f.name, "target": f.target, "summary": f.summary, "params": dict(f.params)}
                 for f in faults.FAULT_KINDS.values()]
        _print(args, kinds, "\n".join(
            f"{k['kind']:16} {k['target']:8} {k['summary']}"
            + (f" (params: {', '.join(f'{n}={v}' for n, v in k['params'].items())})" if k["params"] else "")
            for k in kinds))
        return EXIT_OK
    if not args.machine:
        raise TrainguardError("inject needs --machine NAME (or --list for the fault kinds)")
    inv = _inventory(args)
    if args.clear:
        doc = inject.clear(inv, args.machine, args.fault)
        _print(args, doc, f"cleared faults on {args.machine}: "
               f"{', '.join(e['kind'] for e in doc.get('cleared', [])) or 'none recorded'}")
        return EXIT_OK
    if not args.fault:
        raise TrainguardError("inject needs --fault KIND (or --clear)")
    doc = inject.inject(inv, args.machine, args.fault, rank=args.rank, job_name=args.job, params=key_values(args.param))
    _print(args, doc, f"injected {doc['kind']} on {doc['machine']}: {doc.get('effect', '')}")
    return EXIT_OK


def cmd_job(args: argparse.Namespace) -> int:
    from node_tools import launcher
    from node_tools.topology import Topology

    inv = _inventory(args)
    if args.action == "launch":
        machines = _machines(inv, args.machines)
        rpm = args.ranks_per_machine
        topo = Topology.parse(args.topology, ranks_per_machine=rpm)
        extra = args.args[1:] if args.args[:1] == ["--"] else list(args.args)
        if args.steps:
            extra = ["--steps", str(args.steps), *extra]
        plan = launcher.JobPlan(job=args.job, topology=topo, machines=machines[: topo.machines] if not args.machines
                                else machines, train_args=extra, master_port=args.master_port)
        docs = launcher.launch(inv, plan)
        _print(args, docs, f"job {args.job} started on {', '.join(docs)} ({topo})")
        return EXIT_OK
    machines = _machines(inv, args.machines) if args.machines else inv.machines
    if args.action == "stop":
        docs = launcher.stop(inv, args.job, machines)
        _print(args, docs, f"job {args.job} stopped")
        return EXIT_OK
    docs = launcher.status(inv, args.job, machines)
    lines = []
    for name, doc in docs.items():
        if "error" in doc:
            lines.append(f"{name}: {doc['error']}")
            continue
        ranks = ", ".join(f"r{r['rank']}@{r['step']}({r['process_state']})" for r in doc["ranks"])
        lines.append(f"{name}: {doc['state']} {ranks}")
    _print(args, docs, "\n".join(lines))
    return EXIT_OK


def cmd_ettr(args: argparse.Namespace) -> int:
    from operators.control import ControlConfig, Controller

    if args.window_s <= 0:
        raise TrainguardError(f"--window-s {args.window_s} must be above 0", exit_code=2)
    report = Controller(ControlConfig.from_env()).ettr_report(args.job, window_s=args.window_s)
    c, w = report["cumulative"], report["sliding"]
    lines = [f"job {args.job}: ETTR {c['ettr']:.2%} since its first step ({c['kept_steps']} steps kept, "
             f"{c['lost_steps']} recomputed, {c['lost_work_s']:.1f}s of lost work); "
             f"{w['ettr']:.2%} over the last {w['window_s']:.0f}s"]
    lines += [f"  {cause:14} {v['incidents']} incidents, {v['seconds']:.1f}s"
              for cause, v in report["by_cause"].items()]
    _print(args, report, "\n".join(lines))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    import os

    from operators import status
    from operators.airflow.alerts import silent_from_env
    from operators.control import ControlConfig
    from operators.fleet import FleetStore

    fleet = FleetStore(ControlConfig.from_env().fleet_url)
    url = args.airflow_url or os.environ.get("TG_AIRFLOW_URL", "")
    if not url:
        from node_tools.cluster import default_state_dir
        from operators.airflow.standalone import Standalone

        url = Standalone.kept_url(Path(args.state_dir or default_state_dir()).parent / "control" / "airflow") or ""
    try:
        silent = silent_from_env()
    except ValueError as exc:
        raise TrainguardError(str(exc), exit_code=2) from None
    doc = status.collect(fleet, silent_s=silent or 15.0, airflow_url=url)
    _print(args, doc, status.render(doc))
    return EXIT_OK if doc["healthy"] else 1


def cmd_metrics(args: argparse.Namespace) -> int:
    import time

    from operators import metrics
    from operators.control import ControlConfig
    from operators.fleet import FleetStore

    fleet = FleetStore(ControlConfig.from_env().fleet_url)
    if not args.port:
        sys.stdout.write(metrics.exposition(fleet))
        return EXIT_OK
    if not 0 < args.port < 65536:
        raise TrainguardError(f"--port {args.port} must be 1..65535", exit_code=2)
    try:
        server = metrics.serve(fleet, args.port, args.addr)
    except OSError as exc:
        raise TrainguardError(f"cannot serve on {args.addr}:{args.port}: {exc.strerror}; pick another --port",
                              exit_code=2) from None
    print(f"serving Prometheus metrics on http://{args.addr}:{args.port}/metrics (Ctrl-C stops)", file=sys.stderr)
    try:
        while True:
            time.sleep(3600)
    finally:
        server.shutdown()


def cmd_revision(args: argparse.Namespace) -> int:
    import re

    from operators.control import ControlConfig
    from operators.fleet import FleetStore

    fleet = FleetStore(ControlConfig.from_env().fleet_url)
    job = fleet.job(args.job)  # an unknown job: a one-line error naming the jobs there are
    if args.action == "add":
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}", args.revision):
            raise TrainguardError(f"--revision {args.revision!r} must be 1-128 letters, digits or ._+- (a tag or "
                                  f"commit id)", exit_code=2)
        added = fleet.record_revision(args.job, args.revision, reason=args.reason)
        _print(args, {"job": args.job, "revision": args.revision, "added": added},
               f"revision {args.revision} of job {args.job} " + ("recorded" if added else "was already recorded"))
        return EXIT_OK
    revs = fleet.revisions(args.job)
    doc = {"job": args.job, "running": job.revision, "pending": job.pending_revision,
           "revisions": [{"revision": r.revision, "known_good": r.known_good, "recorded_ts": r.recorded_ts,
                          "reason": r.reason} for r in revs]}
    lines = [f"{'*' if r.revision == job.revision else ('>' if r.revision == job.pending_revision else ' ')} "
             f"{r.revision:24} {'known good' if r.known_good else '':10} {r.reason}" for r in revs]
    _print(args, doc, "\n".join([f"job {args.job} (* runs, > waits for the next restart)", *lines]))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    try:
        args = build_parser().parse_args(args_list)
        if args.command == "cluster":
            return cmd_cluster(args)
        if args.command == "inject":
            return cmd_inject(args)
        if args.command == "job":
            return cmd_job(args)
        if args.command == "demo":
            from operators.demo import run_demo

            return run_demo(args)
        if args.command == "ettr":
            return cmd_ettr(args)
        if args.command == "revision":
            return cmd_revision(args)
        if args.command == "metrics":
            return cmd_metrics(args)
        if args.command == "status":
            return cmd_status(args)
    except TrainguardError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("trainguard: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
