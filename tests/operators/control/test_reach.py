"""A machine that does not answer is gone for the rest of its incident: contacted once, recorded against the
incident for the tasks after it, evicted, and its survivors stopped without the grace of a SIGTERM."""

from __future__ import annotations

import socket
import time

import pytest

from tests.fakes import alert, fleet_controller, run_incident
from trainguard.operators.control import Controller


def _sent_to(fleet, machine: str) -> list[list[str]]:
    return [argv for m, argv in fleet.commands if m == machine]


def test_a_lost_machine_is_contacted_once_per_incident_evicted_and_its_survivors_killed_at_once(tmp_path,
                                                                                             monkeypatch):
    """A lost machine cost a connect timeout and its retry in every task of its incident: the stacks, the stop,
    the eviction each waited on it again (39 of a 51 s recovery)."""
    c, fleet = fleet_controller(tmp_path)
    fleet.unreachable = {"m2"}  # lost: its processes gone with it
    fleet.running.pop("m2")
    out = run_incident(c, [alert("rank_hang", "m1", rank=1), alert("rank_hang", "m3", rank=3)], monkeypatch)
    assert len(_sent_to(fleet, "m2")) == 1, _sent_to(fleet, "m2")  # the stacks' session; nothing after it
    [gone] = [a for a in c.fleet.actions(out["incident"]) if a.kind == "unreachable"]
    assert gone.machines == ["m2"] and "No route to host" in gone.evidence["why"]
    assert "m2" not in c.fleet.job("j").machine_list and out["closed"]["state"] == "resolved"
    stops = [argv for _m, argv in fleet.commands if argv[:2] == ["job", "stop"]]
    assert stops and all(argv[argv.index("--grace-s") + 1] == "0.0" for argv in stops)


def test_the_next_task_of_the_incident_knows_the_machine_is_gone_and_another_incident_tries_it_again(tmp_path):
    """Each task runs in a process of its own: what one found is in the fleet database for the next."""
    c, fleet = fleet_controller(tmp_path)
    [item] = c.ingest([alert("rank_hang", "m1", rank=1)])
    incident = item["incident"]
    fleet.unreachable = {"m2"}
    c.handling(incident)
    assert not c.progress("j", ["m2"])["incarnations"]["m2"]
    fleet.unreachable = set()  # it would answer now: within the incident it is not asked again
    task = Controller(c.cfg, inventory=c.inventory, transport=fleet)  # the next task's, in another process
    task.handling(incident)
    before = len(fleet.commands)
    states = task.progress("j")["states"]
    assert "did not answer earlier in incident" in states["m2"] and len(fleet.commands) - before == 3
    assert task.unreachable("j").keys() == {"m2"}
    # another incident, or no incident at all (the reconciler's look), asks it again
    task.fleet.update_incident(incident, state="resolved", closed_ts=time.time())
    [other] = task.ingest([alert("rank_exit", "m0", rank=0)])
    assert other["incident"] != incident
    task.handling(other["incident"])
    assert task.progress("j")["states"]["m2"] == "running" and not task.unreachable("j")
    task.transport.leave()
    assert task.progress("j")["states"]["m2"] == "running"


def test_a_tcp_handshake_without_an_answer_is_given_up_after_two_seconds_and_not_tried_again(tmp_path):
    """A powered-off machine drops the SYN: the connect timeout (5 s) and its retry 3 to 5 s later made 14 s."""
    import paramiko

    from trainguard.node_tools.inventory import Inventory, Machine
    from trainguard.node_tools.transport import TCP_CONNECT_S, SshTransport

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    port = listener.getsockname()[1]
    fillers = []
    try:
        while True:  # until the accept queue is full: then the kernel drops SYNs, as for a dead link
            try:
                fillers.append(socket.create_connection(("127.0.0.1", port), timeout=0.5))
            except TimeoutError:
                break
            assert len(fillers) < 64, "the listener's queue never filled"
        key = paramiko.RSAKey.generate(1024)
        inv = Inventory(cluster="t", transport="ssh", machines=[
            Machine(name="m0", address="127.0.0.1", port=port, host_key=f"ssh-rsa {key.get_base64()}")])
        inv.save(tmp_path / "inventory.json")
        t = SshTransport(inv, connect_timeout_s=5.0, connect_attempts=2)
        t0 = time.monotonic()
        r = t.run(inv.machine("m0"), ["true"])
        took = time.monotonic() - t0
    finally:
        for s in fillers:
            s.close()
        listener.close()
    assert not r.reachable and r.extra["status"] == "unreachable" and "no answer to a TCP connection" in r.stderr
    assert TCP_CONNECT_S <= took < TCP_CONNECT_S + 1.5, took  # one try, not two


@pytest.mark.parametrize("status", ["host_key_mismatch", "timeout"])
def test_a_machine_that_answered_is_not_gone(tmp_path, status):
    """A host key that does not match and a command past its timeout are answers: the machine is asked again."""
    from trainguard.node_tools.transport import RunResult
    from trainguard.operators.hooks.reach import IncidentReach

    class Answers:
        calls = 0

        def run(self, machine, argv, **kw):
            Answers.calls += 1
            return RunResult(machine.name, list(argv), None, "", "no", 0.1, reachable=status != "host_key_mismatch",
                             timed_out=status == "timeout", extra={"status": status})

    reach, recorded = IncidentReach(Answers()), []
    reach.enter(7, {}, lambda m, why: recorded.append(m))

    class M:
        name = "m1"

    reach.run(M(), ["x"])
    reach.run(M(), ["x"])
    assert Answers.calls == 2 and not recorded and not reach.gone


def test_a_machine_whose_agent_went_quiet_gets_a_short_handshake_in_the_incidents_sessions(tmp_path):
    """A lost machine cost the hang's stacks their 2 s handshake timeout (2.2 of a 13.5 s recovery); its agent's
    heartbeat had stopped seconds before. The incident's sessions to machines whose agents are quiet get 0.5 s for
    the handshake, beside the others' sessions; the one that does not answer is gone, its agent's quiet in the why."""
    from trainguard.operators.hooks.reach import QUIET_HANDSHAKE_S

    c, fleet = fleet_controller(tmp_path)
    now = time.time()
    c.fleet.record_liveness({"m0": {"token": "a", "changed_ts": now - 0.5},  # beating
                             "m1": {"token": "b", "changed_ts": now - 4.0},  # quiet, but its machine answers
                             "m2": {"token": "c", "changed_ts": now - 6.0},  # quiet, its machine lost
                             "m4": {"token": "d", "changed_ts": now - 60.0}})  # quiet, but no machine of the job
    [item] = c.ingest([alert("rank_hang", "m1", rank=1)])
    fleet.unreachable = {"m2"}
    c.handling(item["incident"])
    assert fleet.quick == {"m1": QUIET_HANDSHAKE_S, "m2": QUIET_HANDSHAKE_S} and not fleet.commands
    c.analysis.analyze("j", item["incident"])
    [gone] = [a for a in c.fleet.actions(item["incident"]) if a.kind == "unreachable"]
    assert gone.machines == ["m2"] and "agent quiet for 6." in gone.evidence["why"]
    c.handling(item["incident"])  # the next task: m2 is gone already, m1 still hurried
    assert fleet.quick == {"m1": QUIET_HANDSHAKE_S}
    c.transport.leave()  # outside an incident (the reconciler's look): every handshake gets its usual time
    assert fleet.quick == {}


def test_a_quiet_machine_that_does_not_answer_is_given_up_after_its_short_handshake(tmp_path):
    """No SYN-ACK within the quick handshake is silence; the usual handshake of another machine is untouched."""
    import paramiko

    from trainguard.node_tools.inventory import Inventory, Machine
    from trainguard.node_tools.transport import SshTransport
    from trainguard.operators.hooks.reach import QUIET_HANDSHAKE_S

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(0)
    fillers = []
    try:
        while True:  # the listener's accept queue full: its SYNs dropped, as a dead link's
            try:
                fillers.append(socket.create_connection(listener.getsockname(), timeout=0.5))
            except TimeoutError:
                break
            assert len(fillers) < 64, "the listener's queue never filled"
        key = paramiko.RSAKey.generate(1024)
        inv = Inventory(cluster="t", transport="ssh", machines=[
            Machine(name="m0", address="127.0.0.1", port=listener.getsockname()[1],
                    host_key=f"ssh-rsa {key.get_base64()}")])
        t = SshTransport(inv, connect_timeout_s=5.0)
        t.quick = {"m0": QUIET_HANDSHAKE_S}
        t0 = time.monotonic()
        r = t.run(inv.machine("m0"), ["true"])
        took = time.monotonic() - t0
    finally:
        for s in (*fillers, listener):
            s.close()
    assert not r.reachable and f"within {QUIET_HANDSHAKE_S:g}s" in r.stderr
    assert QUIET_HANDSHAKE_S <= took < QUIET_HANDSHAKE_S + 1.0, took
