"""Restoring a :class:`trainguard.checkpoint.engine.Checkpointer`'s rank, all ranks together: what each holds,
the same plan on every rank (own copy, replica holder, S3), copies verified as they are read, a bad one
excluded and the plan made again.

Its methods use the state ``Checkpointer.__init__`` sets up; the class is one of the checkpointer's bases."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

from trainguard.checkpoint import layout, wire
from trainguard.checkpoint import manifest as mf
from trainguard.checkpoint.errors import RestoreError, S3TierError
from trainguard.checkpoint.info import RestoreResult
from trainguard.checkpoint.plan import PEER_TIERS, S3_HOLDER, Holding, RestorePlan, explain, plan_restore
from trainguard.checkpoint.shards import apply_state
from trainguard.checkpoint.verify import CopyCheck, Problem, check_data, check_s3_copy, inspect_copy, verify_copy
from trainguard.core.errors import UNRESTORABLE


class Restoring:
    """Restoring this rank's state from the newest step every rank can get.
    A part of :class:`~trainguard.checkpoint.engine.Checkpointer`."""

    def _my_copies(self, *, moved: bool = False) -> list[tuple[int, Path, str]]:
        """``(step, path, tier)`` of the copies this rank answers for: its local ones and the replicas
        it holds for others; with ``moved``, also the copies on this machine that no rank of it answers for now
        (a rank's copy, or a replica held for a rank, left by a launch of the job in which this machine ran other
        ranks), which the machine's lowest rank reports and sends to their owners."""
        found = [(s, p, "local") for s, _r, p in layout.list_copies(self.root, "local", rank=self.rank)]
        here = set(self.placement.ranks_on(self.machine_index))
        report_moved = moved and self.rank == min(here)
        for s, owner, p in layout.list_copies(self.root, "replica"):
            info = layout.read_json(p / layout.REPLICA_INFO) or {}
            holder = info.get("holder")
            if holder == self.rank or (holder is None and self.replicate
                                       and self.placement.backup_rank(owner) == self.rank):
                found.append((s, p, "replica"))
            elif report_moved and holder not in here and not (
                    holder is None and self.replicate and self.placement.backup_rank(owner) in here):
                found.append((s, p, "moved"))
        if report_moved:
            found += [(s, p, "moved") for s, owner, p in layout.list_copies(self.root, "local") if owner not in here]
        return found

    def _scan(self) -> tuple[list[Holding], list[str]]:
        """The copies this rank holds that pass the cheap check; lines for those that do not."""
        holdings, problems = [], []
        for _step, path, tier in self._my_copies(moved=True):
            check = inspect_copy(path, machine=self.machine)
            if not check.ok or check.manifest is None:
                problems += [p.line() for p in check.problems]
                continue
            doc = check.manifest
            holdings.append(Holding(check.step, check.rank, tier, self.rank, mf.topology_key(doc),
                                    str(doc.get("state", {}).get("segment", ""))))
        mem = self._memory
        if mem and mem.get("layout"):  # checked when fetched, as any copy
            holdings.append(Holding(int(mem["step"]), self.rank, "memory", self.rank, str(mem["layout"]),
                                    str(mem.get("segment", ""))))
        return holdings, problems

    def restore(self) -> RestoreResult | None:
        """Restore the newest step every rank can get (all ranks call this together, before training).

        Returns None when there is nothing to restore (or restore is "off"); raises
        :class:`RestoreError` when copies exist but no step can be restored on all ranks
        (mode "auto" or "require"), or nothing exists in mode "require".
        """
        t0 = time.monotonic()
        mode = self.cfg.restore
        holdings, problems = self._scan() if mode != "off" else ([], [])
        mine = {"holdings": [h.as_list() for h in holdings], "problems": problems, "segment": self.segment}
        everyone = wire.gather_json(mine, self.ctl, self.world)
        self.segment = everyone[0]["segment"]  # the new segment's id: rank 0's
        for line in problems:
            self._log(line)
        if mode == "off":
            return None
        every = self._not_after(Holding.from_list(item) for doc in everyone for item in doc["holdings"])
        # S3 is the last resort: listed (a boto3 import and a listing, ~0.5 s) only once disks and
        # replicas cannot give every rank the newest step some rank holds; the same decision on every rank
        newest = max((h.step for h in every if h.layout == self.layout_key), default=-1)
        s3_asked = self.s3 is None
        excluded: set[tuple[int, int, str, int]] = set()
        bad_lines: list[str] = [line for doc in everyone for line in doc["problems"]]
        rounds = 0
        while True:
            plan = plan_restore(every, world_size=self.world, layout=self.layout_key, excluded=excluded)
            if not s3_asked and (plan is None or plan.step < newest):
                every += self._not_after(self._list_s3())
                s3_asked = True
                continue
            if not every:
                if mode == "require":
                    raise RestoreError(f"checkpoint: --restore was given but no copy exists on any of the "
                                       f"{self.world} ranks{' or in S3' if self.s3 else ''}; start without --restore")
                return None
            rounds += 1
            if plan is None:
                why = explain(every, world_size=self.world, layout=self.layout_key, excluded=excluded)
                raise RestoreError(
                    f"checkpoint: {len(every)} {UNRESTORABLE} {self.world} "
                    f"ranks: {why}; see the lines above for damaged copies, or pass --no-restore to start "
                    f"from step 0")
            got, failures, lines = self._execute(plan)
            for line in lines:
                self._log(f"restore of step {plan.step}: {line}")
            results = wire.gather_json({"failures": [list(f) for f in failures], "problems": lines},
                                       self.ctl, self.world)
            all_failures = {tuple(f) for doc in results for f in doc["failures"]}
            bad_lines += [line for doc in results for line in doc["problems"]]
            if not all_failures:
                break
            excluded |= all_failures  # type: ignore[arg-type]
        assert got is not None
        self._apply(got)
        src = plan.sources[self.rank]
        self._memory = None
        if src.tier not in ("local", "memory"):  # this machine gets its own copy back (the saver wrote it)
            self._keep_locally(plan.step, got)
        self._drop_newer(plan.step)
        with self._lock:
            self.committed.add(plan.step)
        result = RestoreResult(step=plan.step, tier=src.tier, holder=src.holder if src.tier == "replica" else -1,
                               seconds=time.monotonic() - t0, counts=plan.counts(), rounds=rounds,
                               problems=bad_lines,
                               data_position=dict(got.manifest.get("data_position", {}) if got.manifest else {}))
        with contextlib.suppress(OSError):
            layout.write_json(self.root / "reports" / f"restore-rank{self.rank}-inc{self.incarnation}.json",
                              {"step": result.step, "tier": result.tier, "holder": result.holder,
                               "seconds": result.seconds, "counts": result.counts, "rounds": rounds,
                               "problems": bad_lines, "segment": self.segment, "ts": time.time()})
        return result

    def _not_after(self, holdings: Any) -> list[Holding]:
        limit = self.cfg.restore_max_step
        return [h for h in holdings if limit is None or h.step <= limit]

    def _drop_newer(self, step: int) -> None:
        """Training goes on from ``step``: the copies of later steps here (local, and replicas held for
        others) belong to the timeline that was left and must never be restored; they go. (Copies in
        S3 are superseded as the new timeline uploads the same steps again.)"""
        if self.link is not None:
            with contextlib.suppress(OSError):
                self.link.send({"op": "forget", "after": step})
        newer = [(s, p) for s, p, _tier in self._my_copies() if s > step]
        for _s, p in newer:
            with contextlib.suppress(OSError):
                layout.remove_copy(p)
        dropped = sorted({s for s, _p in newer})
        if dropped:
            self._log(f"restored step {step}: dropped this rank's copies of the later steps "
                      f"{', '.join(map(str, dropped))} (the timeline they belong to was left)", kind="drop-newer")

    def _list_s3(self) -> list[Holding]:
        """What the S3 tier holds: rank 0 lists, every rank takes part in sharing it."""
        assert self.s3 is not None
        listing: list[list[object]] = []
        error = ""
        if self.rank == 0:
            try:
                listing = [Holding(step, rank, "s3", S3_HOLDER, self.layout_key).as_list()
                           for (step, rank) in self.s3.list_copies()]
            except S3TierError as exc:
                error = str(exc)
        shared = wire.gather_json({"s3": listing, "error": error}, self.ctl, self.world)[0]
        if shared["error"]:
            self._log(f"tier s3 unavailable for restore: {shared['error']}")
        return [Holding.from_list(item) for item in shared["s3"]]

    def _execute(self, plan: RestorePlan) -> tuple[CopyCheck | None, set[tuple[int, int, str, int]], list[str]]:
        """Get this rank's copy for ``plan`` (and serve the peers it holds replicas for)."""
        failures: set[tuple[int, int, str, int]] = set()
        lines: list[str] = []
        got: CopyCheck | None = None
        step = plan.step

        def fail(h: Holding, check: CopyCheck | None, what: str = "") -> None:
            failures.add(h.key)
            if check is not None:
                lines.extend(p.line() for p in check.problems)
            if what:
                lines.append(what)

        for holder, owner in plan.transfers():
            h = plan.sources[owner]
            if holder == self.rank:
                check = verify_copy(self._held_copy(h), machine=self.machine, keep_files=True)
                if check.ok and not self._same_segment(check, plan):
                    check.problems.append(Problem(self.machine, owner, step, "replica", check.path,
                                                  "copy belongs to another training segment"))
                if check.ok:
                    wire.send_copy(self.data, owner, step=step, manifest=check.manifest_bytes,
                                   files=[(n, [d]) for n, d in check.files.items()], tag=wire.TAG_RESTORE)
                else:
                    wire.send_copy(self.data, owner, step=step, ok=False, tag=wire.TAG_RESTORE)
                    fail(h, check)
            if owner == self.rank:
                rstep, ok, manifest, files = wire.recv_copy(self.data, holder, tag=wire.TAG_RESTORE)
                if not ok or rstep != step:
                    fail(h, None)  # the holder reported why
                    continue
                check = self._check_received(manifest, files, rank=owner, step=step, tier="replica",
                                             path=Path(f"received from rank {holder}"), deep=True, keep=True)
                if check.ok:
                    got = check
                else:
                    fail(h, check)
        src = plan.sources[self.rank]
        check = None
        where = "s3" if src.tier == "s3" else self.machine
        if src.tier == "local":
            check = verify_copy(layout.copy_dir(self.root, "local", step, self.rank), machine=self.machine,
                                keep_files=True)
        elif src.tier in PEER_TIERS and src.holder == self.rank:  # a copy of its own this rank holds as a peer's
            check = verify_copy(self._held_copy(src), machine=self.machine, keep_files=True)
        elif src.tier == "memory":
            fetched = self.link.fetch(step) if self.link is not None else None
            if fetched is None:
                fail(src, None, f"machine {self.machine} rank {self.rank} step {step} tier memory: the saver no "
                                f"longer holds it")
            else:
                check = check_data(fetched[0], fetched[1], machine=self.machine, rank=self.rank, step=step,
                                   tier="memory", path=f"saver memory of {self.root}", deep=True, keep_files=True)
        elif src.tier == "s3":
            if self.s3 is None:
                fail(src, None, f"machine {self.machine} rank {self.rank} step {step} tier s3: no S3 tier configured")
            else:
                check = check_s3_copy(self.s3, step, self.rank, deep=True, keep_files=True)
                if check.ok and check.manifest and mf.topology_key(check.manifest) != self.layout_key:
                    check.problems.append(Problem("s3", self.rank, step, "s3", check.path,
                                                  f"saved with layout {mf.topology_key(check.manifest)}"))
        if check is not None:  # this rank's own copy (local, memory, S3), judged alike
            if check.ok and not self._same_segment(check, plan):
                check.problems.append(Problem(where, self.rank, step, src.tier, check.path,
                                              "copy belongs to another training segment"))
            if check.ok:
                got = check
            else:
                fail(src, check)
        return got, failures, lines

    def _held_copy(self, h: Holding) -> Path:
        """Where this rank's machine keeps the copy ``h`` it holds for ``h.rank``: the replica folder, or for a moved
        copy whichever of the owner's local and replica folders holds that step."""
        replica = layout.copy_dir(self.root, "replica", h.step, h.rank)
        if h.tier == "moved":
            local = layout.copy_dir(self.root, "local", h.step, h.rank)
            if (local / layout.MANIFEST).exists():
                return local
        return replica

    @staticmethod
    def _same_segment(check: CopyCheck, plan: RestorePlan) -> bool:
        seg = str((check.manifest or {}).get("state", {}).get("segment", ""))
        return not plan.segment or not seg or seg == plan.segment

    def _apply(self, check: CopyCheck) -> None:
        from safetensors.torch import load

        assert check.manifest is not None
        # load_state_dict copies into the live parameters and moves optimizer state to their devices
        tensors = {name: load(bytes(data)) for name, data in check.files.items()}
        apply_state(self.model, self.optimizer, tensors, check.manifest["state"])

    def _keep_locally(self, step: int, check: CopyCheck) -> None:
        dest = layout.copy_dir(self.root, "local", step, self.rank)
        try:
            layout.write_copy(dest, check.manifest_bytes, [(n, [d]) for n, d in check.files.items()],
                              fsync=self.cfg.fsync)
        except OSError as exc:
            self._error(f"step {step} tier local: keeping the restored copy at {dest} failed "
                        f"({exc.strerror or exc})", kind="local-write")
