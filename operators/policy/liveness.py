"""Liveness of trainguard's own parts, as plain functions: is a machine's agent still talking?

An agent rewrites its heartbeat on the bus every few seconds (:meth:`trainguard.node_tools.bus.AlertBus.beat`). The
guardian lists the heartbeats and keeps, per machine, the change token it last saw and *when it saw it
change* by its own clock: neither the agent's clock nor the storage's is trusted. An agent whose heartbeat
did not change for ``silent_s`` on a machine that serves a running job is silent (stopped, hung, its
machine gone or cut off); the guardian reports it once per silence as an ``agent_silent`` alert of its
own, and the ladder probes the machine. An agent still silent ``repeat_s`` after it was reported is reported
again: its alert may have joined an incident about something else that closed without probing it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

#: an agent silent this long on a machine of a running job is an incident (its heartbeat: every 2 s)
DEFAULT_SILENT_S = 15.0
#: an agent still silent this long after it was reported is reported again
DEFAULT_REPEAT_S = 60.0
#: an agent whose heartbeat did not change for this long is quiet (one missed beat and a half): not yet silent, but
#: not to be waited for: a batch of alerts need not wait for it (:func:`heard_from_all`), and an incident's sessions
#: give its machine a short TCP handshake (:class:`trainguard.operators.hooks.reach.IncidentReach`)
QUIET_S = 3.0


def quiet_for(state: Mapping[str, Mapping[str, Any]], machine: str, now: float) -> float:
    """How long ``machine``'s agent has been quiet by ``state`` (an :class:`AgentWatch`'s), seconds; 0.0 when it
    was never seen (nothing to say it stopped)."""
    st = state.get(machine)
    try:
        return max(0.0, now - float(st["changed_ts"])) if st else 0.0
    except (KeyError, TypeError, ValueError):
        return 0.0


def heard_from_all(batch: Sequence[Mapping[str, Any]], watched: Mapping[str, str],
                   state: Mapping[str, Mapping[str, Any]], now: float, *, quiet_s: float = QUIET_S) -> bool:
    """Whether every machine serving a job that ``batch``'s alerts name (``watched``: machine -> its job) said
    something in it, or has an agent quiet for ``quiet_s`` (``state``: the agents as the guardian saw them): then
    nothing more is on its way for the batch's settle window to gather (a hang in a collective: every survivor's
    ranks time out together, and a lost machine's agent has stopped beating)."""
    jobs = {a.get("job") for a in batch if a.get("job")}
    if not jobs:
        return False
    said = {a.get("machine") for a in batch}
    serving = [m for m, job in watched.items() if job in jobs]
    return bool(serving) and all(m in said or quiet_for(state, m, now) >= quiet_s for m in serving)


@dataclass
class AgentWatch:
    """What the guardian saw of each machine's heartbeat.

    Attributes:
        silent_s: seconds without a change that make an agent silent.
        repeat_s: seconds after which an agent still silent is reported again.
        state: machine -> ``{"token", "changed_ts", "reported_ts"}`` (``reported_ts``: when this silence
            was reported; None while the agent talks). Kept in the fleet database between guardian runs.
    """

    silent_s: float = DEFAULT_SILENT_S
    repeat_s: float = DEFAULT_REPEAT_S
    state: dict[str, dict[str, Any]] = field(default_factory=dict)

    def observe(self, tokens: Mapping[str, str], watched: Mapping[str, str], now: float) -> list[dict[str, Any]]:
        """Take one listing of the heartbeats (``tokens``: machine -> change token) for the ``watched``
        machines (machine -> the job it serves) at ``now`` (the guardian's clock); returns the machines that
        became silent with this listing: ``{"machine", "job", "silent_s", "last_change_ts"}`` each. A
        machine seen for the first time gets ``silent_s`` from now; one that talks again is forgiven; one still
        silent ``repeat_s`` after its report is reported again."""
        silent = []
        for machine, job in sorted(watched.items()):
            token = tokens.get(machine, "")
            st = self.state.get(machine)
            if st is None or token != st["token"]:
                self.state[machine] = {"token": token, "changed_ts": now, "reported_ts": None}
                continue
            quiet = now - float(st["changed_ts"])
            reported = st["reported_ts"]
            if quiet > self.silent_s and (reported is None or now - float(reported) > self.repeat_s):
                st["reported_ts"] = now
                silent.append({"machine": machine, "job": job, "silent_s": round(quiet, 1),
                               "last_change_ts": st["changed_ts"]})
        return silent

    def silent_alert(self, found: Mapping[str, Any], now: float) -> dict[str, Any]:
        """The guardian's own ``agent_silent`` alert for one machine :meth:`observe` found silent."""
        from trainguard.node_tools.alerts import Alert

        a = Alert("agent_silent", found["machine"], severity="fault", job=found["job"], ts=now,
                  evidence={"silent_s": found["silent_s"], "last_change_ts": found["last_change_ts"],
                            "threshold_s": self.silent_s, "source": "guardian"})
        a.received_ts = now
        return a.record()
