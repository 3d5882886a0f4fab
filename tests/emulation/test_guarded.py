"""The harness's clock of an injected fault (what every fault -> detected / resumed figure starts from)."""

from trainguard.emulation.guarded import fault_time


def test_a_fault_is_timed_when_the_machine_applied_it_not_when_the_host_began_to_connect():
    # the host asked at 100.0; the SSH connection and the command's start took 0.8 s; the answer came at 101.0
    assert fault_time({"ts": 100.8}, 100.0, 101.0) == 100.8


def test_a_machine_clock_off_or_silent_leaves_the_fault_within_the_hosts_round_trip():
    assert fault_time({"ts": 90.0}, 100.0, 101.0) == 100.0  # behind: no earlier than the host asked
    assert fault_time({"ts": 130.0}, 100.0, 101.0) == 101.0  # ahead: no later than the answer came
    assert fault_time({"effect": "stopped"}, 100.0, 101.0) == 100.0  # no time in the answer: when the host asked
    assert fault_time({"ts": "soon"}, 100.0, 101.0) == 100.0
