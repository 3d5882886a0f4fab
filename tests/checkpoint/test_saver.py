"""The checkpoint saver process (checkpoint/saver.py): persistence outside the training process, the newest
snapshot kept in memory across a rank's death, replicas only for the job's own ranks, no NaN written."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch

from tests import REPO
from tests.checkpoint.test_engine import checkpointer, digest, make_model, run_steps, train_step
from trainguard.checkpoint import hostboard, layout, saver, saverlink, saverproto
from trainguard.checkpoint.saverlink import SaverLink
from trainguard.checkpoint.saverproto import LineReader, non_finite, send_doc

CHILD = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {repo!r})
    from pathlib import Path
    from tests.checkpoint.test_engine import checkpointer, digest, make_model, train_step
    model, opt = make_model()
    ck = checkpointer(Path({root!r}), model, opt, saver="process", fsync=False)
    ck.restore()
    ck.start()
    for step in range(4):
        train_step(model, opt, step)
        ck.after_step(step)
        assert ck.drain(30)
        print(step, digest(model, opt), flush=True)
    print("ready", ck.status()["saver_pid"], flush=True)
    time.sleep(600)
""")


def stop(pid: int, timeout_s: float = 10.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads has stopped (kill() returns before they do:
    a thread inside a system call stops only when it leaves it)."""
    os.kill(pid, signal.SIGSTOP)
    stopped = {psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = set()
        for thread in psutil.Process(pid).threads():
            with contextlib.suppress(psutil.NoSuchProcess):
                states.add(psutil.Process(thread.id).status())
        if states and states <= stopped:
            return
        time.sleep(0.005)  # polling the kernel's view; the stop itself is what is waited for
    os.kill(pid, signal.SIGCONT)  # never left stopped for the tests after this one
    raise AssertionError(f"saver {pid} did not stop within {timeout_s:g}s")

def test_a_rank_killed_mid_run_restores_from_the_savers_memory_without_its_disk(tmp_path: Path):
    """The rank's process dies (SIGKILL); its saver lives on with the newest snapshot in shared memory.
    The restarted rank restores it bit for bit, with every copy on the machine's disk deleted first."""
    proc = subprocess.Popen([sys.executable, "-c", CHILD.format(repo=str(REPO), root=str(tmp_path))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    digests: dict[int, str] = {}
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            word, _, rest = line.strip().partition(" ")
            if word == "ready":
                saver_pid = int(rest)
                break
            digests[int(word)] = rest
        else:
            pytest.fail(f"the training process ended early: {proc.stderr.read() if proc.stderr else ''}")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert sorted(digests) == [0, 1, 2, 3]
    os.kill(saver_pid, 0)  # still there
    for _step, _rank, path in layout.list_copies(tmp_path, "local"):
        layout.remove_copy(path)
    assert layout.list_copies(tmp_path, "local") == []
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, saver="process")
    result = ck.restore()
    assert result is not None and (result.step, result.tier) == (3, "memory")
    assert digest(model, opt) == digests[3]
    assert ck.status()["saver_pid"] == saver_pid  # the same saver, not a new one
    ck.close()
    assert saverlink.stop(tmp_path)


def test_memory_is_offered_only_to_the_same_job(tmp_path: Path):
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, saver="process", job="a")
    ck.restore()
    ck.start()
    run_steps(ck, model, opt, range(2))
    ck.close()
    other = SaverLink(tmp_path, rank=0, job="b")
    assert other.memory is None
    other.close(flush=False)
    again = SaverLink(tmp_path, rank=0, job="a")
    assert again.memory is None  # job b took the machine's saver over: job a's memory went with it
    again.close(flush=False)
    assert saverlink.stop(tmp_path)


def _static(token: str) -> dict[str, object]:
    return {"token": token, "backup": None, "world_size": 2, "topology": {"tp": 1, "pp": 1, "dp": 2,
            "ranks_per_machine": 1}, "coords": {"tp": 0, "pp": 0, "dp": 1}, "machine": "m1", "incarnation": 0,
            "fsync": False, "s3_url": ""}


def test_a_saver_keeps_replicas_only_for_ranks_it_serves_under_the_jobs_token(tmp_path: Path):
    source = tmp_path / "m0"
    model, opt = make_model()
    ck = checkpointer(source, model, opt, saver="thread")  # a real copy to send
    ck.restore()
    ck.start()
    run_steps(ck, model, opt, range(1))
    ck.close()
    copy = layout.copy_dir(source, "local", 0, 0)
    manifest = (copy / "manifest.json").read_bytes()
    files = {name: (copy / name).read_bytes() for name in ("model.safetensors", "optim.safetensors")}

    holder_root = tmp_path / "m1"
    link = SaverLink(holder_root, rank=1, job="j")
    assert link.request({"op": "static", "static": _static("secret")}, "ready")["replica"]
    conn = socket.create_connection((link.host, link.port), timeout=30)
    reader = LineReader(conn)

    def send(token: str, holder: int = 1, body: dict[str, bytes] = files) -> dict[str, object]:
        send_doc(conn, {"op": "replica", "token": token, "owner": 0, "holder": holder, "step": 0,
                        "manifest": len(manifest), "files": [[n, len(d)] for n, d in body.items()]})
        conn.sendall(manifest)
        for data in body.values():
            conn.sendall(data)
        reply = reader.doc()
        assert reply is not None
        return reply

    assert not send("guess")["ok"]
    assert not send("secret", holder=5)["ok"]  # no such rank here
    damaged = dict(files, **{"model.safetensors": files["model.safetensors"][:-1] + b"\0"})
    refused = send("secret", body=damaged)
    assert not refused["ok"] and "sha256 mismatch" in str(refused["why"])
    assert layout.list_copies(holder_root, "replica") == []
    assert send("secret")["ok"]
    (step, owner, path), = layout.list_copies(holder_root, "replica")
    assert (step, owner) == (0, 0)
    assert json.loads((path / layout.REPLICA_INFO).read_text()) == {"holder": 1, "owner": 0}
    conn.close()
    link.close(flush=False)
    assert saverlink.stop(holder_root)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_non_finite_values_are_found_in_every_float_format(dtype: torch.dtype):
    t = torch.arange(6, dtype=torch.float32).to(dtype)
    entries = [["w", {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.float64: "F64"}[dtype], [6], 0, 6 * t.element_size()]]
    data = memoryview(t.view(torch.uint8).numpy().tobytes())
    assert non_finite(data, entries) == ""
    for bad in (float("nan"), float("inf"), float("-inf")):
        t2 = t.clone()
        t2[3] = bad
        found = non_finite(memoryview(t2.view(torch.uint8).numpy().tobytes()), entries)
        assert found == "tensor w holds 1 non-finite values", (dtype, bad)
    ints = memoryview(np.full(4, 0x7F800000, dtype="<u4").tobytes())  # an integer tensor is never "non-finite"
    assert non_finite(ints, [["n", "I32", [4], 0, 16]]) == ""


def test_a_job_whose_checkpoint_folder_is_deeper_than_a_unix_socket_path_still_gets_its_saver(tmp_path: Path):
    """A job named ``peers-trainguard_replicas-machine_lost-0`` under a deep working directory: its saver could not
    bind ``<root>/saver.sock`` (AF_UNIX path too long) and every rank failed its start, 30 s later, with "the
    checkpoint saver did not answer". Such a root's saver listens on a name of the abstract namespace instead."""
    root = tmp_path / ("d" * 60) / "jobs" / "peers-trainguard_replicas-machine_lost-0" / "checkpoints"
    assert len(os.fsencode(str(root / saverproto.SOCKET))) > saverproto.MAX_SOCKET_PATH
    address = saverproto.socket_address(root)
    assert address.startswith("\0trainguard-saver-") and saverproto.socket_address(root) == address
    assert saverproto.socket_address(tmp_path / "short") == str(tmp_path / "short" / saverproto.SOCKET)
    link = SaverLink(root, rank=0, job="j", idle_s=600)
    try:
        assert psutil.pid_exists(link.pid) and not (root / saverproto.SOCKET).exists()
        again = SaverLink(root, rank=1, job="j", idle_s=600)  # a second rank of the machine finds the same saver
        assert again.pid == link.pid
        again.close(flush=False)
    finally:
        pid = link.pid
        link.close(flush=False)
        os.kill(pid, signal.SIGTERM)
        psutil.Process(pid).wait(timeout=15)


def test_a_saver_ends_when_its_root_is_gone(tmp_path: Path):
    root = tmp_path / "machine"
    link = SaverLink(root, rank=0, job="j", idle_s=600)
    pid = link.pid
    link.close(flush=False)
    import shutil

    shutil.rmtree(root)
    import psutil

    psutil.Process(pid).wait(timeout=15)
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_a_saver_that_dies_stops_snapshots_but_never_the_training(tmp_path: Path):
    """The saver process is killed (out of memory, an operator's mistake): the training thread's next
    snapshots are skipped with one line saying why, and no call raises."""
    lines: list[str] = []
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, lines, saver="process", fsync=False)
    assert ck.restore() is None
    ck.start()
    run_steps(ck, model, opt, range(2))
    pid = ck.status()["saver_pid"]
    os.kill(pid, signal.SIGKILL)
    assert ck.link is not None and ck.link.lost.wait(10), "the link did not notice its saver's death"
    for step in range(2, 6):
        train_step(model, opt, step)
        info = ck.after_step(step)  # raises nothing
        assert info.skipped and not info.taken
    assert ck.skipped == 4
    assert any("saver" in line and ("closed" in line or "gone" in line) for line in lines)
    # the dead saver's buffers do not stay in /dev/shm (it cannot remove them; nobody else would)
    assert not list(saverproto.SHM_DIR.glob(f"{saverproto.shm_prefix(tmp_path)}-*"))
    ck.close(flush=False)


def test_a_saver_persists_once_every_rank_of_its_host_idles_and_no_later_than_its_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Its own rank idles, but another rank of the host still computes on the CPU: the saver holds the
    snapshot back until that rank idles too (checkpoint/hostboard.py); a rank that never idles (hung) holds
    it back at most half its own rank's idle span (capped by QUIET_WAIT_S)."""
    monkeypatch.setenv("TG_HOST_BOARD", str(tmp_path / "board"))  # the saver started below inherits it
    other = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        neighbour = hostboard.HostBoard(tmp_path / "board")
        neighbour.claim(pid=other.pid)  # busy
        model, opt = make_model()
        ck = checkpointer(tmp_path / "m", model, opt, saver="process", fsync=False)
        assert ck.restore() is None
        ck.start()
        board = hostboard.HostBoard(tmp_path / "board")
        assert sorted(board.busy()) == sorted([os.getpid(), other.pid])  # this rank claimed its record at start
        ck.host_idle()  # from now on the saver persists at this rank's idle moments
        assert board.busy() == [other.pid]
        ck._idle_span_s = 20.0  # as if the device computed 20 s each step: the bound is QUIET_WAIT_S / 2
        train_step(model, opt, 0)
        ck.after_step(0)
        assert sorted(board.busy()) == sorted([os.getpid(), other.pid])
        ck.host_idle()
        assert not ck.drain(0.5), "the snapshot was persisted while another rank of the host was busy"
        neighbour.mark(hostboard.IDLE)
        assert ck.drain(30)
        assert ck.status()["snapshots"] == 1 and not ck.errors
        neighbour.mark(hostboard.BUSY)  # and stays busy: a hung rank
        train_step(model, opt, 1)
        ck.after_step(1)
        t0 = time.monotonic()
        ck.host_idle()
        assert ck.drain(30)
        assert time.monotonic() - t0 >= 0.8 * saver.HOST_WAIT_SHARE * saver.QUIET_WAIT_S
        ck.close()
        assert os.getpid() not in board.busy()  # its record is given back
        assert saverlink.stop(tmp_path / "m")
    finally:
        other.kill()
        other.wait()


def test_a_paused_saver_makes_the_step_wait_and_the_snapshot_is_kept(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch):
    """The saver falls behind (here: stopped with SIGSTOP, continued once the training thread waits): the
    step whose buffers are both still queued waits for one instead of skipping, so no rank misses a step its
    peers keep."""
    from tests.checkpoint.test_engine import _when_waiting

    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, saver="process", fsync=False)
    assert ck.restore() is None
    ck.start()
    run_steps(ck, model, opt, range(1))  # step 0 persisted: its buffer is the saver's memory copy
    pid = ck.status()["saver_pid"]
    waiting = _when_waiting(monkeypatch, lambda: os.kill(pid, signal.SIGCONT))
    stop(pid)
    try:
        infos = []
        for step in range(1, 4):  # 1 and 2 fill both buffers at the stopped saver; 3 waits for one
            train_step(model, opt, step)
            infos.append(ck.after_step(step))
    finally:
        os.kill(pid, signal.SIGCONT)
    assert waiting.is_set()
    assert [i.taken for i in infos] == [True, True, True] and ck.status()["skipped"] == 0
    assert infos[2].waited_s > 0
    assert ck.drain(30)
    ck.close()
    assert sorted(s for s, _r, _p in layout.list_copies(tmp_path, "local")) == [1, 2, 3]  # retention keeps 3
    assert saverlink.stop(tmp_path)


def test_a_stuck_saver_costs_one_bounded_wait_then_snapshots_skip_until_it_runs_again(tmp_path: Path):
    lines: list[str] = []
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, lines, saver="process", fsync=False, backpressure_wait_s=0.5)
    assert ck.restore() is None
    ck.start()
    run_steps(ck, model, opt, range(1))
    pid = ck.status()["saver_pid"]
    stop(pid)
    try:
        infos = []
        for step in range(1, 5):
            train_step(model, opt, step)
            infos.append(ck.after_step(step))
        assert [i.taken for i in infos] == [True, True, False, False], (infos, lines)
        assert infos[2].skipped and infos[2].waited_s >= 0.5  # one wait, to its bound
        assert infos[3].skipped and infos[3].waited_s == 0  # then at once: the training never waits again
        assert ck.status()["stalled"]
    finally:
        os.kill(pid, signal.SIGCONT)
    assert ck.drain(30)
    assert not ck.status()["stalled"]
    train_step(model, opt, 5)
    assert ck.after_step(5).taken
    assert ck.drain(30)
    assert any("no buffer was freed within 0.5s" in line for line in lines)
    ck.close()
    assert saverlink.stop(tmp_path)


def test_a_step_waiting_for_a_buffer_lets_the_saver_persist_without_waiting_for_the_next_idle_moment(
        tmp_path: Path):
    """A loop that says when its host idles gates the saver: a snapshot is persisted at the next idle moment
    (at most QUIET_WAIT_S later). A step that waits for a free buffer is such a moment: the queued snapshot
    is persisted at once, not after QUIET_WAIT_S."""
    model, opt = make_model()
    ck = checkpointer(tmp_path, model, opt, saver="process", fsync=False)
    assert ck.restore() is None
    ck.start()
    train_step(model, opt, 0)
    ck.after_step(0)
    ck.host_idle()  # the saver now waits for idle moments
    assert ck.drain(30)
    infos = []
    for step in range(1, 4):  # no idle moment said: 1 waits at the saver, 2 behind it, 3 finds both busy
        train_step(model, opt, step)
        infos.append(ck.after_step(step))
    assert [i.taken for i in infos] == [True, True, True]
    assert 0 < infos[2].waited_s < 0.75 * saver.QUIET_WAIT_S
    assert ck.drain(30)
    ck.close()
    assert saverlink.stop(tmp_path)
