"""The fleet database: migrations, the machine state machine, transactions and idempotency."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import sqlalchemy as sa
from alembic.autogenerate import compare_metadata
from alembic.operations import Operations
from alembic.runtime.migration import MigrationContext

from trainguard.operators.fleet import FleetError, FleetStore, states
from trainguard.operators.fleet.migrations import LATEST, MIGRATIONS, VERSION_TABLE, SchemaError, migrate
from trainguard.operators.fleet.models import Base


@pytest.fixture
def store(tmp_path: Path) -> FleetStore:
    s = FleetStore(tmp_path / "fleet.db", migrate=True)
    for i in range(6):
        s.register_machine(f"m{i}", address=f"10.0.0.{i + 1}", state=states.STANDBY)
    s.upsert_job("j", tp=2, pp=2, dp=2, ranks_per_machine=2, machines=["m0", "m1", "m2", "m3"], revision="r1")
    return s


def test_migrating_an_empty_database_gives_exactly_the_models_schema(tmp_path: Path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'a.db'}")
    assert migrate(engine) == list(range(1, LATEST + 1))
    assert migrate(engine) == []  # already there
    with engine.connect() as conn:
        ctx = MigrationContext.configure(conn, opts={
            "include_name": lambda name, kind, _parent: not (kind == "table" and name == VERSION_TABLE.name)})
        diff = compare_metadata(ctx, Base.metadata)
    assert diff == []


def test_a_database_newer_than_the_code_is_refused(tmp_path: Path):
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'b.db'}")
    migrate(engine)
    with engine.begin() as conn:
        conn.execute(VERSION_TABLE.insert().values(version=LATEST + 1, description="future", applied_ts=0.0))
    with pytest.raises(SchemaError, match="newer than this trainguard"):
        migrate(engine)


def test_a_bad_database_url_is_one_line(tmp_path: Path):
    with pytest.raises(FleetError, match="not usable"):
        FleetStore("nosuchdialect://x")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "fleet.db").mkdir()  # a directory where the file should be
    with pytest.raises(FleetError, match="cannot be opened"):
        FleetStore(tmp_path / "ro" / "fleet.db", migrate=True)


def test_only_provisioning_migrates_anywhere_else_an_old_schema_is_one_line_naming_the_command(tmp_path: Path):
    """Tasks, triggers and commands open the fleet database without migrating it: a database that is not
    there, or at an older schema, is refused with what to run; provisioning brings it up to date."""
    url = tmp_path / "fleet.db"
    with pytest.raises(FleetError, match="does not exist; provision it first: trainguard fleet migrate") as exc:
        FleetStore(url)
    assert exc.value.exit_code == 2 and not url.exists()  # nothing created by a reader
    engine = sa.create_engine(f"sqlite:///{url}")  # a fleet provisioned by the release before this one
    with engine.begin() as conn:
        VERSION_TABLE.create(conn)
    for version, description, step in MIGRATIONS[:-1]:
        with engine.begin() as conn:
            step(Operations(MigrationContext.configure(conn)))
            conn.execute(VERSION_TABLE.insert().values(version=version, description=description, applied_ts=0.0))
    engine.dispose()
    with pytest.raises(FleetError, match=f"schema version {LATEST - 1}, this trainguard needs {LATEST}; run: "
                                         f"trainguard fleet migrate"):
        FleetStore(url)
    FleetStore(url, migrate=True).close()  # provisioning applies the missing migration
    assert FleetStore(url).jobs() == []


def test_opening_the_fleet_database_imports_no_migration_machinery(tmp_path: Path):
    """A task that opens (never migrates) the fleet database does not pay for importing Alembic; only
    provisioning does."""
    import subprocess
    import sys

    FleetStore(tmp_path / "fleet.db", migrate=True).close()
    code = ("import sys; from trainguard.operators.fleet import FleetStore; FleetStore(sys.argv[1]).jobs(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('alembic', 'mako')))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "fleet.db")], capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_machine_states_follow_the_state_machine_and_repeats_are_no_ops(store: FleetStore):
    assert store.machine("m0").state == states.ACTIVE and store.machine("m0").job == "j"
    assert store.transition("m0", states.SUSPECT, reason="xid 79") is True
    assert store.transition("m0", states.SUSPECT, reason="xid 79") is False  # already suspect
    with pytest.raises(FleetError, match="cannot go from suspect to standby"):
        store.transition("m0", states.STANDBY, reason="no")
    assert store.machine("m0").state == states.SUSPECT  # the refused change left nothing behind
    store.transition("m0", states.EVICTED, reason="evicted from j: xid")
    store.transition("m0", states.REPAIR, reason="ticket")
    store.transition("m0", states.SELF_CHECK, reason="repaired")
    store.transition("m0", states.STANDBY, reason="self-check passed (L2)", checked=True)
    m0 = store.machine("m0")
    assert m0.evictions == 1 and m0.job is None and m0.checked_ts is not None
    assert [(e.from_state, e.to_state) for e in store.events("m0")] == [
        (None, "standby"), ("standby", "active"), ("active", "suspect"), ("suspect", "evicted"),
        ("evicted", "repair"), ("repair", "self_check"), ("self_check", "standby")]
    with pytest.raises(FleetError, match="not in the fleet database"):
        store.transition("m9", states.ACTIVE, reason="x")
    assert store.register_machine("m0") is False  # known: left as it is
    assert store.machine("m0").state == states.STANDBY


def test_an_inventory_of_12500_machines_registers_in_one_transaction_and_again_is_a_no_op(store: FleetStore):
    import sqlalchemy as sa

    m0 = store.machine("m0")
    commits = []
    sa.event.listen(store.engine, "commit", lambda conn: commits.append(1))
    machines = [(f"n{i}", "10.1.0.1", states.STANDBY, "from the inventory") for i in range(12_500)]
    machines.append(("m0", "10.9.9.9", states.ACTIVE, "from the inventory"))  # known: left as it is
    machines.append(("n7", "10.1.0.1", states.STANDBY, "listed twice"))
    added = store.register_machines(machines)
    assert added == [f"n{i}" for i in range(12_500)] and len(commits) == 1
    assert (store.machine("m0").state, store.machine("m0").address) == (m0.state, m0.address)
    assert [(e.to_state, e.reason) for e in store.events("n7")] == [("standby", "from the inventory")]
    assert store.register_machines(machines) == []
    with pytest.raises(FleetError, match="unknown machine state 'broken'"):
        store.register_machines([("x", "", "broken", "")])


def test_a_swap_is_one_transaction_and_idempotent(store: FleetStore):
    inc, _ = store.open_incident("j", [{"id": "a1", "kind": "gpu_lost", "machine": "m1", "ts": 1.0}])
    assert store.swap("j", {"m1": "m4"}, reason="gpu_lost", incident_id=inc.id) == {"m1": "m4"}
    assert store.job("j").machine_list == ["m0", "m4", "m2", "m3"]  # same node rank
    assert store.machine("m1").state == states.EVICTED and store.machine("m1").job is None
    assert store.machine("m4").state == states.ACTIVE and store.machine("m4").job == "j"
    assert store.swap("j", {"m1": "m4"}, reason="gpu_lost") == {}  # again: nothing
    assert store.machine("m1").evictions == 1
    # a replacement that is not a standby refuses the whole swap; the first pair is not half-done
    with pytest.raises(FleetError, match="m0 cannot replace m2"):
        store.swap("j", {"m3": "m5", "m2": "m0"}, reason="x")
    assert store.job("j").machine_list == ["m0", "m4", "m2", "m3"]
    assert store.machine("m3").state == states.ACTIVE and store.machine("m5").state == states.STANDBY
    assert store.evicted_recently("j", 3600) == {"m1"}


def test_two_controllers_swapping_the_same_machine_evict_it_once(store: FleetStore):
    results: list[object] = []

    def swap(new: str) -> None:
        try:
            results.append(store.swap("j", {"m2": new}, reason="race"))
        except FleetError as exc:
            results.append(exc)

    threads = [threading.Thread(target=swap, args=(n,)) for n in ("m4", "m5")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wins = [r for r in results if isinstance(r, dict) and r]
    assert len(wins) == 1, results  # the other found m2 already replaced (an error or a no-op)
    assert store.machine("m2").evictions == 1
    order = store.job("j").machine_list
    assert order[2] in ("m4", "m5") and sorted(m.name for m in store.machines(state=states.STANDBY)) == \
        sorted({"m4", "m5"} - {order[2]})


def test_alerts_join_the_open_incident_and_a_recurrence_escalates(tmp_path: Path):
    now = [1000.0]
    store = FleetStore(tmp_path / "f.db", clock=lambda: now[0], migrate=True)
    store.register_machine("m0")
    store.upsert_job("j", tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["m0"])
    a, opened = store.open_incident("j", [{"id": "x1", "kind": "rank_exit", "machine": "m0", "ts": 995.0}])
    b, opened2 = store.open_incident("j", [{"id": "x1", "kind": "rank_exit", "ts": 995.0},
                                           {"id": "x2", "kind": "rank_exit", "machine": "m1", "ts": 996.0}])
    assert opened and not opened2 and a.id == b.id and a.level == 0 and a.first_alert_ts == 995.0
    assert [x.id for x in store.alerts_of(a.id)] == ["x1", "x2"]  # x1 once
    assert store.known_alerts(["x1", "x9"]) == {"x1"}
    store.update_incident(a.id, state="resolved", resumed_ts=1008.0, closed_ts=1010.0)
    store.update_incident(a.id, closed_ts=1011.0)  # the first time a milestone is reached counts
    assert store.incident(a.id).closed_ts == 1010.0
    now[0] = 1100.0  # fails again 90 s after the recovery: one level up
    c, opened3 = store.open_incident("j", [{"id": "x3", "kind": "rank_exit", "ts": 1100.0}], escalation_window_s=600)
    assert opened3 and c.id != a.id and c.level == 1
    with pytest.raises(FleetError, match="not one of"):
        store.update_incident(c.id, state="closed-ish")
    store.update_incident(c.id, state="resolved", closed_ts=1100.0)
    now[0] = 1100.0 + 601  # long after: a fresh failure
    d, _ = store.open_incident("j", [{"id": "x4", "kind": "rank_exit", "ts": now[0]}], escalation_window_s=600)
    assert d.level == 0
    # the failure's own time counts: alerts from 30 s after the recovery, recorded only 700 s later
    store.update_incident(d.id, state="resolved", resumed_ts=now[0] + 5, closed_ts=now[0] + 6)
    failed_at, now[0] = now[0] + 35, now[0] + 700
    e, _ = store.open_incident("j", [{"id": "x5", "kind": "rank_exit", "ts": failed_at}], escalation_window_s=600)
    assert e.level == 1


def test_an_incident_closed_without_a_recovery_does_not_escalate_the_next(tmp_path: Path):
    now = [1000.0]
    store = FleetStore(tmp_path / "f.db", clock=lambda: now[0], migrate=True)
    store.register_machine("m0")
    store.upsert_job("j", tp=1, pp=1, dp=1, ranks_per_machine=1, machines=["m0"])
    a, _ = store.open_incident("j", [{"id": "s1", "kind": "rank_slow", "ts": 999.0}])
    store.update_incident(a.id, state="resolved", closed_ts=1040.0)  # a passing slowdown: nothing done
    now[0] = 1050.0
    b, _ = store.open_incident("j", [{"id": "n1", "kind": "nan_loss", "ts": 1050.0}], escalation_window_s=600)
    assert b.level == 0
    store.update_incident(b.id, state="failed", closed_ts=1060.0)  # a failed recovery does count
    c, _ = store.open_incident("j", [{"id": "n2", "kind": "nan_loss", "ts": 1070.0}], escalation_window_s=600)
    assert c.level == 1


def test_a_run_that_closes_late_leaves_what_a_person_or_a_resubmit_decided(store: FleetStore):
    """An incident closed by hand (``trainguard incident close``) while its tg_incident run still acted was closed
    again ``resolved`` by that run, over the person's verdict; a late wait for a human set the resubmitted job to
    ``waiting_human``."""
    a, _ = store.open_incident("j", [{"id": "h1", "kind": "rank_hang", "machine": "m1", "ts": 1.0}])
    store.close_by_hand(a.id, "m1 pulled for a look")
    assert store.close_open(a.id, "resolved", summary="resumed at step 9", closed_ts=5.0) is False
    inc = store.incident(a.id)
    assert inc.state == "failed" and inc.summary == "closed by hand: m1 pulled for a look"
    out = store.wait_for_human(a.id, "the breaker refused the eviction")
    assert out["waiting_human"] and "was closed (failed)" in out["reason"]
    assert store.incident(a.id).state == "failed" and store.job("j").state == "running"
    b, _ = store.open_incident("j", [{"id": "c1", "kind": "rank_exit", "machine": "m1", "ts": 9.0}])
    assert b.id != a.id
    assert store.close_open(b.id, "resolved", resumed_ts=12.0, closed_ts=13.0, lost_steps=1) is True
    inc = store.incident(b.id)
    assert (inc.state, inc.resumed_ts, inc.lost_steps) == ("resolved", 12.0, 1)
    assert store.close_open(b.id, "failed") is False and store.incident(b.id).state == "resolved"  # a repeat: no-op
    with pytest.raises(FleetError, match="resolved or failed"):
        store.close_open(b.id, "open")


def test_actions_are_recorded_once_per_key(store: FleetStore):
    act, created = store.record_action("inc1:evict:m1", kind="evict", machines=["m1"], evidence={"xid": 79})
    again, created2 = store.record_action("inc1:evict:m1", kind="evict", machines=["m1"])
    assert created and not created2 and again.id == act.id and again.evidence == {"xid": 79}
    assert store.finish_action(act.id, "done", "m1 -> m4") is True
    assert store.finish_action(act.id, "failed") is False  # finished once
    assert store.actions()[0].outcome == "done"
    dry, _ = store.record_action("inc1:evict:m2", kind="evict", machines=["m2"], dry_run=True)
    assert dry.outcome == "dry_run"


def test_revisions_and_the_last_known_good(store: FleetStore):
    assert store.last_known_good("j") is None
    store.mark_known_good("j", "r1")
    assert store.record_revision("j", "r2", reason="hot fix") is True
    assert store.record_revision("j", "r2") is False
    assert store.set_revision("j", "r2", pending=True) is True
    assert store.job("j").pending_revision == "r2" and store.job("j").revision == "r1"
    assert store.set_revision("j", "r2") is True and store.set_revision("j", "r2") is False
    assert store.last_known_good("j", other_than="r2") == "r1"
    with pytest.raises(FleetError, match="no revision r9"):
        store.mark_known_good("j", "r9")


def test_checkpoints_and_ettr_events(store: FleetStore):
    assert store.record_checkpoint("j", 10) is True and store.record_checkpoint("j", 10) is False
    store.mark_checkpoint("j", 10, verified=False, problems=["m0 rank 1 local: sha256 mismatch"])
    assert store.checkpoints("j")[0].problems == ["m0 rank 1 local: sha256 mismatch"]
    store.add_ettr("j", "productive", 0.0, 10.0)
    with pytest.raises(FleetError, match="ends before it starts"):
        store.add_ettr("j", "lost_work", 5.0, 4.0)
    assert [e.kind for e in store.ettr_events("j")] == ["productive"]
    store.add_ettr("j", "productive", 0.0, 10.0)  # the same stretch again: kept once
    store.add_ettr("j", "productive", 10.0, 12.0)
    assert [(e.start_ts, e.end_ts) for e in store.ettr_events("j")] == [(0.0, 10.0), (10.0, 12.0)]


def test_the_eviction_breaker_counts_by_job_not_by_the_reasons_wording(tmp_path: Path):
    """It counted ``LIKE 'evicted from {job}:%'`` over free text: ``_`` in a job name is a wildcard, so the
    evictions of job ``axb`` counted against job ``a_b``."""
    s = FleetStore(tmp_path / "fleet.db", migrate=True)
    for i in range(6):
        s.register_machine(f"m{i}", address=f"10.0.0.{i + 1}", state=states.STANDBY)
    s.upsert_job("a_b", tp=1, pp=1, dp=2, ranks_per_machine=1, machines=["m0", "m1"], revision="r1")
    s.upsert_job("axb", tp=1, pp=1, dp=2, ranks_per_machine=1, machines=["m2", "m3"], revision="r1")
    s.swap("axb", {"m2": "m4"}, reason="evicted from a_b: a reason that names another job")
    assert s.evicted_recently("a_b", 60) == set()
    assert s.evicted_recently("axb", 60) == {"m2"}
    s.swap("a_b", {"m0": "m5"}, reason="xid 79")
    assert s.evicted_recently("a_b", 60) == {"m0"} and s.evicted_recently("axb", 60) == {"m2"}


def test_a_standby_is_marked_checked_by_its_check_not_by_the_words_of_its_reason(store: FleetStore):
    store.transition("m4", states.SELF_CHECK, reason="pool")
    store.transition("m4", states.STANDBY, reason="self-check passed (a reason worded by hand)")
    assert store.machine("m4").checked_ts is None
    store.transition("m5", states.SELF_CHECK, reason="pool")
    store.transition("m5", states.STANDBY, reason="L1, L2 and L3 ok", checked=True)
    assert store.machine("m5").checked_ts is not None


def _database_before(tmp_path: Path, version: int) -> sa.Engine:
    """A database as the release before migration ``version`` left it: the migrations before it applied."""
    from trainguard.operators.fleet import migrations

    engine = sa.create_engine(f"sqlite:///{tmp_path / 'old.db'}")
    with engine.begin() as conn:
        migrations.VERSION_TABLE.create(conn)
        ops = Operations(MigrationContext.configure(conn))
        for number, description, step in migrations.MIGRATIONS[:version - 1]:
            step(ops)
            conn.execute(VERSION_TABLE.insert().values(version=number, description=description, applied_ts=0.0))
    return engine


def test_migration_3_gives_events_recorded_before_it_their_job(tmp_path: Path):
    engine = _database_before(tmp_path, 3)
    with engine.begin() as conn:  # with a swap in it
        conn.execute(sa.text("INSERT INTO jobs VALUES ('a_b', 1, 1, 2, 1, '[]', 'running', 'r0', NULL, '[]', 0, 0)"))
        conn.execute(sa.text("INSERT INTO jobs VALUES ('a', 1, 1, 2, 1, '[]', 'running', 'r0', NULL, '[]', 0, 0)"))
        for machine in ("m0", "m1", "m2"):
            conn.execute(sa.text("INSERT INTO machines VALUES (:m, '', 'evicted', 0, NULL, '', 1, NULL)"),
                         {"m": machine})
        for i, (machine, reason) in enumerate([("m0", "evicted from a_b: xid 79"), ("m1", "replaces m0 in a_b"),
                                               ("m2", "evicted from a: lost"), ("m2", "sent to repair")]):
            conn.execute(sa.text("INSERT INTO machine_events (id, machine, from_state, to_state, ts, reason) "
                                 "VALUES (:i, :m, 'active', 'evicted', 0, :r)"),
                         {"i": i + 1, "m": machine, "r": reason})
    assert migrate(engine) == [3, 4, 5]
    with engine.connect() as conn:
        rows = conn.execute(sa.text("SELECT id, job FROM machine_events ORDER BY id")).all()
    assert [tuple(r) for r in rows] == [(1, "a_b"), (2, "a_b"), (3, "a"), (4, None)]


def test_only_a_failure_that_repeats_the_last_recovered_one_climbs(tmp_path: Path):
    """What the fleet database keeps of the last incident (its triage's category and machines) decides whether
    a failure soon after its recovery repeats it: a crash after a GPU eviction starts at 0, the crash again
    climbs; an incident closed before its triage is judged by its alerts."""
    now = [1000.0]
    store = FleetStore(tmp_path / "f.db", clock=lambda: now[0], migrate=True)
    for m in ("m0", "m1"):
        store.register_machine(m)
    store.upsert_job("j", tp=1, pp=1, dp=2, ranks_per_machine=1, machines=["m0", "m1"])
    lost, _ = store.open_incident("j", [{"id": "g1", "kind": "gpu_lost", "machine": "m0", "ts": 990.0}],
                                  escalation_window_s=600)
    assert store.relevel(lost.id, category="machine_fault", machines=["m0"], window_s=600) == 0
    store.update_incident(lost.id, state="resolved", resumed_ts=1000.0, closed_ts=1001.0)
    crash, _ = store.open_incident("j", [{"id": "c1", "kind": "rank_exit", "machine": "m1", "ts": 1060.0}],
                                   escalation_window_s=600)
    assert crash.level == 0  # the old rule: 1, and a rollback of good code
    store.update_incident(crash.id, state="resolved", resumed_ts=1100.0, closed_ts=1101.0)  # never triaged
    again, _ = store.open_incident("j", [{"id": "c2", "kind": "rank_exit", "machine": "m0", "ts": 1160.0}],
                                   escalation_window_s=600)
    assert again.level == 1
    # its triage found a NaN, not the crash again: another failure, and what the next one is compared with
    assert store.relevel(again.id, category="nan", machines=["m0"], window_s=600) == 0
    inc = store.incident(again.id)
    assert (inc.level, inc.category, inc.machines) == (0, "nan", ["m0"])


def test_migration_4_leaves_incidents_recorded_before_it_naming_no_machine(tmp_path: Path):
    engine = _database_before(tmp_path, 4)
    with engine.begin() as conn:
        conn.execute(sa.text("INSERT INTO jobs VALUES ('a', 1, 1, 2, 1, '[]', 'running', 'r0', NULL, '[]', 0, 0)"))
        conn.execute(sa.text("INSERT INTO incidents (id, job, state, category, level, opened_ts, first_alert_ts, "
                             "summary) VALUES (1, 'a', 'resolved', 'crash', 0, 0, 0, '')"))
    assert migrate(engine) == [4, 5]
    store = FleetStore(f"sqlite:///{tmp_path / 'old.db'}")
    assert store.incident(1).machines == [] and store.incident(1).category == "crash"


def test_migration_5_gives_jobs_recorded_before_it_the_reference_jobs_spec_they_ran(tmp_path: Path):
    from trainguard.operators.jobspec import REFERENCE_ENTRY, stored_spec

    engine = _database_before(tmp_path, 5)
    with engine.begin() as conn:  # a 3D job on 4 machines, one of them swapped out for now (3 listed)
        conn.execute(sa.text("INSERT INTO jobs VALUES ('a', 2, 2, 2, 2, '[\"m0\", \"m1\", \"m2\"]', 'running', "
                             "'r7', NULL, '[\"--checkpoint\", \"--steps\", \"9\"]', 0, 0)"))
    assert migrate(engine) == [5]
    spec = stored_spec(FleetStore(f"sqlite:///{tmp_path / 'old.db'}").job("a"))
    assert spec.command == [REFERENCE_ENTRY, "--checkpoint", "--steps", "9"] and spec.pass_layout
    assert (spec.machines, spec.processes_per_machine, spec.revision) == (4, 2, "r7")
    assert spec.topology().world_size == 8 and spec.is_reference


def test_every_public_call_of_the_store_and_its_parts_waits_out_an_unavailable_database():
    """The store's methods live in several classes (machines, jobs, incidents, ledger): each public one, wherever
    it is defined, is wrapped by the retry (a method left out would fail at the first restart of the database)."""
    import inspect

    from trainguard.operators.fleet.store import FleetStore

    public = {n for klass in FleetStore.__mro__[:-1] for n, f in vars(klass).items()
              if not n.startswith("_") and callable(f) and not isinstance(f, (staticmethod, classmethod))}
    assert {"incident", "transition", "submit_job", "add_ettr", "register_machine"} <= public  # from every part
    bare = sorted(n for n in public - {"close", "tx"}
                  if not hasattr(inspect.getattr_static(FleetStore, n), "__wrapped__"))
    assert bare == []
