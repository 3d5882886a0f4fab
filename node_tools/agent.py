"""``tg-node agent``: the daemon on every machine that turns check findings into alerts.

Each check runs on its own interval (``trainguard.node_tools.checks``). A finding whose
condition was not active before becomes one alert on the bus; the agent says
nothing more about it until the condition clears and returns. Network findings
follow the rule "a fault only when repeated": the first occurrence is published
as a warning, a second within ``network_window_s`` (default 2 in 5 min) as a
fault. A check that raises is recorded in the status file and retried at its
next interval; it never stops the agent. Alerts that cannot be published (bus
unreachable) wait in a bounded outbox and are retried. Alerts made together (the
ranks of this machine timing out at once, an outbox flushed after an outage) are
published as one batch document (:meth:`trainguard.node_tools.bus.AlertBus.publish_batch`), so
an NCCL hang across a fleet puts one object per machine on the bus, not one per
rank; a lone alert is published as a single-alert document, as before.

Every ``heartbeat_every_s`` (2 s) the agent rewrites its machine's heartbeat on the
bus (:meth:`trainguard.node_tools.bus.AlertBus.beat`: a sequence number, its pid, when it
started). The control plane watches those documents *change* on its own clock: an
agent that stops, hangs or loses the bus goes silent, and a silent agent on a
machine of a running job is an incident of its own (``agent_silent``).

The agent only reads files and /proc; it never blocks or signals the training
job. ``tg-node agent --supervise`` runs it under a supervisor that restarts it
when it dies, with a growing back-off.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.node_tools import __version__, monitor
from trainguard.node_tools.alerts import MAX_BATCH_ALERTS, NOTICE_KINDS, Alert
from trainguard.node_tools.bus import NOTICES, AlertBus, BusError, open_bus
from trainguard.node_tools.checks import (
    Check,
    CheckpointCheck,
    DiskCheck,
    Finding,
    GpuCheck,
    KernelLogCheck,
    NicCheck,
)
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.nvml import NvmlUnavailable, backend_for
from trainguard.node_tools.rankcheck import RankCheck

NETWORK_KINDS = ("nic_down", "nic_errors", "kernel_link")
METRICS_FILE = "metrics.prom"  # beside the status file
METRICS_EVERY_S = 15.0


@dataclass
class AgentSettings:
    """Knobs of the agent. Intervals in seconds.

    Attributes:
        network_repeats: occurrences of a network finding within ``network_window_s``
            that make it a fault (fewer are published as warnings).
        network_window_s: the window of that rule.
        outbox_max: alerts kept for retry while the bus is unreachable.
        status_every_s: how often the status file is rewritten.
        heartbeat_every_s: how often the agent's heartbeat on the bus is rewritten (0: never).
        intervals: per-check interval overrides, by check name.
    """

    network_repeats: int = 2
    network_window_s: float = 300.0
    outbox_max: int = 1000
    status_every_s: float = 1.0
    heartbeat_every_s: float = 2.0
    intervals: dict[str, float] = field(default_factory=dict)


def default_checks(cfg: NodeConfig, *, kernel_from_start: bool = False) -> tuple[list[Check], list[str]]:
    """The checks this machine can run, and notes on those it cannot."""
    checks: list[Check] = [RankCheck(cfg.workdir), DiskCheck(cfg.workdir), CheckpointCheck(cfg.workdir)]
    notes = []
    checks.append(KernelLogCheck(cfg.kmsg_path or Path("/dev/kmsg"), from_start=kernel_from_start))
    if cfg.iface and cfg.iface != "lo":
        checks.append(NicCheck(cfg.iface))
    try:
        backend = backend_for(cfg)
    except NvmlUnavailable as exc:
        backend, notes = None, [f"gpu: {exc}"]
    if backend is not None:
        checks.append(GpuCheck(backend, expected=cfg.gpus))
    elif cfg.gpus:
        notes.append(f"gpu: no NVML backend, {cfg.gpus} GPUs expected but not watched")
    return checks, notes


class Agent:
    def __init__(self, cfg: NodeConfig, bus: AlertBus, checks: list[Check], *,
                 settings: AgentSettings | None = None, status_path: Path | None = None,
                 notes: list[str] | None = None, notices: AlertBus | None = None) -> None:
        self.cfg = cfg
        self.bus = bus
        self.notices = notices or bus  # where notice kinds go (the bus's notices folder)
        self.checks = checks
        self.settings = settings or AgentSettings()
        for c in checks:
            c.interval_s = self.settings.intervals.get(c.name, c.interval_s)
        self.status_path = status_path
        self.notes = notes or []
        self.next_due = {c.name: 0.0 for c in checks}
        self.active: dict[str, dict[str, Any]] = {}
        self.network_seen: dict[str, deque] = {}
        self.outbox: deque[Alert] = deque(maxlen=self.settings.outbox_max)
        self.errors: dict[str, str] = {}
        self.published = 0
        self.published_by_kind: dict[str, int] = {}
        self.started = time.time()
        self.beats = 0
        self._beat_at = 0.0  # monotonic time of the next heartbeat
        self._status_written = 0.0
        self._metrics_written = 0.0
        self._stop = threading.Event()

    # ---- one pass -------------------------------------------------------------------------
    def tick(self, now: float | None = None) -> list[Alert]:
        """Run the checks that are due; publish what is new. Returns the alerts made."""
        now = time.time() if now is None else now
        made: list[Alert] = []
        for check in self.checks:
            if now < self.next_due[check.name]:
                continue
            self.next_due[check.name] = now + check.interval_s
            try:
                findings = check.run(now)
                self.errors.pop(check.name, None)
            except Exception as exc:  # a broken check must not stop the others
                self.errors[check.name] = f"{type(exc).__name__}: {exc}"[:500]
                continue
            made += self._diff(check.name, findings, now)
        for alert in made:
            self.outbox.append(alert)
        self._flush_outbox()
        self._beat(now)
        if now - self._status_written >= self.settings.status_every_s:
            self.write_status(now)
        return made

    def _diff(self, check: str, findings: list[Finding], now: float) -> list[Alert]:
        made = []
        present = set()
        for f in findings:
            present.add(f.key)
            severity = f.severity
            if f.kind in NETWORK_KINDS:
                # history per kind and link, so separate events on one link count as repeats
                seen = self.network_seen.setdefault(f"{f.kind}:{f.evidence.get('iface', '')}", deque())
                seen.append(now)
                while seen and now - seen[0] > self.settings.network_window_s:
                    seen.popleft()
                repeated = len(seen) >= self.settings.network_repeats
                severity = "fault" if repeated else "warning"
                prev = self.active.get(f.key)
                if prev is not None and (prev["severity"] == "fault" or not repeated):
                    continue
            elif f.key in self.active:
                continue
            self.active[f.key] = {"check": check, "kind": f.kind, "since": now, "severity": severity,
                                  "message": f.message}
            made.append(Alert(kind=f.kind, machine=self.cfg.machine, severity=severity, job=f.job, rank=f.rank,
                              ts=now, evidence=dict(f.evidence, message=f.message)))
        for key in [k for k, v in self.active.items() if v["check"] == check and k not in present]:
            del self.active[key]
        return made

    def _beat(self, now: float) -> None:
        """Rewrite this machine's heartbeat on the bus when it is due (the agent's own monotonic clock)."""
        every = self.settings.heartbeat_every_s
        mono = time.monotonic()
        if not every or mono < self._beat_at:
            return
        self._beat_at = mono + every
        try:
            self.bus.beat(self.cfg.machine, {"machine": self.cfg.machine, "seq": self.beats + 1, "pid": os.getpid(),
                                             "started_ts": self.started, "ts": now, "agent_version": __version__})
        except BusError as exc:
            self.errors["heartbeat"] = str(exc)[:500]
            return
        self.errors.pop("heartbeat", None)
        self.beats += 1

    def _flush_outbox(self) -> None:
        """Publish the outbox in order; alerts waiting together for the same folder go as one batch document
        (the ranks of this machine timing out at once are one object on the bus, not one each)."""
        while self.outbox:
            notice = self.outbox[0].kind in NOTICE_KINDS
            group = []
            for alert in itertools.islice(self.outbox, MAX_BATCH_ALERTS):
                if (alert.kind in NOTICE_KINDS) != notice:
                    break
                group.append(alert)
            try:
                _name, count = (self.notices if notice else self.bus).publish_batch(group)
            except BusError as exc:
                self.errors["bus"] = str(exc)[:500]
                return
            self.errors.pop("bus", None)
            for _ in range(count):
                alert = self.outbox.popleft()
                self.published += 1
                self.published_by_kind[alert.kind] = self.published_by_kind.get(alert.kind, 0) + 1

    # ---- status -----------------------------------------------------------------------------
    def status(self, now: float | None = None) -> dict[str, Any]:
        now = time.time() if now is None else now
        return {
            "machine": self.cfg.machine,
            "agent_version": __version__,
            "pid": os.getpid(),
            "started_ts": self.started,
            "ts": now,
            "bus": self.bus.url,
            "checks": {c.name: {"interval_s": c.interval_s, "error": self.errors.get(c.name)} for c in self.checks},
            "active": self.active,
            "published": self.published,
            "heartbeats": self.beats,
            "outbox": len(self.outbox),
            "bus_error": self.errors.get("bus"),
            "notes": self.notes,
        }

    def write_status(self, now: float) -> None:
        self._status_written = now
        if self.status_path is None:
            return
        with contextlib.suppress(OSError):
            self.status_path.parent.mkdir(parents=True, exist_ok=True)
            monitor.write_json_atomic(self.status_path, self.status(now))
            if now - self._metrics_written >= METRICS_EVERY_S:  # a scrape interval, not every status write
                self._metrics_written = now
                self.write_metrics(self.status_path.with_name(METRICS_FILE), now)

    def write_metrics(self, path: Path, now: float) -> None:
        """The agent's Prometheus metrics as a node_exporter textfile (``--collector.textfile.directory``
        pointed at the agent's folder publishes them with the machine's other metrics)."""
        from prometheus_client import CollectorRegistry, write_to_textfile

        reg = CollectorRegistry(auto_describe=False)
        reg.register(_AgentCollector(self, now))  # type: ignore[arg-type]
        write_to_textfile(str(path), reg)

    # ---- the loop ---------------------------------------------------------------------------
    def stop(self) -> None:
        self._stop.set()

    def run_forever(self) -> None:
        while not self._stop.is_set():
            self.tick()
            wait = min(self.next_due.values()) - time.time()
            if self.settings.heartbeat_every_s:
                wait = min(wait, self._beat_at - time.monotonic())
            self._stop.wait(max(0.01, min(wait, 1.0)))
        self.write_status(time.time())


class _AgentCollector:
    """One scrape of an agent's state (see :meth:`Agent.write_metrics`)."""

    def __init__(self, agent: Agent, now: float) -> None:
        self.agent, self.now = agent, now

    def collect(self) -> Any:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        a, m = self.agent, self.agent.cfg.machine
        published = CounterMetricFamily("trainguard_agent_alerts_published", "Alerts and notices published",
                                        labels=["machine", "kind"])
        for kind, n in sorted(a.published_by_kind.items()):
            published.add_metric([m, kind], n)
        active = GaugeMetricFamily("trainguard_agent_active_findings", "Conditions that hold now",
                                   labels=["machine", "kind"])
        kinds: dict[str, int] = {}
        for v in a.active.values():
            kinds[v["kind"]] = kinds.get(v["kind"], 0) + 1
        for kind, n in sorted(kinds.items()):
            active.add_metric([m, kind], n)
        failing = GaugeMetricFamily("trainguard_agent_check_failing", "1 when a check raised at its last run",
                                    labels=["machine", "check"])
        for c in a.checks:
            failing.add_metric([m, c.name], 1.0 if a.errors.get(c.name) else 0.0)
        outbox = GaugeMetricFamily("trainguard_agent_outbox", "Alerts waiting for the bus", labels=["machine"])
        outbox.add_metric([m], len(a.outbox))
        tick = GaugeMetricFamily("trainguard_agent_last_status_timestamp_seconds",
                                 "When the agent last wrote its status", labels=["machine"])
        tick.add_metric([m], self.now)
        yield from (published, active, failing, outbox, tick)


def status_path(cfg: NodeConfig) -> Path:
    return cfg.status_path or (cfg.workdir / "agent" / "status.json")


def build(cfg: NodeConfig) -> Agent:
    if not cfg.bus_url:
        from trainguard.core.errors import TrainguardError

        raise TrainguardError(f"machine {cfg.machine}: no alert bus configured (bus_url in its node config)")
    checks, notes = default_checks(cfg)
    settings = AgentSettings(intervals=dict(cfg.agent_intervals or {}))
    return Agent(cfg, open_bus(cfg.bus_url), checks, settings=settings, status_path=status_path(cfg), notes=notes,
                 notices=open_bus(cfg.bus_url, folder=NOTICES))


def run(cfg: NodeConfig) -> int:
    agent = build(cfg)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: agent.stop())
    agent.run_forever()
    return 0


def _supervisor_file(cfg: NodeConfig) -> Path:
    return status_path(cfg).with_name("supervisor.json")


def supervise(cfg: NodeConfig, *, max_backoff_s: float = 30.0) -> int:
    """Run the agent in a child process and restart it whenever it dies. ``supervisor.json`` beside the
    status file names the supervisor's and the agent's pids (what :func:`processes` and :func:`restart`
    look at)."""
    stopping = threading.Event()
    child: list[subprocess.Popen[bytes]] = []

    def on_signal(*_: Any) -> None:
        stopping.set()
        if child and child[0].poll() is None:
            child[0].terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    backoff, restarts, code = 1.0, 0, None
    log = _supervisor_file(cfg)
    while not stopping.is_set():
        started = time.monotonic()
        proc = subprocess.Popen([sys.executable, "-m", "trainguard.node_tools.cli", "agent"])
        child[:] = [proc]
        with contextlib.suppress(OSError):
            log.parent.mkdir(parents=True, exist_ok=True)
            monitor.write_json_atomic(log, {"pid": os.getpid(), "agent_pid": proc.pid, "restarts": restarts,
                                            "last_exit": code, "ts": time.time()})
        code = proc.wait()
        if stopping.is_set():
            break
        restarts += 1
        backoff = 1.0 if time.monotonic() - started > 60 else min(max_backoff_s, backoff * 2)
        stopping.wait(backoff)
    return 0


def _process(pid: Any, marker: str) -> dict[str, Any]:
    """``{"pid", "state"}`` of a process of ours: running, stopped (SIGSTOP, traced), or gone (also when the
    pid now belongs to something that is not the agent)."""
    from trainguard.core import procs

    if not isinstance(pid, int) or pid <= 0:
        return {"pid": None, "state": "gone"}
    state = procs.proc_state(pid)
    if state is None or state in ("Z", "X") or marker not in "\0".join(procs.cmdline(pid)):
        return {"pid": pid, "state": "gone"}
    return {"pid": pid, "state": "stopped" if state in ("T", "t") else "running"}


def processes(cfg: NodeConfig) -> dict[str, Any]:
    """The agent's processes as the kernel sees them (not as their files say): the supervisor's and the
    agent's pid and state (running, stopped, gone), and the age of the agent's status file."""
    sup: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        sup = json.loads(_supervisor_file(cfg).read_text())
    status: dict[str, Any] = {}
    with contextlib.suppress(OSError, ValueError):
        status = json.loads(status_path(cfg).read_text())
    agent_pid = status.get("pid") if isinstance(status.get("pid"), int) else sup.get("agent_pid")
    out = {"supervisor": _process(sup.get("pid"), "--supervise"), "agent": _process(agent_pid, "agent"),
           "status_age_s": round(time.time() - float(status.get("ts", 0)), 3) if status else None}
    states = (out["supervisor"]["state"], out["agent"]["state"])
    out["state"] = "stopped" if "stopped" in states else "running" if states == ("running", "running") else \
        "gone" if states == ("gone", "gone") else "degraded"
    return out


def restart(cfg: NodeConfig, *, wait_s: float = 10.0) -> dict[str, Any]:
    """Get a stuck agent going again: a stopped supervisor is continued, the agent process (stopped, hung
    or gone) is killed so that its supervisor starts a fresh one; without a supervisor, one is started.
    Returns :func:`processes` before and after (``after`` once the new agent wrote its status, or after
    ``wait_s``)."""
    before = processes(cfg)
    sup, agent = before["supervisor"], before["agent"]
    if sup["state"] == "stopped":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(sup["pid"], signal.SIGCONT)
    if agent["state"] != "gone":
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(agent["pid"], signal.SIGCONT)
            os.kill(agent["pid"], signal.SIGKILL)
    started = None
    if sup["state"] == "gone":
        started = subprocess.Popen([sys.executable, "-m", "trainguard.node_tools.cli", "agent", "--supervise"],
                                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                   start_new_session=True).pid
    deadline = time.monotonic() + wait_s
    after = processes(cfg)
    while time.monotonic() < deadline:
        after = processes(cfg)
        if after["state"] == "running" and after["agent"]["pid"] != agent["pid"] and \
                (after["status_age_s"] or 99.0) < 2.0:
            break
        time.sleep(0.1)
    return {"machine": cfg.machine, "before": before, "after": after, "started_supervisor": started,
            "restarted": after["state"] == "running" and after["agent"]["pid"] != agent["pid"]}


def check_once(cfg: NodeConfig, group: str = "all") -> tuple[int, dict[str, Any]]:
    """Run the checks of ``group`` once: (exit code, report). 0 healthy, 1 a fault found."""
    from trainguard.core.errors import EXIT_OK, EXIT_UNHEALTHY

    checks, notes = default_checks(cfg, kernel_from_start=True)
    if group != "all":
        checks = [c for c in checks if c.group == group]
    findings: list[Finding] = []
    errors = {}
    now = time.time()
    for c in checks:
        try:
            findings += c.run(now)
        except Exception as exc:
            errors[c.name] = f"{type(exc).__name__}: {exc}"[:500]
    faults = [f for f in findings if f.severity == "fault"]
    report = {"machine": cfg.machine, "group": group, "healthy": not faults and not errors,
              "checks": [c.name for c in checks], "findings": [f.as_dict() for f in findings],
              "errors": errors, "notes": notes}
    return (EXIT_OK if report["healthy"] else EXIT_UNHEALTHY), report


def read_status(cfg: NodeConfig) -> dict[str, Any]:
    path = status_path(cfg)
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        from trainguard.core.errors import TrainguardError

        raise TrainguardError(f"machine {cfg.machine}: the agent has written no status yet ({path})") from None
    except (OSError, ValueError):
        return {"error": f"status file {path} unreadable", "trace": traceback.format_exc(limit=1)}
    doc["age_s"] = round(time.time() - doc.get("ts", 0), 3)
    sup = path.with_name("supervisor.json")
    with contextlib.suppress(OSError, ValueError):
        doc["supervisor"] = json.loads(sup.read_text())
    return doc
