"""Committing a :class:`trainguard.checkpoint.engine.Checkpointer`'s steps: a step is committed once every rank
holds it (an all-gather on the control group), and retention keeps the newest ``keep`` steps per tier.

Its methods use the state ``Checkpointer.__init__`` sets up; the class is one of the checkpointer's bases."""

from __future__ import annotations

import contextlib
import time

from trainguard.checkpoint import layout, timing, wire


class Committing:
    """Committing steps every rank holds, and retention.
    A part of :class:`~trainguard.checkpoint.engine.Checkpointer`."""

    def _mark_done(self, step: int) -> None:
        """``step`` is on this rank's disk and its replica acknowledged (caller holds the lock): the commit
        thread's next exchange says so."""
        self._done.append(step)
        self._done_count += 1
        self._persisted.notify_all()

    def _commit_loop(self) -> None:
        """Learn which steps are done on every rank; mark them committed; apply retention."""
        retained = 0.0
        while True:
            stopping = self._writer_finished.is_set()  # every snapshot written, replicated and acknowledged
            with self._lock:
                mine = sorted(self._done)
                said = self._done_count
            try:
                everyone = wire.gather_json({"stop": stopping, "done": mine}, self.ctl, self.world)
            except Exception as exc:
                if not self._stop.is_set():
                    self._error(f"commit exchange failed ({type(exc).__name__}: {str(exc)[:160]}); "
                                f"no more commits this run", kind="commit")
                return
            common = set.intersection(*(set(d["done"]) for d in everyone))
            fresh = sorted(common - self.committed)
            if fresh:
                with self._lock:
                    self.committed.update(fresh)
                    while len(self.committed) > max(64, 2 * self.cfg.keep):  # only the newest matter
                        self.committed.discard(min(self.committed))
                for step in fresh:
                    path = layout.copy_dir(self.root, "local", step, self.rank)
                    with contextlib.suppress(OSError):
                        layout.write_marker(path, layout.COMMITTED, {"step": step, "committed_ts": time.time(),
                                                                     "verify": self.cfg.is_candidate(step)})
            # after commits, and every timing.RETAIN_EVERY_S without any: a rank whose replica stopped (or a peer
            # that never acknowledges) must not stop retention, or the disk fills with uncommitted steps
            if fresh or stopping or time.monotonic() - retained >= timing.RETAIN_EVERY_S:
                self._retain()
                retained = time.monotonic()
            if all(d["stop"] for d in everyone):
                return
            if stopping:
                time.sleep(0.01)
                continue
            # the next round: at most every commit_interval_s, once this rank has a step more to say (each
            # round's all-gather and JSON hold the interpreter lock the training thread needs; a round per
            # snapshot is enough), or timing.COMMIT_IDLE_S without one (a rank that finishes none must not keep the
            # others' rounds waiting for long)
            self._stop.wait(self.cfg.commit_interval_s)
            with self._lock:
                self._persisted.wait_for(lambda said=said: self._done_count != said or self._stop.is_set(),
                                         timeout=timing.COMMIT_IDLE_S)

    def _retain(self) -> None:
        """Delete old copies here. Kept: the newest ``keep`` steps that are committed or still in
        flight (newer than the newest committed), and always the newest committed and the newest
        verified step, and the two newest verification candidates newer than it (the control plane
        verifies them later), and any copy a verification has pinned (``verifying.json``, younger than
        ``layout.PIN_TTL_S``). Older uncommitted steps (skipped by some rank) go."""
        groups = [("local", self.rank)] + [("replica", s) for s in self.sources]
        with self._lock:
            committed = set(self.committed)
        newest_committed = max(committed, default=-1)
        for tier, rank in groups:
            copies = layout.list_copies(self.root, tier, rank=rank)
            candidates = sorted((s for s, _r, _p in copies if s in committed or s > newest_committed), reverse=True)
            keep = set(candidates[:self.cfg.keep]) | {newest_committed}
            verified = [s for s, _r, p in copies if (p / layout.VERIFIED).exists()]
            newest_verified = max(verified, default=-1)
            if verified:
                keep.add(newest_verified)
            # held by their step number alone: a restart (empty committed set) or a long wait for the
            # verifier must not drop them; an uncommitted one is displaced by the next candidates
            waiting = sorted((s for s, _r, _p in copies if s > newest_verified and self.cfg.is_candidate(s)),
                             reverse=True)
            keep.update(waiting[:2])
            keep.update(s for s, _r, p in copies if layout.pinned(p))  # a verification is reading it
            for step, _r, path in copies:
                if step not in keep:
                    layout.remove_copy(path)
        if self.rank == min(self.placement.ranks_on(self.machine_index)):  # one rank per machine does the rest
            self._retain_foreign()

    def _retain_foreign(self) -> None:
        """Delete the copies this machine keeps for ranks it no longer serves: local copies of ranks that are not
        its own now, and replicas no rank of it answers for (their holder is not one of its ranks). A machine
        evicted and swapped back in under other ranks, or a standby that served another placement, keeps them
        otherwise: nothing restores from them (a rank restores from its own machine, its replica holder or the
        remote tier), and over a job's recoveries they filled the machines' disks until the disk-full rung
        evicted healthy machines one after another (measured: 256 MiB disks full after 25 recoveries). Step
        folders left empty go too; a copy a verification is reading stays."""
        mine = set(self.placement.ranks_on(self.machine_index))
        for tier in ("local", "replica"):
            for _step, owner, path in layout.list_copies(self.root, tier):
                if tier == "local":
                    foreign = owner not in mine
                else:
                    holder = (layout.read_json(path / layout.REPLICA_INFO) or {}).get("holder")
                    if holder is None:
                        holder = self.placement.backup_rank(owner) if self.replicate else None
                    foreign = holder not in mine
                if foreign and not layout.pinned(path):
                    layout.remove_copy(path)
            base = self.root / tier
            with contextlib.suppress(OSError):
                for step_dir in base.iterdir():  # empty for a minute: not a copy about to be written
                    if step_dir.is_dir() and not any(step_dir.iterdir()) \
                            and time.time() - step_dir.stat().st_mtime > timing.EMPTY_STEP_S:
                        with contextlib.suppress(OSError):
                            step_dir.rmdir()
