"""Stop-time diagnosis: L1, L2 and L3 in pairs of neighbours (and the alignment test), judged with the peers of
the same round, a failure run again alone before it counts; the probe of a silent agent.

A diagnosis measures; the ladder decides what to do with its report (evict what failed, restart in place). How a
reading is judged belongs to the measurement, so it lives here, beside the rounds it judges. A diagnosis runs while
other machines are diagnosed beside it, on hosts that may be busy: an absolute floor alone (a memory bandwidth of
0.5 GB/s) fails healthy machines that merely share their cores. So:

* a *measurement* (a bandwidth) is judged against the peers measured in the same round: a machine fails it only when
  it is also far below the median of its peers (less than :data:`PEER_SHARE` of it); when every machine is slow, the
  load is shared and nobody fails on it (:func:`forgiven_by_peers`);
* a *correctness* failure (a wrong matmul result, a copy that came back different, a collective that delivered wrong
  data, a GPU missing) fails on its own;
* a failed reading is repeated, alone, before it can evict.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping, Sequence
from typing import Any

from trainguard.node_tools.inventory import Machine
from trainguard.node_tools.transport import RunResult
from trainguard.operators.control.base import Part
from trainguard.operators.fleet import states
from trainguard.operators.policy import sdc

#: a measurement below this share of the median of the peers measured in the same round fails
PEER_SHARE = 0.5
#: tests whose failure can be a measurement below a floor (the rest are correctness)
MEASURED = {"memory": "gbps"}


def _measured_only(doc: Mapping[str, Any]) -> dict[str, float] | None:
    """The measurements of a report whose failed tests all failed a floor only: test -> value; None when a
    correctness test failed (or a failed test has no measurement)."""
    out: dict[str, float] = {}
    for t in doc.get("tests") or []:
        if t.get("ok") or t.get("name") == "collective_neighbours":
            continue
        key = MEASURED.get(str(t.get("name")))
        value = ((t.get("details") or {}).get(key)) if key else None
        if not isinstance(value, (int, float)) or "below the floor" not in str(t.get("reason", "")) or \
                "came back different" in str(t.get("reason", "")):
            return None
        out[str(t["name"])] = float(value)
    return out


def _value(doc: Mapping[str, Any], test: str) -> float | None:
    for t in doc.get("tests") or []:
        if t.get("name") == test:
            value = (t.get("details") or {}).get(MEASURED[test])
            return float(value) if isinstance(value, (int, float)) else None
    return None


def forgiven_by_peers(round_docs: Mapping[str, Mapping[str, Any] | None]) -> dict[str, str]:
    """Machines of one round (machine -> its L2 report) whose only failures are measurements below a floor
    while they are not far below their peers' median: machine -> why it passes. With no peer measured, the
    floor stands."""
    out: dict[str, str] = {}
    for machine, doc in round_docs.items():
        measured = _measured_only(doc) if doc else None
        if not measured:
            continue
        whys = []
        for test, value in measured.items():
            peers = [v for m, d in round_docs.items() if m != machine and d
                     for v in [_value(d, test)] if v is not None]
            if not peers:
                break
            median = statistics.median(peers)
            if value < PEER_SHARE * median:
                break
            whys.append(f"{test} {value:.3g} is {value / median:.0%} of its {len(peers)} peers' median "
                        f"{median:.3g}, measured in the same round: the load is shared")
        else:
            out[machine] = "; ".join(whys)
    return out


def _digest(r: RunResult) -> str | None:
    """The alignment digest of a ``tg-node align`` or ``tg-node diag --level 3 --align`` run (None when
    it did not run through: that machine disagrees with any majority)."""
    doc = r.answer() or {}
    part = doc if doc.get("test") == "align" else doc.get("align") or {}
    return part.get("digest") if part.get("exit_code", 1) == 0 else None


def neighbour_groups(names: Sequence[str]) -> list[list[str]]:
    """L3's groups: neighbours in pairs, an odd one out joining the last pair."""
    groups = [list(names[i:i + 2]) for i in range(0, len(names), 2)]
    if len(groups) > 1 and len(groups[-1]) == 1:
        odd = groups.pop()
        groups[-1] += odd
    return groups


def _seconds(docs: Mapping[str, Any], results: Mapping[str, RunResult]) -> dict[str, dict[str, float]]:
    """Where a round's time went on each machine: the whole session (``session``) and each test the machine ran."""
    out: dict[str, dict[str, float]] = {}
    for n, r in results.items():
        tests = (docs.get(n) or {}).get("tests") or []
        out[n] = {"session": round(r.duration_s, 3),
                  **{t["name"]: t["duration_s"] for t in tests if isinstance(t.get("duration_s"), int | float)}}
    return out


class Diagnosis(Part):
    """Tests on the job's machines while it is stopped."""

    def diagnose(self, job: str, machine_names: Sequence[str] | None = None, *, levels: Sequence[int] = (1, 2, 3),
                 align: bool = False) -> dict[str, Any]:
        """Stop-time diagnosis on the job's machines (or ``machine_names``): L1, then L2, then L3 in pairs
        of neighbours; a machine failing a level (or unreachable) is not tested further. L2 runs every test
        of L1 in the same process, so with both asked only L2 runs (one round of sessions and one import
        of torch per machine less; the report has no ``L1`` then), and with L3 asked too, L2 and L3 run in
        one test process per machine (:meth:`_l2_l3`). NaN adds the alignment test, run in L3's test process
        after its collective (alone when L3 does not run): a machine whose digest differs from a strict
        majority fails (a tie is broken by self-checked standbys). Robust to load
        (see the module): at most ``diag_concurrency`` machines at once, measurements
        judged against the peers of the same round, and a failed L1 or L2 repeated alone before it counts."""
        names = list(machine_names or self.fleet.job(job).machine_list)
        failed: dict[str, str] = {}
        report: dict[str, Any] = {}
        t0 = time.time()
        aligned: dict[str, RunResult] | None = None
        todo = [lv for lv in levels if not (lv == 1 and 2 in levels)]
        if 2 in todo and 3 in todo and len(names) >= 2:
            aligned = self._l2_l3(names, align=align, failed=failed, report=report)
            todo = [lv for lv in todo if lv not in (2, 3)]
        for level in todo:
            alive = [n for n in names if n not in failed]
            if not alive:
                break
            if level == 3:
                results = self._l3(alive, align=align)
                if align and results:
                    aligned = results
                docs = {n: r.answer() for n, r in results.items()}
                bad = {n: (doc or {}).get("reasons") or [results[n].describe()] for n, doc in docs.items()
                       if not (doc and doc.get("healthy"))}
                report["L3"] = {}
            else:
                docs, bad, report[f"L{level}"] = self._judged(alive, level)
            for n in docs:
                report[f"L{level}"].setdefault(n, {"healthy": n not in bad, "reasons": bad.get(n, [])})
                if n in bad:
                    failed[n] = f"L{level}: " + "; ".join(bad[n])[:300]
        if align:
            alive = [n for n in names if n not in failed]
            if aligned is None:
                aligned = self._align(alive)
            digests = {n: _digest(r) for n, r in aligned.items() if n in alive}
            trusted, odd, why = sdc.align_outliers(digests)
            if trusted is None and len(digests) > 1:  # no majority: a tie is broken by evidence, never by order
                reference = self.reference_digest(exclude=names)
                report["align_reference"] = reference
                if reference is not None:
                    trusted, odd, why = sdc.align_outliers(digests, reference)
            for n in odd:
                failed[n] = f"align: digest {digests.get(n)} differs from {trusted} ({why})"
            report["align"] = digests
            if trusted is None:
                report["align_inconclusive"] = why
        return {"job": job, "machines": names, "failed": failed, "report": report,
                "seconds": round(time.time() - t0, 3)}

    def _waves(self, machines: Sequence[Machine], argv_for: Any, *, timeout: float) -> dict[str, RunResult]:
        """Run on ``machines`` at most ``diag_concurrency`` at a time."""
        out: dict[str, RunResult] = {}
        size = max(1, self.cfg.diag_concurrency)
        for i in range(0, len(machines), size):
            out.update(self.transport.run_many(machines[i:i + size], argv_for, timeout=timeout))
        return out

    def _l2_bad(self, docs: Mapping[str, Any], results: Mapping[str, RunResult]) -> tuple[dict[str, list[str]],
                                                                                         dict[str, str]]:
        """The L1/L2 failures of one round (machine -> reasons, the collective left out) after the peers'
        judgement, and the machines it forgave (machine -> why)."""
        bad: dict[str, list[str]] = {}
        for n, doc in docs.items():
            tests = (doc or {}).get("tests") or []
            reasons = [f"{t['name']}: {t['reason']}" for t in tests
                       if t["name"] != "collective_neighbours" and not t["ok"]]
            if doc is None or (reasons if tests else not doc.get("healthy")):
                bad[n] = reasons or (doc or {}).get("reasons") or [results[n].describe()]
        forgiven = forgiven_by_peers({n: d for n, d in docs.items() if d})
        return {n: r for n, r in bad.items() if n not in forgiven}, forgiven

    def _judged(self, names: Sequence[str], level: int, *, first: Mapping[str, Any] | None = None
                ) -> tuple[dict[str, Any], dict[str, list[str]], dict[str, Any]]:
        """L1 or L2 on ``names`` (in waves), judged with their peers, a failed machine run again alone: the
        documents, the machines that failed twice (machine -> reasons) and the report. ``first``: the
        documents of a round these machines already failed once (they run once more, alone, and are judged
        with that round's peers)."""
        argv = [self.inventory.tg_node, "diag", "--level", str(level)]
        if first is not None:
            results = {n: r for n in names for n, r in self.transport.run_many(
                self.inventory.named([n]), lambda m: argv, timeout=self.cfg.diag_timeout_s).items()}
        else:
            results = self._waves(self.inventory.named(names), lambda m: argv, timeout=self.cfg.diag_timeout_s)
        docs = {n: r.answer() for n, r in results.items()}
        bad, forgiven = self._l2_bad({**(first or {}), **docs}, results)
        bad = {n: r for n, r in bad.items() if n in docs}
        report: dict[str, Any] = {n: {"healthy": True, "reasons": [], "forgiven": why} for n, why in forgiven.items()
                                  if n in docs}
        if first is not None:
            for n in names:
                report[n] = {"healthy": n not in bad, "reasons": bad.get(n, []), "again": True,
                             **({"forgiven": forgiven[n]} if n in forgiven else {})}
            return docs, bad, report
        if bad:  # one failed reading does not evict: each is run again, alone
            _again, bad, again = self._judged(sorted(bad), level, first=docs)
            report.update(again)
        return docs, bad, report

    def _l2_l3(self, names: Sequence[str], *, align: bool, failed: dict[str, str],
               report: dict[str, Any]) -> dict[str, RunResult] | None:
        """L2 and then L3 (and the alignment test) in one round of sessions and one test process per
        machine: every machine of a pair runs its L2 tests, then they meet at the collective. L2 is judged
        with the peers of the round and a failure run again alone (:meth:`_judged`); a machine failing L2
        twice fails; a failed collective counts against a machine whose partners passed L2 the first time,
        and one whose partner failed L2 (or that passed L2 only the second time) is tested again with a
        healthy peer (L3 alone). Fills ``failed`` and ``report`` (``L2``, ``L3``); returns the runs when they
        carry the alignment digests."""
        results = self._l3(names, align=align, level=2)
        docs = {n: r.answer() for n, r in results.items()}
        report["seconds"] = _seconds(docs, results)
        first_bad, forgiven = self._l2_bad(docs, results)
        report["L2"] = {n: {"healthy": True, "reasons": [], "forgiven": why} for n, why in forgiven.items()}
        report["L3"] = {}
        l2_failed: dict[str, list[str]] = {}
        if first_bad:  # the combined run was the first reading: each failure runs once more, alone
            _docs, l2_failed, again = self._judged(sorted(first_bad), 2, first=docs)
            report["L2"].update(again)
        for n, reasons in l2_failed.items():
            report["L2"][n] = {**report["L2"].get(n, {}), "healthy": False, "reasons": reasons}
            failed[n] = "L2: " + "; ".join(reasons)[:300]
        group_of = {n: g for g in neighbour_groups(names) for n in g}
        l3_failed: dict[str, str] = {}
        for n in names:
            report["L2"].setdefault(n, {"healthy": n not in l2_failed, "reasons": []})
            if n in first_bad:
                continue
            coll = next((t for t in (docs.get(n) or {}).get("tests") or [] if t["name"] == "collective_neighbours"),
                        None)
            ok = bool(coll and coll["ok"])
            report["L3"][n] = {"healthy": ok, "reasons": [] if ok else [
                f"collective_neighbours: {coll['reason']}" if coll else "collective_neighbours: did not run"]}
            if not ok:
                l3_failed[n] = report["L3"][n]["reasons"][0]
        unsure = [n for n in l3_failed if any(p in first_bad for p in group_of[n] if p != n)]
        unsure += [n for n in first_bad if n not in l2_failed]  # passed L2 the second time: L3 not yet seen
        for n, why in l3_failed.items():
            if n not in unsure:
                failed[n] = f"L3: {why}"[:300]
        if unsure:  # their partner failed L2 (or they did, once): the collective said nothing of them
            peers = [n for n, v in report["L3"].items() if v["healthy"]][: 1 if len(unsure) == 1 else 0]
            for n, r in self._l3(unsure + peers).items():
                if n not in unsure:
                    continue
                doc = r.answer()
                ok = bool(doc and doc.get("healthy"))
                report["L3"][n] = {"healthy": ok, "again": True,
                                   "reasons": [] if ok else (doc or {}).get("reasons") or [r.describe()]}
                if not ok:
                    failed[n] = "L3: " + "; ".join(report["L3"][n]["reasons"])[:300]
        return results if align else None

    def reference_digest(self, *, exclude: Sequence[str] = (), standbys: int = 2) -> str | None:
        """The alignment digest of self-checked standbys (up to ``standbys`` of them, when they agree): the
        reference a split of the job's machines is judged by. None when no standby answers or they differ."""
        names = [m.name for m in self.fleet.machines(state=states.STANDBY)
                 if m.name not in exclude and m.name in self.inventory.names()][:standbys]
        if not names:
            return None
        digests = {_digest(r) for r in self._align(names).values()}
        return digests.pop() if len(digests) == 1 and None not in digests else None

    def _align(self, names: Sequence[str]) -> dict[str, RunResult]:
        return self.transport.run_many(self.inventory.named(names), lambda m: [self.inventory.tg_node, "align"],
                                       timeout=60)

    def _l3(self, names: Sequence[str], *, align: bool = False, level: int = 3) -> dict[str, RunResult]:
        """L3 in pairs of neighbours (an odd one out joins the last pair); with ``align``, each machine's
        alignment test in the same test process, after the collective; with ``level`` 2, L2's tests first,
        in that process too."""
        groups = neighbour_groups(names)
        argv: dict[str, list[str]] = {}
        for gi, group in enumerate(groups):
            master = self.inventory.machine(group[0])
            for rank, n in enumerate(group):
                argv[n] = [self.inventory.tg_node, "diag", "--level", str(level), "--rank", str(rank), "--world-size",
                           str(len(group)), "--master-addr", master.address, "--master-port", str(29300 + gi),
                           "--timeout-s", "60", *(["--align"] if align else [])]
        if len(names) < 2:
            return {}
        out: dict[str, RunResult] = {}
        size = max(2, self.cfg.diag_concurrency)
        wave: list[str] = []
        for group in [*groups, []]:  # whole groups only: a pair meets at its collective
            if wave and (not group or len(wave) + len(group) > size):
                out.update(self.transport.run_many(self.inventory.named(wave), lambda m: argv[m.name],
                                                   timeout=self.cfg.diag_timeout_s))
                wave = []
            wave += group
        return out

    def probe(self, incident_id: int, machine_names: Sequence[str], *, timeout_s: float = 60.0) -> dict[str, Any]:
        """Machines whose agent went silent: reach each over SSH and run L1 (``tg-node diag --level 1``).
        Unreachable, timed out or unhealthy: ``faulty`` (machine -> why). Healthy: its agent is restarted
        (``tg-node agent --restart``; ``restarted``: machine -> what happened). Every probe is an action of
        the incident with its evidence."""
        names = [n for n in machine_names if n in self.inventory.names()]
        results = self.transport.run_many(self.inventory.named(names),
                                          lambda m: [self.inventory.tg_node, "diag", "--level", "1"], timeout=timeout_s)
        faulty: dict[str, str] = {}
        healthy = []
        for n, r in results.items():
            doc = r.answer() or {}
            if not r.reachable or r.timed_out:
                faulty[n] = r.describe()[:300]
            elif not doc.get("healthy"):
                faulty[n] = "failed L1: " + "; ".join(doc.get("reasons") or [r.describe()])[:300]
            else:
                healthy.append(n)
        restarted: dict[str, str] = {}
        if healthy and not self.cfg.dry_run:
            again = self.transport.run_many(self.inventory.named(healthy),
                                            lambda m: [self.inventory.tg_node, "agent", "--restart"], timeout=30)
            for n, r in again.items():
                doc = r.answer() or {}
                restarted[n] = (f"passed L1; its agent was {doc.get('before', {}).get('agent', {}).get('state', '?')}"
                                f" and runs again (pid {doc.get('after', {}).get('agent', {}).get('pid')})"
                                if r.ok else f"passed L1, but its agent could not be restarted: {r.describe()[:200]}")
        for n in names:
            self.fleet.record_action(f"probe:{incident_id}:{n}", kind="probe", incident_id=incident_id, machines=[n],
                                     dry_run=self.cfg.dry_run,
                                     evidence={"faulty": faulty.get(n), "restarted": restarted.get(n)})
        self.fleet.update_incident(incident_id, decided_ts=time.time())
        return {"machines": names, "faulty": faulty, "restarted": restarted}

