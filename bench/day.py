"""A day in the life of a job, through ``trainguard controlplane up``'s defaults and the command line alone, as its
docs tell a new user: for a program trainguard's authors did not write, and for the three programs in
``examples/``.

``--programs stranger`` (the default): ``bench/stranger/train.py``, Lightning's own ``BoringModel`` fitted by
Lightning's own loop with DDP on 2 machines (1 rank each), gradient accumulation over 2 micro-batches, its own
validation every 200 batches, steps of a few milliseconds, a resumable loader, and one ``TrainguardCallback``.
``--programs examples``: ``examples/plain``, ``examples/lightning`` and ``examples/hf`` as they are, each a job of
its own on one control plane (12 machines, 3 of them warm standbys), paced to 0.2 s steps so that the three share
the host's 2 cores; ``bench/record_samples.py`` writes down the samples each step trains without editing them.
Each job's spec asks for one standby, so the circuit breaker allows it one eviction an hour.

The day, each step by a ``trainguard`` command as a person would type it:

1. ``--healthy-s`` seconds of healthy training (all jobs at once): every incident that opens is a false alarm;
2. a rank crashes: back without a human;
3. a straggler (one rank sleeping 30% of a step before each step) opens a fail-slow vote, and while it votes, a GPU
   of the straggler's machine is lost: the fault takes the incident over, the machine is swapped for the standby;
4. a rank hangs once the breaker's allowance is used up: its eviction is refused and the incident waits for a
   human, who closes it with ``trainguard incident close N``;
5. the job is stopped (``trainguard job stop``) and submitted again (``trainguard job submit``);
6. a rank crashes again: back without a human.

With several jobs, steps 2-6 run job by job while the others train on. Then each job's ETTR (``trainguard ettr``)
and every sample it trained, by index: across every restore, the resubmit's included, no sample of a finished
epoch is trained twice or skipped, and no step is lost but the ones after the newest checkpoint. An incident that
none of the day's faults opened counts as a false alarm (``incidents_not_caused``).

    python bench/day.py --out bench/results/day.json                                # 30 min healthy, then faults
    python bench/day.py --programs examples --out bench/results/day_examples.json   # the three examples
    python bench/day.py --quick                             # 90 s healthy (tests/e2e/test_day.py runs 30 s)
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import stop_on_sigterm, write_result

REPO = Path(__file__).resolve().parent.parent
NAME, SUBNET = "tgday", "10.213.46.0/24"
FINAL = ("resolved", "failed", "waiting_human")
EXAMPLE_PACE_S = "0.2"  # the examples' --step-time-s: three jobs share the host's 2 cores


@dataclass(frozen=True)
class Program:
    """A program the day runs: its files (name in the job's folder -> file of this repository), its command (the
    records' folder filled in), and what its records hold."""

    job: str
    files: dict[str, str]
    command: tuple[str, ...]
    samples: int  # one epoch
    micro: int  # micro-batches a step (records a step)
    straggle_s: float  # the straggler's sleep before each step: 30% of the program's step or more
    step_max_s: float | None = None  # the program's steps are shorter than this (the third-party program)


def _example(name: str, samples: int, straggle_s: float) -> Program:
    return Program(name, {"train.py": f"examples/{name}/train.py", "record_samples.py": "bench/record_samples.py"},
                   ("record_samples.py", "--program", name, "--record", "{record}", "--", "--steps", "0",
                    "--step-time-s", EXAMPLE_PACE_S), samples, 1, straggle_s)


PROGRAMS = {
    # 4096 samples: 512 optimizer steps of 2 micro-batches of 2 samples on each of 2 ranks; steps of a few ms
    "stranger": Program("boring", {"train.py": "bench/stranger/train.py"},
                        ("train.py", "--samples", "4096", "--record", "{record}"), 4096, 2, 0.03, 0.02),
    "plain": _example("plain", 4096, 0.06),  # 64 steps of 32 samples on each of 2 ranks (record_samples.py)
    "lightning": _example("lightning", 2048, 0.08),  # 128 steps of 8 sequences on each of 2 ranks
    "hf": _example("hf", 2048, 0.07),
}


class DayError(AssertionError):
    """A step of the day did not go as a person would expect (the message says which and what was seen)."""


class Plane:
    """The control plane of ``trainguard controlplane up`` in ``home`` (``$TG_HOME``), driven by its command line."""

    def __init__(self, home: Path, *, log: Callable[[str], None] = print, name: str = NAME,
                 subnet: str = SUBNET) -> None:
        self.home, self.log, self.name, self.subnet = home, log, name, subnet
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("TG_") or k == "TG_TEST_SESSION"}
        self.env["TG_HOME"] = str(home)
        self.fleet: Any = None

    def cli(self, *args: str, timeout: float = 600, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([sys.executable, "-m", "trainguard.operators.cli", *args], env=self.env, cwd=self.home,
                              capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode:
            raise DayError(f"'trainguard {' '.join(args)}' exited {proc.returncode}: "
                           f"{(proc.stderr or proc.stdout).strip()[-2000:]}")
        return proc

    def up(self, *sizing: str) -> None:
        """``controlplane up`` with its defaults (``sizing``: ``--machines N --standbys S`` for several jobs)."""
        self.cli("controlplane", "up", "--port", "0", "--name", self.name, "--subnet", self.subnet, *sizing,
                 timeout=900)
        doc = json.loads((self.home / "control" / "profile.json").read_text())
        self.env.update(doc["env"])  # TG_FLEET_URL, TG_INVENTORY: what `controlplane up` tells the user to set
        from trainguard.operators.fleet import FleetStore

        self.fleet = FleetStore(doc["fleet_url"])

    def down(self) -> None:
        self.cli("controlplane", "down", timeout=300, check=False)


class Day:
    """One job on a ``Plane``: a program of ``PROGRAMS`` submitted with ``trainguard job submit`` from a folder of
    its own, faulted, and read back from its records."""

    def __init__(self, plane: Plane, program: Program = PROGRAMS["stranger"], *,
                 program_args: Sequence[str] = ()) -> None:
        self.plane, self.program, self.job = plane, program, program.job
        self.home, self.log, self.cli = plane.home, plane.log, plane.cli
        self.program_args = list(program_args)
        self.workdir = plane.home / "jobs" / program.job
        self.samples = self.workdir / "samples"
        self.timeline: list[dict[str, Any]] = []
        self.caused: list[int] = []  # the incidents the day's faults opened

    @property
    def fleet(self) -> Any:
        return self.plane.fleet

    def up(self, *sizing: str) -> None:
        self.plane.up(*sizing)

    def down(self) -> None:
        self.plane.down()

    def submit(self) -> float:
        self.workdir.mkdir(parents=True, exist_ok=True)
        for name, source in self.program.files.items():
            shutil.copy(REPO / source, self.workdir / name)
        spec = self.workdir / f"{self.job}.yaml"
        command = [a.replace("{record}", str(self.samples)) for a in self.program.command] + self.program_args
        spec.write_text(f"name: {self.job}\n"
                        f"command: {json.dumps(command)}\n"  # a JSON list is a YAML flow sequence
                        f"workdir: {self.workdir}\n"
                        "machines: 2\n"
                        "standbys: 1\n")
        t = time.time()
        out = self.cli("job", "submit", str(spec), "--wait", "420", timeout=480)
        if "(success)" not in out.stdout:
            raise DayError(f"{self.job}: the submission did not launch the job: {out.stdout.strip()}")
        self.back(t, timeout=180)
        return t

    # ---- what the fleet and the job say -----------------------------------------------------------------
    def machines(self) -> list[str]:
        return list(self.fleet.job(self.job).machine_list)

    def incidents(self) -> list[Any]:
        return self.fleet.incidents(self.job)

    def last(self) -> int:
        return max((i.id for i in self.incidents()), default=0)

    def processes(self, rank: int = 0, *, after: float = 0.0) -> list[tuple[float, Path]]:
        """The rank's processes that began training at ``after`` or later: (their first record's time, its file),
        oldest first."""
        out = []
        for f in self.samples.glob(f"samples-{rank}-*.jsonl"):
            try:
                with open(f) as fh:
                    first = json.loads(fh.readline())
            except (OSError, ValueError):
                continue  # a file not written yet
            if first["ts"] >= after:
                out.append((float(first["ts"]), f))
        return sorted(out)

    def step(self, *, after: float = 0.0) -> int:
        """The newest optimizer step rank 0's newest process (begun at ``after`` or later) recorded; -1: none."""
        procs = self.processes(after=after)
        if not procs:
            return -1
        with open(procs[-1][1], "rb") as fh:
            fh.seek(max(0, fh.seek(0, 2) - 4096))
            lines = fh.read().decode(errors="replace").strip().splitlines()
        for line in reversed(lines):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError):
                continue
        return -1

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str, interval: float = 1.0) -> Any:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = predicate()
            if got:
                return got
            time.sleep(interval)
        raise DayError(f"timed out after {timeout:.0f}s waiting for {what}; incidents: "
                       + "; ".join(f"{i.id} {i.state} {i.category}: {i.summary[:200]}" for i in self.incidents()[-3:]))

    def closed_after(self, last: int, timeout: float = 300) -> Any:
        return self.wait(lambda: next((i for i in self.incidents() if i.id > last and i.state in FINAL), None),
                         timeout, f"an incident of job {self.job} after {last} to close")

    def back(self, fault_ts: float, timeout: float = 240, *, begun_after: float | None = None) -> float:
        """Seconds from ``fault_ts`` to the first step of a rank 0 process begun after it (or after
        ``begun_after``: a process begun before then is not the one that came back) that trained a few steps (the
        old process's records, still written while a fault takes effect, never count)."""
        def begun() -> list[tuple[float, Path]] | None:
            procs = [p for p in self.processes(after=fault_ts if begun_after is None else begun_after)
                     if self._steps_in(p[1]) >= 3]
            return procs or None

        procs = self.wait(begun, timeout, "the job to train again after the fault", interval=0.5)
        return procs[0][0] - fault_ts

    @staticmethod
    def _steps_in(path: Path) -> int:
        return len({json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()})

    def inject(self, machine: str, fault: str, *, rank: int | None = None, **params: Any) -> float:
        argv = ["inject", "--machine", machine, "--fault", fault]
        if rank is not None:
            argv += ["--rank", str(rank)]
        for k, v in params.items():
            argv += ["--param", f"{k}={v}"]
        t = time.time()
        self.cli(*argv)
        return t

    def phases(self, incident: int) -> list[str]:
        """Where the incident's seconds went (``trainguard incident show N --tasks``), a line per event."""
        doc = json.loads(self.cli("--json", "incident", "show", str(incident), "--tasks").stdout)
        return [f"{e['t']:+.2f}s {e['what']}" + ("" if e["took_s"] is None else f" ({e['took_s']:.2f}s)")
                for e in doc["events"]]

    def record(self, what: str, **fields: Any) -> None:
        self.timeline.append({"what": what, **fields})
        self.log(f"{self.job}: {what}: {json.dumps(fields)}")

    # ---- the day --------------------------------------------------------------------------------------
    def healthy(self, seconds: float) -> dict[str, Any]:
        mark = self.healthy_begin()
        t0 = time.time()
        while time.time() - t0 < seconds:
            time.sleep(min(5.0, max(0.1, seconds - (time.time() - t0))))
        return self.healthy_end(mark)

    def healthy_begin(self) -> tuple[int, int, float]:
        return self.last(), self.step(), time.time()

    def healthy_end(self, mark: tuple[int, int, float]) -> dict[str, Any]:
        """What the job did since ``healthy_begin``: its steps, and every incident opened (each a false alarm)."""
        last, first, t0 = mark
        opened = [i for i in self.incidents() if i.id > last]
        steps = self.step() - first
        out = {"seconds": round(time.time() - t0, 1), "steps": steps,
               "step_s": round((time.time() - t0) / max(steps, 1), 4), "incidents": len(opened),
               "opened": [f"{i.id} {i.category}: {i.summary[:300]}" for i in opened]}
        self.record("healthy", **out)
        return out

    def crash(self, label: str) -> dict[str, Any]:
        m = self.machines()[1]
        last = self.last()
        t = self.inject(m, "crash", rank=1)
        inc = self.closed_after(last)
        back = self.back(t)
        self.caused.append(inc.id)
        out = {"incident": inc.id, "state": inc.state, "category": inc.category, "back_s": round(back, 2),
               "human": False, "phases": self.phases(inc.id)}
        self.record(label, **out)
        if inc.state != "resolved":
            raise DayError(f"{label}: incident {inc.id} {inc.state}: {inc.summary}")
        return out

    def gpu_lost_during_vote(self) -> dict[str, Any]:
        first, straggler = self.machines()
        last = self.last()
        t_slow = self.inject(straggler, "slow", rank=1, seconds=self.program.straggle_s)
        voting = self.wait(lambda: next((i for i in self.incidents() if i.id > last and i.state == "open"
                                         and i.category == "slow" and "vote" in i.summary), None),
                           240, "a fail-slow vote on the straggler")
        t = self.inject(straggler, "gpu_lost")
        inc = self.wait(lambda: next((i for i in self.incidents() if i.id == voting.id and i.state in FINAL), None),
                        300, f"incident {voting.id} (the vote's) to close")
        self.caused.append(inc.id)
        self.cli("inject", "--machine", straggler, "--clear")
        back = self.back(t)
        now = self.machines()
        out = {"incident": inc.id, "vote_opened_after_s": round(voting.opened_ts - t_slow, 2),
               "state": inc.state, "category": inc.category, "back_s": round(back, 2),
               "machines": now, "evicted": straggler not in now and first in now, "human": False,
               "phases": self.phases(inc.id)}
        self.record("gpu_lost during a fail-slow vote", **out)
        if inc.id != voting.id or inc.state != "resolved" or inc.category != "machine_fault" or not out["evicted"]:
            raise DayError(f"the lost GPU did not take the vote over: incident {inc.id} (the vote's {voting.id}) "
                           f"{inc.state} {inc.category}, machines {now}: {inc.summary}")
        return out

    def refused_hang(self) -> dict[str, Any]:
        machine = self.machines()[1]
        last = self.last()
        t = self.inject(machine, "hang", rank=1)
        inc = self.closed_after(last)
        if inc.state != "waiting_human" or "breaker" not in inc.summary.lower():
            raise DayError(f"the hang's eviction was not refused by the breaker: incident {inc.id} {inc.state}: "
                           f"{inc.summary}")
        self.caused.append(inc.id)
        waited = time.time()
        self.cli("incident", "close", str(inc.id), "--note", "the hung machine is pulled for a look; job resubmitted")
        out = {"incident": inc.id, "state": "waiting_human", "waiting_after_s": round(waited - t, 2),
               "closed_by": f"trainguard incident close {inc.id}", "machine": machine, "human": True,
               "reason": inc.summary[-300:], "phases": self.phases(inc.id)}
        self.record("hang with the breaker's allowance used up", **out)
        return out

    def stop_and_resubmit(self, hang: dict[str, Any]) -> dict[str, Any]:
        """``trainguard job stop`` then ``job submit``. The machine still hangs until the stop: an incident the
        hang opened again after the person closed the first (the job still held still) is the same fault's, and
        the stop supersedes it."""
        step = self.step()
        t = time.time()
        self.cli("job", "stop", self.job, timeout=240)
        stopped = time.time()
        self.cli("inject", "--machine", hang["machine"], "--clear")
        cleared = time.time()  # until now the machine hung: a hang incident opened before is this fault's
        again = [i.id for i in self.incidents() if i.id > hang["incident"] and i.opened_ts <= cleared
                 and i.category == "hang"]
        self.caused.extend(again)
        submitted = self.submit()
        launched = time.time()
        # the job trains again in a process the submit began: one begun before the stop ended (a restart in place
        # of the refused hang's incident, blocked on the hung rank) is not it
        back = self.back(t, begun_after=stopped)
        waiting = [i.id for i in self.incidents() if i.state == "waiting_human"]
        out = {"stopped_at_step": step, "back_s": round(back, 2), "stop_s": round(stopped - t, 2),
               "submit_s": round(launched - submitted, 2), "machines": self.machines(),
               "hang_reopened": again, "incidents_waiting": waiting, "human": True}
        self.record("stop and resubmit", **out)
        if waiting:
            raise DayError(f"incidents still wait after the resubmit: {waiting}")
        return out

    def ettr(self) -> dict[str, Any]:
        doc = json.loads(self.cli("--json", "ettr", "--job", self.job).stdout)
        return {"cumulative": doc["cumulative"]["ettr"], "by_cause": doc["by_cause"]}


def exact_once(folder: Path, samples: int, world: int = 2, micro: int = 2) -> dict[str, Any]:
    """Every sample the job trained, read back by index from its records (a file per process): per rank, each
    process's steps replace the steps from its first one on (a restore went back to the step before it); the steps
    kept must run 0..N without a gap, each of 2 micro-batches, and across the ranks each finished epoch must hold
    every sample exactly once (the last, unfinished one none twice). ``most_steps_redone``: the most steps a
    restore trained again that a process had finished before it (the steps lost to a fault). ``micro``: the
    micro-batches (records) of a step."""
    history: dict[int, dict[int, list[dict[str, Any]]]] = {}
    restores = redone = 0
    for rank in range(world):
        procs = []
        for f in folder.glob(f"samples-{rank}-*.jsonl"):
            recs = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
            if recs:
                procs.append((recs[0]["ts"], recs))
        kept: dict[int, list[dict[str, Any]]] = {}
        for _started, recs in sorted(procs, key=lambda p: p[0]):
            first = recs[0]["step"]
            if kept:
                restores += rank == 0
                finished = max((s for s, v in kept.items() if len(v) == micro), default=-1)
                redone = max(redone, finished - (first - 1))  # steps finished before, trained again after
            kept = {s: v for s, v in kept.items() if s < first}
            for r in recs:
                kept.setdefault(r["step"], []).append(r)
        history[rank] = kept
    problems: list[str] = []
    last = min(max(h, default=-1) for h in history.values())
    for rank, kept in history.items():
        gaps = sorted(set(range(last + 1)) - set(kept))
        if gaps:
            problems.append(f"rank {rank}: steps missing {gaps[:10]}")
        short = [s for s in range(last) if len(kept.get(s, [])) != micro]  # the newest may be mid-step
        if short:
            problems.append(f"rank {rank}: steps without exactly {micro} micro-batch(es): {short[:10]}")
    epochs: dict[int, list[int]] = {}
    for kept in history.values():
        for s in range(last + 1):
            for r in kept.get(s, []):
                epochs.setdefault(r["epoch"], []).extend(r["idx"])
    finished = sorted(epochs)[:-1]
    for e in finished:
        seen = epochs[e]
        if sorted(seen) != list(range(samples)):
            twice = len(seen) - len(set(seen))
            problems.append(f"epoch {e}: {len(set(seen))} of {samples} samples, {twice} trained twice")
    newest = epochs.get(max(epochs, default=-1), [])
    if len(newest) != len(set(newest)):
        problems.append(f"the unfinished epoch trained {len(newest) - len(set(newest))} samples twice")
    return {"steps": last + 1, "epochs_finished": len(finished), "restores": restores,
            "most_steps_redone": redone, "problems": problems}


def run(home: Path, *, healthy_s: float, log: Callable[[str], None] = print,
        programs: Sequence[str] = ("stranger",)) -> dict[str, Any]:
    """The whole day in ``home``, for each of ``programs`` (keys of ``PROGRAMS``) as a job of its own on one control
    plane: all train healthy together, then each job's faults in turn while the others train on. The control plane
    is brought down at the end whatever happened."""
    home.mkdir(parents=True, exist_ok=True)
    plane = Plane(home, log=log)
    days = [Day(plane, PROGRAMS[p]) for p in programs]
    out: dict[str, dict[str, Any]] = {p: {} for p in programs}
    result: dict[str, Any] = {"healthy_s": healthy_s, "programs": out}
    try:
        # several jobs: 4 machines and a warm standby each (a job may use up to 4: 2, the swap, and the hung one)
        plane.up(*(("--machines", str(4 * len(days)), "--standbys", str(len(days))) if len(days) > 1 else ()))
        t0 = {p: day.submit() for p, day in zip(programs, days, strict=True)}
        marks = [day.healthy_begin() for day in days]
        begun = time.time()
        while time.time() - begun < healthy_s:
            time.sleep(min(5.0, max(0.1, healthy_s - (time.time() - begun))))
        for p, day, mark in zip(programs, days, marks, strict=True):
            out[p]["healthy"] = day.healthy_end(mark)
        for p, day in zip(programs, days, strict=True):
            r = out[p]
            r["crash"] = day.crash("crash")
            r["gpu_lost_during_vote"] = day.gpu_lost_during_vote()
            r["hang_refused"] = day.refused_hang()
            r["resubmit"] = day.stop_and_resubmit(r["hang_refused"])
            r["crash_again"] = day.crash("crash again")
        for p, day in zip(programs, days, strict=True):
            r = out[p]
            r["wall_s"] = round(time.time() - t0[p], 1)
            r["ettr"] = day.ettr()
            r["samples"] = exact_once(day.samples, day.program.samples, micro=day.program.micro)
            incidents = day.incidents()
            r["incidents"] = [{"id": i.id, "state": i.state, "category": i.category, "summary": i.summary[:300]}
                              for i in incidents]
            # an incident none of the day's faults opened (the healthy window's included) is a false alarm
            r["not_caused"] = [f"{i.id} {i.category}: {i.summary[:300]}" for i in incidents if i.id not in day.caused]
    finally:
        result["timeline"] = {p: day.timeline for p, day in zip(programs, days, strict=True)}
        plane.down()
    return result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--healthy-s", type=float, default=1800.0,
                   help="healthy training before the faults (default 30 min)")
    p.add_argument("--quick", action="store_true", help="90 s healthy")
    p.add_argument("--programs", default="stranger",
                   help=f"comma-separated, of {', '.join(PROGRAMS)}; 'examples': plain,lightning,hf (one job each, "
                        "on one control plane; default stranger)")
    p.add_argument("--out", type=Path)
    p.add_argument("--keep", action="store_true", help="keep the day's folder (fleet database, Airflow's and the "
                                                        "machines' logs) after a run that passed too")
    args = p.parse_args()
    programs = ["plain", "lightning", "hf"] if args.programs == "examples" else args.programs.split(",")
    unknown = [x for x in programs if x not in PROGRAMS]
    if unknown:
        p.error(f"unknown program(s) {', '.join(unknown)}: use {', '.join(PROGRAMS)} or 'examples'")
    stop_on_sigterm()
    healthy_s = 90.0 if args.quick else args.healthy_s
    home = Path(tempfile.mkdtemp(prefix="tg-bench-day-"))
    try:
        result = run(home, healthy_s=healthy_s, log=lambda m: print(m, file=sys.stderr, flush=True),
                     programs=programs)
    except BaseException:
        print(f"kept {home} for a post-mortem (control/: the fleet database, Airflow's logs)", file=sys.stderr)
        raise
    if args.keep:
        print(f"kept {home}", file=sys.stderr)
    else:
        shutil.rmtree(home, ignore_errors=True)
    single = programs == ["stranger"]
    setup = {"programs": {x: {"job": PROGRAMS[x].job, "files": PROGRAMS[x].files,
                               "command": list(PROGRAMS[x].command)} for x in programs},
             "machines": 2, "standbys": 1, "healthy_s": healthy_s, "timeline": result["timeline"],
             "incidents": {x: result["programs"][x]["incidents"] for x in programs}}
    figures = {f"{'' if single else x + '.'}{k}": v for x in programs
               for k, v in metrics(result["programs"][x], PROGRAMS[x]).items()}
    name = "day" if single else "day_examples" if programs == ["plain", "lightning", "hf"] else "day_programs"
    print(write_result(name, quick=args.quick, setup=setup,
                       metrics=figures, out=args.out))
    return 0


def metrics(result: dict[str, Any], program: Program) -> dict[str, Any]:
    """One job's figures in the benchmark tables' form (one value each: the day runs once)."""
    def one(value: Any, unit: str, target: Any = None, **more: Any) -> dict[str, Any]:
        return {"value": value, "n": 1, "unit": unit, **({} if target is None else {"target": target}), **more}

    healthy = result["healthy"]
    out = {"incidents_healthy": one(healthy["incidents"], "incidents", 0, window_s=healthy["seconds"]),
           "step_s_healthy": one(healthy["step_s"], "s", None if program.step_max_s is None
                                 else f"< {program.step_max_s:g}")}
    for key in ("crash", "gpu_lost_during_vote", "crash_again"):
        out[f"back_s.{key}"] = one(result[key]["back_s"], "s")
    out["back_s.stop_and_resubmit"] = one(result["resubmit"]["back_s"], "s")
    out["faults_needing_a_human"] = one(sum(1 for k in ("crash", "gpu_lost_during_vote", "crash_again",
                                                        "hang_refused") if result[k]["human"]), "faults", 1)
    out["ettr"] = one(round(result["ettr"]["cumulative"], 4), "ratio", ">= 0.95")
    out["steps_redone_max"] = one(result["samples"]["most_steps_redone"], "steps", "<= 1")
    out["samples_twice_or_skipped"] = one(len(result["samples"]["problems"]), "problems", 0,
                                          restores=result["samples"]["restores"],
                                          epochs=result["samples"]["epochs_finished"])
    out["incidents_not_caused"] = one(len(result["not_caused"]), "incidents", 0)
    out["incidents_left_open"] = one(sum(1 for i in result["incidents"] if i["state"] in ("open", "waiting_human")),
                                     "incidents", 0)
    return out


if __name__ == "__main__":
    sys.exit(main())
