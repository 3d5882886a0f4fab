"""Triage and the decision ladder (ByteRobust, SOSP 2025, Fig. 5), as plain functions.

:func:`triage` reads one batch of alerts of one job and says what kind of failure it is and which
machines are implicated; :func:`decide` turns that and the incident's position on the ladder into the
next action; :func:`breaker` is the circuit breaker every automatic eviction passes through.

The ladder::

    explicit machine fault (GPU lost, fatal Xid, uncorrectable ECC, disk, MCE) -> evict at once
    network alert                    -> tolerate; the same machine again within 5 min -> evict
    silent data corruption suspected -> find the machine that computes wrong (alignment test; dual-phase
                                        replay) -> evict it; none -> restart; again -> wait for a human
    user-code error (from the logs)  -> roll back to the last known-good revision, restart in place
    a first crash naming its ranks   -> restart in place at once (logs read as the job stops: a repeat
                                        offender is evicted, user code rolled back); L1 of the crashed
                                        machine beside the restore; it fails -> stop-time diagnosis
    crash / NaN without a culprit    -> stop-time diagnosis (logs -> L1 -> L2 -> L3; NaN adds the
                                        alignment test) -> evict what fails; all pass -> reattempt
                                        again (level 1) -> roll back (a crash: stop-time diagnosis first,
                                        all pass -> roll back); again (level 2) -> replay
                                        ("again": the same category soon after the last recovery, see
                                        :func:`escalation_level`)
    hang                             -> runtime analysis (stacks) -> over-evict the parallel group
    silent agent                     -> probe its machine (ssh + L1): unreachable or unhealthy -> evict it;
                                        healthy -> restart the agent, leave the job alone
    throughput decline               -> vote over rounds while the job trains: the group holding the slowest
                                        ranks in most rounds is evicted; none in most rounds -> transient
    beyond that, or over the breaker -> wait for a human

Nothing here imports Airflow; the DAGs call these functions and record what they return.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from trainguard.core.topology import Topology

# Xid codes that mean the GPU or its memory is unusable until repaired (NVIDIA's Xid catalogue:
# 48 DBE, 62/63/64 row remapping, 74 NVLink, 79 fell off the bus, 92 high single-bit ECC rate,
# 94/95 contained/uncontained ECC, 119/120 GSP errors, 140 unrecovered ECC).
FATAL_XIDS = frozenset({48, 62, 63, 64, 74, 79, 92, 94, 95, 119, 120, 140})

EXPLICIT = frozenset({"gpu_lost", "gpu_ecc", "disk_full", "disk_readonly", "kernel_mce", "kernel_fs"})
XID = frozenset({"gpu_xid", "kernel_xid"})
NETWORK = frozenset({"nic_down", "nic_errors", "kernel_link"})
HANG = frozenset({"rank_hang", "rank_stopped", "job_stalled"})
SLOW = frozenset({"rank_slow", "throughput_decline"})
NUMERIC = frozenset({"nan_loss", "job_held"})  # job_held: the reconciler found the NaN guard holding
SDC = frozenset({"sdc_suspect"})
CRASH = frozenset({"rank_exit", "kernel_oom", "job_down"})
AGENT = frozenset({"agent_silent"})
OBSERVE = frozenset({"loss_spike", "grad_spike", "gpu_thermal", "gpu_pcie"})

NETWORK_REPEAT_WINDOW_S = 300.0
NETWORK_REPEAT_COUNT = 2
NETWORK_EPISODE_S = 10.0  # network alerts of one machine closer than this are one event (one flap)



class Category(StrEnum):
    """What kind of failure a batch of alerts is (its strongest alert's), strongest first."""

    MACHINE_FAULT = "machine_fault"
    NETWORK = "network"
    SDC = "sdc"
    NAN = "nan"
    CRASH = "crash"
    HANG = "hang"
    AGENT = "agent"
    SLOW = "slow"
    OBSERVE = "observe"


class Action(StrEnum):
    """What the ladder does next about an incident (:func:`decide`)."""

    EVICT = "evict"
    TOLERATE = "tolerate"
    OBSERVE = "observe"
    DIAGNOSE = "diagnose"
    ANALYZE = "analyze"
    VOTE = "vote"
    REPLAY = "replay"
    ROLLBACK = "rollback"
    REATTEMPT = "reattempt"
    PROBE = "probe"
    RESTART = "restart"
    WAIT_HUMAN = "wait_human"


# categories, strongest first: the batch is what its strongest alert says
CATEGORIES = tuple(c.value for c in Category)


@dataclass(frozen=True)
class Triage:
    """What a batch of alerts means for one job."""

    job: str
    category: Category
    machines: tuple[str, ...] = ()  # implicated machines (the culprits for machine_fault/network)
    ranks: tuple[int, ...] = ()
    reason: str = ""
    alert_kinds: tuple[str, ...] = ()
    repeated: bool = False  # network: the implicated machines' faults repeated within the window

    def __post_init__(self) -> None:
        object.__setattr__(self, "category", Category(self.category))  # an unknown category: ValueError


@dataclass(frozen=True)
class Decision:
    """The next action for an incident.

    ``action``: one of :class:`Action`."""

    action: Action
    machines: tuple[str, ...] = ()
    reason: str = ""
    diagnose: Mapping[str, Any] = field(default_factory=dict)  # for "diagnose": levels and options

    def __post_init__(self) -> None:
        object.__setattr__(self, "action", Action(self.action))  # an unknown action: ValueError


def _xid(alert: Mapping[str, Any]) -> int | None:
    ev = alert.get("evidence") or {}
    for key in ("xid", "code"):
        value = ev.get(key)
        if isinstance(value, int) or (isinstance(value, str) and value.isdigit()):
            return int(value)  # the kernel log's pattern gives digits as text
    xids = ev.get("xids")
    if isinstance(xids, list) and xids and isinstance(xids[-1], int):
        return int(xids[-1])
    return None


def _category(alert: Mapping[str, Any]) -> str:
    kind = alert.get("kind", "")
    if kind in EXPLICIT:
        return "machine_fault"
    if kind in XID:
        code = _xid(alert)
        return "machine_fault" if code is None or code in FATAL_XIDS else "observe"
    if kind in NETWORK:
        return "network"
    if kind in SDC:
        return "sdc"
    if kind in NUMERIC:
        return "nan"
    if kind in CRASH:
        return "crash"
    if kind in HANG:
        return "hang"
    if kind in SLOW:
        return "slow"
    if kind in AGENT:
        return "agent"
    return "observe"


def decisive(alert: Mapping[str, Any]) -> bool:
    """An alert the ladder acts on by itself, whatever else arrives with it: an explicit machine fault (the
    first rung evicts at once) or a silent agent (its machine is probed). A batch holding one needs no
    settle window."""
    return _category(alert) in ("machine_fault", "agent")


#: categories whose alert, naming its machine, is acted on without waiting for more of the burst: the rung gathers
#: what it needs itself (the logs as the job stops, every machine's digest), and what arrives later joins the
#: incident. A hang waits: thousands of ranks time out together, one batch and one run; a fail-slow report waits
#: for the job's others (a shared slowdown is told from a straggler on all of them), a network alert for the
#: episode (its repeat rule counts episodes)
UNSETTLED = frozenset({"crash", "nan", "sdc"})


def urgent(alert: Mapping[str, Any]) -> bool:
    """An alert whose batch goes out at once, without the settle window: a decisive one, or one of
    :data:`UNSETTLED` that names its machine."""
    return decisive(alert) or (_category(alert) in UNSETTLED and bool(alert.get("machine")))


def network_repeats(alerts: Iterable[Mapping[str, Any]], now: float, *, window_s: float = NETWORK_REPEAT_WINDOW_S,
                    count: int = NETWORK_REPEAT_COUNT) -> set[str]:
    """Machines with at least ``count`` network episodes in the last ``window_s``. One link event raises
    several alerts (the driver's kernel log line, the link check a few seconds later): alerts of a machine
    less than ``NETWORK_EPISODE_S`` apart are one episode."""
    times: dict[str, list[float]] = {}
    for a in alerts:
        if a.get("kind") in NETWORK and a.get("machine") and now - float(a.get("ts", 0)) <= window_s:
            times.setdefault(a["machine"], []).append(float(a.get("ts", 0)))
    repeated = set()
    for machine, ts in times.items():
        ordered = sorted(ts)
        episodes = 1 + sum(1 for prev, cur in itertools.pairwise(ordered) if cur - prev >= NETWORK_EPISODE_S)
        if episodes >= count:
            repeated.add(machine)
    return repeated


def triage(job: str, batch: Sequence[Mapping[str, Any]], *, job_machines: Sequence[str] = (),
           network_history: Sequence[Mapping[str, Any]] = (), now: float | None = None) -> Triage:
    """Classify one batch of alerts of ``job``.

    ``network_history``: the job's earlier network alerts (for the repeat rule); ``job_machines``:
    the machines the job runs on (machine-level alerts from other machines do not implicate it)."""
    relevant = [a for a in batch if not job_machines or a.get("machine") in job_machines or a.get("job") == job]
    if not relevant:
        return Triage(job, "observe", reason="no alert concerns this job's machines")
    by_cat: dict[str, list[Mapping[str, Any]]] = {}
    for a in relevant:
        by_cat.setdefault(_category(a), []).append(a)
    kinds = tuple(sorted({a["kind"] for a in relevant}))
    now = now if now is not None else max(float(a.get("ts", 0)) for a in relevant)
    for cat in CATEGORIES:
        alerts = by_cat.get(cat)
        if not alerts:
            continue
        machines = tuple(sorted({a["machine"] for a in alerts if a.get("machine")}))
        ranks = tuple(sorted({a["rank"] for a in alerts if isinstance(a.get("rank"), int)}))
        if cat == "machine_fault":
            what = ", ".join(sorted({f"{a['machine']}: {a['kind']}" for a in alerts}))
            return Triage(job, cat, machines, ranks, f"explicit machine fault ({what})", kinds)
        if cat == "network":
            repeated = network_repeats([*network_history, *alerts], now)
            culprits = tuple(sorted(set(machines) & repeated))
            if culprits:
                return Triage(job, cat, culprits, ranks,
                              f"network fault repeated on {', '.join(culprits)} within "
                              f"{NETWORK_REPEAT_WINDOW_S:.0f}s", kinds, repeated=True)
            if any(k in by_cat for k in ("crash", "hang", "nan", "sdc")):
                continue  # a first network blip that also broke the job: handle the breakage
            return Triage(job, cat, machines, ranks, "first network alert: tolerated until it repeats", kinds)
        return Triage(job, cat, machines, ranks, f"{cat}: {', '.join(sorted({a['kind'] for a in alerts}))}", kinds)
    return Triage(job, "observe", reason="nothing actionable", alert_kinds=kinds)


def decide(t: Triage, *, level: int = 0, log_verdict: str = "", rollback_to: str | None = None,
           diagnosis_failed: Sequence[str] = (), diagnosis_done: bool = False) -> Decision:
    """The next rung for an incident.

    ``level``: how many recoveries of this job failed before (0 = first failure); ``log_verdict``:
    the logs' classification of the crash (``user_code``, ``infrastructure``, ``unknown``);
    ``rollback_to``: the last known-good revision other than the current one (None = none);
    ``diagnosis_failed``/``diagnosis_done``: results of a stop-time diagnosis already run."""
    if t.category == "machine_fault":
        return Decision("evict", t.machines, t.reason)
    if t.category == "network":
        if t.repeated:
            return Decision("evict", t.machines, t.reason)
        return Decision("tolerate", t.machines, t.reason)
    if t.category == "observe":
        return Decision("observe", (), t.reason)
    if t.category == "hang":
        return Decision("analyze", t.machines, "hang: stacks and collective progress of every rank")
    if t.category == "agent":
        return Decision("probe", t.machines, f"silent agent on {', '.join(t.machines)}: reach the machine and run L1")
    if t.category == "slow":
        return Decision("vote", t.machines, "throughput decline: per-rank compute time over several rounds, "
                                            "while the job keeps training")
    if t.category == "sdc":
        if not diagnosis_done:
            return Decision("replay", t.machines, "parameters differ between data-parallel peers: find the "
                                                  "machine that computes wrong")
        if diagnosis_failed:
            return Decision("evict", tuple(sorted(diagnosis_failed)),
                            f"{', '.join(sorted(diagnosis_failed))} computed differently from the rest")
        if level == 0:
            return Decision("reattempt", (), "no machine computed differently: restart from the last checkpoint")
        return Decision("wait_human", (), "parameters diverged again and no machine computes differently")
    # crash and NaN
    if log_verdict == "user_code":
        if rollback_to:
            return Decision("rollback", (), f"user-code error in the logs: roll back to {rollback_to}")
        return Decision("wait_human", (), "user-code error in the logs and no known-good revision to roll back to")
    if diagnosis_done:
        if diagnosis_failed:
            return Decision("evict", tuple(sorted(diagnosis_failed)),
                            f"stop-time diagnosis failed on {', '.join(sorted(diagnosis_failed))}")
        if level == 0:
            return Decision("reattempt", (), "every machine passed diagnosis: restart in place")
    if t.category == "crash" and not diagnosis_done:
        # a crash's level 0 is the restart at once; the stop-time diagnosis comes when it fails again (level 1,
        # before the rollback) or when the check beside the restore failed (the rung asks for it itself)
        if level == 0 and t.machines:
            return Decision("restart", t.machines, f"first crash on {', '.join(t.machines)}: restart in place at "
                                                   f"once; L1 of {', '.join(t.machines)} beside the restore")
        if level == 1:
            return Decision("diagnose", (), "crash again after its restart: stop-time diagnosis",
                            diagnose={"levels": ["L1", "L2", "L3"], "align": False})
    if level == 0:
        return Decision("diagnose", (), f"{t.category} without a culprit: stop-time diagnosis",
                        diagnose={"levels": ["L1", "L2", "L3"], "align": t.category == "nan"})
    if level == 1:
        if rollback_to:
            return Decision("rollback", (), f"failed again after recovery: roll back to {rollback_to}")
        return Decision("replay", (), "failed again after recovery, no other known-good revision: replay")
    if level == 2:
        return Decision("replay", (), "failed again after a rollback: dual-phase replay for a silent culprit")
    return Decision("wait_human", (), f"failed {level + 1} times; automatic recovery stops here")


# categories whose named machines are the culprits the ladder acts on (evicts, probes): the same kind of fault on
# another machine is another fault, not the last one coming back
CULPRIT_CATEGORIES = frozenset({Category.MACHINE_FAULT, Category.NETWORK, Category.AGENT})


def related(*, last_category: str | None, last_machines: Sequence[str], category: str | None,
            machines: Sequence[str]) -> bool:
    """Whether a failure (``category``, ``machines``) repeats the job's last incident (``last_category``,
    ``last_machines``), so that the last recovery did not hold. ByteRobust climbs its ladder when "the job fails
    again after the reattempt": the same failure again. At 9,600 GPUs several unrelated failures strike a day and
    many land soon after some recovery; taking each for a repeat would roll back good code and replay for a
    culprit that is not there.

    * An explicit machine fault is never a repeat and never makes the next failure one: its machine was
      evicted at once, so nothing of it is left to fail again, and the fault says nothing about the code.
    * Another category (a crash after a hang, a NaN after a crash) is another failure. An unknown category
      (None or empty) is not taken for a repeat.
    * Where the culprits are machines (network, silent agent) and both incidents name machines, a fault of
      machines the last one did not name is another machine's fault. A crash, a NaN or a hang naming other
      ranks is still the job failing again: the ranks that die first are not the cause."""
    if not category or not last_category or category != last_category:
        return False
    if category == Category.MACHINE_FAULT:
        return False
    named = bool(machines) and bool(last_machines)
    return category not in CULPRIT_CATEGORIES or not named or bool(set(machines) & set(last_machines))


def escalation_level(*, last_level: int | None, last_recovery_end_ts: float | None, failed_ts: float,
                     window_s: float, last_category: str | None, last_machines: Sequence[str] = (),
                     category: str | None, machines: Sequence[str] = ()) -> int:
    """The ladder level of a new failure of a job (its first alert at ``failed_ts``, its triage ``category`` and
    implicated ``machines``): 0 for a first failure; a failure within ``window_s`` of the end of the job's last
    recovery (``last_recovery_end_ts``, of an incident at ``last_level`` triaged as ``last_category`` on
    ``last_machines``) that repeats it (:func:`related`) starts one level higher, because that recovery did not
    hold. A failure unrelated to the last one starts at 0 however soon it comes. The escalation state is an
    input, not something this module remembers: the fleet database keeps it for the DAGs, the simulator keeps
    it in memory, and both get the same answer."""
    if last_level is None or last_recovery_end_ts is None or failed_ts - last_recovery_end_ts > window_s:
        return 0
    if not related(last_category=last_category, last_machines=last_machines, category=category, machines=machines):
        return 0
    return last_level + 1


def assess(job: str, alerts: Sequence[Mapping[str, Any]], *, level: int, rollback_to: str | None,
           job_machines: Sequence[str] = (), network_history: Sequence[Mapping[str, Any]] = (),
           now: float | None = None) -> tuple[Triage, Decision]:
    """An incident's triage and its first decision, as ``tg_incident``'s triage task makes them (:func:`triage`,
    then :func:`decide` at the incident's level): what the simulator acts on. ``now`` is the incident's clock
    (its newest alert's time when None), ``level`` its escalation level (:func:`escalation_level`)."""
    t = triage(job, alerts, job_machines=job_machines, network_history=network_history, now=now)
    return t, decide(t, level=level, rollback_to=rollback_to)


# an incident still being watched (the job trains on while the slow ranks are voted on) is taken over
# by stronger alerts that arrive meanwhile: a NaN, a crash or a hang during the vote is handled as such
WATCHED = frozenset({"slow"})


def supersedes(current: str, t: Triage) -> bool:
    """Whether the incident's alerts, triaged again as ``t``, take over an incident of category
    ``current`` that is still being watched (no action taken yet): a stronger category that calls for
    more than tolerating or observing."""
    if current not in WATCHED or t.category == current or t.category not in CATEGORIES:
        return False
    if CATEGORIES.index(t.category) > CATEGORIES.index(current):
        return False
    return decide(t).action not in ("tolerate", "observe")


#: a shared slowdown is judged only when at least this share of the job's ranks reported theirs
SHARED_QUORUM = 0.5


def observed_only(alerts: Sequence[Mapping[str, Any]]) -> str:
    """Why a batch needs no incident because every alert in it is an observation the ladder records and never
    acts on (a loss or gradient spike, a hot or throttled GPU, a non-fatal Xid); "" when one alert is more. On a
    stranger's job such signals come from the program's own noise (a loss on random data is above 5x its median
    every few steps): an incident per spike is a ``tg_incident`` run per batch, and an incident open for nothing
    is one a real fault would join."""
    if not alerts or any(_category(a) != "observe" or a.get("kind") not in OBSERVE | XID for a in alerts):
        return ""  # (a kind the ladder does not know is no observation: it opens an incident, as before)
    kinds = sorted({str(a.get("kind", "")) for a in alerts})
    return f"observed only ({', '.join(kinds)}): recorded, nothing to recover"


def shared_slowdown(alerts: Sequence[Mapping[str, Any]], *, ranks: int, factor: float,
                    topology: Topology | None = None) -> str:
    """Why a batch of fail-slow alerts (``rank_slow``, ``throughput_decline``) is a slowdown the whole job shares
    (host load, the data, a slower input pipeline), not a straggler; "" when it may be one. Each alert carries
    its rank's compute growth (``compute_ratio``: its recent compute time, less the wait in collectives, over its
    own normal one): a straggler's grew and its peers' did not (they wait for it), while a load on every machine
    grows them all alike. Shared: at least :data:`SHARED_QUORUM` of the job's ``ranks`` reported, no rank's
    growth is above ``factor`` times the median growth of the ranks that reported, and no rank's recent compute
    time (``recent_compute_s``) stands out against its pipeline stage's as one round of the fail-slow vote judges
    it (:meth:`~trainguard.operators.policy.runtime.SlowVoter.add_round`, the whole batch as one stage without
    the job's ``topology``), so that a straggler whose slowdown its own history learned still stands out against
    its peers now. Anything else (another kind in the batch, too few ranks, no growth reported) is left to the
    vote."""
    if not alerts or any(a.get("kind") not in SLOW for a in alerts):
        return ""
    growth: dict[int, float] = {}
    now: dict[int, float] = {}
    for a in alerts:
        evidence, rank = a.get("evidence") or {}, a.get("rank")
        ratio, recent = evidence.get("compute_ratio"), evidence.get("recent_compute_s")
        if isinstance(rank, int) and isinstance(ratio, (int, float)) and ratio > 0:
            growth[rank] = max(growth.get(rank, 0.0), float(ratio))
        if isinstance(rank, int) and isinstance(recent, (int, float)) and recent > 0:
            now[rank] = max(now.get(rank, 0.0), float(recent))
    if ranks <= 0 or len(growth) < max(2, SHARED_QUORUM * ranks):
        return ""
    median = statistics.median(growth.values())
    top_rank, top = max(growth.items(), key=lambda kv: kv[1])
    if top > factor * median:
        return ""
    from trainguard.operators.policy.runtime import SlowVoter

    topo = topology or Topology(tp=1, pp=1, dp=max(now, default=0) + 1)  # without it: one stage
    if SlowVoter(topo, rounds=1).add_round({r: t for r, t in now.items() if 0 <= r < topo.world_size},
                                           factor=factor):
        return ""
    ordered = sorted(growth.values())
    return (f"a slowdown {len(growth)} of {ranks} ranks share: their compute grew {ordered[0]:.2f}x-{top:.2f}x "
            f"(median {median:.2f}x), none above {factor:g}x the median (rank {top_rank} highest), and no rank "
            f"computes {factor:g}x longer than its stage's: load or data, not a straggler")


def outranks(current: str, t: Triage) -> bool:
    """Whether the incident's alerts, triaged again as ``t`` before it closes, say something its decision (made
    for ``current``) does not explain: a stronger category that calls for more than tolerating or observing
    (a crash or a hang that joined a fail-slow vote, a network incident that was tolerated ...). The incident
    is then triaged again instead of closing."""
    if t.category == current or t.category not in CATEGORIES or current not in CATEGORIES:
        return False
    if CATEGORIES.index(t.category) > CATEGORIES.index(current):
        return False
    return decide(t).action not in ("tolerate", "observe")


@dataclass(frozen=True)
class BreakerVerdict:
    allowed: bool
    reason: str


def breaker(*, job_machines: int, evicted_recently: set[str], to_evict: Iterable[str], max_share: float,
            window_s: float, spares: int = 0) -> BreakerVerdict:
    """Whether evicting ``to_evict`` keeps the job's evictions within its allowance per ``window_s``: ``max_share``
    of its machines, and never less than one machine, nor less than the ``spares`` kept for it (one eviction per
    spare: a two-machine job with two standbys may use both, where half its machines would allow one). Over it,
    the incident waits for a human; the reason says how to raise the allowance."""
    wanted = set(to_evict)
    total = evicted_recently | wanted
    share = int(max_share * job_machines + 1e-9)
    limit = max(1, share, spares)
    if len(total) > limit:
        why = (f"{max_share:.0%} of {job_machines} machines" if limit == share
               else f"one per spare, {spares}" if limit == spares else "at least one")
        return BreakerVerdict(False, f"evicting {', '.join(sorted(wanted))} would make {len(total)} machines of "
                                     f"{job_machines} evicted within {window_s:.0f}s (limit {limit}: {why}); "
                                     f"waiting for a human: raise TG_BREAKER_SHARE (now {max_share:g}) or the job's "
                                     f"standbys, or wait out TG_BREAKER_WINDOW_S, then retry the incident")
    return BreakerVerdict(True, f"{len(total)} of at most {limit} machines evicted in the window")


# ---- the rungs' verdicts ----------------------------------------------------------------------------------------
# Each rung of tg_incident gathers its evidence (the services of trainguard.operators.control) and hands it here; what
# comes back says what the rung does. Nothing below reads a database or a machine.

@dataclass(frozen=True)
class Verdict:
    """What a rung decided from its evidence.

    ``kind``: ``evict`` (``machines``, ``reason``; ``max_step``: the newest step the restart may restore;
    ``priority``: the machines with direct evidence in an over-evicted group), ``rollback`` (to ``revision``),
    ``reattempt`` (restart as it is; ``reason`` says why), ``wait_human`` (``reason``: why, and what next), ``leave``
    (the job is left alone: ``resolved`` when nothing needs recovering, ``not_evicted`` when the group could not be
    evicted while the job trains on), or ``diagnose`` (a gate: the rung's stop-time diagnosis is to be taken next)."""

    kind: str
    machines: tuple[str, ...] = ()
    reason: str = ""
    max_step: int | None = None
    priority: tuple[str, ...] = ()
    revision: str | None = None
    resolved: str | None = None
    not_evicted: str | None = None


def explicit_faults(alerts: Iterable[Mapping[str, Any]], serving: Iterable[str]) -> dict[str, str]:
    """The explicit machine faults among ``alerts`` (documents) on machines that still serve the job (``serving``):
    machine -> the alerts' kinds. Every one is acted on before the incident closes."""
    machines = set(serving)
    out: dict[str, set[str]] = {}
    for a in alerts:
        if a.get("machine") in machines and decisive(a) and _category(a) == "machine_fault":
            out.setdefault(str(a["machine"]), set()).add(str(a.get("kind")))
    return {m: ", ".join(sorted(k)) for m, k in sorted(out.items())}


def joined_fault(rung: str, explicit: Mapping[str, str]) -> str:
    """Why an explicit machine fault that joined the incident before its rung acted decides it instead (the first
    rung: evict that machine alone); "" when none did, or the rung is that first rung already."""
    if rung == "evict_now" or not explicit:
        return ""
    return ("explicit machine fault that joined the incident before its rung acted: "
            + "; ".join(f"{m}: {k}" for m, k in explicit.items()))


def evict_named(job: str, machines: Sequence[str], serving: Iterable[str], reason: str) -> Verdict:
    """The first rung: evict the machines an explicit fault names, no diagnosis; a decision naming no machine of the
    job (an alert about a machine that left it) touches nothing."""
    if not set(machines) & set(serving):
        why = f"nothing to evict: {', '.join(machines) or 'no machine'} does not serve job {job}"
        return Verdict("leave", reason=why, resolved=why)
    return Verdict("evict", tuple(machines), reason)


def evict_unreachable(gone: Mapping[str, str]) -> Verdict:
    """Machines of the job that did not answer a session of the incident are evicted: a restart would wait on them
    and fail."""
    return Verdict("evict", tuple(sorted(gone)), "unreachable: " + "; ".join(f"{m}: {why[-120:]}"
                                                                             for m, why in sorted(gone.items())))


def repeat_offender(culprit: str | None, before: Sequence[int] | None, *, count: int, window_s: float
                    ) -> Verdict | None:
    """A machine where the job's failure started ``count`` times within ``window_s`` (``before``: the other incidents
    that implicated it and left it in the job; None: the logs implicated no machine) is evicted now, whatever its
    diagnosis would say; None otherwise."""
    if not culprit or before is None or len(before) < count:
        return None
    return Verdict("evict", (culprit,), f"repeat offender: {culprit} was where the job failed first in incidents "
                                        f"{', '.join(map(str, before))} within {window_s:.0f}s, each of which left "
                                        f"it in the job; it is swapped out now")


def following(d: Decision, *, rollback_to: str | None = None, max_step: int | None = None) -> Verdict:
    """The ladder's ``d`` as a rung's verdict: evict what it names, roll back (when there is a revision to go to),
    restart as it is (a reattempt, or a replay the rung already ran), else wait for a human."""
    if d.action == Action.EVICT:
        return Verdict("evict", tuple(d.machines), d.reason, max_step=max_step)
    if d.action == Action.ROLLBACK and rollback_to:
        return Verdict("rollback", reason=d.reason, revision=rollback_to)
    if d.action in (Action.REATTEMPT, Action.REPLAY):
        return Verdict("reattempt", reason=d.reason)
    return Verdict("wait_human", reason=d.reason)


def after_stop(job: str, category: str, machines: Sequence[str], *, level: int, rollback_to: str | None,
               log_verdict: str, offender: Verdict | None = None) -> Verdict:
    """A rung that stopped the job (an incident of ``category`` on ``machines``) and read its logs: a repeat offender
    is evicted; logs that blame the job's own code roll it back (or wait for a human without a known-good revision);
    anything else is diagnosed next."""
    if offender is not None:
        return offender
    if log_verdict == "user_code":
        t = Triage(job, category, tuple(machines))
        return following(decide(t, level=level, log_verdict="user_code", rollback_to=rollback_to),
                         rollback_to=rollback_to)
    return Verdict("diagnose")


def after_diagnosis(job: str, category: str, machines: Sequence[str], *, level: int, rollback_to: str | None,
                    failed: Sequence[str], max_step: int | None = None) -> Verdict:
    """What the ladder says once the stop-time diagnosis (or the alignment test, or a replay) named ``failed``:
    evict them (restoring no step newer than ``max_step``), else restart in place, roll back or wait for a human by
    the incident's level."""
    t = Triage(job, category, tuple(machines))
    return following(decide(t, level=level, rollback_to=rollback_to, diagnosis_done=True,
                            diagnosis_failed=sorted(failed)), rollback_to=rollback_to, max_step=max_step)


def after_analysis(category: str, analysis: Mapping[str, Any]) -> Verdict:
    """A hang's stacks: over-evict the outliers' parallel group (the outliers' own machines first when the pool is
    short); ``diagnose`` when nothing stands out; left alone when every rank has stepped past the stall the alerts
    reported (``passed``: a pause of the program's own, not a hang)."""
    passed = analysis.get("passed")
    if isinstance(passed, int) and not isinstance(passed, bool):
        return Verdict("leave", resolved=f"{category}: every rank stepped on past the stall (at step {passed} by the "
                                         f"stacks): a pause of the job's own, no hang")
    if not analysis.get("machines"):
        return Verdict("diagnose")
    group = analysis.get("group_kind") or "machine"
    return Verdict("evict", tuple(analysis["machines"]),
                   f"{category}: ranks {analysis.get('outliers')} stand out; {group} group evicted",
                   priority=tuple(m for m in analysis.get("culprits") or () if m in analysis["machines"]))


def after_vote(vote: Mapping[str, Any], *, blocked: str = "") -> Verdict:
    """The fail-slow vote's verdict: the slow group evicted, or nothing (superseded, nothing stood out, or the group
    cannot be replaced now, ``blocked`` says why: then the job trains on at its reduced speed)."""
    if vote.get("superseded") or not vote.get("machines"):
        return Verdict("leave")
    kind, machines = vote.get("verdict") or "machine", ", ".join(vote["machines"])
    if blocked:
        return Verdict("leave", not_evicted=f"the slow {kind} group ({machines}) was not evicted: {blocked}; the job "
                                            f"trains on at its reduced speed")
    return Verdict("evict", tuple(vote["machines"]), f"slow: the {kind} group of {machines} held the slowest ranks "
                                                      f"in most of {len(vote.get('rounds') or ())} rounds")


def after_probe(probe: Mapping[str, Any]) -> Verdict:
    """A silent agent's machine probed: unreachable or unhealthy, it is evicted; healthy, its agent was restarted
    and the job is left alone."""
    faulty = probe.get("faulty") or {}
    if not faulty:
        return Verdict("leave", resolved="; ".join(f"{m}: {why}" for m, why in sorted((probe.get("restarted")
                                                                                         or {}).items())))
    return Verdict("evict", tuple(sorted(faulty)),
                   "silent agent, and the machine " + "; ".join(f"{m} {why}" for m, why in sorted(faulty.items())))
