"""The checkpoint library in one process: snapshot and restore bit for bit, back-pressure, retention,
verification of damaged copies in every tier, the restore plan, the S3 tier against a real moto_server,
and the great-expectations check of the metrics around a step.

The multi-rank behaviour (replicas, peer restore, eviction, a killed job) is in test_checkpoint_restore.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import zlib
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import REPO
from tests.conftest import free_port, wait_until
from trainguard.checkpoint import layout, saverlink, timing
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.config import CheckpointConfig, expand_root
from trainguard.checkpoint.engine import Checkpointer
from trainguard.checkpoint.errors import CheckpointError, RestoreError
from trainguard.checkpoint.plan import Holding, explain, plan_restore
from trainguard.checkpoint.s3 import S3Tier
from trainguard.checkpoint.shards import MODEL_FILE, OPTIM_FILE, ShardLayout
from trainguard.checkpoint.verify import check_metrics, verify_copy, verify_root, verify_s3, verify_step
from trainguard.core.topology import Topology
from trainguard.node_tools.monitor import JobMonitor

ONE = Topology(1, 1, 1)


# ---- damage a copy (also used by test_checkpoint_restore.py) ------------------------------
def flip_byte(path: Path, offset: int | None = None) -> None:
    """Flip one bit in the middle of a file (a silent corruption of the data)."""
    data = bytearray(path.read_bytes())
    at = len(data) // 2 if offset is None else offset
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def truncate(path: Path, by: int = 64) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:-by])


def lie_about_size(copy: Path, name: str = MODEL_FILE, delta: int = 8) -> None:
    """Rewrite the manifest, correctly sealed, but with a wrong size for ``name``."""
    doc = json.loads((copy / mf.MANIFEST).read_text())
    for entry in doc["files"]:
        if entry["name"] == name:
            entry["size"] += delta
    (copy / mf.MANIFEST).write_bytes(mf.seal(doc))


DAMAGES = {
    "flip": (lambda copy: flip_byte(copy / MODEL_FILE), "model.safetensors sha256 mismatch"),
    "truncate": (lambda copy: truncate(copy / OPTIM_FILE), "optim.safetensors has"),
    "lie": (lambda copy: lie_about_size(copy), "manifest says"),
    "manifest": (lambda copy: flip_byte(copy / mf.MANIFEST, 40), "manifest"),
}


# ---- a tiny job in this process -----------------------------------------------------------
def make_model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, step: int) -> None:
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) + torch.rand(1)  # uses the global RNG
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()


def digest(model: torch.nn.Module, opt: torch.optim.Optimizer) -> str:
    crc = 0
    for p in model.parameters():
        crc = zlib.crc32(p.detach().numpy().tobytes(), crc)
        for key in sorted(opt.state[p]):
            crc = zlib.crc32(opt.state[p][key].numpy().tobytes(), crc)
    return f"{crc:08x}"


def checkpointer(root: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, lines: list[str] | None = None,
                 **cfg: Any) -> Checkpointer:
    cfg.setdefault("saver", "thread")  # the saver process has tests of its own (and the ones parametrized here)
    job = cfg.pop("job", "job")
    return Checkpointer(CheckpointConfig(root=root, machine="m7", **cfg), topology=ONE, rank=0, model=model,
                        optimizer=opt, job=job, log=(lines.append if lines is not None else None))


def run_steps(ck: Checkpointer, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: range,
              digests: dict[int, str] | None = None) -> None:
    """Train ``steps``, each snapshot written before the next step (so none is skipped)."""
    for step in steps:
        train_step(model, opt, step)
        info = ck.after_step(step)
        assert not info.skipped
        if digests is not None:
            digests[step] = digest(model, opt)
        assert ck.drain(30), "the writer did not finish a snapshot within 30 s"


def saved_run(root: Path, steps: int = 4, **cfg: Any) -> dict[int, str]:
    model, opt = make_model()
    ck = checkpointer(root, model, opt, **cfg)
    assert ck.restore() is None
    ck.start()
    digests: dict[int, str] = {}
    run_steps(ck, model, opt, range(steps), digests)
    ck.close()
    return digests


# ---- snapshot and restore ------------------------------------------------------------------
@pytest.mark.parametrize(("saver", "tier"), [("thread", "local"), ("process", "memory")])
def test_restore_is_bit_identical_parameters_optimizer_and_rng(tmp_path: Path, saver: str, tier: str):
    ref_model, ref_opt = make_model()  # the uninterrupted run
    for step in range(5):
        train_step(ref_model, ref_opt, step)
    digests = saved_run(tmp_path, steps=4, saver=saver)
    model, opt = make_model()
    torch.manual_seed(99)  # the restored RNG must replace whatever state the process is in
    ck = checkpointer(tmp_path, model, opt, saver=saver)
    result = ck.restore()
    assert result is not None and result.step == 3 and result.tier == tier
    assert result.data_position == {"next_step": 4}
    assert digest(model, opt) == digests[3]
    # the RNG came back too: the next step (which draws from the global RNG) equals the uninterrupted one
    train_step(model, opt, 4)
    assert digest(model, opt) == digest(ref_model, ref_opt)


@pytest.mark.parametrize("saver", ["thread", "process"])
def test_a_copy_left_to_the_idle_moment_holds_its_own_steps_state(tmp_path: Path, saver: str):
    """copy_at_idle: after_step only reads the state; the copy runs at the next step's host_idle(), after that
    step's forward and backward (which change the gradients and draw from the RNG, not the parameters),
    and before_update() waits for it. What is restored is the state as it was when its step ended."""
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, saver=saver, copy_at_idle=True)
    assert ck.restore() is None
    ck.start()
    digests, rng = {}, {}
    for step in range(4):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step)) + torch.rand(1)
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        ck.host_idle()  # the copy of the last step's snapshot starts now
        ck.before_update()
        assert ck.drain(30)  # persisted (the copy itself is done: before_update waited for it)
        opt.step()
        info = ck.after_step(step)
        assert info.taken and not info.skipped
        assert ck._deferred is not None  # nothing copied yet: the training thread only read references
        digests[step], rng[step] = digest(model, opt), torch.get_rng_state()
        torch.rand(3)  # the next step's RNG draws happen before its copy
    ck.close()
    assert ck.skipped == 0 and ck.errors == []
    model2, opt2 = make_model()
    result = checkpointer(tmp_path, model2, opt2, saver=saver).restore()
    assert result is not None and result.step == 3
    assert digest(model2, opt2) == digests[3]
    assert torch.equal(torch.get_rng_state(), rng[3])


def test_a_copy_left_to_the_idle_moment_that_never_ran_is_dropped_not_taken_from_a_later_state(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """A loop that changes the state without host_idle() or before_update() in between: the snapshot of the
    step before cannot be copied any more (the parameters are the next step's); it is dropped and said so,
    never written under the wrong step number."""
    monkeypatch.setattr(timing, "COPY_LATEST_S", 600.0)  # the copier's own deadline never comes here
    lines: list[str] = []
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, lines, copy_at_idle=True, keep=5)
    assert ck.restore() is None
    ck.start()
    train_step(model, opt, 0)
    assert ck.after_step(0).taken
    train_step(model, opt, 1)  # no host_idle, no before_update: step 0's copy never ran
    assert ck.after_step(1).taken
    after_1 = digest(model, opt)
    ck.close()
    assert ck.skipped == 1
    assert any("step 0: snapshot dropped" in line for line in lines)
    assert [s for s, _r, _p in layout.list_copies(tmp_path, "local", rank=0)] == [1]
    model2, opt2 = make_model()
    result = checkpointer(tmp_path, model2, opt2).restore()
    assert result is not None and result.step == 1 and digest(model2, opt2) == after_1


def test_a_step_that_never_reaches_its_idle_moment_still_gets_the_snapshot_of_the_step_before(tmp_path: Path):
    """The next step hangs before host_idle() (a collective blocked on a dead peer): the copier copies the
    deferred snapshot on its own deadline, so a restart finds the step the job finished, not the one before."""
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, copy_at_idle=True)
    assert ck.restore() is None
    ck.start()
    run_steps(ck, model, opt, range(2))
    train_step(model, opt, 2)
    assert ck.after_step(2).taken
    done = digest(model, opt)
    with ck._copied:  # nobody calls host_idle() nor before_update(): the job hangs in step 3
        assert ck._copied.wait_for(lambda: ck._deferred is None, timeout=30)
    assert ck.drain(30)
    ck.close(flush=False)  # the hung job is stopped
    model2, opt2 = make_model()
    result = checkpointer(tmp_path, model2, opt2).restore()
    assert result is not None and result.step == 2 and digest(model2, opt2) == done


def test_a_failing_rank_hands_its_deferred_snapshot_to_the_saver_on_its_way_out(tmp_path: Path,
                                                                                monkeypatch: pytest.MonkeyPatch):
    """The next step raises before its idle moment (a user's bug in the data pipeline): the state is still the
    finished step's, and the saver process persists it after the rank is gone."""
    monkeypatch.setattr(timing, "COPY_LATEST_S", 600.0)
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, saver="process", copy_at_idle=True, fsync=False)
    assert ck.restore() is None
    ck.start()
    train_step(model, opt, 0)
    assert ck.after_step(0).taken and ck._deferred is not None
    done = digest(model, opt)
    ck.close(flush=False)  # the loop raised: the job is failing
    model2, opt2 = make_model()
    ck2 = checkpointer(tmp_path, model2, opt2, saver="process")
    result = ck2.restore()
    assert result is not None and result.step == 0 and digest(model2, opt2) == done
    ck2.close(flush=False)


def test_a_snapshot_dropped_before_its_copy_leaves_the_saver_its_newest_memory_copy(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """copy_at_idle with the saver process: a deferred snapshot dropped before its copy (the loop changed the state
    without an idle moment) never touched its buffer, which still holds, and is labelled with, the older step it
    held; the next snapshot takes that buffer, not the one with the saver's newest step."""
    monkeypatch.setattr(timing, "COPY_LATEST_S", 600.0)
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, saver="process", copy_at_idle=True, fsync=False, keep=5)
    assert ck.restore() is None
    ck.start()
    run_steps(ck, model, opt, range(2))
    assert sorted(s.step for s in ck._slots) == [0, 1]
    train_step(model, opt, 2)
    assert ck.after_step(2).taken  # left to the idle moment, in the buffer of step 0
    train_step(model, opt, 3)  # no idle moment: step 2's copy never ran
    assert ck.after_step(3).taken and ck.skipped == 1
    ck.host_idle()
    ck.before_update()
    assert sorted(s.step for s in ck._slots) == [1, 3]  # step 1, the newest before, is kept
    ck.close()


def test_a_saver_killed_before_the_idle_moments_copy_costs_that_snapshot_and_never_the_training(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """copy_at_idle with the saver process: the saver is told a buffer is being overwritten by the copier, at the
    idle moment. A saver killed before then costs the deferred snapshot (skipped, said once); the copier frees the
    training thread, which goes on without snapshots."""
    import signal

    monkeypatch.setattr(timing, "COPY_LATEST_S", 600.0)
    lines: list[str] = []
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, lines, saver="process", copy_at_idle=True, fsync=False)
    assert ck.restore() is None
    ck.start()
    run_steps(ck, model, opt, range(2))
    train_step(model, opt, 2)
    assert ck.after_step(2).taken and ck._deferred is not None
    pid = ck.status()["saver_pid"]
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: ck.link.lost.is_set(), timeout=10, what="the link to see the saver gone")
    ck.host_idle()
    waited = ck.before_update()  # the copier told a dead saver: the snapshot is dropped, nobody waits on it
    assert waited < 10 and ck._deferred is None
    train_step(model, opt, 3)
    assert ck.after_step(3).skipped  # no saver: training goes on without snapshots
    ck.close(flush=False)
    assert ck.skipped >= 2 and sum("checkpoint saver is gone" in line for line in lines) == 1, lines


def test_files_are_plain_safetensors_with_the_manifests_tensors(tmp_path: Path):
    from safetensors.torch import load_file

    saved_run(tmp_path, steps=1)
    copy = layout.copy_dir(tmp_path, "local", 0, 0)
    doc = mf.parse((copy / mf.MANIFEST).read_bytes())
    assert doc["step"] == 0 and doc["rank"] == 0 and doc["topology"]["tp"] == 1 and doc["machine"] == "m7"
    for entry in doc["files"]:
        tensors = load_file(copy / entry["name"])
        assert {k: {"dtype": v["dtype"], "shape": v["shape"]} for k, v in entry["tensors"].items()} == {
            k: {"dtype": ShardLayout.signature_of({k: t})[0][1], "shape": list(t.shape)} for k, t in tensors.items()}
        assert entry["size"] == (copy / entry["name"]).stat().st_size
    model_names = set(load_file(copy / MODEL_FILE))
    assert model_names == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert {"rng.torch", "state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step"} <= set(load_file(copy / OPTIM_FILE))
    assert (copy / layout.COMMITTED).exists()  # one rank, no replica: committed once durable
    assert not any(p.suffix == ".pkl" or p.name.endswith(".pt") for p in tmp_path.rglob("*"))


def _held_writer(monkeypatch: pytest.MonkeyPatch) -> threading.Event:
    """The writer thread persists nothing until the returned event is set (a persister that fell behind)."""
    release = threading.Event()
    persist = Checkpointer._persist

    def held_persist(self: Checkpointer, slot: Any) -> None:
        assert release.wait(30)
        persist(self, slot)

    monkeypatch.setattr(Checkpointer, "_persist", held_persist)
    return release


def _when_waiting(monkeypatch: pytest.MonkeyPatch, then: Any) -> threading.Event:
    """Call ``then()`` from another thread once the training thread waits for a free buffer: from inside the
    wait on the checkpointer's condition (its lock released), so a buffer ``then`` frees cannot come first."""
    waiting = threading.Event()
    wait = Checkpointer._await_free_slot

    def watched(self: Checkpointer, step: int) -> float:
        cond, me = self._persisted, threading.get_ident()

        class Watched(type(cond)):  # type: ignore[misc]
            def wait(self, timeout: float | None = None) -> bool:
                if threading.get_ident() == me and not waiting.is_set():
                    waiting.set()
                    threading.Thread(target=then, daemon=True).start()
                return super().wait(timeout)

        self._persisted = Watched(self._lock)
        try:
            return wait(self, step)
        finally:
            self._persisted = cond

    monkeypatch.setattr(Checkpointer, "_await_free_slot", watched)
    return waiting


def _steps_against_a_held_writer(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, steps: int, *,
                                 release_when_waiting: bool = False, **cfg: Any,
                                 ) -> tuple[Checkpointer, list[Any], threading.Event, list[str], threading.Event]:
    """``steps`` steps of the tiny job while its writer persists nothing (until ``release`` is set, or, with
    ``release_when_waiting``, once a step waits for a free buffer). Returns the checkpointer, each step's
    SnapshotInfo, ``release``, the lines it logged and whether a step waited."""
    model, opt = make_model()
    lines: list[str] = []
    ck = checkpointer(tmp_path, model, opt, lines, **cfg)
    ck.restore()
    release = _held_writer(monkeypatch)
    waiting = _when_waiting(monkeypatch, release.set if release_when_waiting else lambda: None)
    ck.start()
    infos = []
    for step in range(steps):
        train_step(model, opt, step)
        infos.append(ck.after_step(step))
    return ck, infos, release, lines, waiting


def test_back_pressure_waits_for_a_slow_persister_and_keeps_every_step(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch):
    """Both buffers busy: the step waits until the writer frees one (no snapshot skipped, so every rank of a
    job keeps the same steps), and says how long it waited."""
    ck, infos, _release, _lines, waiting = _steps_against_a_held_writer(tmp_path, monkeypatch, 3,
                                                                        release_when_waiting=True)
    assert waiting.is_set()  # steps 0 and 1 held both buffers: step 2 waited for one
    assert [i.taken for i in infos] == [True, True, True] and not any(i.skipped for i in infos)
    assert infos[0].waited_s == infos[1].waited_s == 0 and infos[2].waited_s > 0
    assert infos[2].blocking_s >= infos[2].waited_s
    status = ck.status()
    assert (status["skipped"], status["waits"], status["stalled"]) == (0, 1, False)
    assert ck.drain(30)
    ck.close()
    assert sorted(s for s, _r, _p in layout.list_copies(tmp_path, "local")) == [0, 1, 2]


def test_back_pressure_on_a_stuck_persister_costs_one_bounded_wait_then_skips_until_it_frees_a_buffer(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ck, infos, release, lines, _waiting = _steps_against_a_held_writer(tmp_path, monkeypatch, 4,
                                                                       backpressure_wait_s=0.3)
    assert [i.taken for i in infos] == [True, True, False, False]
    assert 0.3 <= infos[2].waited_s < 5 and infos[2].skipped  # one wait, to its bound
    assert infos[3].skipped and infos[3].waited_s == 0 and infos[3].blocking_s < 0.3  # stalled: skipped at once
    assert ck.status()["stalled"] and ck.status()["skipped"] == 2
    assert any("snapshot skipped: no buffer was freed within 0.3s" in line for line in lines)
    release.set()
    assert ck.drain(30)
    assert not ck.status()["stalled"]  # the writer freed its buffers: the next due step is taken
    train_step(ck.model, ck.optimizer, 4)
    assert ck.after_step(4).taken
    ck.close()
    assert sorted(s for s, _r, _p in layout.list_copies(tmp_path, "local")) == [0, 1, 4]  # 2 and 3 never written


def test_back_pressure_without_a_wait_skips_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ck, infos, release, _lines, waiting = _steps_against_a_held_writer(tmp_path, monkeypatch, 3,
                                                                       backpressure_wait_s=0)
    assert [i.taken for i in infos] == [True, True, False]
    assert infos[2].skipped and infos[2].waited_s == 0 and ck.status()["waits"] == 0 and not waiting.is_set()
    release.set()
    assert ck.drain(30)
    ck.close()


@pytest.mark.parametrize("wait", [-1.0, float("nan")])
def test_a_negative_or_unknown_back_pressure_wait_is_refused(tmp_path: Path, wait: float):
    with pytest.raises(CheckpointError, match=r"back-pressure wait .* must be >= 0"):
        CheckpointConfig(root=tmp_path, backpressure_wait_s=wait)


@pytest.mark.parametrize("saver", ["thread", "process"])
def test_a_non_finite_step_is_not_snapshotted_and_the_last_good_one_survives_retention(tmp_path: Path, saver: str):
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, keep=2, saver=saver)
    ck.restore()
    ck.start()
    digests: dict[int, str] = {}
    run_steps(ck, model, opt, range(3), digests)
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))  # a NaN gradient poisoned the update
    infos = [ck.after_step(step, healthy=False, why="gradient norm nan") for step in range(3, 9)]
    assert all(i.refused and not i.taken for i in infos) and ck.status()["refused"] == 6
    ck.close()
    assert sorted(s for s, _r, _p in layout.list_copies(tmp_path, "local")) == [1, 2]
    model, opt = make_model()
    result = checkpointer(tmp_path, model, opt, saver=saver).restore()
    assert result is not None and result.step == 2 and digest(model, opt) == digests[2]


def test_a_restore_capped_below_corrupted_steps_starts_a_new_timeline(tmp_path: Path):
    digests = saved_run(tmp_path, steps=6)  # keep=3: steps 3, 4, 5 on disk
    assert sorted(s for s, _r, _p in layout.list_copies(tmp_path, "local")) == [3, 4, 5]
    model, opt = make_model()
    lines: list[str] = []
    ck = checkpointer(tmp_path, model, opt, lines, restore_max_step=4)  # step 5 holds corrupted parameters
    result = ck.restore()
    assert result is not None and result.step == 4 and digest(model, opt) == digests[4]
    # the left timeline's step 5 is gone: a later restore can never pick it
    assert sorted(s for s, _r, _p in layout.list_copies(tmp_path, "local")) == [3, 4]
    assert any("dropped this rank's copies of the later steps 5" in line for line in lines), lines
    with pytest.raises(CheckpointError, match="restore max step -1"):
        CheckpointConfig(root=tmp_path, restore_max_step=-1)


def test_retention_keeps_the_newest_committed_and_the_newest_verified(tmp_path: Path):
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, keep=2)
    ck.restore()
    ck.start()
    run_steps(ck, model, opt, range(2))
    wait_until(lambda: (layout.copy_dir(tmp_path, "local", 1, 0) / layout.COMMITTED).exists(), timeout=30,
               what="step 1 to be committed")
    report = verify_step(tmp_path, 1)
    assert report.ok and report.marked == [str(layout.copy_dir(tmp_path, "local", 1, 0))]
    run_steps(ck, model, opt, range(2, 7))
    ck.close()
    assert sorted(s for s, _r, _p in layout.list_copies(tmp_path, "local")) == [1, 5, 6]


def test_copies_of_ranks_this_machine_no_longer_serves_are_deleted_and_its_own_kept(tmp_path: Path):
    """Measured in the chaos campaign: a machine swapped back in under other ranks kept every copy of the ranks it
    served before (and replicas for holders gone from it); after 25 recoveries its 256 MiB disk was full and the
    disk-full rung evicted healthy machines one after another. Retention now deletes what no rank of the machine
    answers for: local copies of other ranks, replicas held for a rank not on it, step folders left empty a
    minute; a replica this machine's rank holds, and a copy a verification is reading, stay."""
    import shutil

    saved_run(tmp_path, steps=2)  # rank 0's copies of steps 0 and 1 (this machine: rank 0 of a 1-rank layout)
    own = layout.copy_dir(tmp_path, "local", 1, 0)

    def plant(tier: str, step: int, rank: int, holder: int | None = None) -> Path:
        dst = layout.copy_dir(tmp_path, tier, step, rank)
        shutil.copytree(own, dst)
        if holder is not None:
            (dst / layout.REPLICA_INFO).write_text(json.dumps({"holder": holder}))
        return dst

    gone = [plant("local", 0, 3), plant("local", 1, 2), plant("replica", 1, 6, holder=2)]
    held = plant("replica", 1, 5, holder=0)  # this machine's rank holds it
    pinned = plant("local", 0, 4)
    (pinned / layout.VERIFYING).write_text("{}")
    empty_old, empty_new = tmp_path / "replica" / "step_7", tmp_path / "replica" / "step_8"
    empty_old.mkdir(parents=True)
    empty_new.mkdir()
    os.utime(empty_old, (1.0, 1.0))
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, keep=3)
    ck.restore()
    ck.start()
    run_steps(ck, model, opt, range(2, 4))
    ck.close()
    assert not any(p.exists() for p in gone)
    assert held.exists() and pinned.exists() and own.exists()
    assert not empty_old.exists() and empty_new.exists()
    assert sorted(s for s, _r, _p in layout.list_copies(tmp_path, "local", rank=0)) == [1, 2, 3]


def test_a_checkpoint_root_that_cannot_be_made_is_one_line(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    model, opt = make_model()
    with pytest.raises(CheckpointError, match=r"^machine m7 rank 0: checkpoint root .* is not writable"):
        checkpointer(blocker / "root", model, opt)


def test_root_templates_name_the_machine():
    assert expand_root("/d/m{machine}/r{rank}", machine=2, rank=5, local_rank=1) == Path("/d/m2/r5")
    with pytest.raises(CheckpointError, match="unknown placeholder"):
        expand_root("/d/{host}", machine=0, rank=0, local_rank=0)


# ---- verification of damaged copies --------------------------------------------------------
@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_verification_names_the_damaged_copy(tmp_path: Path, damage: str):
    saved_run(tmp_path, steps=2)
    copy = layout.copy_dir(tmp_path, "local", 1, 0)
    assert verify_copy(copy).ok
    do, expected = DAMAGES[damage]
    do(copy)
    report = verify_root(tmp_path)
    bad = [p for p in report.problems]
    assert len(bad) >= 1 and all(p.step == 1 for p in bad), [p.line() for p in bad]
    p = bad[0]
    assert (p.machine, p.rank, p.step, p.tier, p.path) == ("m7", 0, 1, "local", str(copy))
    assert expected in p.what, p.what
    assert p.line().startswith("machine m7 rank 0 step 1 tier local: ")
    assert verify_copy(layout.copy_dir(tmp_path, "local", 0, 0)).ok  # the older step is untouched


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_restore_skips_a_damaged_copy_for_an_older_step(tmp_path: Path, damage: str):
    digests = saved_run(tmp_path, steps=3)
    DAMAGES[damage][0](layout.copy_dir(tmp_path, "local", 2, 0))
    model, opt = make_model()
    lines: list[str] = []
    result = checkpointer(tmp_path, model, opt, lines).restore()
    assert result is not None and result.step == 1 and digest(model, opt) == digests[1]
    assert any("rank 0 step 2 tier local" in line for line in lines), lines


@pytest.mark.parametrize("saver", ["thread", "process"])
def test_a_non_finite_state_the_loop_called_healthy_is_never_written_nor_committed(tmp_path: Path, saver: str):
    """Defence in depth: the writer (or the saver process) checks every value before the copy is written."""
    model, opt = make_model()
    lines: list[str] = []
    ck = checkpointer(tmp_path, model, opt, lines, keep=2, saver=saver)
    ck.restore()
    ck.start()
    digests: dict[int, str] = {}
    run_steps(ck, model, opt, range(2), digests)
    with torch.no_grad():
        next(model.parameters())[0] = float("inf")
    assert ck.after_step(2).taken  # the loop saw nothing wrong; the copy into memory is made
    assert ck.drain(30)
    ck.close()
    assert sorted(s for s, _r, _p in layout.list_copies(tmp_path, "local")) == [0, 1]
    assert ck.newest_committed == 1
    assert any("step 2: snapshot not kept: tensor" in line and "non-finite" in line for line in lines), lines
    model, opt = make_model()
    result = checkpointer(tmp_path, model, opt, saver=saver).restore()
    assert result is not None and result.step == 1 and digest(model, opt) == digests[1]


def test_non_finite_values_fail_verification_even_with_good_checksums(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch):
    from trainguard.checkpoint.slots import Slot as _Slot

    monkeypatch.setattr(_Slot, "non_finite", lambda self: "")  # a copy from before the writer checked
    model, opt = make_model()
    with torch.no_grad():
        model[0].weight[0, 0] = float("nan")
    ck = checkpointer(tmp_path, model, opt)
    ck.restore()
    ck.start()
    run_steps(ck, model, opt, range(1))
    ck.close()
    check = verify_copy(layout.copy_dir(tmp_path, "local", 0, 0))
    assert not check.ok and any("non-finite" in p.what for p in check.problems), check.problems
    assert verify_copy(layout.copy_dir(tmp_path, "local", 0, 0), deep=False).ok  # checksums alone pass


def test_only_damaged_copies_refuse_to_start_from_scratch(tmp_path: Path):
    saved_run(tmp_path, steps=1)
    flip_byte(layout.copy_dir(tmp_path, "local", 0, 0) / MODEL_FILE)
    model, opt = make_model()
    with pytest.raises(RestoreError, match=r"^checkpoint: 1 copies found but no step can be restored on all 1 "
                                           r"ranks: .*--no-restore"):
        checkpointer(tmp_path, model, opt).restore()
    assert checkpointer(tmp_path, model, opt, restore="off").restore() is None
    with pytest.raises(RestoreError, match="no copy exists"):
        checkpointer(tmp_path / "empty", model, opt, restore="require").restore()


# ---- the plan ------------------------------------------------------------------------------
L = "tp=1,pp=2,dp=2"


def H(step: int, rank: int, tier: str = "local", holder: int | None = None, layout_: str = L,
      segment: str = "a") -> Holding:
    if holder is None:
        holder = rank if tier == "local" else (-1 if tier == "s3" else (rank + 2) % 4)
    return Holding(step, rank, tier, holder, layout_, segment)


@pytest.mark.parametrize(
    ("holdings", "excluded", "step", "tiers"),
    [
        ([H(5, r) for r in range(4)] + [H(4, r) for r in range(4)], [], 5, ["local"] * 4),
        # rank 1 lost its disk: its replica holder serves it
        ([H(5, r) for r in (0, 2, 3)] + [H(5, 1, "replica")], [], 5, ["local", "replica", "local", "local"]),
        # local beats replica beats S3
        ([H(5, r) for r in range(4)] + [H(5, r, "replica") for r in range(4)] + [H(5, r, "s3") for r in range(4)],
         [], 5, ["local"] * 4),
        ([H(5, r) for r in (1, 2, 3)] + [H(5, 0, "s3"), H(5, 0, "replica")], [], 5,
         ["replica", "local", "local", "local"]),
        ([H(5, r) for r in (1, 2, 3)] + [H(5, 0, "s3", segment="")], [], 5, ["s3", "local", "local", "local"]),
        # step 5 lacks rank 3 anywhere: step 4
        ([H(5, r) for r in range(3)] + [H(4, r) for r in range(4)], [], 4, ["local"] * 4),
        # a copy that failed verification is excluded: the replica of the same step, then an older step
        ([H(5, r) for r in range(4)] + [H(5, 2, "replica")], [(5, 2, "local", 2)], 5,
         ["local", "local", "replica", "local"]),
        ([H(5, r) for r in range(4)] + [H(4, r) for r in range(4)], [(5, 2, "local", 2)], 4, ["local"] * 4),
        # copies of step 5 from two segments (a restart redid step 5) are never mixed
        ([H(5, 0, segment="b"), *(H(5, r) for r in (1, 2, 3)), *(H(4, r) for r in range(4))], [], 4, ["local"] * 4),
        # another layout's copies do not count
        ([H(5, r, layout_="tp=2,pp=1,dp=2") for r in range(4)] + [H(3, r) for r in range(4)], [], 3, ["local"] * 4),
    ],
)
def test_restore_plan(holdings: list[Holding], excluded: list[tuple[int, int, str, int]], step: int,
                      tiers: list[str]):
    plan = plan_restore(holdings, world_size=4, layout=L, excluded=excluded)
    assert plan is not None and plan.step == step
    assert [plan.sources[r].tier for r in range(4)] == tiers
    for holder, owner in plan.transfers():
        assert plan.sources[owner].tier == "replica" and plan.sources[owner].holder == holder


def test_restore_plan_explains_why_nothing_fits():
    holdings = [H(5, r) for r in range(3)]
    assert plan_restore(holdings, world_size=4, layout=L) is None
    assert explain(holdings, world_size=4, layout=L) == "newest step 5 has no usable copy for rank(s) [3]"
    other = [H(5, r, layout_="tp=2,pp=2,dp=1") for r in range(4)]
    assert "another layout (tp=2,pp=2,dp=1)" in explain(other, world_size=4, layout=L)


# ---- S3 ------------------------------------------------------------------------------------
def _bucket(endpoint: str, name: str) -> str:
    import boto3

    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=name)
    return f"s3://{name}/job"


def test_s3_tier_upload_verify_damage_and_restore(tmp_path: Path, s3_endpoint: str):
    url = _bucket(s3_endpoint, "ckpt-unit")
    digests = saved_run(tmp_path, steps=4, s3_url=url, s3_endpoint_url=s3_endpoint, s3_every_steps=2)
    tier = S3Tier(url, endpoint_url=s3_endpoint)
    assert sorted(tier.list_copies()) == [(1, 0), (3, 0)]
    assert verify_s3(url, endpoint_url=s3_endpoint).ok
    # flip a byte of step 3's model in S3: verification names it, restore (without local copies) takes step 1
    data = bytearray(tier.get(3, 0, MODEL_FILE) or b"")
    data[len(data) // 2] ^= 1
    tier.put(3, 0, MODEL_FILE, bytes(data))
    report = verify_s3(url, endpoint_url=s3_endpoint)
    assert [(p.machine, p.rank, p.step, p.tier, p.path) for p in report.problems] == [
        ("s3", 0, 3, "s3", "s3://ckpt-unit/job/step_3/rank_0/")]
    assert "sha256 mismatch" in report.problems[0].what
    for _s, _r, path in layout.list_copies(tmp_path, "local"):
        layout.remove_copy(path)
    model, opt = make_model()
    lines: list[str] = []
    result = checkpointer(tmp_path, model, opt, lines, s3_url=url, s3_endpoint_url=s3_endpoint).restore()
    assert result is not None and (result.step, result.tier, result.rounds) == (1, "s3", 2)
    assert digest(model, opt) == digests[1]
    assert any("rank 0 step 3 tier s3: model.safetensors sha256 mismatch" in line for line in lines), lines
    # the restored state is on local disk again
    assert verify_copy(layout.copy_dir(tmp_path, "local", 1, 0)).ok


def test_a_directory_tier_on_shared_storage_uploads_verifies_and_restores_like_s3(tmp_path: Path):
    """The embedded default's remote tier: a directory every machine mounts (file://)."""
    from trainguard.checkpoint.s3 import DirTier, open_tier

    url = f"file://{tmp_path / 'shared'}"
    digests = saved_run(tmp_path / "disk", steps=4, s3_url=url, s3_every_steps=2)
    tier = open_tier(url)
    assert isinstance(tier, DirTier) and sorted(tier.list_copies()) == [(1, 0), (3, 0)]
    assert verify_s3(url).ok
    sha, size = tier.remote_checksums(3, 0, MODEL_FILE)
    assert size == len(tier.get(3, 0, MODEL_FILE)) and len(sha) == 64
    data = bytearray(tier.get(3, 0, MODEL_FILE) or b"")
    data[len(data) // 2] ^= 1
    tier.put(3, 0, MODEL_FILE, bytes(data))
    report = verify_s3(url)
    assert [(p.rank, p.step, p.tier, p.path) for p in report.problems] == [(0, 3, "s3", tier.copy_url(3, 0))]
    for _s, _r, path in layout.list_copies(tmp_path / "disk", "local"):
        layout.remove_copy(path)
    model, opt = make_model()
    result = checkpointer(tmp_path / "disk", model, opt, s3_url=url).restore()
    assert result is not None and (result.step, result.tier, result.rounds) == (1, "s3", 2)
    assert digest(model, opt) == digests[1]
    tier.delete_copy(1, 0)
    assert sorted(tier.list_copies()) == [(3, 0)]
    with pytest.raises(CheckpointError, match="must look like s3://bucket/prefix or file:///shared/dir"):
        CheckpointConfig(root=tmp_path, s3_url="file:relative/dir")


def test_s3_is_asked_only_when_disks_cannot_give_the_newest_step(tmp_path: Path, s3_endpoint: str):
    url = _bucket(s3_endpoint, "ckpt-last-resort")
    digests = saved_run(tmp_path, steps=3, s3_url=url, s3_endpoint_url=s3_endpoint, s3_every_steps=1)
    model, opt = make_model()
    result = checkpointer(tmp_path, model, opt, s3_url=url, s3_endpoint_url=s3_endpoint).restore()
    assert result is not None and (result.step, result.tier) == (2, "local")
    # a damaged newest local copy: S3's copy of the same step beats the older local one
    flip_byte(layout.copy_dir(tmp_path, "local", 2, 0) / MODEL_FILE)
    model, opt = make_model()
    result = checkpointer(tmp_path, model, opt, s3_url=url, s3_endpoint_url=s3_endpoint).restore()
    assert result is not None and (result.step, result.tier, result.rounds) == (2, "s3", 2)
    assert digest(model, opt) == digests[2]


def test_s3_uploads_on_demand_only_when_asked(tmp_path: Path, s3_endpoint: str):
    url = _bucket(s3_endpoint, "ckpt-demand")
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, s3_url=url, s3_endpoint_url=s3_endpoint, s3_every_steps=0)
    ck.restore()
    ck.start()
    run_steps(ck, model, opt, range(2))
    (tmp_path / layout.S3_REQUEST).touch()  # what an operator (or the control plane) does
    run_steps(ck, model, opt, range(2, 4))
    ck.request_s3()
    run_steps(ck, model, opt, range(4, 5))
    ck.close()
    assert sorted(S3Tier(url, endpoint_url=s3_endpoint).list_copies()) == [(2, 0), (4, 0)]
    assert not (tmp_path / layout.S3_REQUEST).exists()


def test_s3_endpoint_down_is_reported_and_never_blocks(tmp_path: Path):
    dead = f"http://127.0.0.1:{free_port()}"
    report = verify_s3("s3://ckpt-down/job", endpoint_url=dead, timeout_s=1)
    assert not report.ok and report.problems[0].tier == "s3" and "failed" in report.problems[0].what
    model, opt = make_model()
    lines: list[str] = []
    ck = checkpointer(tmp_path, model, opt, lines, s3_url="s3://ckpt-down/job", s3_endpoint_url=dead,
                      s3_every_steps=1, s3_timeout_s=1)
    assert ck.restore() is None
    ck.start()
    run_steps(ck, model, opt, range(2))
    ck.close()
    assert len(layout.list_copies(tmp_path, "local")) == 2  # local copies go on
    assert any("tier s3: S3 tier s3://ckpt-down/job at " in line for line in lines), lines
    assert any("tier s3 unavailable for restore" in line for line in lines), lines
    # restore with the endpoint down uses the local copies
    model2, opt2 = make_model()
    result = checkpointer(tmp_path, model2, opt2, s3_url="s3://ckpt-down/job", s3_endpoint_url=dead,
                          s3_timeout_s=1).restore()
    assert result is not None and result.step == 1 and result.tier == "local"


# ---- metrics around a step (great-expectations, in the control plane) ----------------------------------
def _records(run_dir: Path, losses: list[Any], steps: list[int] | None = None) -> list[dict[str, Any]]:
    """A rank's step records as its monitor writes them (and the control plane reads them back)."""
    from trainguard.node_tools.monitor import read_steps

    mon = JobMonitor(run_dir=run_dir, rank=0)
    for step, loss in zip(steps or range(len(losses)), losses, strict=True):
        mon.step_end(step, loss=loss, grad_norm=1.0, step_time_s=0.1, tokens_per_s=1.0)
    mon.close()
    return read_steps(run_dir, 0)


@pytest.mark.parametrize(
    ("losses", "steps", "problem"),
    [
        ([4.0, 3.9, 3.8, 3.7], None, None),
        ([4.0, float("nan"), 3.8, 3.7], None, "expect_column_values_to_not_be_null failed on loss"),
        ([4.0, 3.9, float("inf"), 3.7], None, "expect_column_values_to_be_between failed on loss"),
        ([4.0, 3.9, 3.8, 3.7], [0, 1, 1, 3], "expect_column_values_to_be_increasing failed on step"),
        ([4.0, 3.9, 3.8], None, "no step records for this step"),
    ],
)
def test_metrics_around_a_step(tmp_path: Path, losses: list[float], steps: list[int] | None, problem: str | None):
    records = _records(tmp_path, losses, steps)
    problems = check_metrics({0: records}, step=3, machines={0: "m7"})
    if problem is None:
        assert problems == []
    else:
        assert problems and problem in problems[0].what, [p.line() for p in problems]
        assert (problems[0].machine, problems[0].rank, problems[0].step, problems[0].tier) == ("m7", 0, 3, "metrics")


def test_verify_step_checks_and_marks_the_copies_and_leaves_the_metrics_to_the_control_plane(tmp_path: Path):
    root = tmp_path / "ckpt"
    saved_run(root, steps=2)
    truncate(layout.copy_dir(root, "local", 1, 0) / MODEL_FILE)
    report = verify_step(root, 1)
    assert not report.ok and report.marked == []
    assert not (layout.copy_dir(root, "local", 1, 0) / layout.VERIFIED).exists()
    report = verify_step(root, 0)
    assert report.ok and (layout.copy_dir(root, "local", 0, 0) / layout.VERIFIED).exists()
    marker = json.loads((layout.copy_dir(root, "local", 0, 0) / layout.VERIFIED).read_text())
    assert marker["checks"] == ["sha256", "tensors", "finite"]


def test_verify_command_line(tmp_path: Path):
    saved_run(tmp_path, steps=2)
    truncate(layout.copy_dir(tmp_path, "local", 1, 0) / MODEL_FILE)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "trainguard.checkpoint.verify", "--root", str(tmp_path)],
                         capture_output=True, text=True, env=env, cwd=REPO, timeout=120)
    assert res.returncode == 1, res.stderr
    doc = json.loads(res.stdout)
    assert [(p["rank"], p["step"], p["tier"]) for p in doc["problems"]] == [(0, 1, "local")]
    assert doc["problem_lines"][0].startswith("machine m7 rank 0 step 1 tier local: model.safetensors has")


# ---- the reference job's flags (one process, no torchrun) ------------------------------------------
SMALL = ["--checkpoint", "--tp", "1", "--pp", "1", "--dp", "1", "--layers", "2", "--d-model", "32", "--heads", "2",
         "--seq-len", "16",
         "--micro-batches", "1", "--micro-batch-size", "2", "--vocab", "64"]


def _train(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TG_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    env.pop("TG_CHECKPOINT", None)
    return subprocess.run([sys.executable, "-m", "examples.gpt3d.train", *SMALL, *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=180)


def test_training_script_checkpoints_every_n_steps_and_refuses_in_one_line(tmp_path: Path):
    from trainguard.node_tools.monitor import read_steps

    run = tmp_path / "run"
    res = _train(run, "--steps", "4", "--checkpoint-every", "2")
    assert res.returncode == 0, res.stderr
    recs = read_steps(run, 0)
    assert [r["ckpt_saved"] for r in recs] == [False, True, False, True]
    assert all(r["ckpt_blocking_s"] >= 0 and r["ckpt_skipped"] is False for r in recs)
    root = run / "checkpoints"
    assert sorted(s for s, _r, _p in layout.list_copies(root, "local")) == [1, 3]
    # every copy damaged (and the saver's memory gone with its process, as after a reboot): the job refuses to
    # start from scratch, in one line, with the damage named above it
    assert saverlink.stop(root)
    flip_byte(layout.copy_dir(root, "local", 3, 0) / MODEL_FILE)
    truncate(layout.copy_dir(root, "local", 1, 0) / OPTIM_FILE)
    res = _train(run, "--steps", "6")
    assert res.returncode == 1
    errors = [line for line in res.stderr.splitlines() if line.startswith("gpt3d: error: ")]
    assert len(errors) == 1 and "no step can be restored on all 1 ranks" in errors[0], res.stderr
    assert "rank 0 step 3 tier local: model.safetensors sha256 mismatch" in res.stderr
    assert "rank 0 step 1 tier local: optim.safetensors has" in res.stderr
    assert "Traceback" not in res.stderr
    # the node's log classifier names this end by its kind, which the control plane acts on (a rescue)
    from trainguard.node_tools import logs

    verdict = logs.classify(res.stderr.splitlines(), [str(REPO / "examples")], exitcode=res.returncode)
    assert (verdict["class"], verdict["kind"]) == ("unknown", logs.UNRESTORABLE_KIND)
    assert verdict["evidence"] == errors[0]
    # --no-restore starts over; --restore without any copy refuses
    res = _train(run, "--steps", "1", "--no-restore", "--no-checkpoint")
    assert res.returncode == 0 and "ckpt_saved" not in read_steps(run, 0)[-1]
    res = _train(tmp_path / "empty", "--steps", "1", "--restore")
    assert res.returncode == 1 and res.stderr.strip().startswith("gpt3d: error: checkpoint: --restore was given")


def test_a_rescue_puts_every_copy_of_a_step_held_here_into_the_remote_tier_once(tmp_path: Path):
    """What the control plane runs on a machine it is about to evict when that machine holds the last copy."""
    from trainguard.checkpoint.s3 import open_tier
    from trainguard.core.errors import TrainguardError
    from trainguard.node_tools import ckpt
    from trainguard.node_tools.config import NodeConfig

    cfg = NodeConfig(machine="m7", workdir=tmp_path / "w", install_dir=tmp_path)
    root = tmp_path / "w" / "jobs" / "j" / "checkpoints"
    saved_run(root, steps=3)
    url = f"file://{tmp_path / 'shared'}"
    code, doc = ckpt.rescue(cfg, "j", 2, to_url=url)
    assert code == 0 and [u["rank"] for u in doc["uploaded"]] == [0] and doc["bad"] == []
    tier = open_tier(url)
    assert sorted(tier.list_copies()) == [(2, 0)] and tier.get(2, 0, "manifest.json") == \
        (layout.copy_dir(root, "local", 2, 0) / "manifest.json").read_bytes()
    code, again = ckpt.rescue(cfg, "j", 2, to_url=url)
    assert code == 0 and again["uploaded"] == [] and again["skipped"][0]["why"] == "already in the remote tier"
    flip_byte(layout.copy_dir(root, "local", 1, 0) / MODEL_FILE)
    code, bad = ckpt.rescue(cfg, "j", 1, to_url=url)
    assert code == 1 and bad["uploaded"] == [] and "sha256 mismatch" in bad["bad"][0]["why"]
    assert (1, 0) not in tier.list_copies()  # a damaged copy is never rescued
    with pytest.raises(TrainguardError, match="has no copy of step 9 here"):
        ckpt.rescue(cfg, "j", 9, to_url=url)
