"""Checkpoints of the reference job for real: torchrun on 127.0.0.1, 4 ranks (TP=1 PP=2 DP=2), gloo, and
each rank its own emulated machine with a disk of its own (``--checkpoint-ranks-per-machine 1``,
``--checkpoint-dir <dir>/m{machine}``), so evicting a machine is deleting its directory.

Placement (``Topology.backup_rank``): rank 0's replica lives on machine 3, 1's on 2, 2's on 1, 3's on 0.

The tests form one chain over the same checkpoint directories, in file order (a module fixture holds
them): a job is killed mid-run and resumes; then, before each restart, the chain evicts machines or damages
copies, and every restart must resume from the expected step and source with parameters bit-identical
(``param_digest``) to an uninterrupted run with the same seed. At most 4 training processes run at once.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests import REPO
from tests.checkpoint.test_engine import flip_byte, lie_about_size, truncate
from tests.conftest import free_port, wait_until
from trainguard.checkpoint import layout, saverlink
from trainguard.checkpoint.shards import MODEL_FILE, OPTIM_FILE
from trainguard.checkpoint.verify import verify_step
from trainguard.core.topology import Topology
from trainguard.node_tools.monitor import read_heartbeat, read_steps

pytestmark = pytest.mark.slow


TRAIN = "examples/gpt3d/train.py"
# no verification candidates: retention here is exactly the newest three, the newest committed and the newest
# verified step (candidates held for the verifier are test_checkpoint_verify.py's)
SMALL = ["--checkpoint", "--layers", "2", "--d-model", "64", "--heads", "4", "--seq-len", "32",
         "--micro-batches", "2", "--micro-batch-size", "2", "--vocab", "128", "--checkpoint-verify-every", "0"]
TOPO = Topology(1, 2, 2, ranks_per_machine=1)
WORLD = TOPO.world_size
REF_STEPS = 40
HOST = "host"


@dataclass
class Chain:
    """The state the chain's tests share."""

    base: Path
    s3_endpoint: str
    s3_url: str
    reference: dict[int, dict[int, str]]  # rank -> step -> param_digest of the uninterrupted run
    launches: int = 0
    newest: int = -1  # the last step the chain's latest run finished
    verified: tuple[Path, int] | None = None  # a root and the step verified there
    outputs: list[str] = field(default_factory=list)

    def machine(self, index: int) -> Path:
        return self.base / f"m{index}"


def _torchrun(run_dir: Path, *args: str, env_extra: dict[str, str] | None = None, wait: bool = True,
              timeout: float = 240) -> subprocess.Popen[str] | subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD),
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
           TRAIN, "--tp", "1", "--pp", "2", "--dp", "2", *SMALL, *args]
    env = {**os.environ, "TG_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "TG_MACHINE": HOST, **(env_extra or {})}
    env.pop("TG_FAULT_FILE", None)
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    if not wait:
        return proc
    return _finish(proc, cmd, timeout)


def _finish(proc: subprocess.Popen[str], cmd: list[str] | Any, timeout: float) -> subprocess.CompletedProcess[str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"torchrun ran over {timeout}s\n{out}\n{err[-4000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _digests(run_dir: Path) -> dict[int, dict[int, str]]:
    return {r: {s["step"]: s["param_digest"] for s in read_steps(run_dir, r)} for r in range(WORLD)}


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory, s3_endpoint: str) -> Chain:
    import boto3

    base = tmp_path_factory.mktemp("ckpt-chain")
    res = _torchrun(base / "reference", "--no-checkpoint", "--steps", str(REF_STEPS))
    assert res.returncode == 0, res.stderr[-4000:]
    boto3.client("s3", endpoint_url=s3_endpoint).create_bucket(Bucket="ckpt-chain")
    return Chain(base=base, s3_endpoint=s3_endpoint, s3_url="s3://ckpt-chain/job",
                 reference=_digests(base / "reference"))


def restart(chain: Chain, *, more: int = 2, s3: bool = True, env_extra: dict[str, str] | None = None,
            memory: bool = False) -> tuple[Path, dict[int, dict[str, Any]], str]:
    """Start the job again on the chain's disks; check it ran to the end bit-identically to the reference.
    Without ``memory`` the machines' saver processes are ended first (as after a reboot), so the state
    comes from the disks, peers and S3 this chain damages. Returns the run dir, each rank's first record
    (with the restore fields) and stderr."""
    if not memory:
        for m in range(WORLD):
            saverlink.stop(chain.machine(m))
    chain.launches += 1
    run_dir = chain.base / f"run{chain.launches}"
    steps = chain.newest + 1 + more
    assert steps <= REF_STEPS
    args = ["--steps", str(steps), "--checkpoint-ranks-per-machine", "1", "--checkpoint-dir",
            str(chain.base / "m{machine}")]
    if s3:
        args += ["--checkpoint-s3", chain.s3_url, "--checkpoint-s3-every", "1"]
    env = {"TG_S3_ENDPOINT_URL": chain.s3_endpoint, **(env_extra or {})}
    res = _torchrun(run_dir, *args, env_extra=env)
    chain.outputs.append(res.stderr)
    assert res.returncode == 0, f"{res.stdout}\n{res.stderr[-6000:]}"
    first: dict[int, dict[str, Any]] = {}
    for rank, recs in _digests(run_dir).items():
        assert recs, f"rank {rank} ran no step"
        assert max(recs) == steps - 1
        for step, value in recs.items():  # bit-identical to the uninterrupted run
            assert value == chain.reference[rank][step], (rank, step)
        first[rank] = read_steps(run_dir, rank)[0]
    restored = {rec.get("ckpt_restored_step") for rec in first.values()}
    assert len(restored) == 1 and None not in restored, first  # every rank restored the same step
    assert all(rec["step"] == rec["ckpt_restored_step"] + 1 for rec in first.values())
    chain.newest = steps - 1
    return run_dir, first, res.stderr


def sources(first: dict[int, dict[str, Any]]) -> list[str]:
    return [first[r]["ckpt_restore_source"] for r in range(WORLD)]


def newest_local(chain: Chain, rank: int) -> int:
    return max(s for s, _r, _p in layout.list_copies(chain.machine(TOPO.machine_of(rank)), "local", rank=rank))


# ---- the chain ------------------------------------------------------------------------------
def test_killed_job_resumes_from_the_newest_committed_step_losing_at_most_one(chain: Chain):
    run_dir = chain.base / "killed"
    proc = _torchrun(run_dir, "--steps", "200", "--step-delay-s", "0.1", "--checkpoint-ranks-per-machine", "1",
                     "--checkpoint-dir", str(chain.base / "m{machine}"), "--checkpoint-s3", chain.s3_url,
                     "--checkpoint-s3-every", "1", env_extra={"TG_S3_ENDPOINT_URL": chain.s3_endpoint}, wait=False)
    assert isinstance(proc, subprocess.Popen)
    try:
        wait_until(lambda: all(len(read_steps(run_dir, r)) >= 4 for r in range(WORLD)), timeout=180,
                   what="every rank to finish 4 steps")
        # the steps were checkpointed and committed as they went
        wait_until(lambda: any((p / layout.COMMITTED).exists() for _s, _r, p in
                               layout.list_copies(chain.machine(3), "local")), timeout=60, what="a committed step")
        victim = read_heartbeat(run_dir, 2)
        assert victim and victim["pid"]
        os.kill(victim["pid"], signal.SIGKILL)
    finally:
        res = _finish(proc, "killed run", timeout=120)
    assert res.returncode != 0
    finished = min(read_steps(run_dir, r)[-1]["step"] for r in range(WORLD))  # done by every rank
    chain.newest = finished
    _, first, _ = restart(chain)
    restored = first[0]["ckpt_restored_step"]
    assert finished - restored <= 1, (finished, restored)  # lost at most one step
    assert sources(first) == ["local"] * WORLD
    # the control plane verifies a step on machine 3 (its own copy and rank 0's replica) and marks it
    step = chain.newest
    report = verify_step(chain.machine(3), step, s3_url=chain.s3_url, endpoint_url=chain.s3_endpoint)
    assert report.ok, [p.line() for p in report.problems]
    assert sorted((c.tier, c.rank) for c in report.copies) == [("local", 3), ("replica", 0), ("s3", 3)]
    chain.verified = (chain.machine(3), step)


def test_an_evicted_machine_gets_its_state_from_the_replica(chain: Chain):
    shutil.rmtree(chain.machine(1))
    _, first, _ = restart(chain)
    assert sources(first) == ["local", "replica", "local", "local"]
    assert first[1]["ckpt_restored_step"] == chain.newest - 2  # nothing lost: the newest step everyone had
    # the new machine holds rank 1's state again, and a replica of rank 2 (machine 1 backs rank 2 up)
    assert newest_local(chain, 1) == chain.newest
    assert layout.list_copies(chain.machine(1), "replica", rank=2)


def test_an_evicted_pipeline_group_restores_from_replicas_across_groups(chain: Chain):
    evicted = TOPO.machines_of_group("pp", 0)
    assert evicted == (0, 1)
    for m in evicted:
        shutil.rmtree(chain.machine(m))
    _, first, _ = restart(chain)
    assert sources(first) == ["replica", "replica", "local", "local"]


def test_a_rank_without_local_copy_or_replica_comes_back_from_s3(chain: Chain):
    shutil.rmtree(chain.machine(0))
    for _s, _r, path in layout.list_copies(chain.machine(3), "replica", rank=0):
        layout.remove_copy(path)
    _, first, _ = restart(chain)
    assert sources(first) == ["s3", "local", "local", "local"]
    assert first[0]["ckpt_restored_step"] == chain.newest - 2


def test_a_corrupt_local_copy_is_reported_and_the_replica_used(chain: Chain):
    step = chain.newest
    flip_byte(layout.copy_dir(chain.machine(2), "local", step, 2) / MODEL_FILE)
    _, first, err = restart(chain)
    assert first[2]["ckpt_restored_step"] == step
    assert sources(first) == ["local", "local", "replica", "local"]
    assert f"machine {HOST}/m2 rank 2 step {step} tier local: model.safetensors sha256 mismatch" in err, err[-3000:]


def test_damage_in_every_tier_falls_back_to_an_older_step(chain: Chain):
    step = chain.newest
    truncate(layout.copy_dir(chain.machine(3), "local", step, 3) / OPTIM_FILE)
    lie_about_size(layout.copy_dir(chain.machine(0), "replica", step, 3))
    dead = f"http://127.0.0.1:{free_port()}"  # and the S3 endpoint is down
    _, first, err = restart(chain, env_extra={"TG_S3_ENDPOINT_URL": dead})
    assert first[3]["ckpt_restored_step"] == step - 1
    assert sources(first) == ["local"] * WORLD
    assert f"rank 3 step {step} tier local: optim.safetensors has" in err, err[-3000:]
    assert f"machine {HOST}/m0 rank 3 step {step} tier replica: model.safetensors has" in err, err[-3000:]
    assert "tier s3 unavailable for restore" in err
    assert "Traceback" not in err


def test_retention_kept_the_verified_step_and_the_newest_committed(chain: Chain):
    assert chain.verified is not None
    root, step = chain.verified
    local = [s for s, _r, _p in layout.list_copies(root, "local", rank=3)]
    assert step in local, local  # older than the newest three, kept because it is the newest verified
    assert len([s for s in local if s != step]) == 3, local
    assert step < min(s for s in local if s != step)


def test_the_same_machines_in_another_order_restore_the_newest_step_from_each_other(chain: Chain):
    """The job stopped and submitted again on its machines, which came back in another order: every rank looked
    for its own rank's copies on a machine that had run another rank, found none, and the job fell back to the
    program's own epoch snapshot (about 2,000 steps lost). Each machine's copies left by other ranks are sent to
    their owners over the job's own group now."""
    for m in range(WORLD):  # machine m runs what machine m-1 ran: each disk now serves the next rank
        chain.machine(m).rename(chain.base / f"was{m}")
    for m in range(WORLD):
        (chain.base / f"was{m}").rename(chain.machine((m + 1) % WORLD))
    newest = chain.newest
    _, first, _ = restart(chain)
    assert first[0]["ckpt_restored_step"] == newest  # nothing lost
    assert sources(first) == ["moved"] * WORLD
    assert newest_local(chain, 0) == chain.newest  # each rank's own copies are where it runs now
