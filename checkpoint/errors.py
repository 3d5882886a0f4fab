"""Errors of the checkpoint library: one line each, saying where and what to do next.

Every error is a :class:`trainguard.core.errors.TrainguardError`, so the training
script (and any trainguard command line) prints its message on one line and
exits with its code instead of a traceback.
"""

from __future__ import annotations

from trainguard.core.errors import EXIT_UNHEALTHY, TrainguardError


class CheckpointError(TrainguardError):
    """A checkpoint could not be written, read or placed (bad configuration, unusable root)."""


class RestoreError(CheckpointError):
    """Copies exist but no step can be restored on every rank; the job must not start from scratch silently."""

    exit_code = EXIT_UNHEALTHY


class S3TierError(CheckpointError):
    """The S3 tier is unreachable, refuses a request, or holds something unreadable."""
