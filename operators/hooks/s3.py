"""The control plane's one way to S3: the Airflow connection ``TG_S3_CONN_ID`` (default ``tg_s3``, type ``aws``;
login and password the access key and secret, ``endpoint_url`` and ``region_name`` in its extra for an
S3-compatible store). Every part of the control plane that reads the remote checkpoint tier or hands machines
the credentials to write it (the verification DAG's promotion, an eviction's listing of the remote copies and
its rescue of a last copy) takes them from :func:`s3_access`: the endpoint, a boto3 client, and the ``AWS_*``
variables for the machines' commands, all from that one connection.

Where the connection is not defined (a tool run outside Airflow, a deployment without a remote tier), the
process's own environment stands in, as boto3 reads it (``TG_S3_ENDPOINT_URL`` and boto3's credential chain),
and :attr:`S3Access.source` says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

DEFAULT_CONN_ID = "tg_s3"
#: the ``AWS_*`` variables a machine's upload or rescue command is handed
ENV_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_DEFAULT_REGION")


def conn_id() -> str:
    return os.environ.get("TG_S3_CONN_ID", "").strip() or DEFAULT_CONN_ID


@dataclass
class S3Access:
    """Where and how to reach S3. ``endpoint_url``: "" = AWS; ``env``: the ``AWS_*`` variables for the
    machines' commands; ``source``: ``connection <id>`` or ``environment``; ``client``: a boto3 S3 client
    with the same credentials (None: each tier opens its own from boto3's chain)."""

    endpoint_url: str = ""
    env: dict[str, str] = field(default_factory=dict)
    source: str = "environment"
    client: Any = None


def s3_credentials(access_key: str | None, secret_key: str | None, token: str | None,
                   region: str | None) -> dict[str, str]:
    """The ``AWS_*`` variables handed to the machines' commands (empty ones left out)."""
    env = {"AWS_ACCESS_KEY_ID": access_key or "", "AWS_SECRET_ACCESS_KEY": secret_key or "",
           "AWS_SESSION_TOKEN": token or "", "AWS_DEFAULT_REGION": region or "us-east-1"}
    return {k: v for k, v in env.items() if v}


def _defined(conn: str) -> bool:
    """Whether Airflow knows the connection (its environment variable, a secrets backend, the database)."""
    from trainguard.operators.hooks.connections import get_connection

    return get_connection(conn) is not None


class S3ConnectionMissing(LookupError):
    """The S3 connection a task needs is not defined."""


def s3_access(conn: str | None = None, *, required: bool = False, timeout_s: float = 5.0,
              attempts: int = 2) -> S3Access:
    """The endpoint, client and machine credentials from the connection ``conn`` (default :func:`conn_id`);
    when it is not defined, :class:`S3ConnectionMissing` if ``required``, else this process's environment.
    Requests time out after ``timeout_s`` with ``attempts`` tries, so an endpoint that is down fails in
    seconds."""
    conn = conn or conn_id()
    if not _defined(conn):
        if required:
            raise S3ConnectionMissing(
                f"the S3 connection {conn!r} is not defined: add an Airflow connection of type aws named {conn} "
                f"(login/password = access key/secret, endpoint_url in its extra for an S3-compatible store), "
                f"or name another in TG_S3_CONN_ID")
        return S3Access(endpoint_url=os.environ.get("TG_S3_ENDPOINT_URL", ""),
                        env={k: os.environ[k] for k in ENV_KEYS if os.environ.get(k)})
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from botocore.config import Config

    hook = S3Hook(aws_conn_id=conn, config=Config(connect_timeout=timeout_s, read_timeout=max(timeout_s, 30.0),
                                                  retries={"max_attempts": attempts, "mode": "standard"}))
    creds = hook.get_credentials()
    return S3Access(endpoint_url=hook.conn_config.endpoint_url or "", source=f"connection {conn}",
                    env=s3_credentials(creds.access_key, creds.secret_key, creds.token, hook.conn_region_name),
                    client=hook.get_conn())
