"""A private PostgreSQL server for tests (:func:`trainguard.emulation.servers.private_postgres`): Debian's
``postgresql`` binaries (installed on first use when missing), a cluster of its own in a temporary folder, reached only
through a Unix socket in that folder (no TCP port), stopped and removed at the end."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

from trainguard.emulation.servers import ensure_pg_binaries, pg_binaries, private_postgres

__all__ = ["ensure_pg_binaries", "pg_binaries", "private_server"]


def private_server() -> Iterator[str]:
    """A server in a temporary folder of its own for a test module (a short path: a Unix socket's path has a
    limit of 107 bytes); yields its URL, then stops it and removes the folder."""
    folder = Path(tempfile.mkdtemp(prefix="tgpg-"))
    try:
        with private_postgres(folder / "pg") as url:
            yield url
    finally:
        shutil.rmtree(folder, ignore_errors=True)
