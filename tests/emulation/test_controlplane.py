"""``trainguard controlplane up`` when the control plane does not come up in time (a host short of CPU): one line
that says what to do, exit 1, and no half-started Airflow left behind for the next ``up`` to take as running."""

from __future__ import annotations

import argparse
import types

import pytest

from trainguard.core.errors import EXIT_UNHEALTHY, TrainguardError
from trainguard.emulation import cluster, controlplane
from trainguard.emulation.standalone import Standalone
from trainguard.operators import control


def test_a_control_plane_that_does_not_come_up_is_stopped_and_named_in_one_line(tmp_path, monkeypatch):
    stopped = []

    class Controller:
        def __init__(self, cfg):
            pass

        def sync_inventory(self):
            return None

    def start(self, timeout=240):
        raise TimeoutError("timed out after 120s waiting for the tg_ssh pool to be created")

    monkeypatch.setattr(cluster, "up", lambda spec, state, log: types.SimpleNamespace(bus_url="file:///bus"))
    monkeypatch.setattr(control, "Controller", Controller)
    monkeypatch.setattr(Standalone, "start", start)
    monkeypatch.setattr(Standalone, "stop_kept", staticmethod(lambda home: stopped.append(home) or True))
    args = argparse.Namespace(profile="embedded", name="tgcp", machines=2, standbys=0, subnet="10.213.99.0/24",
                              workers=1, schedulers=1, concurrency=4, port=0)
    with pytest.raises(TrainguardError) as caught:
        controlplane.up(args, tmp_path, log=lambda msg: None)
    message = str(caught.value)
    assert caught.value.exit_code == EXIT_UNHEALTHY and "\n" not in message
    assert "tg_ssh pool" in message and "'trainguard controlplane up' again" in message
    assert len(stopped) == 1 and stopped[0].name == "airflow", stopped  # the half-started standalone, stopped
    assert not (stopped[0].parent / controlplane.PROFILE_FILE).exists()  # nothing says it is up
