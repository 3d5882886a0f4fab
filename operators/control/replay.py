"""Dual-phase replay: the job's model and data replayed on groups of machines at once, horizontally then
vertically, to find a machine that computes wrong only in training."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.core.errors import TrainguardError
from trainguard.core.topology import Topology
from trainguard.node_tools import launcher
from trainguard.operators.control.base import REPLAY_PORT_BASE, Part
from trainguard.operators.fleet import states
from trainguard.operators.jobspec import stored_spec
from trainguard.operators.policy import sdc


def _replay_result(statuses: Mapping[str, Any], steps: int, world_size: int) -> str | None:
    """A replay group's result once every machine's part ended: the ranks' parameter digests after the
    last step (``rank:digest`` in rank order), or ``failed: ...``; None while it runs."""
    if any(d.get("error") for d in statuses.values()):
        return "failed: " + "; ".join(f"{n}: {d['error']}" for n, d in statuses.items() if d.get("error"))[:300]
    if any(d.get("state") == "running" for d in statuses.values()):
        return None
    bad = {n: d.get("returncode") for n, d in statuses.items() if d.get("returncode") not in (0, None)}
    if bad:
        return f"failed: exit codes {bad}"
    digests = {}
    for d in statuses.values():
        for r in d.get("ranks", []):
            last = r.get("last_step") or {}
            if last.get("step") != steps - 1 or last.get("incarnation") != d.get("incarnation"):
                return f"failed: rank {r.get('rank')} ended at step {last.get('step')}, not {steps - 1}"
            digests[int(r["rank"])] = last.get("param_digest")
    if len(digests) != world_size:
        return f"failed: {len(digests)} of {world_size} ranks reported"
    return ",".join(f"{r}:{digests[r]}" for r in sorted(digests))


class Replay(Part):
    """Replaying training steps on groups of machines."""

    def replay_plan(self, job: str, *, k: int = 1) -> dict[str, Any]:
        """The replay groups of the job (:func:`trainguard.operators.policy.sdc.plan_replay`), and a reference
        group of self-checked standbys (``k * PP`` of them, or none when too few are free)."""
        j = self.fleet.job(job)
        topo = j.topology
        plan = sdc.plan_replay(topo, j.machine_list, k=k)
        standbys = sorted(m.name for m in self.fleet.machines(state=states.STANDBY))
        size = k * topo.pp
        return {"job": job, "k": k, "horizontal": plan.horizontal, "vertical": plan.vertical,
                "reference": standbys[:size] if len(standbys) >= size else []}

    def replay_launch(self, job: str, groups: Mapping[str, Sequence[str]], *, k: int, steps: int = 2
                      ) -> dict[str, Any]:
        """Start the job's model and data (its code revision and training arguments, TP and PP, DP = ``k``)
        on each group of machines at once, from the same seed, ``steps`` steps, no checkpoint: a sub-job
        named ``<job>-replay-<group>`` per group. Every group computes the same thing, so healthy groups
        agree bit for bit. The job itself must be stopped. Returns what was launched (JSON: a trigger takes
        it): each group's sub-job and machines, and the groups that failed to start."""
        j = self.fleet.job(job)
        topo = Topology(j.tp, j.pp, k, ranks_per_machine=j.ranks_per_machine)
        args = [*j.train_args, "--no-checkpoint", "--no-restore", "--steps", str(steps), "--step-delay-s", "0"]
        launched: dict[str, Any] = {"job": job, "k": k, "steps": steps, "world_size": topo.world_size,
                                    "groups": {}}
        for i, (tag, names) in enumerate(groups.items()):
            plan = stored_spec(j).plan(job=f"{job}-replay-{tag}", topology=topo, machines=self.inventory.named(names),
                                       train_args=args, master_port=REPLAY_PORT_BASE + i, revision=j.revision)
            group: dict[str, Any] = {"job": plan.job, "machines": list(names), "failed": None}
            if self.cfg.dry_run:
                group["failed"] = "dry run"
            else:
                try:
                    launcher.launch(self.inventory, plan, transport=self.transport)
                except TrainguardError as exc:
                    group["failed"] = f"failed: {exc}"[:300]
            launched["groups"][tag] = group
        return launched

    def replay_poll(self, launched: Mapping[str, Any]) -> dict[str, str | None]:
        """Each launched group's result: its ranks' parameter digests after the last step, ``failed: ...``,
        or None while it still runs."""
        out: dict[str, str | None] = {}
        for tag, g in launched["groups"].items():
            if g.get("failed"):
                out[tag] = g["failed"]
                continue
            st = launcher.status(self.inventory, g["job"], self.inventory.named(g["machines"]),
                                 transport=self.transport)
            out[tag] = _replay_result(st, int(launched["steps"]), int(launched["world_size"]))
        return out

    def replay_stop(self, launched: Mapping[str, Any]) -> None:
        """End every group's sub-job (ended already, or now): marked stopped, out of the ranks' checks."""
        for g in launched["groups"].values():
            with contextlib.suppress(TrainguardError):
                launcher.stop(self.inventory, g["job"], self.inventory.named(g["machines"]), grace_s=2.0,
                              transport=self.transport)

    def replay_groups(self, job: str, groups: Mapping[str, Sequence[str]], *, k: int, steps: int = 2,
               timeout_s: float = 300.0) -> dict[str, str]:
        """:meth:`replay_launch`, then :meth:`replay_poll` every second until every group has a result (or
        ``timeout_s`` passed: ``failed: no result ...``), then :meth:`replay_stop`. Returns each group's
        result. (In Airflow the polling runs in the triggerer:
        :class:`trainguard.operators.triggers.replay.ReplayTrigger`.)"""
        launched = self.replay_launch(job, groups, k=k, steps=steps)
        if self.cfg.dry_run:
            return {tag: "dry run" for tag in launched["groups"]}
        out: dict[str, str] = {}
        try:
            deadline = time.monotonic() + timeout_s
            while len(out) < len(launched["groups"]) and time.monotonic() < deadline:
                out.update({t: r for t, r in self.replay_poll(launched).items() if r is not None})
                if len(out) < len(launched["groups"]):
                    time.sleep(1.0)
            for tag in launched["groups"]:
                out.setdefault(tag, f"failed: no result within {timeout_s:.0f}s")
        finally:
            self.replay_stop(launched)
        return out

    def dual_phase_replay(self, job: str, *, k: int = 1) -> dict[str, Any]:
        """Replay a fixed step on the horizontal groups (with the standbys' reference group beside them),
        then on the vertical groups; the culprits are the machines in both a failing horizontal and a
        failing vertical group (:func:`trainguard.operators.policy.sdc.culprits`). With two groups and no reference,
        a difference cannot be placed: ``inconclusive``."""
        plan = self.replay_plan(job, k=k)
        t0 = time.time()
        h = self.replay_phase(plan, "horizontal")
        v = self.replay_phase(plan, "vertical")
        return {**plan, **self.replay_verdict(plan, h, v), "seconds": round(time.time() - t0, 3)}

    @staticmethod
    def phase_groups(plan: Mapping[str, Any], phase: str) -> dict[str, list[str]]:
        """The groups of one phase of :meth:`replay_plan`'s replay: ``horizontal`` (groups ``h0``.., with the
        standbys' reference group ``ref``) or ``vertical`` (``v0``..)."""
        groups = {f"{phase[0]}{i}": list(g) for i, g in enumerate(plan[phase])}
        if phase == "horizontal" and plan["reference"]:
            groups["ref"] = list(plan["reference"])
        return groups

    def replay_phase(self, plan: Mapping[str, Any], phase: str) -> dict[str, str]:
        """One phase of :meth:`replay_plan`'s replay (:meth:`phase_groups`), run to its end."""
        return self.replay_groups(plan["job"], self.phase_groups(plan, phase), k=int(plan["k"]))

    @staticmethod
    def replay_verdict(plan: Mapping[str, Any], h: Mapping[str, str], v: Mapping[str, str]) -> dict[str, Any]:
        """The culprits from both phases' results (``h0``.., ``ref``; ``v0``..)."""
        groups = sdc.ReplayPlan(plan["k"], plan["horizontal"], plan["vertical"])
        h_res = {i: h[f"h{i}"] for i in range(len(groups.horizontal))}
        v_res = {i: v[f"v{i}"] for i in range(len(groups.vertical))}
        reference = h.get("ref")
        if reference is not None and reference.startswith("failed"):
            reference = None  # the reference did not run: judge by the majority
        suspects = sdc.culprits(groups, h_res, v_res, reference=reference)
        inconclusive = reference is None and len(h_res) == 2 and len(set(h_res.values()) | set(v_res.values())) > 1
        return {"horizontal_results": h, "vertical_results": v, "reference_result": reference,
                "culprits": [] if inconclusive else sorted(suspects), "inconclusive": inconclusive}

