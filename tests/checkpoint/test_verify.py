"""Checkpoint verification pieces without Airflow: verification candidates and their retention, the node
agent's ``checkpoint_committed`` notice (on the bus's notices folder, never among the alerts), the
``tg-node ckpt`` commands on a real checkpoint, the upload of verified copies to a real moto_server with
the remote checksum check, the watcher trigger, and the policy (which step, what S3 retention deletes).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests import REPO
from tests.checkpoint.test_engine import flip_byte, saved_run
from trainguard.checkpoint import layout
from trainguard.checkpoint.s3 import S3Tier
from trainguard.checkpoint.shards import MODEL_FILE
from trainguard.core.errors import EXIT_OK, EXIT_REFUSED, EXIT_UNHEALTHY
from trainguard.node_tools import ckpt
from trainguard.node_tools.agent import Agent
from trainguard.node_tools.bus import NOTICES, BusReader, SpoolBus, open_bus
from trainguard.node_tools.checks import CheckpointCheck
from trainguard.node_tools.config import NodeConfig
from trainguard.operators import checkpoints
from trainguard.operators.policy import checkpoints as policy

JOB = "vjob"


def _node(tmp_path: Path, steps: int = 6, **cfg) -> tuple[NodeConfig, Path]:
    """A machine whose job ``vjob`` saved ``steps`` steps (one rank), candidates every 2 steps."""
    workdir = tmp_path / "disk"
    run_dir = workdir / "jobs" / JOB
    run_dir.mkdir(parents=True)
    (run_dir / "job.json").write_text(json.dumps({"job": JOB, "spec": {"checkpoint": ""}, "incarnation": 0}))
    root = run_dir / "checkpoints"
    saved_run(root, steps=steps, **({"verify_every_steps": 2, "keep": 1} | cfg))
    return NodeConfig(machine="m0", workdir=workdir, install_dir=REPO), root


def _steps(root: Path) -> list[int]:
    return sorted(s for s, _r, _p in layout.list_copies(root, "local"))


# ---- candidates and retention ------------------------------------------------------------------------
def test_retention_keeps_unverified_candidates_until_they_are_verified(tmp_path: Path):
    _cfg, root = _node(tmp_path)
    # keep=1: the newest step (5), plus the two newest candidates (3, 5) not verified yet; 1 is gone
    assert _steps(root) == [3, 5]
    committed = json.loads((layout.copy_dir(root, "local", 3, 0) / layout.COMMITTED).read_text())
    assert committed["verify"] is True
    plain = tmp_path / "plain"
    saved_run(plain, steps=6, keep=1)  # without candidates only the newest step stays
    assert _steps(plain) == [5]


def test_a_step_under_verification_is_pinned_against_retention_until_it_is_marked(tmp_path: Path):
    """Another run verifying a newer candidate must not release the step this run is still reading."""
    from tests.checkpoint.test_engine import checkpointer, make_model, run_steps

    cfg, root = _node(tmp_path)
    three = layout.copy_dir(root, "local", 3, 0)
    code, doc = ckpt.verify(cfg, JOB, 3, mark=False)  # the first of the two calls: pins 3
    assert code == EXIT_OK and layout.pinned(three)
    assert ckpt.verify(cfg, JOB, 5, mark=True)[0] == EXIT_OK  # a newer one verified meanwhile

    def more(steps: range) -> None:
        model, opt = make_model()
        ck = checkpointer(root, model, opt, verify_every_steps=2, keep=1)
        ck.restore()
        ck.start()
        run_steps(ck, model, opt, steps)
        ck.close()

    more(range(6, 10))
    assert _steps(root) == [3, 5, 7, 9]  # 3 is pinned; 5 newest verified; 7, 9 the new candidates
    code, doc = ckpt.verify(cfg, JOB, 3, mark=True)  # the marking call lifts the pin
    assert code == EXIT_OK and doc["marked"] == [str(three)] and not layout.pinned(three)
    more(range(10, 12))
    assert 3 not in _steps(root)
    # a pin older than its lifetime holds nothing (a verification that died)
    layout.pin([layout.copy_dir(root, "local", 9, 0)])
    assert not layout.pinned(layout.copy_dir(root, "local", 9, 0), now=layout.time.time() + layout.PIN_TTL_S + 1)


# ---- the agent's notice -------------------------------------------------------------------------------
def test_the_agent_announces_the_newest_candidate_once_on_the_notices_folder(tmp_path: Path):
    cfg, _root = _node(tmp_path)
    bus = tmp_path / "bus"
    agent = Agent(cfg, open_bus(str(bus)), [CheckpointCheck(cfg.workdir)],
                  notices=open_bus(str(bus), folder=NOTICES), status_path=tmp_path / "agent" / "status.json")
    made = agent.tick(now=1000.0)
    assert [(a.kind, a.severity, a.job, a.rank, a.evidence["step"]) for a in made] == [
        ("checkpoint_committed", "info", JOB, 0, 5)]
    assert agent.tick(now=1010.0) == []  # the same step is not announced twice
    assert BusReader(SpoolBus(bus)).read() == []  # the guardian's folder stays empty
    notices = BusReader(SpoolBus(bus, folder=NOTICES)).read()
    assert [(n.kind, n.evidence["step"]) for n in notices] == [("checkpoint_committed", 5)]
    # the agent's own metrics, a node_exporter textfile beside its status
    from prometheus_client.parser import text_string_to_metric_families

    text = (tmp_path / "agent" / "metrics.prom").read_text()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("trainguard_agent_alerts_published_total",
                    (("kind", "checkpoint_committed"), ("machine", "m0")))] == 1
    assert samples[("trainguard_agent_check_failing", (("check", "checkpoints"), ("machine", "m0")))] == 0
    assert samples[("trainguard_agent_outbox", (("machine", "m0"),))] == 0


def test_a_machine_without_rank_0_says_nothing(tmp_path: Path):
    cfg, root = _node(tmp_path)
    for _s, _r, path in layout.list_copies(root, "local"):
        path.rename(path.with_name("rank_1"))  # this machine holds rank 1 only
    assert CheckpointCheck(cfg.workdir).run(0.0) == []


# ---- tg-node ckpt -------------------------------------------------------------------------------------
def test_verify_marks_nothing_unless_asked_and_names_a_corrupt_copy(tmp_path: Path):
    cfg, root = _node(tmp_path)
    code, doc = ckpt.verify(cfg, JOB, 5, mark=False)
    assert code == EXIT_OK and doc["ok"] and doc["marked"] == [] and doc["bytes"] > 0
    assert not (layout.copy_dir(root, "local", 5, 0) / layout.VERIFIED).exists()
    code, doc = ckpt.verify(cfg, JOB, 5, mark=True)
    assert code == EXIT_OK and doc["marked"] == [str(layout.copy_dir(root, "local", 5, 0))]
    flip_byte(layout.copy_dir(root, "local", 3, 0) / MODEL_FILE)
    code, doc = ckpt.verify(cfg, JOB, 3, mark=True)
    assert code == EXIT_UNHEALTHY and doc["marked"] == []
    assert doc["problem_lines"] == [f"machine m0 rank 0 step 3 tier local: {MODEL_FILE} sha256 mismatch (corrupt) "
                                    f"({layout.copy_dir(root, 'local', 3, 0)})"]
    listing = {(c["step"], c["verified"]) for c in ckpt.listing(cfg, JOB)["copies"]}
    assert listing == {(3, False), (5, True)}


def _rewrite(copy: Path) -> None:
    """The job writing the same step again after a restore from an older one (a new directory renamed into
    place)."""
    from trainguard.checkpoint import manifest as mf

    manifest = (copy / mf.MANIFEST).read_bytes()
    files = [(name, [(copy / name).read_bytes()]) for name in mf.file_names(manifest)]
    layout.write_copy(copy, manifest, files, fsync=False)


@pytest.mark.parametrize("corrupt", [False, True])
def test_a_copy_the_job_writes_again_while_it_is_read_is_read_again_not_failed(tmp_path: Path, monkeypatch,
                                                                               corrupt: bool):
    """After a restore from an older step, the job writes the newer steps again; a verification reading a
    copy as it is replaced sees its model vanish. That is no damage: the new write is read again and judged
    as it stands (and a new write that is itself corrupt is still named)."""
    from trainguard.checkpoint import verify

    cfg, root = _node(tmp_path)
    copy = layout.copy_dir(root, "local", 5, 0)
    real_read, replaced = verify._read, []

    def read(path: Path) -> bytes | None:
        if path.name == MODEL_FILE and not replaced:
            replaced.append(path)
            _rewrite(copy)  # the rename lands while this read is under way
            if corrupt:  # and the new write is itself damaged
                flip_byte(copy / MODEL_FILE)
            return None
        return real_read(path)

    monkeypatch.setattr(verify, "_read", read)
    code, doc = ckpt.verify(cfg, JOB, 5, mark=True)
    assert replaced == [copy / MODEL_FILE]
    if corrupt:
        assert code == EXIT_UNHEALTHY and doc["marked"] == []
        assert doc["problem_lines"] == [f"machine m0 rank 0 step 5 tier local: {MODEL_FILE} sha256 mismatch "
                                        f"(corrupt) ({copy})"]
    else:
        assert code == EXIT_OK and doc["ok"] and doc["marked"] == [str(copy)], doc["problem_lines"]


def test_a_copy_that_vanishes_without_a_new_write_is_still_a_problem(tmp_path: Path, monkeypatch):
    from trainguard.checkpoint import verify

    cfg, _root = _node(tmp_path)
    real_read = verify._read
    monkeypatch.setattr(verify, "_read", lambda p: None if p.name == MODEL_FILE else real_read(p))
    code, doc = ckpt.verify(cfg, JOB, 5, mark=True)
    assert code == EXIT_UNHEALTHY and doc["marked"] == [] and len(doc["problem_lines"]) == 1, doc


def test_upload_refuses_an_unverified_copy_and_the_remote_checksums_are_checked(tmp_path: Path, s3_endpoint: str):
    import boto3

    cfg, _root = _node(tmp_path)
    client = boto3.client("s3", endpoint_url=s3_endpoint)
    client.create_bucket(Bucket="verify-unit")
    url = "s3://verify-unit/ckpt/vjob"
    code, doc = ckpt.upload(cfg, JOB, 5, s3_url=url, endpoint_url=s3_endpoint)
    assert code == EXIT_REFUSED and doc["uploaded"] == []
    assert doc["refused"][0]["why"].startswith("not verified")
    tier = S3Tier(url, endpoint_url=s3_endpoint)
    assert tier.list_copies() == {}  # an unverified copy is never promoted

    ckpt.verify(cfg, JOB, 5, mark=True)
    code, doc = ckpt.upload(cfg, JOB, 5, s3_url=url, endpoint_url=s3_endpoint)
    assert code == EXIT_OK and [u["rank"] for u in doc["uploaded"]] == [0]
    from trainguard.checkpoint import manifest as mf

    sha = doc["uploaded"][0]["manifest_sha256"]
    assert checkpoints._remote_mismatch(tier, 5, 0, sha, mf) == ""
    # an object replaced behind our back (no checksum, other bytes): the check says which
    tier.put(5, 0, MODEL_FILE, b"not the model")
    assert checkpoints._remote_mismatch(tier, 5, 0, sha, mf) == f"{MODEL_FILE} missing or without a SHA-256 checksum"
    assert checkpoints._remote_mismatch(tier, 5, 0, "0" * 64, mf) == "manifest differs from the verified copy's"


# ---- the watcher ------------------------------------------------------------------------------------
def test_the_notice_watcher_emits_once_per_batch_writes_nothing_and_the_run_records_its_cursor(tmp_path: Path):
    from trainguard.node_tools.alerts import Alert
    from trainguard.operators.fleet import FleetStore
    from trainguard.operators.triggers.alerts import NOTICES_READER, CheckpointNoticeTrigger

    bus = open_bus(str(tmp_path / "bus"), folder=NOTICES)
    fleet = FleetStore(tmp_path / "fleet.db", migrate=True)
    trigger = CheckpointNoticeTrigger(str(tmp_path / "bus"), fleet.url, poll_s=0.05)

    async def first_event(timeout: float):
        gen = trigger.run()
        try:
            return await asyncio.wait_for(gen.__anext__(), timeout)
        finally:
            await gen.aclose()

    bus.publish(Alert(kind="checkpoint_committed", machine="m0", severity="info", job=JOB, rank=0,
                      evidence={"step": 19}))
    open_bus(str(tmp_path / "bus")).publish(Alert(kind="gpu_lost", machine="m1", job=JOB))  # an alert: not ours
    event = asyncio.run(first_event(10))
    assert [(n["job"], n["step"], n["machine"]) for n in event.payload["notices"]] == [(JOB, 19, "m0")]
    assert fleet.cursor(NOTICES_READER) == {}  # the watcher writes nothing
    again = asyncio.run(first_event(10))  # not recorded: a watcher started again sends the same notice
    assert again.payload["notices"] == event.payload["notices"]
    # the verification run's first task records the names it was sent (and sends no notice again)
    from tests.fakes import fleet_controller
    from trainguard.operators.tasks import checkpoint_verify

    c, _fake = fleet_controller(tmp_path / "fleet", fleet_url=fleet.url)
    c.inventory.bus_url = str(tmp_path / "bus")

    checkpoint_verify.record_notices(c, [event.payload])
    assert list(fleet.cursor(NOTICES_READER)) == list(event.payload["read"]) and fleet.cursor("guardian") == {}
    with pytest.raises(TimeoutError):  # nothing new: the watcher waits
        asyncio.run(first_event(0.5))


# ---- policy -----------------------------------------------------------------------------------------
def test_the_newest_announced_step_per_job_wins():
    assert policy.newest_per_job([{"job": "a", "step": 19}, {"job": "a", "step": 39}, {"job": "b", "step": 9},
                                  {"job": "c", "step": -1}, {"job": "", "step": 3}, {"job": "d"}]) == {"a": 39, "b": 9}


def test_the_newest_candidate_is_rank_0s_own_committed_one():
    copies = [{"tier": "local", "rank": 0, "step": 39, "committed": False, "candidate": False},
              {"tier": "local", "rank": 0, "step": 19, "committed": True, "candidate": True},
              {"tier": "replica", "rank": 0, "step": 59, "committed": True, "candidate": True},
              {"tier": "local", "rank": 1, "step": 79, "committed": True, "candidate": True}]
    assert policy.newest_candidate(copies) == 19
    assert policy.newest_candidate([]) is None


@pytest.mark.parametrize(("steps", "keep", "deleted"), [
    ({19: {0: True, 1: True}, 39: {0: True, 1: True}, 59: {0: True, 1: True}, 79: {0: True, 1: True}}, 2, [19, 39]),
    # the newest step is not verified on every rank: it stays (in flight), and so do 2 verified ones
    ({19: {0: True, 1: True}, 39: {0: True, 1: True}, 59: {0: True, 1: True}, 79: {0: True}}, 2, [19]),
    # nothing verified anywhere: nothing deleted (the tier may be all a restore has)
    ({19: {0: False, 1: False}, 39: {0: False, 1: False}}, 1, []),
    # an old unverified step below the newest verified one goes; the newest verified one always stays
    ({19: {0: False, 1: False}, 39: {0: True, 1: True}, 59: {0: False, 1: True}}, 1, [19]),
])
def test_s3_retention_never_deletes_the_newest_verified_step(steps, keep, deleted):
    assert policy.s3_deletions(steps, world_size=2, keep=keep) == deleted


def test_s3_retention_refuses_keep_0():
    with pytest.raises(policy.VerifyError, match="keep=0: must be >= 1"):
        policy.s3_deletions({}, world_size=1, keep=0)


def test_the_note_says_what_was_verified_and_what_is_corrupt():
    ok = {"job": "ops", "step": 39, "ok": True, "copies": 4, "bytes": 2_500_000, "seconds": 1.24,
          "machines": {"m0": {}, "m1": {}}, "problems": []}
    bad = {"job": "ops2", "step": 19, "ok": False, "copies": 4, "bytes": 0, "seconds": 1.0, "machines": {"m2": {}},
           "problems": ["machine m2 rank 1 step 19 tier replica: model.safetensors sha256 mismatch (/x)", "p2"]}
    promoted = {"job": "ops", "step": 39, "promoted": True, "url": "s3://b/p/ops", "kept_steps": [19, 39],
                "problems": []}
    assert checkpoints.note([ok, bad], [promoted]) == (
        "ops step 39: 4 copies on m0, m1 verified and marked (2.5 MB, 1.2s); uploaded to s3://b/p/ops, remote "
        "checksums match; S3 keeps steps 19, 39; ops2 step 19: NOT verified, nothing marked or uploaded: "
        "machine m2 rank 1 step 19 tier replica: model.safetensors sha256 mismatch (/x) (+1 more)")
    assert checkpoints.note([], []) == "nothing to verify: no new verification candidate"


def test_a_bad_verification_request_is_refused_before_anything_is_recorded(tmp_path: Path):
    from trainguard.node_tools.inventory import Inventory, Machine
    from trainguard.operators.control import ControlConfig, Controller
    from trainguard.operators.fleet.store import FleetError

    inv = Inventory(cluster="t", transport="local", machines=[Machine(name="m0", address="127.0.0.1")])
    inv.save(tmp_path / "inventory.json")
    c = Controller(ControlConfig(fleet_url=str(tmp_path / "fleet.db"), inventory=str(inv.path)), inventory=inv)
    c.sync_inventory()
    c.fleet.upsert_job("idle", tp=1, pp=1, dp=1, ranks_per_machine=1, machines=[])
    with pytest.raises(FleetError, match="nojob"):
        checkpoints.targets(c, job="nojob")
    with pytest.raises(policy.VerifyError, match="job idle has no machines; launch it before verifying"):
        checkpoints.targets(c, job="idle")
    with pytest.raises(policy.VerifyError, match="step -3 is negative"):
        checkpoints.targets(c, job="idle", step=-3)
    assert c.fleet.checkpoints("idle") == []
    # announced steps of a job that has no machines any more: nothing to do, nothing recorded
    assert checkpoints.targets(c, announced=[{"job": "idle", "step": 19}]) == []
    assert c.fleet.checkpoints("idle") == []


def test_the_control_plane_checks_the_metrics_around_a_step_over_the_records_it_gathers(tmp_path: Path):
    """great-expectations runs in the control plane's task, over the step records of the ranks whose own
    copies each machine holds, read with ``tg-node job steps``: not on the training machines."""
    from tests.fakes import fleet_controller
    from trainguard.operators.checkpoints import metric_problems

    c, fleet = fleet_controller(tmp_path)
    fleet.records = [{"step": s, "incarnation": 0, "loss": 2.0, "grad_norm": 1.0, "step_time_s": 0.5}
                     for s in range(6)]
    machines = {"m0": {"own": {0: 0}}, "m1": {"own": {1: 0, 5: 0}}}  # m1 holds two ranks' own copies
    target = {"job": "j", "step": 5, "machines": ["m0", "m1"]}
    assert metric_problems(c, target, machines) == []
    asked = sorted((m, cmd[cmd.index("--rank") + 1]) for m, cmd in fleet.commands if cmd[:2] == ["job", "steps"])
    assert asked == [("m0", "0"), ("m1", "1"), ("m1", "5")]  # each rank on the machine holding its copy
    fleet.records[3]["loss"] = float("nan")
    problems = metric_problems(c, target, machines)
    assert len(problems) == 3 and all("not_be_null failed on loss" in p for p in problems), "\n".join(problems)
    assert problems[0].startswith("machine m0 rank 0 step 5 tier metrics")
    fleet.records = fleet.records[:3]  # the step itself was never recorded
    lines = metric_problems(c, target, machines)
    assert lines and all("expect_column_max_to_be_between failed on step" in p for p in lines), lines
