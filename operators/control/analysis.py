"""Runtime analysis while the job still runs: every rank's stack in a hang (the outliers' parallel group to over-
evict) and the fail-slow vote over rounds of compute times."""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.node_tools import launcher, monitor
from trainguard.operators.control.base import Part
from trainguard.operators.policy import ladder, runtime


class Analysis(Part):
    """Evidence taken from the running (or hanging) job."""

    def analyze(self, job: str, incident_id: int | None = None) -> dict[str, Any]:
        """Stacks and collective counters of every rank, grouped; the outliers' parallel group, at least
        a pipeline (hangs and slow ranks are over-evicted by group). The incident's alerts name the
        ranks to prefer when the outliers do not fit one group: a stopped process, else the first rank
        to stall or slow down."""
        j = self.fleet.job(job)
        # the claims of stopped ranks, and the first rank to stall or slow down (the incident of a hang may hold
        # an alert from every rank: only these are read)
        stops = self.fleet.alerts_of(incident_id, kinds={"rank_stopped"}) if incident_id is not None else []
        claimed = sorted({a.rank for a in stops if a.rank is not None})
        firsts = [] if incident_id is None else \
            self.fleet.alerts_of(incident_id, kinds={"rank_hang", "rank_slow"}, limit=64)  # oldest first
        first = next((a.rank for a in firsts if a.rank is not None), None)
        topo = j.topology
        results = self.transport.run_many(self.inventory.named(j.machine_list),
                                          lambda m: [self.inventory.tg_node, "stacks", "--job", job], timeout=60)
        docs = {n: r.json() for n, r in results.items() if r.reachable and not r.timed_out and r.json()}
        # an alert saying a rank stopped is a claim; the process the stacks see is the evidence
        stopped = runtime.confirmed_stopped(claimed, docs)
        named = stopped or ([first] if first is not None else [])
        machine_of = {r: j.machine_list[topo.machine_of(r)] for r in range(topo.world_size)}
        a = runtime.analyze(topo, runtime.rank_stacks(docs, topo.world_size, machine_of), named=named,
                            kinds=("pp", "dp"), stopped=stopped)
        # the steps the stall was reported at, against the steps the ranks are at now
        passed = runtime.stall_passed({k: v for doc in docs.values() for k, v in (doc.get("steps") or {}).items()},
                                      [ev.get("step") for a in firsts if a.kind == "rank_hang"
                                       for ev in [(a.document or {}).get("evidence")] if isinstance(ev, dict)],
                                      topo.world_size)
        return {"job": job, "outliers": a.outliers, "named": named, "claimed_stopped": claimed, "passed": passed,
                "refuted": sorted(set(claimed) - set(stopped)),
                "reasons": {str(k): v for k, v in a.reasons.items()},
                "group_kind": a.group_kind, "groups": [len(g) for g in a.groups],
                "machines": [j.machine_list[i] for i in a.evict_machines],
                # the machines of the outlier ranks: swapped first when the pool cannot take the whole group
                "culprits": list(dict.fromkeys(machine_of[r] for r in sorted(a.outliers)))}

    def compute_times(self, job: str) -> dict[int, float]:
        """Each rank's recent compute time (step time less the time spent in collectives), from every machine's
        ``tg-node job status``: one round of the fail-slow vote."""
        return self.compute_round(job)["times"]

    def compute_round(self, job: str) -> dict[str, dict[int, float]]:
        """One round of the fail-slow vote: ``times`` (rank -> its recent compute time, the median of its steps
        of the last seconds, as its machine measured it; else its last step's), ``noise`` (rank -> the standard
        error of that median: its steps' spread over the root of their count) and ``walls`` (rank -> the median
        of those steps' own times; both absent when the machine did not say), from every machine's
        ``tg-node job status``."""
        j = self.fleet.job(job)
        st = launcher.status(self.inventory, job, self.inventory.named(j.machine_list), transport=self.transport)
        times: dict[int, float] = {}
        noise: dict[int, float] = {}
        walls: dict[int, float] = {}
        for doc in st.values():
            for r in doc.get("ranks", []):
                recent = r.get("recent_compute_s")  # the median of its last steps, when the machine says it
                if isinstance(recent, (int, float)):
                    times[int(r["rank"])] = float(recent)
                    wall = r.get("recent_step_s")
                    if isinstance(wall, (int, float)):
                        walls[int(r["rank"])] = float(wall)
                    spread, n = r.get("recent_compute_spread_s"), r.get("recent_steps")
                    if isinstance(spread, (int, float)) and isinstance(n, int) and n > 0:
                        noise[int(r["rank"])] = float(spread) / math.sqrt(n)
                    continue
                last = r.get("last_step") or {}
                compute = monitor.step_compute(last)  # its local part, as the recent figures of the others
                if math.isfinite(compute):
                    times[int(r["rank"])] = max(0.0, compute)
        return {"times": times, "noise": noise, "walls": walls}

    def vote_round(self, incident_id: int) -> dict[str, Any]:
        """One round of the fail-slow vote: each rank's recent compute time (``times``, rank -> seconds) and the
        noise of that figure (``noise``), or ``superseded`` when stronger alerts took the incident over meanwhile
        (its category is no longer a watched one). The rounds are taken ``slow_interval_s`` apart: by
        :meth:`vote_slow` here, by the vote's trigger in Airflow (no worker held between them)."""
        inc = self.fleet.incident(incident_id)
        if inc.category not in ladder.WATCHED:
            return {"superseded": True}
        taken = self.compute_round(inc.job)
        return {"times": {str(r): t for r, t in taken["times"].items()},
                "noise": {str(r): round(n, 9) for r, n in taken["noise"].items()},
                "walls": {str(r): w for r, w in taken["walls"].items()}}

    def vote_verdict(self, incident_id: int, rounds: Sequence[Mapping[str, Any]], *,
                     superseded: bool = False) -> dict[str, Any]:
        """The vote's verdict over its rounds (:class:`trainguard.operators.policy.runtime.SlowVoter`: the smallest
        group holding the ranks flagged in most rounds), claimed on the incident before anything is acted on, so
        that stronger alerts arriving from here on (the job being stopped, say) cannot start a second
        handler; ``superseded`` when they came first. Returns the rounds (the ranks flagged in each), the
        verdict's kind and machines."""
        inc = self.fleet.incident(incident_id)
        j = self.fleet.job(inc.job)
        voter = runtime.SlowVoter(j.topology, rounds=max(1, len(rounds)))
        flagged = []
        for one in rounds:  # a round: {"times", "noise", "walls"} (or, as recorded before, the times alone)
            times, noise = (one["times"], one.get("noise") or {}) if "times" in one else (one, {})
            walls = one.get("walls") or {} if "times" in one else {}
            flagged.append(voter.add_round({int(r): float(t) for r, t in times.items()}, factor=self.cfg.slow_factor,
                                           noise={int(r): float(n) for r, n in noise.items()},
                                           walls={int(r): float(w) for r, w in walls.items()}))
        if superseded:
            return {"job": inc.job, "superseded": True, "rounds": flagged}
        verdict = voter.verdict()
        kind, machines = (None, []) if verdict is None else (verdict[0], [j.machine_list[i] for i in verdict[1]])
        if not self.fleet.claim_watched(incident_id, f"vote:{incident_id}", watched=ladder.WATCHED, kind="vote",
                                        machines=machines, evidence={"rounds": flagged, "verdict": kind},
                                        detail=f"{kind or 'no'} group flagged in most of {len(flagged)} rounds"):
            return {"job": inc.job, "superseded": True, "rounds": flagged}
        return {"job": inc.job, "rounds": flagged, "verdict": kind, "machines": machines}

    def vote_slow(self, incident_id: int) -> dict[str, Any]:
        """The fail-slow vote in one call: ``slow_rounds`` rounds (:meth:`vote_round`), ``slow_interval_s``
        apart, while the job trains, then the verdict (:meth:`vote_verdict`); stops early, with
        ``superseded``, when stronger alerts took the incident over."""
        rounds: list[dict[str, Any]] = []
        while len(rounds) < self.cfg.slow_rounds:
            if rounds:
                time.sleep(self.cfg.slow_interval_s)  # the sampling interval of the vote
            taken = self.vote_round(incident_id)
            if taken.get("superseded"):
                return self.vote_verdict(incident_id, rounds, superseded=True)
            rounds.append(taken)
        return self.vote_verdict(incident_id, rounds)
