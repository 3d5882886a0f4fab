"""The host's board of busy and idle ranks (checkpoint/hostboard.py): what the savers of a host read before
they persist, so that their work runs while every rank of the host waits on its device."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from trainguard.checkpoint import hostboard
from trainguard.checkpoint.hostboard import BUSY, IDLE, HostBoard


@pytest.fixture
def neighbour() -> Iterator[subprocess.Popen[bytes]]:
    """A live process that is not this one (another rank of the host)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc
    proc.kill()
    proc.wait()


def test_a_rank_is_busy_until_it_says_it_idles_and_gone_once_released(tmp_path: Path):
    board = HostBoard(tmp_path / "board")
    slot = board.claim()
    assert slot is not None and board.busy() == [os.getpid()]
    board.mark(IDLE)
    assert board.busy() == []
    board.mark(BUSY)
    assert board.busy() == [os.getpid()]
    board.release()
    assert board.busy() == []
    assert board.claim() == slot  # its record is free again
    assert (tmp_path / "board").stat().st_mode & 0o777 == 0o600
    board.close()


def test_every_process_of_the_host_sees_the_same_board(tmp_path: Path, neighbour: subprocess.Popen[bytes]):
    mine, theirs = HostBoard(tmp_path / "board"), HostBoard(tmp_path / "board")
    theirs.claim(pid=neighbour.pid)
    assert mine.busy() == [neighbour.pid]
    theirs.mark(IDLE)
    assert mine.busy() == []
    mine.close()
    theirs.close()


def test_a_rank_that_died_busy_holds_nobody_back_and_its_record_is_taken_again(tmp_path: Path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    board = HostBoard(tmp_path / "board")
    slot = board.claim(pid=dead.pid)
    assert slot is not None
    assert board.busy() == []  # it says busy, but nobody is there
    assert HostBoard(tmp_path / "board").claim() == slot


def test_a_full_board_gives_no_record_and_nothing_breaks(tmp_path: Path, neighbour: subprocess.Popen[bytes]):
    board = HostBoard(tmp_path / "board")
    for i in range(hostboard.SLOTS):
        hostboard.RECORD.pack_into(board.mm, i * hostboard.STRIDE, os.getpid(), IDLE, 0.0)
    assert board.claim(pid=neighbour.pid) is None
    board.mark(BUSY)  # a rank without a record: its marks are no-ops
    assert board.busy() == []


def test_a_waiting_saver_goes_once_the_busy_rank_idles(tmp_path: Path, neighbour: subprocess.Popen[bytes]):
    saver_view, rank = HostBoard(tmp_path / "board"), HostBoard(tmp_path / "board")
    rank.claim(pid=neighbour.pid)
    marked = threading.Event()

    def idle_soon() -> None:
        rank.mark(IDLE)
        marked.set()

    threading.Timer(0.05, idle_soon).start()
    waited = saver_view.wait_idle(time.monotonic() + 60)
    assert marked.is_set() and waited < 30  # it ended with the idle mark, not at its deadline


def test_the_wait_is_bounded_and_can_be_given_up(tmp_path: Path, neighbour: subprocess.Popen[bytes]):
    board = HostBoard(tmp_path / "board")
    board.claim(pid=neighbour.pid)  # busy, and stays so (a hung rank)
    waited = board.wait_idle(time.monotonic() + 0.3)
    assert 0.25 <= waited < 10
    assert board.busy() == [neighbour.pid]
    assert board.wait_idle(time.monotonic() + 60, give_up=lambda: True) < 30


def test_a_board_that_is_not_private_is_not_used(tmp_path: Path):
    target = tmp_path / "elsewhere"
    target.write_bytes(b"keep")
    (tmp_path / "link").symlink_to(target)
    assert HostBoard.open(tmp_path / "link") is None
    assert target.read_bytes() == b"keep"
    shared = tmp_path / "shared"
    shared.write_bytes(b"")
    shared.chmod(0o644)
    assert HostBoard.open(shared) is None
    assert shared.stat().st_size == 0


def test_the_board_path_can_be_set_for_a_set_of_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TG_HOST_BOARD", str(tmp_path / "b"))
    assert hostboard.default_path() == tmp_path / "b"
    monkeypatch.delenv("TG_HOST_BOARD")
    assert hostboard.default_path() == Path("/dev/shm") / f"tg-host-{os.getuid()}"
