"""The main job on the embedded default: a guarded training run through a scripted series of faults.

``trainguard demo`` brings up the emulated cluster (6 machines: the job on 4, 2 warm standbys),
starts ``airflow standalone`` with trainguard's DAGs unpaused and its pool and connections
provisioned, launches the reference job (TP=2 PP=2 DP=2, a checkpoint every step) under guard, and
injects one fault of each rung of the decision ladder in turn: an explicit GPU fault, a hang, a NaN
loss, a user-code bug in a new revision, a slow rank. The control plane detects, decides, evicts,
swaps in standbys and resumes on its own; the demo only plays the repair crew (evicted machines are
fixed, self-checked and parked warm again) and narrates what the fleet database records, live.

It ends with a report (per incident: what happened, how long each phase took, steps lost; the run's
ETTR) and a timeline chart (HTML) in the report folder. ``--keep`` leaves Airflow at
http://localhost:8080 and the cluster up to explore (``trainguard cluster down`` ends both). Ctrl-C
at any moment stops the job and Airflow and brings the cluster down.
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from trainguard.core.errors import EXIT_OK, EXIT_UNHEALTHY, TrainguardError
from trainguard.emulation import cluster
from trainguard.emulation.guarded import (
    DEVICE_TRAIN_ARGS,
    FAULTS,
    NO_SCHEDULES,
    TOPOLOGY,
    Fault,
    GuardedJob,
    action_swaps,
)

JOB = "demo"
DEFAULT_FAULTS = ("gpu_lost", "hang", "nan", "user_error", "slow")
# the ladder's clocks, compressed so that five faults fit in ten minutes (production in brackets)
SETTINGS = {
    "TG_ESCALATION_WINDOW_S": "20",  # a failure this soon after a recovery climbs the ladder (1800)
    "TG_BREAKER_SHARE": "0.75", "TG_BREAKER_WINDOW_S": "60",  # evictions per window (0.5 per 3600 s)
    "TG_SLOW_ROUNDS": "5", "TG_SLOW_INTERVAL_S": "3",  # the fail-slow vote (5 rounds, 10 s apart)
    "TG_STOP_GRACE_S": "2",  # a failing job's processes: SIGTERM, then SIGKILL after this (5)
    **NO_SCHEDULES,  # the demo is the repair crew and deploys its own revisions
}
PHASES = (("detection", "first_alert_ts", "opened_ts", "#f0a030"), ("diagnosis", "opened_ts", "decided_ts", "#d04040"),
          ("recovery", "decided_ts", "resumed_ts", "#4070d0"))


class Clock:
    def __init__(self) -> None:
        self.t0 = time.time()

    def say(self, message: str) -> None:
        print(f"[{time.time() - self.t0:6.1f}s] {message}", flush=True)


class Narrator:
    """Prints what the fleet database records about the job as it happens: alerts, incidents, their
    triage, evictions, restarts, resumption."""

    def __init__(self, g: GuardedJob, clock: Clock) -> None:
        self.g, self.clock = g, clock
        self.seen_alerts: set[str] = set()
        self.seen_actions: set[int] = set()
        self.state: dict[int, dict[str, Any]] = {}
        self.fault_ts: float | None = None
        self.last_progress = 0.0

    def _at(self, ts: float | None) -> str:
        return f" (+{ts - self.fault_ts:.1f}s after the fault)" if ts and self.fault_ts else ""

    def tick(self) -> None:
        fleet = self.g.ctl.fleet
        for inc in fleet.incidents(JOB):
            old = self.state.get(inc.id)
            if old is not None and old.get("closed"):
                continue
            if old is None:
                old = self.state[inc.id] = {}
                self.clock.say(f"incident {inc.id} opened (level {inc.level}){self._at(inc.opened_ts)}")
            alerts = fleet.alerts_of(inc.id)
            new = [a for a in alerts if a.id not in self.seen_alerts]
            self.seen_alerts.update(a.id for a in new)
            if new:
                kinds = sorted({f"{a.machine}:{a.kind}" for a in new})
                first = min(new, key=lambda a: a.ts)
                self.clock.say(f"  detected: {', '.join(kinds[:6])}{' ...' if len(kinds) > 6 else ''}"
                               f"{self._at(first.ts)}")
            decision = inc.summary.split("; resumed at", 1)[0]
            if inc.category and decision != old.get("decision"):
                old["decision"] = decision
                self.clock.say(f"  decision: {inc.category}: {decision}")
            for a in fleet.actions(inc.id):
                if a.id in self.seen_actions or a.outcome == "pending":
                    continue
                self.seen_actions.add(a.id)
                self.clock.say(f"  {_action_line(a)}{self._at(a.finished_ts)}")
            if inc.resumed_ts and not old.get("resumed"):
                old["resumed"] = True
                lost = "unknown" if inc.lost_steps is None else inc.lost_steps
                self.clock.say(f"  training resumed; steps lost: {lost}{self._at(inc.resumed_ts)}")
            if inc.state not in ("open", "diagnosing", "recovering") and inc.closed_ts:
                old["closed"] = True
                self.clock.say(f"incident {inc.id} {inc.state}: {inc.category}"
                               f"{self._at(inc.closed_ts)}")

    def progress(self, every_s: float = 20.0) -> None:
        """A line on the job's training every ``every_s``."""
        if time.time() - self.last_progress < every_s:
            return
        self.last_progress = time.time()
        p = self.g.ctl.progress(JOB)
        machines = self.g.ctl.fleet.job(JOB).machine_list
        self.clock.say(f"training: step {p['step']} on {', '.join(machines)}")


def _action_line(a: Any) -> str:
    detail = a.detail or ""
    if a.kind == "evict":
        moved = ", ".join(f"{old} -> standby {new}" for old, new in action_swaps(a).items())
        return f"evicted {moved}" if moved else f"eviction of {', '.join(a.machines)}: {a.outcome} {detail}"
    if a.kind == "launch":
        return f"restarted the job on {', '.join(a.machines)} ({a.outcome})"
    if a.kind == "rollback":
        return f"rolled back: {detail or a.outcome}"
    return f"{a.kind} {', '.join(a.machines)}: {a.outcome} {detail[:120]}"


def _wait(until_ts: float, narrator: Narrator) -> None:
    while time.time() < until_ts:
        narrator.tick()
        narrator.progress()
        time.sleep(0.5)


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _validate(args: argparse.Namespace) -> list[Fault]:
    kinds = [k.strip() for k in args.faults.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in FAULTS]
    if unknown:
        raise TrainguardError(f"--faults: unknown fault {', '.join(unknown)}; use some of {', '.join(FAULTS)}")
    if args.every < 30:
        raise TrainguardError(f"--every {args.every:g} must be at least 30 (seconds between faults)")
    if args.standbys < 2:
        raise TrainguardError(f"--standbys {args.standbys} must be at least 2 (a hang evicts a pipeline of 2)")
    if args.machines - args.standbys < TOPOLOGY.machines:
        raise TrainguardError(f"--machines {args.machines} with --standbys {args.standbys} leaves "
                              f"{args.machines - args.standbys} for the job; it needs {TOPOLOGY.machines}")
    if args.port and not _port_free(args.port):
        raise TrainguardError(f"port {args.port} is in use (another Airflow?); pass --port with a free one, "
                              f"or 0 for any")
    return [FAULTS[k] for k in kinds]


def run_demo(args: argparse.Namespace) -> int:
    faults = _validate(args)
    spec = cluster.ClusterSpec(name=args.name, machines=args.machines, standbys=args.standbys, subnet=args.subnet,
                               disk_mb=256, gpus=8)
    spec.validate()
    state_dir = Path(args.state_dir or cluster.default_state_dir())
    home = state_dir.parent / "control"
    report_dir = Path(args.report_dir) if args.report_dir else state_dir.parent / "report"
    clock = Clock()
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    from trainguard.emulation.standalone import Standalone

    if Standalone.stop_kept(home / "airflow"):
        clock.say("stopped the Airflow a kept demo left running")
    shutil.rmtree(home, ignore_errors=True)  # a fresh fleet database and Airflow home
    clock.say(f"bringing up the emulated cluster ({spec.machines} machines, {spec.standbys} warm standbys)")
    inv = cluster.up(spec, state_dir, log=lambda m: clock.say(f"  {m}"))
    for m in inv.machines:
        clock.say(f"  {m.name}  {m.role:8} {m.address}")
    g: GuardedJob | None = None
    keep = False
    try:
        g = GuardedJob(inv, home, job=JOB, settings=SETTINGS, port=args.port or None, train_args=DEVICE_TRAIN_ARGS)
        g.start(log=clock.say, submit=True)  # as a user submits a job: a tg_job_launch run
        clock.say(f"Airflow UI {g.airflow.url}  (user admin, password in "
                  f"{g.airflow.home / 'simple_auth_manager_passwords.json.generated'})")
        narrator = Narrator(g, clock)
        results = _play(g, faults, args, clock, narrator)
        narrator.tick()
        code = _report(g, faults, results, clock, report_dir)
        keep = args.keep
        return code
    except KeyboardInterrupt:
        clock.say("interrupted: stopping the job and Airflow, bringing the cluster down")
        raise
    finally:
        if keep and g is not None:
            clock.say(f"kept: Airflow at {g.airflow.url}, the cluster and the job; "
                      f"'trainguard cluster down' ends them all")
        else:
            if g is not None:
                g.stop()
            cluster.down(state_dir, name=spec.name, log=lambda m: None)
            clock.say("cluster down, Airflow stopped; nothing left running")


def _play(g: GuardedJob, faults: Sequence[Fault], args: argparse.Namespace, clock: Clock,
          narrator: Narrator) -> list[dict[str, Any]]:
    """Each fault at its time (or once the last was handled, when that is later); returns what
    happened to each."""
    start = time.time()
    results = []
    bad = ""  # the revision with the bug, once deployed
    for i, fault in enumerate(faults):
        if i:
            # the repair crew works right after an incident: parking warm interpreters shares these cores
            # with the job, and its load passes before the next fault comes
            g.settled()
            back = g.repair()
            if back:
                clock.say(f"repair crew: {', '.join(back)} fixed, self-checked and parked warm "
                          f"({'a standby' if len(back) == 1 else 'standbys'} again)")
        _wait(start + args.first + i * args.every, narrator)
        g.settled()
        if fault.bad_revision and g.ctl.fleet.job(JOB).revision != bad:  # no restart applied the lazy one
            bad = g.deploy_bad_revision()
            clock.say(f"deployed revision {bad} (hot update); its training loop has a bug")
        elif not fault.bad_revision and i + 1 < len(faults) and faults[i + 1].bad_revision and not bad:
            bad = g.deploy_bad_revision(lazy=True)
            clock.say(f"queued revision {bad} as a lazy update (the next restart applies it); its training loop "
                      f"has a bug")
        g.armed()
        g.training(2)
        machine = g.ctl.fleet.job(JOB).machine_list[fault.node]
        clock.say(f"FAULT {i + 1}/{len(faults)}: {fault.what} on {machine}"
                  f"{'' if fault.rank is None else f' (rank {fault.rank})'}")
        narrator.fault_ts = time.time()
        try:
            inc, machine, t_fault = g.fault_and_incident(fault, machine=machine, on_tick=narrator.tick)
        except TimeoutError as exc:
            clock.say(f"  not recovered: {exc}")
            results.append({"fault": fault.kind, "machine": machine, "t_fault": narrator.fault_ts, "incident": None})
            continue
        narrator.tick()
        results.append({"fault": fault.kind, "machine": machine, "t_fault": t_fault, "incident": inc.id})
    _wait(start + args.first + len(faults) * args.every, narrator)
    return results


def _report(g: GuardedJob, faults: Sequence[Fault], results: list[dict[str, Any]], clock: Clock,
            report_dir: Path) -> int:
    fleet = g.ctl.fleet
    as_of = time.time()  # the records are as of now: steps that end while they are read are not in them
    records = g.ctl.step_history(JOB)
    ettr = g.ctl.ettr_report(JOB, records=records, as_of=as_of)
    rows = []
    for r in results:
        inc = fleet.incident(r["incident"]) if r["incident"] else None
        row: dict[str, Any] = {"fault": r["fault"], "machine": r["machine"], "t_fault": r["t_fault"]}
        if inc is not None:
            row.update({"incident": inc.id, "state": inc.state, "category": inc.category, "summary": inc.summary,
                        "evicted": g.swaps(inc.id), "actions": [a.kind for a in fleet.actions(inc.id)],
                        "lost_steps": inc.lost_steps, "level": inc.level,
                        **{k: getattr(inc, k) for k in ("first_alert_ts", "opened_ts", "diagnosis_start_ts",
                                                        "decided_ts", "resumed_ts", "closed_ts")}})
            row["fault_to_resumed_s"] = inc.resumed_ts - r["t_fault"] if inc.resumed_ts else None
            row["phases_s"] = {name: _span(row.get(a), row.get(b)) for name, a, b, _ in PHASES}
        rows.append(row)
    recovered = [row for row in rows if row.get("state") == "resolved" and row.get("resumed_ts")]
    cum = ettr["cumulative"]
    print()
    print("=== trainguard demo: report ===")
    print(f"job {JOB} ({TOPOLOGY}, {TOPOLOGY.world_size} ranks), {cum['wall_s']:.0f} s of wall time since its "
          f"first step, {cum['kept_steps']} steps kept")
    print(f"{'#':>2} {'fault':11} {'machine':7} {'handled as':14} {'evicted -> standby':22} {'detect':>7} "
          f"{'diagnose':>8} {'recover':>8} {'to resume':>9} {'lost':>5}  outcome")
    for i, row in enumerate(rows, 1):
        ph = row.get("phases_s", {})
        swaps = ", ".join(f"{a}->{b}" for a, b in row.get("evicted", {}).items()) or "-"
        print(f"{i:>2} {row['fault']:11} {row['machine']:7} {row.get('category') or '-':14} {swaps:22} "
              f"{_s(ph.get('detection')):>7} {_s(ph.get('diagnosis')):>8} {_s(ph.get('recovery')):>8} "
              f"{_s(row.get('fault_to_resumed_s')):>9} {_n(row.get('lost_steps')):>5}  "
              f"{row.get('state', 'not handled')}")
    print(f"recovered automatically: {len(recovered)} of {len(faults)} faults")
    print(f"ETTR {cum['ettr'] * 100:.1f}%  (productive {cum['productive_s']:.1f} s of {cum['wall_s']:.1f} s; "
          f"work lost and recomputed {cum['lost_work_s']:.1f} s)")
    by_cause = ", ".join(f"{k} {v['seconds']:.1f} s" for k, v in ettr["by_cause"].items())
    if by_cause:
        print(f"time lost by cause: {by_cause}")
    report_dir.mkdir(parents=True, exist_ok=True)
    doc = {"job": JOB, "topology": str(TOPOLOGY), "faults": rows, "ettr": ettr,
           "recovered": len(recovered), "injected": len(faults),
           "steps": [{k: r.get(k) for k in ("step", "incarnation", "ts", "step_time_s", "machine")} for r in records]}
    (report_dir / "report.json").write_text(json.dumps(doc, indent=2, default=str))
    html = report_dir / "timeline.html"
    html.write_text(timeline_html(records, rows, ettr))
    print(f"timeline chart: {html}  (report.json beside it)")
    ok = len(recovered) == len(faults)
    clock.say("demo " + ("OK: every fault was recovered automatically" if ok else "FAILED: see the rows above"))
    return EXIT_OK if ok else EXIT_UNHEALTHY


def _span(a: float | None, b: float | None) -> float | None:
    return b - a if a is not None and b is not None and b >= a else None


def _s(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}s"


def _n(v: Any) -> str:
    return "?" if v is None else str(v)


def timeline_html(records: Sequence[Mapping[str, Any]], rows: Sequence[Mapping[str, Any]],
                  ettr: Mapping[str, Any]) -> str:
    """A self-contained HTML page: the job's steps over time (each incarnation its own colour, work that
    was lost and recomputed in grey), each incident's detection / diagnosis / recovery as bands, and
    each fault as a marked line."""
    from trainguard.operators.policy import ettr as ettr_policy

    execs = ettr_policy.executions(records)
    if not execs:
        return "<html><body><p>no step records</p></body></html>"
    _, lost = ettr_policy.kept(execs)
    lost_ids = {id(e) for e in lost}
    t0 = min(e.start_ts for e in execs)
    t1 = max([e.end_ts for e in execs] + [r.get("closed_ts") or 0 for r in rows])
    smax = max(e.step for e in execs) or 1
    w, h, left, top, bottom = 1000, 420, 60, 30, 60
    pw, ph = w - left - 20, h - top - bottom

    def x(ts: float) -> float:
        return left + (ts - t0) / max(t1 - t0, 1e-9) * pw

    def y(step: float) -> float:
        return top + ph - step / smax * ph

    palette = ["#2a9d8f", "#264653", "#e76f51", "#8a5a9e", "#e9c46a", "#3a86ff", "#06d6a0", "#ef476f"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="11">', f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fafafa" '
             f'stroke="#ccc"/>']
    for i, row in enumerate(rows):
        for name, a, b, colour in PHASES:
            if row.get(a) and row.get(b) and row[b] >= row[a]:
                parts.append(f'<rect x="{x(row[a]):.1f}" y="{top}" width="{max(x(row[b]) - x(row[a]), 1):.1f}" '
                             f'height="{ph}" fill="{colour}" opacity="0.25"><title>incident {row.get("incident")}: '
                             f'{name} {row[b] - row[a]:.1f}s</title></rect>')
        if row.get("t_fault"):
            fx = x(row["t_fault"])
            parts.append(f'<line x1="{fx:.1f}" y1="{top}" x2="{fx:.1f}" y2="{top + ph}" stroke="#b00" '
                         f'stroke-dasharray="4,3"/>')
            parts.append(f'<text x="{fx + 3:.1f}" y="{top + 12 + 13 * (i % 3)}" fill="#b00">{i + 1}. {row["fault"]} '
                         f'({row["machine"]})</text>')
    for e in execs:
        colour = "#aaa" if id(e) in lost_ids else palette[e.incarnation % len(palette)]
        parts.append(f'<circle cx="{x(e.end_ts):.1f}" cy="{y(e.step):.1f}" r="1.6" fill="{colour}"/>')
    for frac in (0, 0.25, 0.5, 0.75, 1):
        ts = t0 + frac * (t1 - t0)
        parts.append(f'<text x="{x(ts):.1f}" y="{top + ph + 16}" text-anchor="middle">{ts - t0:.0f}s</text>')
        parts.append(f'<text x="{left - 6}" y="{y(frac * smax) + 4:.1f}" text-anchor="end">{frac * smax:.0f}</text>')
    parts.append(f'<text x="{left + pw / 2}" y="{h - 22}" text-anchor="middle">seconds since the first step'
                 f'</text><text x="14" y="{top + ph / 2}" transform="rotate(-90 14 {top + ph / 2})" '
                 f'text-anchor="middle">step</text>')
    legend = [("detection", PHASES[0][3]), ("diagnosis", PHASES[1][3]), ("recovery", PHASES[2][3]),
              ("lost, recomputed", "#aaa")]
    for i, (name, colour) in enumerate(legend):
        parts.append(f'<rect x="{left + 150 * i}" y="{h - 14}" width="10" height="10" fill="{colour}" '
                     f'opacity="0.6"/><text x="{left + 150 * i + 14}" y="{h - 5}">{name}</text>')
    parts.append("</svg>")
    cum = ettr["cumulative"]
    rows_html = "".join(
        f"<tr><td>{i}</td><td>{r['fault']}</td><td>{r['machine']}</td><td>{r.get('category', '-')}</td>"
        f"<td>{', '.join(f'{a} &rarr; {b}' for a, b in r.get('evicted', {}).items()) or '-'}</td>"
        + "".join(f"<td>{_s(r.get('phases_s', {}).get(n))}</td>" for n, *_ in PHASES)
        + f"<td>{_s(r.get('fault_to_resumed_s'))}</td><td>{_n(r.get('lost_steps'))}</td>"
          f"<td>{r.get('state', 'not handled')}</td></tr>"
        for i, r in enumerate(rows, 1))
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>trainguard demo timeline</title>"
            f"<style>body{{font-family:sans-serif;margin:24px}}td,th{{padding:3px 10px;text-align:left}}"
            f"tr:nth-child(even){{background:#f3f3f3}}</style></head><body>"
            f"<h2>trainguard demo: ETTR {cum['ettr'] * 100:.1f}%</h2>"
            f"<p>productive {cum['productive_s']:.1f} s of {cum['wall_s']:.1f} s; {cum['kept_steps']} steps kept, "
            f"{cum['lost_steps']} executions lost and recomputed</p>{''.join(parts)}"
            f"<table><tr><th>#</th><th>fault</th><th>machine</th><th>handled as</th><th>evicted</th>"
            f"<th>detection</th><th>diagnosis</th><th>recovery</th><th>fault &rarr; resumed</th><th>steps lost</th>"
            f"<th>outcome</th></tr>{rows_html}</table></body></html>")
