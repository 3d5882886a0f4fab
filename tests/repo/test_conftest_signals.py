"""The test run itself: a SIGTERM tears the fixtures down."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from tests import REPO as ROOT
from tests.conftest import wait_until


def test_a_run_ended_by_sigterm_tears_its_fixtures_down(tmp_path: Path):
    marker = tmp_path / "torn_down"
    started = tmp_path / "started"
    (tmp_path / "test_victim.py").write_text(textwrap.dedent(f"""
        import pathlib, time
        import pytest

        @pytest.fixture
        def held():
            yield
            pathlib.Path({str(marker)!r}).write_text("done")

        def test_waits(held):
            pathlib.Path({str(started)!r}).write_text("yes")
            time.sleep(60)
    """))
    # the project's conftest, as the suite loads it
    (tmp_path / "conftest.py").write_text("from tests.conftest import pytest_configure  # noqa: F401\n")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                            cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wait_until(lambda: started.exists() or proc.poll() is not None, timeout=60, what="the test to start")
    assert proc.poll() is None, proc.communicate()[0].decode()[-2000:]
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=60)[0].decode()
    assert marker.exists(), out[-2000:]
