"""The discrete-event simulation of one training job over simulated months, its response computed by the
control plane's own policy code.

Time advances from event to event (a heap of failure events: the next random failure of the job's machines,
and faults left in place that show again), never by ticking. Failures strike while the job trains (a
stopped job's machines fail too, but a failure found at the next start is one more of the same incidents).
Each incident goes through what ``tg_incident`` runs, with the simulator standing in for the machines:

* the alerts the node agent would raise -> :func:`trainguard.operators.policy.ladder.assess` (the same triage and first
  decision the triage task records; the escalation level from :func:`~trainguard.operators.policy.ladder.
  escalation_level`, the clock the simulated one);
* a stop-time diagnosis's verdict -> :func:`~trainguard.operators.policy.ladder.decide` again, as the rung does;
* a hang -> :func:`trainguard.operators.policy.runtime.analyze` over every rank's (synthetic) stack, which chooses the
  parallel group to over-evict; a throughput decline -> :class:`~trainguard.operators.policy.runtime.SlowVoter`;
  silent corruption -> :func:`trainguard.operators.policy.sdc.plan_replay` and
  :func:`~trainguard.operators.policy.sdc.culprits`;
* every eviction through :func:`~trainguard.operators.policy.ladder.breaker`; standbys from a pool sized by
  :func:`trainguard.operators.policy.pool.pool_target` on :func:`~trainguard.operators.policy.pool.failure_rate` of
  the simulated history and refilled by :func:`~trainguard.operators.policy.pool.plan_pool` on the pool job's
  10-minute schedule (which retires repeat offenders);
* manual code changes through :func:`trainguard.operators.policy.code.plan_update` (urgent: now; lazy: at the next
  restart, or when :func:`~trainguard.operators.policy.code.lazy_due`).

How long each phase takes comes from a :class:`~trainguard.operators.sim.model.Profile`. The ledger follows Meta's
ETTR: productive time is training time less the work lost to a restore and less checkpoint writes.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any

from trainguard.core.topology import Topology
from trainguard.operators.policy import code, degrade, ladder, pool, runtime, sdc
from trainguard.operators.settings import ControlSettings
from trainguard.operators.sim.model import DAY_S, FailureKind, FailureModel, Profile, SimError

JOB = "sim"
WEEK_S = 7 * DAY_S
POOL_PERIOD_S = 600.0  # tg_standby_pool's default schedule (*/10 * * * *)
PHASES = ("detection", "diagnosis", "restart", "restore", "swap", "wait_machine", "lost_work", "human",
          "hot_update", "checkpoint", "quorum", "degraded")
_DEFAULTS = ControlSettings.model_fields


def _setting(name: str) -> Any:
    return _DEFAULTS[name].default


@dataclass(frozen=True)
class Knobs:
    """What the sensitivity table varies. ``pool_size``: a fixed standby target instead of the policy's;
    ``checkpoint_interval_s``: instead of every step; ``detect_scale``/``restart_scale``: multiply those
    phases (the swap and the hot update are restarts too); ``phase_scale``: multiply any ledger phase's cost
    (what-if for one phase); ``degrade``: faults confined to a few data-parallel replicas are trained through on
    the others (:func:`trainguard.operators.policy.degrade.plan`), no fewer than ``min_replicas`` of them."""

    pool_size: int | None = None
    checkpoint_interval_s: float | None = None
    detect_scale: float = 1.0
    restart_scale: float = 1.0
    phase_scale: tuple[tuple[str, float], ...] = ()
    degrade: bool = False
    min_replicas: int = 1


@dataclass
class Result:
    gpus: int
    machines: int
    days: float
    profile: str
    ettr: float
    weeks: list[float]
    by_cause: dict[str, float]
    by_phase: dict[str, float]
    incidents: dict[str, int]
    actions: dict[str, int]
    evictions: dict[str, int]
    pool: dict[str, Any]
    pool_series: list[tuple[float, int]] = field(default_factory=list)
    degrade: bool = False

    def as_dict(self) -> dict[str, Any]:
        hours = {k: round(v / 3600, 3) for k, v in sorted(self.by_cause.items(), key=lambda kv: -kv[1])}
        return {"gpus": self.gpus, "machines": self.machines, "days": self.days, "profile": self.profile,
                "degrade": self.degrade, "ettr": round(self.ettr, 5), "ettr_weekly": [round(w, 5) for w in self.weeks],
                "unproductive_h": {"by_cause": hours,
                                   "by_phase": {k: round(v / 3600, 3) for k, v in self.by_phase.items()}},
                "incidents": self.incidents, "actions": self.actions, "evictions": self.evictions, "pool": self.pool}


class Simulation:
    """One job of ``gpus`` GPUs (machines of the model's GPUs each) in a TP x PP x DP layout, for ``days``."""

    def __init__(self, model: FailureModel, prof: Profile, *, gpus: int, days: float, tp: int = 8, pp: int = 8,
                 seed: int = 0, knobs: Knobs | None = None) -> None:
        gpm = model.gpus_per_machine
        if gpus < gpm or gpus % gpm:
            raise SimError(f"--gpus {gpus} must be a positive multiple of {gpm} (GPUs per machine)")
        if days <= 0:
            raise SimError(f"--days {days} must be above 0")
        machines = gpus // gpm
        if tp != gpm or machines % pp:
            raise SimError(f"layout TP={tp} PP={pp} does not fit {machines} machines of {gpm} GPUs: TP must be {gpm} "
                           f"(one machine) and PP must divide {machines}")
        self.model, self.prof, self.knobs = model, prof, knobs or Knobs()
        self.topo = Topology(tp, pp, machines // pp, ranks_per_machine=gpm)
        self.n, self.horizon, self.rng = machines, days * DAY_S, random.Random(seed)  # noqa: S311 (a simulation, not a secret)
        self.interval = self.knobs.checkpoint_interval_s or prof.step_s
        # one checkpoint's cost on the step (Meta's w: ETTR / (1 + w / interval))
        self.write_s = prof.checkpoint_overhead * prof.step_s * dict(self.knobs.phase_scale).get("checkpoint", 1.0)
        shares = model.shares()
        self.kinds = {k.name: k for k in model.kinds}
        self.kind_names, self.kind_weights = list(shares), list(shares.values())
        failure_rate = model.rate_per_machine_day / DAY_S
        w, m = model.weak_machine_share, model.weak_rate_multiplier
        self.rate_normal = failure_rate / (1 - w + w * m)
        self.rate_weak = self.rate_normal * m
        self.manual_rate = (model.rate_per_machine_day * machines / DAY_S) * model.manual_share / (
            1 - model.manual_share)
        # the job's machines: names by slot (node rank), who is weak, and an index to draw from each class
        self.serial = 0
        self.names: list[str] = []
        self.weak: dict[str, bool] = {}
        self.slot: dict[str, int] = {}
        self.weak_slots: list[int] = []
        for i in range(machines):
            name = self._fresh()
            self.names.append(name)
            self.slot[name] = i
            if self.weak[name]:
                self.weak_slots.append(i)
        self.since: dict[str, float] = dict.fromkeys(self.names, 0.0)  # in service since
        # control-plane state the policy reads
        self.last_level: int | None = None
        self.last_end: float | None = None
        self.last_category: str | None = None
        self.last_machines: tuple[str, ...] = ()
        self.last_replicas: tuple[int, ...] | None = None  # a degraded recovery's replicas (None: the whole job)
        self.net_history: deque[dict[str, Any]] = deque(maxlen=64)
        self.evicted_log: deque[tuple[float, str]] = deque()  # (ts, machine) evictions, for breaker/pool
        self.eviction_count: Counter[str] = Counter()
        self.past_events: list[pool.Event] = []
        self.standbys: list[pool.Standby] = []
        self.coming: list[tuple[float, str]] = []
        self.free: deque[str] = deque()
        self.repairing: list[tuple[float, str]] = []
        self.retired: set[str] = set()
        self.target = 0
        self.target_day = -1
        self.pool_dirty = True
        self.pool_tick = 0.0
        self.pending_since: float | None = None  # a lazy code update waiting for a restart
        self.revision = 0
        self.left: dict[str, str] = {}  # faulty machines left in the job -> their fault kind
        # ledger
        self.weeks_prod = [0.0] * (math.ceil(self.horizon / WEEK_S) or 1)
        self.by_cause: Counter[str] = Counter()
        self.by_phase: Counter[str] = Counter()
        self.incidents: Counter[str] = Counter()
        self.actions: Counter[str] = Counter()
        self.evictions: Counter[str] = Counter()
        self.waits = 0
        self.short_machines = 0
        self.pool_series: list[tuple[float, int]] = []
        self.pool_area = 0.0
        self.pool_empty_s = 0.0
        self.pool_last = (0.0, 0)
        self.replay_plan: sdc.ReplayPlan | None = None

    # ---- machines -----------------------------------------------------------------------------------
    def _fresh(self) -> str:
        self.serial += 1
        name = f"m{self.serial:05d}"
        self.weak[name] = self.rng.random() < self.model.weak_machine_share
        return name

    def _total_rate(self) -> float:
        k = len(self.weak_slots)
        return k * self.rate_weak + (self.n - k) * self.rate_normal

    def _draw_machine(self) -> int:
        k = len(self.weak_slots)
        if k and self.rng.random() < k * self.rate_weak / self._total_rate():
            return self.weak_slots[self.rng.randrange(k)]
        while True:  # rejection: a weak slot drawn here is drawn again (weak slots are few)
            s = self.rng.randrange(self.n)
            if not self.weak[self.names[s]]:
                return s

    def _replace(self, slot: int, new: str, now: float) -> None:
        old = self.names[slot]
        if self.weak[old]:
            self.weak_slots.remove(slot)
        del self.slot[old]
        self.names[slot] = new
        self.slot[new] = slot
        self.since[new] = now
        self.past_events.append(pool.Event(old, "active", self.since.pop(old)))
        self.past_events.append(pool.Event(old, "evicted", now))
        if self.weak[new]:
            self.weak_slots.append(slot)
        self.left.pop(old, None)
        self.replay_plan = None

    # ---- the standby pool -----------------------------------------------------------------------------
    def _note_pool(self, now: float) -> None:
        t0, n0 = self.pool_last
        self.pool_area += n0 * (now - t0)
        if n0 == 0:
            self.pool_empty_s += now - t0
        self.pool_last = (now, len(self.standbys))
        if not self.pool_series or self.pool_series[-1][1] != len(self.standbys):
            self.pool_series.append((now, len(self.standbys)))

    def _size_pool(self, now: float) -> None:
        """The pool's target, once a day, from the simulated history (the pool job's :func:`sizing`: the P99
        of a day's failures, never fewer than one pipeline's machines)."""
        day = int(now // DAY_S)
        if day == self.target_day and self.knobs.pool_size is None:
            return
        self.target_day = day
        if self.knobs.pool_size is not None:
            self.target = self.knobs.pool_size
            return
        since = now - pool.HISTORY_WINDOW_S
        events = [e for e in self.past_events if e.ts >= since - pool.HISTORY_WINDOW_S]
        events += [pool.Event(n, "active", s) for n, s in self.since.items()]
        rate = pool.failure_rate(events, now)["rate"]
        t = self.topo
        self.target = max(pool.pool_target(self.n, rate),
                          pool.over_eviction_floor([(t.tp, t.pp, t.dp, t.ranks_per_machine)]))

    def _arrivals(self, now: float) -> None:
        """Standbys whose self-check ended by ``now`` park; repaired machines return to the free inventory."""
        for ts, name in sorted(c for c in self.coming if c[0] <= now):
            self._note_pool(ts)
            self.standbys.append(pool.Standby(name, ts))
            self._note_pool(ts)
        self.coming = [c for c in self.coming if c[0] > now]
        back = sorted(r for r in self.repairing if r[0] <= now)
        if back:
            self.repairing = [r for r in self.repairing if r[0] > now]
            self.free.extend(n for _, n in back)

    def _pool_until(self, now: float) -> None:
        """The pool job's runs (every 10 minutes) up to ``now``, while something is to be done."""
        while self.pool_dirty and self.pool_tick <= now:
            self._arrivals(self.pool_tick)
            self._pool_run(self.pool_tick)
            self.pool_tick += POOL_PERIOD_S
        self._arrivals(now)

    def _mark_pool(self, now: float) -> None:
        if not self.pool_dirty:
            self.pool_dirty = True
            self.pool_tick = math.ceil(now / POOL_PERIOD_S) * POOL_PERIOD_S

    def _pool_run(self, now: float) -> None:
        self._size_pool(now)
        since = now - pool.HISTORY_WINDOW_S
        while self.evicted_log and self.evicted_log[0][0] < since:
            _, gone = self.evicted_log.popleft()
            self.eviction_count[gone] -= 1
        counts = {n: c for n, c in self.eviction_count.items() if c > 0}
        want = max(0, self.target - len(self.standbys) - len(self.coming))
        while len([n for n in self.free if counts.get(n, 0) < pool.RETIRE_AFTER]) < want:
            self.free.append(self._fresh())
        plan = pool.plan_pool(self.target, self.standbys, list(self.free), counts, now,
                              checking=[n for _, n in self.coming])
        for name in plan.retire:
            self.retired.add(name)
            self.standbys = [s for s in self.standbys if s.name != name]
            if name in self.free:
                self.free.remove(name)
        for name in plan.provision:
            self.free.remove(name)
            self.coming.append((now + self.prof.provision_s, name))
        self._note_pool(now)
        self.pool_dirty = bool(plan.provision or plan.retire or self.coming)

    # ---- policy inputs ----------------------------------------------------------------------------------
    def _alerts(self, kind: FailureKind, slot: int, ts: float) -> list[dict[str, Any]]:
        machine = self.names[slot]
        rank = self.topo.ranks_on(slot)[0]
        return [{"id": f"{kind.alert}-{machine}-{ts:.3f}", "job": JOB, "machine": machine, "rank": rank,
                 "kind": kind.alert, "severity": "fault", "ts": ts, "evidence": {}}]

    def _stacks(self, slot: int) -> list[runtime.RankStack]:
        """Every rank's stack in a hang on ``slot``: its ranks stuck in an all_gather, the stage before it in
        isend, the stage after in irecv, everyone else waiting in the same all_reduce (§5's example)."""
        coords = self.topo.coords(self.topo.ranks_on(slot)[0])
        special = {slot: "all_gather < forward < train_step < main"}
        for dpp, sig in ((-1, "isend < send_forward < train_step < main"),
                         (1, "irecv < recv_forward < train_step < main")):
            if 0 <= coords.pp + dpp < self.topo.pp:
                special[self.topo.machine_of(self.topo.rank_of(tp=0, pp=coords.pp + dpp, dp=coords.dp))] = sig
        healthy = "all_reduce < backward < train_step < main"
        rpm = self.topo.ranks_per_machine
        return [runtime.RankStack(r, self.names[r // rpm], special.get(r // rpm, healthy))
                for r in range(self.topo.world_size)]

    def _vote(self, slot: int) -> list[int]:
        voter = runtime.SlowVoter(self.topo)
        slow = set(self.topo.ranks_on(slot))
        for _ in range(voter.rounds):
            voter.add_round({r: (1.8 if r in slow else 1.0) * (1 + 0.05 * self.rng.random())
                             for r in range(self.topo.world_size)})
        verdict = voter.verdict()
        return verdict[1] if verdict else []

    def _replay(self, culprit: str | None) -> list[str]:
        if self.replay_plan is None:
            self.replay_plan = sdc.plan_replay(self.topo, self.names)
        p = self.replay_plan
        h = {i: ("bad" if culprit in g else "good") for i, g in enumerate(p.horizontal)}
        v = {j: ("bad" if culprit in g else "good") for j, g in enumerate(p.vertical)}
        return sorted(sdc.culprits(p, h, v))

    # ---- one incident ---------------------------------------------------------------------------------
    def decide(self, kind: FailureKind, slot: int, ts: float, level: int, rollback_to: str | None = "known-good"
               ) -> tuple[ladder.Triage, ladder.Decision]:
        """The triage and first decision for a failure of ``kind`` on ``slot`` at ``ts``: the control plane's
        own :func:`~trainguard.operators.policy.ladder.assess` on the alerts the agent raises. The simulated job
        always has a known-good revision to roll back to (``rollback_to``)."""
        return ladder.assess(JOB, self._alerts(kind, slot, ts), level=level, rollback_to=rollback_to,
                             network_history=list(self.net_history), now=ts)

    def _incident(self, kind: FailureKind, slot: int, ts: float) -> tuple[float, dict[str, float]]:
        """Handle one failure; returns (how long the job is down, seconds by phase)."""
        p, k = self.prof, self.knobs
        machine = self.names[slot]
        faulty = machine if kind.machine_fault else (self.left.get(machine) and machine)
        cost: Counter[str] = Counter()
        cost["detection"] = p.detect_s.get(kind.name, 0.0) * k.detect_scale
        # the level needs the failure's triage (does it repeat the last incident?); the decision needs the level
        first = ladder.triage(JOB, self._alerts(kind, slot, ts), network_history=list(self.net_history), now=ts)
        level = ladder.escalation_level(last_level=self.last_level, last_recovery_end_ts=self.last_end,
                                        failed_ts=ts, window_s=_setting("escalation_window_s"),
                                        last_category=self.last_category, last_machines=self.last_machines,
                                        category=first.category, machines=first.machines)
        if level and self.knobs.degrade and not degrade.repeats(self.last_replicas,
                                                                degrade.replicas_of(self.topo, [slot])):
            level = 0  # the last recovery healed other replicas: this one never stopped, nothing to climb
        t, d = self.decide(kind, slot, ts, level)
        self.incidents[kind.name] += 1
        action = d.action
        self.actions[action.value] += 1
        evict: list[str] = []
        restart = True
        diag = p.diagnose_s
        if action == ladder.Action.TOLERATE:
            self.net_history.extend(self._alerts(kind, slot, ts))
            return 0.0, {}
        if action == ladder.Action.EVICT:
            evict = list(d.machines)
        elif action == ladder.Action.ANALYZE:
            cost["diagnosis"] += diag["analyze"]
            a = runtime.analyze(self.topo, self._stacks(slot), named=[self.topo.ranks_on(slot)[0]], kinds=("pp", "dp"))
            evict = [self.names[i] for i in a.evict_machines]
        elif action == ladder.Action.VOTE:
            cost["diagnosis"] += diag["vote"]
            evict = [self.names[i] for i in self._vote(slot)]
            restart = bool(evict)
        elif action in (ladder.Action.DIAGNOSE, ladder.Action.REPLAY, ladder.Action.RESTART):
            if action in (ladder.Action.DIAGNOSE, ladder.Action.RESTART):
                if kind.log_verdict == "user_code":
                    d = ladder.decide(t, level=level, log_verdict="user_code", rollback_to="known-good")
                else:
                    seen = faulty is not None and kind.machine_fault and self.rng.random() < kind.recall
                    d = ladder.decide(t, level=level, rollback_to="known-good", diagnosis_done=True,
                                      diagnosis_failed=[machine] if seen else [])
                # the restart at once diagnoses only when L1 beside the restore saw the machine (then all of it)
                if action == ladder.Action.DIAGNOSE or d.action == ladder.Action.EVICT:
                    cost["diagnosis"] += diag["diagnose"] + (diag["align"] if t.category == "nan" else 0.0)
            else:
                cost["diagnosis"] += diag["replay"]
                found = self._replay(faulty)
                d = ladder.decide(t, level=level, diagnosis_done=True, diagnosis_failed=found)
            self.actions[f"then_{d.action.value}"] += 1
            if d.action == ladder.Action.EVICT:
                evict = list(d.machines)
            elif d.action == ladder.Action.ROLLBACK:
                cost["diagnosis"] += diag["rollback"]
                self.revision += 1
            elif d.action == ladder.Action.WAIT_HUMAN:
                cost["human"] += p.human_s
                evict = [faulty] if faulty else []
        elif action == ladder.Action.ROLLBACK:
            cost["diagnosis"] += diag["rollback"]
            self.revision += 1
        elif action == ladder.Action.WAIT_HUMAN:
            cost["human"] += p.human_s
            evict = [faulty] if faulty else []
        path = self._path(t, d, action, kind, slot, evict, level) if k.degrade and restart else None
        if evict:
            window = _setting("breaker_window_s")
            recent = {n for when, n in self.evicted_log if when >= ts - window}
            verdict = ladder.breaker(job_machines=self.n, evicted_recently=recent, to_evict=evict,
                                     max_share=_setting("breaker_share"), window_s=window)
            if not verdict.allowed:
                self.actions["breaker"] += 1
                cost["human"] += p.human_s
            self._evict(evict, faulty, ts, cost)
        if path is not None and path.path == degrade.DEGRADE:
            self.actions["degrade"] += 1
            # the other replicas stall at the two changes of who trains (the replica leaves; healed, it rejoins);
            # meanwhile the job trains without it: its share of that time is lost
            window = sum(cost.values()) + p.heal_s
            cost = Counter({"quorum": 2 * p.quorum_s, "degraded": (1 - path.width) * window})
            restart = False
            self.last_level, self.last_category, self.last_machines = level, t.category, t.machines
            self.last_end = ts + 2 * p.quorum_s + window
            self.last_replicas = path.replicas
        elif path is not None and path.path == degrade.STOP_WORLD:
            self.actions["stop_world"] += 1
        if restart:
            cost["restart"] += p.restart_s * k.restart_scale
            cost["restore"] += p.restore_s
            self.pending_since = None  # a lazy code update rides along
        if faulty and faulty in self.slot and faulty not in evict:
            self.left[faulty] = kind.name
        elif not kind.machine_fault and kind.recur_p and self.rng.random() < kind.recur_p:
            self.left[machine] = kind.name  # a latent cause on this machine that no test sees
        if restart:
            self.last_level, self.last_category, self.last_machines = level, t.category, t.machines
            self.last_replicas = None
        for ph, f in k.phase_scale:
            if ph in cost:
                cost[ph] *= f
        down = sum(v for ph, v in cost.items() if ph != "degraded")  # degraded: the job trains on, narrower
        if restart:
            self.last_end = ts + down
        return down, dict(cost)

    def _path(self, t: ladder.Triage, d: ladder.Decision, action: ladder.Action, kind: FailureKind, slot: int,
              evict: list[str], level: int) -> degrade.DegradePlan:
        """Degrade or stop the world (:func:`trainguard.operators.policy.degrade.plan`) for this incident: the
        machines it takes out (what the rung evicts, and where the failure showed) and its first decision."""
        machines = {slot, *(self.slot[n] for n in evict if n in self.slot)}
        verdict = kind.log_verdict if action in (ladder.Action.DIAGNOSE, ladder.Action.RESTART) else ""
        final = d.action.value if action in (ladder.Action.DIAGNOSE, ladder.Action.REPLAY, ladder.Action.RESTART) \
            else action.value
        return degrade.plan(self.topo, category=t.category.value, action=final, machines=sorted(machines),
                            level=level, min_replicas=self.knobs.min_replicas, log_verdict=verdict)

    def _evict(self, machines: list[str], faulty: str | None, now: float, cost: Counter[str]) -> None:
        self._pool_until(now)
        short = 0
        for name in machines:
            if name not in self.slot:
                continue
            slot = self.slot[name]
            self.evictions["faulty" if name == faulty or name in self.left else "healthy"] += 1
            self.evicted_log.append((now, name))
            self.eviction_count[name] += 1
            self.repairing.append((now + self.model.repair_days * DAY_S, name))
            if self.standbys:
                new = self.standbys.pop(0).name
            else:
                short += 1
                new = self._fresh()
            self._replace(slot, new, now)
        self._note_pool(now)
        self._mark_pool(now)
        cost["swap"] += self.prof.swap_s * self.knobs.restart_scale
        if short:
            self.waits += 1
            self.short_machines += short
            cost["wait_machine"] += self.prof.reschedule_s

    # ---- the run ------------------------------------------------------------------------------------------
    def _spread(self, start: float, end: float, sign: float = 1.0) -> None:
        """Add (or take away) productive seconds over ``[start, end)`` to the weeks they fall in."""
        end = min(end, self.horizon)
        while start < end:
            w = min(int(start // WEEK_S), len(self.weeks_prod) - 1)
            stop = min(end, (w + 1) * WEEK_S)
            self.weeks_prod[w] += sign * (stop - start)
            start = stop

    def run(self) -> Result:
        now = 0.0
        heap: list[tuple[float, int, str, str]] = []  # (ts, seq, what, machine): faults left in place
        seq = 0
        self._pool_until(0.0)
        ratio = self.interval / (self.interval + self.write_s) if self.write_s else 1.0
        while now < self.horizon:
            gap = self.rng.expovariate(self._total_rate() + self.manual_rate)
            t_fail = now + gap
            what, slot = "random", -1
            while heap and heap[0][3] not in self.slot:
                heapq.heappop(heap)
            if heap and heap[0][0] < t_fail:
                t_fail, _, what, name = heapq.heappop(heap)
                slot = self.slot[name]
            if self.pending_since is not None and code.lazy_due(self.pending_since, t_fail):
                t_fail, what = max(now, self.pending_since + code.LAZY_FORCE_S), "lazy"
            if t_fail >= self.horizon:
                self._train(now, self.horizon, ratio)
                break
            self._train(now, t_fail, ratio)
            self._pool_until(t_fail)
            if what == "lazy" or (what == "random" and self.rng.random() < self.manual_rate / (
                    self._total_rate() + self.manual_rate)):
                down = self._manual(t_fail, forced=what == "lazy")
                now = t_fail + down
                continue
            lost = (t_fail - now) % self.interval
            if what == "random":
                kind = self.kinds[self.rng.choices(self.kind_names, self.kind_weights)[0]]
                slot = self._draw_machine()
            else:
                kind = self.kinds[what]
            down, cost = self._incident(kind, slot, t_fail)
            if down == 0.0 and not cost:  # tolerated: the job trains on
                if kind.repeat_p and self.rng.random() < kind.repeat_p:
                    seq += 1
                    heapq.heappush(heap, (t_fail + self.rng.uniform(30, 240), seq, kind.name, self.names[slot]))
                now = t_fail
                continue
            if "quorum" in cost:  # trained through: the other replicas lose the step in flight, not the interval
                lost = (t_fail - now) % self.prof.step_s
            cost["lost_work"] = lost * ratio * dict(self.knobs.phase_scale).get("lost_work", 1.0)
            self._spread(t_fail - cost["lost_work"], t_fail, -1.0)
            for ph, sec in cost.items():
                self.by_phase[ph] += sec
                self.by_cause[kind.name] += sec
            now = t_fail + down
            if cost.get("degraded"):  # the job trained on at reduced width: that share of the window is lost
                self._spread(now, now + cost["degraded"], -1.0)
            for name, left_kind in self.left.items():
                if not any(h[3] == name for h in heap):
                    seq += 1
                    heapq.heappush(heap, (now + self.rng.expovariate(1 / self.model.recur_after_s), seq, left_kind,
                                          name))
        self._note_pool(self.horizon)
        return self._result()

    def _train(self, start: float, end: float, ratio: float) -> None:
        end = min(end, self.horizon)
        if end <= start:
            return
        self._spread(start, end)
        overhead = (end - start) * (1 - ratio)
        self._spread(start, start + overhead, -1.0)
        self.by_phase["checkpoint"] += overhead
        self.by_cause["checkpoint"] += overhead

    def _manual(self, ts: float, *, forced: bool) -> float:
        """A code or data change (the census' manual restarts) through the code-update policy."""
        if forced:
            self.pending_since = None
            self.incidents["manual_forced"] += 1
        else:
            self.incidents["manual"] += 1
            urgency = "urgent" if self.rng.random() < self.model.manual_urgent_share else "lazy"
            self.revision += 1
            cur, new = f"r{self.revision - 1}", f"r{self.revision}"
            plan = code.plan_update(job=JOB, current=cur, pending=None, requested=new, urgency=urgency,
                                    recorded=[cur, new], known_good=[cur])
            self.actions[f"code_{plan.action}"] += 1
            if plan.action == "pending":
                if self.pending_since is None:
                    self.pending_since = ts
                return 0.0
        down = self.prof.hot_update_s * self.knobs.restart_scale * dict(self.knobs.phase_scale).get("hot_update", 1)
        self.by_phase["hot_update"] += down
        self.by_cause["manual"] += down
        return down

    def _result(self) -> Result:
        productive = sum(self.weeks_prod)
        weeks = []
        for i, prod in enumerate(self.weeks_prod):
            length = min(WEEK_S, self.horizon - i * WEEK_S)
            weeks.append(prod / length if length > 0 else 0.0)
        pool_doc = {"target_last": self.target, "mean": round(self.pool_area / self.horizon, 3),
                    "min": min((n for _, n in self.pool_series), default=0),
                    "max": max((n for _, n in self.pool_series), default=0),
                    "empty_share": round(self.pool_empty_s / self.horizon, 4), "waits": self.waits,
                    "machines_short": self.short_machines, "retired": len(self.retired)}
        ev = dict(self.evictions)
        n_evict = sum(self.incidents.values())
        ev["healthy_per_incident"] = round(ev.get("healthy", 0) / max(n_evict, 1), 3)
        return Result(gpus=self.n * self.model.gpus_per_machine, machines=self.n, days=self.horizon / DAY_S,
                      profile=self.prof.name, ettr=productive / self.horizon, weeks=weeks,
                      by_cause=dict(self.by_cause), by_phase={p: self.by_phase.get(p, 0.0) for p in PHASES},
                      incidents=dict(self.incidents), actions=dict(self.actions), evictions=ev, pool=pool_doc,
                      pool_series=self.pool_series, degrade=self.knobs.degrade)


def simulate(model: FailureModel, prof: Profile, *, gpus: int, days: float, tp: int = 8, pp: int = 8, seed: int = 0,
             knobs: Knobs | None = None) -> Result:
    return Simulation(model, prof, gpus=gpus, days=days, tp=tp, pp=pp, seed=seed, knobs=knobs).run()
