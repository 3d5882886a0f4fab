"""``tg-node``: the node-side command line. Every command prints one JSON document.

Exit codes: 0 success/healthy, 1 unhealthy (with reasons), 2 could not run
(bad input, missing prerequisite), 3 refused, 130 interrupted (Ctrl-C). On exit 2 or
130 the document is ``{"error": "...one line..."}``.

Commands::

    tg-node version
    tg-node info                                  this machine's configuration
    tg-node up [--config P --sshd BIN --listen A --authorized-keys F --netns NS --foreground]
                                                  bring sshd and the agent up (the node image's entrypoint)
    tg-node gpu                                   NVML snapshot (real or emulated backend)
    tg-node agent [--supervise|--once]            the real-time checks, publishing alerts
    tg-node agent --processes | --restart         the agent's processes (running, stopped, gone); restart it
    tg-node status                                the agent's status
    tg-node check [gpu|host|net|disk|all]         the real-time checks once (exit 1 on a fault)
    tg-node diag --level 1|2|3 [L3: --rank --world-size --master-addr --master-port [--align]]
                                                  (level 2 with the L3 options: both, one process)
    tg-node align [--seed S --steps N]            bit-wise alignment digest
    tg-node stacks --job J [--native]             py-spy stacks of the job's processes
    tg-node logs --job J [--since T]              exit codes and classified log tails
    tg-node job start --job J --nnodes N --node-rank I --nproc-per-node P
                      --master-addr A --master-port PORT [--entry SCRIPT] [--revision R] -- ARGS...
    tg-node job stop --job J [--grace-s S]
    tg-node job status --job J
    tg-node job steps --job J --rank R [--since STEP] [--since-ts T]
    tg-node standby park --nproc N | activate <job start arguments> | status | unpark
    tg-node ckpt list --job J | verify --job J --step N [--mark] | upload --job J --step N --s3 URL
                | rescue --job J --step N --to URL      (a step's copies here into the remote tier)

Other packages add commands through the entry point group ``tg_node.commands``: a function that adds its
subparsers, each with ``node_handler`` (``(namespace, node config) -> (exit code, document)``) as a default.
The emulation adds ``tg-node fault inject|clear|list`` that way; a node installed without it has no ``fault``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from typing import Any

from trainguard.core.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, TrainguardError
from trainguard.node_tools import __version__
from trainguard.node_tools.cliutil import OneLineParser
from trainguard.node_tools.plugins import load_group

COMMANDS_GROUP = "tg_node.commands"


def _job_start_args(js: argparse.ArgumentParser) -> None:
    js.add_argument("--job", required=True)
    js.add_argument("--nnodes", type=int, required=True)
    js.add_argument("--node-rank", type=int, required=True)
    js.add_argument("--nproc-per-node", type=int, required=True)
    js.add_argument("--master-addr", required=True)
    js.add_argument("--master-port", type=int, required=True)
    js.add_argument("--entry", required=True,
                    help="the training script (relative to --workdir), or with --module the module to run")
    js.add_argument("--module", action="store_true", help="--entry names a module (python -m), not a script")
    js.add_argument("--workdir", default="", help="where the job runs (default: the install directory)")
    js.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                    help="an environment variable for every rank (repeat it)")
    js.add_argument("--restore-max-step", type=int, default=None, metavar="N",
                    help="the job restores no checkpoint step newer than N (TG_RESTORE_MAX_STEP)")
    js.add_argument("--hang-floor-s", type=float, default=None, metavar="S",
                    help="the least time without progress this machine's agent calls a hang of the job's ranks "
                         "(default: the agent's own)")
    js.add_argument("--revision", default="")
    js.add_argument("--checkpoint", default="", help="checkpoint location for the job (TG_CHECKPOINT)")
    js.add_argument("--launcher", default="torchrun", help="torchrun, or direct: one process, no torchrun "
                                                          "(--nproc-per-node 1)")
    js.add_argument("--replica", type=int, default=None, metavar="N",
                    help="this part belongs to data-parallel replica group N (nnodes and node-rank are the group's)")
    js.add_argument("--replicas", type=int, default=0, metavar="W", help="the job's replica groups (with --replica)")
    js.add_argument("--lighthouse", default="", help="the replica groups' lighthouse, http://host:port")
    js.add_argument("--replica-host", default="", help="the address other groups reach this one at "
                                                       "(default: --master-addr)")
    js.add_argument("--min-replicas", type=int, default=1, help="the fewest groups that may train a step")
    js.add_argument("args", nargs=argparse.REMAINDER)


def _job_spec(ns: argparse.Namespace, *, warm: bool) -> Any:
    from trainguard.node_tools import job

    args = ns.args[1:] if ns.args[:1] == ["--"] else ns.args
    return job.JobSpec(
        job=ns.job, nnodes=ns.nnodes, node_rank=ns.node_rank, nproc_per_node=ns.nproc_per_node,
        master_addr=ns.master_addr, master_port=ns.master_port, entry=ns.entry, args=args,
        revision=ns.revision, checkpoint=ns.checkpoint, warm=warm,
        warm_if_parked=bool(getattr(ns, "warm_if_parked", False)), launcher=ns.launcher,
        module=ns.module, workdir=ns.workdir, env=job.parse_env(ns.env), restore_max_step=ns.restore_max_step,
        hang_floor_s=ns.hang_floor_s, replica=ns.replica, replicas=ns.replicas, lighthouse=ns.lighthouse,
        replica_host=ns.replica_host, min_replicas=ns.min_replicas,
    )


def build_parser(*, plugins: bool = True) -> argparse.ArgumentParser:
    """The command line; with ``plugins``, also the commands other installed packages register (reading the
    installed packages' entry points costs about 25 ms: :func:`run` asks for them only for a command that is
    not one of tg-node's own)."""
    p = OneLineParser(prog="tg-node", description="trainguard node tools (JSON on stdout)")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    sub.add_parser("version", help="print the version")
    sub.add_parser("info", help="this machine's node configuration")
    up = sub.add_parser("up", help="bring this machine's services up: sshd and the agent (a node image's entrypoint)")
    up.add_argument("--config", help="the node configuration (default $TG_NODE_CONFIG); made from TG_MACHINE, "
                                     "TG_BUS_URL, ... when it does not exist")
    up.add_argument("--sshd", default="", help="sshd binary: start sshd (key-only) for the control plane")
    up.add_argument("--listen", default="0.0.0.0", help="sshd's listen address")  # noqa: S104  (a machine's sshd)
    up.add_argument("--authorized-keys", help="the control plane's public keys (default beside the configuration)")
    up.add_argument("--netns", default="", help="the network namespace to start sshd and the agent in")
    up.add_argument("--host-key-dir", help="publish the host public key there as MACHINE.pub "
                                           "(default $TG_HOST_KEY_DIR; none when unset)")
    up.add_argument("--foreground", action="store_true", help="stay until SIGTERM, then end them (PID 1)")
    sub.add_parser("gpu", help="GPU snapshot through NVML (real, or a backend a package registers)")
    ap = sub.add_parser("agent", help="run the real-time checks and publish alerts (a daemon)")
    ap.add_argument("--supervise", action="store_true", help="restart the agent whenever it dies")
    ap.add_argument("--restart", action="store_true",
                    help="get a stopped or hung agent going again (its supervisor starts a fresh one)")
    ap.add_argument("--processes", action="store_true", help="the agent's processes and their states, then exit")
    ap.add_argument("--once", action="store_true", help="one pass of every check, then exit")
    sub.add_parser("status", help="the agent's status file")
    cp = sub.add_parser("check", help="the real-time checks once (exit 1 if a fault is found)")
    cp.add_argument("group", nargs="?", default="all", choices=["gpu", "host", "net", "disk", "all"])
    dg = sub.add_parser("diag", help="stop-time diagnostics: L1 quick, L2 compute/memory/collective/disk, L3 peers")
    dg.add_argument("--level", type=int, required=True, choices=[1, 2, 3])
    dg.add_argument("--timeout-s", type=float, help="per test")
    dg.add_argument("--rank", type=int, help="L3: this machine's rank among its neighbours")
    dg.add_argument("--world-size", type=int, help="L3: machines in the group")
    dg.add_argument("--master-addr", help="L3: address of rank 0")
    dg.add_argument("--master-port", type=int, help="L3: rendezvous port on rank 0")
    dg.add_argument("--iface", default="", help="L3: network interface (default: the node's)")
    dg.add_argument("--align", action="store_true",
                    help="L3: then the bit-wise alignment test in the same process (its digest: the report's align)")
    al = sub.add_parser("align", help="bit-wise alignment test: digest of one fixed reference step")
    al.add_argument("--seed", type=int, default=0)
    al.add_argument("--steps", type=int, default=1)
    sp = sub.add_parser("stacks", help="py-spy stacks of a job's processes, with collective counters")
    sp.add_argument("--job", required=True)
    sp.add_argument("--native", action="store_true", help="include native frames (slow: seconds per process)")
    sp.add_argument("--timeout-s", type=float, default=10.0)
    lp = sub.add_parser("logs", help="exit codes and classified log tails of a job's ranks")
    lp.add_argument("--job", required=True)
    lp.add_argument("--since", type=float, default=0.0, help="epoch seconds: ignore older log files")
    lp.add_argument("--tail", type=int, default=50)

    jp = sub.add_parser("job", help="this machine's part of a training job")
    jsub = jp.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    js = jsub.add_parser("start")
    _job_start_args(js)
    js.add_argument("--warm-if-parked", action="store_true",
                    help="on the parked warm interpreters when enough are free, else cold (the answer's \"warm\")")
    jt = jsub.add_parser("stop")
    jt.add_argument("--job", required=True)
    jt.add_argument("--grace-s", type=float, default=10.0)
    jt.add_argument("--mark-only", action="store_true",
                    help="only record that a stop was requested (first phase of a stop across machines)")
    jt.add_argument("--wait-go", action="store_true",
                    help="both phases in one session: mark, print the mark's document, wait for a line on stdin "
                         "(or its end, or --go-timeout-s), then stop")
    jt.add_argument("--go-timeout-s", type=float, default=30.0)
    jt.add_argument("--logs-since", type=float,
                    help="after the stop, add what 'tg-node logs --since' says (its \"logs\")")
    jt.add_argument("--status", action="store_true", help="after the stop, add what 'tg-node job status' says")
    jt.add_argument("--copies", action="store_true",
                    help="after the stop, add the job's checkpoint copies here (what 'tg-node ckpt list' says)")
    jq = jsub.add_parser("status")
    jq.add_argument("--job", required=True)
    jq.add_argument("--brief", action="store_true",
                    help="each rank's process, step and status from its heartbeat only (no step history read): "
                         "the reconciler's look every few seconds")
    jr = jsub.add_parser("steps", help="a rank's step records")
    jr.add_argument("--job", required=True)
    jr.add_argument("--rank", type=int, required=True)
    jr.add_argument("--since", type=int, default=-1,
                    help="only the newest stretch of steps after this one (read from the history's end)")
    jr.add_argument("--incarnation", type=int, help="only steps of this incarnation of the job")
    jr.add_argument("--since-ts", type=float, help="only steps that ended after this time (epoch seconds); "
                                                   "reads only the tail of the rank's history")

    jo = jsub.add_parser("output", help="the last lines a job's ranks wrote on this machine (stdout or stderr) "
                                        "and where their files are")
    jo.add_argument("--job", required=True)
    jo.add_argument("--rank", type=int, default=None, help="this global rank only")
    jo.add_argument("--stream", choices=("stdout", "stderr"), default="stdout")
    jo.add_argument("--tail", type=int, default=50, help="lines per rank (0: only the paths)")

    sb = sub.add_parser("standby", help="warm standby: park pre-warmed interpreters, activate a job on them")
    sbsub = sb.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    pk = sbsub.add_parser("park")
    pk.add_argument("--nproc", type=int, required=True, help="ranks a job will start here")
    pk.add_argument("--timeout-s", type=float, default=180.0)
    pk.add_argument("--workdir", default="", help="the working directory of the job these interpreters stand by")
    pk.add_argument("--entry", default="", help="its training script (relative to --workdir), or with --module its "
                                                "module: its imports and its own modules are loaded ahead")
    pk.add_argument("--module", action="store_true", help="--entry names a module (python -m), not a script")
    pk.add_argument("--also", action="append", default=[], metavar="SCRIPT",
                    help="another program a standby may serve (a script's path): its third-party imports are loaded "
                         "too (repeatable)")
    _job_start_args(sbsub.add_parser("activate"))
    sbsub.add_parser("status")
    sbsub.add_parser("unpark")

    kp = sub.add_parser("ckpt", help="a job's checkpoint copies here: list, verify (and mark), upload to S3, rescue")
    ksub = kp.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    kl = ksub.add_parser("list")
    kl.add_argument("--job", required=True)
    kv = ksub.add_parser("verify")
    kv.add_argument("--job", required=True)
    kv.add_argument("--step", type=int, required=True)
    kv.add_argument("--mark", action="store_true", help="write verified markers if every copy here passes")
    ku = ksub.add_parser("upload")
    ku.add_argument("--job", required=True)
    ku.add_argument("--step", type=int, required=True)
    ku.add_argument("--s3", required=True, help="s3://bucket/prefix of the job's S3 tier")
    ku.add_argument("--endpoint-url", default="", help="S3-compatible endpoint (default: boto3's)")
    kr = ksub.add_parser("rescue", help="every copy of a step held here into the remote tier (before an eviction)")
    kr.add_argument("--job", required=True)
    kr.add_argument("--step", type=int, required=True)
    kr.add_argument("--to", required=True, help="the job's remote tier: s3://bucket/prefix or file:///dir")
    kr.add_argument("--endpoint-url", default="", help="S3-compatible endpoint (default: boto3's)")

    if plugins:
        for _name, register in load_group(COMMANDS_GROUP):  # the emulation's `fault`, where it is installed
            register(sub)
    return p


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    return {name for a in parser._actions if isinstance(a, argparse._SubParsersAction) for name in a.choices}


def _up(ns: argparse.Namespace) -> dict[str, Any]:
    import os
    from pathlib import Path

    from trainguard.node_tools import services

    if not ns.config and not os.environ.get("TG_NODE_CONFIG"):
        raise TrainguardError("tg-node up needs --config PATH or TG_NODE_CONFIG")
    path = Path(ns.config or os.environ["TG_NODE_CONFIG"]).resolve()
    if not path.exists():
        services.node_config_from_env(path, dict(os.environ))
    host_key_dir = ns.host_key_dir or os.environ.get("TG_HOST_KEY_DIR")
    doc = services.machine_up(path, netns=ns.netns, sshd=ns.sshd, listen=ns.listen,
                             authorized_keys=Path(ns.authorized_keys) if ns.authorized_keys else None,
                             host_key_dir=Path(host_key_dir) if host_key_dir else None)
    if ns.foreground:
        print(json.dumps(doc), flush=True)
        services.serve_forever(path, ns.netns)
        return {**doc, "stopped": True}
    return doc


def run(argv: list[str]) -> tuple[int, Any]:
    from trainguard.node_tools.config import NodeConfig

    parser = build_parser(plugins=False)
    if not argv or argv[0] not in _commands(parser):  # another package's command (or a mistake: say so in full)
        parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "version":
        return EXIT_OK, {"version": __version__}
    if ns.command == "up":
        return EXIT_OK, _up(ns)
    cfg = NodeConfig.current()
    if ns.command == "info":
        return EXIT_OK, cfg.to_dict()
    if ns.command == "gpu":
        from trainguard.node_tools.nvml import NvmlUnavailable, backend_for

        backend = backend_for(cfg)
        if backend is None:
            raise NvmlUnavailable(f"machine {cfg.machine} has no GPU backend (nvml_backend={cfg.nvml_backend})")
        return EXIT_OK, backend.snapshot()
    if ns.command == "agent":
        from trainguard.node_tools import agent

        if ns.supervise:
            return agent.supervise(cfg), {"machine": cfg.machine, "agent": "stopped"}
        if ns.processes:
            doc = agent.processes(cfg)
            return (EXIT_OK if doc["state"] == "running" else 1), {"machine": cfg.machine, **doc}
        if ns.restart:
            doc = agent.restart(cfg)
            return (EXIT_OK if doc["restarted"] else 1), doc
        if ns.once:
            a = agent.build(cfg)
            alerts = a.tick()
            return EXIT_OK, {"machine": cfg.machine, "alerts": [x.to_dict() for x in alerts], **a.status()}
        return agent.run(cfg), {"machine": cfg.machine, "agent": "stopped"}
    if ns.command == "status":
        from trainguard.node_tools import agent

        return EXIT_OK, agent.read_status(cfg)
    if ns.command == "check":
        from trainguard.node_tools import agent

        return agent.check_once(cfg, ns.group)
    if ns.command == "diag":
        from trainguard.node_tools import diag

        l3 = None
        group = ("rank", "world_size", "master_addr", "master_port")
        if ns.level == 3 or any(getattr(ns, f) is not None for f in group):  # at level 2: then L3, one process
            missing = [f for f in group if getattr(ns, f) is None]
            if missing:
                flags = " --".join(m.replace("_", "-") for m in missing)
                raise TrainguardError(f"diag --level {ns.level} with neighbours needs --{flags}")
            l3 = diag.L3Spec(rank=ns.rank, world_size=ns.world_size, master_addr=ns.master_addr,
                             master_port=ns.master_port, iface=ns.iface)
        if ns.align and l3 is None:
            raise TrainguardError("diag --align runs after the neighbour collective: give --rank --world-size "
                                  "--master-addr --master-port, or use 'tg-node align'")
        return diag.diag(cfg, ns.level, timeout_s=ns.timeout_s, l3=l3, align_steps=1 if ns.align else 0)
    if ns.command == "align":
        from trainguard.node_tools import diag

        return diag.align(cfg, seed=ns.seed, steps=ns.steps)
    if ns.command == "stacks":
        from trainguard.node_tools import job, stacks

        return stacks.stacks(cfg, job.check_job_name(ns.job), native=ns.native, timeout_s=ns.timeout_s)
    if ns.command == "logs":
        from trainguard.node_tools import job, logs

        return logs.logs(cfg, job.check_job_name(ns.job), since=ns.since, tail=ns.tail)
    if ns.command == "job":
        from trainguard.node_tools import job

        if ns.action == "start":
            return EXIT_OK, job.start(cfg, _job_spec(ns, warm=False))
        if ns.action == "stop":
            wait = (lambda mark: _wait_go(mark, ns.go_timeout_s)) if ns.wait_go else None
            out = job.stop(cfg, job.check_job_name(ns.job), grace_s=ns.grace_s, mark_only=ns.mark_only,
                           wait_go=wait)
            if ns.status:
                out["status"] = job.status(cfg, ns.job)
            if ns.copies:
                from trainguard.node_tools import ckpt

                try:
                    out["copies"] = ckpt.listing(cfg, ns.job)["copies"]
                except TrainguardError:  # no checkpoint root here: no copies
                    out["copies"] = []
            if ns.logs_since is not None:
                from trainguard.node_tools import logs

                try:
                    out["logs"] = logs.logs(cfg, ns.job, since=ns.logs_since)[1]
                except TrainguardError as exc:
                    out["logs"] = {"error": str(exc)}
            return EXIT_OK, out
        if ns.action == "steps":
            return EXIT_OK, job.steps(cfg, ns.job, ns.rank, since=ns.since, incarnation=ns.incarnation,
                                      since_ts=ns.since_ts)
        if ns.action == "output":
            return EXIT_OK, job.output(cfg, job.check_job_name(ns.job), rank=ns.rank, stream=ns.stream,
                                       tail=max(0, ns.tail))
        return EXIT_OK, job.status(cfg, job.check_job_name(ns.job), brief=ns.brief)
    if ns.command == "standby":
        from trainguard.node_tools import job, standby

        if ns.action == "park":
            return EXIT_OK, standby.park(cfg, nproc=ns.nproc, timeout_s=ns.timeout_s, workdir=ns.workdir,
                                         entry=ns.entry, module=ns.module, also=tuple(ns.also))
        if ns.action == "activate":
            return EXIT_OK, job.start(cfg, _job_spec(ns, warm=True))
        if ns.action == "unpark":
            return EXIT_OK, standby.unpark(cfg)
        return EXIT_OK, standby.status(cfg)
    if ns.command == "ckpt":
        from trainguard.node_tools import ckpt

        if ns.action == "list":
            return EXIT_OK, ckpt.listing(cfg, ns.job)
        if ns.action == "verify":
            return ckpt.verify(cfg, ns.job, ns.step, mark=ns.mark)
        if ns.action == "rescue":
            return ckpt.rescue(cfg, ns.job, ns.step, to_url=ns.to, endpoint_url=ns.endpoint_url)
        return ckpt.upload(cfg, ns.job, ns.step, s3_url=ns.s3, endpoint_url=ns.endpoint_url)
    handler = getattr(ns, "node_handler", None)
    if handler is not None:  # a command another package registered
        return handler(ns, cfg)
    raise TrainguardError(f"unknown command {ns.command!r}")


def _wait_go(mark: dict[str, Any], timeout_s: float) -> None:
    """The first phase's document on one line of stdout, then the go: a line on stdin, its end, or
    ``timeout_s`` (a controller that went away must not leave the job marked but running)."""
    sys.stdout.write(json.dumps(mark, separators=(",", ":")) + "\n")
    sys.stdout.flush()
    import select

    with contextlib.suppress(OSError, ValueError):
        if select.select([sys.stdin], [], [], max(0.0, timeout_s))[0]:
            sys.stdin.readline()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] in ("-h", "--help"):
        build_parser().print_help()
        return EXIT_OK
    try:
        code, document = run(args)
    except TrainguardError as exc:
        code, document = exc.exit_code, {"error": str(exc)}
    except OSError as exc:  # a full or read-only disk, a vanished file: say so on one line
        where = f" ({exc.filename})" if exc.filename else ""
        code, document = EXIT_USAGE, {"error": f"{exc.strerror or exc}{where}"}
    except KeyboardInterrupt:
        code, document = EXIT_INTERRUPTED, {"error": "interrupted"}
    json.dump(document, sys.stdout, indent=None, separators=(",", ":"), default=str)
    sys.stdout.write("\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
