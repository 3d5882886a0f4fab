"""Commands of two phases across machines in one round of sessions (Transport.run_two_phase): the
second phase runs nowhere before the first is done everywhere. Locally, over the SSH transport (with the
inventory's login, and with the NodeHook's); then the two-phase stop of a real job."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from trainguard.node_tools import cli
from trainguard.node_tools.config import NodeConfig
from trainguard.node_tools.inventory import SCHEMA_VERSION, Inventory
from trainguard.node_tools.transport import LocalTransport, SshTransport

TG_NODE = str(Path(sys.executable).with_name("tg-node"))
# phase 1: leave a mark (after DELAY s: the slow machine); phase 2: say which marks exist
PHASES = """
import json, pathlib, sys, time
d, name, delay = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3])
if delay < 0:
    sys.exit(3)  # ends before its first phase is done
time.sleep(delay)
(d / name).touch()
print(json.dumps({"marked": name}), flush=True)
sys.stdin.readline()
print(json.dumps({"machine": name, "saw": sorted(p.name for p in d.iterdir())}))
"""


def local_inventory(names: list[str]) -> Inventory:
    return Inventory.from_dict({"schema": SCHEMA_VERSION, "transport": "local", "cluster": "t",
                                "machines": [{"name": n, "address": "127.0.0.1"} for n in names]})


def phases(d: Path, delays: dict[str, float]):
    return lambda m: [sys.executable, "-c", PHASES, str(d), m.name, str(delays.get(m.name, 0.0))]


def check_every_machine_saw_every_mark(results, names: list[str]) -> None:
    for name in names:
        r = results[name]
        assert r.ok, r.describe()
        assert json.loads(r.extra["first"]) == {"marked": name}
        assert r.json() == {"machine": name, "saw": sorted(names)}


def test_the_second_phase_waits_for_the_slowest_first_phase(tmp_path: Path):
    inv = local_inventory(["a", "b", "c"])
    # c takes a while to mark: a and b must not go on before it did (with one plain round each, they would)
    results = LocalTransport(inv).run_two_phase(inv.machines, phases(tmp_path, {"c": 1.0}), timeout=30)
    check_every_machine_saw_every_mark(results, ["a", "b", "c"])


def test_a_command_that_ends_early_or_never_marks_does_not_hold_the_others(tmp_path: Path):
    inv = local_inventory(["a", "b", "gone", "stuck"])
    results = LocalTransport(inv).run_two_phase(inv.machines, phases(tmp_path, {"gone": -1, "stuck": 60}),
                                                timeout=6, ready_timeout=2)
    assert results["gone"].returncode == 3 and results["gone"].extra["first"] == ""
    assert results["stuck"].timed_out and not results["stuck"].ok
    for name in ("a", "b"):  # went on after the ready timeout, without the stuck one's mark
        assert results[name].ok and results[name].json()["saw"] == ["a", "b"]


def test_wait_go_prints_the_mark_then_stops_once_stdin_ends(tmp_path: Path, monkeypatch, capsys):
    NodeConfig(machine="n1", workdir=tmp_path, install_dir=tmp_path).save(tmp_path / "n.json")
    monkeypatch.setenv("TG_NODE_CONFIG", str(tmp_path / "n.json"))
    monkeypatch.setattr(sys, "stdin", open("/dev/null"))  # noqa: SIM115 - the go: its end
    assert cli.main(["job", "stop", "--job", "j", "--wait-go", "--logs-since", "0"]) == 0
    first, second = capsys.readouterr().out.splitlines()
    assert json.loads(first)["state"] == "absent" and "logs" not in json.loads(first)
    assert json.loads(second)["logs"] == {"error": "machine n1 has no job j"}


@pytest.mark.cluster
@pytest.mark.slow
def test_two_phases_over_the_ssh_transport_and_the_node_hooks(ns_cluster: Inventory, tmp_path: Path, monkeypatch):
    from trainguard.operators.hooks.node import NodeHook

    monkeypatch.delenv("AIRFLOW_CONN_TG_SSH", raising=False)
    names = ["m0", "m1", "m2", "m3"]
    machines = [ns_cluster.machine(n) for n in names]
    for i, transport in enumerate((SshTransport(ns_cluster), NodeHook(ns_cluster, ssh_conn_id=None).transport())):
        d = tmp_path / str(i)
        d.mkdir()
        results = transport.run_two_phase(machines, phases(d, {"m2": 1.0}), timeout=30)
        check_every_machine_saw_every_mark(results, names)


@pytest.mark.full
@pytest.mark.cluster
@pytest.mark.slow
def test_a_stop_in_one_round_marks_everywhere_first_raises_no_alert_and_reads_the_logs(ns_cluster: Inventory):
    from tests import jobs
    from tests.conftest import wait_until
    from trainguard.core.topology import Topology
    from trainguard.node_tools import launcher

    active = ns_cluster.by_role("active")
    plan = jobs.start(ns_cluster, "stop2p", Topology(tp=2, pp=2, dp=2), active)
    try:
        jobs.wait_all_reach(plan, 2)
        alerts = jobs.AlertWatch(ns_cluster)
        results = launcher.stop_sessions(ns_cluster, plan.job, plan.machines, grace_s=3, logs_since=0.0)
        stopped = time.time()
        for m in active:
            r = results[m.name]
            assert r.ok, r.describe()
            mark, done = json.loads(r.extra["first"]), r.json()
            assert mark["state"] == "running" and mark["marked_stopped"] is True and mark["stopped_pids"] == []
            assert done["stopped_pids"] and done["state"] == "exited"
            assert done["logs"]["stop_requested"] is True and "verdict" in done["logs"]
    finally:
        launcher.stop(ns_cluster, plan.job, plan.machines, grace_s=3)

    def agent_ts(m):
        try:
            return json.loads((Path(m.extra["machine_dir"]) / "agent" / "status.json").read_text())["ts"]
        except (OSError, ValueError, KeyError):
            return 0.0

    # ranks ended by the stop are not failures: every agent ran all its checks since, and said nothing
    wait_until(lambda: all(agent_ts(m) > stopped + 10.5 for m in active), timeout=60,
               what="every agent to finish a full round of checks after the stop")
    assert alerts.poll() == [], [(a.kind, a.machine, a.rank) for a in alerts.seen]


@pytest.mark.parametrize("max_two_phase", [256, 1])
def test_a_stop_of_more_machines_than_sessions_held_at_once_takes_a_round_per_phase(tmp_path: Path, max_two_phase):
    from trainguard.node_tools import launcher

    configs = {}
    for name in ("a", "b"):
        NodeConfig(machine=name, workdir=tmp_path / name, install_dir=tmp_path).save(tmp_path / f"{name}.json")
        configs[name] = {"env": {"TG_NODE_CONFIG": str(tmp_path / f"{name}.json")}}
    machines = [{"name": n, "address": "127.0.0.1", "extra": e} for n, e in configs.items()]
    inv = Inventory.from_dict({"schema": SCHEMA_VERSION, "transport": "local", "cluster": "t", "tg_node": TG_NODE,
                               "machines": machines})
    transport = LocalTransport(inv)
    transport.max_two_phase = max_two_phase
    results = launcher.stop_sessions(inv, "j", inv.machines, grace_s=1, transport=transport, status=True)
    for name, r in results.items():
        assert r.ok and r.json()["machine"] == name and r.json()["status"]["state"] == "absent"
        # one session of two phases answers the mark first; a round per phase has no first line
        assert ("first" in r.extra) == (max_two_phase > 1)
