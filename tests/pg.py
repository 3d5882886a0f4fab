"""A private PostgreSQL server for tests: Debian's ``postgresql`` binaries (installed on first use when
missing), a cluster of its own in a temporary folder, reached only through a Unix socket in that folder (no
TCP port), stopped and removed at the end.

PostgreSQL refuses to run as root; under root the server runs as the ``postgres`` system user (the folder is
handed to it)."""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

PORT = 5433  # names the socket file; nothing listens on TCP


def binaries() -> Path | None:
    """The folder of the newest installed PostgreSQL's server binaries, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def ensure_binaries() -> Path:
    """The server binaries' folder, installing Debian's ``postgresql`` with apt-get when it is missing (root
    only, once), as the emulated cluster installs ``openssh-server``."""
    found = binaries()
    if found is not None:
        return found
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise RuntimeError("PostgreSQL is not installed and cannot be installed here: apt-get install postgresql")
    from node_tools.cluster import apt_install
    from node_tools.errors import ClusterError

    try:
        apt_install("postgresql")
    except ClusterError as exc:
        raise RuntimeError(str(exc)) from None
    found = binaries()
    if found is None:
        raise RuntimeError("postgresql was installed but no pg_ctl was found under /usr/lib/postgresql")
    return found


def _as_server_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    pwd.getpwnam("postgres")  # KeyError: no such user
    return ["runuser", "-u", "postgres", "--"]


@contextlib.contextmanager
def server(folder: Path) -> Iterator[str]:
    """A running server with an empty database ``tg``; yields its SQLAlchemy URL."""
    bin_dir = ensure_binaries()
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "data"
    prefix = _as_server_user()
    if prefix:
        os.chmod(folder.parent, 0o755)  # the server user must reach its folder
        shutil.chown(folder, "postgres", "postgres")
    run = lambda *argv: subprocess.run([*prefix, *argv], check=True, capture_output=True, text=True,  # noqa: E731
                                       timeout=120)
    run(str(bin_dir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync", "-E", "UTF8")
    options = f"-k {folder} -p {PORT} -c listen_addresses='' -c fsync=off -c max_connections=100"
    run(str(bin_dir / "pg_ctl"), "-D", str(data), "-l", str(folder / "server.log"), "-o", options, "-w", "start")
    try:
        run(str(bin_dir / "createdb"), "-h", str(folder), "-p", str(PORT), "-U", "postgres", "tg")
        yield f"postgresql+psycopg://postgres@/tg?host={folder}&port={PORT}"
    finally:
        subprocess.run([*prefix, str(bin_dir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop"],
                       capture_output=True, timeout=60, check=False)
        shutil.rmtree(folder, ignore_errors=True)


def private_server() -> Iterator[str]:
    """A server in a temporary folder of its own for a test module (a short path: a Unix socket's path has a
    limit of 107 bytes); yields its URL, then stops it and removes the folder."""
    folder = Path(tempfile.mkdtemp(prefix="tgpg-"))
    try:
        with server(folder / "pg") as url:
            yield url
    finally:
        shutil.rmtree(folder, ignore_errors=True)
