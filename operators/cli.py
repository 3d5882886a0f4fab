"""``trainguard``: the host-side command line.

Commands::

    trainguard fleet migrate                    provision the fleet database (schema, the inventory's machines)
    trainguard airflow bundles                  the DAG bundle list with trainguard's (for an Airflow you run)
    trainguard airflow install [--pool-slots 16 --api-url URL]   provision that Airflow for trainguard's DAGs
    trainguard job submit SPEC [--wait S]       put a job under guard: a tg_job_launch run with the spec
    trainguard job stop J | status J | list     stop a job (its machines back to the pool); where jobs stand
    trainguard revision add --job J --revision R [--reason TEXT] | list --job J
    trainguard metrics [--port 9464 --addr 127.0.0.1]   (Prometheus; without --port: print one scrape)
    trainguard ettr --job J [--window-s 3600]   (the control plane's fleet database: $TG_FLEET_URL, $TG_INVENTORY)
    trainguard status [--airflow-url URL]       trainguard's own health and its jobs, one screen (exit 1: look)
    trainguard simulate [--gpus 9600 --days 90 --profile byterobust|measured --model FILE --seed N
                         --sensitivity --chart PNG --degrade [--min-replicas N]]
                                                projected ETTR of one job at scale (operators/sim)

and the commands other packages register through the ``trainguard.commands`` entry point (the emulation's:
``cluster``, ``inject``, ``demo``, ``controlplane``; see :mod:`trainguard.emulation.cli`).

Exit codes: 0 success, 1 the job or check failed, 2 bad input or missing
prerequisite (a one-line message says what to do), 3 refused, 130 interrupted.
``--state-dir`` (or ``$TG_HOME``) chooses where the emulated cluster keeps its
state (default ``./.tg/cluster``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from trainguard.core.errors import EXIT_INTERRUPTED, EXIT_OK, TrainguardError
from trainguard.node_tools.cliutil import OneLineParser

Handler = Callable[[argparse.Namespace], int]
COMMANDS_GROUP = "trainguard.commands"


def _airflow_url_option(parser: argparse.ArgumentParser) -> None:
    """``--airflow-url`` of a command that talks to the api-server with the operator's login (:func:`_airflow`)."""
    parser.add_argument("--airflow-url", default="", help="the api-server (default $TG_AIRFLOW_URL, else the demo's "
                                                          "kept Airflow); login from "
                                                          "$TG_AIRFLOW_USER/$TG_AIRFLOW_PASSWORD")


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, Handler]]:
    """The parser and the handlers of the commands other packages register (entry point group
    ``trainguard.commands``: a function that adds its subparsers and returns their handlers)."""
    from trainguard.node_tools.plugins import load_group

    p = OneLineParser(prog="trainguard", description="keep large PyTorch training jobs productive")
    p.add_argument("--state-dir", type=Path, help="emulated cluster state (default $TG_HOME/cluster or ./.tg/cluster)")
    p.add_argument("--json", action="store_true", help="print results as JSON")
    sub = p.add_subparsers(dest="command", required=True, parser_class=OneLineParser)

    fp = sub.add_parser("fleet", help="the fleet database: provision it (once per release, before the DAGs run)")
    fsub = fp.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    fsub.add_parser("migrate", help="create or migrate the schema; register the inventory's new machines")

    ap = sub.add_parser("airflow", help="trainguard in an Airflow 3 you run: its DAG bundle, and what its DAGs need")
    asub = ap.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    asub.add_parser("bundles", help="print AIRFLOW__DAG_PROCESSOR__DAG_BUNDLE_CONFIG_LIST: yours, with trainguard's")
    ai = asub.add_parser("install", help="provision the fleet database, the tg_ssh pool, the run notes' login and "
                                         "the tg_airflow_api connection (each a no-op when in place)")
    ai.add_argument("--pool-slots", type=int, default=None, help="resize the tg_ssh pool (concurrent SSH sessions); "
                                                                 "default: keep it, or make it with $TG_SSH_POOL_SLOTS "
                                                                 "(16) slots")
    ai.add_argument("--api-url", default="", help="where tasks reach the api-server (default: [api] base_url, "
                                                  "else its host and port)")

    jp = sub.add_parser("job", help="jobs under guard: submit a spec (a tg_job_launch run), stop, status, list")
    jsub = jp.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    js = jsub.add_parser("submit", help="validate a job spec (YAML or JSON) and start a tg_job_launch run with it")
    js.add_argument("spec", type=Path, help="the job spec file")
    js.add_argument("--wait", type=float, default=0.0, metavar="S",
                    help="wait up to S seconds for the launch run to end (exit 1 if it failed); 0: do not wait")
    _airflow_url_option(js)
    for action, text in (("stop", "stop the job and return its machines to the pool"),
                         ("status", "the job's state, machines, command and progress")):
        jsub.add_parser(action, help=text).add_argument("job")
    jl = jsub.add_parser("logs", help="what the job's ranks printed (their stdout, or --stream stderr), read on its "
                                      "machines, and where the files are")
    jl.add_argument("job")
    jl.add_argument("--rank", type=int, default=None, help="this global rank only (default: every rank)")
    jl.add_argument("--stream", choices=("stdout", "stderr"), default="stdout")
    jl.add_argument("--tail", type=int, default=50, help="lines per rank (default 50)")
    jsub.add_parser("list", help="every job of the fleet database")

    ip = sub.add_parser("incident", help="incidents: list them, show one's timeline, close one by hand, act on a "
                                         "waiting one again")
    isub = ip.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    il = isub.add_parser("list", help="the incidents still open or waiting for a human (--all: every one)")
    il.add_argument("--job", default="", help="of this job only")
    il.add_argument("--all", action="store_true", help="closed ones too")
    ish = isub.add_parser("show", help="an incident's timeline: its alerts, the run that took it, each action and how "
                                       "long it took, and when it was decided, trained again and closed")
    ish.add_argument("incident", type=int)
    ish.add_argument("--tasks", action="store_true",
                     help="with the task instances of its tg_incident runs (how long each waited in the queue and "
                          "ran), read from the api-server")
    _airflow_url_option(ish)
    ic = isub.add_parser("close", help="close an incident that is open or waits for a human (its job is looked at "
                                       "again by the reconciler)")
    ic.add_argument("incident", type=int)
    ic.add_argument("--note", default="", help="what was done about it (kept in its summary)")
    ir = isub.add_parser("retry", help="act on an incident that waits for a human again, once its cause is put right "
                                       "(its run's restart_job and the tasks after it are cleared)")
    ir.add_argument("incident", type=int)
    _airflow_url_option(ir)

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
    sim = sub.add_parser("simulate", help="project a job's ETTR at scale: months of failures, the real policy's "
                                          "response, latencies from a profile")
    sim.add_argument("--gpus", type=int, default=9600, help="GPUs of the job (default 9600)")
    sim.add_argument("--days", type=float, default=90.0, help="simulated days (default 90)")
    sim.add_argument("--profile", default="byterobust", help="phase latencies: byterobust (the paper's figures) or "
                                                             "measured (bench/results/*.json)")
    sim.add_argument("--model", type=Path, help="a YAML or JSON file overriding the failure model's keys")
    sim.add_argument("--pp", type=int, default=8, help="pipeline stages (TP is one 8-GPU machine; default 8)")
    sim.add_argument("--seed", type=int, default=1)
    sim.add_argument("--sensitivity", action="store_true", help="also the sensitivity table (about 30 runs)")
    sim.add_argument("--degrade", action="store_true", help="train through faults confined to a few data-parallel "
                                                           "replicas on the others (operators/policy/degrade.py)")
    sim.add_argument("--min-replicas", type=int, default=1, help="with --degrade: the fewest replicas the job "
                                                                 "trains on (default 1)")
    sim.add_argument("--chart", type=Path, help="write a PNG chart here")
    handlers: dict[str, Handler] = {}
    for _name, register in load_group(COMMANDS_GROUP):  # without the parts this installation leaves out
        handlers.update(register(sub))
    return p, handlers




def print_result(args: argparse.Namespace, document: Any, text: str | None = None) -> None:
    if args.json or text is None:
        print(json.dumps(document, indent=2, default=str))
    else:
        print(text)


def cmd_airflow(args: argparse.Namespace) -> int:
    from trainguard.operators import airflow_setup

    if args.action == "bundles":
        print(airflow_setup.bundles_json())
        return EXIT_OK
    lines = airflow_setup.install(pool_slots=args.pool_slots, url=args.api_url)
    print_result(args, {"done": lines}, "\n".join(lines))
    return EXIT_OK


def cmd_ettr(args: argparse.Namespace) -> int:
    from trainguard.operators.control import ControlConfig, Controller
    from trainguard.operators.fleet import FleetStore

    if args.window_s <= 0:
        raise TrainguardError(f"--window-s {args.window_s} must be above 0", exit_code=2)
    cfg = ControlConfig.from_env()
    report = Controller(cfg, fleet=FleetStore(cfg.fleet_url)).ettr_report(args.job, window_s=args.window_s)
    c, w = report["cumulative"], report["sliding"]
    lines = [f"job {args.job}: ETTR {c['ettr']:.2%} since its first step ({c['kept_steps']} steps kept, "
             f"{c['lost_steps']} recomputed, {c['lost_work_s']:.1f}s of lost work); "
             f"{w['ettr']:.2%} over the last {w['window_s']:.0f}s"]
    lines += [f"  {cause:14} {v['incidents']} incidents, {v['seconds']:.1f}s"
              for cause, v in report["by_cause"].items()]
    print_result(args, report, "\n".join(lines))
    return EXIT_OK


def cmd_simulate(args: argparse.Namespace) -> int:
    from trainguard.operators.sim import model, profiles, report

    if args.profile not in profiles.PROFILES:
        raise TrainguardError(f"unknown profile {args.profile!r}; use --profile {' or '.join(profiles.PROFILES)}",
                              exit_code=2)
    m = model.load_model(args.model)
    machines = args.gpus // m.gpus_per_machine if args.gpus > 0 else 0
    prof = profiles.profile(args.profile, max(machines, 1), gpus_per_machine=m.gpus_per_machine)
    knobs = report.degrade_knobs(prof, args.min_replicas) if args.degrade else None
    result, wall = report.timed(m, prof, gpus=args.gpus, days=args.days, pp=args.pp, seed=args.seed, knobs=knobs)
    doc: dict[str, Any] = {**result.as_dict(), "wall_s": round(wall, 3)}
    lines = [*report.breakdown_lines(result), f"  simulated in {wall:.1f} s"]
    if args.sensitivity:
        rows = report.sensitivity(m, prof, gpus=args.gpus, days=args.days, seed=args.seed, pp=args.pp)
        doc["sensitivity"] = rows
        lines.append(report.sensitivity_markdown(rows))
    if args.chart:
        report.chart([result], args.chart)
        lines.append(f"  chart: {args.chart}")
    print_result(args, doc, "\n".join(lines))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    import os

    from trainguard.operators import status
    from trainguard.operators.control import ControlConfig
    from trainguard.operators.fleet import FleetStore
    from trainguard.operators.sensors.alerts import silent_from_env

    fleet = FleetStore(ControlConfig.from_env().fleet_url)
    url = args.airflow_url or os.environ.get("TG_AIRFLOW_URL", "") or status.kept_airflow_url(
        _kept_airflow_home(args))
    try:
        silent = silent_from_env()
    except ValueError as exc:
        raise TrainguardError(str(exc), exit_code=2) from None
    beats = None
    if url:  # the watchers' beats in Airflow's asset state stores, with the operator's login
        try:
            with _airflow(args) as api:
                beats = status.watcher_beats(api)
        except Exception:  # the api-server away or the login refused: its health below says which
            beats = None
    observed = None
    try:  # what the running jobs' machines say (the inventory may be out of reach: then the database alone)
        from trainguard.operators.control import Controller

        observed = status.observe(Controller(ControlConfig.from_env()), fleet.jobs())
    except Exception as exc:  # a health command says what it can: the machines' word is left out, with why
        print(f"trainguard: status: the machines were not asked ({type(exc).__name__}: {exc})"[:300],
              file=sys.stderr)
        observed = None
    doc = status.collect(fleet, silent_s=silent or 15.0, airflow_url=url, beats=beats, observed=observed,
                         reconcile_period_s=ControlConfig.from_env().reconcile_period_s)
    print_result(args, doc, status.render(doc))
    return EXIT_OK if doc["healthy"] else 1


def cmd_metrics(args: argparse.Namespace) -> int:

    from trainguard.operators import metrics
    from trainguard.operators.control import ControlConfig
    from trainguard.operators.fleet import FleetStore

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
    from trainguard.operators.control import ControlConfig
    from trainguard.operators.fleet import FleetStore
    from trainguard.operators.jobspec import REVISION_RE

    fleet = FleetStore(ControlConfig.from_env().fleet_url)
    job = fleet.job(args.job)  # an unknown job: a one-line error naming the jobs there are
    if args.action == "add":
        if not REVISION_RE.match(args.revision):
            raise TrainguardError(f"--revision {args.revision!r} must be 1-128 letters, digits or ._+- (a tag or "
                                  f"commit id)", exit_code=2)
        added = fleet.record_revision(args.job, args.revision, reason=args.reason)
        print_result(args, {"job": args.job, "revision": args.revision, "added": added},
               f"revision {args.revision} of job {args.job} " + ("recorded" if added else "was already recorded"))
        return EXIT_OK
    revs = fleet.revisions(args.job)
    doc = {"job": args.job, "running": job.revision, "pending": job.pending_revision,
           "revisions": [{"revision": r.revision, "known_good": r.known_good, "recorded_ts": r.recorded_ts,
                          "reason": r.reason} for r in revs]}
    lines = [f"{'*' if r.revision == job.revision else ('>' if r.revision == job.pending_revision else ' ')} "
             f"{r.revision:24} {'known good' if r.known_good else '':10} {r.reason}" for r in revs]
    print_result(args, doc, "\n".join([f"job {args.job} (* runs, > waits for the next restart)", *lines]))
    return EXIT_OK


def _kept_airflow_home(args: argparse.Namespace) -> Path:
    """Where a demo kept with ``--keep`` left its ``airflow standalone``."""
    from trainguard.node_tools.config import tg_home

    return (args.state_dir.parent if args.state_dir else tg_home()) / "control" / "airflow"


def _airflow(args: argparse.Namespace) -> Any:
    """The api-server to start runs on, with the operator's login: ``--airflow-url`` or ``$TG_AIRFLOW_URL`` and
    ``$TG_AIRFLOW_USER``/``$TG_AIRFLOW_PASSWORD``; else the demo's kept Airflow with its admin login."""
    import os

    from trainguard.operators import status
    from trainguard.operators.hooks.airflow_api import AirflowApi

    url = args.airflow_url or os.environ.get("TG_AIRFLOW_URL", "")
    user, password = os.environ.get("TG_AIRFLOW_USER", ""), os.environ.get("TG_AIRFLOW_PASSWORD", "")
    home = _kept_airflow_home(args)
    kept = status.kept_airflow_url(home)
    url = url or kept
    if url and url.rstrip("/") == kept.rstrip("/") and not user:
        try:
            user, password = "admin", json.loads(
                (home / "simple_auth_manager_passwords.json.generated").read_text())["admin"]
        except (OSError, ValueError, KeyError):
            pass
    if not url:
        raise TrainguardError("no Airflow api-server to submit to: pass --airflow-url or set TG_AIRFLOW_URL (and "
                              "TG_AIRFLOW_USER, TG_AIRFLOW_PASSWORD)", exit_code=2)
    if not user:
        raise TrainguardError(f"no login for the api-server at {url}: set TG_AIRFLOW_USER and TG_AIRFLOW_PASSWORD "
                              f"(an Airflow user allowed to trigger DAG runs)", exit_code=2)
    # a wrong address answers nothing: say so after a few seconds; a busy api-server (a request of its own waits up
    # to half a minute for a database lock) is waited for, and the launch run, named here, is asked for again
    return AirflowApi(url, username=user, password=password, timeout_s=60.0, retry_s=120.0, connect_retry_s=5.0)


def cmd_incident(args: argparse.Namespace) -> int:
    from trainguard.operators.control import ControlConfig
    from trainguard.operators.fleet import FleetStore
    from trainguard.operators.fleet.states import OPEN_INCIDENT_STATES

    fleet = FleetStore(ControlConfig.from_env().fleet_url)
    if args.action == "list":
        rows = [i for i in fleet.incidents(args.job or None) if args.all or i.state in OPEN_INCIDENT_STATES]
        runs = fleet.runs_of([i.id for i in rows]) if rows else {}
        doc = [{"incident": i.id, "job": i.job, "state": i.state, "category": i.category, "level": i.level,
                "opened_ts": i.opened_ts, "run": (runs.get(i.id) or [None])[-1], "summary": i.summary} for i in rows]
        print_result(args, doc, "\n".join(f"{d['incident']:6} {d['job']:16} {d['state']:14} {d['category'] or '-':13} "
                                          f"{d['run'] or '-'}  {(d['summary'] or '')[:100]}" for d in doc)
                     or "no incident")
        return EXIT_OK
    if args.action == "show":
        from trainguard.operators.control.timeline import format_timeline, incident_timeline

        fleet.incident(args.incident)  # one that does not exist: said before the api-server is asked
        tasks: dict[str, Any] = {}
        if args.tasks:
            runs = [c["run"] for c in fleet.claims_of(args.incident)]
            try:
                with _airflow(args) as api:
                    tasks = {run: api.task_instances("tg_incident", run) for run in runs}
            except TrainguardError:
                raise
            except Exception as exc:
                raise TrainguardError(f"the api-server did not list the task instances of run(s) {', '.join(runs)}: "
                                      f"{exc}; leave out --tasks for the fleet database's timeline alone",
                                      exit_code=2) from None
        doc = incident_timeline(fleet, args.incident, tasks)
        print_result(args, doc, format_timeline(doc))
        return EXIT_OK
    if args.action == "close":
        out = fleet.close_by_hand(args.incident, args.note)
        print_result(args, out, f"incident {args.incident} " + (
            f"closed ({out['state']}); job {out['job']} is {out['job_state']}" if out["closed"]
            else f"was closed already ({out['state']})"))
        return EXIT_OK
    inc = fleet.incident(args.incident)
    if inc.state in ("resolved", "failed"):
        raise TrainguardError(f"incident {inc.id} is {inc.state}; only one that is open or waits for a human can be "
                              f"retried", exit_code=2)
    runs = [c["run"] for c in fleet.claims_of(inc.id)]
    if not runs:
        raise TrainguardError(f"incident {inc.id} has no tg_incident run to act again; trigger tg_incident with "
                              f"incident_id {inc.id}", exit_code=2)
    api = _airflow(args)
    try:
        with api:
            cleared = api.clear_tasks("tg_incident", runs[-1], ["restart_job"])
    except Exception as exc:
        raise TrainguardError(f"the api-server did not clear restart_job of run {runs[-1]}: {exc}",
                              exit_code=2) from None
    doc = {"incident": inc.id, "run": runs[-1], "cleared": cleared}
    print_result(args, doc, f"incident {inc.id}: restart_job of tg_incident run {runs[-1]} cleared "
                            f"({', '.join(cleared) or 'nothing'}); it acts on the incident again")
    return EXIT_OK


def _job_logs(args: argparse.Namespace, c: Any, j: Any) -> int:
    """``trainguard job logs``: each machine's ``tg-node job output`` (the machine holding ``--rank`` alone when it
    is given), printed rank by rank."""
    if args.tail < 0:
        raise TrainguardError(f"--tail {args.tail} must be >= 0", exit_code=2)
    names = list(j.machine_list)
    if args.rank is not None:
        topo = c.topology(j.name)
        if not 0 <= args.rank < topo.world_size:
            raise TrainguardError(f"--rank {args.rank}: job {j.name} has ranks 0..{topo.world_size - 1}", exit_code=2)
        names = [names[topo.machine_of(args.rank)]]
    extra = [*(["--rank", str(args.rank)] if args.rank is not None else []), "--stream", args.stream,
             "--tail", str(args.tail)]
    results = c.transport.run_many(c.inventory.named(names), lambda m: [
        c.inventory.tg_node, "job", "output", "--job", j.name, *extra], timeout=30)
    docs = {n: (r.json() if r.ok else {"error": r.describe()}) for n, r in results.items()}
    lines: list[str] = []
    for name in names:
        doc = docs.get(name) or {"error": "no answer"}
        if "error" in doc:
            lines.append(f"== {name}: {doc['error']}")
            continue
        for r in doc.get("ranks", []):
            lines.append(f"== rank {r['rank']} on {name} (local rank {r['local_rank']}, incarnation "
                         f"{doc.get('incarnation')}): {r['path']}")
            lines += r["lines"]
    print_result(args, {"job": j.name, "stream": args.stream, "machines": docs},
                 "\n".join(lines) or f"job {j.name}: no output yet")
    return EXIT_OK if all("error" not in d for d in docs.values()) else 1


def cmd_job(args: argparse.Namespace) -> int:
    from trainguard.operators.control import ControlConfig, Controller

    if args.action == "submit":
        import httpx

        from trainguard.operators.hooks.airflow_api import ApiError
        from trainguard.operators.jobspec import load_spec

        spec = load_spec(args.spec)
        api = _airflow(args)
        try:
            with api:
                run_id = api.trigger_run("tg_job_launch", {"spec": spec.document()})
                link = f"{api.base_url}/dags/tg_job_launch/runs/{run_id}"
                state = "queued"
                deadline = time.monotonic() + args.wait
                while args.wait > 0 and state not in ("success", "failed") and time.monotonic() < deadline:
                    time.sleep(2.0)
                    state = api.run_state("tg_job_launch", run_id)
        except ApiError as exc:
            raise TrainguardError(f"the api-server refused the launch run: {exc}", exit_code=2) from None
        except (OSError, httpx.HTTPError) as exc:
            raise TrainguardError(f"no api-server answered at {api.base_url} ({exc}); check --airflow-url or "
                                  f"TG_AIRFLOW_URL", exit_code=2) from None
        doc = {"job": spec.name, "dag_id": "tg_job_launch", "run_id": run_id, "url": link, "state": state}
        print_result(args, doc, f"job {spec.name} submitted: tg_job_launch run {run_id} ({state}); {link}")
        return 1 if state == "failed" else EXIT_OK
    c = Controller(ControlConfig.from_env())
    if args.action == "list":
        jobs = c.fleet.jobs()
        doc = [{"job": j.name, "state": j.state, "machines": j.machine_list, "revision": j.revision,
                "command": (j.spec or {}).get("command", [])} for j in jobs]
        print_result(args, doc, "\n".join(f"{d['job']:24} {d['state']:10} {len(d['machines']):4} machines  "
                                          f"{' '.join(d['command'])}" for d in doc) or "no job")
        return EXIT_OK
    j = c.fleet.job(args.job)  # an unknown job: a one-line error
    if args.action == "logs":
        return _job_logs(args, c, j)
    if args.action == "stop":
        out = c.jobs.release(args.job)
        print_result(args, out, f"job {args.job} stopped; machines {', '.join(out['released']) or 'none'} back "
                                f"in the pool")
        return EXIT_OK
    progress = c.jobs.progress(args.job) if j.state in ("launching", "running") else {}
    doc = {"job": j.name, "state": j.state, "machines": j.machine_list, "revision": j.revision, "spec": j.spec,
           "progress": progress}
    print_result(args, doc, "\n".join([
        f"job {j.name}: {j.state}, revision {j.revision}, {len(j.machine_list)} machines",
        f"  command: {' '.join((j.spec or {}).get('command', []))}",
        f"  machines: {', '.join(j.machine_list)}",
        *([f"  step {progress['step']} on every rank; machines: "
           + ", ".join(f"{n} {s}" for n, s in progress["states"].items())] if progress else [])]))
    return EXIT_OK


def cmd_fleet(args: argparse.Namespace) -> int:
    from trainguard.operators.hooks.fleet import provision

    doc = provision()
    print_result(args, doc, f"fleet database {doc['fleet_url']}: "
                 + (f"migrations {', '.join(map(str, doc['migrations_applied']))} applied"
                    if doc["migrations_applied"] else "schema up to date")
                 + (f"; machines added: {', '.join(doc['machines_added'])}" if doc["machines_added"] else ""))
    return EXIT_OK


def main(argv: list[str] | None = None) -> int:
    import logging

    args_list = sys.argv[1:] if argv is None else argv
    # a command's output is its result (one JSON document with --json): the SSH library's connection lines, which
    # the logging Airflow sets up would print on stdout, stay out of it
    logging.getLogger("paramiko").setLevel(logging.ERROR)
    try:
        parser, handlers = build_parser()
        args = parser.parse_args(args_list)
        if args.command in handlers:
            return handlers[args.command](args)
        if args.command == "fleet":
            return cmd_fleet(args)
        if args.command == "airflow":
            return cmd_airflow(args)
        if args.command == "job":
            return cmd_job(args)
        if args.command == "incident":
            return cmd_incident(args)
        if args.command == "ettr":
            return cmd_ettr(args)
        if args.command == "revision":
            return cmd_revision(args)
        if args.command == "metrics":
            return cmd_metrics(args)
        if args.command == "status":
            return cmd_status(args)
        if args.command == "simulate":
            return cmd_simulate(args)
    except TrainguardError as exc:
        print(f"trainguard: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("trainguard: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
