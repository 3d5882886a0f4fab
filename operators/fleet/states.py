"""A machine's life, as a state machine.

::

    provisioning -> self_check -> standby -> active -> suspect -> evicted -> repair -> self_check ...
                         |            |         |          |                     \\-> retired
                         \\-> repair   \\-> self_check (periodic re-check)   \\-> active (cleared)

* ``provisioning``: being installed; ``self_check``: running its L2 checks before it may serve;
* ``standby``: checked, parked warm, ready to replace a failed machine;
* ``active``: serving a job; ``suspect``: a job's alert or diagnosis points at it, not yet evicted;
* ``evicted``: taken out of its job; ``repair``: waiting for (or in) repair; ``retired``: gone for good.
"""

from __future__ import annotations

from enum import StrEnum


class MachineState(StrEnum):
    """A machine's state (values as stored in the fleet database)."""

    PROVISIONING = "provisioning"
    SELF_CHECK = "self_check"
    STANDBY = "standby"
    ACTIVE = "active"
    SUSPECT = "suspect"
    EVICTED = "evicted"
    REPAIR = "repair"
    RETIRED = "retired"


PROVISIONING = MachineState.PROVISIONING
SELF_CHECK = MachineState.SELF_CHECK
STANDBY = MachineState.STANDBY
ACTIVE = MachineState.ACTIVE
SUSPECT = MachineState.SUSPECT
EVICTED = MachineState.EVICTED
REPAIR = MachineState.REPAIR
RETIRED = MachineState.RETIRED

STATES = (PROVISIONING, SELF_CHECK, STANDBY, ACTIVE, SUSPECT, EVICTED, REPAIR, RETIRED)

TRANSITIONS: dict[str, frozenset[str]] = {
    PROVISIONING: frozenset({SELF_CHECK, RETIRED}),
    SELF_CHECK: frozenset({STANDBY, ACTIVE, REPAIR, RETIRED}),
    STANDBY: frozenset({ACTIVE, SELF_CHECK, REPAIR, RETIRED}),
    ACTIVE: frozenset({SUSPECT, EVICTED, STANDBY}),
    SUSPECT: frozenset({ACTIVE, EVICTED}),
    EVICTED: frozenset({REPAIR, RETIRED}),
    REPAIR: frozenset({SELF_CHECK, RETIRED}),
    RETIRED: frozenset(),
}

# machines that count as serving or able to serve
IN_SERVICE = frozenset({ACTIVE, SUSPECT})


class IncidentState(StrEnum):
    """An incident's state: open (being handled), waiting for a human, or closed (resolved, failed)."""

    OPEN = "open"
    WAITING_HUMAN = "waiting_human"
    RESOLVED = "resolved"
    FAILED = "failed"


OPEN_INCIDENT_STATES = (IncidentState.OPEN, IncidentState.WAITING_HUMAN)
#: a job's states once released (``trainguard job stop``, a launch that failed): its machines may serve another job,
#: and nothing but a new submission runs it again
RELEASED_JOB_STATES = ("stopped", "failed")
INCIDENT_STATES = tuple(IncidentState)


def allowed(from_state: str | None, to_state: str) -> bool:
    """Whether a machine may go from ``from_state`` (None: not known yet) to ``to_state``."""
    if to_state not in TRANSITIONS:
        return False
    if from_state is None:
        return to_state in (PROVISIONING, SELF_CHECK, STANDBY, ACTIVE)  # registering an existing machine
    return to_state in TRANSITIONS.get(from_state, frozenset())
