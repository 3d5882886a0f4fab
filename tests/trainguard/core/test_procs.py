"""Process groups: a group whose members have all exited has ended, even while they wait to be reaped."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from trainguard.core.procs import group_alive
from trainguard.emulation.standalone import stop_group


def test_a_group_of_zombies_has_ended_though_the_kernel_still_knows_it():
    exited = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    try:
        os.waitid(os.P_PID, exited.pid, os.WEXITED | os.WNOWAIT)  # it exited; left unreaped: a zombie
        os.killpg(exited.pid, 0)  # the signal test still finds the group
        assert not group_alive(exited.pid)
    finally:
        exited.wait()
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        assert group_alive(running.pid)
    finally:
        running.kill()
        running.wait()
    assert not group_alive(running.pid)


# a parent that takes in orphans (a subreaper, as an init is) and never reaps them: the group it starts, once ended,
# stays behind as zombies, as airflow standalone's components did on a host whose init reaps lazily
_LAZY_INIT = """
import ctypes, subprocess, sys, time
ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
child = f"import subprocess, time; subprocess.Popen({sleeper!r}); time.sleep(60)"
leader = subprocess.Popen([sys.executable, "-c", child], start_new_session=True)
print(leader.pid, flush=True)
time.sleep(120)
"""


def test_stopping_a_group_returns_when_its_members_exit_not_when_someone_reaps_them():
    import time

    from trainguard.core.procs import alive

    init = subprocess.Popen([sys.executable, "-c", _LAZY_INIT], stdout=subprocess.PIPE, text=True)
    try:
        leader = int(init.stdout.readline())
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # the leader's own child has started: two in the group
            if len(subprocess.run(["pgrep", "-g", str(leader)], capture_output=True, text=True).stdout.split()) >= 2:
                break
            time.sleep(0.05)
        assert alive(leader) and group_alive(leader)
        t0 = time.monotonic()
        assert stop_group(leader, grace_s=60.0, sig=signal.SIGTERM)
        took = time.monotonic() - t0
        os.killpg(leader, 0)  # the zombies are still there, unreaped
        assert took < 10 and not group_alive(leader), took
    finally:
        init.kill()
        init.wait()


def test_groups_that_ignore_sigterm_are_ended_within_one_grace_not_one_each():
    """A plane's components are stopped together: three that ignore SIGTERM cost one grace (then SIGKILL), where
    stopping them one after another cost three."""
    import time

    from trainguard.emulation.standalone import stop_groups

    deaf = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print(flush=True); time.sleep(60)"
    procs = [subprocess.Popen([sys.executable, "-c", deaf], start_new_session=True, stdout=subprocess.PIPE)
             for _ in range(3)]
    gone = subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)
    gone.wait()
    try:
        for p in procs:  # each has set its handler
            assert p.stdout is not None and p.stdout.readline() == b"\n"
        grace = 3.0
        t0 = time.monotonic()
        ran = stop_groups([p.pid for p in procs] + [gone.pid], grace_s=grace, sig=signal.SIGTERM)
        took = time.monotonic() - t0
        assert ran == {p.pid for p in procs}  # the one that had exited is not counted
        for p in procs:
            assert p.wait(timeout=10) == -signal.SIGKILL  # SIGTERM was ignored: SIGKILL ended it
        assert grace <= took < 2 * grace, took
    finally:
        for p in procs:
            p.kill()
            p.wait()
