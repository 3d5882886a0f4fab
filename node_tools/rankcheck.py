"""The real-time check of a machine's training ranks (:class:`RankCheck`, every 0.25 s): a rank exited, its
heartbeat stopped, no progress beyond a calibrated timeout, NaN or 5x jumps in loss and gradient norm, slow
steps, a sustained decline of the job's throughput. One of the agent's checks
(:mod:`trainguard.node_tools.checks`).

It trusts what it observes over what files claim: a rank's heartbeat and progress are judged by whether
their contents *changed*, timed on the agent's own monotonic clock (a rank whose clock steps back an hour
still beats), and a rank is called stopped only on proof: its process is in state ``T``, or its heartbeat
stayed unchanged past the threshold while the process used no CPU for a further second.
"""

from __future__ import annotations

import json
import math
import os
import signal
import statistics
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainguard.core import procs
from trainguard.node_tools import monitor
from trainguard.node_tools.checks import Check, Finding, read_json
from trainguard.node_tools.job import HANG_FLOOR_RANGE


@dataclass
class RankTimeouts:
    """How long a rank may go without progress before it counts as hung.

    The timeout is calibrated from what the rank has shown (as NVRx does):
    ``max(floor_s, factor x the longest step interval seen recently)`` (a job's spec may set its own floor:
    ``hang_floor_s``, recorded in its ``job.json``), where the
    ``ignore_longest`` longest intervals of the window are left out once it holds
    20 or more, so a one-off stall (an earlier fault, a restore) does not inflate
    it while step kinds that recur (an evaluation every N steps) still count.
    Before ``min_steps`` steps it is ``startup_s`` (imports, rendezvous, first step).

    Attributes:
        floor_s: lower bound of the calibrated timeout, seconds. 3 s: NVRx calibrates its heartbeat timeout with no
            floor (1.1 s on 0.2 s steps), and a lost machine or a rank stalled in a collective costs every GPU of
            the job each second of it; the floor is there for a job's own first pause that its steps never showed
            (a first evaluation outside a step, a first save of its own), which should stay under it, come in a
            step, or raise the job's ``hang_floor_s``; a pause that passed before the runtime analysis looked is
            left alone there (:func:`trainguard.operators.tasks.rungs.runtime_analysis`).
        factor: safety factor on the longest observed step interval.
        startup_s: timeout before the rank has shown ``min_steps`` steps, seconds.
        min_steps: steps needed before calibration applies.
        window: how many recent step intervals the calibration looks at.
        stale_heartbeat_s: a heartbeat unchanged this long (the agent's monotonic clock) while the
            process exists is a candidate for "stopped", seconds.
        confirm_s: ... and it is called stopped once the process used no CPU time for this much longer
            (a process in state ``T`` needs no confirmation; one in a tracing stop, ``t``, is called
            stopped once it stayed there this long: py-spy pauses a rank so while it takes its stacks),
            seconds.
        spike_factor: a loss / grad norm above this multiple of the recent median is a spike.
        spike_history: steps of history needed before spikes are judged.
        spike_over_max: ... and above this multiple of the largest of its recent values (a loss on noisy data, a
            small model's on random batches, swings past 5x its median every few steps and past 15x now and then:
            a spike is what the recent history never came near).
        spike_quiet_s: a rank reports a spike of one kind at most once in this many seconds (its steps' clock, the
            agent's for a record without its time):
            a spike is an observation recorded without an incident, and a noisy loss must not flood the bus.
        slow_factor: a step time above this multiple of the recent median counts as slow ...
        slow_spread: ... and above the median by this many robust spreads (1.4826 x the median absolute deviation)
            of the rank's normal steps: a job whose steps swing by half on a busy host is judged on its own noise ...
        slow_min_excess_s: ... and by at least this much, seconds (a 10 ms step at 30 ms is no straggler) ...
        slow_min_s: ... for ``slow_steps`` steps in a row that took this long together, seconds (three slow 10 ms
            steps are a scheduling hiccup; a few seconds of them are a rank's pace).
        slow_steps: consecutive slow steps that make a ``rank_slow`` finding.
        slow_history: normal steps of an incarnation needed before step times are judged (a rank slow
            from its first steps is learned as normal: keep this short).
        ignore_longest: longest step intervals left out of the calibration (see above).
        recur_s: a long interval (over 3x the median: a program's own evaluation or checkpoint every N steps) seen
            twice within this many seconds recurs: the calibration keeps the shorter of the two longest such
            intervals of that time however many steps came between (an evaluation every 2,000 steps of 10 ms
            falls out of a window of 100 steps, and the next one was called a hang).
        decline: the job's throughput has declined when its throughput over its last steps (the window: their
            tokens over their time, the harmonic mean of their tokens/s, leaving out steps over
            ``decline_outlier`` times the window's median step: an evaluation, a checkpoint of the program's own)
            is below ``1 - decline`` of its throughput over the steps before them, and below it by
            ``decline_spread`` robust spreads of the windows' throughput seen so far (a job's own noise); long
            steps are left out while rare (at most a quarter of the last 32), counted once they are the pace. One
            step's tokens/s is noise: on a busy host it swings by a quarter from step to step.
        decline_steps: the window holds at least this many steps ...
        decline_window_s: ... and at least this many seconds of them (500 steps of a 10 ms job, not 16); a
            ``throughput_decline`` finding needs the window below for half as many steps in a row (a sudden 23%
            decline of 0.6 s steps is reported on its 17th step).
        decline_history: the baseline holds at least this many steps (at least ``decline_steps`` of them needed) ...
        decline_history_s: ... and at least this many seconds of them; a step enters it as it leaves the window,
            unless the window was below by then.
        decline_spread: see ``decline``; judged once ``decline_samples`` windows were seen.
        decline_samples: windows (one per window's length of steps) whose throughput measures the job's noise.
        decline_outlier: see ``decline``.
        decline_persist_s: a ``throughput_decline`` also needs the window below for this long, seconds (a burst of
            load on a shared host takes a window of 5 s below for about as long as the burst and the window).
        decline_relearn: consecutive declined steps after which the lower throughput is the new normal ...
        decline_relearn_s: ... and that took this long together, seconds.
        release_replicas: kill a rank proven stopped (not one a debugger holds) when it belongs to a replica group
            (:meth:`RankCheck._release`): the other groups then train on without waiting out their collective's
            timeout.
    """

    floor_s: float = 3.0
    factor: float = 5.0
    startup_s: float = 600.0
    min_steps: int = 3
    window: int = 100
    stale_heartbeat_s: float = 2.5
    spike_factor: float = 5.0
    spike_history: int = 50
    spike_over_max: float = 2.0
    spike_quiet_s: float = 300.0
    slow_factor: float = 2.5
    slow_spread: float = 6.0
    slow_min_excess_s: float = 0.05
    slow_min_s: float = 1.5
    slow_steps: int = 3
    slow_history: int = 5
    ignore_longest: int = 2
    confirm_s: float = 1.0
    recur_s: float = 900.0
    decline: float = 0.15
    decline_steps: int = 16
    decline_window_s: float = 5.0
    decline_history: int = 48
    decline_history_s: float = 15.0
    decline_spread: float = 2.0
    decline_samples: int = 8
    decline_outlier: float = 3.0
    decline_persist_s: float = 10.0
    decline_relearn: int = 60
    decline_relearn_s: float = 30.0
    release_replicas: bool = True


LEARN_FACTOR = 1.5  # a step time above this multiple of the baseline does not teach the baseline
# a rank's recent compute in its alerts' evidence: its steps of the last seconds (at least five); the vote's look
# (tg-node job status) takes 3 s of them (trainguard.node_tools.job.RECENT_S)
RECENT_S = 2.0
MAX_WINDOW_STEPS = 20000  # no window holds more steps than this, however short they are
SPIKE_HISTORY = 100  # the recent values a loss or gradient norm spike is judged against


# the longest a rank's own word that it holds still on purpose is trusted: past it, no progress is a hang
MAX_HOLD_S = 900.0


@dataclass
class _Run:
    """A condition seen on consecutive steps, raised once per run: ``n`` steps so far, ``raised`` once reported."""

    n: int = 0
    raised: bool = False

    def end(self) -> None:
        self.n, self.raised = 0, False

    def step(self, *, needed: int, relearn: int) -> str:
        """One more step of the run: "relearn" once it lasted ``relearn`` steps (the run ends: its level is the
        new normal), "raise" on its ``needed``-th step unless raised already, else ""."""
        self.n += 1
        if self.n >= relearn:
            self.end()
            return "relearn"
        if self.n < max(1, needed) or self.raised:
            return ""
        self.raised = True
        return "raise"


@dataclass
class _RankState:
    key: tuple[str, int, int] = ("", 0, 0)  # (job, incarnation, rank)
    offset: int = 0
    times: deque = field(default_factory=lambda: deque(maxlen=100))
    losses: deque = field(default_factory=lambda: deque(maxlen=SPIKE_HISTORY))
    step_times: deque = field(default_factory=lambda: deque(maxlen=64))
    slow_run: int = 0
    slow_run_s: float = 0.0  # the current run of slow steps' time together
    slow: bool = False
    sdc: bool = False
    grads: deque = field(default_factory=lambda: deque(maxlen=SPIKE_HISTORY))
    steps_seen: int = 0
    nan: bool = False
    spike: dict[str, bool] = field(default_factory=dict)
    spike_said: dict[str, float] = field(default_factory=dict)  # kind -> its last spike's time (the steps' clock)
    # what the agent observed, on its own monotonic clock
    records_seen: float | None = None  # when the last step record was read
    beat: Any = None  # the heartbeat's content that changes with every flush
    beat_seen: float = 0.0  # when it last changed
    progress: Any = None  # the heartbeat's progress (step, collectives completed)
    progress_seen: float = 0.0
    frozen: tuple[int, float] | None = None  # (CPU ticks, since) while a stale heartbeat is being confirmed
    released: bool = False  # the rank was killed for its replica group (RankCheck._release)
    held_seen: float | None = None  # when the rank was first seen holding still on purpose (status "held")
    traced_seen: float | None = None  # when the rank was first seen in a tracing stop ("t") in a row
    tput: deque = field(default_factory=deque)  # the baseline's steps: (tokens, seconds, kept, wall seconds)
    tput_recent: deque = field(default_factory=deque)  # the window's steps, likewise
    tput_win: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # the window's running sums (see _add)
    tput_base: list = field(default_factory=lambda: [0.0, 0.0, 0.0])  # the baseline's
    tput_windows: deque = field(default_factory=lambda: deque(maxlen=64))  # past windows' throughput (the noise)
    tput_since: int = 0  # steps since the last window was sampled into ``tput_windows``
    tput_needed: float = 0.15  # the decline the last step needed (the threshold, noise counted)
    long_seen: deque = field(default_factory=lambda: deque(maxlen=16))  # (agent's clock, interval) of long ones
    long_recent: deque = field(default_factory=lambda: deque(maxlen=32))  # whether each of the last steps was long
    decline: _Run = field(default_factory=_Run)  # the window's throughput below its baseline
    grew: _Run = field(default_factory=_Run)  # the rank's own compute grown (see RankCheck._grown)
    relearning: bool = False  # the decline's baseline refills after a relearn: no decline can be judged yet
    compute_recent: deque = field(default_factory=deque)  # (compute, step time) of the steps of the last RECENT_S
    compute_window: deque = field(default_factory=deque)  # the decline window's steps' compute time
    compute_base: deque = field(default_factory=lambda: deque(maxlen=512))  # normal steps' compute time
    decline_run_s: float = 0.0  # the current run of declined steps' time together
    compute_recent_s: float = 0.0  # the step time of the steps in ``compute_recent`` together


class RankCheck(Check):
    """Ranks of every job running on this machine, from the in-job hook's files and /proc."""

    name, group, interval_s = "ranks", "host", 0.25

    def __init__(self, workdir: Path, *, timeouts: RankTimeouts | None = None, clock: Any = time.monotonic) -> None:
        self.jobs_dir = Path(workdir) / "jobs"
        self.t = timeouts or RankTimeouts()
        self.state: dict[tuple[str, int, int], _RankState] = {}
        self.clock = clock

    def _jobs(self) -> list[tuple[str, Path, dict[str, Any]]]:
        out = []
        try:
            entries = sorted(self.jobs_dir.iterdir())
        except OSError:
            return []
        for d in entries:
            try:
                record = json.loads((d / "job.json").read_text())
            except (OSError, ValueError):
                continue
            if record.get("stop_requested_ts"):
                continue
            out.append((d.name, d, record))
        return out

    def timeout_for(self, st: _RankState, floor_s: float | None = None) -> float:
        """The rank's hang timeout now, seconds (``floor_s``: its job's own floor, else the agent's)."""
        if st.steps_seen < self.t.min_steps or not st.times:
            return self.t.startup_s
        ordered = sorted(st.times)
        if len(ordered) >= 20:
            ordered = ordered[: len(ordered) - self.t.ignore_longest]
        longest = ordered[-1]
        now = self.clock()
        recurring = sorted(t for seen, t in st.long_seen if now - seen <= self.t.recur_s)
        if len(recurring) >= 2:  # a long step that came back (the program's own evaluation): it counts
            longest = max(longest, recurring[-2])
        return max(self.t.floor_s if floor_s is None else floor_s, self.t.factor * longest)

    def _release(self, record: dict[str, Any], pid: Any, pid_start: Any, state: str | None) -> str | None:
        """A stopped rank of a replica group (its launch recorded ``replica``) holds every other group inside the
        collective it never joins, until the collective's timeout; its group is taken out and its machine swapped
        anyway (the degrade path). Killed now (SIGKILL: the kernel closes its connections, so the others' collective
        fails at once and their next quorum leaves the group out): returns what was done, else None. A rank a
        debugger holds (a tracing stop) is left to the person at the debugger; a job that is one group is left to
        the control plane's stop."""
        spec = record.get("spec")
        if not self.t.release_replicas or state == "t" or not isinstance(spec, dict) \
                or spec.get("replica") is None or not isinstance(pid, int):
            return None
        if procs.proc_state(pid, pid_start) in (None, "Z", "X"):  # gone, or its pid another process's now
            return None
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            return None
        return (f"killed (SIGKILL) so that replica group {spec.get('replica')}'s peers leave it out of their next "
                f"quorum at once instead of at their collective's timeout")

    def _read_new_steps(self, run_dir: Path, rank: int, st: _RankState) -> list[dict[str, Any]]:
        path = monitor.steps_path(run_dir, rank)
        try:
            with open(path, encoding="utf-8") as fh:
                fh.seek(st.offset)
                data = fh.read()
        except OSError:
            return []
        complete = data[: data.rfind("\n") + 1]
        st.offset += len(complete.encode())
        records = []
        for line in complete.splitlines():
            try:
                records.append(json.loads(line))
            except ValueError:
                continue
        return records

    def run(self, now: float) -> list[Finding]:
        found: list[Finding] = []
        for job, run_dir, record in self._jobs():
            inc = int(record.get("incarnation", 0))
            exit_doc = read_json(run_dir / "exit.json")
            for hb_path in sorted((run_dir / "ranks").glob("rank*.json")):
                stem = hb_path.stem[4:]
                if not stem.isdigit():
                    continue
                rank = int(stem)
                hb = monitor.read_heartbeat(run_dir, rank)
                if not hb or hb.get("incarnation", 0) != inc:
                    continue
                key = (job, inc, rank)
                st = self.state.get(key)
                if st is None:
                    for old in [k for k in self.state if k[0] == job and k[1] < inc]:  # an earlier incarnation's
                        del self.state[old]
                    st = self.state[key] = _RankState(key=key)
                    st.offset = _offset_of_incarnation(monitor.steps_path(run_dir, rank), inc)
                found += self._rank(job, rank, hb, st, run_dir, record, exit_doc, now)
        return found

    def _rank(self, job: str, rank: int, hb: dict[str, Any], st: _RankState, run_dir: Path,
              record: dict[str, Any], exit_doc: dict[str, Any] | None, now: float) -> list[Finding]:
        found: list[Finding] = []
        mono = self.clock()
        fresh = [rec for rec in self._read_new_steps(run_dir, rank, st)
                 if rec.get("incarnation", 0) == record.get("incarnation", 0)]
        if fresh:
            # step intervals as the agent saw them arrive: no rank's clock is trusted for the calibration; a
            # backlog read at once (the agent just started) counts each step's own duration (the rank's
            # monotonic timer) instead
            if st.records_seen is not None and st.steps_seen:
                interval = (mono - st.records_seen) / len(fresh)
                if len(st.times) >= 5 and interval > 3.0 * statistics.median(st.times):
                    st.long_seen.append((mono, interval))
                st.times.extend([interval] * len(fresh))
            else:
                st.times.extend(t for t in (_num(r.get("step_time_s")) for r in fresh) if 0 < t < 3600)
            st.records_seen = mono
        for rec in fresh:
            found += self._metrics(job, rank, rec, st)
            st.steps_seen += 1
        beat = (hb.get("beat"), hb.get("alive_ts"))
        if beat != st.beat or not st.beat_seen:
            st.beat, st.beat_seen = beat, mono
        progress = (hb.get("progress_ts"), hb.get("step"),
                    sum(int(c.get("completed", 0)) for c in (hb.get("collectives") or {}).values()
                        if isinstance(c, dict)))
        if progress != st.progress or not st.progress_seen:
            st.progress, st.progress_seen = progress, mono
        status = hb.get("status")
        pid = hb.get("pid")
        state = procs.proc_state(pid, hb.get("pid_start")) if pid else None  # a reused pid is not the rank
        base = {"pid": pid, "step": hb.get("step"), "collectives": hb.get("collectives", {})}
        if status in ("finished",):
            return found
        if state is None or state in ("Z", "X"):
            evidence = dict(base, status=status, returncode=(exit_doc or {}).get("returncode"),
                            log_tail=_log_tail(record, hb.get("local_rank", 0)))
            found.append(Finding("rank_exit", f"exit:{job}:{rank}", f"rank {rank} of job {job} exited "
                                 f"(status {status}, pid {pid})", job=job, rank=rank, evidence=evidence))
            return found
        unchanged = mono - st.beat_seen
        # "T" (SIGSTOP) is proof at once. "t", a tracing stop, is also what py-spy's own dump of the rank looks
        # like while it lasts (the runtime analysis takes every rank's stacks): proof only once it lasted
        # confirm_s on this agent's clock, or every stack collection could open an incident of its own
        if state == "t":
            st.traced_seen = mono if st.traced_seen is None else st.traced_seen
        else:
            st.traced_seen = None
        traced = st.traced_seen is not None and mono - st.traced_seen >= self.t.confirm_s
        stopped = state == "T" or traced
        if not stopped and state != "t" and unchanged > self.t.stale_heartbeat_s:  # a tracing stop has its own clock
            ticks = procs.cpu_seconds(pid)
            if st.frozen is None or ticks != st.frozen[0]:
                st.frozen = (ticks if ticks is not None else -1, mono)  # running, or just started confirming
            elif mono - st.frozen[1] >= self.t.confirm_s:
                stopped = True  # its heartbeat stopped and it used no CPU since: frozen
        else:
            st.frozen = None
        if stopped:
            released = self._release(record, pid, hb.get("pid_start"), state) if not st.released else None
            st.released = st.released or released is not None
            found.append(Finding("rank_stopped", f"stopped:{job}:{rank}",
                                 f"rank {rank} of job {job}: heartbeat unchanged for {unchanged:.1f}s, process "
                                 f"state {state}", job=job, rank=rank,
                                 evidence=dict(base, alive_age_s=round(unchanged, 3), process_state=state,
                                               confirmed="process stopped" if state == "T"
                                               else "process traced (a debugger holds it) for "
                                                    f"{mono - st.traced_seen:.1f}s" if traced
                                               else "no CPU time used",
                                               **({"released": released} if released else {}))))
            return found
        progress_age = mono - st.progress_seen
        timeout = self.timeout_for(st, _job_floor(record))
        hold = hb.get("hold") if status == "held" else None
        if isinstance(hold, dict):
            # the rank stopped stepping on purpose (a non-finite loss: it waits for the control plane); trusted
            # for the time it gave, on this agent's clock, and judged as any rank once that has passed
            seconds = _num(hold.get("seconds"))
            seconds = min(seconds, MAX_HOLD_S) if math.isfinite(seconds) and seconds > 0 else 0.0
            st.held_seen = mono if st.held_seen is None else st.held_seen
            if mono - st.held_seen <= seconds:
                return found
            progress_age = mono - max(st.progress_seen, st.held_seen + seconds)
        else:
            st.held_seen = None
        if progress_age > timeout:
            found.append(Finding("rank_hang", f"hang:{job}:{rank}",
                                 f"rank {rank} of job {job}: no progress for {progress_age:.1f}s "
                                 f"(timeout {timeout:.1f}s)", job=job, rank=rank,
                                 evidence=dict(base, progress_age_s=round(progress_age, 3),
                                               timeout_s=round(timeout, 3))))
        return found

    def _metrics(self, job: str, rank: int, rec: dict[str, Any], st: _RankState) -> list[Finding]:
        found = []
        loss, grad = _num(rec.get("loss")), _num(rec.get("grad_norm"))
        step = rec.get("step")
        step_time = _num(rec.get("step_time_s"))
        compute = monitor.step_compute(rec)
        leaving = None
        if math.isfinite(compute):
            # the recent compute: the last steps of RECENT_S seconds (at least 5), not five 10 ms steps
            wall = step_time if math.isfinite(step_time) and step_time > 0 else 0.0
            st.compute_recent.append((max(0.0, compute), wall))
            st.compute_recent_s += wall
            while len(st.compute_recent) > 5 and (
                    st.compute_recent_s - st.compute_recent[0][1] >= RECENT_S or st.compute_recent[0][1] <= 0
                    or len(st.compute_recent) > MAX_WINDOW_STEPS):
                st.compute_recent_s -= st.compute_recent.popleft()[1]
            leaving = _slide(st.compute_window, max(0.0, compute), max(self.t.decline_steps, len(st.tput_recent)))
        found += self._slow(job, rank, rec, st)
        found += self._decline(job, rank, rec, st)
        found += self._grown(job, rank, rec, st)
        # the normal compute time learns a step as it leaves the decline's window, and only while no slowdown is
        # seen: a slowdown small enough to take the window a while to show must not become the rank's normal
        # first (its compute growth would then read 1.0x, as a waiting peer's does)
        if leaving is not None and not st.slow_run and not st.decline.n and not st.grew.n:
            st.compute_base.append(leaving)
        if rec.get("dp_digests_match") is False and not st.sdc:
            found.append(Finding("sdc_suspect", f"sdc:{job}:{rank}",
                                 f"rank {rank} of job {job}: parameters differ from its DP peers at step {step}",
                                 job=job, rank=rank,
                                 evidence={"step": step, "param_digest": rec.get("param_digest"),
                                           "dp_digests": rec.get("dp_digests")}))
        st.sdc = rec.get("dp_digests_match") is False
        if not (math.isfinite(loss) and math.isfinite(grad)):
            if not st.nan:
                st.nan = True
                found.append(Finding("nan_loss", f"nan:{job}:{rank}", f"rank {rank} of job {job}: loss {loss}, "
                                     f"grad norm {grad} at step {step}", job=job, rank=rank,
                                     evidence={"step": step, "loss": str(loss), "grad_norm": str(grad)}))
            return found
        st.nan = False
        if rec.get("healed_from_step") is not None:
            # a replica group's step that received a live replica's state: its loss and gradients were computed on
            # the state it had before (torchft applies the state at the step's commit), not a spike of training
            return found
        for kind, value, hist in (("loss_spike", loss, st.losses), ("grad_spike", grad, st.grads)):
            if len(hist) >= self.t.spike_history:
                median = statistics.median(hist)
                spiking = median > 0 and value > max(self.t.spike_factor * median, self.t.spike_over_max * max(hist))
                when = _num(rec.get("ts"))
                when = when if math.isfinite(when) else self.clock()  # a record without its time: the agent's
                quiet = when - st.spike_said.get(kind, -math.inf) < self.t.spike_quiet_s
                if spiking and not st.spike.get(kind) and not quiet:
                    st.spike_said[kind] = when
                    found.append(Finding(kind, f"{kind}:{job}:{rank}:{step}",
                                         f"rank {rank} of job {job}: {kind.split('_')[0]} {value:.4g} at step {step} "
                                         f"is {value / median:.1f}x the recent median {median:.4g}",
                                         job=job, rank=rank,
                                         evidence={"step": step, "value": value, "median": median}))
                st.spike[kind] = spiking
            hist.append(value)
        return found

    def _slow(self, job: str, rank: int, rec: dict[str, Any], st: _RankState) -> list[Finding]:
        step_time = _num(rec.get("step_time_s"))
        if not math.isfinite(step_time):
            return []
        hist = st.step_times
        baseline = statistics.median(hist) if len(hist) >= self.t.slow_history else None
        spread = _spread(hist, baseline) if baseline is not None else 0.0
        limit = None if baseline is None else max(self.t.slow_factor * baseline, baseline + self.t.slow_spread * spread,
                                                  baseline + self.t.slow_min_excess_s)
        is_slow = limit is not None and step_time > limit
        st.slow_run, st.slow_run_s = (st.slow_run + 1, st.slow_run_s + step_time) if is_slow else (0, 0.0)
        if not is_slow:
            # the baseline learns only from normal steps: not from elevated ones either, or a slowdown
            # that starts below the threshold would raise the baseline until it is never judged slow
            if baseline is None or step_time <= max(LEARN_FACTOR * baseline, baseline + 3.0 * spread):
                hist.append(step_time)
            st.slow = False
            return []
        if st.slow_run < self.t.slow_steps or st.slow_run_s < self.t.slow_min_s or st.slow:
            return []
        st.slow = True
        assert baseline is not None and limit is not None
        comm, compute = _num(rec.get("comm_s")), monitor.step_compute(rec)
        return [Finding("rank_slow", f"slow:{job}:{rank}",
                        f"rank {rank} of job {job}: {st.slow_run} steps at {step_time:.3f}s, "
                        f"{step_time / baseline:.1f}x the median {baseline:.3f}s", severity="warning",
                        job=job, rank=rank,
                        evidence={"step": rec.get("step"), "step_time_s": step_time, "baseline_s": baseline,
                                  "spread_s": round(spread, 6), "limit_s": round(limit, 6),
                                  "slow_for_s": round(st.slow_run_s, 3),
                                  "comm_s": comm, "compute_s": compute if math.isfinite(compute) else None,
                                  **_compute_growth(st)})]

    def _decline(self, job: str, rank: int, rec: dict[str, Any], st: _RankState) -> list[Finding]:
        """A sustained decline of the job's throughput (over its last steps, against the steps before them):
        too small for ``rank_slow``, large enough that at scale the whole job runs at a straggler's pace.
        A window's throughput is judged, not each step's: under load one step's swings by a quarter, and a rule
        of consecutive low steps is reset by every lucky one (a 30% slow rank went unreported for 15 minutes).
        The windows are measured in seconds as well as steps (16 steps of a 10 ms job are one scheduling hiccup),
        a window's rare long step (the program's own evaluation or checkpoint) is left out of its throughput, and
        a decline must stand out of the noise the job's own windows showed."""
        tput = _num(rec.get("tokens_per_s"))
        if not math.isfinite(tput) or tput <= 0:
            return []
        dt = _num(rec.get("step_time_s"))
        dt = dt if math.isfinite(dt) and dt > 0 else 0.0
        # a step as (tokens, seconds, kept, wall seconds): its time unknown, it counts as one token in 1/tput seconds
        # (the windows are then the harmonic mean of their tokens/s, by steps alone); a step over decline_outlier
        # times the rank's normal step is left out of the throughput (kept 0) but not out of the window's time
        typical = statistics.median(st.step_times) if len(st.step_times) >= self.t.slow_history else 0.0
        long = dt > 0 and typical > 0 and dt > self.t.decline_outlier * typical
        st.long_recent.append(long)
        # ... while long steps are rare: when a quarter of the last steps are long, they are the job's pace now (a
        # straggler that makes 7 ms steps 33 ms long), not its evaluation
        kept = 0.0 if long and 4 * sum(st.long_recent) <= len(st.long_recent) else 1.0
        one = (tput * dt, dt, kept, dt) if dt > 0 else (1.0, 1.0 / tput, kept, 0.0)
        hist, recent, win, base = st.tput, st.tput_recent, st.tput_win, st.tput_base
        # a window already half a decline below its baseline teaches the baseline nothing: a slowdown that creeps up
        # by steps each under the threshold must not become the normal one step at a time (a straggler whose sleep
        # grew 15%, 14%, 24%, then 36% was never reported)
        ready = len(hist) >= max(1, self.t.decline_steps) and len(recent) >= max(1, self.t.decline_steps)
        sinking = ready and _throughput(win) < (1.0 - st.tput_needed / 2) * _throughput(base)
        recent.append(one)
        _add(win, one, 1)
        while len(recent) > max(1, self.t.decline_steps) and (
                recent[0][3] <= 0 or win[2] - recent[0][3] >= self.t.decline_window_s
                or len(recent) > MAX_WINDOW_STEPS):
            leaving = recent.popleft()
            _add(win, leaving, -1)
            if st.decline.n or sinking:  # the baseline learns from steps no decline was seen in
                continue
            hist.append(leaving)
            _add(base, leaving, 1)
            while len(hist) > max(self.t.decline_steps, self.t.decline_history) and (
                    hist[0][3] <= 0 or base[2] - hist[0][3] >= self.t.decline_history_s
                    or len(hist) > MAX_WINDOW_STEPS):
                _add(base, hist.popleft(), -1)
        window = len(recent)
        if len(hist) < max(1, self.t.decline_steps) or window < max(1, self.t.decline_steps):
            return []
        st.relearning = False
        baseline, now = _throughput(base), _throughput(win)
        if baseline <= 0 or now <= 0:
            return []
        st.tput_since += 1
        if st.tput_since >= window and not st.decline.n and not sinking:  # a whole window since the last sample
            st.tput_windows.append(now)
            st.tput_since = 0
        needed = self.t.decline
        if len(st.tput_windows) >= self.t.decline_samples:
            samples = list(st.tput_windows)
            middle = statistics.median(samples)
            if middle > 0:
                needed = max(needed, self.t.decline_spread * _spread(samples, middle) / middle)
        st.tput_needed = needed
        if now >= (1.0 - needed) * baseline:
            st.decline.end()
            st.decline_run_s = 0.0
            return []
        st.decline_run_s += dt
        relearn = self.t.decline_relearn if st.decline_run_s >= self.t.decline_relearn_s else MAX_WINDOW_STEPS ** 2
        # below for half a window of steps, and for decline_persist_s: a burst of load on the host takes the window
        # below for about as long as the burst and the window together, a straggler for good
        needed_steps = window // 2 if st.decline_run_s >= self.t.decline_persist_s else st.decline.n + 2
        verdict = st.decline.step(needed=needed_steps, relearn=relearn)
        if verdict == "relearn":  # lasting: the new normal (the vote had its chance)
            hist.clear()
            base[:] = [0.0, 0.0, 0.0]
            st.decline_run_s = 0.0
            st.relearning = True
        if verdict != "raise":
            return []
        return [Finding("throughput_decline", f"decline:{job}:{rank}",
                        f"rank {rank} of job {job}: {now:.0f} tokens/s over its last {window} steps, "
                        f"{1 - now / baseline:.0%} below the {baseline:.0f} of the steps before", severity="warning",
                        job=job, rank=rank,
                        evidence={"step": rec.get("step"), "tokens_per_s": round(now, 1),
                                  "baseline_tokens_per_s": round(baseline, 1),
                                  "decline": round(1 - now / baseline, 3), "needed": round(needed, 3),
                                  "window_steps": window, "window_s": round(win[2], 3),
                                  "steps": st.decline.n, **_compute_growth(st)})]

    def _grown(self, job: str, rank: int, rec: dict[str, Any], st: _RankState) -> list[Finding]:
        """While the throughput decline cannot speak for a straggler (a decline every rank shared, a busy host,
        was raised and still stands, so a rank that starts to straggle raises nothing new; or its baseline
        refills after a relearn, which would take a straggler's pace for the job's normal): the rank's own
        compute per step (its local part, else the step less its wait in collectives) stayed ``1 + 2 * decline``
        times its normal one, and ``1 + decline`` times the median growth of the job's other ranks on this machine, for
        ``decline_steps`` steps: a ``throughput_decline`` of its own, raised once. Its peers' compute does not
        grow (they wait), a host's load grows every rank of the machine alike, and one slow device grows one
        rank: so this is the straggler's own word. It is not asked otherwise: on the busy 2-core host one rank's
        compute alone read 1.34x for 8 steps in a healthy job (a false fail-slow vote), a noise the job's
        throughput does not have. A rank with no peer on its machine (one rank per machine) is left to the
        throughput. A step between ``1 + decline`` and the threshold neither counts nor ends the run (one lucky
        step must not); below it, the run ends. Lasting ``decline_relearn`` steps, the grown compute is the
        rank's new normal."""
        if not (st.decline.raised or st.relearning):
            st.grew.end()
            return []
        growth = _compute_growth(st)
        ratio = growth.get("compute_ratio")
        peers = [g for k, v in self.state.items() if v is not st and k[:2] == st.key[:2]
                 for g in (_compute_growth(v).get("compute_ratio"),) if g is not None]
        if ratio is None or not peers or ratio < 1.0 + self.t.decline:
            st.grew.end()
            return []
        if ratio < 1.0 + 2 * self.t.decline or ratio < (1.0 + self.t.decline) * statistics.median(peers):
            return []  # grown, but not enough to count (or alike its peers): the run neither grows nor ends
        verdict = st.grew.step(needed=self.t.decline_steps, relearn=self.t.decline_relearn)
        if verdict == "relearn":
            st.compute_base.clear()
        if verdict != "raise":
            return []
        return [Finding("throughput_decline", f"grew:{job}:{rank}",
                        f"rank {rank} of job {job}: its compute per step is {ratio:.2f}x its normal for "
                        f"{st.grew.n} steps (its wait on the others left out)", severity="warning",
                        job=job, rank=rank,
                        evidence={"step": rec.get("step"), "steps": st.grew.n, "compute_grew": True,
                                  "local_peer_ratios": [round(g, 3) for g in sorted(peers)], **growth})]


def _slide(window: deque, value: float, size: int) -> float | None:
    """Append ``value`` to a window of ``size`` (at least 1) values; the value that left it, if one did."""
    window.append(value)
    return window.popleft() if len(window) > max(1, size) else None


def _add(sums: list[float], step: tuple[float, float, float, float], sign: int) -> None:
    """Add (``sign`` 1) or take out (-1) a step ``(tokens, seconds, kept, wall seconds)`` of a window's running sums
    ``[tokens kept, seconds kept, wall seconds]``: a window's throughput in constant time per step."""
    tokens, seconds, kept, wall = step
    sums[0] += sign * tokens * kept
    sums[1] += sign * seconds * kept
    sums[2] += sign * wall


def _throughput(sums: list[float]) -> float:
    """A window's throughput from its running sums (:func:`_add`): its kept steps' tokens over their time (steps of
    equal tokens: the harmonic mean of their tokens/s); 0 when none was kept."""
    return sums[0] / sums[1] if sums[1] > 0 else 0.0


def _spread(values: Any, center: float) -> float:
    """A robust spread of ``values`` around ``center``: 1.4826 x their median absolute deviation (the standard
    deviation of normal noise, unmoved by the odd outlier)."""
    return 1.4826 * statistics.median(abs(v - center) for v in values)


def _compute_growth(st: _RankState) -> dict[str, float]:
    """The rank's recent compute time (the median of its last steps, less their wait in collectives) against its
    own normal one: a straggler's grew, its peers' did not (they wait for it), and a load every rank shares grew
    all alike. The control plane compares the ranks' ratios (:func:`trainguard.operators.policy.ladder.
    shared_slowdown`); {} until both are known."""
    if len(st.compute_recent) < 3 or len(st.compute_base) < 5:
        return {}
    recent, base = statistics.median(c for c, _t in st.compute_recent), statistics.median(st.compute_base)
    if base <= 0:
        return {}
    return {"recent_compute_s": round(recent, 6), "baseline_compute_s": round(base, 6),
            "compute_ratio": round(recent / base, 4)}


_num = monitor.number  # a record's number, NaN for anything else



def _offset_of_incarnation(path: Path, incarnation: int, *, block: int = 1 << 16) -> int:
    """Byte offset of the first step record of ``incarnation`` (after the last complete record if it has none
    yet), found from the file's end backwards: its records are the newest, so what is read is that incarnation's
    (an agent restarted into a job of months reads its last stretch, not millions of records)."""
    try:
        fh = open(path, "rb")  # noqa: SIM115 - closed below
    except OSError:
        return 0
    with fh:
        found = None
        for offset, line in monitor.lines_back(fh, block=block):
            if found is None and not line.strip():
                continue
            if found is None:
                found = offset + len(line) + 1  # the end of the last complete record: where new ones start
            try:
                if json.loads(line).get("incarnation", 0) != incarnation:
                    return found
            except ValueError:
                continue
            found = offset
        return found or 0


def _job_floor(record: dict[str, Any]) -> float | None:
    """The hang floor the job's launch recorded (``hang_floor_s`` of its spec), or None: a record that holds
    anything else there is not trusted with it."""
    spec = record.get("spec")
    value = _num(spec.get("hang_floor_s")) if isinstance(spec, dict) else math.nan
    return value if math.isfinite(value) and HANG_FLOOR_RANGE[0] <= value <= HANG_FLOOR_RANGE[1] else None


def _log_tail(record: dict[str, Any], local_rank: int, lines: int = 20) -> list[str]:
    log_dir = record.get("log_dir")
    if not log_dir:
        return []
    logs = sorted(Path(log_dir).glob(f"*/attempt_*/{local_rank}/stderr.log"))
    if not logs:
        return []
    try:
        with open(logs[-1], "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 16384))
            return fh.read().decode(errors="replace").splitlines()[-lines:]
    except OSError:
        return []

