"""The scale-out control plane, run for real on this host (``trainguard controlplane up --profile scaleout``).

What ``docker/compose.yaml`` deploys on machines of their own, here on one host:

- **PostgreSQL** (Debian's ``postgresql``): Airflow's metadata database and the fleet database, two
  databases with a login of their own each, reached over TCP on the cluster's bridge;
- **Redis** (Debian's ``redis-server``): the CeleryExecutor's broker, with a password;
- **moto_server**: the S3 endpoint of the alert bus (bucket ``trainguard-bus``), which every machine's agent
  publishes to and the guardian's trigger reads;
- Airflow's components as separate processes: the api-server, ``schedulers`` schedulers (two by default:
  Airflow's scheduler runs active-active on PostgreSQL), the dag-processor and the triggerer;
- ``workers`` Celery workers, each in a network namespace of its own on the cluster's bridge, standing for
  another host: an Airflow home of its own (its configuration, its task logs, which the api-server fetches
  from its log server), its own copy of the deployment's files (inventory, SSH key, known_hosts, database
  password file); it reaches the api-server, Redis and PostgreSQL over the network, never through a file
  of the scheduler's.

Secrets never reach a command line or the environment: each host's ``airflow.cfg`` (mode 0600) holds the
Fernet key, the JWT and API secrets and the broker's URL; a libpq password file (``PGPASSFILE``) the
database logins. :class:`ScaleOut` is a :class:`~trainguard.emulation.standalone.Standalone` to the harness (the same
REST API calls), so the demo's :class:`~trainguard.emulation.guarded.GuardedJob` and the end-to-end tests run on either.
"""

from __future__ import annotations

import base64
import contextlib
import ipaddress
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainguard.core.errors import ClusterError
from trainguard.core.procs import group_alive
from trainguard.emulation import servers
from trainguard.emulation.cluster import ClusterSpec, _netns_list, _network_up, _run, namespace_on_bridge
from trainguard.emulation.standalone import Standalone, free_port

BUS_BUCKET = "trainguard-bus"
PG_PORT = 5432
REDIS_PORT = 6379
MOTO_PORT = 9000
WORKER_OFFSET = 2  # worker i's address: the subnet's .2+i (the host has .1, machines .10 and up)
COMPONENTS = ("api-server", "dag-processor", "triggerer")
STATE = "plane.json"  # the processes and namespaces a plane started, for ``down`` from another process


@dataclass(frozen=True)
class Shape:
    """How many of each: Celery workers (each in a namespace of its own), schedulers, task slots a worker."""

    workers: int = 2
    schedulers: int = 2
    concurrency: int = 4

    def validate(self) -> None:
        if not 1 <= self.workers <= 8:
            raise ClusterError(f"--workers {self.workers} must be 1..8")
        if not 1 <= self.schedulers <= 4:
            raise ClusterError(f"--schedulers {self.schedulers} must be 1..4")
        if not 1 <= self.concurrency <= 32:
            raise ClusterError(f"--concurrency {self.concurrency} must be 1..32")


def worker_netns(spec: ClusterSpec, i: int) -> str:
    return f"{spec.name}-w{i}"


def worker_address(spec: ClusterSpec, i: int) -> str:
    return str(ipaddress.ip_network(spec.subnet).network_address + WORKER_OFFSET + i)


def bus_url(spec: ClusterSpec) -> str:
    """The S3 alert bus of a scale-out plane on ``spec``'s bridge (what its cluster comes up with)."""
    return f"s3://{BUS_BUCKET}/{spec.name}?endpoint_url=http://{spec.host_address}:{MOTO_PORT}"


class ScaleOut(Standalone):
    """The scale-out control plane over the emulated cluster ``spec`` (its bridge is this plane's network).

    ``home``: the control plane's folder (databases, logs, each worker's home); ``env``: the control plane's
    ``TG_*`` settings (``TG_INVENTORY`` names the cluster's inventory; ``TG_FLEET_URL`` is set here)."""

    def __init__(self, home: Path, env: Mapping[str, str], spec: ClusterSpec, *, shape: Shape = Shape(),
                 port: int | None = None) -> None:
        shape.validate()
        self.root, self.spec, self.shape = home, spec, shape
        self.host = spec.host_address
        self.pg = servers.Postgres(home / "pg", host=self.host, port=PG_PORT, max_connections=300,
                                   clients=spec.subnet)
        self.secrets = self._secrets(home / "secrets.json")
        self.redis = servers.Redis(home / "redis", self.host, REDIS_PORT, self.secrets["redis"])
        self.moto = servers.Moto(self.host, MOTO_PORT, home / "moto.log")
        self.fleet_url = self.pg.url("trainguard", "trainguard")
        airflow_db = self.pg.url("airflow", "airflow")
        port = port or free_port()
        super().__init__(home / "airflow", {
            **env,
            "AIRFLOW__CORE__EXECUTOR": "CeleryExecutor",
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN": airflow_db,
            # psycopg 3 is both the sync and the async driver (Airflow would pick asyncpg for the async one)
            "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN_ASYNC": airflow_db,
            "AIRFLOW__CELERY__RESULT_BACKEND": "db+" + airflow_db,
            "AIRFLOW__CELERY__WORKER_CONCURRENCY": str(shape.concurrency),
            "AIRFLOW__CORE__PARALLELISM": str(4 * shape.workers * shape.concurrency),
            "AIRFLOW__API__HOST": self.host,
            "AIRFLOW__CORE__EXECUTION_API_SERVER_URL": f"http://{self.host}:{port}/execution/",
            # a scheduler that stops heart-beating is taken as dead after 10 s, and the other one adopts the
            # tasks it had queued at its next check (Airflow's defaults: 30 s and 300 s)
            "AIRFLOW__SCHEDULER__SCHEDULER_HEALTH_CHECK_THRESHOLD": "10",
            "AIRFLOW__SCHEDULER__ORPHANED_TASKS_CHECK_INTERVAL": "10",
            "AIRFLOW__SCHEDULER__JOB_HEARTBEAT_SEC": "2",
            # a task a dying scheduler queued whose message never reached a worker stays queued: after 60 s the
            # surviving scheduler revokes and queues it again, checked every 10 s (defaults: 600 s and 120 s)
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT": "60",
            "AIRFLOW__SCHEDULER__TASK_QUEUED_TIMEOUT_CHECK_INTERVAL": "10",
            "AIRFLOW__API__WORKERS": "1",
            "TG_FLEET_URL": self.fleet_url,
            "PGPASSFILE": str(home / "airflow" / ".pgpass"),
            "AWS_SHARED_CREDENTIALS_FILE": str(home / "airflow" / "aws_credentials"),
            "AWS_DEFAULT_REGION": "us-east-1",
        }, port=port)
        self.url = f"http://{self.host}:{self.port}"
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    # ---- secrets and each host's files ---------------------------------------------------------------------
    @staticmethod
    def _secrets(path: Path) -> dict[str, str]:
        """The plane's secrets, made once (a plane brought up again keeps its databases' logins)."""
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
        made = {"airflow": secrets.token_hex(16), "trainguard": secrets.token_hex(16),
                "redis": secrets.token_hex(16), "s3": secrets.token_hex(16), "jwt": secrets.token_hex(32),
                "api": secrets.token_hex(32), "fernet": base64.urlsafe_b64encode(os.urandom(32)).decode()}
        servers.secret_file(path, json.dumps(made))
        return made

    def _host_files(self, airflow_home: Path) -> None:
        """One host's ``airflow.cfg`` (its secrets) and database password file, both mode 0600."""
        s = self.secrets
        servers.secret_file(airflow_home / "airflow.cfg", "\n".join([
            "[core]", f"fernet_key = {s['fernet']}", "[api]", f"secret_key = {s['api']}",
            "[api_auth]", f"jwt_secret = {s['jwt']}", "[celery]", f"broker_url = {self.redis.url}", ""]))
        servers.secret_file(airflow_home / "aws_credentials", "[default]\naws_access_key_id = trainguard\n"
                             f"aws_secret_access_key = {s['s3']}\n")
        servers.secret_file(airflow_home / ".pgpass", "".join(
            servers.pgpass_line(self.host, PG_PORT, db, db, s[db]) + "\n" for db in ("airflow", "trainguard")))

    def _worker_home(self, i: int) -> Path:
        """Worker ``i``'s own home: its Airflow home and its copy of the deployment's files (the inventory,
        the control plane's SSH key, known_hosts), as a provisioner puts them on another host."""
        home = self.root / "workers" / f"w{i}"
        deploy = home / "deploy"
        inv = Path(self.env["TG_INVENTORY"])
        deploy.mkdir(parents=True, exist_ok=True)
        text = inv.read_text()
        (deploy / "inventory.json").write_text(text)
        ssh = json.loads(text).get("ssh") or {}
        for key in ("identity_file", "known_hosts"):
            rel = ssh.get(key)
            if rel:
                src = inv.parent / rel
                dst = deploy / rel
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
                os.chmod(dst, 0o600)
        self._host_files(home / "airflow")
        return home

    # ---- bring-up ---------------------------------------------------------------------------------------------
    def servers_up(self) -> None:
        """The bridge, PostgreSQL (both databases), Redis and moto_server (the bus bucket): what the cluster's
        agents and Airflow's components need before they start. Idempotent."""
        self.root.mkdir(parents=True, exist_ok=True)
        _network_up(self.spec)
        self.pg.start()
        for db in ("airflow", "trainguard"):
            self.pg.create(db, db, self.secrets[db])
        if not self._alive("redis"):
            self._record(redis=self.redis.start())
        if not self._alive("moto"):
            self._record(moto=self.moto.start(buckets=(BUS_BUCKET,),
                                              credentials=("trainguard", self.secrets["s3"])))
        self._host_files(self.home)

    def _pids(self) -> dict[str, int]:
        """The pids this plane recorded, by component ({} before anything started)."""
        with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
            return {str(k): int(v) for k, v in json.loads((self.root / STATE).read_text())["pids"].items()}
        return {}

    def _alive(self, name: str) -> bool:
        """Whether the process this plane recorded as ``name`` still runs (a repair leaves it be)."""
        pid = self._pids().get(name)
        return pid is not None and group_alive(pid)  # a group of zombies died

    def launch(self) -> None:
        """Migrate Airflow's database, then start its components and the workers; returns at once
        (:meth:`ready` waits for them)."""
        self.home.mkdir(parents=True, exist_ok=True)
        migrate = subprocess.run([self._airflow(), "db", "migrate"], env=self.env, capture_output=True, text=True,
                                 timeout=600, check=False)
        if migrate.returncode:
            raise ClusterError(f"airflow db migrate failed: {migrate.stderr.strip()[-400:]}")
        for name, args in [*((n, [n]) for n in COMPONENTS),
                           *((f"scheduler-{i}", ["scheduler"]) for i in range(self.shape.schedulers))]:
            if not self._alive(name):  # up again after one died: the rest run on
                self._start(name, args, self.env, self.home)
        for i in range(self.shape.workers):
            if not self._alive(f"worker-{i}"):
                self._worker_up(i)
        self.proc = self.procs.get("api-server")
        # where ``trainguard status`` finds the api-server (as it finds a kept ``airflow standalone``)
        (self.home / "standalone.url").write_text(self.url)
        api_server = self._pids().get("api-server")
        if api_server:
            (self.home / "standalone.pid").write_text(str(api_server))

    def _airflow(self) -> str:
        return str(Path(sys.executable).parent / "airflow")

    def _start(self, name: str, args: list[str], env: Mapping[str, str], home: Path,
               netns: str = "") -> subprocess.Popen[bytes]:
        argv = [self._airflow(), *args]
        if netns:
            argv = ["ip", "netns", "exec", netns, *argv]
        with open(self._log(name), "ab") as log:
            proc = subprocess.Popen(argv, env=dict(env), stdout=log, stderr=subprocess.STDOUT, cwd=home,
                                    start_new_session=True)
        self.procs[name] = proc
        self._record(**{name: proc.pid})
        return proc

    def _log(self, name: str) -> Path:
        folder = self.root / "logs"
        folder.mkdir(parents=True, exist_ok=True)
        return folder / f"{name}.log"

    def _worker_up(self, i: int) -> None:
        spec, ns = self.spec, worker_netns(self.spec, i)
        namespace_on_bridge(spec, ns, f"{spec.name}w{i}", worker_address(spec, i))
        home = self._worker_home(i)
        env = {**self.env, "AIRFLOW_HOME": str(home / "airflow"), "PGPASSFILE": str(home / "airflow" / ".pgpass"),
               "AWS_SHARED_CREDENTIALS_FILE": str(home / "airflow" / "aws_credentials"),
               "TG_INVENTORY": str(home / "deploy" / "inventory.json"),
               "TG_HOST_ADDRESS": worker_address(spec, i),
               "AIRFLOW__CORE__HOSTNAME_CALLABLE": "trainguard.emulation.servers.host_address"}
        self._record(namespaces=[ns])
        self._start(f"worker-{i}", ["celery", "worker", "-H", f"w{i}@{worker_address(spec, i)}",
                                    "-c", str(self.shape.concurrency)], env, home, netns=ns)

    def _record(self, **items: Any) -> None:
        path = self.root / STATE
        doc: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            doc = json.loads(path.read_text())
        for key, value in items.items():
            if key == "namespaces":
                doc["namespaces"] = sorted(set(doc.get("namespaces", [])) | set(value))
            else:
                doc.setdefault("pids", {})[key] = value
        doc["pg"] = str(self.pg.folder)
        path.write_text(json.dumps(doc, indent=1))

    def _healthy(self) -> bool:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited {proc.returncode}; see {self._log(name)}")
        return super()._healthy()

    def last_error(self) -> str | None:
        try:
            lines = self._log("api-server").read_bytes()[-256 * 1024:].decode(errors="replace").splitlines()
        except OSError:
            return None
        found = [ln.strip() for ln in lines if "[error" in ln or "ERROR" in ln]
        return found[-1][:400] if found else None

    # ---- teardown -------------------------------------------------------------------------------------------
    def kill(self, name: str, sig: int = signal.SIGKILL) -> int:
        """Send ``sig`` to one component's process group (``scheduler-0``: a scheduler host that dies);
        returns its pid."""
        proc = self.procs[name]
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        proc.wait(timeout=30)
        return proc.pid

    def stop(self, *, grace_s: float = 30.0) -> None:
        """Stop Airflow's components and the workers (their namespaces go too); the servers keep running
        (the fleet database outlives the orchestrator: :meth:`servers_down`)."""
        if self._api is not None:
            self._api.close()
            self._api = None
        down(self.root, grace_s=grace_s, stop_servers=False)
        (self.home / "standalone.pid").unlink(missing_ok=True)
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.procs.clear()
        self.proc = None

    def servers_down(self) -> None:
        """Stop PostgreSQL, Redis and moto_server (after :meth:`stop`)."""
        down(self.root)


SERVERS = ("redis", "moto")


def down(root: Path, *, grace_s: float = 30.0, stop_servers: bool = True) -> dict[str, Any]:
    """Stop what a plane in ``root`` started (from its :data:`STATE` file): Airflow's components and workers
    and the workers' namespaces, then (``stop_servers``) Redis, moto_server and PostgreSQL. Safe to repeat; the
    folder stays (databases, logs)."""
    path = root / STATE
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {"stopped": [], "namespaces": []}
    pids: dict[str, int] = doc.get("pids", {})
    stopped = []
    # Airflow's processes first (they end their tasks), all at once: one grace for all of them
    airflow = {int(pids.pop(n)): n for n in [n for n in pids if n not in SERVERS]}
    stopped += [airflow[pid] for pid in servers.stop_pids(airflow, grace_s=grace_s)]
    removed = []
    for ns in doc.get("namespaces", []):
        out = _run(["ip", "netns", "pids", ns], check=False).stdout
        for pid in (int(p) for p in out.split() if p.isdigit()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if ns in _netns_list() and _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            removed.append(ns)
    doc["namespaces"] = []
    if stop_servers:
        own = {int(pids.pop(n)): n for n in [n for n in pids if n in SERVERS]}
        stopped += [own[pid] for pid in servers.stop_pids(own, grace_s=10.0)]
        if doc.get("pg"):
            servers.Postgres(Path(doc["pg"])).stop()
            stopped.append("postgres")
        path.unlink(missing_ok=True)
    else:
        doc["pids"] = pids
        path.write_text(json.dumps(doc, indent=1))
    return {"stopped": stopped, "namespaces": removed}
