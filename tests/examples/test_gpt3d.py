"""The reference job (examples/gpt3d) run for real on one host: torchrun, gloo on CPU, a small model.

* tensor and pipeline parallelism are exact: TP=2 and PP=2 give the loss of one process;
* two runs with the same seed and layout give identical losses and parameters;
* a layout that does not fit the ranks is refused with one line and exit code 2.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

from examples.gpt3d.data import MarkovData
from examples.gpt3d.train import main as train_main
from examples.gpt3d.train import shuffle_window
from tests import REPO
from tests.conftest import free_port
from trainguard.core.topology import Topology
from trainguard.node_tools.monitor import read_heartbeat, read_steps

TRAIN = "examples/gpt3d/train.py"
SMALL = ["--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "32",
         "--micro-batches", "2", "--micro-batch-size", "2", "--vocab", "128"]
STEPS = 3


def _env(run_dir: Path, **extra: str) -> dict[str, str]:
    env = {**os.environ, "TG_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}
    env.pop("TG_FAULT_FILE", None)
    return env


def _run(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in its own session; on a timeout kill that session (torchrun and its workers)."""
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} ran over {timeout}s\n{out}\n{err}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def torchrun(run_dir: Path, tp: int, pp: int, dp: int, *extra: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(tp * pp * dp),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           TRAIN, "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), *extra]
    return _run(cmd, _env(run_dir))


def train(run_dir: Path, tp: int, pp: int, dp: int, steps: int = STEPS) -> dict[int, list[dict[str, Any]]]:
    """Train ``steps`` steps of the small model; check the run is sound; return each rank's step records."""
    res = torchrun(run_dir, tp, pp, dp, "--steps", str(steps), *SMALL)
    assert res.returncode == 0, f"tp={tp} pp={pp} dp={dp} failed:\n{res.stdout}\n{res.stderr[-4000:]}"
    world = tp * pp * dp
    records = {r: read_steps(run_dir, r) for r in range(world)}
    for r, recs in records.items():
        assert [s["step"] for s in recs] == list(range(steps)), r
        hb = read_heartbeat(run_dir, r)
        assert hb is not None and hb["status"] == "finished" and hb["step"] == steps - 1, (r, hb)
        # every rank reports the same loss at every step (pipeline broadcast, DP mean)
        assert [s["loss"] for s in recs] == [s["loss"] for s in records[0]], r
    topo = Topology(tp, pp, dp)
    for r in range(world):  # DP replicas hold identical parameters
        for peer in topo.group("dp", r):
            assert [s["param_digest"] for s in records[peer]] == [s["param_digest"] for s in records[r]], (r, peer)
    # the report line comes from the last stage's tp=0 rank of replica 0, once per step
    assert len(re.findall(r"^step \d+ loss [\d.]+ grad_norm", res.stdout, re.M)) == steps, res.stdout
    return records


@pytest.mark.slow  # three torchrun launches: ~25 s on 2 cores
def test_tensor_and_pipeline_parallel_match_one_process(tmp_path: Path):
    one = train(tmp_path / "tp1pp1", 1, 1, 1)[0]
    for tp, pp in ((2, 1), (1, 2)):
        split = train(tmp_path / f"tp{tp}pp{pp}", tp, pp, 1)[0]
        # the same full model on the same data: the same first loss and gradient norm
        assert split[0]["loss"] == pytest.approx(one[0]["loss"], abs=1e-5), (tp, pp)
        assert split[0]["grad_norm"] == pytest.approx(one[0]["grad_norm"], rel=1e-4), (tp, pp)
        # and the same updates (the sharded backward is right): later losses agree too
        for step in range(1, STEPS):
            assert split[step]["loss"] == pytest.approx(one[step]["loss"], abs=1e-4), (tp, pp, step)
    assert one[-1]["loss"] < one[0]["loss"]


def test_same_seed_same_layout_repeats_exactly(tmp_path: Path):
    first = train(tmp_path / "a", 1, 1, 2)
    second = train(tmp_path / "b", 1, 1, 2)
    for r in first:
        assert [s["loss"] for s in second[r]] == [s["loss"] for s in first[r]], r
        assert [s["grad_norm"] for s in second[r]] == [s["grad_norm"] for s in first[r]], r
        assert [s["param_digest"] for s in second[r]] == [s["param_digest"] for s in first[r]], r
    # the two replicas saw different data
    assert first[0][0]["replica_loss"] != first[1][0]["replica_loss"]


@pytest.mark.parametrize(
    ("world", "args", "message"),
    [
        (8, ["--tp", "3", "--pp", "2", "--dp", "2"], "= 12 ranks, but the job has WORLD_SIZE=8"),
        (2, ["--tp", "1", "--pp", "2", "--dp", "1", "--layers", "3"], "--layers 3 do not split evenly"),
        (4, ["--tp", "4", "--pp", "1", "--dp", "1", "--heads", "6", "--d-model", "96"], "--heads 6 do not split"),
        (4, ["--tp", "2", "--pp", "1", "--dp", "2"], "do not fill machines of 3 ranks"),
    ],
)
def test_bad_layout_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str], world: int, args: list[str],
                                           message: str):
    """The entry point's own refusal, in process (the torchrun test below runs it for real)."""
    run_dir = tmp_path / "run"
    local_world = 3 if "fill machines" in message else world
    for key, value in {"TG_RUN_DIR": str(run_dir), "WORLD_SIZE": str(world), "RANK": "0", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": str(local_world)}.items():
        monkeypatch.setenv(key, value)
    assert train_main([*args, "--steps", "1"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpt3d: error: ") and message in lines[0], err
    assert not run_dir.exists()  # refused before the monitor hook started


def test_bad_layout_under_torchrun(tmp_path: Path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           TRAIN, "--tp", "3", "--pp", "1", "--dp", "1", "--steps", "1", *SMALL]
    res = _run(cmd, _env(tmp_path / "bad"))
    assert res.returncode != 0
    output = res.stdout + res.stderr
    # one line from local rank 0, and the workers exited with code 2
    assert output.count("gpt3d: error: --tp 3 x --pp 1 x --dp 1 = 3 ranks, but the job has WORLD_SIZE=2") == 1
    assert re.search(r"exitcode\s*:\s*2\b", res.stderr), res.stderr
    assert 'train.py", line' not in output  # refused, not crashed


def test_batches_are_a_pure_function_of_seed_step_and_replica():
    def make(seed: int) -> MarkovData:
        return MarkovData(vocab=128, seq_len=16, micro_batches=2, micro_batch_size=3, seed=seed)

    a, b = make(7), make(7)
    x, y = a.batch(5, 1)
    assert x.shape == y.shape == (2, 3, 16) and x.dtype == torch.int64
    assert torch.equal(x, b.batch(5, 1)[0]) and torch.equal(y, b.batch(5, 1)[1])
    assert torch.equal(x[..., 1:], y[..., :-1])  # targets are the inputs shifted by one
    assert not torch.equal(x, a.batch(6, 1)[0]) and not torch.equal(x, a.batch(5, 0)[0])
    assert not torch.equal(x, make(8).batch(5, 1)[0])
    # low entropy: every token has at most 4 successors
    assert 0.2 < a.entropy_rate() < 1.39


def test_user_error_is_raised_from_the_jobs_own_file():
    with pytest.raises(IndexError) as info:
        shuffle_window(torch.arange(64).view(1, 64), window=8)
    last = traceback.extract_tb(info.value.__traceback__)[-1]
    assert Path(last.filename).resolve() == (REPO / TRAIN).resolve()
    assert last.name == "shuffle_window"


def test_a_nan_step_is_never_trained_on_nor_snapshotted(tmp_path: Path):
    """The loss turns NaN at step 0 (the emulated fault, on the last pipeline stage): every rank skips that
    update together, records the step, holds still for the control plane (1 s here, nobody comes), then
    goes on with the next batch from finite parameters; no copy of the NaN step is ever written."""
    import json

    from trainguard.checkpoint import layout

    run_dir, ckpt = tmp_path / "run", tmp_path / "ckpt"
    control = tmp_path / "faults.json"
    control.write_text(json.dumps({"faults": [{"kind": "nan", "rank": 1, "id": "f1"}]}))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           TRAIN, "--tp", "1", "--pp", "2", "--dp", "1", "--steps", "4", "--nonfinite-hold-s", "1",
           "--checkpoint", "--checkpoint-ranks-per-machine", "1", "--checkpoint-dir", f"{ckpt}/m{{machine}}",
           *SMALL]
    res = _run(cmd, {**_env(run_dir), "TG_FAULT_FILE": str(control)})
    assert res.returncode == 0, res.stderr[-3000:]
    records = {r: read_steps(run_dir, r) for r in range(2)}
    losses = [s["loss"] for s in records[0]]
    assert losses[0] == "nan", losses  # the fault fired at this run's first step
    # the parameters stayed finite: an update with the NaN gradients would have made every later loss NaN
    assert len(losses) == 4 and all(isinstance(x, float) for x in losses[1:]), losses
    assert "holding up to 1s for the control plane" in res.stdout and "going on with the next batch" in res.stdout
    for r in range(2):
        steps = sorted(s for s, _r, _p in layout.list_copies(ckpt / f"m{r}", "local", rank=r))
        assert 0 not in steps and steps, (r, steps)  # the NaN step was refused; later ones were kept
        assert records[r][0]["ckpt_refused"] is True
