"""A machine that does not answer is gone, for the rest of its incident.

A lost machine (power off, a dead link: no RST) costs every session to it the connect timeout and its retries, some
14 s on the defaults, and every task of an incident opens sessions of its own: the hang's stacks, the stop, the
logs, the eviction's checks each waited on the same silent machine again. :class:`IncidentReach` sits between the
controller's services and their transport: while an incident is handled (:meth:`IncidentReach.enter`), the first
session to a machine that finds it unreachable records it against the incident in the fleet database (an action
``unreachable:<incident>:<machine>``, so that the next task, in another process, knows it too), and no later session
of that incident is opened to it: its result says unreachable at once. What the rungs do with such a machine: it is
evicted (``swap_machines`` takes the incident's unreachable machines that still serve the job, as it takes explicit
faults that joined), and a stop with one of the job's machines gone kills the survivors at once instead of waiting
out the grace of a SIGTERM they cannot act on while they hang in a collective with it.

Outside an incident (the reconciler's look, the Fleet page, a script) the proxy passes every call through: a machine
that did not answer once is tried again next time. A host key that does not match and a command that outlived its
timeout are not "unreachable": the machine answered.

A machine whose agent has gone quiet (its heartbeat unchanged for
:data:`~trainguard.operators.policy.liveness.QUIET_S`, as the guardian last saw it) gets :data:`QUIET_HANDSHAKE_S`
for the TCP handshake of the incident's sessions to it instead of the usual 2 s (:meth:`IncidentReach.hurry`): a
live machine's kernel answers in milliseconds however loaded it is, and the 2 s are there so that one lost SYN does
not evict a healthy machine; with a quiet agent too, two signs agree. Its session then fails beside the others'
instead of after them."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from trainguard.node_tools.inventory import Machine
from trainguard.node_tools.transport import RunResult, Transport

GONE = "gone"  # the RunResult.extra key of a session not opened: why the machine counts as gone
#: a machine whose agent is quiet (:data:`~trainguard.operators.policy.liveness.QUIET_S`) is given this long to
#: answer the TCP handshake of a session of the incident
QUIET_HANDSHAKE_S = 0.5


class IncidentReach:
    """A transport that remembers, within one incident, the machines that did not answer (see the module). Every
    other attribute is the wrapped transport's."""

    def __init__(self, inner: Transport) -> None:
        self.inner = inner
        self.incident: int | None = None
        self.gone: dict[str, str] = {}
        self.quiet: dict[str, float] = {}  # machine -> how long its agent was quiet when the incident's task began
        self._record: Callable[[str, str], None] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["inner"], name)

    def enter(self, incident: int, gone: Mapping[str, str], record: Callable[[str, str], None]) -> None:
        """Handle ``incident`` from now on: ``gone`` its machines recorded unreachable so far, ``record(machine, why)``
        what keeps a new one."""
        self.incident, self.gone, self._record = int(incident), dict(gone), record

    def hurry(self, quiet: Mapping[str, float]) -> None:
        """The incident's sessions to ``quiet`` (machine -> how long its agent has been quiet, seconds) get
        :data:`QUIET_HANDSHAKE_S` for their TCP handshake; one that gets no answer is gone as any other, its agent's
        quiet in the why."""
        self.quiet = {m: float(q) for m, q in quiet.items() if m not in self.gone}
        self.inner.quick = dict.fromkeys(self.quiet, QUIET_HANDSHAKE_S)

    def leave(self) -> None:
        self.incident, self.gone, self._record = None, {}, None
        self.quiet, self.inner.quick = {}, {}

    # ---- the sessions ------------------------------------------------------------------------------------------
    def _not_opened(self, machine: str, argv: Sequence[str]) -> RunResult:
        why = self.gone[machine]
        return RunResult(machine, [str(a) for a in argv], None, "",
                         f"{machine}: did not answer earlier in incident {self.incident} ({why[-200:]}); not "
                         f"contacted again", 0.0, reachable=False, extra={"status": "unreachable", GONE: why})

    def _saw(self, results: Mapping[str, RunResult]) -> None:
        if self.incident is None:
            return
        for name, r in results.items():
            if not r.reachable and r.extra.get("status", "unreachable") == "unreachable" and name not in self.gone:
                quiet = f" (its agent quiet for {self.quiet[name]:.1f}s)" if name in self.quiet else ""
                self.gone[name] = (r.stderr.strip()[-260:] or "unreachable") + quiet
                if self._record is not None:
                    self._record(name, self.gone[name])

    def _split(self, machines: Sequence[Machine]) -> tuple[list[Machine], list[Machine]]:
        if self.incident is None:
            return list(machines), []
        return [m for m in machines if m.name not in self.gone], [m for m in machines if m.name in self.gone]

    def run(self, machine: Machine, argv: Sequence[str], **kw: Any) -> RunResult:
        if self.incident is not None and machine.name in self.gone:
            return self._not_opened(machine.name, argv)
        r = self.inner.run(machine, argv, **kw)
        self._saw({machine.name: r})
        return r

    def _many(self, call: Callable[..., dict[str, RunResult]], machines: Sequence[Machine], argv_for: Any,
              **kw: Any) -> dict[str, RunResult]:
        live, gone = self._split(machines)
        out = call(live, argv_for, **kw) if live else {}
        self._saw(out)
        return {**out, **{m.name: self._not_opened(m.name, argv_for(m)) for m in gone}}

    def run_many(self, machines: Sequence[Machine], argv_for: Any, **kw: Any) -> dict[str, RunResult]:
        return self._many(self.inner.run_many, machines, argv_for, **kw)

    def run_two_phase(self, machines: Sequence[Machine], argv_for: Any, **kw: Any) -> dict[str, RunResult]:
        return self._many(self.inner.run_two_phase, machines, argv_for, **kw)

    def open_two_phase(self, machine: Machine, argv: Sequence[str], **kw: Any) -> Any:
        if self.incident is not None and machine.name in self.gone:
            raise OSError(self._not_opened(machine.name, argv).stderr)
        return self.inner.open_two_phase(machine, argv, **kw)
