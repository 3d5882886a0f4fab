"""Scale benchmark of the alert bus in an alert storm: an NCCL hang makes every rank of a 100,000-rank job
alert at once.

``size`` schema-valid ``rank_hang`` alerts from the machines of a 12,500-machine fleet (``size`` / 12,500 ranks
a machine, at least one; 10,000 alerts come from 10,000 machines), stamped over 5 s by their writers' clocks
(one machine's clock an hour ahead, one an hour behind), are published on a spool bus (a temporary folder) or
an S3 bus (a ``moto_server`` on loopback, started for the run and ended when the process exits). Each machine
publishes its alerts as its agent does: one batch document for its ranks (``.spool_single`` and
``.s3_single``: one object per alert, as agents before batching did). Publishing is untimed.

``bus_storm_read_s``
    what the alert watcher does (:class:`trainguard.operators.triggers.alerts.AlertTrigger`, its cursor in a fleet
    database, the default settle window and poll) until its first event, holding alerts of the job, is ready:
    this bounds how soon the incident can open.
``bus_storm_drain_s``
    the watcher until every alert of the storm was delivered in its events, batch after batch (the recording
    itself, the fleet database's part, left out: each batch's names count as recorded at once).
``bus_idle_poll_s``
    one poll of the watcher with nothing new, after the storm (published one object per alert) was read and
    recorded and the retention removed it from the folder; ``.unretained``: before the retention ran (the
    folder still holds every name it read). ``.s3``: the same on S3.

    python bench/scale_bus.py [METRIC ...] [SIZE ...]

prints the seconds of one run per case and size (a quick self-check; the scale harness imports ``CASES``).
S3 on moto: every call costs moto's CPU on the same two cores (a LIST of 1,000 names about 0.5 s at 10,000
objects, a GET about 3 ms), far slower than S3 itself.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trainguard.node_tools.alerts import Alert
from trainguard.node_tools.bus import ALERTS, AlertBus, open_bus
from trainguard.operators.fleet import FleetStore
from trainguard.operators.settings import DEFAULT_SETTLE_S
from trainguard.operators.triggers.alerts import DEFAULT_POLL_S, AlertTrigger, _Watch

MACHINES = 12_500
JOB = "big"
STORM_S = 5.0
SIZES = [10_000, 100_000]
PUBLISHERS = 16
_MOTO: dict[str, Any] = {}


def _folder() -> Path:
    folder = Path(tempfile.mkdtemp(prefix="tg-scale-bus-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


def _die_with_parent() -> None:
    """In moto_server's process before it starts: the kernel ends it when this process ends, however it ends
    (a harness that kills a trial on its time limit runs no exit handler)."""
    import ctypes
    import signal

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG (Linux)


def _moto() -> str:
    """The endpoint of this process's moto_server (started on first use, ended when the process exits)."""
    if "url" in _MOTO:
        return _MOTO["url"]
    from trainguard.emulation.standalone import free_port

    port = free_port()
    proc = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_die_with_parent)

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    atexit.register(stop)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            with urllib.request.urlopen(url, timeout=1):
                break
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("moto_server did not answer") from None
            time.sleep(0.1)
    for k, v in (("AWS_ACCESS_KEY_ID", "testing"), ("AWS_SECRET_ACCESS_KEY", "testing"),
                 ("AWS_DEFAULT_REGION", "us-east-1")):
        os.environ.setdefault(k, v)
    _MOTO["url"] = url
    return url


def _bus_url(backend: str, folder: Path) -> str:
    if backend == "spool":
        return f"spool://{folder / 'bus'}"
    import boto3

    endpoint = _moto()
    bucket = f"tg-bench-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket=bucket)
    return f"s3://{bucket}/fleet?endpoint_url={endpoint}"


def _machine_alerts(i: int, machines: int, per: int, t0: float) -> list[Alert]:
    """Machine ``i``'s rank alerts, stamped by its own clock (machine 0's an hour ahead, machine 1's behind)."""
    skew = 3600.0 if i == 0 else -3600.0 if i == 1 else 0.0
    ts = t0 + STORM_S * i / machines + skew
    return [Alert("rank_hang", f"m{i:05d}", job=JOB, rank=i * per + r, ts=ts + r * 1e-4,
                  evidence={"step": 48_213, "silent_s": 612.5, "collective_seq": 9_214, "op": "all_reduce",
                            "message": "no progress (step or collective) for 612.5 s"})
            for r in range(per)]


def publish_storm(bus: AlertBus, size: int, *, batched: bool) -> int:
    """Publish ``size`` alerts from ``min(size, MACHINES)`` machines, each machine's as its agent does
    (``batched``: one document for its ranks; else one object per alert); returns the objects written."""
    machines = min(size, MACHINES)
    per = size // machines
    t0 = time.time() - STORM_S

    def one(i: int) -> int:
        alerts = _machine_alerts(i, machines, per, t0)
        if not batched:
            for a in alerts:
                bus.publish(a)
            return len(alerts)
        objects = 0
        while alerts:
            _name, count = bus.publish_batch(alerts)
            alerts, objects = alerts[count:], objects + 1
        return objects

    with ThreadPoolExecutor(PUBLISHERS) as pool:
        return sum(pool.map(one, range(machines)))


def _storm(backend: str, size: int, *, batched: bool = True) -> tuple[str, FleetStore]:
    """The bus holding the storm, and the fleet database holding the guardian's (empty) cursor, with what a
    triggerer that has run before holds already: the modules the trigger imports as it starts, the process's
    engine of the fleet database."""
    from trainguard.operators.hooks.fleet import fleet_store
    from trainguard.operators.policy import liveness  # noqa: F401

    folder = _folder()
    url = _bus_url(backend, folder)
    publish_storm(open_bus(url), size, batched=batched)
    fleet = FleetStore(folder / "fleet.db", migrate=True)
    fleet_store(fleet.url).cursor("guardian")
    return url, fleet


async def first_event(trigger: AlertTrigger) -> dict[str, Any]:
    """The payload of the trigger's first event (the run is closed after it)."""
    run = trigger.run()
    try:
        return (await run.__anext__()).payload
    finally:
        await run.aclose()


def storm_read(backend: str, *, batched: bool = True) -> Callable[[int], Callable[[], int]]:
    def prepare(size: int) -> Callable[[], int]:
        url, fleet = _storm(backend, size, batched=batched)

        def run() -> int:
            event = asyncio.run(first_event(AlertTrigger(url, fleet.url, settle_s=DEFAULT_SETTLE_S,
                                                          poll_s=DEFAULT_POLL_S)))
            if not any(a["job"] == JOB for a in event["alerts"]):
                raise RuntimeError("the first event holds no alert of the job")
            return len(event["alerts"])
        return run
    return prepare


def storm_drain(backend: str, *, batched: bool = True) -> Callable[[int], Callable[[], int]]:
    def prepare(size: int) -> Callable[[], int]:
        url, fleet = _storm(backend, size, batched=batched)

        async def drain() -> int:
            delivered = 0
            events = AlertTrigger(url, fleet.url, settle_s=DEFAULT_SETTLE_S, poll_s=DEFAULT_POLL_S, silent_s=0).run()
            try:
                while delivered < size:
                    event = (await events.__anext__()).payload
                    delivered += len(event["alerts"])
            finally:
                await events.aclose()
            return delivered

        def run() -> int:
            delivered = asyncio.run(drain())
            if delivered != size:
                raise RuntimeError(f"{delivered} of {size} alerts delivered")
            return delivered
        return run
    return prepare


def idle_poll(backend: str, *, retained: bool) -> Callable[[int], Callable[[], int]]:
    def prepare(size: int) -> Callable[[], int]:
        url, fleet = _storm(backend, size, batched=False)
        watch = _Watch(url, fleet.url, "guardian", folder=ALERTS, silent_s=0.0, skew_s=60.0)
        read = 0
        while True:  # the storm read and recorded, batch by batch
            got = watch.poll(tidy=False)
            event = watch.event(got, time.time())
            fleet.advance_cursor("guardian", event["read"], event["gone"])  # what the recording task commits
            read += len(got)
            if not watch.reader.more:
                break
        if read != size:
            raise RuntimeError(f"read {read} of {size} alerts")
        watch.refresh()  # the watcher read the committed cursor again (every few seconds)
        if retained:  # what the recording task's retention does once the names are older than it
            names = list(fleet.cursor("guardian"))
            done = open_bus(url).retire(names)
            fleet.advance_cursor("guardian", {}, done)
            watch.refresh()
        watch.poll(tidy=False)  # the fleet database's periodic reads (the watched machines) done: not due again

        def run() -> int:
            new = watch.poll(tidy=False)
            if new:
                raise RuntimeError(f"an idle poll found {len(new)} alerts")
            return len(watch.reader.seen)  # names still listed by every poll
        return run
    return prepare


CASES: dict[str, tuple[Callable[[int], Callable[[], Any]], list[int]]] = {
    "bus_storm_read_s.spool": (storm_read("spool"), SIZES),
    "bus_storm_read_s.s3": (storm_read("s3"), SIZES),
    "bus_storm_drain_s.spool": (storm_drain("spool"), SIZES),
    "bus_storm_drain_s.s3": (storm_drain("s3"), SIZES),
    "bus_storm_read_s.spool_single": (storm_read("spool", batched=False), SIZES),
    "bus_storm_drain_s.spool_single": (storm_drain("spool", batched=False), SIZES),
    "bus_storm_read_s.s3_single": (storm_read("s3", batched=False), [10_000]),
    "bus_idle_poll_s": (idle_poll("spool", retained=True), SIZES),
    "bus_idle_poll_s.unretained": (idle_poll("spool", retained=False), SIZES),
    "bus_idle_poll_s.s3": (idle_poll("s3", retained=True), [10_000]),
    "bus_idle_poll_s.s3_unretained": (idle_poll("s3", retained=False), [10_000]),
}


def main(argv: list[str]) -> int:
    sizes = [int(a) for a in argv if a.isdigit()]
    names = [a for a in argv if not a.isdigit()] or list(CASES)
    for name in names:
        prepare, case_sizes = CASES[name]
        for size in sizes or case_sizes:
            began = time.perf_counter()
            run = prepare(size)
            prepared = time.perf_counter() - began
            t0 = time.perf_counter()
            result = run()
            print(f"{name} {size}: {time.perf_counter() - t0:.3f} s (result {result}; prepared in {prepared:.1f} s)",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
