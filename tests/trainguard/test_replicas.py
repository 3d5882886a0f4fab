"""Replica groups under trainguard.replicas (torchft's lighthouse, quorum and live healing behind trainguard's
face): two groups train ``examples/replicas``; one group's rank is killed; the other trains on alone (its step
records say one participant) without stopping longer than the quorum change; torchrun restarts the killed rank,
which heals from the live group and rejoins; afterwards both hold the same state bit for bit."""

from __future__ import annotations

import itertools

import pytest

from trainguard.emulation.replicas import ReplicaRun
from trainguard.emulation.standalone import poll

STEPS = 150


@pytest.mark.slow
def test_one_replica_dies_the_other_trains_on_and_the_restarted_one_heals_from_it(tmp_path):
    # no checkpoint: a group restarted within the quorum change would otherwise restore its own newest step and
    # rejoin at the survivor's step, the survivor never training alone (the next test's path)
    run = ReplicaRun(tmp_path, steps=STEPS, step_s=0.05, heartbeat_timeout_ms=2000, args=["--no-checkpoint"])
    try:
        run.start()
        poll(lambda: len(run.records(1)) >= 20 and any(r.get("participants") == 2 for r in run.records(1)),
             timeout=120, interval=0.05, what="both replicas to train together")
        killed_at = run.kill(1)
        poll(lambda: any(r["ts"] > killed_at and r.get("participants") == 1 for r in run.records(0)),
             timeout=120, interval=0.05, what="the survivor to train alone")
        poll(lambda: any(r.get("healed_from_step") is not None and r["ts"] > killed_at for r in run.records(1)),
             timeout=120, interval=0.05, what="the restarted replica to heal from the live one")
        codes = run.finish()
        assert codes == {0: 0, 1: 0}, [run.log(i).read_text()[-3000:] for i in (0, 1)]
    finally:
        run.stop()
    survivor = run.records(0)
    # the survivor's process lived through it (it never healed after the kill: a restart of its own would)
    assert not [r for r in survivor if r["ts"] > killed_at and r.get("healed_from_step") is not None]
    steps = [r["step"] for r in survivor]  # (the group that joined second healed from the other at the start)
    # every step once: none lost, none redone (the first a few steps in: the group that joined second healed at a
    # step the first had reached alone, later under load)
    assert steps == list(range(steps[0], STEPS)) and steps[0] < 40
    # the survivor never stood still longer than the quorum change (the lighthouse's 2 s heartbeat timeout and
    # a failed step), far from a restart of the whole job
    gaps = [b["ts"] - a["ts"] for a, b in itertools.pairwise(survivor) if a["ts"] >= killed_at - 5]
    assert max(gaps) < 10.0, max(gaps)
    # the wait on the other replicas is the step's communication, not its compute: the survivor's stall is in
    # comm_s, so the rank check does not take the quorum change for a slow machine
    before, stalled = max(itertools.pairwise(survivor), key=lambda ab: ab[1]["ts"] - ab[0]["ts"])
    assert stalled["step_time_s"] > 0.8 * (stalled["ts"] - before["ts"])  # every try of the step, timed
    assert stalled["comm_s"] > stalled["step_time_s"] - 0.5, stalled  # and nearly all of it waiting on the others
    alone = [r["step"] for r in survivor if r.get("participants") == 1 and r["ts"] > killed_at]
    assert alone and any(r.get("participants") == 2 for r in survivor if r["step"] > max(alone))  # it rejoined
    healed = [r for r in run.records(1) if r.get("healed_from_step") is not None and r["ts"] > killed_at]
    reached = max(r["step"] for r in survivor if r["ts"] <= killed_at)
    assert healed[0]["step"] > reached  # it came back past where the survivor was when it died: the live state
    # the same state bit for bit at every step both logged after the heal, the last one included
    d0, d1 = run.digests(0), run.digests(1)
    common = sorted(s for s in set(d0) & set(d1) if s > healed[0]["step"])
    assert STEPS in common, (sorted(d0), sorted(d1))
    assert all(d0[s] == d1[s] for s in common), {s: (d0[s], d1[s]) for s in common}


@pytest.mark.slow
def test_every_group_restarted_at_once_restores_its_own_checkpoint_and_loses_at_most_one_step(tmp_path):
    """What a fault that stops the world does to a job of replica groups: every group's rank dies at once (torchrun
    restarts each), no live replica is ahead to heal from, so each group restores the newest step of its own
    checkpoint (trainguard's, taken every committed step, on by default under a launch) and the job goes on from
    there, at most the step in flight lost; both groups end with the same state bit for bit."""
    run = ReplicaRun(tmp_path, steps=STEPS, step_s=0.05, heartbeat_timeout_ms=2000)
    try:
        run.start()
        poll(lambda: sum(r.get("participants") == 2 for r in run.records(1)) >= 30, timeout=120, interval=0.05,
             what="both replicas to train together")
        at = min(run.kill(0), run.kill(1))
        poll(lambda: all(any(r["ts"] > at for r in run.records(i)) for i in (0, 1)), timeout=120, interval=0.1,
             what="both groups to train again")
        codes = run.finish()
        assert codes == {0: 0, 1: 0}, [run.log(i).read_text()[-3000:] for i in (0, 1)]
    finally:
        run.stop()
    reached = max(r["step"] for i in (0, 1) for r in run.records(i) if r["ts"] <= at)
    for i in (0, 1):
        records = run.records(i)
        first = next(r for r in records if r["ts"] > at)
        restored = first.get("ckpt_restored_step")
        assert restored is not None and restored >= reached - 1, (i, first, reached)  # at most one step lost
        assert first["step"] >= restored + 1  # from the restored step on (or past it, healed from the other)
    d0, d1 = run.digests(0), run.digests(1)
    assert STEPS in d0 and d0[STEPS] == d1.get(STEPS), (d0.get(STEPS), d1.get(STEPS))


def test_a_lighthouse_that_does_not_answer_or_is_not_a_url_is_refused_in_one_line(monkeypatch):
    import socket

    import torch

    from trainguard import replicas
    from trainguard.emulation.standalone import free_port
    from trainguard.replicas import Replicas, ReplicasError

    monkeypatch.setattr(replicas, "LIGHTHOUSE_WAIT_S", 1.0)

    model = torch.nn.Linear(2, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    monkeypatch.setenv("TG_REPLICA", "0")
    with socket.socket() as held:  # a port nothing listens on: bound, never listening
        held.bind(("127.0.0.1", free_port()))
        monkeypatch.setenv("TORCHFT_LIGHTHOUSE", f"http://127.0.0.1:{held.getsockname()[1]}")
        with pytest.raises(ReplicasError, match=r"does not answer .*start torchft_lighthouse there") as exc:
            Replicas(model, opt, checkpoint=False)
    assert "\n" not in str(exc.value)
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", "10.0.0.1:29510")
    with pytest.raises(ReplicasError, match="is not a URL; write http://host:port"):
        Replicas(model, opt, checkpoint=False)


@pytest.mark.slow
def test_a_nan_on_one_replica_is_applied_by_none_recorded_by_every_one_and_held_for_the_control_plane(tmp_path):
    """A NaN on one replica reaches every replica through the average: no replica applies the step, each records
    it as NaN (what the agent reports as ``nan_loss``, which stops the world) and holds still for the control
    plane; nobody comes here, so after the hold they go on together, and no parameter ever held a NaN."""
    import math

    from trainguard.emulation.faults import write_control

    control = tmp_path / "faults.json"
    write_control(control, [])
    run = ReplicaRun(tmp_path, steps=80, step_s=0.05, heartbeat_timeout_ms=2000,
                     args=["--nonfinite-hold-s", "1"], env={1: {"TG_FAULT_FILE": str(control)}})
    try:
        run.start()
        poll(lambda: sum(r.get("participants") == 2 for r in run.records(1)) >= 15, timeout=120, interval=0.05,
             what="both replicas to train together")
        write_control(control, [{"kind": "nan", "rank": 0, "id": "n1", "params": {}}])
        codes = run.finish()
        assert codes == {0: 0, 1: 0}, [run.log(i).read_text()[-3000:] for i in (0, 1)]
    finally:
        run.stop()
    refused = {i: [r for r in run.records(i) if r.get("refused")] for i in (0, 1)}
    assert len(refused[0]) == 1 and len(refused[1]) == 1, refused
    assert refused[0][0]["step"] == refused[1][0]["step"]  # the same step, on both
    assert all(not isinstance(r["loss"], float) or math.isnan(r["loss"]) for i in (0, 1) for r in refused[i])
    for i in (0, 1):  # the refused step ran again and every committed step is finite
        committed = [r for r in run.records(i) if not r.get("refused")]
        assert refused[i][0]["step"] in {r["step"] for r in committed}
        assert all(math.isfinite(r["loss"]) for r in committed)
    d0, d1 = run.digests(0), run.digests(1)
    assert 80 in d0 and d0[80] == d1.get(80)
