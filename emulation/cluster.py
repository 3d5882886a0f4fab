"""The emulated cluster: N machines on one host, each a Linux network namespace.

Each machine gets its own network namespace with an address on a bridge that
``up`` creates, its own ``sshd`` (generated host key, key-only login), its own
size-limited local disk (a tmpfs mount), an emulated NVML state file and a node
configuration that every ssh session sees through sshd's ``SetEnv``. ``up``
writes ``<state_dir>/inventory.json`` that the rest of trainguard reads.

``up`` is idempotent: run twice, it repairs what is missing and leaves what runs.
``down`` removes every namespace, link, mount, process and file it made. It finds
them by what they are (namespaces and links by name prefix, processes by their
namespace and by the ``TG_NODE_CONFIG`` marker in their environment, mounts
under the state folder), so it cleans up after a crash that lost the inventory.

Without root (or with ``transport="local"``) machines are plain folders on this
host reached through the ``local`` transport: no sshd, no namespace, no disk
limit, no link faults. ``up`` says so.

Each machine's services come up through ``tg-node up``
(:func:`trainguard.node_tools.services.machine_up`), the entrypoint of the node container image too.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

from trainguard.core import procs
from trainguard.core.errors import ClusterError
from trainguard.emulation.nvml import EmulatedNvml
from trainguard.node_tools.config import NodeConfig, tg_home
from trainguard.node_tools.inventory import Inventory, InventoryError, Machine
from trainguard.node_tools.services import agent_running, keygen, sshd_binary, sshd_running
from trainguard.node_tools.transport import known_hosts_lines, transport_for

_CLUSTER_NAME_RE = re.compile(r"^[a-z][a-z0-9]{0,5}$")


@dataclass
class ClusterSpec:
    """The shape of an emulated cluster.

    Attributes:
        name: short name (1-6 lower-case letters/digits); prefixes namespaces and links.
        machines: machines in all.
        standbys: how many of them start as warm standbys (the rest are active).
        free: how many (after the standbys) start unprovisioned, role "free": the inventory the standby
            pool job provisions from.
        subnet: the /24 (or larger) private network of the bridge; the host takes .1.
        disk_mb: size of each machine's local disk (tmpfs), in MiB.
        gpus: emulated GPUs per machine.
        transport: "ssh" (namespaces + sshd, needs root), "local", or "auto".
        job_nice: each machine's ``job_nice``: the machines share this host's cores, and a job's ranks
            on all of them would otherwise starve the agents, sshd sessions and the control plane that
            a real GPU machine's idle cores serve at once.
        bus_url: the alert bus (``s3://bucket/prefix?endpoint_url=...``: each machine gets S3 credentials
            in its folder, ``aws_credentials``); "" (default): a spool folder in the cluster's state.
    """

    name: str = "tg"
    machines: int = 6
    standbys: int = 2
    subnet: str = "10.213.7.0/24"
    disk_mb: int = 256
    gpus: int = 8
    transport: str = "auto"
    free: int = 0
    job_nice: int = 10
    bus_url: str = ""

    def role(self, i: int) -> str:
        """Machine ``i``'s role at start: active first, then standbys, then free machines."""
        if i >= self.machines - self.free:
            return "free"
        return "standby" if i >= self.machines - self.free - self.standbys else "active"

    def validate(self) -> None:
        if not _CLUSTER_NAME_RE.match(self.name):
            raise ClusterError(
                f"cluster name {self.name!r} must be 1-6 lower-case letters or digits, starting with a letter"
            )
        if not 1 <= self.machines <= 1000:
            raise ClusterError(f"--machines {self.machines} must be 1..1000 (more than 244 need a --subnet larger "
                               f"than a /24)")
        if not 0 <= self.standbys < self.machines:
            raise ClusterError(
                f"--standbys {self.standbys} must be 0..{self.machines - 1} (at least one active machine)"
            )
        if not 0 <= self.free < self.machines - self.standbys:
            raise ClusterError(f"--free {self.free} must be 0..{self.machines - self.standbys - 1} "
                               f"(at least one active machine besides {self.standbys} standbys)")
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError:
            raise ClusterError(f"--subnet {self.subnet!r} is not a network like 10.213.7.0/24") from None
        if not net.is_private or net.num_addresses < self.machines + 12:
            raise ClusterError(
                f"--subnet {self.subnet} must be a private network with room for {self.machines} machines"
            )
        if self.disk_mb < 16:
            raise ClusterError(f"--disk-mb {self.disk_mb} is too small; give each machine at least 16 MiB")
        if self.gpus < 0:
            raise ClusterError(f"--gpus {self.gpus} must be >= 0")
        if self.transport not in ("auto", "ssh", "local"):
            raise ClusterError(f"--transport {self.transport!r} must be auto, ssh or local")
        if not 0 <= self.job_nice <= 19:
            raise ClusterError(f"--job-nice {self.job_nice} must be 0..19")
        if self.bus_url and not self.bus_url.startswith("s3://"):
            raise ClusterError(f"bus {self.bus_url!r} must be an s3://bucket/prefix URL (or empty: a spool folder)")

    # naming ------------------------------------------------------------------------------
    def netns(self, i: int) -> str:
        return f"{self.name}-m{i}"

    def veth(self, i: int) -> str:
        return f"{self.name}v{i}"

    @property
    def bridge(self) -> str:
        return f"{self.name}br"

    def address(self, i: int) -> str:
        return str(ipaddress.ip_network(self.subnet).network_address + 10 + i)

    @property
    def host_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet).network_address + 1)

    @property
    def prefixlen(self) -> int:
        return ipaddress.ip_network(self.subnet).prefixlen


def default_state_dir() -> Path:
    return tg_home() / "cluster"


def _run(argv: list[str], *, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode:
        raise ClusterError(f"'{' '.join(argv)}' failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def _is_root() -> bool:
    return os.geteuid() == 0


def _netns_list() -> set[str]:
    proc = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in proc.stdout.splitlines() if line.strip()}


def _link_exists(name: str, netns: str | None = None) -> bool:
    argv = ["ip", "link", "show", name]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    return _run(argv, check=False).returncode == 0


def _links() -> list[str]:
    proc = _run(["ip", "-o", "link", "show"], check=False)
    names = []
    for line in proc.stdout.splitlines():
        parts = line.split(":", 2)
        if len(parts) >= 2:
            names.append(parts[1].strip().split("@")[0])
    return names


def _mounts_under(path: Path) -> list[Path]:
    root = str(path.resolve())
    found = []
    with open("/proc/mounts", encoding="utf-8") as fh:
        for line in fh:
            target = line.split()[1].replace("\\040", " ")
            if target == root or target.startswith(root + "/"):
                found.append(Path(target))
    return sorted(found, key=lambda p: len(str(p)), reverse=True)


def apt_install(package: str, *, timeout_s: float = 900.0) -> None:
    """Install one of Debian's packages with apt-get (root); ClusterError naming the failing command."""
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
        proc = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout_s, check=False)
        if proc.returncode:
            raise ClusterError(f"'{' '.join(argv)}' failed: {proc.stderr.strip()[-300:]}")


def ensure_openssh(log: Any = print) -> str:
    """The sshd binary, installing Debian's openssh-server when it is missing (root only)."""
    sshd = sshd_binary()
    if sshd:
        return sshd
    if not shutil.which("apt-get"):
        raise ClusterError("sshd is not installed and apt-get is not available; install openssh-server")
    log("openssh-server is missing; installing it with apt-get (once)")
    apt_install("openssh-server")
    sshd = sshd_binary()
    if not sshd:
        raise ClusterError("openssh-server was installed but no sshd binary was found")
    return sshd


@contextlib.contextmanager
def _locked(state_dir: Path) -> Iterator[None]:
    state_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(state_dir.parent / f".{state_dir.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


# ---------------------------------------------------------------------------------------
# One machine
# ---------------------------------------------------------------------------------------
def _machine_dir(state_dir: Path, i: int) -> Path:
    return state_dir / "machines" / f"m{i}"


def kill_sshd(mdir: Path, sig: int = signal.SIGKILL) -> int:
    """An emulated machine's sshd dies with every session it serves, as when its host goes: the listener
    (``sshd.pid`` in its folder) and its connections' processes (a connection a client holds open, an
    OpenSSH master's, would outlive the listener alone). Returns the listener's pid."""
    pid = int((mdir / "sshd.pid").read_text().strip())
    try:
        listener = psutil.Process(pid)
        every = [listener, *listener.children(recursive=True)]
    except psutil.Error:  # gone already
        return pid
    for proc in every:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(sig)
    return pid


def _write_credentials(mdir: Path) -> None:
    key = os.environ.get("AWS_ACCESS_KEY_ID", "trainguard")
    secret = os.environ.get("AWS_SECRET_ACCESS_KEY", "trainguard-secret")
    fd = os.open(mdir / "aws_credentials", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"[default]\naws_access_key_id = {key}\naws_secret_access_key = {secret}\n")


def _tg_node_up(tg_node: str, config: Path, *, netns: str, sshd: str, listen: str, authorized_keys: Path) -> str:
    """``tg-node up`` for one machine, the same command a node container starts with; its host key."""
    argv = [tg_node, "up", "--config", str(config)]
    if sshd:
        argv += ["--sshd", sshd, "--listen", listen, "--authorized-keys", str(authorized_keys), "--netns", netns]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False,
                          env={k: v for k, v in os.environ.items() if k != "TG_NODE_CONFIG"})
    try:
        doc = json.loads(proc.stdout)
    except ValueError:
        doc = {"error": (proc.stderr or proc.stdout).strip()[-500:]}
    if proc.returncode or "error" in doc:
        raise ClusterError(f"'tg-node up' for {config.parent.name} failed: {doc.get('error')}")
    return str(doc.get("host_key", ""))


# ---------------------------------------------------------------------------------------
# The cluster
# ---------------------------------------------------------------------------------------
def _network_up(spec: ClusterSpec) -> None:
    br = spec.bridge
    if not _link_exists(br):
        _run(["ip", "link", "add", br, "type", "bridge"])
    addr = f"{spec.host_address}/{spec.prefixlen}"
    shown = _run(["ip", "-o", "addr", "show", "dev", br]).stdout
    if f" {addr} " not in shown:
        _run(["ip", "addr", "add", addr, "dev", br])
    _run(["ip", "link", "set", br, "up"])


def _namespace_up(spec: ClusterSpec, i: int) -> None:
    namespace_on_bridge(spec, spec.netns(i), spec.veth(i), spec.address(i))


def namespace_on_bridge(spec: ClusterSpec, ns: str, veth: str, address: str) -> None:
    """Network namespace ``ns`` with ``eth0`` at ``address`` on the cluster's bridge (through the veth pair
    ``veth``), and its loopback up: a host of its own on the cluster's network. Idempotent."""
    if ns not in _netns_list():
        _run(["ip", "netns", "add", ns])
    if not _link_exists("eth0", ns):
        if _link_exists(veth):
            _run(["ip", "link", "del", veth])
        _run(["ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns])
    _run(["ip", "link", "set", veth, "master", spec.bridge, "up"])
    inside = ["ip", "netns", "exec", ns]
    addr = f"{address}/{spec.prefixlen}"
    if f" {addr} " not in _run([*inside, "ip", "-o", "addr", "show", "dev", "eth0"]).stdout:
        _run([*inside, "ip", "addr", "add", addr, "dev", "eth0"])
    _run([*inside, "ip", "link", "set", "eth0", "up"])
    _run([*inside, "ip", "link", "set", "lo", "up"])


def _disk_up(workdir: Path, size_mb: int) -> bool:
    workdir.mkdir(parents=True, exist_ok=True)
    if not _is_root():
        return False
    if workdir.resolve() not in _mounts_under(workdir):
        _run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m,mode=0755", "tmpfs", str(workdir)])
    return True


def _wait_reachable(inv: Inventory, timeout_s: float | None = None) -> None:
    """Wait until every machine answers over its transport. The machines of an emulated cluster share this
    host's cores, and a few hundred of them starting their agents at once answer slowly: the wait and each
    session's limit grow with the machines (30 s and 10 s for a handful; 158 s and 36 s at 256)."""
    n = len(inv.machines)
    timeout_s = 30.0 + 0.5 * n if timeout_s is None else timeout_s
    transport = transport_for(inv)
    deadline = time.monotonic() + timeout_s
    pending = list(inv.machines)
    last: dict[str, str] = {}
    try:
        while pending and time.monotonic() < deadline:
            results = transport.run_many(pending, lambda m: [inv.tg_node, "version"],
                                         timeout=10.0 + 0.1 * len(pending))
            pending = [m for m in pending if not results[m.name].ok]
            last = {m.name: results[m.name].describe() for m in pending}
            if pending:
                time.sleep(0.2)
    finally:
        transport.close()
    if pending:
        shown = "; ".join(list(last.values())[:3]) + (f"; and {len(last) - 3} more" if len(last) > 3 else "")
        raise ClusterError(f"{len(pending)} of {n} machines not reachable after {timeout_s:.0f}s: {shown}")


def up(spec: ClusterSpec, state_dir: Path | None = None, *, log: Any = print) -> Inventory:
    """Bring the emulated cluster up (or repair it); returns its inventory."""
    spec.validate()
    state_dir = Path(state_dir or default_state_dir()).resolve()
    transport = spec.transport
    if transport == "auto":
        transport = "ssh" if _is_root() and shutil.which("ip") else "local"
        if transport == "local":
            log("not running as root (or no 'ip' command): machines are local process groups "
                "reached through the local transport; no sshd, no namespaces, no disk limit, no link faults")
    if transport == "ssh" and not _is_root():
        raise ClusterError("the ssh transport needs root (network namespaces); run as root or use --transport local")
    with _locked(state_dir):
        state_dir.mkdir(parents=True, exist_ok=True)
        inv_path = state_dir / "inventory.json"
        if inv_path.exists():
            try:
                old = Inventory.load(inv_path)
            except InventoryError:
                old = None
            if old is not None and (
                old.cluster != spec.name or len(old.machines) != spec.machines or old.transport != transport
                or old.machines[0].extra.get("subnet") != spec.subnet
                or (spec.bus_url or "spool://") != (old.bus_url if old.bus_url.startswith("s3://") else "spool://")
            ):
                raise ClusterError(
                    f"a cluster {old.cluster!r} of {len(old.machines)} machines ({old.transport}, bus "
                    f"{old.bus_url.split('?')[0]}) is already up in "
                    f"{state_dir}; run 'trainguard cluster down' first to change its shape"
                )
        sshd = ensure_openssh(log) if transport == "ssh" else ""
        venv_bin = str(Path(sys.executable).parent)
        tg_node = str(Path(venv_bin) / "tg-node")
        install_dir = Path(__file__).resolve().parent.parent
        keys = state_dir / "keys"
        client_key = keys / "id_ed25519"
        authorized = keys / "authorized_keys"
        if transport == "ssh":
            pub = keygen(client_key, f"trainguard-{spec.name}")
            authorized.write_text(pub + "\n")
            _network_up(spec)
        bus_url = spec.bus_url or f"spool://{state_dir / 'bus'}"
        machines: list[Machine] = []
        for i in range(spec.machines):
            mdir = _machine_dir(state_dir, i)
            mdir.mkdir(parents=True, exist_ok=True)
            workdir = mdir / "disk"
            workdir.mkdir(parents=True, exist_ok=True)
            limited = transport == "ssh" and _disk_up(workdir, spec.disk_mb)
            name = f"m{i}"
            netns = spec.netns(i) if transport == "ssh" else ""
            cfg = NodeConfig(
                machine=name, workdir=workdir, install_dir=install_dir, gpus=spec.gpus,
                nvml_backend="emulated", nvml_state=mdir / "nvml.json", fault_file=mdir / "faults.json",
                netns=netns, iface="eth0" if netns else "lo",
                bus_url=bus_url, kmsg_path=mdir / "kmsg",
                status_path=mdir / "agent" / "status.json", job_nice=spec.job_nice,
            )
            cfg.save(mdir / "node.json")
            if not cfg.nvml_state.exists():  # healthy GPUs until a fault is injected
                EmulatedNvml(cfg.nvml_state, machine=name, gpus=spec.gpus).reset()
            if spec.bus_url:
                _write_credentials(mdir)
            if transport == "ssh":
                _namespace_up(spec, i)
            host_key = _tg_node_up(tg_node, mdir / "node.json", netns=netns, sshd=sshd,
                                   listen=spec.address(i) if netns else "", authorized_keys=authorized)
            machines.append(Machine(
                name=name,
                address=spec.address(i) if transport == "ssh" else "127.0.0.1",
                port=22,
                role=spec.role(i),
                host_key=host_key,
                workdir=str(workdir),
                gpus=spec.gpus,
                extra={
                    "netns": netns, "iface": "eth0" if netns else "", "machine_dir": str(mdir),
                    "node_config": str(mdir / "node.json"), "disk_limited": limited, "subnet": spec.subnet,
                    "env": {} if transport == "ssh" else {"TG_NODE_CONFIG": str(mdir / "node.json")},
                },
            ))
        inv = Inventory(
            cluster=spec.name, transport=transport, machines=machines, tg_node=tg_node,
            bus_url=bus_url,
            ssh={"user": "root", "identity_file": "keys/id_ed25519", "known_hosts": "known_hosts",
                 "connect_timeout_s": 5} if transport == "ssh" else {},
        )
        inv.path = inv_path
        if inv_path.exists():
            # keep roles the control plane has changed since the cluster came up
            with contextlib.suppress(InventoryError):
                old_roles = {m.name: m.role for m in Inventory.load(inv_path).machines}
                for m in inv.machines:
                    m.role = old_roles.get(m.name, m.role)
        if transport == "ssh":
            (state_dir / "known_hosts").write_text("\n".join(known_hosts_lines(inv)) + "\n")
        _wait_reachable(inv)
        inv.save(inv_path)
        return inv


def down(state_dir: Path | None = None, *, name: str | None = None, log: Any = print) -> dict[str, Any]:
    """Remove everything ``up`` made: processes, namespaces, links, mounts, files. Safe to repeat."""
    state_dir = Path(state_dir or default_state_dir()).resolve()
    report: dict[str, Any] = {"killed": [], "namespaces": [], "links": [], "unmounted": [], "removed": False,
                              "errors": []}

    def undo(argv: list[str], what: str, into: str) -> None:
        proc = _run(argv, check=False)
        if proc.returncode:
            message = f"could not remove {what}: {proc.stderr.strip()}"
            report["errors"].append(message)
            log(message)
        else:
            report[into].append(what)

    cluster = name
    if cluster is None:
        try:
            cluster = Inventory.load(state_dir / "inventory.json").cluster
        except InventoryError:
            cluster = ClusterSpec().name
    with _locked(state_dir):
        namespaces = sorted(n for n in (_netns_list() if _is_root() else set()) if n.startswith(f"{cluster}-m"))
        pids: set[int] = set(procs.pids_with_env("TG_NODE_CONFIG", str(state_dir) + "/", prefix=True))
        for ns in namespaces:
            out = _run(["ip", "netns", "pids", ns], check=False).stdout
            pids.update(int(p) for p in out.split() if p.isdigit())
        report["killed"] = procs.terminate(pids, grace_s=5.0)
        for ns in namespaces:
            undo(["ip", "netns", "del", ns], ns, "namespaces")
        if _is_root():
            for link in _links():
                if re.fullmatch(rf"{re.escape(cluster)}(v\d+|br)", link):
                    undo(["ip", "link", "del", link], link, "links")
            for mount in _mounts_under(state_dir):
                undo(["umount", "-l", str(mount)], str(mount), "unmounted")
        if state_dir.exists():
            shutil.rmtree(state_dir)
            report["removed"] = True
    with contextlib.suppress(OSError):
        (state_dir.parent / f".{state_dir.name}.lock").unlink()
    return report


def status(state_dir: Path | None = None) -> dict[str, Any]:
    """Each machine's role, address, sshd, reachability and agent: its supervisor's and its process's state
    as the kernel has them (running, stopped, gone) and its status file's age, so a stopped (SIGSTOP) or
    hung agent shows as such, not as a pid that exists."""
    from trainguard.node_tools import agent

    state_dir = Path(state_dir or default_state_dir()).resolve()
    inv = Inventory.load(state_dir / "inventory.json")
    transport = transport_for(inv)
    results = transport.run_many(inv.machines, lambda m: [inv.tg_node, "version"], timeout=10)
    transport.close()
    machines = []
    for m in inv.machines:
        mdir = Path(m.extra.get("machine_dir", ""))
        netns = m.extra.get("netns", "")
        try:
            procs_doc = agent.processes(NodeConfig.load(mdir / "node.json"))
        except Exception as exc:  # a machine folder without its configuration
            procs_doc = {"state": "unknown", "error": str(exc)[:200]}
        machines.append({
            "name": m.name, "role": m.role, "address": m.address, "netns": netns,
            "sshd_pid": sshd_running(mdir, netns) if netns else None,
            "agent_pid": agent_running(mdir),
            "agent_state": procs_doc.get("state"),
            "agent_status_age_s": procs_doc.get("status_age_s"),
            "agent": procs_doc,
            "reachable": results[m.name].ok,
            "ssh_s": round(results[m.name].duration_s, 3),
        })
    return {"cluster": inv.cluster, "transport": inv.transport, "inventory": str(inv.path), "machines": machines}
