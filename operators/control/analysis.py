"""Runtime analysis while the job still runs: every rank's stack in a hang (the outliers' parallel group to over-
evict) and the fail-slow vote over rounds of compute times."""

from __future__ import annotations

import threading
import time
from typing import Any

from node_tools import launcher
from operators.control.base import ControllerBase
from operators.policy import ladder, runtime


class RuntimeAnalysis(ControllerBase):
    """Evidence taken from the running (or hanging) job."""

    def analyze(self, job: str, incident_id: int | None = None) -> dict[str, Any]:
        """Stacks and collective counters of every rank, grouped; the outliers' parallel group, at least
        a pipeline (hangs and slow ranks are over-evicted by group). The incident's alerts name the
        ranks to prefer when the outliers do not fit one group: a stopped process, else the first rank
        to stall or slow down."""
        j = self.fleet.job(job)
        alerts = sorted(self.fleet.alerts_of(incident_id), key=lambda a: a.ts) if incident_id is not None else []
        claimed = sorted({a.rank for a in alerts if a.kind == "rank_stopped" and a.rank is not None})
        first = next((a.rank for a in alerts if a.kind in ("rank_hang", "rank_slow") and a.rank is not None), None)
        topo = self.topology(job)
        # scikit-learn takes seconds to import: in the background while the stacks are taken
        preload = threading.Thread(target=runtime.preload, name="preload-sklearn", daemon=True)
        preload.start()
        results = self._run(self.machines(j.machine_list),
                            lambda m: [self.inventory.tg_node, "stacks", "--job", job], timeout=60)
        preload.join()
        docs = {n: r.json() for n, r in results.items() if r.reachable and not r.timed_out and r.json()}
        # an alert saying a rank stopped is a claim; the process the stacks see is the evidence
        stopped = runtime.confirmed_stopped(claimed, docs)
        named = stopped or ([first] if first is not None else [])
        machine_of = {r: j.machine_list[topo.machine_of(r)] for r in range(topo.world_size)}
        a = runtime.analyze(topo, runtime.rank_stacks(docs, topo.world_size, machine_of), named=named,
                            kinds=("pp", "dp"), stopped=stopped)
        return {"job": job, "outliers": a.outliers, "named": named, "claimed_stopped": claimed,
                "refuted": sorted(set(claimed) - set(stopped)),
                "reasons": {str(k): v for k, v in a.reasons.items()},
                "group_kind": a.group_kind, "groups": [len(g) for g in a.groups],
                "machines": [j.machine_list[i] for i in a.evict_machines]}

    def compute_times(self, job: str) -> dict[int, float]:
        """Each rank's compute time in its last step (step time less the time spent in collectives),
        from every machine's ``tg-node job status``: one round of the fail-slow vote."""
        j = self.fleet.job(job)
        st = launcher.status(self.inventory, job, self.machines(j.machine_list), transport=self.transport)
        out: dict[int, float] = {}
        for doc in st.values():
            for r in doc.get("ranks", []):
                recent = r.get("recent_compute_s")  # the median of its last steps, when the machine says it
                if isinstance(recent, (int, float)):
                    out[int(r["rank"])] = float(recent)
                    continue
                last = r.get("last_step") or {}
                step_time, comm = last.get("step_time_s"), last.get("comm_s")
                if isinstance(step_time, (int, float)) and isinstance(comm, (int, float)):
                    out[int(r["rank"])] = max(0.0, float(step_time) - float(comm))
        return out

    def vote_slow(self, incident_id: int) -> dict[str, Any]:
        """The fail-slow vote (:class:`operators.policy.runtime.SlowVoter`): ``slow_rounds`` rounds,
        ``slow_interval_s`` apart, while the job trains. Stops early, with ``superseded``, when stronger
        alerts took the incident over. Returns the rounds, the verdict (kind and machines) or None."""
        inc = self.fleet.incident(incident_id)
        voter = runtime.SlowVoter(self.topology(inc.job), rounds=self.cfg.slow_rounds)
        j = self.fleet.job(inc.job)
        rounds: list[list[int]] = []
        while not voter.done:
            if rounds:
                time.sleep(self.cfg.slow_interval_s)  # the sampling interval of the vote
            if self.fleet.incident(incident_id).category not in ladder.WATCHED:
                return {"job": inc.job, "superseded": True, "rounds": rounds}
            rounds.append(voter.add_round(self.compute_times(inc.job), factor=self.cfg.slow_factor))
        verdict = voter.verdict()
        kind, machines = (None, []) if verdict is None else (verdict[0], [j.machine_list[i] for i in verdict[1]])
        # the verdict is claimed before anything is acted on: stronger alerts arriving from here on (the
        # job being stopped, say) cannot start a second handler on the same incident
        if not self.fleet.claim_watched(incident_id, f"vote:{incident_id}", watched=ladder.WATCHED, kind="vote",
                                        machines=machines, evidence={"rounds": rounds, "verdict": kind},
                                        detail=f"{kind or 'no'} group flagged in most of {len(rounds)} rounds"):
            return {"job": inc.job, "superseded": True, "rounds": rounds}
        return {"job": inc.job, "rounds": rounds, "verdict": kind, "machines": machines}

