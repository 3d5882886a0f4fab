"""Scale benchmark of the guardian's ingest: an alert burst from every rank of one large job (an NCCL hang: all
ranks time out together) recorded into the fleet database.

A fleet of 12,500 machines (a SQLite fleet database in a temporary folder, every machine serving one job of
100,000 ranks) receives ``size`` schema-valid ``rank_hang`` alerts spread over all its machines, with the
heartbeats of all their agents, as one trigger event (``guardian_ingest_s``) or as ten events of a tenth each
(``guardian_ingest_10_batches_s``). What is timed is what the guardian does with the event(s):
:func:`trainguard.operators.tasks.guardian.group_alerts` (the alerts attached to the job's one incident, the bus cursor
and the agents' liveness recorded, in one transaction per event).

    python bench/scale_ingest.py [SIZE ...]

prints the seconds of one run per case and size (a quick self-check; the scale harness imports ``CASES``).
"""

from __future__ import annotations

import sys
import tempfile
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.node_tools.alerts import Alert
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.operators.control import ControlConfig, Controller
from trainguard.operators.fleet import states
from trainguard.operators.fleet.models import Machine as FleetMachine
from trainguard.operators.fleet.models import MachineEvent

MACHINES = 12_500
TP, PP, DP, RANKS_PER_MACHINE = 8, 10, 1250, 8  # 100,000 ranks, 8 per machine
JOB = "big"
SIZES = [1_000, 10_000, 100_000]


def _fleet(folder: Path) -> Controller:
    """A controller over an inventory of ``MACHINES`` machines, all serving job ``JOB`` in the fleet database.
    The machines are registered in one transaction (the rows :meth:`FleetStore.register_machine` writes, which
    one at a time would take most of the set-up's time); the job is recorded as ever."""
    names = [f"m{i:05d}" for i in range(MACHINES)]
    inv = Inventory(cluster="scale", transport="local", bus_url=f"spool://{folder / 'bus'}",
                    machines=[Machine(name=n, address=f"10.{i // 62500}.{i // 250 % 250}.{i % 250 + 1}")
                              for i, n in enumerate(names)])
    inv.save(folder / "inventory.json")
    c = Controller(ControlConfig(fleet_url=str(folder / "fleet.db"), inventory=str(inv.path)), inventory=inv)
    now = time.time()
    with c.fleet.tx() as s:
        s.add_all([FleetMachine(name=m.name, address=m.address, state=states.STANDBY, state_since=now,
                                reason="from the inventory (role active)", evictions=0) for m in inv.machines])
        s.add_all([MachineEvent(machine=n, from_state=None, to_state=states.STANDBY, ts=now,
                                reason="from the inventory (role active)") for n in names])
    c.fleet.upsert_job(JOB, tp=TP, pp=PP, dp=DP, ranks_per_machine=RANKS_PER_MACHINE, machines=names)
    return c


def _events(size: int, batches: int) -> list[dict[str, Any]]:
    """``size`` rank_hang alerts from every machine (rank ``i`` on machine ``i // 8``, spread over all
    machines), read off the bus as the trigger reads them, in ``batches`` trigger events."""
    now = time.time()
    docs = []
    for i in range(size):
        rank = i * (TP * PP * DP) // size
        machine = f"m{rank // RANKS_PER_MACHINE:05d}"
        a = Alert("rank_hang", machine, job=JOB, rank=rank, ts=now + i * 1e-5,
                  evidence={"step": 1234, "waited_s": 600.0, "collective": "all_reduce"})
        a.received_ts = a.ts + 0.5
        a.bus_name = f"{int(a.ts * 1e9):020d}-{machine}-{a.id}.json"
        docs.append(a.record())
    # the trigger's event carries what it saw of every watched agent's heartbeat: all machines of the job
    liveness = {f"m{i:05d}": {"token": f"{now - 2.0:.6f}", "changed_ts": now - 1.0, "reported_ts": None}
                for i in range(MACHINES)}
    per = -(-size // batches)
    out = []
    for b in range(batches):
        part = docs[b * per:(b + 1) * per]
        out.append({"alerts": part, "first_seen_ts": now, "fired_ts": now + 3.0, "reader": "guardian",
                    "read": {d["bus_name"]: d["received_ts"] for d in part}, "gone": [], "quarantined": [],
                    "liveness": liveness})
    return out


def _prepare(batches: int) -> Callable[[int], Callable[[], Any]]:
    def prepare(size: int) -> Callable[[], Any]:
        from trainguard.operators.tasks.guardian import group_alerts

        tmp = tempfile.TemporaryDirectory(prefix="tg-scale-ingest-")
        c = _fleet(Path(tmp.name))
        events = _events(size, batches)

        def run() -> int:
            starts = [s for e in events for s in group_alerts(c, e)]
            return len(starts)  # runs to start: one (the job's one incident)

        weakref.finalize(run, lambda: (c.fleet.close(), tmp.cleanup()))
        return run

    return prepare


CASES: dict[str, tuple[Callable[[int], Callable[[], Any]], list[int]]] = {
    "guardian_ingest_s": (_prepare(1), SIZES),
    "guardian_ingest_10_batches_s": (_prepare(10), SIZES),
}


def main(argv: list[str]) -> int:
    sizes = [int(a) for a in argv] or SIZES
    for metric, (prepare, _) in CASES.items():
        for size in sizes:
            run = prepare(size)
            t0 = time.perf_counter()
            result = run()
            print(f"{metric} size={size}: {time.perf_counter() - t0:.3f} s (runs to start: {result})", flush=True)
            del run
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
