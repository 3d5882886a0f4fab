"""Errors with a one-line message and a documented exit code.

Every command-line entry point catches :class:`TrainguardError`, prints its
message on one line to stderr (or as a JSON document for ``tg-node``) and exits
with :attr:`TrainguardError.exit_code`.

Exit codes used across trainguard:

====  ===========================================================
0     success / healthy
1     ran, and found something unhealthy (checks, diagnosis)
2     could not run: bad input, missing prerequisite, unreachable
3     an operation was refused because it would be unsafe
====  ===========================================================
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_UNHEALTHY = 1
EXIT_USAGE = 2
EXIT_REFUSED = 3
EXIT_INTERRUPTED = 130  # Ctrl-C (128 + SIGINT), as shells report it

# The words of the checkpoint library's RestoreError for copies that exist but make no complete step: the training
# script prints the error on one line, and the node's log classifier names such an end by them (kind
# ``checkpoint_unrestorable``). Both sides read them from here.
UNRESTORABLE = "copies found but no step can be restored on all"


class TrainguardError(Exception):
    """An error a user can act on; the message says what is wrong and what to do."""

    exit_code = EXIT_USAGE

    def __init__(self, message: str, *, exit_code: int | None = None) -> None:
        super().__init__(message)
        if exit_code is not None:
            self.exit_code = exit_code


class TopologyError(TrainguardError):
    """A parallel layout that does not fit the ranks or machines it was given."""


class InventoryError(TrainguardError):
    """A missing or malformed inventory file, or an unknown machine."""


class FaultError(TrainguardError):
    """An unknown fault kind, or a fault that cannot be injected where asked."""


class ClusterError(TrainguardError):
    """The emulated cluster could not be brought up, down or inspected."""
