"""A scripted fleet for the control plane's policy tests: machines that answer ``tg-node`` commands from
state a test sets (no processes, no ssh), so every rung of the ladder runs through the real
:class:`trainguard.operators.control.Controller` and the task bodies of :mod:`trainguard.operators.tasks` in
milliseconds.

:class:`FakeFleet` keeps one job. While every machine of the job runs its part, each read of the job's
status or steps is one more training step. A test breaks what it needs: a machine unreachable, a standby
whose start fails, a diagnosis that fails, checkpoint copies only on some machines, and reads back every
command that was sent (``commands``)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainguard.core.topology import Topology
from trainguard.node_tools.inventory import Inventory, Machine
from trainguard.node_tools.transport import RunResult, Transport
from trainguard.operators.control import ControlConfig, Controller


class FakeFleet(Transport):
    """Machines of an inventory answering tg-node from a script.

    Attributes:
        unreachable: machines whose ssh fails.
        start_fails: machine -> the error its ``job start`` answers with.
        parked: machines with warm interpreters parked.
        l1, l2: machine -> reasons it fails that level (absent: healthy).
        gbps: machine -> the memory bandwidth its L2 measures (GB/s), or the readings of its next runs in
            order (the last one repeats); the floor is ``floor_gbps``.
        l2_once: machine -> a reason its next L2 fails for (once: a transient failure).
        digests: machine -> its alignment digest (default "d0").
        copies: machine -> checkpoint copies held there: ``(tier, step, rank)`` each.
        log_verdict: the logs' class after a stop (none, user_code, infrastructure, unknown), or per machine
            in ``logs`` (machine -> its verdict document: class, kind, first_failure ...).
        restore_fails: a start after which every rank ends without a step (no step restorable), until some
            copy was rescued into the remote tier.
        rescue_fails: ``ckpt rescue`` fails (the remote tier cannot be written).
        process_state: rank -> its process state as ``tg-node stacks`` sees it (default "S": running).
        frames: rank -> its main thread's functions, innermost first (default: waiting in an all_reduce).
        compute: rank -> its recent compute time per step (default 0.35 s).
    """

    def __init__(self, inventory: Inventory, topology: Topology, job: str = "j") -> None:
        super().__init__(inventory)
        self.topo, self.job = topology, job
        self.commands: list[tuple[str, list[str]]] = []
        self.unreachable: set[str] = set()
        self.start_fails: dict[str, str] = {}
        self.parked: set[str] = set()
        self.l1: dict[str, str] = {}
        self.l2: dict[str, str] = {}
        self.gbps: dict[str, float | list[float]] = {}
        self.l2_once: dict[str, str] = {}
        self.floor_gbps = 0.5
        self.digests: dict[str, str] = {}
        self.copies: dict[str, list[tuple[str, int, int]]] = {}
        self.log_verdict = "none"
        self.logs: dict[str, dict[str, Any]] = {}
        self.restore_fails = False
        self.rescue_fails = False
        self.running: dict[str, list[int]] = {}  # machine -> its ranks, while its part runs
        self.incarnation: dict[str, int] = {}
        self.step = 10  # steps every rank finished
        self.started_ts = 0.0
        self.records: list[dict[str, Any]] = []  # rank 0's step records
        self.process_state: dict[int, str] = {}
        self.frames: dict[int, list[str]] = {}
        self.compute: dict[int, float] = {}
        self.progress_age: float | None = None  # seconds since each rank's last progress, as its heartbeat says
        self.agent_restarted: list[str] = []
        self.rescued: list[tuple[str, int, int]] = []
        self.envs: list[tuple[str, list[str], dict[str, str]]] = []  # each command's extra environment

    # ---- the job ---------------------------------------------------------------------------------------
    def launch(self, machines: Sequence[str]) -> None:
        """The job runs on ``machines`` (node-rank order)."""
        for i, name in enumerate(machines):
            self.running[name] = list(self.topo.ranks_on(i))
            self.incarnation[name] = self.incarnation.get(name, -1) + 1
        self.started_ts = time.time()

    #: machines that step on their own while others of the job are down (a job run as replica groups)
    trains_without: frozenset[str] = frozenset()

    def _train(self) -> None:
        """One step more, if the whole job runs (or the machines of ``trains_without`` do)."""
        if len(self.running) == self.topo.machines or (self.trains_without
                                                        and self.trains_without <= set(self.running)):
            self.step += 1
            self.records.append({"step": self.step, "ts": time.time(), "incarnation": 0, "loss": 2.0,
                                 "ckpt_restored_step": self.restored if len(self.records) == 0 else None})

    restored = 9
    held: frozenset[int] = frozenset()  # ranks whose heartbeat says they hold still (a non-finite step)

    def _status(self, name: str) -> dict[str, Any]:
        ranks = self.running.get(name, [])
        return {"job": self.job, "machine": name, "state": "running" if ranks else "exited",
                "incarnation": self.incarnation.get(name), "returncode": None if ranks else -9,
                "ranks": [{"rank": r, "step": self.step, "process_state": "S" if ranks else "gone",
                           "status": "held" if r in self.held else "running",
                           "last_step": {"step": self.step, "step_time_s": 0.6, "comm_s": 0.2,
                                         "incarnation": self.incarnation.get(name)},
                           "recent_compute_s": self.compute.get(r, 0.35), "progress_age_s": self.progress_age}
                          for r in ranks]}

    # ---- the transport -----------------------------------------------------------------------------------
    def _ok(self, machine: str, argv: list[str], doc: Any, code: int = 0) -> RunResult:
        return RunResult(machine, argv, code, json.dumps(doc), "", 0.01)

    def run(self, machine: Machine, argv: Sequence[str], *, timeout: float = 30.0, stdin: str | None = None,
            env: Any = None) -> RunResult:
        argv = [str(a) for a in argv]
        name = machine.name
        self.commands.append((name, argv[1:]))
        self.envs.append((name, argv[1:], dict(env or {})))
        if name in self.unreachable:
            return RunResult(name, argv, 255, "", f"ssh: connect to host {machine.address} port 22: No route to host",
                             0.01, reachable=False)
        cmd = argv[1:3]
        if cmd in (["job", "start"], ["standby", "activate"]):
            if name in self.start_fails:
                return self._ok(name, argv, {"error": self.start_fails[name]}, 2)
            node_rank = int(argv[argv.index("--node-rank") + 1])
            if "--replica" in argv:  # a replica group's part: its node rank is the group's
                node_rank += int(argv[argv.index("--replica") + 1]) * int(argv[argv.index("--nnodes") + 1])
            self.incarnation[name] = self.incarnation.get(name, -1) + 1
            if self.restore_fails and not self.rescued:  # it starts, finds no step to restore, and ends
                self.running.pop(name, None)
                return self._ok(name, argv, {**self._status(name), "warm": name in self.parked})
            self.running[name] = list(self.topo.ranks_on(node_rank))
            self.started_ts = time.time()
            self.records = []
            return self._ok(name, argv, {**self._status(name), "warm": name in self.parked})
        if cmd == ["job", "status"]:
            self._train()
            return self._ok(name, argv, self._status(name))
        if cmd == ["job", "steps"]:
            self._train()
            return self._ok(name, argv, {"steps": list(self.records)})
        if cmd == ["job", "stop"]:
            self.running.pop(name, None)
            return self._ok(name, argv, {"job": self.job, "machine": name, "stopped_pids": [1], "state": "exited"})
        if cmd == ["standby", "status"]:
            return self._ok(name, argv, {"state": "parked" if name in self.parked else "idle"})
        if cmd == ["standby", "park"]:
            self.parked.add(name)
            return self._ok(name, argv, {"state": "parked"})
        if cmd[0] == "diag":
            return self._diag(name, argv)
        if cmd[0] == "align":
            return self._ok(name, argv, {"test": "align", "exit_code": 0, "digest": self.digests.get(name, "d0")})
        if cmd[0] == "stacks":
            ranks = self.running.get(name, [])
            procs = [{"pid": 100 + r, "role": "rank", "rank": r, "process_state": self.process_state.get(r, "S"),
                      "error": None, "threads": [{"name": "MainThread", "frames": [
                          {"name": f, "filename": "train.py"} for f in self.frames.get(r, ["all_reduce", "step",
                                                                                          "main"])]}]}
                     for r in ranks]
            return self._ok(name, argv, {"job": self.job, "machine": name, "processes": procs,
                                         "collectives": {str(r): {"dp": {"started": 5, "completed": 4}} for r in ranks},
                                         "steps": {str(r): self.step for r in ranks}})
        if cmd == ["ckpt", "list"]:
            return self._ok(name, argv, {"machine": name, "job": self.job, "copies": [
                {"tier": t, "step": s, "rank": r, "committed": True, "candidate": False, "verified": False}
                for t, s, r in self.copies.get(name, [])]})
        if cmd == ["ckpt", "rescue"]:
            from trainguard.checkpoint.s3 import open_tier

            if self.rescue_fails:
                return self._ok(name, argv, {"error": f"machine {name}: the remote tier refused the write"}, 2)
            step = int(argv[argv.index("--step") + 1])
            endpoint = argv[argv.index("--endpoint-url") + 1] if "--endpoint-url" in argv else ""
            tier = open_tier(argv[argv.index("--to") + 1], endpoint_url=endpoint)
            mine = sorted({(s, r) for t, s, r in self.copies.get(name, []) if s == step})
            for s, r in mine:
                self.rescued.append((name, s, r))
                tier.upload_copy(s, r, [], json.dumps({"step": s, "rank": r}).encode())
            return self._ok(name, argv, {"machine": name, "step": step, "uploaded": [{"rank": r} for _, r in mine]})
        if cmd[0] == "agent" and "--restart" in argv:
            self.agent_restarted.append(name)
            return self._ok(name, argv, {"machine": name, "restarted": True, "before": {"agent": {"state": "stopped"}},
                                         "after": {"agent": {"state": "running", "pid": 4242}}})
        if cmd[0] == "logs":
            verdict = self.logs.get(name, {"class": self.log_verdict})
            if self.restore_fails and not self.rescued:
                verdict = {"class": "unknown", "kind": "checkpoint_unrestorable",
                           "evidence": "gpt3d: error: checkpoint: 40 copies found but no step can be restored on "
                                       "all 8 ranks: newest step 238 has no usable copy for rank(s) [0, 1, 6, 7]"}
            return self._ok(name, argv, {"verdict": verdict})
        raise AssertionError(f"{name}: unexpected command {argv}")

    def _diag(self, name: str, argv: list[str]) -> RunResult:
        level = int(argv[argv.index("--level") + 1])
        tests: list[dict[str, Any]] = []
        if level == 1 or name in self.l1:
            tests.append({"name": "quick", "ok": name not in self.l1, "reason": self.l1.get(name, "")})
        if level == 2:
            gbps = self.gbps.get(name, 5.0)
            if isinstance(gbps, list):
                gbps = gbps.pop(0) if len(gbps) > 1 else gbps[0]
            wrong = self.l2.get(name) or self.l2_once.pop(name, "")
            tests.append({"name": "compute", "ok": not wrong, "reason": wrong})
            tests.append({"name": "memory", "ok": gbps >= self.floor_gbps, "details": {"gbps": gbps},
                          "reason": "" if gbps >= self.floor_gbps else
                          f"cpu: copy bandwidth {gbps:.3g} GB/s is below the floor of {self.floor_gbps:g} GB/s"})
        if "--rank" in argv:
            tests.append({"name": "collective_neighbours", "ok": True, "reason": ""})
        reasons = [f"{t['name']}: {t['reason']}" for t in tests if not t["ok"]]
        doc = {"machine": name, "level": level, "healthy": not reasons, "tests": tests, "reasons": reasons}
        if "--align" in argv:
            doc["align"] = {"exit_code": 0, "digest": self.digests.get(name, "d0")}
        return self._ok(name, argv, doc, 0 if not reasons else 1)

    def run_two_phase(self, machines: Sequence[Machine], argv_for: Any, *, timeout: float = 30.0,
                      ready_timeout: float | None = None) -> dict[str, RunResult]:
        out = {}
        for m in machines:
            argv = [str(a) for a in argv_for(m)]
            self.commands.append((m.name, argv[1:]))
            if m.name in self.unreachable:
                out[m.name] = RunResult(m.name, argv, 255, "", "ssh: No route to host", 0.01, reachable=False)
                continue
            self.running.pop(m.name, None)
            doc: dict[str, Any] = {"job": self.job, "machine": m.name, "stopped_pids": [1], "state": "running",
                                   "status": self._status(m.name)}
            if "--logs-since" in argv:
                doc["logs"] = {"verdict": self.logs.get(m.name, {"class": self.log_verdict})}
            if "--copies" in argv:
                doc["copies"] = [{"tier": t, "step": s, "rank": r, "committed": True}
                                 for t, s, r in self.copies.get(m.name, [])]
            out[m.name] = RunResult(m.name, argv, 0, json.dumps(doc), "", 0.01, extra={"first": "{}"})
        return out

    def sent(self, *words: str) -> list[str]:
        """The machines that were sent a command starting with ``words``."""
        return [m for m, argv in self.commands if argv[: len(words)] == list(words)]


def replicated_copies(topo: Topology, machines: Sequence[str], steps: Sequence[int]) -> dict[str, list]:
    """Each machine's checkpoint copies of ``steps`` as the checkpoint library places them: its ranks' own
    copies, and the replicas of the ranks whose backup rank it runs."""
    out: dict[str, list[tuple[str, int, int]]] = {m: [] for m in machines}
    for step in steps:
        for r in range(topo.world_size):
            out[machines[topo.machine_of(r)]].append(("local", step, r))
            out[machines[topo.machine_of(topo.backup_rank(r))]].append(("replica", step, r))
    return out


def fleet_controller(tmp_path: Path, *, machines: int = 6, active: int = 4, topology: Topology | None = None,
                     train_args: Sequence[str] = ("--checkpoint",), revision: str = "",
                     spec: dict[str, Any] | None = None, fleet_url: str = "",
                     **settings: Any) -> tuple[Controller, FakeFleet]:
    """A controller over ``machines`` scripted machines (the first ``active`` run job ``j``, the rest are
    parked standbys), with its fleet database in ``tmp_path`` (or at ``fleet_url``). ``spec``: the job's spec
    (default: the reference job with ``train_args``)."""
    topo = topology or Topology(tp=1, pp=2, dp=2)
    inv = Inventory(cluster="t", transport="local", bus_url=f"spool://{tmp_path / 'bus'}", machines=[
        Machine(name=f"m{i}", address=f"10.0.0.{i + 10}", role="active" if i < active else "standby")
        for i in range(machines)])
    inv.save(tmp_path / "inventory.json")
    fleet = FakeFleet(inv, topo)
    c = Controller(ControlConfig(fleet_url=fleet_url or str(tmp_path / "fleet.db"), inventory=str(inv.path),
                                 **settings), inventory=inv, transport=fleet)
    c.sync_inventory()
    names = [f"m{i}" for i in range(active)]
    c.fleet.upsert_job("j", tp=topo.tp, pp=topo.pp, dp=topo.dp, ranks_per_machine=topo.ranks_per_machine,
                       machines=names, train_args=list(train_args), revision=revision, spec=spec)
    fleet.launch(names)
    fleet.parked = {f"m{i}" for i in range(machines)}
    return c, fleet


def use_controller(monkeypatch: Any, c: Controller) -> None:
    """The triggers' shared controller (and the controller a DAG's task is handed) is ``c`` for the rest of the
    test; task bodies called directly are handed ``c``."""
    from trainguard.operators.hooks import fleet
    from trainguard.operators.tasks import common

    monkeypatch.setattr(common, "shared_controller", lambda: c)
    monkeypatch.setattr(fleet, "task_controller", lambda: c)


def run_incident(c: Controller, alerts: Sequence[dict[str, Any]], monkeypatch: Any, *,
                 joined: Sequence[dict[str, Any]] = (), joined_late: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """What tg_incident does with a batch, task by task (triage, the branch's rung, stop_job, swap_machines,
    restart_job, the resume check, close): returns ``{"decision", "result", "resumed", "closed",
    "incident"}`` (``result``: the rung's, with the ``stop``, ``swap`` and ``recovery`` that followed it).
    ``joined``: alerts the guardian records right after the triage (they join the open incident);
    ``joined_late``: alerts it records after the restart, before the resume check."""
    from trainguard.operators.tasks import incident as steps
    from trainguard.operators.tasks import rungs

    use_controller(monkeypatch, c)
    [item] = c.ingest(alerts)
    incident = item["incident"]
    decision = steps.triage(c, incident)
    if joined:
        assert [i["incident"] for i in c.ingest(joined)] == [incident]
    branch = steps.choose(decision)
    if branch == "no_recovery":
        idle = steps.no_recovery(c, decision)
        recovery = steps.restart_job(c, incident, [])
        resumed = steps.resumed(c, incident, recovery)
        closed = steps.close(c, incident, idle, recovery, resumed)
        return {"decision": decision, "result": idle, "resumed": resumed, "closed": closed, "incident": incident}
    result = rungs.handle(c, branch, decision)
    recovery, stop, swap = recover(c, incident, result)
    result = {**result, "stop": stop, "swap": swap, "recovery": recovery}
    if joined_late:
        assert [i["incident"] for i in c.ingest(joined_late)] == [incident]
    resumed = None
    for _ in range(20):  # the resume trigger's checks
        resumed = steps.resumed(c, incident, recovery)
        if resumed is not None:
            break
    closed = steps.close(c, incident, None, recovery, resumed)
    return {"decision": decision, "result": result, "resumed": resumed, "closed": closed, "incident": incident}


def recover(c: Controller, incident: int, result: dict[str, Any] | None, **kwargs: Any
            ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The tasks after a rung (its ``result``; None: the rung was skipped): stop_job, swap_machines,
    restart_job; returns their results ``(restart, stop, swap)``. ``kwargs``: restart_job's."""
    from trainguard.operators.tasks import incident as steps

    results = [result]
    stop = steps.stop_job(c, incident, results)
    swap = steps.swap_machines(c, incident, results, stop)
    return steps.restart_job(c, incident, results, stop, swap, **kwargs), stop, swap


def alert(kind: str, machine: str, *, rank: int | None = None, job: str = "j", ts: float | None = None,
          **evidence: Any) -> dict[str, Any]:
    """An alert document as the guardian records it."""
    from trainguard.node_tools.alerts import Alert

    a = Alert(kind, machine, job=job if rank is not None or kind not in ("gpu_lost", "kernel_xid", "disk_full")
              else "", rank=rank, ts=ts or time.time(), evidence=evidence,
              severity="warning" if kind in ("rank_slow", "throughput_decline", "nic_errors") else "fault")
    a.received_ts = a.ts
    return a.record()
