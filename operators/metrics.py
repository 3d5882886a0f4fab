"""Prometheus metrics of the control plane, read from the fleet database at each scrape
(prometheus-client custom collector: no state of its own, so every Airflow process and the exporter
agree, and a restart loses nothing).

    trainguard metrics [--port 9464]      serve them (one scrape per request); without --port, print once

Metrics (``job``, ``category``, ``outcome``, ``phase``, ``state`` labels):

* ``trainguard_incidents_total``: incidents by job, category and outcome (open, resolved, failed,
  waiting_human);
* ``trainguard_incident_phase_seconds``: summary (count, sum) of detection, diagnosis and recovery
  time of closed incidents, by job and phase;
* ``trainguard_evictions_total``: machines evicted automatically or by hand, by job;
* ``trainguard_machines``: machines by state (standby, active, repair ...);
* ``trainguard_standby_pool_target``: the pool target from the fleet's failure history, and
  ``trainguard_failure_rate_per_machine_day`` the rate it comes from;
* ``trainguard_job_revision_info``: the revision each job runs (and the one pending, if any);
* ``trainguard_ettr_ratio``: each job's effective training time ratio, ``window`` "cumulative" and
  "sliding", from the newest ``tg_ettr`` report (hourly);
* ``trainguard_checkpoint_step``: each job's newest checkpoint step announced for verification
  (``state`` "announced") and newest verified one ("verified");
  ``trainguard_checkpoint_verified_age_seconds``: how old the newest verified step is (since its
  commit); ``trainguard_checkpoint_verifications_total``: verdicts by ``result`` (verified, corrupt,
  pending).
* ``trainguard_component_last_seen_timestamp_seconds``: when a part of trainguard's own control plane last
  said it is alive (``component`` "guardian": its last poll of the bus; alert when it stops advancing);
* ``trainguard_agent_heartbeat_age_seconds``: for each machine serving a running job, how long ago the
  guardian saw its agent's heartbeat change;
* ``trainguard_human_needed``: 1 for each job with an incident waiting for a human (its reason is in
  ``trainguard status`` and the incident's run note); ``trainguard_job_state``: 1 for each job's state;
* ``trainguard_alerts_quarantined``: bus documents never acted on (unknown machine or job, oversized,
  not an alert).

Agents write metrics of their own on every machine (:mod:`trainguard.node_tools.agent`: a node_exporter textfile).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily, SummaryMetricFamily
from prometheus_client.registry import Collector

from trainguard.operators import standby_pool
from trainguard.operators.fleet import FleetStore, states
from trainguard.operators.fleet.states import IncidentState

PHASES = ("detection", "diagnosis", "recovery")


class FleetCollector(Collector):
    """Every scrape reads the fleet database once."""

    def __init__(self, fleet: FleetStore, *, clock: Any = time.time) -> None:
        self.fleet = fleet
        self.clock = clock

    def collect(self) -> Iterator[Any]:
        jobs = self.fleet.jobs()
        actions = self.fleet.actions()
        incidents = CounterMetricFamily("trainguard_incidents", "Incidents by job, category and outcome",
                                        labels=["job", "category", "outcome"])
        phases = SummaryMetricFamily("trainguard_incident_phase_seconds",
                                     "Detection, diagnosis and recovery time of closed incidents",
                                     labels=["job", "phase"])
        evictions = CounterMetricFamily("trainguard_evictions", "Machines evicted, by job", labels=["job"])
        revisions = InfoMetricFamily("trainguard_job_revision", "The code revision each job runs",
                                     labels=["job"])
        for j in jobs:
            counts: dict[tuple[str, str], int] = {}
            of_job = self.fleet.incidents(j.name)
            for inc in of_job:
                key = (inc.category or "untriaged", inc.state)
                counts[key] = counts.get(key, 0) + 1
            for (category, outcome), n in sorted(counts.items()):
                incidents.add_metric([j.name, category, outcome], n)
            spans: dict[str, list[float]] = {p: [] for p in PHASES}
            for e in self.fleet.ettr_events(j.name):
                if e.kind in spans:
                    spans[e.kind].append(e.end_ts - e.start_ts)
            for phase in PHASES:
                phases.add_metric([j.name, phase], count_value=len(spans[phase]), sum_value=sum(spans[phase]))
            ids = {inc.id for inc in of_job}
            evicted = sum(len(a.machines) for a in actions if a.kind == "evict" and a.outcome == "done"
                          and a.incident_id in ids)
            evictions.add_metric([j.name], evicted)
            revisions.add_metric([j.name], {"revision": j.revision, "pending": j.pending_revision or ""})
        yield from (incidents, phases, evictions, revisions)
        yield from self._ettr(jobs, actions)
        yield from self._checkpoints(jobs)
        yield from self._liveness(jobs)

        machines = GaugeMetricFamily("trainguard_machines", "Machines by state", labels=["state"])
        by_state: dict[str, int] = dict.fromkeys(states.STATES, 0)
        for m in self.fleet.machines():
            by_state[m.state] = by_state.get(m.state, 0) + 1
        for state, n in by_state.items():
            machines.add_metric([state], n)
        yield machines

        _history, rate, _serving, target = standby_pool.sizing(self.fleet, self.clock())
        yield GaugeMetricFamily("trainguard_failure_rate_per_machine_day",
                                "Machine failures per machine-day in service (fleet history with a prior)",
                                value=rate["rate"])
        yield GaugeMetricFamily("trainguard_standby_pool_target",
                                "Standbys the pool keeps: P99 of Binomial(machines serving, daily failure rate)",
                                value=target)


    def _liveness(self, jobs: Any) -> Iterator[Any]:
        now = self.clock()
        seen = GaugeMetricFamily("trainguard_component_last_seen_timestamp_seconds",
                                 "When a part of trainguard's control plane last said it is alive (guardian: its poll)",
                                 labels=["component"])
        for name, c in sorted(self.fleet.components().items()):
            seen.add_metric([name], c.seen_ts)
        ages = GaugeMetricFamily("trainguard_agent_heartbeat_age_seconds",
                                 "Seconds since the guardian saw the heartbeat of the agent change (running jobs)",
                                 labels=["machine", "job"])
        running = {j.name for j in jobs if j.state == "running"}
        liveness = self.fleet.liveness()
        for m in self.fleet.machines(state=states.ACTIVE):
            if m.job in running and m.name in liveness:
                ages.add_metric([m.name, m.job], max(0.0, now - liveness[m.name].changed_ts))
        human = GaugeMetricFamily("trainguard_human_needed", "1 when an incident of the job waits for a human",
                                  labels=["job"])
        state = GaugeMetricFamily("trainguard_job_state", "The job's state in the fleet database (1)",
                                  labels=["job", "state"])
        for j in jobs:
            waiting = any(i.state == IncidentState.WAITING_HUMAN for i in self.fleet.incidents(j.name))
            human.add_metric([j.name], float(waiting))
            state.add_metric([j.name, j.state], 1.0)
        quarantined = CounterMetricFamily("trainguard_alerts_quarantined", "Bus documents never acted on")
        quarantined.add_metric([], len(self.fleet.quarantined()))
        yield from (seen, ages, human, state, quarantined)

    def _ettr(self, jobs: Any, actions: Any) -> Iterator[Any]:
        ratio = GaugeMetricFamily("trainguard_ettr_ratio", "Effective training time ratio (newest tg_ettr report)",
                                  labels=["job", "window"])
        newest = newest_ettr_reports(actions)
        for j in jobs:
            a = newest.get(j.name)
            if a is not None:
                ratio.add_metric([j.name, "cumulative"], float(a.evidence["cumulative"]))
                ratio.add_metric([j.name, "sliding"], float(a.evidence["sliding"]))
        yield ratio

    def _checkpoints(self, jobs: Any) -> Iterator[Any]:
        step = GaugeMetricFamily("trainguard_checkpoint_step", "Newest checkpoint step announced / verified",
                                 labels=["job", "state"])
        age = GaugeMetricFamily("trainguard_checkpoint_verified_age_seconds",
                                "Seconds since the newest verified checkpoint step was committed", labels=["job"])
        verdicts = CounterMetricFamily("trainguard_checkpoint_verifications", "Checkpoint verdicts by result",
                                       labels=["job", "result"])
        now = self.clock()
        for j in jobs:
            records = self.fleet.checkpoints(j.name)
            if not records:
                continue
            step.add_metric([j.name, "announced"], max(c.step for c in records))
            good = [c for c in records if c.verified]
            if good:
                newest = max(good, key=lambda c: c.step)
                step.add_metric([j.name, "verified"], newest.step)
                age.add_metric([j.name], max(0.0, now - newest.committed_ts))
            for result, n in (("verified", len(good)), ("corrupt", sum(c.verified is False for c in records)),
                              ("pending", sum(c.verified is None for c in records))):
                verdicts.add_metric([j.name, result], n)
        yield from (step, age, verdicts)


def registry(fleet: FleetStore) -> Any:
    from prometheus_client import CollectorRegistry

    reg = CollectorRegistry(auto_describe=False)
    reg.register(FleetCollector(fleet))
    return reg


def exposition(fleet: FleetStore) -> str:
    """One scrape, in Prometheus's text format."""
    from prometheus_client import generate_latest

    return generate_latest(registry(fleet)).decode()


def serve(fleet: FleetStore, port: int, addr: str = "127.0.0.1") -> Any:
    """Serve the metrics on ``addr:port`` (a thread of this process); returns the server."""
    from prometheus_client import start_http_server

    server, _thread = start_http_server(port, addr=addr, registry=registry(fleet))
    return server


def newest_ettr_reports(actions: Any) -> dict[str, Any]:
    """The newest ``ettr_report`` action (tg_ettr's) of each job, by job."""
    newest: dict[str, Any] = {}
    for a in actions:
        if a.kind == "ettr_report":
            job = a.key.split(":")[1]
            if job not in newest or a.started_ts >= newest[job].started_ts:
                newest[job] = a
    return newest
