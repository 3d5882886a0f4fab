"""Stop-time diagnostics (trainguard.node_tools.diag) on one machine: levels 1-3 and the alignment test.

Every diagnostic runs its tests in worker processes; these tests check the verdicts,
the reasons and that nothing outlives a timeout. No cluster is needed: level 3 runs
two "machines" as two concurrent diag() calls on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.conftest import free_port
from trainguard.core.errors import TrainguardError
from trainguard.emulation.faults import write_control
from trainguard.emulation.nvml import EmulatedNvml
from trainguard.node_tools import diag as d
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.diag import collectives, common, levels
from trainguard.node_tools.diag import runner as diag_runner


@pytest.fixture
def node(tmp_path):
    return NodeConfig(machine="m7", workdir=tmp_path / "disk", install_dir=tmp_path, gpus=2,
                      nvml_backend="emulated", nvml_state=tmp_path / "nvml.json", fault_file=tmp_path / "faults.json")


def sdc(cfg: NodeConfig) -> NodeConfig:
    write_control(cfg.fault_file, [{"id": "x", "kind": "sdc", "rank": None, "params": {"bit": 22}}])
    return cfg


def by_name(report):
    return {t["name"]: t for t in report["tests"]}


def test_level_1_healthy_ignores_the_ranks_of_a_dead_job(node):
    # a job whose rank has exited: the real-time checks report it, the machine is not to blame
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    run_dir = node.workdir / "jobs" / "j1"
    (run_dir / "ranks").mkdir(parents=True)
    (run_dir / "job.json").write_text(json.dumps({"incarnation": 0}))
    (run_dir / "ranks" / "rank0.json").write_text(json.dumps(
        {"pid": gone.pid, "status": "running", "incarnation": 0, "alive_ts": 0, "progress_ts": 0}))

    code, report = d.diag(node, 1)

    assert code == 0 and report["healthy"] and report["reasons"] == [], report["reasons"]
    tests = by_name(report)
    assert set(tests) == {"workdir", "checks", "gpu", "torch"}
    assert all(t["ok"] and t["duration_s"] >= 0 for t in tests.values())
    assert tests["checks"]["details"]["ignored_rank_findings"] >= 1
    assert tests["gpu"]["details"]["device_count"] == 2
    assert tests["torch"]["details"]["version"].startswith("2.")
    assert report["machine"] == "m7" and report["level"] == 1
    json.dumps(report, allow_nan=False)  # one strict JSON document


def test_level_1_names_a_lost_gpu(node):
    EmulatedNvml(node.nvml_state, machine=node.machine, gpus=2).inject("gpu_lost", {"gpu": 1})

    code, report = d.diag(node, 1)

    assert code == 1 and not report["healthy"]
    gpu = by_name(report)["gpu"]
    assert not gpu["ok"] and "GPU 1 missing" in gpu["reason"] and "1 of 2 GPUs" in gpu["reason"]
    assert gpu["details"]["missing"] == [1]
    assert any(r.startswith("gpu: GPU 1 missing") for r in report["reasons"])


def test_no_nvml_is_fine_without_gpus_and_a_failure_with_them(tmp_path):
    cfg = NodeConfig(machine="cpu1", workdir=tmp_path, install_dir=tmp_path, gpus=0, nvml_backend="none")
    assert levels.run_gpu({"config": _saved(cfg, tmp_path / "a.json")})["ok"]
    cfg.gpus = 8
    result = levels.run_gpu({"config": _saved(cfg, tmp_path / "b.json")})
    assert not result["ok"] and "8 GPUs are expected" in result["reason"]


def _saved(cfg: NodeConfig, path):
    cfg.save(path)
    return str(path)


def test_level_2_healthy_within_a_minute_with_bandwidths(node):
    t0 = time.monotonic()
    code, report = d.diag(node, 2)
    took = time.monotonic() - t0

    assert code == 0 and report["healthy"], report["reasons"]
    assert took < 60 and report["duration_s"] < 60
    tests = by_name(report)
    assert list(tests) == ["workdir", "checks", "gpu", "torch", "compute", "memory", "disk", "collective_local"]
    compute = tests["compute"]["details"]["devices"][0]
    assert compute["device"] == "cpu" and compute["wrong"] == 0 and compute["results"] >= 6
    assert tests["memory"]["details"]["gbps"] > 0
    coll = tests["collective_local"]["details"]
    assert coll["backend"] == "gloo" and coll["threads"] == 2  # no GPUs: the ranks are threads of the batch
    assert coll["allreduce_busbw_gbps"] > 0 and coll["allgather_algbw_gbps"] > 0
    assert all(r["ok"] and r["allreduce_ok"] and r["allgather_ok"] and r["alltoall_ok"] for r in coll["ranks"])
    disk = tests["disk"]["details"]
    assert disk["write_mbps"] > 0 and disk["read_mbps"] > 0
    assert list(node.workdir.iterdir()) == []  # the test files are gone
    json.dumps(report, allow_nan=False)


def test_level_2_catches_wrong_arithmetic(node):
    code, report = d.diag(sdc(node), 2)

    assert code == 1 and not report["healthy"]
    failed = [t for t in report["tests"] if not t["ok"]]
    assert [t["name"] for t in failed] == ["compute"]
    reason = failed[0]["reason"]
    assert reason.startswith("cpu: ") and "max error" in reason and "matmul results wrong" in reason
    assert failed[0]["details"]["devices"][0]["wrong"] == failed[0]["details"]["devices"][0]["results"]


def test_align_agrees_with_itself_and_not_with_a_broken_alu(node):
    runs = [d.align(node) for _ in range(2)]
    for code, report in runs:
        assert code == 0 and report["test"] == "align" and len(report["digest"]) == 64
        assert report["torch"].startswith("2.") and report["device"] == "cpu"
    assert runs[0][1]["digest"] == runs[1][1]["digest"]

    code, bad = d.align(sdc(node))
    assert code == 0  # it does not judge itself
    assert bad["digest"] != runs[0][1]["digest"] and bad["compare_key"] == runs[0][1]["compare_key"]
    assert bad["tests"][0]["details"]["sdc_flips"] == 1


def test_level_3_two_machines_on_loopback(tmp_path):
    port = free_port()
    cfgs = [NodeConfig(machine=f"m{i}", workdir=tmp_path / f"m{i}", install_dir=tmp_path, nvml_backend="none")
            for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(d.diag, cfgs[i], 3, timeout_s=60, l3=d.L3Spec(i, 2, "127.0.0.1", port))
                   for i in range(2)]
        results = [f.result() for f in futures]

    for i, (code, report) in enumerate(results):
        assert code == 0 and report["healthy"], report["reasons"]
        (test,) = report["tests"]
        det = test["details"]
        assert test["name"] == "collective_neighbours" and det["rank"] == i and det["backend"] == "gloo"
        assert det["allreduce_ok"] and det["allgather_ok"] and det["bad_peers"] == []
        assert det["ranks"] == [{"rank": 0, "ok": True}, {"rank": 1, "ok": True}]
        assert det["allreduce_algbw_gbps"] > 0 and det["iface"] == "lo"


def test_level_3_with_align_reports_each_machines_digest_from_the_same_process(tmp_path):
    """NaN's stop-time diagnosis: the alignment test after the collective, in its process; a machine
    with a broken ALU passes the collective (integer-valued data) and differs in its digest."""
    port = free_port()
    cfgs = [NodeConfig(machine=f"m{i}", workdir=tmp_path / f"m{i}", install_dir=tmp_path, nvml_backend="none",
                       fault_file=tmp_path / f"faults{i}.json") for i in range(2)]
    sdc(cfgs[1])
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(d.diag, cfgs[i], 3, timeout_s=60, l3=d.L3Spec(i, 2, "127.0.0.1", port),
                               align_steps=1) for i in range(2)]
        results = [f.result() for f in futures]
    _, alone = d.align(cfgs[0])

    for code, report in results:
        assert code == 0 and report["healthy"], report["reasons"]
        assert [t["name"] for t in report["tests"]] == ["collective_neighbours"]  # align does not judge
        assert report["align"]["exit_code"] == 0 and len(report["align"]["digest"]) == 64
    good, bad = (r["align"] for _, r in results)
    assert good["digest"] == alone["digest"] and good["compare_key"] == alone["compare_key"]
    assert bad["digest"] != good["digest"] and bad["compare_key"] == good["compare_key"]


def test_level_2_then_3_and_align_in_one_process(tmp_path):
    """The stop-time round of a NaN: L2's tests, then the collective with the neighbour and the alignment
    test, all in one test process per machine (one import of torch)."""
    port = free_port()
    cfgs = [NodeConfig(machine=f"m{i}", workdir=tmp_path / f"m{i}", install_dir=tmp_path, nvml_backend="none",
                       fault_file=tmp_path / f"faults{i}.json") for i in range(2)]
    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(d.diag, cfgs[i], 2, timeout_s=60, l3=d.L3Spec(i, 2, "127.0.0.1", port),
                               align_steps=1) for i in range(2)]
        results = [f.result() for f in futures]
    for i, (code, report) in enumerate(results):
        assert code == 0 and report["healthy"], report["reasons"]
        assert report["level"] == 2 and report["l3"]["rank"] == i
        assert [t["name"] for t in report["tests"]] == ["workdir", "checks", "gpu", "torch", "compute", "memory",
                                                        "disk", "collective_local", "collective_neighbours"]
        coll = report["tests"][-1]["details"]
        assert coll["rank"] == i and coll["allreduce_ok"] and coll["iface"] == "lo"
    assert results[0][1]["align"]["digest"] == results[1][1]["align"]["digest"]
    with pytest.raises(TrainguardError, match="not level 1"):
        d.diag(cfgs[0], 1, l3=d.L3Spec(0, 2, "127.0.0.1", port))
    with pytest.raises(TrainguardError, match="give the group"):
        d.diag(cfgs[0], 2, align_steps=1)


def test_level_3_peer_never_comes(node):
    t0 = time.monotonic()
    code, report = d.diag(node, 3, timeout_s=8, l3=d.L3Spec(0, 2, "127.0.0.1", free_port()))
    took = time.monotonic() - t0

    assert code in (1, 2) and not report["healthy"]
    assert took < 8 + 4
    assert "timed out waiting for peers" in report["tests"][0]["reason"]
    assert "127.0.0.1" in report["tests"][0]["reason"]


def test_level_3_peer_never_comes_align_still_runs(node):
    code, report = d.diag(node, 3, timeout_s=8, l3=d.L3Spec(0, 2, "127.0.0.1", free_port()), align_steps=1)
    assert code in (1, 2) and "timed out waiting for peers" in report["tests"][0]["reason"]
    assert report["align"]["exit_code"] == 0 and len(report["align"]["digest"]) == 64


def test_a_test_past_its_timeout_is_killed_with_its_process(node, monkeypatch):
    started: list[diag_runner.Worker] = []
    real_init = diag_runner.Worker.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(diag_runner.Worker, "__init__", spy)
    # the disk exists already: a test that does finish in time (the real-time checks) has nothing to fail on,
    # even when the workdir test, which would have made it, was killed first
    node.workdir.mkdir(parents=True)
    code, report = d.diag(node, 1, timeout_s=0.05)

    assert code == 1
    slow = [t for t in report["tests"] if not t["ok"]]
    assert slow and all("did not finish within 0.05 s" in t["reason"] for t in slow), \
        [(t["name"], t["status"], t["reason"]) for t in slow]
    assert all(w.proc.returncode is not None for w in started)  # reaped: nothing left running


def test_a_batch_goes_on_in_a_fresh_process_after_a_test_times_out(tmp_path, node, monkeypatch):
    started: list[diag_runner.Worker] = []
    real_init = diag_runner.Worker.__init__

    def spy(self, *args, **kwargs):
        real_init(self, *args, **kwargs)
        started.append(self)

    monkeypatch.setattr(diag_runner.Worker, "__init__", spy)
    runner = diag_runner.Runner(node, tmp_path, timeout_s=3, seed=0)
    # a rank whose peer never comes blocks in its rendezvous past the test's timeout
    hanging = {"rank": 0, "world_size": 2, "master_addr": "127.0.0.1", "master_port": free_port(),
               "backend": "gloo", "device": "cpu"}
    t0 = time.monotonic()
    workdir, collective, gpu = runner.batch([("workdir", {}), ("collective", hanging), ("gpu", {})])
    assert time.monotonic() - t0 < 3 * 3
    assert workdir["ok"] and gpu["ok"], (workdir, gpu)
    assert not collective["ok"] and collective["reason"] == "did not finish within 3 s; killed"
    assert len(started) == 2 and all(w.proc.returncode is not None for w in started)


def test_local_collective_with_one_process_per_rank(node, tmp_path):
    """The path of a machine with GPUs (one process per device), here with gloo on the CPU."""
    runner = diag_runner.Runner(node, tmp_path, timeout_s=60, seed=0)
    try:
        result = runner.local_collective({"cuda_device_count": 0})
    finally:
        assert runner.sweep() == []
    details = result["details"]
    assert result["ok"], result["reason"]
    assert details["backend"] == "gloo" and details["processes"] == 2
    assert details["allreduce_busbw_gbps"] > 0
    assert all(r["ok"] and r["allreduce_ok"] and r["alltoall_ok"] for r in details["ranks"])


def test_threaded_collective_names_the_rank_that_failed(node, tmp_path, monkeypatch):
    """A rank thread that raises fails the test with its rank named; its peer is not left waiting forever."""
    real = collectives.collective_checks

    def broken(args, rank, world, seed, dev, details, ops=None):
        if rank == 1:
            raise RuntimeError("emulated broken rank")
        return real(args, rank, world, seed, dev, details, ops)

    monkeypatch.setattr(collectives, "collective_checks", broken)
    t0 = time.monotonic()
    result = collectives.run_collective_threads({"world_size": 2, "seed": 0, "deadline_unix": time.time() + 6})
    assert time.monotonic() - t0 < 10
    assert not result["ok"]
    assert "rank 1: RuntimeError: emulated broken rank" in result["reason"]
    assert [r["ok"] for r in result["details"]["ranks"]] == [False, False]


def test_disk_errors_carry_the_errno(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("x")
    cfg = NodeConfig(machine="m", workdir=blocker / "sub", install_dir=tmp_path)
    result = levels.run_disk({"config": _saved(cfg, tmp_path / "n.json"), "size_mib": 1})
    assert not result["ok"] and "errno 20 (ENOTDIR)" in result["reason"]


@pytest.mark.parametrize("level", [0, 4, "2", True])
def test_unknown_levels_are_refused(node, level):
    with pytest.raises(TrainguardError, match=r"diag level .* is unknown") as exc:
        d.diag(node, level)
    assert exc.value.exit_code == 2


def test_level_3_needs_its_group(node):
    with pytest.raises(TrainguardError, match="needs the group") as exc:
        d.diag(node, 3)
    assert exc.value.exit_code == 2
    with pytest.raises(TrainguardError, match=r"rank 2 is outside 0\.\.1"):
        d.diag(node, 3, l3=d.L3Spec(2, 2, "127.0.0.1", 29500))


def test_a_failed_rank_stops_its_waiting_peers(tmp_path):
    # one worker fails at once; its "peer" waits for a rendezvous that never completes
    blocker = tmp_path / "file"
    blocker.write_text("x")
    cfg = NodeConfig(machine="m", workdir=blocker / "sub", install_dir=tmp_path)
    runner = diag_runner.Runner(cfg, tmp_path, timeout_s=30, seed=0)
    t0 = time.monotonic()
    failing = runner._start([("workdir", {})])
    waiting = runner._start([("collective", {"rank": 0, "world_size": 2, "master_addr": "127.0.0.1",
                                             "master_port": free_port(), "backend": "gloo", "device": "cpu"})])
    try:
        diag_runner.wait_all([failing, waiting], "rank {} failed")
    finally:
        waiting.kill()
    assert time.monotonic() - t0 < 15
    assert runner._judge("rank 0", failing, "workdir")["reason"].startswith("write/read in")
    assert runner._judge("rank 1", waiting)["reason"] == "stopped: rank 0 failed"


def test_stragglers_of_a_run_are_ended(tmp_path, node):
    runner = diag_runner.Runner(node, tmp_path, timeout_s=5, seed=0)
    env = {**os.environ, common.MARKER_ENV: runner.marker}
    orphan = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(120)"],
                              env=env, start_new_session=True, stdout=subprocess.PIPE, text=True)
    try:
        assert orphan.stdout.readline().strip() == "up"  # running as a straggler does, not still being born
        assert runner.sweep() == [orphan.pid]
        assert orphan.wait(timeout=10) != 0
    finally:
        orphan.kill()
        orphan.wait()
        orphan.stdout.close()
