"""Fault catalogue, in-job fault points, the monitor hook's files, and the emulated NVML."""

from __future__ import annotations

import json
import math
import threading

import pytest
import torch

from trainguard.core.errors import FaultError
from trainguard.emulation import faults
from trainguard.emulation.nvml import EmulatedNvml
from trainguard.node_tools.monitor import JobMonitor, read_heartbeat, read_steps


def test_every_fault_from_the_foundation_issue_is_in_the_catalogue():
    wanted = {"crash", "exit", "hang", "hang_collective", "slow", "nan", "bitflip", "user_error",
              "nic_down", "disk_full", "gpu_lost", "xid", "ecc", "thermal"}
    assert wanted <= set(faults.FAULT_KINDS)


def test_params_are_typed_and_unknown_ones_refused():
    slow = faults.fault_kind("slow")
    assert faults.resolve_params(slow, {"seconds": "1.5"}) == {"seconds": 1.5}
    with pytest.raises(FaultError, match="takes no parameter speed"):
        faults.resolve_params(slow, {"speed": "2"})
    with pytest.raises(FaultError, match="is not a float"):
        faults.resolve_params(slow, {"seconds": "fast"})
    with pytest.raises(FaultError, match="unknown fault 'meteor'"):
        faults.fault_kind("meteor")


def control(tmp_path, *entries):
    path = tmp_path / "faults.json"
    faults.write_control(path, list(entries))
    return path


def test_in_job_points_are_inert_without_a_control_file(tmp_path):
    f = faults.InJobFaults(None, rank=0)
    loss = torch.tensor(2.0)
    assert f.corrupt_loss(loss).item() == 2.0
    assert f.corrupt_grads([torch.ones(3)]) is False
    f.before_step(0)
    f.before_collective("dp", "all_reduce")


def test_nan_fires_once_for_its_rank_only(tmp_path):
    path = control(tmp_path, {"id": "a", "kind": "nan", "rank": 1, "params": {}})
    other, target = faults.InJobFaults(path, rank=0), faults.InJobFaults(path, rank=1)
    assert other.corrupt_loss(torch.tensor(1.0)).item() == 1.0
    assert math.isnan(target.corrupt_loss(torch.tensor(1.0)).item())
    assert target.corrupt_loss(torch.tensor(1.0)).item() == 1.0  # one-shot
    # a restarted rank (a new process) does not see the transient fault again; another injection fires
    restarted = faults.InJobFaults(path, rank=1)
    assert restarted.corrupt_loss(torch.tensor(1.0)).item() == 1.0
    faults.write_control(path, [{"id": "a", "kind": "nan", "rank": 1, "params": {}},
                                {"id": "c", "kind": "nan", "rank": 1, "params": {}}])
    assert math.isnan(restarted.corrupt_loss(torch.tensor(1.0)).item())


def test_a_bug_in_the_code_meets_every_new_process_of_its_revision(tmp_path, monkeypatch):
    monkeypatch.setenv("TG_REVISION", "r1")
    path = control(tmp_path, {"id": "u", "kind": "user_error", "rank": 0, "params": {"revision": "r1"}})
    first = faults.InJobFaults(path, rank=0)
    assert first.active("user_error") is not None and first.active("user_error") is None  # once per process
    assert faults.InJobFaults(path, rank=0).active("user_error") is not None  # restarted: the bug is back
    monkeypatch.setenv("TG_REVISION", "r0")  # rolled back
    assert faults.InJobFaults(path, rank=0).active("user_error") is None


def test_bitflip_flips_exactly_the_requested_bit(tmp_path):
    path = control(tmp_path, {"id": "b", "kind": "bitflip", "rank": None, "params": {"bit": 22}})
    p = torch.nn.Parameter(torch.zeros(4))
    p.grad = torch.full((4,), 1.0)
    before = p.grad.clone()
    assert faults.InJobFaults(path, rank=3).corrupt_grads([p])
    assert p.grad[0].item() == 1.5  # mantissa MSB of 1.0
    assert torch.equal(p.grad[1:], before[1:])


def test_a_bitflip_stays_with_its_gpu_in_any_job_while_a_slow_rank_is_the_jobs(tmp_path):
    path = control(tmp_path, {"id": "b", "kind": "bitflip", "rank": 4, "local_rank": 0, "params": {"bit": 22}},
                   {"id": "s", "kind": "slow", "rank": 4, "local_rank": 0, "params": {"seconds": 0.5}})
    main_job, replay = faults.InJobFaults(path, rank=4, local_rank=0), faults.InJobFaults(path, rank=2, local_rank=0)
    other_gpu = faults.InJobFaults(path, rank=4, local_rank=1)  # rank 4 of another layout, on another GPU
    assert main_job.active("bitflip") and replay.active("bitflip") and other_gpu.active("bitflip") is None
    assert main_job.active("slow") and replay.active("slow") is None


def test_exit_raises_systemexit_with_the_code(tmp_path):
    path = control(tmp_path, {"id": "e", "kind": "exit", "rank": 0, "params": {"code": 7}})
    with pytest.raises(SystemExit) as info:
        faults.InJobFaults(path, rank=0).before_step(3)
    assert info.value.code == 7


def test_hang_collective_blocks_until_cleared(tmp_path):
    path = control(tmp_path, {"id": "h", "kind": "hang_collective", "rank": 0, "params": {"group": "dp"}})
    f = faults.InJobFaults(path, rank=0)
    f.poll_interval_s = 0.01
    f.before_collective("tp", "all_reduce")  # another group passes
    entered, done = threading.Event(), threading.Event()

    def worker():
        entered.set()
        f.before_collective("dp", "all_reduce")
        done.set()

    t = threading.Thread(target=worker, daemon=True)
    t.start()
    entered.wait(5)
    assert not done.wait(0.3)  # still blocked after many polls
    faults.write_control(path, [])
    assert done.wait(5)


def test_monitor_writes_heartbeat_and_steps(tmp_path):
    m = JobMonitor(run_dir=tmp_path, rank=3, world_size=8, job="j", machine="m1", coords={"tp": 1},
                   flush_interval_s=0.05, faults=faults.InJobFaults(None, rank=3))
    m.start()
    with m.collective("dp", "all_reduce"):
        pass
    with m.collective("dp", "all_reduce"):
        pass
    m.step_end(0, loss=2.5, grad_norm=float("nan"), step_time_s=0.1, tokens_per_s=10.0, param_digest="ab")
    m.close("finished")
    hb = read_heartbeat(tmp_path, 3)
    assert hb["status"] == "finished" and hb["step"] == 0 and hb["machine"] == "m1"
    assert hb["collectives"]["dp"] == {"started": 2, "completed": 2, "last_op": "all_reduce"}
    (rec,) = read_steps(tmp_path, 3)
    assert rec["loss"] == 2.5 and rec["grad_norm"] == "nan" and rec["param_digest"] == "ab"
    assert rec["collectives"] == {"dp": 2}


def test_a_clock_fault_stamps_the_ranks_heartbeats_and_steps_that_far_off_and_its_beats_still_count(tmp_path):
    import time

    path = control(tmp_path, {"id": "c", "kind": "clock", "rank": 3, "params": {"offset_s": -3600.0}})
    m = JobMonitor(run_dir=tmp_path, rank=3, world_size=8, job="j", machine="m1", flush_interval_s=0.05,
                   faults=faults.InJobFaults(path, rank=3))
    m.flush()
    first = read_heartbeat(tmp_path, 3)
    m.step_end(0, loss=2.5, grad_norm=1.0, step_time_s=0.1, tokens_per_s=10.0)
    m.flush()
    hb = read_heartbeat(tmp_path, 3)
    assert -3610 < hb["alive_ts"] - time.time() < -3590 and hb["beat"] == first["beat"] + 1
    (rec,) = read_steps(tmp_path, 3)
    assert -3610 < rec["ts"] - time.time() < -3590
    faults.write_control(path, [])
    m.flush()
    assert abs(read_heartbeat(tmp_path, 3)["alive_ts"] - time.time()) < 5
    m.close()


def test_read_steps_ignores_a_torn_last_line(tmp_path):
    (tmp_path / "ranks").mkdir()
    (tmp_path / "ranks" / "rank0.steps.jsonl").write_text('{"step": 0}\n{"step": 1, "lo')
    assert read_steps(tmp_path, 0) == [{"step": 0}]


def test_emulated_nvml_faults(tmp_path):
    nv = EmulatedNvml(tmp_path / "nvml.json", machine="m0", gpus=4)
    nv.reset()
    assert nv.snapshot()["device_count"] == 4
    nv.inject("gpu_lost", {"gpu": 2})
    nv.inject("ecc", {"gpu": 0})
    nv.inject("thermal", {"gpu": 1, "temperature_c": 97})
    snap = nv.snapshot()
    assert snap["device_count"] == 3 and [d["index"] for d in snap["devices"]] == [0, 1, 3]
    assert snap["devices"][0]["ecc_uncorrectable"] == 1 and snap["devices"][0]["remap_pending"]
    assert snap["devices"][1]["temperature_c"] == 97 and snap["devices"][1]["throttle_reasons"]
    assert [e["xid"] for e in snap["xid_events"]] == [79, 48]
    with pytest.raises(FaultError, match="no GPU 9"):
        nv.inject("xid", {"gpu": 9})
    nv.reset()
    assert nv.snapshot()["device_count"] == 4
    json.loads((tmp_path / "nvml.json").read_text())
