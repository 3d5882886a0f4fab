"""The real-time checks and the agent's rules, on real files and real processes (no cluster)."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import wait_until
from trainguard.core import procs
from trainguard.emulation.nvml import EmulatedNvml
from trainguard.node_tools import monitor
from trainguard.node_tools.agent import Agent, AgentSettings
from trainguard.node_tools.alerts import Alert
from trainguard.node_tools.bus import BusError, BusReader, SpoolBus
from trainguard.node_tools.checks import (
    Check,
    DiskCheck,
    Finding,
    GpuCheck,
    KernelLogCheck,
    NicCheck,
)
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.rankcheck import RankCheck, RankTimeouts


# ---- kernel log ---------------------------------------------------------------------------
def test_kernel_log_reports_only_new_matching_lines(tmp_path):
    log = tmp_path / "kmsg"
    log.write_text("NVRM: Xid (PCI:0000:18:00): 79, old line before the agent started\n")
    check = KernelLogCheck(log)
    assert check.run(0) == []
    with open(log, "a") as fh:
        fh.write("eth0: renamed\n")
        fh.write("NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, DBE\n")
        fh.write("Out of memory: Killed process 4242 (python) total-vm:1kB\n")
        fh.write("mce: [Hardware Error]: CPU 3: Machine Check: 0 Bank 5\n")
        fh.write("EXT4-fs error (device sda1): ext4_find_entry\n")
        fh.write("eth0: Link is Down\n")
        fh.write("NVRM: Xid (PCI:0000:3b:00): 31, half a line")  # not finished yet: not read
    found = check.run(1)
    assert [f.kind for f in found] == ["kernel_xid", "kernel_oom", "kernel_mce", "kernel_fs", "kernel_link"]
    assert found[0].evidence["xid"] == "48" and found[1].evidence["pid"] == "4242"
    assert len({f.key for f in found}) == 5
    with open(log, "a") as fh:
        fh.write("\n")
    assert [f.evidence.get("xid") for f in check.run(2)] == ["31"]
    log.write_text("")  # rotated
    with open(log, "a") as fh:
        fh.write("NVRM: Xid (PCI:0000:3b:00): 13, after rotation\n")
    assert [f.evidence.get("xid") for f in check.run(3)] == ["13"]


# ---- GPU ------------------------------------------------------------------------------------
def test_gpu_check_finds_each_emulated_fault_once(tmp_path):
    nv = EmulatedNvml(tmp_path / "nvml.json", machine="m0", gpus=4)
    nv.reset()
    check = GpuCheck(nv, expected=4)
    assert check.run(0) == []
    nv.inject("gpu_lost", {"gpu": 2})
    nv.inject("ecc", {"gpu": 1})
    nv.inject("thermal", {"gpu": 0, "temperature_c": 95})
    kinds = sorted(f.kind for f in check.run(1))
    assert kinds == ["gpu_ecc", "gpu_lost", "gpu_thermal", "gpu_xid", "gpu_xid"]  # Xid 79 and Xid 48
    again = sorted(f.kind for f in check.run(2))
    assert again == ["gpu_ecc", "gpu_lost", "gpu_thermal"]  # Xid events are reported once each
    nv.reset()  # the event log is emptied; a new event after it is new, even at the same list length
    assert check.run(3) == []
    nv.inject("xid", {"gpu": 0, "xid": 31})
    nv.inject("xid", {"gpu": 1, "xid": 43})
    assert sorted(f.evidence["xid"] for f in check.run(4)) == [31, 43]


# ---- NIC ------------------------------------------------------------------------------------
def _nic(tmp_path, operstate="up", carrier="1", rx_errors=0):
    d = tmp_path / "eth0"
    (d / "statistics").mkdir(parents=True, exist_ok=True)
    (d / "operstate").write_text(operstate + "\n")
    (d / "carrier").write_text(carrier + "\n")
    (d / "statistics" / "rx_errors").write_text(f"{rx_errors}\n")
    (d / "statistics" / "rx_dropped").write_text(f"{rx_errors * 10}\n")


def test_nic_check_link_and_error_counters(tmp_path):
    _nic(tmp_path)
    check = NicCheck("eth0", sysfs=tmp_path)
    assert check.run(0) == []
    _nic(tmp_path, rx_errors=0)
    assert check.run(1) == []
    _nic(tmp_path, rx_errors=5)
    (f,) = check.run(2)
    assert f.kind == "nic_errors" and f.evidence["delta"] == {"rx_errors": 5}  # drops alone are not errors
    _nic(tmp_path, operstate="down", carrier="0", rx_errors=5)
    (f,) = check.run(3)
    assert f.kind == "nic_down" and f.evidence["operstate"] == "down"
    assert NicCheck("eth9", sysfs=tmp_path).run(4)[0].kind == "nic_down"


# ---- disk -----------------------------------------------------------------------------------
def test_disk_check_free_space(tmp_path):
    assert DiskCheck(tmp_path, min_free_bytes=1, min_free_fraction=0.0).run(0) == []
    (f,) = DiskCheck(tmp_path, min_free_bytes=1 << 62, min_free_fraction=1.0).run(0)
    assert f.kind == "disk_full" and f.evidence["free_bytes"] > 0


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to mount a read-only tmpfs")
def test_disk_check_read_only_mount(tmp_path):
    target = tmp_path / "ro"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(target)], check=True)
    try:
        kinds = [f.kind for f in DiskCheck(target, min_free_bytes=1, min_free_fraction=0).run(0)]
        assert kinds == ["disk_readonly"]
    finally:
        subprocess.run(["umount", str(target)], check=True)


# ---- ranks ------------------------------------------------------------------------------------
class FakeJob:
    """A job's run directory with real processes standing in for ranks."""

    def __init__(self, workdir: Path, job: str = "j", incarnation: int = 0):
        self.dir = workdir / "jobs" / job
        (self.dir / "ranks").mkdir(parents=True)
        self.job, self.inc = job, incarnation
        monitor.write_json_atomic(self.dir / "job.json", {"job": job, "incarnation": incarnation,
                                                          "log_dir": str(self.dir / "logs")})
        self.procs: dict[int, subprocess.Popen] = {}

    def rank(self, r: int, *, status="running", alive_age=0.0, progress_age=0.0, pid_start_shift=0, **extra) -> None:
        if r not in self.procs:
            self.procs[r] = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        now = time.time()
        pid = self.procs[r].pid
        monitor.write_json_atomic(monitor.heartbeat_path(self.dir, r), {
            "rank": r, "local_rank": r, "pid": pid, "pid_start": procs.started(pid) + pid_start_shift,
            "status": status, "incarnation": self.inc, "alive_ts": now - alive_age, "progress_ts": now - progress_age,
            "step": 5, "collectives": {"dp": 3}, **extra,
        })

    def step(self, r: int, step: int, loss, grad=1.0, ts=None, **extra) -> None:
        with open(monitor.steps_path(self.dir, r), "a") as fh:
            fh.write(json.dumps({"step": step, "loss": loss, "grad_norm": grad, "ts": ts or time.time(),
                                 "incarnation": self.inc, **extra}) + "\n")

    def close(self):
        for p in self.procs.values():
            p.kill()
            p.wait()


@pytest.fixture
def fake_job(tmp_path):
    job = FakeJob(tmp_path)
    yield job
    job.close()


def kinds(findings: list[Finding]) -> list[str]:
    return sorted(f.kind for f in findings)


def test_healthy_ranks_give_nothing(tmp_path, fake_job):
    for r in range(2):
        fake_job.rank(r)
        for s in range(12):
            fake_job.step(r, s, 3.0 - 0.1 * s)
    assert RankCheck(tmp_path).run(time.time()) == []


def test_a_dead_rank_is_an_exit(tmp_path, fake_job):
    fake_job.rank(0)
    fake_job.rank(1)
    fake_job.procs[1].kill()
    fake_job.procs[1].wait()
    (f,) = RankCheck(tmp_path).run(time.time())
    assert (f.kind, f.rank, f.job) == ("rank_exit", 1, "j")


def test_a_finished_or_deliberately_stopped_rank_is_not_a_failure(tmp_path, fake_job):
    fake_job.rank(0, status="finished")
    fake_job.procs[0].kill()
    fake_job.procs[0].wait()
    assert RankCheck(tmp_path).run(time.time()) == []
    fake_job.rank(1)
    fake_job.procs[1].kill()
    fake_job.procs[1].wait()
    record = json.loads((fake_job.dir / "job.json").read_text())
    monitor.write_json_atomic(fake_job.dir / "job.json", record | {"stop_requested_ts": time.time()})
    assert RankCheck(tmp_path).run(time.time()) == []


class Clock:
    """The agent's monotonic clock, moved by hand."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_stopped_process_is_proof_and_a_stale_heartbeat_needs_a_frozen_process(tmp_path, fake_job):
    fake_job.rank(0)
    os.kill(fake_job.procs[0].pid, signal.SIGSTOP)
    try:
        wait_until(lambda: procs.proc_state(fake_job.procs[0].pid) == "T", timeout=5, what="the process to stop")
        (f,) = RankCheck(tmp_path).run(time.time())
        assert f.kind == "rank_stopped" and f.evidence["process_state"] == "T"
        assert f.evidence["confirmed"] == "process stopped"
    finally:
        os.kill(fake_job.procs[0].pid, signal.SIGCONT)
    clock = Clock()
    check = RankCheck(tmp_path, clock=clock)
    fake_job.rank(0)
    assert check.run(time.time()) == []
    clock.t += 3.0  # the heartbeat did not change for 3 s of the agent's clock ...
    assert check.run(time.time()) == []  # ... a candidate: is the process using CPU?
    clock.t += 1.1  # it used none for another second: frozen
    (f,) = check.run(time.time())
    assert f.kind == "rank_stopped" and f.evidence["confirmed"] == "no CPU time used"
    fake_job.rank(0)  # it beats again: no longer stopped
    assert check.run(time.time()) == []


@pytest.mark.parametrize("replica", [1, None])
def test_a_stopped_rank_of_a_replica_group_is_killed_so_the_other_groups_train_on(tmp_path, fake_job, replica):
    """A SIGSTOPped rank of one replica group held the other two inside their all-reduce for the collective's 2 s
    timeout (1.6 to 1.9 GPU-s each of the degrade path's 6.4 for a hang). Its group leaves anyway: killed at once,
    the kernel closes its connections and the others' collective fails now. A job that is one group is left to the
    control plane's stop (its stacks are evidence)."""
    record = json.loads((fake_job.dir / "job.json").read_text())
    monitor.write_json_atomic(fake_job.dir / "job.json", record | {"spec": {"replica": replica, "replicas": 3}})
    fake_job.rank(0)
    proc = fake_job.procs[0]
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_until(lambda: procs.proc_state(proc.pid) == "T", timeout=5, what="the process to stop")
        (f,) = RankCheck(tmp_path).run(time.time())
        assert f.kind == "rank_stopped" and f.evidence["process_state"] == "T"
        if replica is None:
            assert "released" not in f.evidence and proc.poll() is None
        else:
            assert "replica group 1" in f.evidence["released"]
            assert proc.wait(timeout=5) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)


def test_a_rank_a_debugger_holds_is_not_killed_for_its_replica_group(tmp_path, fake_job, monkeypatch):
    record = json.loads((fake_job.dir / "job.json").read_text())
    monitor.write_json_atomic(fake_job.dir / "job.json", record | {"spec": {"replica": 0, "replicas": 2}})
    fake_job.rank(0)
    pid = fake_job.procs[0].pid
    real = procs.proc_state
    monkeypatch.setattr(procs, "proc_state", lambda p, started_at=None: "t" if p == pid else real(p, started_at))
    clock = Clock()
    check = RankCheck(tmp_path, clock=clock)
    assert check.run(time.time()) == []
    clock.t += 1.0
    (f,) = check.run(time.time())
    assert f.kind == "rank_stopped" and "released" not in f.evidence and fake_job.procs[0].poll() is None


def test_a_tracing_stop_is_proof_only_once_it_lasts(tmp_path, fake_job, monkeypatch):
    """py-spy pauses a rank (state "t") for the moment it takes its stacks, as the runtime analysis does on
    every rank: an agent that took that for a stopped rank opened a hang incident of the control plane's own
    making after each analysis (the recovery benchmark's hang, then again on the job it had just restarted).
    A tracing stop that lasts (a debugger holds the rank) is still proof."""
    fake_job.rank(0)
    pid = fake_job.procs[0].pid
    states = {pid: "S"}
    real = procs.proc_state
    monkeypatch.setattr(procs, "proc_state",
                        lambda p, started_at=None: states.get(p) or real(p, started_at))
    clock = Clock()
    check = RankCheck(tmp_path, clock=clock)
    assert check.run(time.time()) == []
    for _ in range(3):  # py-spy dumps it again and again, each time for less than confirm_s
        states[pid] = "t"
        assert check.run(time.time()) == []
        clock.t += 0.6
        assert check.run(time.time()) == []
        states[pid] = "S"
        fake_job.rank(0)
        clock.t += 0.25
        assert check.run(time.time()) == []
    states[pid] = "t"  # and now it stays traced
    assert check.run(time.time()) == []
    clock.t += 1.0
    (f,) = check.run(time.time())
    assert f.kind == "rank_stopped" and f.evidence["process_state"] == "t"
    assert f.evidence["confirmed"].startswith("process traced")


def test_heartbeats_whose_clock_stepped_back_an_hour_still_beat(tmp_path, fake_job):
    """A rank whose clock stepped back an hour wrote heartbeats an hour old: the agent once called it stopped
    at once, and two healthy machines were evicted."""
    clock = Clock()
    check = RankCheck(tmp_path, clock=clock)
    for _ in range(20):
        fake_job.rank(0, alive_age=3600.0, progress_age=3600.0)  # stamped an hour behind, but rewritten
        fake_job.rank(1, alive_age=-3600.0, progress_age=-3600.0)  # an hour ahead
        assert check.run(time.time()) == []
        clock.t += 0.5


def test_a_process_that_computes_while_its_heartbeat_is_stuck_is_not_called_stopped(tmp_path, fake_job):
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        fake_job.procs[0] = busy
        clock = Clock()
        check = RankCheck(tmp_path, clock=clock, timeouts=RankTimeouts(floor_s=3.0, startup_s=20.0))
        fake_job.rank(0)
        check.run(time.time())
        def later(seconds: float) -> list[Finding]:
            """The agent's clock moves on; so does the busy process's CPU time (as it would in that time)."""
            clock.t += seconds
            before = procs.cpu_seconds(busy.pid)
            wait_until(lambda: procs.cpu_seconds(busy.pid) != before, timeout=5, what="a CPU tick")
            return check.run(time.time())

        for _ in range(6):
            assert "rank_stopped" not in kinds(later(3.0))
        assert kinds(later(30.0)) == ["rank_hang"]  # still no progress past the startup timeout: a hang
    finally:
        busy.kill()
        busy.wait()


def test_a_rank_whose_pid_was_reused_by_another_process_has_exited(tmp_path, fake_job):
    fake_job.rank(0)
    assert RankCheck(tmp_path).run(time.time()) == []
    fake_job.rank(0, pid_start_shift=-1)  # its pid is another process's now
    (f,) = RankCheck(tmp_path).run(time.time())
    assert f.kind == "rank_exit"


def test_hang_timeout_is_calibrated_from_observed_steps(tmp_path, fake_job):
    clock = Clock()
    check = RankCheck(tmp_path, clock=clock, timeouts=RankTimeouts(floor_s=3.0, factor=5.0))
    fake_job.rank(0)
    for s in range(5):  # steps arriving 0.2 s apart by the agent's clock -> timeout = max(3 s floor, 5 x 0.2 s)
        fake_job.step(0, s, 2.0, ts=time.time() - 7200 + s, step_time_s=0.2)  # whatever the rank's clock says
        fake_job.rank(0)
        assert check.run(time.time()) == []
        clock.t += 0.2
    clock.t += 3.5
    (f,) = check.run(time.time())
    assert f.kind == "rank_hang" and f.evidence["timeout_s"] == pytest.approx(3.0)
    # a rank that has not shown steps yet gets the startup timeout; an agent that starts on a backlog of
    # steps calibrates from their own durations
    other = RankCheck(tmp_path, clock=clock, timeouts=RankTimeouts(floor_s=3.0, startup_s=120))
    fake_job.rank(1)
    other.run(time.time())
    clock.t += 60.0
    assert [x.rank for x in other.run(time.time())] == [0]


@pytest.mark.parametrize("recorded, floor", [(8.0, 8.0), ("eight", 3.0), (0.01, 3.0), (None, 3.0)])
def test_a_job_may_raise_its_own_hang_floor(tmp_path, fake_job, recorded, floor):
    """A job whose first evaluation pauses 6 s outside a step raises ``hang_floor_s`` in its spec (recorded in its
    job.json by the launch): no hang until that floor; a record that holds anything else gets the agent's floor."""
    record = json.loads((fake_job.dir / "job.json").read_text())
    monitor.write_json_atomic(fake_job.dir / "job.json", record | {"spec": {"hang_floor_s": recorded}})
    clock = Clock()
    check = RankCheck(tmp_path, clock=clock)
    assert check.t.floor_s == 3.0
    fake_job.rank(0)
    for s in range(5):  # 0.2 s steps: the calibrated part (5 x 0.2 s) is under any floor
        fake_job.step(0, s, 2.0, step_time_s=0.2)
        fake_job.rank(0)
        assert check.run(time.time()) == []
        clock.t += 0.2
    clock.t += floor - 0.3
    assert check.run(time.time()) == []
    clock.t += 0.5
    (f,) = check.run(time.time())
    assert f.kind == "rank_hang" and f.evidence["timeout_s"] == pytest.approx(floor)


def test_a_rank_holding_still_after_a_nan_is_not_a_hang_until_its_hold_runs_out(tmp_path, fake_job):
    """A rank that found a non-finite loss skips the update and holds still for the control plane: its
    progress stops on purpose. The agent reports the NaN, not a hang (a hang would evict machines), for as
    long as the rank said it would hold (on the agent's clock, at most MAX_HOLD_S), and a hang after it."""
    from trainguard.node_tools.rankcheck import MAX_HOLD_S

    clock = Clock()
    check = RankCheck(tmp_path, clock=clock, timeouts=RankTimeouts(floor_s=3.0, factor=5.0))
    for r in (0, 1):
        fake_job.rank(r)
    for s in range(5):
        for r in (0, 1):
            fake_job.step(r, s, 2.0, step_time_s=0.2)
            fake_job.rank(r)
        assert check.run(time.time()) == []
        clock.t += 0.2
    hold = {0: {"reason": "step 5: loss nan: update skipped", "seconds": 20.0},
            1: {"reason": "step 5: a rank that claims a day", "seconds": 86400.0}}
    frozen = time.time()  # the progress the heartbeats carry from now on: none

    def held(r: int) -> None:
        fake_job.rank(r, status="held", hold=hold[r], progress_ts=frozen)

    for r in (0, 1):
        fake_job.step(r, 5, "nan", "nan", step_time_s=0.2)
        held(r)
    assert kinds(check.run(time.time())) == ["nan_loss", "nan_loss"]
    for _ in range(9):  # 18 s without progress, six times the hang timeout
        clock.t += 2.0
        for r in (0, 1):
            held(r)
        assert check.run(time.time()) == []
    clock.t += 2.0 + 3.5  # rank 0's 20 s are over, and the timeout after them
    for r in (0, 1):
        held(r)
    assert [(f.kind, f.rank) for f in check.run(time.time())] == [("rank_hang", 0)]
    clock.t += MAX_HOLD_S  # rank 1's day is trusted for MAX_HOLD_S only
    held(1)
    assert [(f.kind, f.rank) for f in check.run(time.time()) if f.rank == 1] == [("rank_hang", 1)]


def test_a_one_off_stall_does_not_inflate_the_hang_timeout(tmp_path, fake_job):
    clock = Clock()
    check = RankCheck(tmp_path, clock=clock, timeouts=RankTimeouts(floor_s=3.0))
    fake_job.rank(0)
    for s in range(30):
        clock.t += 30.0 if s == 10 else 0.2  # one 30 s stall (an earlier fault) among 0.2 s steps
        fake_job.step(0, s, 2.0)
        fake_job.rank(0)
        check.run(time.time())
    clock.t += 4.0
    (f,) = check.run(time.time())
    assert f.kind == "rank_hang" and f.evidence["timeout_s"] == pytest.approx(3.0)


def test_a_sustained_decline_of_throughput_too_small_for_rank_slow_is_reported_once(tmp_path, fake_job):
    """A rank slowed by 30% of a step raised nothing: rank_slow needs 2.5x the median."""
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    for s in range(40):
        fake_job.step(0, s, 2.0, step_time_s=0.6, tokens_per_s=1000.0 + (s % 3))
    assert check.run(time.time()) == []
    # 23% below: the window of 16 is below from its 10th such step, and a decline must last 10 s (13 steps of
    # 0.78 s): a burst of load on the host takes the window below for about as long as the burst and the window
    for s in range(40, 61):
        fake_job.step(0, s, 2.0, step_time_s=0.78, tokens_per_s=770.0)
        assert check.run(time.time()) == []
    fake_job.step(0, 61, 2.0, step_time_s=0.78, tokens_per_s=770.0)
    (f,) = check.run(time.time())  # the 13th time
    assert (f.kind, f.severity) == ("throughput_decline", "warning")
    assert f.evidence["decline"] == pytest.approx(0.23, abs=0.01)
    assert (f.evidence["window_steps"], f.evidence["steps"]) == (16, 13)
    fake_job.step(0, 62, 2.0, step_time_s=0.78, tokens_per_s=770.0)
    assert check.run(time.time()) == []  # reported once
    for s in range(63, 85):  # noise of a few percent is no decline
        fake_job.step(0, s, 2.0, step_time_s=0.62, tokens_per_s=960.0)
    assert check.run(time.time()) == []


def test_on_a_busy_host_a_noisy_throughput_is_no_decline_and_a_straggler_under_the_same_noise_still_is(
        tmp_path, fake_job):
    """On the 2-core host with two CPU hogs, one step's tokens/s swung between about 1,900 and 3,300, and a rank
    slowed by 30% of its step (tokens/s down 23%) went unreported for 15 minutes: a rule of 8 low steps in a
    row is reset by every lucky step. Here the steps alternate (every other one slower, as a step with extra
    work every second step does) with a jitter: judged over a window's tokens and time, that noise is no
    decline, and the straggler is one, with the size of its decline (not one step's)."""
    rng = np.random.default_rng(7)
    step_of = iter(range(10**6))

    def noisy(level: float) -> float:
        return level * (0.75 if next(step_of) % 2 else 1.25) * rng.uniform(0.97, 1.03)

    fake_job.rank(0)
    check = RankCheck(tmp_path)
    findings = []
    for s in range(600):  # healthy: 600 noisy steps
        fake_job.step(0, s, 2.0, step_time_s=0.628, tokens_per_s=noisy(2600.0))
        findings += check.run(time.time())
    assert findings == []
    for s in range(600, 660):  # the same noise, 23% lower
        fake_job.step(0, s, 2.0, step_time_s=0.816, tokens_per_s=noisy(2600.0 * 0.77))
        findings += check.run(time.time())
        if findings:
            break
    (f,) = findings
    assert f.kind == "throughput_decline" and s - 600 < 32
    assert f.evidence["decline"] == pytest.approx(0.23, abs=0.06)


def test_a_slowdown_slow_to_show_in_the_throughput_is_not_learned_as_the_straggler_s_normal_compute(
        tmp_path, fake_job):
    """Measured: a rank slowed by 30% of its step under load took the throughput's window 16% below only after
    a while; meanwhile its slowed compute (0.48 s against 0.26 s) had become its normal one, its decline said
    compute 0.99x, and the control plane took the batch for a shared slowdown. The normal compute learns a step
    only as it leaves the window, from a history longer than a slowdown's first steps."""
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    for s in range(60):
        fake_job.step(0, s, 2.0, step_time_s=0.6, comm_s=0.34, tokens_per_s=1000.0)
    for s in range(60, 90):  # slowed, but the job's throughput only 10% down: no decline yet
        fake_job.step(0, s, 2.0, step_time_s=0.6, comm_s=0.12, tokens_per_s=900.0)
    assert check.run(time.time()) == []  # (alone on its machine: no peer for its own growth to stand out from)
    found = []
    for s in range(90, 130):  # then 25% down
        fake_job.step(0, s, 2.0, step_time_s=0.6, comm_s=0.12, tokens_per_s=750.0)
        found += check.run(time.time())
    (f,) = found
    assert f.kind == "throughput_decline"
    assert f.evidence["baseline_compute_s"] == pytest.approx(0.26)
    assert f.evidence["compute_ratio"] == pytest.approx(0.48 / 0.26, abs=0.01)


def test_a_rank_that_straggles_while_a_shared_decline_stands_is_reported_by_its_own_compute_growth(
        tmp_path, fake_job):
    """Measured under load: a decline every rank shared (the busy host) was raised and judged shared; a rank slowed
    minutes later raised nothing, since a raised decline stays quiet until its window recovers, and its relearn
    would take the straggler's pace for the job's normal. The straggler's own compute growth is its word: it grew
    against its normal and against its machine peer's, which waits for it."""
    fake_job.rank(0)
    fake_job.rank(1)
    check = RankCheck(tmp_path)

    def steps(first: int, n: int, compute: tuple[float, float], step_s: float, tput: float) -> list:
        found = []
        for s in range(first, first + n):
            for r in (0, 1):
                fake_job.step(r, s, 2.0, step_time_s=step_s, comm_s=step_s - compute[r], tokens_per_s=tput)
            found += check.run(time.time())
        return found

    assert steps(0, 60, (0.4, 0.4), 0.6, 1000.0) == []
    shared = steps(60, 40, (0.5, 0.5), 0.75, 800.0)  # a load on the host: both computed 25% longer
    assert {(f.rank, f.kind) for f in shared} == {(0, "throughput_decline"), (1, "throughput_decline")}
    assert not [f for f in shared if f.evidence.get("compute_grew")]  # alike on both: no one's own growth
    straggle = steps(100, 20, (0.7, 0.5), 0.95, 630.0)  # then rank 0 computes 0.2 s more; rank 1 waits for it
    (f,) = straggle
    assert f.rank == 0 and f.evidence["compute_grew"] is True and f.evidence["steps"] == 16
    assert f.evidence["compute_ratio"] == pytest.approx(0.7 / 0.4, abs=0.01)
    assert f.evidence["local_peer_ratios"] == [pytest.approx(0.5 / 0.4, abs=0.01)]
    assert steps(120, 20, (0.7, 0.5), 0.95, 630.0) == []  # reported once


def test_one_rank_s_compute_alone_grown_in_a_job_whose_throughput_holds_is_no_finding(tmp_path, fake_job):
    """Measured on the busy 2-core host in a healthy job: one rank's compute read 1.34x its normal for 8 steps
    (its machine peer's 1.03x) while the job's throughput held, and its growth alone opened a fail-slow vote that
    found nothing. The throughput speaks for a straggler then; a rank's own growth is asked only while it
    cannot."""
    fake_job.rank(0)
    fake_job.rank(1)
    check = RankCheck(tmp_path)
    found = []
    for s in range(140):
        grown = 60 <= s < 100  # rank 0 computes 1.34x for 40 steps, the steps' length and throughput unchanged
        for r in (0, 1):
            compute = 0.536 if grown and r == 0 else 0.4
            fake_job.step(r, s, 2.0, step_time_s=0.6, comm_s=0.6 - compute, tokens_per_s=1000.0)
        found += check.run(time.time())
    assert found == []


def test_one_lucky_step_does_not_reset_a_straggler_s_own_growth(tmp_path, fake_job):
    """Under load a straggler's compute swings too: a step now and then near its normal must not restart its
    count of grown steps (as a count of low steps was reset by every lucky one), nor teach its normal."""
    fake_job.rank(0)
    fake_job.rank(1)
    check = RankCheck(tmp_path)
    for s in range(60):
        for r in (0, 1):
            fake_job.step(r, s, 2.0, step_time_s=0.6, comm_s=0.2, tokens_per_s=1000.0)
    assert check.run(time.time()) == []
    found = []
    for s in range(60, 140):  # rank 0 computes 1.6x, but 3 steps in every 10 only 1.2x: 7 grown in a row at most
        compute = 0.48 if s % 10 >= 7 else 0.64
        fake_job.step(0, s, 2.0, step_time_s=0.84, comm_s=0.84 - compute, tokens_per_s=714.0)
        fake_job.step(1, s, 2.0, step_time_s=0.84, comm_s=0.44, tokens_per_s=714.0)
        found += [f for f in check.run(time.time()) if f.evidence.get("compute_grew")]
    (f,) = found
    assert f.rank == 0 and f.evidence["baseline_compute_s"] == pytest.approx(0.4)


def test_a_load_that_grows_every_local_rank_alike_is_no_rank_s_own_growth(tmp_path, fake_job):
    rng = np.random.default_rng(3)
    fake_job.rank(0)
    fake_job.rank(1)
    check = RankCheck(tmp_path)
    found = []
    for s in range(300):
        load = 1.5 if 100 <= s < 200 else 1.0  # 100 steps of a load that makes both compute 1.5x
        for r in (0, 1):
            compute = 0.4 * load * rng.uniform(0.85, 1.15)
            fake_job.step(r, s, 2.0, step_time_s=0.2 + compute, comm_s=0.2, tokens_per_s=1000.0 / load)
        found += check.run(time.time())
    assert not [f for f in found if f.evidence.get("compute_grew")], found


def test_a_rank_slowed_soon_after_a_restart_is_flagged_once(tmp_path, fake_job):
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    for s in range(5):  # five normal steps of the new incarnation are the baseline
        fake_job.step(0, s, 2.0, step_time_s=0.2, comm_s=0.05)
    assert check.run(time.time()) == []
    for s in range(5, 7):
        fake_job.step(0, s, 2.0, step_time_s=2.2, comm_s=0.05)
    assert check.run(time.time()) == []  # two slow steps: not yet
    fake_job.step(0, 7, 2.0, step_time_s=2.2, comm_s=0.05)
    (f,) = check.run(time.time())
    assert f.kind == "rank_slow" and f.evidence["baseline_s"] == pytest.approx(0.2)
    assert f.evidence["compute_s"] == pytest.approx(2.15)
    fake_job.step(0, 8, 2.0, step_time_s=2.2, comm_s=0.05)
    assert check.run(time.time()) == []  # still slow: reported once


def test_a_slowdown_that_creeps_up_does_not_teach_the_baseline(tmp_path, fake_job):
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    for s in range(5):
        fake_job.step(0, s, 2.0, step_time_s=0.2, comm_s=0.05)
    for s, t in enumerate([0.32, 0.35, 0.4, 0.45, 0.48, 0.5], start=5):  # elevated, not above 2.5x
        fake_job.step(0, s, 2.0, step_time_s=t, comm_s=0.05)
    assert check.run(time.time()) == []
    for s in range(11, 14):
        fake_job.step(0, s, 2.0, step_time_s=0.6, comm_s=0.05)  # 3x the baseline it kept: 0.2 s
    (f,) = check.run(time.time())
    assert f.kind == "rank_slow" and f.evidence["baseline_s"] == pytest.approx(0.2)


def test_nan_and_spikes(tmp_path, fake_job):
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    for s in range(50):
        fake_job.step(0, s, 2.0, grad=1.0)
    assert check.run(time.time()) == []
    fake_job.step(0, 50, 11.0, grad=1.0)  # 5.5x the median loss
    assert kinds(check.run(time.time())) == ["loss_spike"]
    fake_job.step(0, 51, 2.0, grad=9.0)
    assert kinds(check.run(time.time())) == ["grad_spike"]
    fake_job.step(0, 52, "nan", grad="nan")
    fake_job.step(0, 53, "nan", grad="nan")
    (f,) = check.run(time.time())
    assert f.kind == "nan_loss" and f.evidence["step"] == 52  # once per episode


def test_a_loss_that_is_noisy_by_nature_is_no_spike_and_a_spike_is_said_once_in_its_quiet_period(tmp_path,
                                                                                                 fake_job):
    """A small model's loss on random batches (Lightning's BoringModel) swings past 5x its median every few steps:
    judged on its own spread it is no spike. A real spike is reported, and the next within ``spike_quiet_s`` (the
    steps' clock) is not, however often the loss crosses the line."""
    import numpy as np

    fake_job.rank(0)
    check = RankCheck(tmp_path)
    rng = np.random.default_rng(0)
    t0 = time.time()
    # BoringModel's loss: the mean squared error of 2 outputs on a batch of 2 random inputs (4 squared errors)
    noisy = rng.chisquare(4, 4000) / 4 * 0.01
    for s, v in enumerate(noisy):
        fake_job.step(0, s, float(v), grad=1.0, ts=t0 + s * 0.001)
    assert sum(v > 5 * np.median(noisy) for v in noisy) > 5  # the old rule's spikes
    assert check.run(time.time()) == []
    fake_job.step(0, 4000, 5.0, grad=1.0, ts=t0 + 4.0)  # a spike out of its own noise
    assert kinds(check.run(time.time())) == ["loss_spike"]
    for s in range(4001, 4011):  # back, then out again, 100 s later: within the quiet period
        fake_job.step(0, s, 0.01, grad=1.0, ts=t0 + 5.0)
    fake_job.step(0, 4011, 6.0, grad=1.0, ts=t0 + 100.0)
    assert check.run(time.time()) == []
    for s in range(4012, 4022):
        fake_job.step(0, s, 0.01, grad=1.0, ts=t0 + 301.0)
    fake_job.step(0, 4022, 20.0, grad=1.0, ts=t0 + 305.0)  # past it, and twice the spikes before it
    assert kinds(check.run(time.time())) == ["loss_spike"]


def test_the_step_a_replica_group_healed_on_is_not_judged_for_spikes(tmp_path, fake_job):
    """A replica group's step that received a live replica's state (``healed_from_step``): torchft applies the state
    at the step's commit, so its loss was computed on the group's state from before (at a fresh start: the initial
    weights), not a spike of training; the next step is judged against the history as before."""
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    for s in range(50):
        fake_job.step(0, s, 2.0, grad=1.0)
    assert check.run(time.time()) == []
    fake_job.step(0, 40, 30.0, grad=20.0, healed_from_step=12)
    assert check.run(time.time()) == []
    fake_job.step(0, 41, 30.0, grad=1.0)  # a spike after the heal still is one
    assert kinds(check.run(time.time())) == ["loss_spike"]


def test_old_incarnations_are_ignored(tmp_path, fake_job):
    fake_job.rank(0)
    fake_job.inc = 0
    fake_job.step(0, 0, "nan")  # a NaN of the previous incarnation
    record = json.loads((fake_job.dir / "job.json").read_text())
    monitor.write_json_atomic(fake_job.dir / "job.json", record | {"incarnation": 1})
    fake_job.inc = 1
    fake_job.rank(0)
    fake_job.step(0, 0, 2.5)
    assert RankCheck(tmp_path).run(time.time()) == []


# ---- the agent's rules -----------------------------------------------------------------------
class Scripted(Check):
    def __init__(self, name: str, interval: float = 1.0) -> None:
        self.name, self.interval_s, self.findings, self.fail = name, interval, [], False

    def run(self, now):
        if self.fail:
            raise RuntimeError("sensor broke")
        return list(self.findings)


def _agent(tmp_path, *checks, bus=None):
    cfg = NodeConfig(machine="m3", workdir=tmp_path, install_dir=tmp_path)
    bus = bus or SpoolBus(tmp_path / "bus")
    return Agent(cfg, bus, list(checks), settings=AgentSettings(), status_path=tmp_path / "status.json"), bus


def test_agent_alerts_once_per_condition_and_again_after_it_clears(tmp_path):
    disk = Scripted("disk")
    agent, bus = _agent(tmp_path, disk)
    reader = BusReader(bus)
    disk.findings = [Finding("disk_full", "diskfull:/w", "full", evidence={"free_bytes": 0})]
    assert [a.kind for a in agent.tick(100)] == ["disk_full"]
    assert agent.tick(101.5) == []
    disk.findings = []
    assert agent.tick(103) == []
    disk.findings = [Finding("disk_full", "diskfull:/w", "full again")]
    assert [a.kind for a in agent.tick(104.5)] == ["disk_full"]
    got = reader.read()
    assert [(a.kind, a.machine, a.severity) for a in got] == [("disk_full", "m3", "fault")] * 2
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["published"] == 2 and "diskfull:/w" in status["active"]


def test_network_faults_need_a_repeat_within_the_window(tmp_path):
    nic = Scripted("nic", interval=5)
    agent, _ = _agent(tmp_path, nic)
    down = Finding("nic_down", "nic:eth0", "eth0 down", evidence={"iface": "eth0"})
    nic.findings = [down]
    assert [(a.kind, a.severity) for a in agent.tick(0)] == [("nic_down", "warning")]
    assert [(a.kind, a.severity) for a in agent.tick(5)] == [("nic_down", "fault")]
    assert agent.tick(10) == []
    # a single flap long after is a warning again
    nic.findings = []
    agent.tick(15)
    nic.findings = [down]
    assert [a.severity for a in agent.tick(400)] == ["warning"]


def test_a_broken_check_is_reported_and_the_others_go_on(tmp_path):
    bad, disk = Scripted("gpu"), Scripted("disk")
    bad.fail = True
    disk.findings = [Finding("disk_full", "d", "full")]
    agent, _ = _agent(tmp_path, bad, disk)
    assert [a.kind for a in agent.tick(0)] == ["disk_full"]
    assert "sensor broke" in agent.status()["checks"]["gpu"]["error"]


class FlakyBus(SpoolBus):
    down = True

    def put(self, name, body):
        if self.down:
            raise BusError("bus unreachable")
        super().put(name, body)


def test_alerts_wait_in_the_outbox_while_the_bus_is_down(tmp_path):
    disk = Scripted("disk")
    bus = FlakyBus(tmp_path / "bus")
    agent, _ = _agent(tmp_path, disk, bus=bus)
    disk.findings = [Finding("disk_full", "d", "full")]
    agent.tick(0)
    assert agent.status()["outbox"] == 1 and "unreachable" in agent.status()["bus_error"]
    bus.down = False
    agent.tick(2)
    assert agent.status()["outbox"] == 0
    (alert,) = BusReader(bus).read()
    assert isinstance(alert, Alert) and alert.kind == "disk_full" and alert.ts == 0


def test_a_decline_says_how_much_the_ranks_own_compute_grew_a_straggler_from_its_waiting_peers(tmp_path, fake_job):
    """Every rank of a synchronous job declines together; what tells the straggler from its peers is whose own
    compute (the step less its wait in collectives) grew: the straggler's (1.3x), not its peers' (they wait)."""
    fake_job.rank(0)
    fake_job.rank(1)
    check = RankCheck(tmp_path)
    for s in range(40):
        fake_job.step(0, s, 2.0, step_time_s=0.6, comm_s=0.2, tokens_per_s=1000.0)
        fake_job.step(1, s, 2.0, step_time_s=0.6, comm_s=0.2, tokens_per_s=1000.0)
    assert check.run(time.time()) == []
    for s in range(40, 67):  # rank 0 computes 0.12 s longer; rank 1 waits that long for it (17% down: the
        # window is below from the 14th such step, the 27th is its 14th time in a row: 10 s of steps)
        fake_job.step(0, s, 2.0, step_time_s=0.72, comm_s=0.2, tokens_per_s=830.0)
        fake_job.step(1, s, 2.0, step_time_s=0.72, comm_s=0.32, tokens_per_s=830.0)
    found = {f.rank: f for f in check.run(time.time())}
    assert {f.kind for f in found.values()} == {"throughput_decline"}
    assert found[0].evidence["compute_ratio"] == pytest.approx(1.3, abs=0.01)
    assert found[1].evidence["compute_ratio"] == pytest.approx(1.0, abs=0.01)
    assert found[0].evidence["baseline_compute_s"] == pytest.approx(0.4)


def _stranger_steps(rng: np.random.Generator, n: int, *, step_s: float, tokens: float, slow: float = 1.0,
                    eval_every: int = 300, eval_s: float = 1.5) -> list[tuple[float, float]]:
    """A third-party job's step times and tokens/s on a busy 2-core host: 10-30 ms steps (lognormal, a quarter's
    spread), a scheduling hiccup of three steps at 4x now and then, a second of 2x load every 1,000 steps, and
    the program's own evaluation inside its step every ``eval_every`` steps; ``slow``: a straggler's factor."""
    out = []
    for i in range(n):
        t = step_s * slow * float(rng.lognormal(0.0, 0.25))
        if i % 397 in (1, 2, 3):
            t *= 4.0  # a hiccup: another process took the core
        if i % 1000 < int(1.0 / step_s):
            t *= 2.0  # a second of load (an Airflow task starting)
        if eval_every and i % eval_every == eval_every - 1:
            t += eval_s
        out.append((t, tokens / t))
    return out


@pytest.mark.parametrize("step_s", [0.01, 0.05])
def test_a_stranger_s_noisy_short_steps_with_its_own_evaluation_raise_nothing(tmp_path, fake_job, step_s):
    """A small third-party GPT trainer (10-30 ms steps, its own evaluation every few hundred steps, two shared
    cores) raised 15 fail-slow incidents in 33 healthy minutes: three steps over 2.5x a 15 ms median, or a
    16-step window 15% below the 48 before it, are a scheduling hiccup, not a straggler."""
    rng = np.random.default_rng(11)
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    steps = _stranger_steps(rng, int(240 / step_s), step_s=step_s, tokens=8192.0)  # four minutes of training
    with open(monitor.steps_path(fake_job.dir, 0), "a") as fh:
        for s, (t, tput) in enumerate(steps):
            fh.write(json.dumps({"step": s, "loss": 2.0, "grad_norm": 1.0, "ts": 0.0, "incarnation": fake_job.inc,
                                 "step_time_s": t, "comm_s": 0.0, "tokens_per_s": tput}) + "\n")
    assert check.run(time.time()) == []


def test_a_straggler_30_percent_slow_on_the_same_noisy_short_steps_is_still_a_decline(tmp_path, fake_job):
    rng = np.random.default_rng(12)
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    healthy = _stranger_steps(rng, 12000, step_s=0.01, tokens=8192.0)
    slowed = _stranger_steps(rng, 6000, step_s=0.01, tokens=8192.0, slow=1.3)
    with open(monitor.steps_path(fake_job.dir, 0), "a") as fh:
        for s, (t, tput) in enumerate(healthy + slowed):
            fh.write(json.dumps({"step": s, "loss": 2.0, "grad_norm": 1.0, "ts": 0.0, "incarnation": fake_job.inc,
                                 "step_time_s": t, "comm_s": 0.0, "tokens_per_s": tput}) + "\n")
    (f,) = check.run(time.time())
    assert f.kind == "throughput_decline" and f.evidence["decline"] == pytest.approx(0.23, abs=0.05)
    assert f.evidence["step"] < len(healthy) + 3000  # within half a minute of 10 ms steps
    assert f.evidence["window_s"] >= 5.0


@pytest.mark.parametrize("slow", [3.5, 4.7])
def test_a_straggler_that_makes_short_steps_several_times_longer_is_a_decline_not_the_programs_evaluation(
        tmp_path, fake_job, slow):
    """A rank sleeping 30 ms before each 7 ms step (Lightning's BoringModel under DDP: its peer waits inside DDP's
    all-reduce) makes every step over 3x the normal one. Long steps are left out of the throughput while they are
    rare (an evaluation); once they are the pace they count, or no decline is ever seen. The rare long steps of
    the program's own evaluation still raise nothing (the healthy part)."""
    rng = np.random.default_rng(13)
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    healthy = _stranger_steps(rng, 8000, step_s=0.007, tokens=8192.0, eval_every=200, eval_s=0.3)
    slowed = _stranger_steps(rng, 4000, step_s=0.007, tokens=8192.0, slow=slow, eval_every=200, eval_s=0.3)
    with open(monitor.steps_path(fake_job.dir, 0), "a") as fh:
        for s, (t, tput) in enumerate(healthy):
            fh.write(json.dumps({"step": s, "loss": 2.0, "grad_norm": 1.0, "ts": 0.0, "incarnation": fake_job.inc,
                                 "step_time_s": t, "comm_s": 0.0, "tokens_per_s": tput}) + "\n")
    assert check.run(time.time()) == []
    with open(monitor.steps_path(fake_job.dir, 0), "a") as fh:
        for s, (t, tput) in enumerate(slowed, start=len(healthy)):
            fh.write(json.dumps({"step": s, "loss": 2.0, "grad_norm": 1.0, "ts": 0.0, "incarnation": fake_job.inc,
                                 "step_time_s": t, "comm_s": 0.0, "tokens_per_s": tput}) + "\n")
    found = [f for f in check.run(time.time()) if f.kind == "throughput_decline"]
    assert found, "a straggler that slows every step was never reported"
    assert found[0].evidence["decline"] == pytest.approx(1 - 1 / slow, abs=0.08)


def test_a_steps_compute_is_its_local_part_when_the_guard_measured_it():
    """DDP's gradient all-reduce waits inside backward, where ``comm_s`` cannot see it: a rank waiting for a
    straggler there reads as computing as long. The guard's ``local_s`` (up to the first wait) is the compute."""
    from trainguard.node_tools.monitor import step_compute

    assert step_compute({"step_time_s": 0.033, "comm_s": 0.0002, "local_s": 0.001}) == 0.001
    assert step_compute({"step_time_s": 0.033, "comm_s": 0.003}) == pytest.approx(0.030)
    assert math.isnan(step_compute({"loss": 1.0}))


def test_an_evaluation_that_recurs_raises_the_hang_timeout_however_many_steps_come_between(tmp_path, fake_job):
    """A program's own evaluation every 2,000 steps of 10 ms falls out of a window of 100 step intervals; the
    timeout went back to its floor between them, and a longer evaluation was called a hang."""
    clock = Clock()
    check = RankCheck(tmp_path, clock=clock, timeouts=RankTimeouts(floor_s=3.0))
    fake_job.rank(0)
    step = 0

    def train(n: int, interval: float) -> list[Finding]:
        nonlocal step
        found = []
        for _ in range(n):
            clock.t += interval
            fake_job.step(0, step, 2.0, step_time_s=interval)
            step += 1
            fake_job.rank(0)
            found += check.run(time.time())
        return found

    assert train(30, 0.05) == []
    for _ in range(2):  # two evaluations of 2.5 s (under the floor), each followed by 150 steps
        assert train(1, 2.5) == [] and train(150, 0.05) == []
    assert check.timeout_for(next(iter(check.state.values()))) == pytest.approx(12.5)
    clock.t += 8.0  # the third evaluation takes longer: still no hang
    fake_job.rank(0)
    assert check.run(time.time()) == []


def test_a_straggler_that_creeps_up_by_steps_under_the_threshold_is_still_a_decline(tmp_path, fake_job):
    """Measured beside two CPU hogs: a rank's sleep grew in steps (the job's step 15%, 14%, 24%, 52%, then 36% longer,
    each for about 15 steps); each step under the threshold taught the baseline its pace, and the straggler was never
    reported. A window half a decline below its baseline teaches it nothing."""
    rng = np.random.default_rng(5)
    fake_job.rank(0)
    check = RankCheck(tmp_path)
    found: list[Finding] = []
    step = 0
    for growth, n in ((1.0, 120), (1.14, 15), (1.14, 15), (1.24, 15), (1.36, 120)):
        for _ in range(n):
            t = 0.42 * growth * float(rng.uniform(0.95, 1.05))
            fake_job.step(0, step, 2.0, step_time_s=t, tokens_per_s=4096.0 / t)
            step += 1
        found += check.run(time.time())
    assert [f.kind for f in found] == ["throughput_decline"], [f.message for f in found]
    assert found[0].evidence["decline"] >= 0.2


def test_the_votes_look_at_a_rank_is_its_local_compute_and_its_step(tmp_path, fake_job):
    """``tg-node job status``'s recent compute of a rank (what a round of the fail-slow vote compares) is the median
    of its steps' local parts where the guard measured them, and ``recent_step_s`` the median of the steps' own
    times (the vote's least excess is a share of it)."""
    from trainguard.node_tools.job import rank_status

    fake_job.rank(0)
    for s in range(400):
        fake_job.step(0, s, 2.0, step_time_s=0.033, comm_s=0.0002, local_s=0.001 + 0.0001 * (s % 3))
    st = rank_status(fake_job.dir, 0, time.time())
    assert st["recent_compute_s"] == pytest.approx(0.0011) and st["recent_step_s"] == pytest.approx(0.033)
    assert st["recent_steps"] >= 90  # 3 s of 33 ms steps


def test_the_last_records_of_a_long_history_are_read_from_its_end(tmp_path, fake_job):
    """A job of 7 ms steps writes 200,000 records in half an hour: a rank's status (asked by a stop, a vote's round,
    the Fleet page) reads the newest records from the file's end, never the whole history."""
    from trainguard.node_tools.monitor import read_steps_since

    fake_job.rank(0)
    with open(monitor.steps_path(fake_job.dir, 0), "a") as fh:
        for s in range(5000):
            fh.write(json.dumps({"step": s, "ts": 1000.0 + s, "incarnation": fake_job.inc}) + "\n")
        fh.write('{"step": 5000, "ts": 60')  # a torn line being written
    last = read_steps_since(fake_job.dir, 0, -math.inf, limit=3, block=256)
    assert [r["step"] for r in last] == [4997, 4998, 4999]
    assert len(read_steps_since(fake_job.dir, 0, -math.inf, limit=10_000)) == 5000


def test_the_steps_after_a_checkpoint_are_its_newest_stretch_read_from_the_end(tmp_path, fake_job):
    """A checkpoint's verification asked each machine for the steps around it, and the machine parsed the rank's
    whole history (200,000 records after half an hour of 8 ms steps) to send back a hundred."""
    from trainguard.node_tools.monitor import read_steps_after

    fake_job.rank(0)
    with open(monitor.steps_path(fake_job.dir, 0), "a") as fh:
        for s in range(0, 100):
            fh.write(json.dumps({"step": s, "ts": 1000.0 + s, "incarnation": 0}) + "\n")
        fh.write("\n")
        for s in range(90, 151):  # restored to step 90
            fh.write(json.dumps({"step": s, "ts": 2000.0 + s, "incarnation": 1}) + "\n")
        fh.write('{"step": 151, "ts": 30')  # a torn line being written
    for block in (40, 1 << 16):
        after = read_steps_after(fake_job.dir, 0, 95, block=block)
        assert [(r["step"], r["incarnation"]) for r in after] == [(s, 1) for s in range(96, 151)]
        assert [r["step"] for r in read_steps_after(fake_job.dir, 0, 140, block=block)] == list(range(141, 151))
        assert read_steps_after(fake_job.dir, 0, 150, block=block) == []
        before = read_steps_after(fake_job.dir, 0, 85, block=block)  # before the restore's step: both stretches
        assert [r["step"] for r in before] == [*range(86, 100), *range(90, 151)]
