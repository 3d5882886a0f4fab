"""One machine's services: its sshd and its agent, brought up from the machine's own folder.

:func:`machine_up` is ``tg-node up``: the entrypoint of the node container image (``docker/``) and,
for each of its network namespaces, what the emulated cluster (``trainguard.emulation.cluster``) runs.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from trainguard.core import procs
from trainguard.core.errors import ClusterError
from trainguard.core.files import write_atomic
from trainguard.node_tools.config import NodeConfig

SSHD_CANDIDATES = ("/usr/sbin/sshd", "/usr/bin/sshd")


def sshd_binary() -> str:
    for path in SSHD_CANDIDATES:
        if os.access(path, os.X_OK):
            return path
    return ""


def keygen(path: Path, comment: str) -> str:
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        argv = ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False)
        if proc.returncode:
            raise ClusterError(f"'{' '.join(argv)}' failed: {proc.stderr.strip() or proc.stdout.strip()}")
    pub = Path(str(path) + ".pub").read_text().split()
    return f"{pub[0]} {pub[1]}"


def _sshd_config(mdir: Path, address: str, authorized_keys: Path, env: dict[str, str]) -> str:
    setenv = " ".join(f'"{k}={v}"' for k, v in env.items())
    return "\n".join([
        f"ListenAddress {address}",
        "Port 22",
        f"HostKey {mdir / 'ssh_host_ed25519_key'}",
        f"PidFile {mdir / 'sshd.pid'}",
        f"AuthorizedKeysFile {authorized_keys}",
        "PermitRootLogin prohibit-password",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "StrictModes no",
        "PrintMotd no",
        "UseDNS no",
        "MaxStartups 200:30:400",
        "MaxSessions 64",
        f"SetEnv {setenv}",
        # S3 credentials the control plane hands a command inside its session (checkpoint uploads)
        "AcceptEnv AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY AWS_SESSION_TOKEN AWS_DEFAULT_REGION",
        "",
    ])


def sshd_running(mdir: Path, netns: str) -> int | None:
    try:
        pid = int((mdir / "sshd.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    if not procs.alive(pid):
        return None
    try:  # the sshd of this machine's namespace (a leftover pid file may name another process)
        ours = f"/run/netns/{netns}" if netns else "/proc/self/ns/net"
        if os.stat(f"/proc/{pid}/ns/net").st_ino != os.stat(ours).st_ino:
            return None
    except OSError:
        return None
    return pid


def agent_running(mdir: Path) -> int | None:
    try:
        pid = int((mdir / "agent.pid").read_text().strip())
    except (OSError, ValueError):
        return None
    cmdline = procs.cmdline(pid)
    return pid if procs.alive(pid) and "agent" in cmdline and "--supervise" in cmdline else None


def credentials_env(mdir: Path) -> dict[str, str]:
    """The machine's S3 credentials for its agent and its SSH sessions (an S3 bus): the shared-credentials
    file in its folder, as a real machine has its own (an instance profile, a credentials file)."""
    creds = mdir / "aws_credentials"
    if not creds.exists():
        return {}
    return {"AWS_SHARED_CREDENTIALS_FILE": str(creds), "AWS_DEFAULT_REGION": "us-east-1"}


def start_agent(config_path: Path, *, netns: str = "") -> int:
    """Start the machine's agent under its supervisor (unless it runs); returns the supervisor's pid."""
    mdir = config_path.parent
    pid = agent_running(mdir)
    if pid:
        return pid
    tg_node = str(Path(sys.executable).parent / "tg-node")
    argv = [tg_node, "agent", "--supervise"]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]  # ip execs the command: the pid stays the same
    with open(mdir / "agent.log", "ab") as log:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                env={**os.environ, **credentials_env(mdir), "TG_NODE_CONFIG": str(config_path)})
    (mdir / "agent.pid").write_text(f"{proc.pid}\n")
    return proc.pid


def machine_up(config_path: Path, *, netns: str = "", sshd: str = "", listen: str = "0.0.0.0",  # noqa: S104
               authorized_keys: Path | None = None, host_key_dir: Path | None = None) -> dict[str, Any]:
    """Bring one machine's services up from its folder: its work directory, kernel log, sshd, agent.

    With ``sshd`` (its binary), the machine's host key is made once (``ssh_host_ed25519_key`` beside
    the configuration) and its ``sshd_config`` written: key-only login for ``authorized_keys`` (default
    ``authorized_keys`` beside the configuration) on ``listen``, every session seeing this machine's
    configuration; in a namespace (``netns``: a machine emulated on a shared host), a home directory of
    its own too (``home`` beside the configuration: a session's login shell reads that home's dotfiles,
    not those of the host, whose ``.bashrc`` may start anything: one that ran ``pyenv init`` cost each
    session 130 ms of CPU). With ``host_key_dir``, the host key's public half is published there as
    ``<machine>.pub`` (where a provisioner builds known_hosts from). This is ``tg-node up``: ``cluster up``
    runs it for each namespace and the node image (``docker/node.Dockerfile``) has it as its entrypoint.
    Idempotent: what runs is left running. Returns the machine, the pids of sshd (0 without) and the agent,
    and the host public key.
    """
    cfg = NodeConfig.load(config_path)
    mdir = config_path.parent
    cfg.workdir.mkdir(parents=True, exist_ok=True)
    if cfg.kmsg_path and str(cfg.kmsg_path) != "/dev/kmsg":
        cfg.kmsg_path.touch()
    host_key = ""
    sshd_pid = 0
    if sshd:
        host_key = keygen(mdir / "ssh_host_ed25519_key", cfg.machine)
        if host_key_dir is not None:
            write_atomic(host_key_dir / f"{cfg.machine}.pub", host_key + "\n")
        env = {"TG_NODE_CONFIG": str(config_path.resolve()),
               "PATH": f"{Path(sys.executable).parent}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
               **credentials_env(mdir)}
        if netns:  # an emulated machine's own home: the host's dotfiles run in none of its sessions
            home = mdir.resolve() / "home"
            home.mkdir(mode=0o700, exist_ok=True)
            env["HOME"] = str(home)
        (mdir / "sshd_config").write_text(_sshd_config(mdir, listen, authorized_keys or mdir / "authorized_keys", env))
        sshd_pid = _sshd_up(cfg, mdir, netns, sshd)
    agent_pid = start_agent(config_path, netns=netns) if cfg.bus_url else 0
    return {"machine": cfg.machine, "sshd_pid": sshd_pid, "agent_pid": agent_pid, "host_key": host_key}


def node_config_from_env(path: Path, env: dict[str, str]) -> NodeConfig:
    """A machine's configuration from ``TG_MACHINE`` (required), ``TG_WORKDIR``, ``TG_BUS_URL``,
    ``TG_GPUS``, ``TG_NVML_BACKEND``, ``TG_IFACE`` (a node container's environment), saved at ``path``."""
    machine = env.get("TG_MACHINE", "")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}", machine):
        raise ClusterError(f"no node configuration at {path} and TG_MACHINE={machine!r} is not a machine name; "
                           f"set TG_MACHINE (letters, digits, '.', '_', '-') or mount a node.json")
    try:
        gpus = int(env.get("TG_GPUS", "0"))
    except ValueError:
        raise ClusterError(f"TG_GPUS={env['TG_GPUS']!r} is not a number of GPUs") from None
    cfg = NodeConfig(machine=machine, workdir=Path(env.get("TG_WORKDIR", "/var/lib/trainguard")),
                     install_dir=Path(__file__).resolve().parent.parent, gpus=gpus,
                     nvml_backend=env.get("TG_NVML_BACKEND", "auto"), iface=env.get("TG_IFACE", ""),
                     bus_url=env.get("TG_BUS_URL", ""))
    path.parent.mkdir(parents=True, exist_ok=True)
    cfg.save(path)
    return cfg


def serve_forever(config_path: Path, netns: str = "") -> int:
    """Stay in the foreground (a container's PID 1) until SIGTERM or SIGINT, then end the machine's
    agent and sshd. Returns 0."""
    import signal

    stop = {"now": False}

    def on_signal(_signum: int, _frame: Any) -> None:
        stop["now"] = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    mdir = config_path.parent
    while not stop["now"]:
        try:
            os.waitpid(-1, os.WNOHANG)  # reap what PID 1 inherits
        except ChildProcessError:
            pass
        time.sleep(0.5)
    ours = procs.pids_with_env("TG_NODE_CONFIG", str(config_path.resolve()))  # the agent, sshd, their sessions
    procs.terminate([*ours, *(p for p in (agent_running(mdir), _pid_in(mdir / "sshd.pid")) if p)])
    return 0


def _pid_in(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _sshd_up(cfg: NodeConfig, mdir: Path, netns: str, sshd: str) -> int:
    pid = sshd_running(mdir, netns)
    if pid:
        return pid
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    argv = [sshd, "-f", str(mdir / "sshd_config")]
    if netns:
        argv = ["ip", "netns", "exec", netns, *argv]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30, check=False,
                          env=dict(os.environ, TG_NODE_CONFIG=str(mdir / "node.json")))
    if proc.returncode:
        raise ClusterError(f"sshd for machine {cfg.machine} did not start: {proc.stderr.strip()}")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pid = sshd_running(mdir, netns)
        if pid:
            return pid
        time.sleep(0.05)
    raise ClusterError(f"sshd for machine {cfg.machine} started but wrote no pid file in {mdir}")
