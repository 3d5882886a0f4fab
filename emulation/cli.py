"""The emulation's commands of ``trainguard`` (registered through the ``trainguard.commands`` entry point,
so the product's command line never imports the harness)::

    trainguard cluster up [--machines 6 --standbys 2 --free 0 --name tg --subnet ... --disk-mb 256 --gpus 8
                           --transport auto|ssh|local]
    trainguard cluster down
    trainguard cluster status
    trainguard inject --machine m2 --fault hang [--rank R] [--job J] [--param k=v ...]
    trainguard inject --machine m2 --clear [--fault K]
    trainguard inject --list
    trainguard cluster job launch --job J [--topology tp=2,pp=2,dp=2] [--steps N] [--machines m0,m1,..] [-- ARGS]
    trainguard cluster job stop --job J
    trainguard cluster job status --job J
    trainguard demo [--faults gpu_lost,hang,nan,user_error,slow --every 90 --machines 6 --port 8080 --keep]
    trainguard controlplane up [--profile embedded|scaleout --workers 2 --schedulers 2 --machines 6 --port 8080]
    trainguard controlplane down | status
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.core.errors import EXIT_OK, TrainguardError
from trainguard.node_tools.cliutil import OneLineParser, key_values
from trainguard.operators.cli import print_result as _print
from trainguard.operators.jobspec import REFERENCE_ENTRY


def register(sub: Any) -> dict[str, Callable[[argparse.Namespace], int]]:
    """Add the emulation's commands to ``trainguard``'s subparsers; returns each command's handler."""
    from trainguard.emulation.cluster import ClusterSpec

    d = ClusterSpec()
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

    # the reference job started on the cluster's machines directly, without the control plane (a job under
    # guard is submitted with 'trainguard job submit')
    jp = csub.add_parser("job", help="the reference job on the cluster's machines, without the control plane")
    jsub = jp.add_subparsers(dest="job_action", required=True, parser_class=OneLineParser)
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
    pp = sub.add_parser("controlplane", help="the control plane over the emulated cluster, run as a service: the "
                                             "embedded default (airflow standalone, SQLite) or the scale-out profile")
    psub = pp.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    pu = psub.add_parser("up", help="bring the cluster and the control plane up (or repair them)")
    pu.add_argument("--profile", default="embedded", choices=["embedded", "scaleout"],
                    help="embedded: airflow standalone and a SQLite fleet database; scaleout: PostgreSQL, Celery "
                         "with Redis, workers in namespaces of their own, two schedulers, the bus on S3")
    pu.add_argument("--workers", type=int, default=2, help="scaleout: Celery workers (each a namespace)")
    pu.add_argument("--schedulers", type=int, default=2, help="scaleout: schedulers")
    pu.add_argument("--concurrency", type=int, default=4, help="scaleout: task slots of each worker")
    pu.add_argument("--machines", type=int, default=d.machines,
                    help=f"emulated machines, standbys included (default {d.machines})")
    pu.add_argument("--standbys", type=int, default=d.standbys,
                    help=f"of them, parked warm as standbys (default {d.standbys})")
    pu.add_argument("--name", default=d.name, help=f"cluster name, the prefix of its namespaces (default {d.name})")
    pu.add_argument("--subnet", default=d.subnet, help=f"the machines' private /24 (default {d.subnet})")
    pu.add_argument("--port", type=int, default=8080, help="the api-server's port (default 8080; 0: any free one)")
    psub.add_parser("down", help="stop the control plane and its servers, then bring the cluster down")
    psub.add_parser("status", help="the control plane's processes and where its UI is")
    return {"cluster": cmd_cluster, "inject": cmd_inject, "demo": cmd_demo,
            "controlplane": cmd_controlplane}


def _machines(inv: Any, names: str, default_role: str = "active") -> list[Any]:
    if names:
        return [inv.machine(n.strip()) for n in names.split(",") if n.strip()]
    return inv.by_role(default_role)


def _inventory(args: argparse.Namespace) -> Any:
    from trainguard.emulation.cluster import default_state_dir
    from trainguard.node_tools.inventory import Inventory

    return Inventory.load(Path(args.state_dir or default_state_dir()) / "inventory.json")


def cmd_cluster(args: argparse.Namespace) -> int:
    from trainguard.emulation import cluster

    if args.action == "job":
        return cmd_job(args)
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
        from trainguard.emulation.standalone import Standalone

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
    from trainguard.emulation import faults, inject

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
    from trainguard.core.topology import Topology
    from trainguard.node_tools import launcher

    inv = _inventory(args)
    if args.job_action == "launch":
        machines = _machines(inv, args.machines)
        rpm = args.ranks_per_machine
        topo = Topology.parse(args.topology, ranks_per_machine=rpm)
        extra = args.args[1:] if args.args[:1] == ["--"] else list(args.args)
        if args.steps:
            extra = ["--steps", str(args.steps), *extra]
        plan = launcher.JobPlan(job=args.job, topology=topo, machines=machines[: topo.machines] if not args.machines
                                else machines, train_args=extra, master_port=args.master_port,
                                entry=REFERENCE_ENTRY, pass_layout=True)
        docs = launcher.launch(inv, plan)
        _print(args, docs, f"job {args.job} started on {', '.join(docs)} ({topo})")
        return EXIT_OK
    machines = _machines(inv, args.machines) if args.machines else inv.machines
    if args.job_action == "stop":
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


def cmd_controlplane(args: argparse.Namespace) -> int:
    from trainguard.emulation import controlplane

    state = Path(args.state_dir or _default_state()).resolve()
    if args.action == "up":
        doc = controlplane.up(args, state, log=lambda msg: print(msg, file=sys.stderr))
        _print(args, doc, "\n".join([
            f"control plane up ({doc['profile']}): Airflow UI {doc['url']} (admin; password in {doc['passwords']})",
            f"  fleet database {doc['fleet_url']}", f"  alert bus {doc['bus_url']}",
            f"  processes: {', '.join(n for n, alive in doc['processes'].items() if alive)}",
            f"  for trainguard's commands here: {' '.join(f'{k}={v}' for k, v in doc['env'].items())}",
            "  'trainguard controlplane down' ends it all"]))
        return EXIT_OK
    if args.action == "down":
        doc = controlplane.down(state)
        _print(args, doc, f"control plane down: {', '.join(doc['stopped']) or 'nothing was running'}; "
                          f"cluster: {len(doc['cluster'].get('namespaces', []))} namespaces removed")
        return EXIT_OK
    doc = controlplane.status(state)
    _print(args, doc, "\n".join([f"control plane ({doc['profile'] or 'none'}): {doc['url'] or 'no api-server'}",
                                 *(f"  {n}: {'running' if up else 'GONE'}" for n, up in doc["processes"].items())]))
    return EXIT_OK if doc["processes"] and all(doc["processes"].values()) else 1


def _default_state() -> Path:
    from trainguard.emulation.cluster import default_state_dir

    return default_state_dir()


def cmd_demo(args: argparse.Namespace) -> int:
    from trainguard.emulation.demo import run_demo

    return run_demo(args)

