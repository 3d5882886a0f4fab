"""The trainers' adapters on this host under torchrun: a Lightning ``Trainer`` on Lightning's demo transformer
(trainguard.lightning) and the Hugging Face ``Trainer`` on GPT-2 built from a configuration
(trainguard.transformers), one rank each (their data-parallel runs recover on the emulated cluster), and a plain
FSDP2 script whose parameters and optimizer state are DTensor shards over two ranks (trainguard.torch). Each
program is stopped and started again at chosen steps, mid-epoch and at an epoch's last step, and every step's
loss must equal bit for bit the loss of an uninterrupted run with the same arguments.

The same programs recover from real faults on the emulated cluster in tests/e2e/test_user_jobs.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import REPO
from trainguard.node_tools.monitor import read_steps

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


SAMPLES = "32"  # 32 sequences, 8 a step, one rank: an epoch is 4 steps


def _torchrun(script: Path, run: Path, ckpt: Path, steps: int, *extra: str, incarnation: int = 0,
              ranks: int = 2) -> str:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TG_") or k == "TG_TEST_SESSION"}
    env |= {"TG_RUN_DIR": str(run), "TG_INCARNATION": str(incarnation), "OMP_NUM_THREADS": "1",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), str(script), "--steps", str(steps), "--checkpoint-dir", str(ckpt), *extra],
                          cwd=script.parent, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stderr


def _stop_and_start(program: str, tmp_path: Path, stops: list[int], *extra: str, ranks: int = 2) -> tuple[
        dict[int, Any], list[dict[str, Any]], list[str]]:
    """An uninterrupted run of ``stops[-1]`` steps, and the same run stopped after each of ``stops`` and started
    again on its checkpoints: (step -> loss uninterrupted, the interrupted run's records, its logs)."""
    script = REPO / "examples" / program / "train.py"
    _torchrun(script, tmp_path / "whole", tmp_path / "whole-ckpt", stops[-1], *extra, ranks=ranks)
    whole = {r["step"]: r["loss"] for r in read_steps(tmp_path / "whole", 0)}
    assert sorted(whole) == list(range(stops[-1]))
    logs = [_torchrun(script, tmp_path / "split", tmp_path / "split-ckpt", n, *extra, incarnation=i, ranks=ranks)
            for i, n in enumerate(stops)]
    return whole, read_steps(tmp_path / "split", 0), logs


def _check(whole: dict[int, Any], records: list[dict[str, Any]], restored: list[int]) -> None:
    """Each incarnation after the first began at the step after the one it restored, the restored steps are the
    expected ones, and every loss ever recorded equals the uninterrupted run's."""
    firsts = {}
    for r in records:
        firsts.setdefault(r["incarnation"], r)
    assert [firsts[i].get("ckpt_restored_step") for i in sorted(firsts)[1:]] == restored
    assert all(firsts[i]["step"] == firsts[i]["ckpt_restored_step"] + 1 for i in sorted(firsts)[1:])
    differ = {r["step"]: (r["loss"], whole[r["step"]]) for r in records if r["loss"] != whole[r["step"]]}
    assert not differ, f"losses that differ from the uninterrupted run (step: (restored run, uninterrupted)): {differ}"


@pytest.mark.full  # CI: the Lightning fit's recoveries on the cluster (tests/e2e/test_user_jobs.py)
def test_a_lightning_fit_resumes_bit_for_bit_mid_epoch_and_across_epochs(tmp_path):
    """Stops after step 3 (an epoch's last step: not snapshotted, so step 2 is restored, mid-epoch, and step 3 runs
    again) and after step 6 (mid-epoch of the next epoch); the last start runs on across the next epoch's start."""
    whole, records, logs = _stop_and_start("lightning", tmp_path, [4, 7, 10], "--samples", SAMPLES, ranks=1)
    _check(whole, records, [2, 6])
    unsaved = [r["step"] for r in records if r.get("ckpt_unsaved")]
    assert unsaved and all(s % 4 == 3 for s in unsaved), unsaved  # the last step of each 4-step epoch
    assert "resuming at step 3" in logs[1] and "resuming at step 7" in logs[2]


@pytest.mark.full  # CI: the HF Trainer's recoveries on the cluster (tests/e2e/test_user_jobs.py)
def test_an_hf_trainer_resumes_bit_for_bit_mid_epoch_and_at_an_epoch_boundary(tmp_path):
    """Stops after step 3 (an epoch's end: the Trainer starts the next epoch and reloads the generators itself)
    and step 5 (mid-epoch: the Trainer skips the batches already trained on); the learning rate's warm-up spans
    the restores, so a scheduler that came back wrong shows in the losses."""
    whole, records, logs = _stop_and_start("hf", tmp_path, [4, 6, 9], "--samples", SAMPLES, ranks=1)
    _check(whole, records, [3, 5])
    assert "resuming at step 4" in logs[1] and "resuming at step 6" in logs[2]
    folder = tmp_path / "split" / "hf-resume" / "checkpoint-6"
    assert (folder / "trainer_state.json").is_file() and (folder / "rng_state.pth").is_file()
    assert not (folder / "optimizer.pt").exists()  # the optimizer came back through the guard, not the file


@pytest.mark.full  # CI: the FSDP2 script's recoveries on the cluster (tests/e2e/test_user_jobs.py)
def test_an_fsdp2_script_resumes_its_sharded_state_bit_for_bit_beside_its_own_checkpoint_module(tmp_path):
    """FSDP2 shards the parameters and the optimizer state (DTensors): each rank snapshots and restores its
    local shards. The script imports its own module named ``checkpoint`` (its export, which runs at the end)."""
    whole, records, _logs = _stop_and_start("fsdp2", tmp_path, [4, 9], "--export", str(tmp_path / "export"))
    _check(whole, records, [3])
    assert any((tmp_path / "export").iterdir())  # the script's own checkpoint module wrote its export
    steps = sorted((tmp_path / "split-ckpt" / "local").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    shard = steps[-1] / "rank_1" / "model.safetensors"
    from safetensors import safe_open

    with safe_open(str(shard), "pt") as f:
        head = f.get_slice("head.weight").get_shape()
    assert head[0] == 128 and head[1] == 64, head  # rank 1 holds half of the 256 x 64 output layer


def test_the_hf_trainer_state_snapshot_copies_the_end_of_its_log_only():
    """The Trainer's log grows by an entry each logging step: a snapshot each step that deep-copied all of it would
    cost more every step (63 ms a step after 7,200 logged steps). Only the kept end is copied; the log stays."""

    from transformers import TrainerState

    from trainguard.transformers import LOG_KEPT, _TrainerSide

    class Uncopyable:
        def __deepcopy__(self, memo: Any) -> Any:
            raise AssertionError("an entry of the log's old part was copied")

    state = TrainerState(global_step=7200)
    state.log_history = [{"step": 0, "note": Uncopyable()}] + [{"step": i, "loss": 1.0} for i in range(1, 7200)]
    log = state.log_history
    trainer = type("Trainer", (), {"lr_scheduler": None, "state": state})()
    doc = _TrainerSide(trainer).state_dict()
    assert [e["step"] for e in doc["trainer_state"]["log_history"]] == list(range(7200 - LOG_KEPT, 7200))
    assert doc["trainer_state"]["global_step"] == 7200 and state.log_history is log and len(log) == 7200
    doc["trainer_state"]["log_history"][-1]["loss"] = 2.0
    assert log[-1]["loss"] == 1.0  # a copy: the snapshot does not change with the Trainer


def test_the_hf_guard_takes_the_gradient_norm_the_trainer_measured_instead_of_measuring_it_again(tmp_path,
                                                                                                  monkeypatch):
    """The Trainer measures the gradients' norm every step (its clipping); the guard's finite check and the step's
    record take that figure, so the gradients are read once a step, not twice."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    import trainguard.torch as guard_module
    from examples.hf.train import BigramTokens
    from trainguard.transformers import TrainguardCallback

    def measured_again(*_args: Any) -> float:
        raise AssertionError("the guard measured the gradients itself")

    monkeypatch.setattr(guard_module, "gradient_norm", measured_again)
    for key in [k for k in os.environ if k.startswith("TG_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("TG_RUN_DIR", str(tmp_path / "run"))
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=4,
                             logging_steps=1, save_strategy="no", report_to=[], use_cpu=True,
                             dataloader_num_workers=0, disable_tqdm=True)
    guard = TrainguardCallback(checkpoint=False)
    trainer = Trainer(model=model, args=args, train_dataset=BigramTokens(16, 16, 64, 0), callbacks=[guard])
    trainer.train(resume_from_checkpoint=guard.restore(trainer))
    logged = [e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e]
    recorded = [r["grad_norm"] for r in read_steps(tmp_path / "run", 0)]
    assert len(recorded) == 3 and recorded == pytest.approx(logged, rel=1e-6), (recorded, logged)
