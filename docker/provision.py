"""airflow-init of docker/compose.yaml: everything trainguard's DAGs need, before Airflow starts.

1. the Airflow metadata database (``airflow db migrate``) and the fleet database (its own Postgres
   database, created when missing);
2. the control plane's SSH key pair (private half in the fleet volume; the public half is the nodes'
   ``authorized_keys``);
3. the inventory and ``known_hosts``, from ``TG_NODES`` (``name:role,...``) and the host keys the nodes
   published when ``tg-node up`` started them (waits for them, up to ``TG_PROVISION_TIMEOUT_S``);
4. the ``tg_ssh`` pool and the S3 buckets of ``TG_BUCKETS``; the fleet database learns the machines;
5. the simple auth manager's passwords file: the run notes' login (``tg_notes``, role ``user``) gets
   ``TG_NOTES_PASSWORD``, the one its connection ``tg_airflow_api`` carries (the admin's is generated).

Connections (``tg_s3``, ``tg_airflow_api``) come from the environment (``AIRFLOW_CONN_*``). Run
again, it changes nothing that is in place. Exit 0 when done, 2 with a one-line reason otherwise.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

FLEET = Path(os.environ.get("TG_CONTROL_HOME", "/opt/trainguard/fleet"))
CONTROL_KEYS = Path(os.environ.get("TG_CONTROL_KEYS", "/opt/trainguard/keys"))
HOST_KEYS = Path(os.environ.get("TG_HOST_KEYS", "/opt/trainguard/host-keys"))
POOL_SLOTS = os.environ.get("TG_SSH_POOL_SLOTS", "16")


def parse_nodes(spec: str) -> list[tuple[str, str]]:
    """``node-0:active,node-4:standby`` -> [(name, role)]; a name alone is active."""
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        name, _, role = item.partition(":")
        role = role or "active"
        if role not in ("active", "standby", "free"):
            raise SystemExit(f"provision: TG_NODES item {item!r}: role must be active, standby or free")
        out.append((name, role))
    if not out:
        raise SystemExit("provision: TG_NODES names no machine; set it to node-0:active,node-1:standby,...")
    return out


def inventory_doc(nodes: list[tuple[str, str]], host_keys: dict[str, str], *, bus_url: str) -> dict:
    """The inventory (trainguard.node_tools.inventory's format) of the compose file's machines."""
    return {
        "schema": 1, "cluster": "compose", "transport": "ssh", "tg_node": "/usr/local/bin/tg-node", "bus_url": bus_url,
        "ssh": {"user": "root", "identity_file": "keys/id_ed25519", "known_hosts": "known_hosts",
                "connect_timeout_s": 5},
        "machines": [{"name": n, "address": n, "port": 22, "role": role, "host_key": host_keys[n],
                      "workdir": "/var/lib/trainguard", "gpus": int(os.environ.get("TG_GPUS", "8"))}
                     for n, role in nodes],
    }


def wait_host_keys(names: list[str], timeout_s: float, folder: Path = HOST_KEYS) -> dict[str, str]:
    """The host public keys ``tg-node up`` published in ``folder`` as ``<name>.pub``."""
    deadline = time.monotonic() + timeout_s
    while True:
        keys = {n: (folder / f"{n}.pub").read_text().strip() for n in names if (folder / f"{n}.pub").exists()}
        if len(keys) == len(names):
            return keys
        if time.monotonic() > deadline:
            missing = sorted(set(names) - set(keys))
            raise SystemExit(f"provision: no host key from {', '.join(missing)} in {folder} after {timeout_s:.0f}s; "
                             f"are those node containers up ('docker compose logs {missing[0]}')?")
        time.sleep(1)


def main() -> int:
    from trainguard.node_tools.inventory import Inventory
    from trainguard.node_tools.transport import known_hosts_lines

    subprocess.run(["airflow", "db", "migrate"], check=True)
    _fleet_database(os.environ["TG_FLEET_URL"])
    keys = FLEET / "keys"
    keys.mkdir(parents=True, exist_ok=True)
    if not (keys / "id_ed25519").exists():
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "trainguard-control",
                        "-f", str(keys / "id_ed25519")], check=True)
    CONTROL_KEYS.mkdir(parents=True, exist_ok=True)
    (CONTROL_KEYS / "authorized_keys").write_text((keys / "id_ed25519.pub").read_text())
    nodes = parse_nodes(os.environ.get("TG_NODES", ""))
    host_keys = wait_host_keys([n for n, _ in nodes], float(os.environ.get("TG_PROVISION_TIMEOUT_S", "300")))
    inv = Inventory.from_dict(inventory_doc(nodes, host_keys, bus_url=os.environ.get("TG_BUS_URL", "")))
    inv.path = Path(os.environ["TG_INVENTORY"])
    inv.save(inv.path)
    (inv.path.parent / "known_hosts").write_text("\n".join(known_hosts_lines(inv)) + "\n")
    subprocess.run(["airflow", "pools", "set", "tg_ssh", POOL_SLOTS,
                    "concurrent SSH sessions of trainguard's node tasks"], check=True)
    _buckets([b for b in os.environ.get("TG_BUCKETS", "").split(",") if b])
    if os.environ.get("TG_NOTES_PASSWORD") and os.environ.get("AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"):
        passwords_file(Path(os.environ["AIRFLOW__CORE__SIMPLE_AUTH_MANAGER_PASSWORDS_FILE"]),
                       {"tg_notes": os.environ["TG_NOTES_PASSWORD"]})
    from trainguard.operators.hooks.fleet import provision

    added = provision()["machines_added"]
    print(f"provision: {len(nodes)} machines in {inv.path} ({len(added)} new in the fleet database); "
          f"pool tg_ssh {POOL_SLOTS} slots; buckets {os.environ.get('TG_BUCKETS', '')}", flush=True)
    return 0


def passwords_file(path: Path, wanted: dict[str, str]) -> None:
    """Add the logins of ``wanted`` to the simple auth manager's passwords file, keeping every password
    already there (the api-server generates the others when it starts). Written whole, then renamed."""
    import json

    try:
        have = json.loads(path.read_text())
    except (OSError, ValueError):
        have = {}
    doc = {**wanted, **have}
    if doc != have:
        from trainguard.core.files import write_atomic

        write_atomic(path, json.dumps(doc) + "\n", mode=0o600)


def _fleet_database(url: str) -> None:
    """Create the fleet database beside Airflow's when it is a Postgres one that does not exist."""
    import re

    import sqlalchemy

    u = sqlalchemy.make_url(url)
    if not u.drivername.startswith("postgresql"):
        return
    if not re.fullmatch(r"[a-z_][a-z0-9_]{0,62}", u.database or ""):
        raise SystemExit(f"provision: TG_FLEET_URL names database {u.database!r}; use lower-case letters, digits, _")
    engine = sqlalchemy.create_engine(u.set(database="postgres"), isolation_level="AUTOCOMMIT")
    with engine.connect() as c:
        if not c.execute(sqlalchemy.text("SELECT 1 FROM pg_database WHERE datname = :d"), {"d": u.database}).first():
            c.execute(sqlalchemy.text(f'CREATE DATABASE "{u.database}"'))


def _buckets(names: list[str]) -> None:
    import boto3

    s3 = boto3.client("s3")  # endpoint and credentials from AWS_ENDPOINT_URL / AWS_* in the environment
    have = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
    for name in names:
        if name not in have:
            s3.create_bucket(Bucket=name)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except subprocess.CalledProcessError as exc:
        print(f"provision: {' '.join(exc.cmd)} failed with exit code {exc.returncode}", file=sys.stderr)
        sys.exit(2)
