"""The public face of the training loop (trainguard.torch.Guard) on plain PyTorch: restore returns where to
resume and the run goes on bit for bit, a non-finite step is neither applied nor kept, states are checked, and
the names trainguard installs cannot collide with a training script's own modules."""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from examples.plain import train as plain
from tests import REPO
from trainguard.node_tools.monitor import read_heartbeat, read_steps
from trainguard.torch import CheckpointConfig, Guard, GuardError, gradient_norm

PLAIN = REPO / "examples" / "plain" / "train.py"


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    d = tmp_path / "run"
    monkeypatch.setenv("TG_RUN_DIR", str(d))
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "TG_CHECKPOINT", "TG_FAULT_FILE"):
        monkeypatch.delenv(name, raising=False)
    return d


def _losses(run_dir: Path) -> dict[int, tuple[int, float | str]]:
    """step -> (incarnation of the record, loss), the newest record of each step."""
    return {r["step"]: (r["incarnation"], r["loss"]) for r in read_steps(run_dir, 0)}


def _config(root: Path) -> CheckpointConfig:
    return CheckpointConfig(root=root, saver="thread", fsync=False)


def test_a_plain_script_stopped_and_started_again_resumes_after_its_last_step_bit_for_bit(run_dir, tmp_path,
                                                                                          monkeypatch):
    assert plain.main(["--steps", "12", "--checkpoint-dir", str(tmp_path / "whole")]) == 0
    whole = {s: loss for s, (_, loss) in _losses(run_dir).items()}
    assert sorted(whole) == list(range(12))
    shutil.rmtree(run_dir)
    ckpt = str(tmp_path / "split")
    assert plain.main(["--steps", "7", "--checkpoint-dir", ckpt]) == 0
    monkeypatch.setenv("TG_INCARNATION", "1")
    assert plain.main(["--steps", "12", "--checkpoint-dir", ckpt]) == 0
    records = read_steps(run_dir, 0)
    second = [r for r in records if r["incarnation"] == 1]
    assert [r["step"] for r in second] == list(range(7, 12))  # nothing repeated, nothing skipped
    assert second[0]["ckpt_restored_step"] == 6 and "ckpt_restored_step" not in second[1]
    # the scheduler's state came back too: StepLR halves at step 20 of its own count, so a lost count shows in lr
    assert {s: loss for s, (_, loss) in _losses(run_dir).items()} == whole
    assert read_heartbeat(run_dir, 0)["status"] == "finished"


def test_a_launch_that_caps_the_restored_step_gets_no_newer_one(run_dir, tmp_path, monkeypatch):
    """After a non-finite loss or silent corruption the control plane restarts the job with TG_RESTORE_MAX_STEP:
    the guard restores that step, not the newest."""
    ckpt = str(tmp_path / "c")
    assert plain.main(["--steps", "7", "--checkpoint-dir", ckpt]) == 0
    monkeypatch.setenv("TG_INCARNATION", "1")
    monkeypatch.setenv("TG_RESTORE_MAX_STEP", "5")
    assert plain.main(["--steps", "8", "--checkpoint-dir", ckpt]) == 0
    second = [r for r in read_steps(run_dir, 0) if r["incarnation"] == 1]
    assert second[0]["step"] == 6 and second[0]["ckpt_restored_step"] == 5


def test_the_scheduler_and_other_states_are_restored_not_rebuilt(run_dir, tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.1)
    with Guard(model, opt, state={"scheduler": sched}, checkpoint=_config(tmp_path / "c"), log=lambda _: None) as g:
        assert g.restore() == 0
        for step in range(5):
            with g.step(step) as s:
                model(torch.ones(1, 4)).sum().backward()
                assert s.ok()
                opt.step()
                sched.step()
    assert sched.last_epoch == 5
    model2 = torch.nn.Linear(4, 1)
    opt2 = torch.optim.SGD(model2.parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.StepLR(opt2, step_size=2, gamma=0.1)
    with Guard(model2, opt2, state={"scheduler": sched2}, checkpoint=_config(tmp_path / "c"),
               log=lambda _: None) as g2:
        assert g2.restore() == 5
    assert sched2.last_epoch == 5 and opt2.param_groups[0]["lr"] == pytest.approx(opt.param_groups[0]["lr"])
    assert torch.equal(model2.weight, model.weight)


def test_a_non_finite_step_is_not_applied_not_snapshotted_and_recorded(run_dir, tmp_path):
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    lines: list[str] = []
    with Guard(model, opt, checkpoint=_config(tmp_path / "c"), nonfinite_hold_s=0, log=lines.append) as g:
        g.restore()
        with g.step(0) as s:
            model(torch.ones(1, 4)).sum().backward()
            assert s.ok(torch.tensor(1.0))
            opt.step()
        assert g.last_snapshot.taken
        before = model.weight.detach().clone()
        with g.step(1) as s:
            out = model(torch.ones(1, 4)).sum()
            out.backward()
            assert not s.ok(out * float("nan"))  # what the loop would apply is refused
        assert torch.equal(model.weight, before)
        assert g.last_snapshot.refused and not g.last_snapshot.taken
        with g.step(2) as s:  # finite loss, but a gradient that is not: refused as well
            model(torch.ones(1, 4)).sum().backward()
            model.weight.grad[0, 0] = float("inf")
            assert not s.ok(torch.tensor(0.5))
    recs = read_steps(run_dir, 0)
    assert [r["loss"] for r in recs] == [1.0, "nan", 0.5] and recs[2]["grad_norm"] == "inf"
    assert [r["ckpt_refused"] for r in recs] == [False, True, True]
    assert any("step 1: loss nan" in line and "holding up to 0s" in line for line in lines)


def test_a_state_that_is_not_json_or_not_stateful_is_refused_in_one_line(run_dir):
    model = torch.nn.Linear(2, 1)

    class Opaque:
        def state_dict(self):
            return {"buffer": torch.zeros(2)}

        def load_state_dict(self, state):
            pass

    with pytest.raises(GuardError, match=r"state 'sampler' \(Opaque\): its state_dict\(\) is not JSON"):
        Guard(model, None, state={"sampler": Opaque()}, checkpoint=False)
    with pytest.raises(GuardError, match=r"state 'loader' \(list\) has no state_dict\(\)/load_state_dict\(\)"):
        Guard(model, None, state={"loader": []}, checkpoint=False)
    with pytest.raises(GuardError, match="nonfinite_hold_s=-1 must be >= 0"):
        Guard(model, None, nonfinite_hold_s=-1, checkpoint=False)


def test_steps_must_not_nest(run_dir):
    g = Guard(torch.nn.Linear(2, 1), None, checkpoint=False)
    with pytest.raises(GuardError, match="step 1 began inside step 0"), g.step(0), g.step(1):
        pass
    g.close()


def _neutral_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TG_", "WORLD_SIZE", "RANK", "LOCAL_"))}
    env.pop("PYTHONPATH", None)  # trainguard comes from the installed package, as for a user's job
    env["TG_RUN_DIR"] = str(tmp_path / "run")
    return env


def test_nothing_trainguard_installs_takes_a_common_top_level_name(tmp_path):
    code = ("import importlib.util, json; "
            "print(json.dumps({n: importlib.util.find_spec(n) is not None for n in "
            "['checkpoint', 'operators', 'node_tools', 'emulation', 'trainguard', 'trainguard.checkpoint']}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_neutral_env(tmp_path),
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == {"checkpoint": False, "operators": False, "node_tools": False,
                                      "emulation": False, "trainguard": True, "trainguard.checkpoint": True}


def test_a_script_with_its_own_checkpoint_and_operators_modules_trains_and_restores(tmp_path):
    job = tmp_path / "job"
    job.mkdir()
    (job / "checkpoint.py").write_text("OWNER = 'the user'\n\ndef save(path):\n    return path\n")
    (job / "operators.py").write_text("OWNER = 'the user'\n")
    script = PLAIN.read_text()
    # the user's script uses its own modules of those names, beside trainguard's
    script = script.replace("import torch\n", "import torch\n\nimport checkpoint\nimport operators\n\n"
                            "assert checkpoint.OWNER == operators.OWNER == 'the user', checkpoint.__file__\n", 1)
    (job / "train.py").write_text(script)
    env = _neutral_env(tmp_path)
    first = subprocess.run([sys.executable, "train.py", "--steps", "4", "--checkpoint-dir", str(tmp_path / "c")],
                           cwd=job, env=env, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-2000:]
    again = subprocess.run([sys.executable, "train.py", "--steps", "6", "--checkpoint-dir", str(tmp_path / "c")],
                           cwd=job, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "restored step 3" in again.stderr and "resuming at step 4" in again.stderr
    assert [line.split()[1] for line in again.stdout.splitlines() if line.startswith("step ")] == ["4", "5"]


def test_the_guards_lines_go_to_the_trainguard_logger(run_dir, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="trainguard")
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, opt, checkpoint=_config(tmp_path / "c")) as g:  # no log=: the logger
        for step in range(g.restore(), 3):
            with g.step(step) as s:
                model(torch.ones(1, 4)).sum().backward()
                assert s.ok()
                opt.step()
    with Guard(torch.nn.Linear(4, 1), None, checkpoint=_config(tmp_path / "c")) as g2:
        assert g2.restore() == 3
    said = [r.getMessage() for r in caplog.records if r.name == "trainguard"]
    assert any(m.startswith("rank 0: restored step 2 ") and m.endswith("resuming at step 3") for m in said), said


@pytest.mark.parametrize("configured", [False, True])
def test_a_job_that_configured_logging_gets_the_lines_in_its_own_format(tmp_path, configured):
    code = ("import logging\n"
            + ("logging.basicConfig(format='JOB %(levelname)s %(name)s: %(message)s', level=logging.WARNING)\n"
               if configured else "")
            + "from trainguard.torch import logger\nlogger().info('restored step 7')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=_neutral_env(tmp_path),
                         capture_output=True, text=True, timeout=60, check=True)
    # the job's handler and format (its root level is the job's, the logger's own INFO lets the line through);
    # with nothing configured, standard error with trainguard's prefix
    want = "JOB INFO trainguard: restored step 7" if configured else "trainguard: restored step 7"
    assert out.stderr.strip() == want


class _NanFault:
    """The emulated cluster's ``nan`` fault, active on this rank at every step."""

    def corrupt_loss(self, loss):
        return loss * float("nan")

    def before_step(self, step):
        pass

    def before_collective(self, group, op):
        pass

    def clock_offset(self):
        return 0.0


def test_a_loop_that_decides_alone_is_never_made_to_disagree_by_a_fault_on_one_rank(run_dir):
    """With sync=False the loop promises a loss that is the same on every rank already (the reference job's is a
    job-wide mean): a NaN fault applied to one rank's copy in ok() would make that rank alone skip and hold while
    the others went on into their next collective (a deadlock seen in the fault-injection tier). The fault then
    belongs in the loop's own loss; with the guard's all-reduce (sync=True, the default) it shows in ok()."""
    from trainguard.node_tools.monitor import JobMonitor

    model = torch.nn.Linear(2, 1)
    monitor = JobMonitor(run_dir=run_dir, rank=0, faults=_NanFault())
    monitor.start()
    with Guard(model, None, checkpoint=False, monitor=monitor, nonfinite_hold_s=0, log=lambda _: None) as g:
        with g.step(0) as s:
            model(torch.ones(1, 2)).sum().backward()
            assert s.ok(torch.tensor(1.0), sync=False) and s.loss == 1.0
        with g.step(1) as s:
            model(torch.ones(1, 2)).sum().backward()
            assert not s.ok(torch.tensor(1.0))
    assert [r["loss"] for r in read_steps(run_dir, 0)] == [1.0, "nan"]


def test_small_tensors_in_a_json_state_go_back_bit_for_bit_and_big_ones_are_refused():
    """A data loader's state may hold its generator's state (a byte tensor): the Lightning adapter writes it as
    JSON and reads it back exactly; a tensor too big for a JSON state is a one-line error."""
    from trainguard.torch import json_tensors, tensors_from_json

    g = torch.Generator().manual_seed(3)
    state = {"generator": g.get_state(), "pos": [1, 2], "w": torch.tensor([[1.5, -0.0], [float("inf"), 2]]),
             "empty": torch.zeros(0, 4, dtype=torch.int64), "bf": torch.tensor([1.25], dtype=torch.bfloat16)}
    back = tensors_from_json(json.loads(json.dumps(json_tensors(state))))
    assert back["pos"] == [1, 2]
    for key in ("generator", "w", "empty", "bf"):
        assert back[key].dtype == state[key].dtype and back[key].shape == state[key].shape
        assert torch.equal(back[key].view(torch.uint8) if back[key].numel() else back[key],
                           state[key].view(torch.uint8) if state[key].numel() else state[key])
    g2 = torch.Generator()
    g2.set_state(back["generator"])
    assert torch.equal(torch.rand(4, generator=g2), torch.rand(4, generator=g))
    with pytest.raises(GuardError, match="in the model or the optimizer"):
        json_tensors({"big": torch.zeros(300_000)})


def _train(guard: Guard, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        with guard.step(step, tokens=4) as s:
            x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
            loss = (model(x) - 1).pow(2).mean()
            loss.backward()
            if s.ok(loss):
                opt.step()
            opt.zero_grad()


def test_a_loop_that_never_calls_restore_still_takes_checkpoints_and_is_told_so(run_dir, tmp_path):
    """restore() also started the checkpoint's background work: a loop that forgot it took no checkpoint, without
    a word."""
    lines: list[str] = []
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, opt, checkpoint=_config(tmp_path / "c"), log=lines.append) as g:
        _train(g, model, opt, range(3))
    assert any("guard.restore() was not called: checkpoints start now" in line for line in lines)
    assert [r["ckpt_saved"] for r in read_steps(run_dir, 0)] == [True, True, True]
    again = Guard(torch.nn.Linear(4, 1), None, checkpoint=_config(tmp_path / "c"), log=lambda _: None)
    assert again.restore() == 3  # they were committed: a later run resumes after them
    again.close()


def test_a_program_that_loads_its_own_checkpoint_after_restore_is_stopped_at_its_first_step(run_dir, tmp_path):
    """A program's own resume (init_from='resume') after guard.restore() silently replaced trainguard's newer
    state with its epoch snapshot: 2,000 steps trained again."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, opt, checkpoint=_config(tmp_path / "c"), log=lambda _: None) as g:
        g.restore()
        _train(g, model, opt, range(2))
        own = {k: v.clone() for k, v in model.state_dict().items()}  # the program's own (older) snapshot
        _train(g, model, opt, range(2, 4))
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = Guard(model, opt, checkpoint=_config(tmp_path / "c"), log=lambda _: None)
    assert g.restore() == 4
    model.load_state_dict(own)  # the program's own resume, after trainguard's
    with pytest.raises(GuardError, match=r"parameters changed between guard.restore\(\) \(step 3\) and step 4: "
                                         r"the program loaded a checkpoint of its own"):
        _train(g, model, opt, range(4, 5))
    g.close("failed")


def test_a_non_finite_step_holds_the_rank_only_when_trainguard_launched_the_job(monkeypatch, tmp_path):
    monkeypatch.delenv("TG_RUN_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    by_hand = Guard(torch.nn.Linear(4, 1), checkpoint=False)
    assert by_hand.nonfinite_hold_s == 0.0  # nobody to wait for: a NaN does not sleep five minutes
    by_hand.close()
    monkeypatch.setenv("TG_RUN_DIR", str(tmp_path / "run"))
    launched = Guard(torch.nn.Linear(4, 1), checkpoint=False)
    assert launched.nonfinite_hold_s == 300.0
    launched.close()


def test_with_a_grad_scaler_an_overflow_is_the_scaler_s_to_skip_not_a_held_rank(run_dir, tmp_path):
    """Under mixed precision an fp16 overflow is routine: the scaler skips the step and lowers its scale. The guard
    took it for a fault and would have held the rank for 300 s."""
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    held: list[str] = []
    g = Guard(model, opt, state={"scaler": scaler}, checkpoint=_config(tmp_path / "c"), scaler=scaler,
              nonfinite_hold_s=300.0, log=held.append)
    g.restore()
    for step in range(2):
        with g.step(step, tokens=4) as s:
            loss = model(torch.ones(2, 4)).pow(2).mean()
            scaler.scale(loss).backward()
            if step == 0:
                model.weight.grad[0, 0] = float("inf")  # the scaled gradients overflowed
            if s.ok(loss):
                scaler.step(opt)
            scaler.update()
            opt.zero_grad()
    records = read_steps(run_dir, 0)
    assert records[0]["scaler_skipped"] is True and records[0]["ckpt_saved"] and "scaler_skipped" not in records[1]
    assert scaler.get_scale() == 2.0**15 and not any("holding" in line for line in held)
    with g.step(2) as s:  # a loss that is not finite is still a fault
        s.ok(torch.tensor(float("nan")))
        g.nonfinite_hold_s = 0.0
    assert s.finite is False and read_steps(run_dir, 0)[-1]["ckpt_refused"]
    g.close()


class _Slow(torch.nn.Module):
    """A forward pass that takes ``seconds`` of the host's time (a bigger model's compute)."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.lin, self.seconds = torch.nn.Linear(4, 1), seconds

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import time

        time.sleep(self.seconds)
        return self.lin(x)


def test_each_step_records_its_local_part_up_to_the_models_first_forward(run_dir):
    """A rank's own compute is the step up to its first wait for the others; DDP's all-reduce inside backward is a
    wait ``comm_s`` cannot see (the first micro-batch's too, unless the framework holds it back). The guard marks
    the model's first forward of the step returning and records ``local_s``; a step whose model never ran forward
    records none."""
    import time

    model = _Slow(0.02)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Guard(model, opt, checkpoint=False) as g:
        with g.step(0) as s:
            for _ in range(2):  # two micro-batches
                model(torch.ones(1, 4)).sum().backward()
            time.sleep(0.05)  # what waits for the others would take (DDP's gradient all-reduce of the last one)
            s.ok(torch.tensor(1.0))
            opt.step()
        with g.step(1) as s:
            s.ok(torch.tensor(1.0))
    first, second = read_steps(run_dir, 0)
    assert 0.02 <= first["local_s"] < 0.035 and first["step_time_s"] >= first["local_s"] + 0.065, first
    assert "local_s" not in second


def test_a_forwards_own_counted_collectives_are_not_its_local_part(run_dir):
    """A pipeline's receive or a tensor-parallel all-reduce inside forward, counted with ``guard.collective``: the
    wait is in ``comm_s``, and taken out of ``local_s`` as out of the step's compute."""
    import time

    class Waits(torch.nn.Module):
        def __init__(self, guard_of: list) -> None:
            super().__init__()
            self.lin, self.guard_of = torch.nn.Linear(4, 1), guard_of

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            with self.guard_of[0].collective("pp", "recv"):
                time.sleep(0.04)  # waiting for the previous stage's activations
            return self.lin(x)

    holder: list = []
    model = Waits(holder)
    with Guard(model, torch.optim.SGD(model.parameters(), lr=0.1), checkpoint=False) as g:
        holder.append(g)
        with g.step(0) as s:
            model(torch.ones(1, 4)).sum().backward()
            s.ok(torch.tensor(1.0))
    (rec,) = read_steps(run_dir, 0)
    assert rec["comm_s"] >= 0.04 and rec["local_s"] < 0.03, rec


def test_the_gradient_norm_is_the_norm_of_all_gradients_measured_in_float32_for_half_precision() -> None:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (7, 300, 1)] + [torch.nn.Parameter(torch.zeros(3))]
    for p in params[:3]:
        p.grad = torch.randn_like(p)  # the last one has no gradient
    whole = torch.cat([p.grad.double() for p in params[:3]])
    assert gradient_norm(params) == pytest.approx(float(whole.norm()), rel=1e-6)
    assert gradient_norm([params[3]]) == 0.0
    # fp16 gradients whose norm is above fp16's largest value: a finite norm, not an overflow of the measurement
    big = [torch.nn.Parameter(torch.zeros(4, dtype=torch.float16)) for _ in range(2)]
    for p in big:
        p.grad = torch.full((4,), 60000.0, dtype=torch.float16)
    assert gradient_norm(big) == pytest.approx(60000.0 * 8 ** 0.5, rel=1e-3)
    params[1].grad[5] = float("nan")
    assert not math.isfinite(gradient_norm(params))
