"""Checkpoint benchmark: what per-step checkpointing costs the reference job, against PyTorch's own
``torch.distributed.checkpoint.async_save``, and how fast each tier brings the job back.

The reference job (TP=1 PP=2 DP=2, 4 ranks, torchrun on 127.0.0.1, each rank its own emulated machine
with a checkpoint directory of its own) runs, in each trial, four times in a rotating order, in two
settings measured side by side:

* ``off``: no checkpoints;
* ``memcpy``: no checkpoints, but a plain copy of the state a snapshot holds into a spare buffer, timed
  each step (``memcpy_s``): the reference blocking is measured against, in a run of its own so that no
  other run pays for it;
* ``on``: trainguard's checkpoints every step (the saver process persists them);
* ``dcp``: ``torch.distributed.checkpoint.async_save`` every step instead, same state, same disk
  (``examples/gpt3d/dcp_baseline.py``).

Settings:

* ``cpu``: the job as it is. Its 4 ranks keep both cores of this host busy computing, so every CPU cycle
  a checkpoint's background work spends is taken from training.
* ``device``: each step also waits ``DEVICE_S`` seconds as a GPU host's training thread waits for its
  kernels (``--emulate-device-s``): the host CPU idles for part of the step, as on the machines
  ByteRobust measured (0.71% MFU loss), and the background work can run there.

From the step records (steps after a warm-up), per setting, for trainguard (``<setting>.<metric>``) and
DCP (``dcp.<setting>.<metric>``):

* ``step_overhead_ratio``: median step time with checkpoints / without - 1, per trial;
* ``blocking_s``: time each step spent in the checkpointer (trainguard ``ckpt_blocking_s``, DCP
  ``dcp_blocking_s``: waiting for the previous save and ``async_save`` itself);
* ``blocking_vs_memcpy``: median blocking / median ``memcpy_s`` of the ``memcpy`` run;
* ``background_cpu_ms_per_step``: CPU of the checkpoint's background work per step and rank (trainguard:
  the saver process and the rank's own checkpoint threads; DCP: the process's other threads);
* ``train_cpu_ms_per_step``: the training thread's own CPU per step, off / on / dcp;
* ``skipped_ratio``: snapshots skipped because both buffers stayed busy (back-pressure that ran out);
* ``waited_ratio``, ``waited_ms_per_step``: steps that waited for a free buffer (back-pressure: the saver
  persists slower than the job steps) and the mean wait per step (part of ``blocking_s``).

Then restores, each the slowest rank's time, each checked bit for bit: the first step after it must
give the loss of an uninterrupted run at that step (``restore_exact``):

* ``restore_s.memory``: a run is killed (SIGKILL of rank 2) and restarted with the machines' savers
  alive: the state comes from their memory; ``lost_steps`` = last step every rank finished - the step
  restored;
* ``restore_s.local``: the savers ended (as after a reboot), from each machine's disk;
* ``restore_s.peer``: machine 1 deleted too: rank 1 from its replica holder;
* ``restore_s.s3``: machine 0 and rank 0's replica deleted: rank 0 from S3 (a local moto_server);
* ``dcp.restore_s``: ``dcp.load`` of the newest step of a DCP run.

    python bench/checkpoint.py [--quick] [--trials N] [--steps N] [--out FILE]

Writes one JSON document in the project's benchmark format (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import summarize, write_result
from trainguard.checkpoint import saverlink
from trainguard.emulation.standalone import free_port
from trainguard.node_tools.monitor import read_heartbeat, read_steps

REPO = Path(__file__).resolve().parent.parent
WORLD = 4
LAYOUT = ["--tp", "1", "--pp", "2", "--dp", "2"]
WARMUP = 3
DEVICE_S = 0.5  # emulated accelerator time per step in the ``device`` setting
SETTINGS = {"cpu": [], "device": ["--emulate-device-s", str(DEVICE_S)]}
MODES = ("off", "memcpy", "on", "dcp")


class Job:
    """Launches of the reference job sharing one set of emulated machine disks."""

    def __init__(self, base: Path, s3_endpoint: str, s3_url: str) -> None:
        self.base = base
        self.s3_endpoint = s3_endpoint
        self.s3_url = s3_url
        self.launches = 0

    def machine(self, index: int) -> Path:
        return self.base / f"m{index}"

    def start(self, *args: str, mode: str = "on", s3: bool = False) -> tuple[subprocess.Popen[str], Path]:
        self.launches += 1
        run_dir = self.base / f"run{self.launches}"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", str(WORLD),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--max-restarts", "0",
               "examples/gpt3d/train.py", *LAYOUT, *args]
        if mode == "on":
            cmd += ["--checkpoint", "--checkpoint-saver", "process", "--checkpoint-ranks-per-machine", "1",
                    "--checkpoint-dir", str(self.base / "m{machine}")]
            if s3:
                cmd += ["--checkpoint-s3", self.s3_url, "--checkpoint-s3-every", "1"]
        else:
            cmd += ["--no-checkpoint"]
        if mode == "memcpy":
            cmd += ["--measure-memcpy"]
        if mode in ("dcp", "dcp-restore"):
            cmd += ["--dcp-dir", str(self.base / "dcp")] + (["--dcp-restore"] if mode == "dcp-restore" else [])
        env = {**os.environ, "TG_RUN_DIR": str(run_dir), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
               "TG_S3_ENDPOINT_URL": self.s3_endpoint}
        env.pop("TG_FAULT_FILE", None)
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
        return proc, run_dir

    @staticmethod
    def finish(proc: subprocess.Popen[str], timeout: float = 600) -> tuple[int, str]:
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            _, err = proc.communicate()
            raise RuntimeError(f"the job ran over {timeout}s: {err[-2000:]}") from None
        return proc.returncode, err

    def run(self, *args: str, mode: str = "on", s3: bool = False) -> Path:
        proc, run_dir = self.start(*args, mode=mode, s3=s3)
        code, err = self.finish(proc)
        if code != 0:
            raise RuntimeError(f"job exited {code}: {err[-3000:]}")
        return run_dir

    def stop_savers(self) -> None:
        """End the machines' saver processes (as a reboot would): their memory snapshots go."""
        for m in range(WORLD):
            saverlink.stop(self.machine(m))


def records(run_dir: Path) -> list[dict[str, Any]]:
    return [rec for r in range(WORLD) for rec in read_steps(run_dir, r)]


def steady(run_dir: Path) -> list[dict[str, Any]]:
    first = min(rec["step"] for rec in records(run_dir))
    return [rec for rec in records(run_dir) if rec["step"] >= first + WARMUP]


def first_records(run_dir: Path) -> list[dict[str, Any]]:
    return [read_steps(run_dir, r)[0] for r in range(WORLD)]


def restore_s(run_dir: Path, source: str, reference: dict[int, float]) -> tuple[float, bool]:
    """The slowest rank's restore time, checking that some rank restored from ``source``; and whether the
    first step after it gave the uninterrupted run's loss, bit for bit."""
    firsts = first_records(run_dir)
    sources = [f.get("ckpt_restore_source") for f in firsts]
    if source not in sources:
        raise RuntimeError(f"expected a restore from {source}, got {sources}")
    return max(f["ckpt_restore_s"] for f in firsts), exact(firsts, reference)


def exact(firsts: list[dict[str, Any]], reference: dict[int, float]) -> bool:
    return all(f["loss"] == reference[f["step"]] for f in firsts)


def last_step(run_dir: Path) -> int:
    return max(rec["step"] for rec in records(run_dir))


def per_step_ms(run_dir: Path, field: str, minus: str = "") -> float:
    """Median over ranks of a cumulative CPU-time field's growth per step (less ``minus``'s), in ms."""
    rates = []
    for r in range(WORLD):
        recs = [rec for rec in read_steps(run_dir, r) if field in rec][WARMUP:]
        if len(recs) >= 2:
            grow = recs[-1][field] - recs[0][field] - ((recs[-1][minus] - recs[0][minus]) if minus else 0.0)
            rates.append(grow / (recs[-1]["step"] - recs[0]["step"]) * 1000)
    return statistics.median(rates)


def overhead_trial(job: Job, steps: int, order: list[str], setting: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in order:
        run_dir = job.run("--steps", str(steps), *SETTINGS[setting], mode=mode)
        recs = steady(run_dir)
        out[f"step_time_s.{mode}"] = statistics.median(r["step_time_s"] for r in recs)
        out[f"train_cpu_ms.{mode}"] = per_step_ms(run_dir, "cpu_s")
        if mode == "memcpy":
            out["memcpy"] = [r["memcpy_s"] for r in recs]
        elif mode == "on":
            out["blocking"] = [r["ckpt_blocking_s"] for r in recs if r["ckpt_saved"]]
            out["skipped_ratio"] = sum(r["ckpt_skipped"] for r in recs) / len(recs)
            waits = [r.get("ckpt_waited_s", 0.0) for r in recs]
            out["waited_ratio"] = sum(w > 0 for w in waits) / len(recs)
            out["waited_ms"] = sum(waits) / len(recs) * 1000
            out["background_cpu_ms"] = per_step_ms(run_dir, "ckpt_bg_cpu_s")
            out["on_run"] = run_dir
        elif mode == "dcp":
            out["dcp.blocking"] = [r["dcp_blocking_s"] for r in recs]
            out["dcp.background_cpu_ms"] = per_step_ms(run_dir, "proc_cpu_s", minus="cpu_s")
            out["dcp_run"] = run_dir
    memcpy = statistics.median(out["memcpy"])
    out["step_overhead_ratio"] = out["step_time_s.on"] / out["step_time_s.off"] - 1
    out["blocking_vs_memcpy"] = statistics.median(out["blocking"]) / memcpy
    out["dcp.step_overhead_ratio"] = out["step_time_s.dcp"] / out["step_time_s.off"] - 1
    out["dcp.blocking_vs_memcpy"] = statistics.median(out["dcp.blocking"]) / memcpy
    return {f"{setting}.{k}": v for k, v in out.items()}


def restore_trial(job: Job, newest: int, reference: dict[int, float]) -> dict[str, Any]:
    """From the checkpoints of a finished run: from every machine's disk, then from a peer, then S3."""
    out: dict[str, Any] = {}
    job.stop_savers()  # a reboot: nothing in memory
    run_dir = job.run("--steps", str(newest + 3), s3=True)  # this run also uploads to S3
    out["restore_s.local"], out["exact.local"] = restore_s(run_dir, "local", reference)
    job.stop_savers()
    shutil.rmtree(job.machine(1))  # machine 1 evicted: rank 1 from its replica on machine 2
    run_dir = job.run("--steps", str(last_step(run_dir) + 3), s3=True)
    out["restore_s.peer"], out["exact.peer"] = restore_s(run_dir, "replica", reference)
    job.stop_savers()
    shutil.rmtree(job.machine(0))  # machine 0 evicted and rank 0's replica (on machine 3) lost: S3
    shutil.rmtree(job.machine(3) / "replica", ignore_errors=True)
    run_dir = job.run("--steps", str(last_step(run_dir) + 3), s3=True)
    out["restore_s.s3"], out["exact.s3"] = restore_s(run_dir, "s3", reference)
    job.stop_savers()
    return out


def dcp_restore_trial(job: Job, newest: int, reference: dict[int, float]) -> dict[str, Any]:
    run_dir = job.run("--steps", str(newest + 3), mode="dcp-restore")
    firsts = first_records(run_dir)
    if any(f.get("dcp_restored_step") != newest for f in firsts):
        raise RuntimeError(f"DCP restored {[f.get('dcp_restored_step') for f in firsts]}, not step {newest}")
    return {"dcp.restore_s": max(f["dcp_restore_s"] for f in firsts), "exact.dcp": exact(firsts, reference)}


def kill_trial(job: Job, after: int, reference: dict[int, float]) -> dict[str, Any]:
    """A rank's process killed mid-run; the job restarted on the same machines, whose savers live on."""
    proc, run_dir = job.start("--steps", "100000", "--step-delay-s", "0.05")
    deadline = time.monotonic() + 300
    try:
        while not all(len(read_steps(run_dir, r)) >= after for r in range(WORLD)):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job did not reach {after} steps")
            time.sleep(0.05)
        victim = read_heartbeat(run_dir, 2) or {}
        os.kill(int(victim["pid"]), signal.SIGKILL)
    finally:
        code, _ = job.finish(proc)
    if code == 0:
        raise RuntimeError("the killed job exited 0")
    finished = min(read_steps(run_dir, r)[-1]["step"] for r in range(WORLD))
    run_dir = job.run("--steps", str(finished + 3))
    restored = read_steps(run_dir, 0)[0]["ckpt_restored_step"]
    seconds, same = restore_s(run_dir, "memory", reference)
    job.stop_savers()
    return {"lost_steps": finished - restored, "restore_s.memory": seconds, "exact.memory": same}


def start_moto(port: int) -> subprocess.Popen[bytes]:
    server = Path(sys.executable).parent / "moto_server"
    proc = subprocess.Popen([str(server), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}", timeout=1):
                return proc
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("moto_server did not start") from None
            time.sleep(0.1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one short trial of each kind (a few minutes)")
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--steps", type=int, default=40, help="steps per overhead run")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    trials, steps = (1, 12) if args.quick else (args.trials, args.steps)
    for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    port = free_port()
    moto = start_moto(port)
    endpoint = f"http://127.0.0.1:{port}"
    results: list[dict[str, Any]] = []
    try:
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="ckpt-bench")
        with tempfile.TemporaryDirectory(prefix="tg-bench-ckpt-") as tmp:
            # the uninterrupted run every restore is checked against, loss by loss
            ref = Job(Path(tmp) / "ref", endpoint, "").run("--steps", str(steps + 30), mode="off")
            reference = {rec["step"]: rec["loss"] for rec in read_steps(ref, 0)}
            for i in range(trials):
                order = list(MODES[i % len(MODES):] + MODES[:i % len(MODES)])
                job = Job(Path(tmp) / f"t{i}", endpoint, f"s3://ckpt-bench/t{i}")
                r = overhead_trial(job, steps, order, "cpu")
                dev = Job(Path(tmp) / f"d{i}", endpoint, f"s3://ckpt-bench/d{i}")
                r.update(overhead_trial(dev, steps, order[::-1], "device"))
                dev.stop_savers()
                for key in ("device.on_run", "device.dcp_run"):
                    r.pop(key)
                r.update(dcp_restore_trial(job, last_step(r.pop("cpu.dcp_run")), reference))
                r.update(restore_trial(job, last_step(r.pop("cpu.on_run")), reference))
                r.update(kill_trial(Job(Path(tmp) / f"k{i}", endpoint, f"s3://ckpt-bench/k{i}"), WARMUP + 3,
                                    reference))
                results.append(r)
                print(json.dumps({"trial": i, **{k: (round(v, 5) if isinstance(v, float) else v)
                                                 for k, v in r.items() if not isinstance(v, list)}}), flush=True)
    finally:
        moto.terminate()
        moto.wait(timeout=10)
    metrics: dict[str, Any] = {}
    for setting in SETTINGS:
        def values(key: str, setting: str = setting) -> list[Any]:
            return [r[f"{setting}.{key}"] for r in results]

        metrics |= {
            f"{setting}.step_overhead_ratio": summarize(values("step_overhead_ratio"), "ratio", 0.01),
            f"dcp.{setting}.step_overhead_ratio": summarize(values("dcp.step_overhead_ratio"), "ratio"),
            f"{setting}.step_time_s.off": summarize(values("step_time_s.off"), "s"),
            f"{setting}.step_time_s.on": summarize(values("step_time_s.on"), "s"),
            f"dcp.{setting}.step_time_s": summarize(values("step_time_s.dcp"), "s"),
            f"{setting}.step_time_s.memcpy_run": summarize(values("step_time_s.memcpy"), "s"),
            f"{setting}.background_cpu_ms_per_step": summarize(values("background_cpu_ms"), "ms"),
            f"dcp.{setting}.background_cpu_ms_per_step": summarize(values("dcp.background_cpu_ms"), "ms"),
            f"{setting}.train_cpu_ms_per_step.off": summarize(values("train_cpu_ms.off"), "ms"),
            f"{setting}.train_cpu_ms_per_step.on": summarize(values("train_cpu_ms.on"), "ms"),
            f"dcp.{setting}.train_cpu_ms_per_step": summarize(values("train_cpu_ms.dcp"), "ms"),
            f"{setting}.blocking_s": summarize([b for v in values("blocking") for b in v], "s", 0.04),
            f"dcp.{setting}.blocking_s": summarize([b for v in values("dcp.blocking") for b in v], "s"),
            f"{setting}.memcpy_s": summarize([m for v in values("memcpy") for m in v], "s"),
            f"{setting}.blocking_vs_memcpy": summarize(values("blocking_vs_memcpy"), "ratio", 1.2),
            f"dcp.{setting}.blocking_vs_memcpy": summarize(values("dcp.blocking_vs_memcpy"), "ratio"),
            f"{setting}.skipped_ratio": summarize(values("skipped_ratio"), "ratio"),
            f"{setting}.waited_ratio": summarize(values("waited_ratio"), "ratio"),
            f"{setting}.waited_ms_per_step": summarize(values("waited_ms"), "ms"),
        }
    for tier in ("memory", "local", "peer", "s3"):
        metrics[f"restore_s.{tier}"] = summarize([r[f"restore_s.{tier}"] for r in results], "s")
    metrics["dcp.restore_s"] = summarize([r["dcp.restore_s"] for r in results], "s")
    checks = [v for r in results for k, v in r.items() if k.startswith("exact.") and k != "exact.dcp"]
    metrics["restore_exact"] = {"value": sum(checks), "n": len(checks), "unit": "restores",
                                "target": len(checks)}
    dcp_checks = [r["exact.dcp"] for r in results]
    metrics["dcp.restore_exact"] = {"value": sum(dcp_checks), "n": len(dcp_checks), "unit": "restores"}
    metrics["lost_steps"] = summarize([float(r["lost_steps"]) for r in results], "steps", 1)
    text = write_result("checkpoint", quick=bool(args.quick), out=args.out, metrics=metrics, setup={
        "topology": "tp=1,pp=2,dp=2", "ranks": WORLD, "machines_emulated": WORLD, "model": "gpt3d defaults",
        "steps": steps, "warmup_steps": WARMUP, "trials": trials, "checkpoint_every": 1, "keep": 3,
        "saver": "process", "s3": "moto_server on loopback", "backend": "gloo (CPU)", "cores": os.cpu_count(),
        "device_setting_wait_s": DEVICE_S, "torch": __import__("torch").__version__,
        "dcp": "torch.distributed.checkpoint.async_save (default: thread), get_state_dict, every step, 3 kept",
        "note": "the plain copy is timed in runs of its own (mode memcpy); no checkpointing run pays for it"})
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
