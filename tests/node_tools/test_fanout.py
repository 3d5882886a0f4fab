"""The fan-out's width and the pieces of the fan-out benchmark and of the scale-out plane that run without a
cluster: a round opens up to ``TG_SSH_FANOUT`` sessions at once (not a fixed 32), the direct launcher runs the
stand-in job with torchrun's variables and no torch, and ``trainguard controlplane`` refuses bad input in one
line before it starts anything."""

from __future__ import annotations

import json
import threading
import time

import pytest

from tests import REPO
from trainguard.core.errors import TrainguardError
from trainguard.core.topology import Topology
from trainguard.emulation import controlplane, scaleout, servers
from trainguard.node_tools import job
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.node_tools.launcher import JobPlan
from trainguard.node_tools.transport import FANOUT, RunResult, Transport, transport_for
from trainguard.operators.cli import main as run_cli
from trainguard.operators.settings import ControlSettings, SettingsError


def _inventory(n: int) -> Inventory:
    return Inventory(cluster="t", transport="local", bus_url="spool:///nowhere", machines=[
        Machine(name=f"m{i}", address="127.0.0.1", port=22, role="active", host_key="k", workdir="/w", gpus=0)
        for i in range(n)])


class _Counting(Transport):
    """Sessions that wait (up to 2 s) until every machine's session is open; the most open at once."""

    def __init__(self, inv: Inventory, **kwargs: int) -> None:
        super().__init__(inv, **kwargs)
        self.lock, self.open, self.peak = threading.Lock(), 0, 0
        self.all_in = threading.Event()

    def run(self, machine, argv, *, timeout=30.0, stdin=None, env=None):
        with self.lock:
            self.open += 1
            self.peak = max(self.peak, self.open)
            if self.open == len(self.inventory.machines):
                self.all_in.set()
        self.all_in.wait(2.0)
        with self.lock:
            self.open -= 1
        return RunResult(machine.name, list(argv), 0, "{}", "", 0.0)


def test_a_round_opens_a_session_to_every_machine_at_once_up_to_the_fanout():
    inv = _inventory(100)
    wide = _Counting(inv)
    t0 = time.monotonic()
    results = wide.run_many(inv.machines, lambda m: ["x"])
    assert len(results) == 100 and wide.peak == 100 and time.monotonic() - t0 < 2.0  # one wave, no one waited out
    narrow = _Counting(inv, fanout=32)
    narrow.run_many(inv.machines, lambda m: ["x"])
    assert narrow.peak == 32  # capped: the rest waited for a free session
    assert transport_for(inv).fanout == FANOUT == 256


def test_the_fanout_is_a_setting_the_controllers_transport_takes(tmp_path, monkeypatch):
    from trainguard.operators.control import Controller

    inv = _inventory(3)
    inv.save(tmp_path / "inventory.json")
    monkeypatch.setenv("TG_SSH_FANOUT", "512")
    cfg = ControlSettings.from_env()
    assert cfg.ssh_fanout == 512
    ctl = Controller(cfg.model_copy(update={"inventory": str(tmp_path / "inventory.json"),
                                            "fleet_url": str(tmp_path / "fleet.db")}))
    assert ctl.transport.fanout == 512 and ctl.jobs.transport is ctl.transport
    monkeypatch.setenv("TG_SSH_FANOUT", "0")
    with pytest.raises(SettingsError, match="TG_SSH_FANOUT"):
        ControlSettings.from_env()


def test_the_direct_launcher_is_one_cold_process_a_machine():
    base = dict(job="j", nnodes=4, node_rank=1, nproc_per_node=1, master_addr="10.0.0.1", master_port=29500,
                entry="examples/standin.py")
    job.JobSpec(**base, launcher="direct").validate()
    for bad in ({"nproc_per_node": 2}, {"warm": True}, {"warm_if_parked": True}):
        with pytest.raises(TrainguardError, match="direct launcher"):
            job.JobSpec(**{**base, **bad}, launcher="direct").validate()
    with pytest.raises(TrainguardError, match="launcher 'mpirun' must be one of torchrun, direct"):
        job.JobSpec(**base, launcher="mpirun").validate()
    inv = _inventory(4)
    plan = JobPlan(job="j", topology=Topology(tp=1, pp=1, dp=4, ranks_per_machine=1), machines=inv.machines,
                   launcher="direct", entry="examples/standin.py")
    argv = plan.start_argv(inv, inv.machines[2])
    assert argv[argv.index("--launcher") + 1] == "direct" and argv[argv.index("--node-rank") + 1] == "2"
    assert "--launcher" not in JobPlan(job="j", topology=plan.topology, machines=inv.machines,
                                       entry="examples/standin.py").start_argv(
        inv, inv.machines[0])  # torchrun stays the default and unnamed


@pytest.mark.slow
def test_the_stand_in_job_beats_and_records_steps_without_torchrun_and_stops_cleanly(tmp_path):
    cfg = NodeConfig(machine="m0", workdir=tmp_path / "disk", install_dir=REPO)
    spec = job.JobSpec(job="standin", nnodes=3, node_rank=2, nproc_per_node=1, master_addr="127.0.0.1",
                       master_port=29511, entry="examples/standin.py", args=["--step-s", "0.1"], launcher="direct")
    started = job.start(cfg, spec)
    try:
        assert started["state"] == "running" and "torch" not in " ".join(job.read_record(cfg, "standin")["command"])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ranks = job.status(cfg, "standin")["ranks"]
            if ranks and ranks[0].get("step", -1) >= 2:
                break
            time.sleep(0.1)
        assert ranks and ranks[0]["rank"] == 2 and ranks[0]["step"] >= 2, ranks  # RANK = the node rank
        assert ranks[0]["last_step"]["step"] >= 1 and ranks[0]["process_state"] != "gone"  # step records
    finally:
        job.stop(cfg, "standin", grace_s=5)
    assert job.status(cfg, "standin")["state"] != "running"


def test_controlplane_refuses_bad_shapes_and_a_second_profile_in_one_line(tmp_path, capsys):
    state = tmp_path / "cluster"
    rc = run_cli(["--state-dir", str(state), "controlplane", "up", "--profile", "scaleout", "--workers", "0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "--workers 0 must be 1..8" in err
    assert not (tmp_path / "control").exists()  # nothing started, nothing written
    # a plane that runs (its pid alive: this process) is not replaced by another profile
    home = tmp_path / "control"
    home.mkdir()
    (home / controlplane.PROFILE_FILE).write_text(json.dumps({"profile": "scaleout", "url": "http://x"}))
    import os

    (home / scaleout.STATE).write_text(json.dumps({"pids": {"api-server": os.getpgid(0)}}))
    rc = run_cli(["--state-dir", str(state), "controlplane", "up", "--profile", "embedded"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "the scaleout control plane runs in" in err and "controlplane down" in err
    assert run_cli(["--state-dir", str(state), "controlplane", "status"]) == 0
    (home / scaleout.STATE).write_text(json.dumps({"pids": {"api-server": 2 ** 22 + 7}}))  # no such process
    assert run_cli(["--state-dir", str(state), "controlplane", "status"]) == 1


def test_a_plane_with_nothing_started_comes_down_as_a_no_op(tmp_path):
    assert scaleout.down(tmp_path / "control") == {"stopped": [], "namespaces": []}
    assert controlplane.status(tmp_path / "cluster") == {"profile": "", "url": "", "processes": {}}


def test_password_file_lines_escape_what_libpq_would_split_on():
    line = servers.pgpass_line("10.0.0.1", 5432, "db", "role", "pa:ss\\word")
    assert line == "10.0.0.1:5432:db:role:pa\\:ss\\\\word"


def test_a_stop_gives_every_machine_the_limit_it_is_handed_to_be_marked(tmp_path):
    from trainguard.node_tools import launcher

    seen: dict[str, float] = {}

    class Recording(Transport):
        def run_two_phase(self, machines, argv_for, *, timeout=30.0, ready_timeout=None):
            seen.update(timeout=timeout, ready=ready_timeout)
            return {m.name: RunResult(m.name, argv_for(m), 0, "{}", "", 0.0) for m in machines}

    inv = _inventory(4)
    launcher.stop_sessions(inv, "j", inv.machines, grace_s=10, transport=Recording(inv))
    assert seen == {"timeout": 40.0, "ready": 30.0}  # the recovery's limits
    launcher.stop_sessions(inv, "j", inv.machines, grace_s=10, transport=Recording(inv), limit_s=300)
    assert seen == {"timeout": 310.0, "ready": 300.0}


def test_the_fanout_results_merge_into_the_scale_file_and_render_in_the_benchmark_table(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    from bench import fanout, table

    out = tmp_path / "scale.json"
    out.write_text(json.dumps({"name": "scale", "metrics": {"stack_analysis_s.1000": {
        "median": 0.007, "n": 3, "unit": "s"}}, "setup": {}}))

    def size(n: int, stop_s: float, *, failed: list[str] | None = None, limits: str = "the recovery's") -> dict:
        rounds = {r: {"s": stop_s, "trials_s": [stop_s] * 3, "control_cpu_s": n * 0.008, "host_cpu_s": n * 0.2}
                  for r in fanout.ROUNDS}
        return {"machines": n, "rounds": rounds, "refused": 0, "failed": failed or [], "limits": limits}

    fanout.merge(out, {16: size(16, 1.3), 256: size(256, 63.0, failed=["trial 0: stop: 256 machines"])}, {})
    doc = fanout.merge(out, {256: size(256, 90.0, limits="the recovery's x 3")}, {})  # measured again, patient
    m = doc["metrics"]
    assert m["stack_analysis_s.1000"]["median"] == 0.007  # the scale benchmark's own metrics stay
    assert m["fanout_stop_ratio_256_vs_16"]["value"] == round(90.0 / 1.3, 2)
    assert m["largest_fanout_machines"]["value"] == 16  # 256 passed only with longer limits
    assert doc["setup"]["fanout"]["sizes"]["256"]["with_the_recoverys_limits"] == ["trial 0: stop: 256 machines"]
    monkeypatch.setattr(table, "ROOT", tmp_path)
    (tmp_path / "bench" / "results").mkdir(parents=True)
    (tmp_path / "bench" / "results" / "scale.json").write_text(out.read_text())
    rendered = "\n".join(table.rows())
    assert "| scale | fanout_stop_s.256 | 90 s |" in rendered and "largest_fanout_machines | 16 machines" in rendered
    row = next(line for line in rendered.splitlines() if "fanout_stop_s.256" in line)
    assert row.endswith("`python bench/fanout.py` |")  # the script that measured it, not the file's
    own = next(line for line in rendered.splitlines() if "stack_analysis" in line)
    assert own.endswith("`python bench/scale.py` |")
