"""Warm standby on one machine: park, activate a real torchrun job on warm interpreters, stop, crash."""

from __future__ import annotations

import dataclasses
import json
import os
import signal

import pytest

from tests import REPO
from tests.conftest import free_port, wait_until
from trainguard.core import procs
from trainguard.core.errors import TrainguardError
from trainguard.node_tools import job, monitor, standby
from trainguard.node_tools.config import NodeConfig
from trainguard.operators.jobspec import REFERENCE_ENTRY

pytestmark = pytest.mark.slow

@pytest.fixture
def node(tmp_path):
    cfg = NodeConfig(machine="w1", workdir=tmp_path / "disk", install_dir=REPO, fault_file=tmp_path / "faults.json")
    cfg.workdir.mkdir()
    yield cfg
    for name in ("warm", "crash"):
        job.stop(cfg, name, grace_s=2)
    standby.unpark(cfg)
    token = (standby.read_state(cfg.workdir) or {}).get("token")
    if token:
        assert procs.pids_with_env("TG_STANDBY_TOKEN", token) == []


def spec(name: str, *, steps: int = 0) -> job.JobSpec:
    return job.JobSpec(job=name, nnodes=1, node_rank=0, nproc_per_node=2, master_addr="127.0.0.1",
                       master_port=free_port(), entry=REFERENCE_ENTRY,
                       args=["--tp", "2", "--pp", "1", "--dp", "1", "--steps", str(steps)],
                       warm=True)


def warm_pids(cfg) -> set[int]:
    return {s["pid"] for s in standby.free_slots(cfg.workdir)}


def test_park_is_idempotent_and_activation_runs_torchrun_on_warm_interpreters(node):
    parked = standby.park(node, nproc=2)
    assert parked["state"] == "parked" and len(parked["slots"]) == 3 and parked["started"] == 3
    assert all("torch" in s["preloaded"] for s in parked["slots"])
    # one interpreter imported, the others are forked copies of it: distinct processes, each leading
    # a session of its own, with the same import time
    pids = [s["pid"] for s in parked["slots"]]
    assert len(set(pids)) == 3 and all(os.getsid(pid) == pid for pid in pids)
    assert len({s["warm_s"] for s in parked["slots"]}) == 1
    again = standby.park(node, nproc=2)
    assert again["started"] == 0 and standby.status(node)["state"] == "parked"
    interpreters = warm_pids(node)

    job.start(node, spec("warm", steps=4))
    rd = job.run_dir(node, "warm")
    wait_until(lambda: (rd / "exit.json").exists(), timeout=120, what="the warm job to finish")
    assert json.loads((rd / "exit.json").read_text())["returncode"] == 0
    # the ranks ran in the warm interpreters, and finished their steps
    for r in (0, 1):
        assert monitor.read_heartbeat(rd, r)["pid"] in interpreters
        assert [s["step"] for s in monitor.read_steps(rd, r)] == [0, 1, 2, 3]
    # torchrun's report and the ranks' logs land where a cold start puts them
    assert (rd / "supervisor.log").exists()
    assert any("step 3" in p.read_text() for p in rd.glob("logs/inc0/*/attempt_0/*/stdout.log"))
    # used up: the interpreters exit right after handing their exit codes over (the job's end may come first)
    wait_until(lambda: standby.status(node)["state"] == "empty", timeout=10, what="the used interpreters to exit")


def test_job_nice_lowers_the_warm_interpreters_and_every_process_of_a_warm_or_cold_job(node):
    nice = dataclasses.replace(node, job_nice=7)
    assert os.getpriority(os.PRIO_PROCESS, 0) < 7  # the test itself runs above it
    standby.park(nice, nproc=2)
    assert {os.getpriority(os.PRIO_PROCESS, p) for p in warm_pids(nice)} == {7}
    for name, warm in (("warm", True), ("crash", False)):
        job.start(nice, dataclasses.replace(spec(name), warm=warm))
        rd = job.run_dir(nice, name)
        wait_until(lambda rd=rd: all(monitor.read_steps(rd, r) for r in (0, 1)), timeout=120,
                   what=f"both ranks of the {name} job to step")
        running = job.job_pids(json.loads((rd / "job.json").read_text()))
        ranks = {monitor.read_heartbeat(rd, r)["pid"] for r in (0, 1)}
        assert ranks <= set(running)
        assert {p: os.getpriority(os.PRIO_PROCESS, p) for p in running} == dict.fromkeys(running, 7)
        job.stop(nice, name, grace_s=2)


def test_activation_needs_a_parked_machine(node):
    with pytest.raises(TrainguardError, match="has 0 warm interpreters, job warm needs 3"):
        job.start(node, spec("warm"))


def test_warm_if_parked_starts_cold_without_interpreters_and_warm_on_them(node):
    either = dataclasses.replace(spec("warm"), warm=False, warm_if_parked=True)
    cold = job.start(node, either)
    assert cold["warm"] is False and cold["state"] == "running"
    job.stop(node, "warm", grace_s=2)
    standby.park(node, nproc=2)
    interpreters = warm_pids(node)
    warm = job.start(node, dataclasses.replace(either, master_port=free_port()))
    assert warm["warm"] is True
    rd = job.run_dir(node, "warm")
    wait_until(lambda: all(monitor.read_steps(rd, r) for r in (0, 1)), timeout=120, what="both ranks to step")
    assert {monitor.read_heartbeat(rd, r)["pid"] for r in (0, 1)} <= interpreters


def test_a_start_says_running_even_when_the_new_process_shows_no_environment_yet(node, monkeypatch):
    """On a loaded machine the state read right after the launch said "exited": a process that is still in
    its exec shows an empty /proc/<pid>/environ for a moment (the kernel sets it up after the parent of a
    vfork resumes), and the job's processes are found by the token in their environment."""
    real, hidden = procs.environ, {}

    def in_exec(pid: int) -> dict[str, str]:
        env = real(pid)
        if "TG_JOB_TOKEN" in env and hidden.get(pid, 0) < 3:  # the first three reads of each job process
            hidden[pid] = hidden.get(pid, 0) + 1
            return {}
        return env

    monkeypatch.setattr(procs, "environ", in_exec)
    started = job.start(node, dataclasses.replace(spec("crash"), warm=False))
    monkeypatch.undo()
    assert hidden and started["state"] == "running" and started["warm"] is False
    job.stop(node, "crash", grace_s=2)


def test_stop_ends_every_warm_process_of_the_job(node):
    standby.park(node, nproc=2)
    job.start(node, spec("warm"))
    rd = job.run_dir(node, "warm")
    wait_until(lambda: all(monitor.read_steps(rd, r) for r in (0, 1)), timeout=120, what="both ranks to step")
    record = json.loads((rd / "job.json").read_text())
    running = job.job_pids(record)
    assert len(running) >= 2 + 3  # supervisor + clients, and the warm torchrun and ranks
    job.stop(node, "warm", grace_s=5)
    assert job.job_pids(record) == []
    assert all(not procs.alive(p) for p in running)
    # the claims of its interpreters went with them: no file of an ended job names a process later
    assert not list(standby.standby_dir(node.workdir).glob("slot*.claim"))


def test_a_start_that_ran_beside_the_stop_is_ended_by_it(node):
    """A start that wrote a job.json of its own while a stop ran (a restart in flight when the person stopped the
    job): its processes, under a token the stop had not read, are ended too."""
    import subprocess
    import sys
    import uuid

    rd = job.run_dir(node, "late")
    rd.mkdir(parents=True)
    tokens = [uuid.uuid4().hex, uuid.uuid4().hex]
    started: list[subprocess.Popen] = []

    def start(token: str) -> None:
        started.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                                        env={**os.environ, "TG_JOB_TOKEN": token}))
        wait_until(lambda: procs.pids_with_env("TG_JOB_TOKEN", token), timeout=10, what="the process to start")
        (rd / "job.json").write_text(json.dumps({"job": "late", "token": token}))

    start(tokens[0])
    try:
        out = job.stop(node, "late", grace_s=2, wait_go=lambda _mark: start(tokens[1]))
        assert sorted(out["stopped_pids"]) == sorted(p.pid for p in started) and out["state"] == "exited"
        assert all(p.wait(timeout=10) is not None for p in started)
    finally:
        for p in started:
            p.kill()
            p.wait()


def test_spares_parked_beside_a_warm_job_are_unparked_without_touching_it(node):
    standby.park(node, nproc=2)
    job.start(node, spec("warm"))
    rd = job.run_dir(node, "warm")
    wait_until(lambda: all(monitor.read_steps(rd, r) for r in (0, 1)), timeout=120, what="both ranks to step")
    record = json.loads((rd / "job.json").read_text())
    running = job.job_pids(record)
    spares = standby.park(node, nproc=2)  # armed for the next restart, beside the running job
    assert spares["started"] == 3 and standby.status(node)["state"] == "parked"
    # the job's claims stay: its ranks are still found as its processes (stacks, stop), not only their clients
    assert set(job.job_pids(record)) >= set(running)
    ended = standby.unpark(node)["ended_pids"]
    assert sorted(ended) == sorted(s["pid"] for s in spares["slots"])
    assert all(procs.alive(p) for p in running)  # the job's own interpreters are its, not spares
    step = len(monitor.read_steps(rd, 0))
    wait_until(lambda: len(monitor.read_steps(rd, 0)) > step, timeout=60, what="the job to go on training")


def test_a_killed_warm_rank_fails_the_job_like_a_cold_one(node):
    standby.park(node, nproc=2)
    job.start(node, spec("crash"))
    rd = job.run_dir(node, "crash")
    wait_until(lambda: all(monitor.read_steps(rd, r) for r in (0, 1)), timeout=120, what="both ranks to step")
    victim = monitor.read_heartbeat(rd, 1)["pid"]
    import os

    os.kill(victim, signal.SIGKILL)
    wait_until(lambda: (rd / "exit.json").exists(), timeout=60, what="the job to end")
    assert json.loads((rd / "exit.json").read_text())["returncode"] != 0
    # torchrun saw its worker die by the signal, as it would in a cold start
    assert "Signal 9 (SIGKILL)" in (rd / "supervisor.log").read_text()


@pytest.mark.skipif(not standby.AUTOGROUP.exists(), reason="this kernel has no scheduler autogroups")
def test_an_interpreter_warms_up_at_the_lowest_priority_of_its_session_and_serves_at_the_default():
    """Warming up (imports) beside a running job yields to it: the session's autogroup nice is 19 while
    importing and 0 again before the interpreter waits for work; a process that does not lead its session
    leaves the caller's session alone (also when the caller's is the root autogroup, which has no nice)."""
    import subprocess
    import sys

    probe = ("from node_tools import standby\n"
             "with standby._yielding():\n    inside = standby.autogroup_nice()\n"
             "print(inside, standby.autogroup_nice())\n")
    led = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True,
                         start_new_session=True)
    assert led.stdout.split() == ["19", "0"], led.stdout + led.stderr
    mine = str(standby.autogroup_nice())
    shared = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert shared.stdout.split() == [mine, mine], shared.stdout + shared.stderr


@pytest.mark.parametrize(("text", "nice"), [("/autogroup-12 nice 0\n", 0), ("/autogroup-3 nice 19\n", 19),
                                            ("/autogroup-3 nice -5\n", -5), ("", None), ("garbage\n", None)])
def test_the_autogroup_nice_is_read_and_the_root_autogroup_has_none(tmp_path, text, nice):
    """A process of init's session (the root autogroup) reads an empty file: no autogroup to lower."""
    path = tmp_path / "autogroup"
    path.write_text(text)
    assert standby.autogroup_nice(path) == nice
    assert standby.autogroup_nice(tmp_path / "missing") is None


def test_a_program_s_imports_are_read_without_running_it(tmp_path):
    (tmp_path / "teamlib").mkdir()
    (tmp_path / "teamlib" / "__init__.py").write_text("")
    (tmp_path / "model.py").write_text("")
    (tmp_path / "train.py").write_text(
        "from __future__ import annotations\nimport os, torch\nimport teamlib.data\nfrom model import GPT\n"
        "from . import nothing\ntry:\n    import lightning as L\nexcept ImportError:\n    L = None\n"
        "def main():\n    import transformers\nif __name__ == '__main__':\n    import sys\n    main()\n"
        "raise SystemExit('never run')\n")
    third, local = standby.program_imports(tmp_path, "train.py")
    assert third == ["os", "torch", "lightning"] and local == ["teamlib.data", "model"]
    assert standby.program_imports(tmp_path, "teamlib", module=True) == ([], [])  # an empty package's imports
    assert standby.program_imports(tmp_path, "missing.py") == ([], [])


def test_a_standby_parked_for_a_job_imports_its_program_and_a_changed_module_is_imported_afresh(node, tmp_path):
    """Parked interpreters imported the demo's examples.gpt3d.train whatever job they stood by, so a user's job
    swapped onto a standby started cold. They import the job's own program now; a module of its directory that
    changed after they parked is imported again when the job runs (not the parked copy)."""
    team = tmp_path / "team"
    team.mkdir()
    (team / "teamlib.py").write_text("VALUE = 'parked'\n")
    (team / "train.py").write_text(
        "import os\nimport torch\nimport teamlib\nif __name__ == '__main__':\n"
        "    with open(os.path.join(os.environ['OUT_DIR'], 'rank' + os.environ['RANK']), 'w') as fh:\n"
        "        fh.write(teamlib.VALUE)\n")
    parked = standby.park(node, nproc=2, workdir=str(team), entry="train.py")
    assert all({"torch", "teamlib"} <= set(s["preloaded"]) for s in parked["slots"])
    assert "examples.gpt3d.train" not in parked["slots"][0]["preloaded"]
    assert parked["program"]["entry"] == "train.py"
    (team / "teamlib.py").write_text("VALUE = 'changed'\n")
    st = (team / "teamlib.py").stat()
    os.utime(team / "teamlib.py", ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    out = tmp_path / "out"
    out.mkdir()
    started = job.start(node, dataclasses.replace(spec("warm"), entry="train.py", args=[], workdir=str(team),
                                                   env={"OUT_DIR": str(out)}))
    assert started["warm"] is True
    rd = job.run_dir(node, "warm")
    wait_until(lambda: (rd / "exit.json").exists(), timeout=120, what="the warm job to finish")
    assert json.loads((rd / "exit.json").read_text())["returncode"] == 0
    assert {p.name: p.read_text() for p in out.iterdir()} == {"rank0": "changed", "rank1": "changed"}
    # parked again for the demo's program, the interpreters warmed for the team's make way
    again = standby.park(node, nproc=2)
    assert again["started"] == 3 and "examples.gpt3d.train" in again["slots"][0]["preloaded"]


def test_a_dead_interpreter_s_files_do_not_name_the_process_that_got_its_pid(tmp_path):
    """Pids are reused: a claim or ready file left by a dead warm interpreter names, by pid alone, whatever process
    got that pid later (another job's rank). Such a file names no process of the job (to report running or to
    stop) and no free slot; the same files naming the live process that wrote them do."""
    import subprocess
    import sys

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        wait_until(lambda: procs.started(other.pid) is not None, timeout=10, what="the process to start")
        slots = tmp_path / "slots"
        slots.mkdir()
        for n, started in enumerate((procs.started(other.pid), procs.started(other.pid) - 3600.0)):
            (slots / f"slot{n}.claim").write_text(json.dumps({"pid": other.pid, "started": started,
                                                               "job_token": f"job{n}"}))
            (slots / f"slot{n + 2}.ready").write_text(json.dumps({"pid": other.pid, "started": started}))
        assert standby.claimed_pids(slots, "job0") == [other.pid]  # the process that wrote it: still the job's
        assert standby.claimed_pids(slots, "job1") == []  # an hour older than the process with that pid now
        workdir = tmp_path / "disk"
        standby.standby_dir(workdir).parent.mkdir(parents=True)
        standby.standby_dir(workdir).symlink_to(slots)
        assert [s["slot"] for s in standby.free_slots(workdir)] == ["slot2"]
    finally:
        other.kill()
        other.wait()
