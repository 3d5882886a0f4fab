"""The servers of the scale-out control plane, run from Debian's packages on this host: PostgreSQL (Airflow's
metadata database and the fleet database), Redis (Celery's broker) and ``moto_server`` (the S3 endpoint of
the alert bus).

Each is a real server with a folder of its own, its own port, a password where it takes one (kept in files
of mode 0600, never on a command line), and a pid it is stopped by. Debian's packages are installed with
apt-get on first use when missing (root), as the emulated cluster installs ``openssh-server``.
"""

from __future__ import annotations

import contextlib
import glob
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from trainguard.core.errors import ClusterError


def _ensure(package: str, found: str | None) -> None:
    if found:
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        raise ClusterError(f"{package} is not installed and cannot be installed here: apt-get install {package}")
    from trainguard.emulation.cluster import apt_install

    apt_install(package)


def _wait_listening(proc: subprocess.Popen[bytes], host: str, port: int, *, what: str, log: Path,
                    timeout_s: float = 60.0) -> None:
    """Wait until ``proc`` listens on ``host``:``port``; ClusterError if it exits or takes too long."""
    deadline = time.monotonic() + timeout_s
    while not _listening(host, port):
        if proc.poll() is not None:
            raise ClusterError(f"{what} exited {proc.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise ClusterError(f"{what} did not listen on {host}:{port} within {timeout_s:.0f}s; see {log}")
        time.sleep(0.1)


def _listening(host: str, port: int) -> bool:
    import socket

    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex((host, port)) == 0


def secret_file(path: Path, text: str) -> Path:
    """Write ``text`` to ``path`` readable by its owner only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def stop_pids(pids: Iterable[int], *, grace_s: float = 10.0) -> list[int]:
    """End the process groups ``pids`` lead, all at once (SIGTERM, SIGKILL after ``grace_s``); the leaders of
    those that ran, in the order given."""
    from trainguard.emulation.standalone import stop_groups

    pids = list(pids)
    ran = stop_groups(pids, grace_s=grace_s, sig=signal.SIGTERM)
    return [pid for pid in pids if pid in ran]


# ---------------------------------------------------------------------------------------------------------
# PostgreSQL
# ---------------------------------------------------------------------------------------------------------
def pg_binaries() -> Path | None:
    """The folder of the newest installed PostgreSQL's server binaries, or None."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/pg_ctl"), key=lambda p: int(Path(p).parts[-3]))
    return Path(found[-1]).parent if found else None


def ensure_pg_binaries() -> Path:
    """The server binaries' folder, installing Debian's ``postgresql`` when it is missing (root, once)."""
    _ensure("postgresql", str(pg_binaries() or ""))
    found = pg_binaries()
    if found is None:
        raise ClusterError("postgresql was installed but no pg_ctl was found under /usr/lib/postgresql")
    return found


@dataclass
class Postgres:
    """A PostgreSQL cluster in ``folder``: a Unix socket there, and TCP on ``host`` when one is given (for
    clients in other network namespaces; password logins only over TCP). PostgreSQL refuses to run as root:
    under root the server runs as the ``postgres`` system user, which owns the folder."""

    folder: Path
    host: str = ""
    port: int = 5433
    max_connections: int = 100
    clients: str = ""  # the network TCP clients log in from (CIDR); default: ``host`` alone

    @property
    def data(self) -> Path:
        return self.folder / "data"

    def _as_server_user(self) -> list[str]:
        if os.geteuid() != 0:
            return []
        pwd.getpwnam("postgres")  # KeyError: no such user
        return ["runuser", "-u", "postgres", "--"]

    def _run(self, *argv: str) -> None:
        proc = subprocess.run([*self._as_server_user(), *argv], capture_output=True, text=True, timeout=120,
                              check=False)
        if proc.returncode:
            raise ClusterError(f"{Path(argv[0]).name} failed: {(proc.stderr or proc.stdout).strip()[-300:]}")

    def start(self) -> None:
        bin_dir = ensure_pg_binaries()
        self.folder.mkdir(parents=True, exist_ok=True)
        if self._as_server_user():
            for parent in self.folder.resolve().parents:  # the server user must reach its folder: traverse only
                mode = parent.stat().st_mode
                if not mode & 0o001:
                    os.chmod(parent, (mode & 0o7777) | 0o001)
            shutil.chown(self.folder, "postgres", "postgres")
        if not (self.data / "PG_VERSION").exists():
            self._run(str(bin_dir / "initdb"), "-D", str(self.data), "--auth-local=trust",
                      "--auth-host=scram-sha-256", "-U", "postgres", "--no-sync", "-E", "UTF8")
            if self.host:
                with open(self.data / "pg_hba.conf", "a", encoding="utf-8") as fh:
                    fh.write(f"host all all {self.clients or self.host + '/32'} scram-sha-256\n")
        if subprocess.run([*self._as_server_user(), str(bin_dir / "pg_ctl"), "-D", str(self.data), "status"],
                          capture_output=True, timeout=30, check=False).returncode == 0:
            return  # it runs already
        listen = f"'{self.host}'" if self.host else "''"
        options = (f"-k {self.folder} -p {self.port} -c listen_addresses={listen} -c fsync=off "
                   f"-c max_connections={self.max_connections}")
        self._run(str(bin_dir / "pg_ctl"), "-D", str(self.data), "-l", str(self.folder / "server.log"), "-o",
                  options, "-w", "start")

    def stop(self) -> None:
        bin_dir = pg_binaries()
        if bin_dir is None or not (self.data / "postmaster.pid").exists():
            return
        subprocess.run([*self._as_server_user(), str(bin_dir / "pg_ctl"), "-D", str(self.data), "-m", "fast",
                        "-w", "stop"], capture_output=True, timeout=60, check=False)

    def socket_url(self, database: str) -> str:
        """The superuser's URL of ``database`` over the Unix socket (trust: only this host's root reaches it)."""
        return f"postgresql+psycopg://postgres@/{database}?host={self.folder}&port={self.port}"

    def create(self, database: str, role: str, password: str) -> None:
        """Role ``role`` (logging in with ``password``) owning database ``database``; repeating it is a no-op
        that sets the password again."""
        import psycopg
        from psycopg import sql

        with psycopg.connect(host=str(self.folder), port=self.port, user="postgres", dbname="postgres",
                             autocommit=True) as conn:
            exists = conn.execute("SELECT 1 FROM pg_roles WHERE rolname = %s", (role,)).fetchone()
            verb = "ALTER" if exists else "CREATE"
            conn.execute(sql.SQL(verb + " ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(role),
                                                                          sql.Literal(password)))
            if not conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,)).fetchone():
                conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(database),
                                                                           sql.Identifier(role)))

    def url(self, database: str, role: str) -> str:
        """The TCP URL of ``database`` as ``role``, without its password (libpq reads it from ``PGPASSFILE``)."""
        return f"postgresql+psycopg://{role}@{self.host}:{self.port}/{database}"


def pgpass_line(host: str, port: int, database: str, role: str, password: str) -> str:
    """One line of a libpq password file (``PGPASSFILE``); ``:`` and ``\\`` escaped."""
    esc = lambda v: str(v).replace("\\", "\\\\").replace(":", "\\:")  # noqa: E731
    return ":".join(esc(v) for v in (host, port, database, role, password))


@contextlib.contextmanager
def private_postgres(folder: Path, *, database: str = "tg") -> Iterator[str]:
    """A running server reached only through its Unix socket in ``folder``, with an empty database
    ``database``; yields its superuser's SQLAlchemy URL, then stops it and removes the folder."""
    pg = Postgres(folder)
    try:
        pg.start()
        pg.create(database, "tg_owner", secrets.token_hex(8))
        yield pg.socket_url(database)
    finally:
        pg.stop()
        shutil.rmtree(folder, ignore_errors=True)


# ---------------------------------------------------------------------------------------------------------
# Redis and moto_server
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Redis:
    """Debian's ``redis-server`` on ``host``:``port``: a password, no persistence (Celery's broker holds
    only messages in flight; a lost one is a task the scheduler queues again)."""

    folder: Path
    host: str
    port: int
    password: str
    pid: int = 0

    def start(self) -> int:
        _ensure("redis-server", shutil.which("redis-server") or ("/usr/bin/redis-server"
                                                                 if os.access("/usr/bin/redis-server", os.X_OK)
                                                                 else None))
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.folder.mkdir(parents=True, exist_ok=True)
        conf = secret_file(self.folder / "redis.conf", "\n".join([
            f"bind {self.host}", f"port {self.port}", "protected-mode yes", f'requirepass "{self.password}"',
            'save ""', "appendonly no", f"dir {self.folder}", f"logfile {self.folder / 'redis.log'}",
            "daemonize no", ""]))
        proc = subprocess.Popen([binary, str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
        self.pid = proc.pid
        _wait_listening(proc, self.host, self.port, what="redis-server", log=self.folder / "redis.log")
        return proc.pid

    @property
    def url(self) -> str:
        return f"redis://:{self.password}@{self.host}:{self.port}/0"


@dataclass
class Moto:
    """A real ``moto_server`` on ``host``:``port``: the S3 endpoint of the alert bus."""

    host: str
    port: int
    log: Path
    pid: int = 0

    def start(self, buckets: tuple[str, ...] = (), *, credentials: tuple[str, str] = ("", "")) -> int:
        server = Path(sys.executable).parent / "moto_server"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "wb") as out:
            proc = subprocess.Popen([str(server), "-H", self.host, "-p", str(self.port)], stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        self.pid = proc.pid
        _wait_listening(proc, self.host, self.port, what="moto_server", log=self.log)
        if buckets:
            import boto3

            key, secret = credentials
            s3 = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                              aws_access_key_id=key or None, aws_secret_access_key=secret or None)
            for bucket in buckets:
                with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
                    s3.create_bucket(Bucket=bucket)
        return proc.pid

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def host_address() -> str:
    """This host's name for the logs it serves (Airflow's ``[core] hostname_callable`` on the scale-out
    profile's workers): the address of its own network namespace, ``$TG_HOST_ADDRESS``; the api-server
    fetches a task's log from there. Every worker namespace shares this host's name, so the name would not do."""
    import socket

    return os.environ.get("TG_HOST_ADDRESS") or socket.getfqdn()
