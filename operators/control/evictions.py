"""Evictions: standbys checked reachable and swapped in through the breaker, never taking the last copy of a
checkpoint; code rollback; what to change before a recovery that did not hold is tried again."""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from trainguard.node_tools.inventory import Machine
from trainguard.node_tools.logs import UNRESTORABLE_KIND
from trainguard.node_tools.transport import RunResult
from trainguard.operators.control.base import Part
from trainguard.operators.control.jobs import held_copies
from trainguard.operators.fleet import states
from trainguard.operators.hooks.s3 import S3Access, s3_access
from trainguard.operators.policy import ladder

if TYPE_CHECKING:
    from trainguard.operators.control.incidents import Incidents
    from trainguard.operators.control.jobs import Jobs

PROBE_TIMEOUT_S = 15.0  # the most a standby's answer is waited for when nothing else answers
PROBE_GRACE_S = 2.0  # once enough standbys answered: how long a silent one earlier in the order is waited for


def probe_settled(order: Sequence[str], ok: Mapping[str, bool], need: int, elapsed_s: float,
                  grace_s: float = PROBE_GRACE_S, timeout_s: float = PROBE_TIMEOUT_S) -> float | None:
    """Whether the standbys asked at once (``order``: the fleet's order) have answered enough to choose:
    None when every one answered, when the ``need`` first of the order answered well, when ``need`` answered
    well and ``grace_s`` passed (a silent one is passed over), or past ``timeout_s``; else the seconds to
    wait before asking again. ``ok``: the answers in so far (True: a standby that answered well)."""
    if len(ok) >= len(order) or elapsed_s >= timeout_s:
        return None
    good = [n for n in order if ok.get(n)]
    if len(good) >= need and (all(n in ok for n in order[:order.index(good[need - 1]) + 1])
                              or elapsed_s >= grace_s):
        return None
    if len(good) >= need:
        return grace_s - elapsed_s
    return timeout_s - elapsed_s


def _answered_well(r: RunResult) -> bool:
    """A standby's ``tg-node standby status`` that answered with its state."""
    return r.ok and isinstance(r.answer(), dict)


class Evictions(Part):
    """Swapping machines for standbys, safely."""

    def __init__(self, *base: Any, jobs: Jobs, incidents: Incidents) -> None:
        super().__init__(*base)
        self.jobs = jobs
        self.incidents = incidents

    def pool(self) -> list[str]:
        """The standbys of the fleet database that the inventory holds, in the fleet's order."""
        return [m.name for m in self.fleet.machines(state=states.STANDBY) if m.name in self.inventory.names()]

    def _status_argv(self, _m: Machine) -> list[str]:
        return [self.inventory.tg_node, "standby", "status"]

    def ready_standbys(self, wanted: int, *, why: str = "") -> tuple[list[str], list[str]]:
        """Up to ``wanted`` standbys checked reachable now (``tg-node standby status``), in the fleet's order;
        one that does not answer goes to repair (``why``: whom it was called to replace) and the next is
        tried. The first ``2 * wanted`` standbys are asked at once: once ``wanted`` have answered, one that is
        still silent after :data:`PROBE_GRACE_S` is passed over, so a standby that died as it was called costs
        seconds, not the connection's timeout. Returns the ready standbys and the passed-over ones (the
        incident's close judges those, :meth:`judge_passed_over`)."""
        ready: list[str] = []
        tried: set[str] = set()
        passed_over: list[str] = []
        while len(ready) < wanted:
            need = wanted - len(ready)
            todo = [n for n in self.pool() if n not in tried][: 2 * need]
            if not todo:
                break
            tried.update(todo)
            results = self._race(todo, need)
            for n in todo:
                r = results.get(n)
                if r is None:  # still silent when enough others answered: passed over, judged later
                    passed_over.append(n)
                    continue
                if _answered_well(r):
                    if len(ready) < wanted:
                        ready.append(n)
                elif not self.cfg.dry_run:
                    self.fleet.transition(n, states.REPAIR, reason=f"standby did not answer when called{why}: "
                                                                   f"{r.describe()[:200]}")
        return ready, passed_over

    def judge_passed_over(self, incident_id: int) -> dict[str, str]:
        """The standbys the incident's evictions passed over (silent when called, see :meth:`ready_standbys`)
        and still in the pool, asked again with the whole timeout: one that does not answer goes to repair.
        Run when the incident closes, after the job was restarted without waiting for them. Returns what each
        answered ("ok", or why it went to repair)."""
        names = sorted({n for a in self.fleet.actions(incident_id) if a.kind == "evict"
                        for n in (a.evidence or {}).get("passed_over") or ()})
        if not names or self.cfg.dry_run:
            return {}
        pool = set(self.pool())
        names = [n for n in names if n in pool]
        results = self.transport.run_many(self.inventory.named(names), self._status_argv, timeout=PROBE_TIMEOUT_S)
        out: dict[str, str] = {}
        for n, r in results.items():
            if _answered_well(r):
                out[n] = "ok"
                continue
            out[n] = r.describe()[:200]
            self.fleet.transition(n, states.REPAIR, reason=f"standby did not answer when called by incident "
                                                           f"{incident_id} (passed over): {out[n]}")
        return out

    def _race(self, names: Sequence[str], need: int) -> dict[str, RunResult]:
        """Ask each of ``names`` for its standby status at once; the answers in by the time
        :func:`probe_settled` says the choice is made (every one answered, or ``need`` answered and the rest
        silent past the grace). Silent ones are absent; their threads end on their own timeout."""
        answers: dict[str, RunResult] = {}
        arrived = threading.Condition()

        def ask(m: Machine) -> None:
            r = self.transport.run(m, self._status_argv(m), timeout=PROBE_TIMEOUT_S)
            with arrived:
                answers[m.name] = r
                arrived.notify_all()

        for m in self.inventory.named(names):
            threading.Thread(target=ask, args=(m,), name=f"tg-probe-{m.name}", daemon=True).start()
        t0 = time.monotonic()
        with arrived:
            while True:
                ok = {n: _answered_well(r) for n, r in answers.items()}
                left = probe_settled(names, ok, need, time.monotonic() - t0)
                if left is None:
                    return dict(answers)
                arrived.wait(left)

    def _breaker(self, job: Any, wanted: Sequence[str]) -> ladder.BreakerVerdict:
        from trainguard.operators.jobspec import stored_spec

        # the job's spares: the standbys its spec keeps for it, else those the pool holds now (a small job must be
        # able to use them: its share alone may allow less than one eviction per standby)
        spares = (stored_spec(job).standbys if job.spec else 0) or len(self.pool())
        return ladder.breaker(job_machines=len(job.machine_list),
                              evicted_recently=self.fleet.evicted_recently(job.name, self.cfg.breaker_window_s),
                              to_evict=wanted, max_share=self.cfg.breaker_share, window_s=self.cfg.breaker_window_s,
                              spares=spares)

    def eviction_blocked(self, incident_id: int, machine_names: Sequence[str]) -> str:
        """Why evicting ``machine_names`` from the incident's job could not happen now (the breaker, fewer
        standbys in the pool than machines to replace), or "" when it may: asked before a rung stops a job
        that still trains, however slowly, for an eviction (:meth:`evict` checks again, reachability too)."""
        job = self.fleet.job(self.fleet.incident(incident_id).job)
        serving = set(job.machine_list)
        wanted = [n for n in machine_names if n in serving]
        verdict = self._breaker(job, wanted)
        if not verdict.allowed:
            return verdict.reason
        pool = self.pool()
        if len(pool) < len(wanted):
            return (f"{len(wanted)} machines to replace ({', '.join(wanted)}), {len(pool)} standbys in the pool; "
                    f"add machines to the pool (tg_standby_pool) or repair the standbys, then resolve the incident")
        return ""

    def evict(self, incident_id: int, machine_names: Sequence[str], *, reason: str,
              breaker: bool = True, max_step: int | None = None,
              copies: Mapping[str, Sequence[Sequence[Any]] | None] | None = None,
              priority: Sequence[str] = ()) -> dict[str, Any]:
        """Replace ``machine_names`` in the incident's job with standbys (each checked reachable first),
        through the breaker (``breaker`` False: machines that failed to start, not a judgement of the ladder)
        and the checkpoint check (no eviction takes the last copy of a step; ``max_step``: the restart will
        restore no newer step; ``copies``: each machine's checkpoint copies as the stop before it found them,
        handed on by ``stop_job``, else read now). Returns the swaps;
        ``waiting_human`` when the breaker, a lack of standbys or the checkpoints stop it. ``priority``: the
        machines of an over-evicted group with direct evidence; with fewer standbys answering than the group,
        they are swapped first (then as many of the others as there are standbys) and the job restarts on that
        list, the rest of the group ``deferred`` (recorded in the action), where waiting for a human would stall
        the whole job (ByteRobust's partial swap; at PP >= 6 a hang's pipeline outnumbers a pool sized for
        single failures)."""
        inc = self.fleet.incident(incident_id)
        job = self.fleet.job(inc.job)
        serving = set(job.machine_list)
        wanted = [n for n in machine_names if n in serving]
        if not wanted:  # gone from the job: by this incident's eviction (asked again), or otherwise
            done = {old: new for a in self.fleet.actions(incident_id) if a.kind == "evict" and a.outcome == "done"
                    for old, new in json.loads(a.detail or "{}").items() if old in machine_names}
            return {"swaps": done, "reason": "done before"} if done else {"swaps": {}, "reason": "nothing to evict"}
        for a in self.fleet.actions(incident_id):  # a partial swap asked again: what it kept stays
            deferred = (a.evidence or {}).get("deferred") if a.kind == "evict" and a.outcome == "done" else None
            if deferred and set(wanted) <= set(deferred):
                return {"swaps": json.loads(a.detail or "{}"), "reason": "done before", "deferred": deferred}
        verdict = self._breaker(job, wanted)
        key = f"evict:{incident_id}:{','.join(sorted(wanted))}"
        action, created = self.fleet.record_action(
            key, kind="evict", incident_id=incident_id, machines=wanted, dry_run=self.cfg.dry_run,
            evidence={"reason": reason, "breaker": verdict.reason if breaker else "not applied (failed to start)"})
        if not created and action.outcome == "done":
            return {"swaps": json.loads(action.detail or "{}"), "reason": "done before"}
        if breaker and not verdict.allowed:
            self.fleet.finish_action(action.id, "skipped", verdict.reason)
            return self.fleet.wait_for_human(incident_id, verdict.reason)
        standbys, passed_over = self.ready_standbys(len(wanted), why=f" to replace {', '.join(wanted)} in {inc.job}")
        silent = {"passed_over": passed_over} if passed_over else {}
        deferred: list[str] = []
        if len(standbys) < len(wanted):
            must = [n for n in wanted if n in set(priority)]
            why = (f"{len(wanted)} machines to replace ({', '.join(wanted)}), {len(standbys)} standbys answer; add "
                   f"machines to the pool (tg_standby_pool) or repair the standbys, then resolve the incident")
            if not must or len(standbys) < len(must):
                self.fleet.finish_action(action.id, "skipped", why, evidence={"standbys": standbys, **silent})
                return self.fleet.wait_for_human(incident_id, why)
            order = must + [n for n in wanted if n not in set(must)]
            wanted, deferred = order[:len(standbys)], order[len(standbys):]
            reason = (f"{reason}; partial swap: {len(standbys)} standbys for {len(order)} machines, "
                      f"{', '.join(wanted)} swapped (the evidence's first), {', '.join(deferred)} kept for now")
        if copies is not None:  # what the stop found, handed on: no round of reads
            self.memory.copies[inc.job] = {n: None if c is None else [(str(t), int(st), int(r)) for t, st, r in c]
                                     for n, c in copies.items()}
        kept = self.protect_checkpoints(inc.job, wanted, max_step=max_step)
        if kept.get("refused"):
            self.fleet.finish_action(action.id, "skipped", kept["refused"], evidence={"checkpoint": kept, **silent})
            return {**self.fleet.wait_for_human(incident_id, kept["refused"]), "checkpoint": kept}
        plan = dict(zip(sorted(wanted), standbys, strict=False))
        if self.cfg.dry_run:
            self.fleet.finish_action(action.id, "dry_run", json.dumps(plan), evidence={"checkpoint": kept})
            return {"swaps": plan, "dry_run": True, "reason": reason, "checkpoint": kept}
        swaps = self.fleet.swap(inc.job, plan, reason=reason, incident_id=incident_id)
        self.fleet.finish_action(action.id, "done", json.dumps(swaps), evidence={"checkpoint": kept,
                                                                               "standbys": standbys, **silent,
                                                                               **({"deferred": deferred}
                                                                                  if deferred else {})})
        self.fleet.update_incident(incident_id, decided_ts=time.time())
        return {"swaps": swaps, "reason": reason, "checkpoint": kept, **({"deferred": deferred} if deferred else {})}

    def remote_url(self, job: str) -> str:
        """The job's remote checkpoint tier (its spec's, or the reference job's ``--checkpoint-remote`` /
        ``--checkpoint-s3``), or ""."""
        from trainguard.operators.jobspec import stored_spec

        j = self.fleet.job(job)
        return stored_spec(j).remote_url(list(j.train_args))

    def remote_copies(self, url: str, access: S3Access | None = None) -> tuple[set[tuple[int, int]], str]:
        """The ``(step, rank)`` copies in a remote tier, and why not ("" when it answered); an S3 tier through
        ``access`` (default: :func:`trainguard.operators.hooks.s3.s3_access`)."""
        from trainguard.checkpoint.errors import S3TierError
        from trainguard.checkpoint.s3 import open_tier

        try:
            access = access or _access_for(url)
            tier = open_tier(url, endpoint_url=access.endpoint_url, timeout_s=5.0, client=access.client)
            return set(tier.list_copies()), ""
        except S3TierError as exc:
            return set(), str(exc)

    def copies(self, job: str, names: Sequence[str]) -> dict[str, list[tuple[str, int, int]] | None]:
        """The checkpoint copies each of ``names`` holds (``(tier, step, rank)``; None: it did not answer): from
        the stop this controller just made, else read now (``tg-node ckpt list``)."""
        known = self.memory.copies.get(job) or {}
        if all(n in known for n in names):
            return {n: known[n] for n in names}
        results = self.transport.run_many(self.inventory.named(names),
                                          lambda m: [self.inventory.tg_node, "ckpt", "list", "--job", job], timeout=30)
        out: dict[str, list[tuple[str, int, int]] | None] = {}
        for n, r in results.items():
            doc = r.answer()
            if r.ok:
                out[n] = held_copies((doc or {}).get("copies"))
            elif doc is not None and "no checkpoint root" in str(doc.get("error", "")):
                out[n] = []
            else:
                out[n] = None
        return out

    def protect_checkpoints(self, job: str, evict: Sequence[str], *, fresh: bool = False, force: bool = False,
                            max_step: int | None = None) -> dict[str, Any]:
        """Before evicting ``evict``: every rank of the step the job will restore must keep a copy on a machine
        that stays or in the remote tier. If not, the missing copies are rescued from the evicted machines
        (reachable ones) into the remote tier first; failing that the restart falls back to the newest step
        that stays complete; failing that the eviction is ``refused`` (it would destroy the job's progress).
        Returns what was found and done, for the eviction's evidence."""
        from trainguard.operators.jobspec import stored_spec
        from trainguard.operators.policy.checkpoints import eviction_safety

        j = self.fleet.job(job)
        if not stored_spec(j).keeps_checkpoints(list(j.train_args)):
            return {"checked": False, "reason": "the job keeps no checkpoints"}
        world = j.tp * j.pp * j.dp
        if fresh:
            self.memory.copies.pop(job, None)
        serving, known = set(j.machine_list), self.inventory.names()
        names = [*j.machine_list, *(n for n in evict if n not in serving and n in known)]
        copies = self.copies(job, names)
        if max_step is not None:  # the restart restores no newer step: only those count
            copies = {n: None if c is None else [x for x in c if x[1] <= max_step] for n, c in copies.items()}
        url = self.remote_url(job)
        # one way to S3 for the listing and the rescue: the control plane's connection (its endpoint, its keys)
        access = _access_for(url)
        remote, remote_error = self.remote_copies(url, access) if url else (set(), "no remote tier")
        if max_step is not None:
            remote = {x for x in remote if x[0] <= max_step}
        safety = eviction_safety(copies, remote, evict=evict, world_size=world)
        out: dict[str, Any] = {"step": safety.step, "safe": safety.safe, "reason": safety.reason,
                               "unanswered": sorted(n for n, c in copies.items() if c is None)}
        if force and safety.step is not None:  # the listing said safe, the restore said otherwise: take them all
            held = {n: sorted({r for _t, st, r in copies.get(n) or () if st == safety.step}) for n in evict}
            safety = dataclasses.replace(safety, lacking=tuple(sorted({r for rs in held.values() for r in rs})),
                                         rescue={n: rs for n, rs in held.items() if rs})
        elif safety.safe:
            return out
        why = remote_error or "nothing to rescue from"
        if url and safety.rescue and not self.cfg.dry_run:
            step = str(safety.step)
            done = self.transport.run_many(self.inventory.named(sorted(safety.rescue)), lambda m: [
                self.inventory.tg_node, "ckpt", "rescue", "--job", job, "--step", step, "--to", url,
                "--endpoint-url", access.endpoint_url], timeout=600, env=access.env)
            out["rescued"] = {n: [u["rank"] for u in (r.answer() or {}).get("uploaded", [])] if r.ok else r.describe()
                              for n, r in done.items()}
            remote, remote_error = self.remote_copies(url, access)
            remote = {x for x in remote if max_step is None or x[0] <= max_step}
            again = eviction_safety(copies, remote, evict=evict, world_size=world)
            if again.step == safety.step and again.safe and all(isinstance(v, list) and v
                                                                for v in out["rescued"].values()):
                out.update(safe=True, reason=f"step {safety.step}: the last copies of rank(s) {list(safety.lacking)} "
                                             f"were rescued from {', '.join(sorted(safety.rescue))} to the remote tier")
                return out
            why = "; ".join(f"{n}: {v}" for n, v in out["rescued"].items() if isinstance(v, str)) or remote_error \
                or "the rescued copies are not in the remote tier"
        if safety.fallback is not None:
            out.update(fallback=safety.fallback,
                       reason=f"{safety.reason}; they could not be rescued ({why}); the job restarts from step "
                              f"{safety.fallback}, the newest step complete without them")
            return out
        out["refused"] = (f"{safety.reason}; they could not be rescued ({why}) and no older step is complete "
                          f"without them: evicting would destroy the job's progress; bring those machines (or a copy "
                          f"of their checkpoints) back, then resolve the incident")
        return out

    def rollback(self, incident_id: int, revision: str) -> dict[str, Any]:
        inc = self.fleet.incident(incident_id)
        action, created = self.fleet.record_action(f"rollback:{incident_id}:{revision}", kind="rollback",
                                                   incident_id=incident_id, dry_run=self.cfg.dry_run,
                                                   evidence={"to": revision, "from": self.fleet.job(inc.job).revision})
        if created and not self.cfg.dry_run:
            self.fleet.set_revision(inc.job, revision)
            self.fleet.finish_action(action.id, "done", f"revision {revision}")
        self.fleet.update_incident(incident_id, decided_ts=time.time())
        return {"revision": revision}

    def job_logs(self, job: str) -> dict[str, dict[str, Any] | None]:
        """Each machine's ``tg-node logs --job J`` (None: it did not answer)."""
        names = self.fleet.job(job).machine_list
        results = self.transport.run_many(self.inventory.named(names),
                                          lambda m: [self.inventory.tg_node, "logs", "--job", job], timeout=60)
        return {n: (r.answer() if r.reachable and not r.timed_out else None) for n, r in results.items()}

    def before_retry(self, incident_id: int, why: str) -> dict[str, Any]:
        """What to change before restarting a recovery that did not hold (``why``): explicit faults that joined
        the incident are evicted; machines that no longer answer are replaced; when no step could be restored,
        the last copies are rescued from the incident's evicted machines into the remote tier; when the job's
        own code failed, it rolls back to the last known-good revision; else it is tried again as it is (a
        transient failure). Returns ``{"did": what}``, or ``{"give_up": why}`` when nothing is left to try."""
        inc = self.fleet.incident(incident_id)
        job = inc.job
        pending = self.incidents.unhandled_faults(incident_id)
        if pending:
            self.jobs.stop(job)
            ev = self.evict(incident_id, sorted(pending), reason="explicit machine fault that joined the "
                            "incident: " + "; ".join(f"{m}: {k}" for m, k in pending.items()))
            return {"give_up": ev["reason"]} if ev.get("waiting_human") else \
                {"did": "evicted " + ", ".join(f"{a} -> {b}" for a, b in (ev.get("swaps") or {}).items())}
        logs = self.job_logs(job)
        silent = sorted(n for n, doc in logs.items() if doc is None)
        if silent:
            self.jobs.stop(job)
            ev = self.evict(incident_id, silent, reason=f"unreachable after the restart ({why[:200]})")
            return {"give_up": ev["reason"]} if ev.get("waiting_human") else \
                {"did": "replaced unreachable " + ", ".join(f"{a} -> {b}" for a, b in (ev.get("swaps") or {}).items())}
        if any((doc or {}).get("verdict", {}).get("kind") == UNRESTORABLE_KIND for doc in logs.values()):
            evicted = sorted({m for a in self.fleet.actions(incident_id) if a.kind == "evict" and a.outcome == "done"
                              for m in a.machines})
            if not evicted:
                return {"give_up": f"no step can be restored on all ranks and this incident evicted no machine that "
                                   f"could hold the missing copies ({why[:300]})"}
            kept = self.protect_checkpoints(job, evicted, fresh=True, force=True)
            if kept.get("rescued") and kept.get("safe"):
                return {"did": kept["reason"]}
            return {"give_up": f"no step can be restored on all ranks: {kept.get('refused') or kept['reason']}"}
        verdicts = {(doc or {}).get("verdict", {}).get("class") for doc in logs.values()}
        rolled = any(a.kind == "rollback" for a in self.fleet.actions(incident_id))
        good = self.fleet.last_known_good(job, other_than=self.fleet.job(job).revision)
        if "user_code" in verdicts and good and not rolled:
            self.jobs.stop(job)
            self.rollback(incident_id, good)
            return {"did": f"rolled back to {good} (the job's own code failed after the restart)"}
        return {"did": f"restarted again as it was ({why[:160]})"}


def _access_for(url: str) -> S3Access:
    """How to reach a remote tier: an ``s3://`` one through the control plane's S3 connection; a directory
    tier (``file://``) needs nothing."""
    return s3_access() if url.startswith("s3://") else S3Access()
