"""tg-node's stacks (py-spy dumps of a job's processes) and logs (why ranks ended).

Unit tests of the pure parts (classify, stack_signature, torchrun's report, the
verdict over a run directory made by hand), then two real two-rank jobs of the
reference model on this machine, without the cluster: one with a rank stopped
by SIGSTOP (stacks), one whose rank 1 raises in the job's own code (logs).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests import REPO
from tests.conftest import free_port, wait_until
from trainguard.core import procs
from trainguard.core.errors import TrainguardError
from trainguard.emulation import faults
from trainguard.node_tools import job, monitor
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.logs import classify, logs, parse_torchrun_report, strip_prefix
from trainguard.node_tools.stacks import dump_process, find_py_spy, stack_signature, stacks
from trainguard.operators.jobspec import REFERENCE_ENTRY

TRAIN_PY = REPO / "examples" / "gpt3d" / "train.py"
SITE = "/opt/venv/lib/python3.11/site-packages"


def run_script(path: Path) -> list[str]:
    """Run a script and return its stderr lines (a genuine traceback)."""
    done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 1, done.stderr
    return done.stderr.splitlines()


def torchrun_prefix(lines: list[str], rank: int) -> list[str]:
    return [f"[rank{rank}]: {line}" for line in lines]


# ---------------------------------------------------------------------------------------
# classify
# ---------------------------------------------------------------------------------------
def test_a_genuine_index_error_in_the_jobs_own_file_is_user_code(tmp_path):
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    script.write_text(textwrap.dedent("""\
        def shuffle_window(tokens, window):
            out = list(tokens)
            for start in range(0, len(tokens), window):
                for i in range(window):
                    out[start + i] = tokens[start + window - i]
            return out


        def main():
            return shuffle_window(list(range(16)), 8)


        main()
        """))
    lines = torchrun_prefix(run_script(script), 1)
    assert lines[-1] == "[rank1]: IndexError: list index out of range"
    got = classify(lines, [str(script.parent)])
    assert got["class"] == "user_code" and got["kind"] is None
    assert got["evidence"] == "IndexError: list index out of range"
    exc = got["exception"]
    assert (exc["type"], exc["message"], exc["function"]) == ("IndexError", "list index out of range", "shuffle_window")
    assert exc["location"] == f"{script}:5" == got["user_frame"]
    # the same traceback is not the job's when its file lies outside the job's roots
    assert classify(lines, [str(tmp_path / "elsewhere")])["class"] == "unknown"


def test_an_enospc_oserror_is_infrastructure_even_in_user_code(tmp_path):
    script = tmp_path / "ckpt.py"
    script.write_text(textwrap.dedent("""\
        import errno, os


        def save_checkpoint(path):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)


        save_checkpoint("/disk/ckpt/step100.pt")
        """))
    lines = run_script(script)
    assert lines[-1] == "OSError: [Errno 28] No space left on device: '/disk/ckpt/step100.pt'"
    got = classify(lines, [str(tmp_path)])
    assert (got["class"], got["kind"]) == ("infrastructure", "io")
    assert got["evidence"] == lines[-1]
    assert got["exception"]["location"] == f"{script}:5"


GLOO_RESET = f"""\
[rank0]: Traceback (most recent call last):
[rank0]:   File "/srv/job/train.py", line 317, in main
[rank0]:     Trainer(args, topo, rank, monitor, device).run()
[rank0]:   File "/srv/job/model.py", line 77, in all_reduce_
[rank0]:     dist.all_reduce(tensor, group=self.group)
[rank0]:   File "{SITE}/torch/distributed/c10d_logger.py", line 83, in wrapper
[rank0]:     return func(*args, **kwargs)
[rank0]:            ^^^^^^^^^^^^^^^^^^^^^
[rank0]:   File "{SITE}/torch/distributed/distributed_c10d.py", line 3252, in all_reduce
[rank0]:     work.wait()
[rank0]: RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection reset by peer \
[10.213.9.12]:43121
"""


def test_a_gloo_connection_reset_is_infrastructure():
    got = classify(GLOO_RESET.splitlines(), ["/srv/job"])
    assert (got["class"], got["kind"]) == ("infrastructure", "peer_connection")
    assert got["evidence"].startswith("RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection")
    assert got["exception"]["file"] == f"{SITE}/torch/distributed/distributed_c10d.py"
    assert got["exception"]["function"] == "all_reduce"
    assert got["user_frame"] == "/srv/job/model.py:77"  # where the job called the collective


CUDA_OOM = f"""\
Traceback (most recent call last):
  File "/srv/job/train.py", line 88, in <module>
    loss = model(batch).sum()
           ^^^^^^^^^^^^
  File "{SITE}/torch/nn/modules/module.py", line 1773, in _wrapped_call_impl
    return self._call_impl(*args, **kwargs)
           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{SITE}/torch/nn/functional.py", line 2380, in linear
    return torch._C._nn.linear(input, weight, bias)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.10 GiB \
of which 1.06 GiB is free. Including non-PyTorch memory, this process has 78.03 GiB memory in use. Of the allocated \
memory 75.91 GiB is allocated by PyTorch, and 1.12 GiB is reserved by PyTorch but unallocated. If reserved but \
unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.
"""


def test_cuda_out_of_memory_is_infrastructure():
    got = classify(CUDA_OOM.splitlines(), ["/srv/job"])
    assert (got["class"], got["kind"]) == ("infrastructure", "oom")
    assert got["exception"]["type"] == "torch.OutOfMemoryError"
    assert got["evidence"].startswith("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB")


def test_a_library_error_that_is_not_infrastructure_is_unknown_but_points_at_the_job():
    text = f"""\
Traceback (most recent call last):
  File "/srv/job/train.py", line 40, in step
    out = F.linear(x, w)
  File "{SITE}/torch/nn/functional.py", line 2380, in linear
    return torch._C._nn.linear(input, weight, bias)
RuntimeError: mat1 and mat2 shapes cannot be multiplied (4x64 and 128x128)
"""
    got = classify(text.splitlines(), ["/srv/job"])
    assert got["class"] == "unknown" and got["user_frame"] == "/srv/job/train.py:40"
    assert got["exception"]["message"] == "mat1 and mat2 shapes cannot be multiplied (4x64 and 128x128)"


def test_a_chained_connection_error_under_a_user_wrapper_is_infrastructure():
    text = """\
Traceback (most recent call last):
  File "/srv/job/data.py", line 12, in fetch
    return sock.recv(4096)
ConnectionResetError: [Errno 104] Connection reset by peer

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "/srv/job/train.py", line 9, in <module>
    batch = fetch()
  File "/srv/job/data.py", line 14, in fetch
    raise RuntimeError("data server went away")
RuntimeError: data server went away
"""
    got = classify(text.splitlines(), ["/srv/job"])
    assert (got["class"], got["kind"]) == ("infrastructure", "peer_connection")
    assert got["exception"]["type"] == "RuntimeError"  # the one that ended the rank
    # whereas a programming error in the job's own code stays the job's, whatever came before
    bug = text.replace('raise RuntimeError("data server went away")', "return cache[key]").replace(
        "RuntimeError: data server went away", "KeyError: 'shard-7'")
    assert classify(bug.splitlines(), ["/srv/job"])["class"] == "user_code"


def test_another_threads_line_inside_a_traceback_is_not_taken_for_its_exception():
    # a background thread's log line lands between the frames of the traceback being printed
    lines = GLOO_RESET.splitlines()
    lines.insert(2, "checkpoint: machine m0 rank 0: could not close the replica stream to rank 7: gone")
    got = classify(lines, ["/srv/job"])
    assert (got["class"], got["kind"]) == ("infrastructure", "peer_connection")
    assert got["exception"]["function"] == "all_reduce"
    assert got["user_frame"] == "/srv/job/model.py:77"


def test_no_traceback_nccl_watchdog_warnings_and_exit_codes():
    watchdog = [
        "[rank3]:[E1121 09:12:44.512345 4242 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective "
        "operation timeout: WorkNCCL(SeqNum=1184, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) "
        "ran for 600081 milliseconds before timing out.",
        "terminate called after throwing an instance of 'c10::DistBackendError'",
    ]
    got = classify(watchdog, [])
    assert (got["class"], got["kind"]) == ("infrastructure", "collective_timeout")
    assert got["evidence"].startswith("[E1121 09:12:44.512345 4242 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog")
    healthy = [
        "[rank0]:[W1121 09:00:00.000000 77 ProcessGroupNCCL.cpp:1250] Warning: WARNING: destroy_process_group() "
        "was not called before program exit, which can leak resources (NCCL timeout handling).",
        "step 3 loss 4.1 grad_norm 2.2",
    ]
    assert classify(healthy, [])["class"] == "none"
    assert classify(healthy, [], exitcode=0)["class"] == "none"
    killed = classify([], [], exitcode=-9)
    assert (killed["class"], killed["kind"], killed["evidence"]) == (
        "infrastructure", "signal", "exit code -9: killed by SIGKILL")
    assert classify(["Fatal Python error: Segmentation fault"], [])["class"] == "unknown"
    assert classify([], [], exitcode=3) == {"class": "unknown", "kind": None, "evidence": "exit code 3",
                                            "exception": None, "user_frame": None}
    assert strip_prefix("[rank12]: x") == "x" and strip_prefix("[default0]:  File") == " File"


# ---------------------------------------------------------------------------------------
# stack_signature
# ---------------------------------------------------------------------------------------
def test_stack_signature_ignores_lines_and_directories():
    raw = [  # py-spy's own JSON frames, innermost first
        {"name": "all_reduce", "filename": f"{SITE}/torch/distributed/distributed_c10d.py",
         "short_filename": "torch/distributed/distributed_c10d.py", "line": 3252},
        {"name": "TPComm.all_reduce_", "filename": "/srv/a/model.py", "short_filename": "model.py", "line": 77},
        {"name": "main", "filename": "/srv/a/train.py", "short_filename": "train.py", "line": 317},
    ]
    other_host = [dict(f, filename=f["filename"].replace("/srv/a", "/home/b"), line=f["line"] + 5) for f in raw]
    sig = stack_signature(raw)
    assert sig == "all_reduce (distributed_c10d.py) < TPComm.all_reduce_ (model.py) < main (train.py)"
    assert stack_signature(other_host) == sig
    assert stack_signature([{"name": f["name"], "filename": f["filename"], "line": 1} for f in raw]) == sig
    assert stack_signature(raw, depth=1) == "all_reduce (distributed_c10d.py)"
    assert stack_signature(raw[1:]) != sig
    native = [{"name": "0x7f3a12cd", "filename": "/usr/lib/x86_64-linux-gnu/libc.so.6", "line": 0}]
    assert stack_signature(native) == stack_signature([dict(native[0], name="0x7f00beef")]) == "0x? (libc.so.6)"
    assert stack_signature([]) == ""


# ---------------------------------------------------------------------------------------
# py-spy on one process: a stopped one, and a py-spy that does not answer
# ---------------------------------------------------------------------------------------
@pytest.fixture
def sleeper(tmp_path):
    script = tmp_path / "sleeper.py"
    script.write_text("import time\n\n\ndef wait_here():\n    print('ready', flush=True)\n    time.sleep(120)\n\n\n"
                      "wait_here()\n")
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stdout.readline() == "ready\n"
        # asleep in time.sleep (between its print and the sleep it runs: a stop then would land on line 5)
        wait_until(lambda: procs.proc_state(proc.pid) == "S", timeout=10, what="the sleeper to sleep", interval=0.01)
        yield proc.pid
    finally:
        proc.kill()  # SIGKILL ends a stopped process too
        proc.wait(timeout=10)
        proc.stdout.close()


def test_a_stopped_process_is_dumped_without_pausing_and_stays_stopped(sleeper):
    os.kill(sleeper, signal.SIGSTOP)
    wait_until(lambda: procs.proc_state(sleeper) == "T", timeout=10, what="the sleeper to stop", interval=0.02)
    got = dump_process(find_py_spy(), sleeper, native=True, timeout_s=5.0)
    assert got["error"] is None and got["mode"] == "nonblocking" and got["process_state"] == "T"
    assert "Python frames only" in got["note"]  # py-spy takes native frames only by pausing (ptrace)
    frames = got["threads"][0]["frames"]
    assert [f["name"] for f in frames] == ["wait_here", "<module>"] and frames[0]["line"] == 6
    assert procs.proc_state(sleeper) == "T"


def test_a_py_spy_that_does_not_answer_is_cut_off_at_the_timeout(sleeper, tmp_path):
    stuck = tmp_path / "py-spy"
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    stuck.chmod(0o755)
    t0 = time.monotonic()
    got = dump_process(str(stuck), sleeper, timeout_s=0.5)
    assert time.monotonic() - t0 < 3.0
    assert got["error"] == "py-spy did not answer within 0.5s (killed)" and got["threads"] == []


# ---------------------------------------------------------------------------------------
# The verdict over a run directory written by hand (no processes)
# ---------------------------------------------------------------------------------------
REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
/srv/job/train.py FAILED
------------------------------------------------------------
Failures:
[1]:
  time      : {t}
  host      : m3
  rank      : 5 (local_rank: 1)
  exitcode  : -9 (pid: 4243)
  error_file: <N/A>
  traceback : Signal 9 (SIGKILL) received by PID 4243
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : {t}
  host      : m3
  rank      : 4 (local_rank: 0)
  exitcode  : 1 (pid: 4242)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def fake_job(tmp_path: Path, stderr: dict[int, str], *, supervisor: str = "", returncode: int = 1) -> NodeConfig:
    cfg = NodeConfig(machine="m3", workdir=tmp_path / "disk", install_dir=tmp_path)
    rd = job.run_dir(cfg, "f")
    log_dir = rd / "logs" / "inc2"
    (rd / "ranks").mkdir(parents=True)
    now = time.time()
    monitor.write_json_atomic(rd / "job.json", {
        "job": "f", "token": "no-process-has-this-token", "incarnation": 2, "log_dir": str(log_dir),
        "started_ts": now - 60, "spec": {"entry": "/srv/job/train.py"}})
    monitor.write_json_atomic(rd / "exit.json", {"returncode": returncode, "ended_ts": now})
    (rd / "supervisor.log").write_text(supervisor)
    for local_rank, text in stderr.items():
        path = log_dir / "x_1" / "attempt_0" / str(local_rank) / "stderr.log"
        path.parent.mkdir(parents=True)
        path.write_text(text)
        os.utime(path, (now - 10 + local_rank, now - 10 + local_rank))  # local rank 0 wrote first
        monitor.write_json_atomic(monitor.heartbeat_path(rd, 4 + local_rank), {
            "incarnation": 2, "rank": 4 + local_rank, "local_rank": local_rank, "pid": 4242 + local_rank,
            "status": "running", "step": 7, "alive_ts": now - 12})
    return cfg


def test_a_peer_error_written_first_does_not_hide_the_rank_that_crashed(tmp_path):
    bug = "[rank5]: Traceback (most recent call last):\n" \
          '[rank5]:   File "/srv/job/train.py", line 111, in shuffle_window\n' \
          "[rank5]:     out[..., start + i] = tokens[..., start + window - i]\n" \
          "[rank5]: IndexError: index 64 is out of bounds for dimension 1 with size 64\n"
    cfg = fake_job(tmp_path, {0: GLOO_RESET, 1: bug})  # rank 4's log has the older mtime
    code, doc = logs(cfg, "f", tail=2)
    assert code == 0 and doc["incarnation"] == 2 and doc["returncode"] == 1 and doc["state"] == "exited"
    r4, r5 = doc["ranks"]
    assert (r4["rank"], r4["class"], r4["kind"], r4["secondary"]) == (4, "infrastructure", "peer_connection", True)
    assert (r5["rank"], r5["class"], r5["exception"]["function"]) == (5, "user_code", "shuffle_window")
    assert r5["tail"] == bug.splitlines()[-2:]
    v = doc["verdict"]
    assert (v["class"], v["rank"], v["first_failure"]["rank"]) == ("user_code", 5, 5)
    assert v["exception"]["location"] == "/srv/job/train.py:111"
    # since: older logs are left out
    code, doc = logs(cfg, "f", since=time.time() - 9.5)
    assert doc["skipped_local_ranks"] == [0] and [r["local_rank"] for r in doc["ranks"]] == [1]


def test_a_rank_killed_without_a_word_is_infrastructure_from_torchruns_report(tmp_path):
    report = REPORT.format(t=time.strftime("%Y-%m-%d_%H:%M:%S"))
    cfg = fake_job(tmp_path, {0: "", 1: "step 3\n"}, supervisor="some output\n" + report)
    code, doc = logs(cfg, "f")
    assert code == 0
    r4, r5 = doc["ranks"]
    assert (r5["exitcode"], r5["class"], r5["kind"]) == (-9, "infrastructure", "signal")
    assert r5["failed_ts_source"] == "last heartbeat"
    assert (r4["exitcode"], r4["class"]) == (1, "unknown")  # exit code 1, and its log says nothing
    v = doc["verdict"]
    assert (v["class"], v["kind"], v["rank"]) == ("infrastructure", "signal", 5)
    parsed = parse_torchrun_report(report)
    assert parsed["root_cause"]["rank"] == 4 and [f["rank"] for f in parsed["failures"]] == [5]
    assert parse_torchrun_report(report, not_before=time.time() + 3600) is None  # an older incarnation's


def test_unknown_jobs_are_exit_2(tmp_path):
    cfg = NodeConfig(machine="m3", workdir=tmp_path / "disk", install_dir=REPO)
    for call in (lambda: logs(cfg, "nope"), lambda: stacks(cfg, "nope")):
        with pytest.raises(TrainguardError, match="machine m3 has no job nope") as info:
            call()
        assert info.value.exit_code == 2


# ---------------------------------------------------------------------------------------
# Real jobs
# ---------------------------------------------------------------------------------------
@pytest.fixture
def node(tmp_path):
    return NodeConfig(machine="m0", workdir=tmp_path / "disk", install_dir=REPO, fault_file=tmp_path / "faults.json")


def start_job(cfg: NodeConfig, name: str) -> Path:
    job.start(cfg, job.JobSpec(job=name, nnodes=1, node_rank=0, nproc_per_node=2, master_addr="127.0.0.1",
                               master_port=free_port(), entry=REFERENCE_ENTRY,
                               args=["--tp", "2", "--pp", "1", "--dp", "1"]))
    return job.run_dir(cfg, name)


def frames_in(process: dict, filename: str) -> set[str]:
    return {f["name"] for t in process["threads"] for f in t["frames"] if f["filename"].endswith(filename)}


@pytest.mark.slow
def test_stacks_of_a_job_with_a_stopped_rank(node):
    rd = start_job(node, "s1")
    try:
        # a step record on file, and a heartbeat written after it (it is flushed every 0.5 s)
        wait_until(lambda: all(monitor.read_steps(rd, r) and (monitor.read_heartbeat(rd, r) or {}).get("step", -1) >= 0
                               for r in (0, 1)), timeout=120, what="both ranks to finish a step")
        code, doc = logs(node, "s1")
        assert code == 0 and doc["state"] == "running" and doc["verdict"]["class"] == "none"
        assert [(r["local_rank"], r["class"]) for r in doc["ranks"]] == [(0, "none"), (1, "none")]

        stopped = monitor.read_heartbeat(rd, 1)["pid"]
        os.kill(stopped, signal.SIGSTOP)
        wait_until(lambda: procs.proc_state(stopped) == "T", timeout=10, what="rank 1 to stop", interval=0.02)
        t0 = time.monotonic()
        code, doc = stacks(node, "s1", timeout_s=5.0)
        elapsed = time.monotonic() - t0
        assert elapsed < 5.0 + 2.0, f"stacks took {elapsed:.1f}s with a stopped rank"
        by_rank = {p["rank"]: p for p in doc["processes"] if p["role"] == "rank"}
        assert sorted(by_rank) == [0, 1] and by_rank[0]["local_rank"] == 0
        assert any(p["role"] == "agent" for p in doc["processes"])
        running = by_rank[0]
        assert running["error"] is None and running["process_state"] != "T"
        loop = {"<module>", "main", "Trainer.run"}  # py-spy names methods Class.method
        assert loop <= frames_in(running, "examples/gpt3d/train.py"), running["threads"]
        main = next(t for t in running["threads"] if t["name"] == "MainThread")
        assert "main (train.py)" in stack_signature(main["frames"])
        halted = by_rank[1]
        assert halted["process_state"] == "T"
        assert halted["error"] or loop <= frames_in(halted, "examples/gpt3d/train.py"), halted
        assert procs.proc_state(stopped) == "T"  # py-spy left it stopped
        assert code == (0 if all(p["error"] is None for p in doc["processes"]) else 1)
        assert set(doc["collectives"]) == {"0", "1"} and doc["collectives"]["0"]["tp"]["started"] > 0
        assert doc["steps"]["0"] >= 0 and doc["duration_s"] <= elapsed + 0.001
        json.dumps(doc)
    finally:
        job.stop(node, "s1", grace_s=5)
    with pytest.raises(TrainguardError, match="job s1 is not running on machine m0"):
        stacks(node, "s1")


@pytest.mark.slow
def test_logs_name_the_user_bug_of_a_rank(node):
    rd = start_job(node, "s2")
    try:
        faults.write_control(node.fault_file, [{"id": "u", "kind": "user_error", "rank": 1, "params": {}}])
        wait_until(lambda: (rd / "exit.json").exists(), timeout=120, what="the job to exit")
        # its supervisor writes exit.json, then ends: the job is exited once that process is gone too
        wait_until(lambda: logs(node, "s2")[1]["state"] == "exited", timeout=30, what="the supervisor to end")
        code, doc = logs(node, "s2")
    finally:
        job.stop(node, "s2", grace_s=5)
    assert code == 0 and doc["state"] == "exited" and doc["returncode"] != 0
    bug_line = next(i for i, line in enumerate(TRAIN_PY.read_text().splitlines(), start=1)
                    if "out[..., start + i] = tokens[..., start + window - i]" in line)
    r1 = next(r for r in doc["ranks"] if r["local_rank"] == 1)
    assert r1["rank"] == 1 and r1["class"] == "user_code", r1
    assert r1["exception"]["type"] == "IndexError" and r1["exception"]["function"] == "shuffle_window"
    assert r1["exception"]["location"] == f"{TRAIN_PY}:{bug_line}"
    assert r1["heartbeat_status"] == "failed" and r1["tail"][-1].startswith("[rank1]: IndexError")
    verdict = doc["verdict"]
    assert (verdict["class"], verdict["rank"]) == ("user_code", 1), doc
