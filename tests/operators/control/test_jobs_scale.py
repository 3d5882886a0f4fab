"""The resume check at fleet scale: rank 0's machine sends only the steps after the restart (read from the
tail of a history that may hold millions), and the round over every machine that asks whether the job ended
without a step is taken at most every EXITED_CHECK_S, not at each poll."""

from __future__ import annotations

import io
import json
import random
from pathlib import Path

import pytest

from tests.fakes import fleet_controller
from trainguard.node_tools import monitor
from trainguard.operators.control import jobs as jobs_mod


def _write(rd: Path, records: list[dict], *, torn: str = "") -> Path:
    path = monitor.steps_path(rd, 0)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) if isinstance(r, dict) else r for r in records]
    path.write_text("".join(line + "\n" for line in lines) + torn)
    return path


@pytest.mark.parametrize("seed", range(6))
def test_the_tail_read_gives_what_the_whole_read_filtered_gives(tmp_path, seed):
    rng = random.Random(seed)
    records: list = []
    ts = 1000.0
    for step in range(rng.randint(0, 3000)):
        ts += rng.uniform(0.01, 2.0)
        records.append({"step": step, "incarnation": step // 700, "ts": round(ts, 3), "step_time_s": 0.5,
                        "pad": "x" * rng.randint(0, 300)})
        if rng.random() < 0.01:
            records.append("")  # a blank line
    torn = '{"step": 99999, "ts": 1e12, "step_ti' if seed % 2 else ""
    _write(tmp_path, records, torn=torn)
    whole = monitor.read_steps(tmp_path, 0)
    for since in [0.0, 999.0, ts + 1, *(rng.uniform(1000.0, ts) for _ in range(20))]:
        want = [r for r in whole if r["ts"] > since]
        for block in (64, 4096, 1 << 16):
            assert monitor.read_steps_since(tmp_path, 0, since, block=block) == want


def test_the_tail_read_of_a_long_history_reads_only_its_end(tmp_path, monkeypatch):
    records = [{"step": s, "incarnation": 0, "ts": 1000.0 + s, "step_time_s": 1.0} for s in range(50_000)]
    path = _write(tmp_path, records)
    read = {"bytes": 0}
    real_open = open

    class Counting(io.BufferedReader):
        def read(self, n: int = -1) -> bytes:
            data = super().read(n)
            read["bytes"] += len(data)
            return data

    def counting_open(file, mode="r", *args, **kwargs):
        if Path(file) == path and "b" in mode:
            return Counting(io.FileIO(file, "rb"))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", counting_open)
    got = monitor.read_steps_since(tmp_path, 0, 1000.0 + 49_990)
    assert [r["step"] for r in got] == list(range(49_991, 50_000))
    assert read["bytes"] <= 1 << 16 < path.stat().st_size // 20  # one block of a 3 MB history


@pytest.mark.parametrize("seed", range(6))
def test_the_agent_finds_an_incarnations_first_record_from_the_end_as_a_whole_scan_would(tmp_path, seed):
    """The agent's rank check scanned a rank's whole history for the start of a new incarnation, on every restart:
    200,000 records at 8 ms steps after half an hour, parsed on the machine while the job restarted."""
    from trainguard.node_tools.rankcheck import _offset_of_incarnation

    rng = random.Random(seed)
    records: list = []
    for step in range(rng.randint(0, 2000)):
        records.append({"step": step, "incarnation": step // 600, "ts": 1000.0 + step, "pad": "x" * rng.randint(0, 90)})
        if rng.random() < 0.01:
            records.append("")  # a blank line
    torn = '{"step": 99999, "incarnation": 9, "ts' if seed % 2 else ""
    path = _write(tmp_path, records, torn=torn)
    data = path.read_bytes()
    complete = data[: data.rfind(b"\n") + 1]
    newest = max((r["incarnation"] for r in records if isinstance(r, dict)), default=0)
    for inc in (newest, newest + 1):  # the agent asks for the job's current one: the newest, or one not begun yet
        offset, want = 0, None
        for line in complete.splitlines(keepends=True):  # the whole scan, from the start
            if line.strip() and json.loads(line).get("incarnation") == inc:
                want = offset
                break
            offset += len(line)
        want = len(complete) if want is None else want  # none yet: where its first record will begin
        for block in (16, 300, 1 << 16):
            got = _offset_of_incarnation(path, inc, block=block)
            assert got == want, (inc, block)
            if want < len(complete):
                assert json.loads(complete[got:].split(b"\n")[0])["incarnation"] == inc
    assert _offset_of_incarnation(tmp_path / "none.jsonl", 0) == 0


def test_a_restart_wait_asks_every_machine_at_most_every_exited_check_s(tmp_path, monkeypatch):
    c, fake = fleet_controller(tmp_path)
    clock = {"now": 5000.0}
    monkeypatch.setattr(jobs_mod.time, "monotonic", lambda: clock["now"])
    fake.records = []  # rank 0 has run no step since the restart

    def rounds() -> int:
        return len(fake.sent("job", "status"))

    before = rounds()
    for _ in range(5):  # five polls within a second
        assert c.resumed("j", restart_ts=1e12) is None
        clock["now"] += 0.2
    assert rounds() - before == 4  # one round: one status per machine of the job
    clock["now"] += jobs_mod.EXITED_CHECK_S
    assert c.resumed("j", restart_ts=1e12) is None
    assert rounds() - before == 8  # the next round, once the interval passed
    steps_asked = [argv for _m, argv in fake.commands if argv[:2] == ["job", "steps"]]
    assert steps_asked and all("--since-ts" in argv for argv in steps_asked)


def test_questions_about_a_storms_incident_load_only_the_alerts_they_ask_about(tmp_path):
    """An incident of an NCCL hang holds an alert from every rank. The resume wait asks every second for
    explicit machine faults among them, the hang analysis for the stopped ranks and the first to stall: none
    of them loads the storm."""
    import sqlalchemy as sa

    from tests.fakes import alert
    from trainguard.operators.fleet.models import Alert

    c, _fake = fleet_controller(tmp_path)
    t0 = 1_000_000.0
    storm = [alert("rank_hang", f"m{i % 4}", rank=i % 4, ts=t0 + i * 1e-4) for i in range(20_000)]
    storm.append(alert("gpu_lost", "m2", ts=t0 + 5))
    storm.append(alert("rank_stopped", "m1", rank=1, ts=t0 + 6))
    [opened] = c.ingest(storm)
    incident = opened["incident"]
    loaded = []
    sa.event.listen(Alert, "load", lambda target, _ctx: loaded.append(target.kind))
    assert c.unhandled_faults(incident) == {"m2": "gpu_lost"}
    assert loaded == ["gpu_lost"]
    loaded.clear()
    stops = c.fleet.alerts_of(incident, kinds={"rank_stopped"})
    firsts = c.fleet.alerts_of(incident, kinds={"rank_hang"}, limit=64)
    assert [a.rank for a in stops] == [1] and firsts[0].ts == t0 and firsts[0].rank == 0
    assert len(loaded) == 65
