"""trainguard as an Airflow provider: what Airflow's providers manager reads from the ``apache_airflow_provider``
entry point (``pyproject.toml``), so an Airflow with trainguard installed lists it under Admin -> Providers and
offers its connection type in the connection form.

A leaf module: Airflow calls :func:`get_provider_info` while it discovers every provider, so nothing here may import
more than the standard library (an error here would stop the discovery of every provider).
"""

from __future__ import annotations

from typing import Any

CONN_TYPE = "trainguard_ssh"  # :class:`trainguard.operators.hooks.node.NodeHook`'s, not the SSH provider's "ssh"
FLEET_CONN_TYPE = "trainguard_fleet"  # :class:`trainguard.operators.hooks.fleet.FleetHook`'s: the fleet database


def get_provider_info() -> dict[str, Any]:
    return {
        "package-name": "trainguard",
        "name": "trainguard",
        "description": "Keeps large PyTorch training jobs productive: failures detected in seconds, faulty machines "
                       "evicted for warm standbys, verified checkpoints, code rollback.",
        "hooks": [{"integration-name": "trainguard",
                   "python-modules": ["trainguard.operators.hooks.node", "trainguard.operators.hooks.fleet"]}],
        "connection-types": [{
            "connection-type": CONN_TYPE,
            "hook-class-name": "trainguard.operators.hooks.node.NodeHook",
            "hook-name": "trainguard machines (SSH)",
            # the machines' addresses, ports and host keys come from the inventory; the connection holds the login
            "ui-field-behaviour": {
                "hidden-fields": ["host", "schema", "port", "password"],
                "relabeling": {"login": "SSH user on the machines"},
                "placeholders": {"login": "root",
                                 "extra": '{"key_file": "/etc/trainguard/id_ed25519"} or {"private_key": "..."}'},
            },
        }, {
            "connection-type": FLEET_CONN_TYPE,
            "hook-class-name": "trainguard.operators.hooks.fleet.FleetHook",
            "hook-name": "trainguard fleet database",
            # any SQLAlchemy URL in the extra; a postgres or sqlite connection serves as well (hooks/connections.py)
            "ui-field-behaviour": {
                "hidden-fields": ["host", "schema", "port", "login", "password"],
                "relabeling": {},
                "placeholders": {"extra": '{"url": "postgresql+psycopg://trainguard:...@db:5432/trainguard"}'},
            },
        }],
    }
