"""``FleetHook``: the control plane's hold on its fleet, for one task (or one triggerer, or one api-server).

It owns, for whoever holds it:

- the **fleet database**: one SQLAlchemy engine per process and URL, shared by every hook of the process
  (a task process, the triggerer's triggers, the api-server's Fleet page); the schema is never migrated
  here (only when the fleet is provisioned: :func:`provision`, ``trainguard fleet migrate``), so a task
  opening it costs one query, and an out-of-date schema is a one-line error saying what to run;
- the **bus cursors**: each reader's position on the alert bus, a table of the fleet database, committed by
  the task that records what was read (:meth:`cursor`);
- the **machines over SSH**: a :class:`~trainguard.operators.hooks.node.NodeHook` holding one connection per machine
  for the hook's life (:meth:`close` ends them);
- the :class:`~trainguard.operators.control.Controller` over all three (:meth:`get_controller`).

Settings come from :class:`trainguard.operators.settings.ControlSettings` (``TG_*`` variables), the fleet database
from its Airflow connection (``tg_fleet``, type ``trainguard_fleet``, ``postgres`` or ``sqlite``:
:mod:`trainguard.operators.hooks.connections`) where it is defined, else ``TG_FLEET_URL``; SSH credentials from
the Airflow connection ``ssh_conn_id`` (default ``tg_ssh``), else the inventory's.
"""

from __future__ import annotations

import threading
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from airflow.sdk import BaseHook

from trainguard.operators.fleet.store import FleetStore, url_for
from trainguard.operators.hooks.connections import (
    DEFAULT_FLEET_CONN_ID,
    FLEET_CONN_TYPE,
    FleetConnectionError,
    fleet_url_of,
    get_connection,
)
from trainguard.operators.settings import ControlSettings

if TYPE_CHECKING:
    from trainguard.node_tools.inventory import Inventory
    from trainguard.operators.control import Controller
    from trainguard.operators.hooks.node import NodeHook

_STORES: dict[str, FleetStore] = {}
_LOCK = threading.Lock()


def fleet_store(url: str | Path) -> FleetStore:
    """The process's one :class:`FleetStore` (and engine) for ``url``: its schema checked the first time,
    never migrated; a database that does not answer is waited for up to ``TG_FLEET_RETRY_S`` on every call."""
    key = url_for(url)
    with _LOCK:
        store = _STORES.get(key)
        if store is None:
            store = _STORES[key] = FleetStore(key, retry_s=ControlSettings.from_env(fleet_url=key).fleet_retry_s)
        return store


def task_controller() -> Controller:
    """The controller a task is handed (the DAGs' tasks and operators make it as they start): the process's fleet
    database (no migration, one engine), the inventory, and SSH connections held for the task's life."""
    return FleetHook().get_controller()


def provision(settings: ControlSettings | None = None) -> dict[str, Any]:
    """Provision the fleet database: create or migrate its schema and register the inventory's machines it
    does not know yet. Run once per release, before the DAGs (``trainguard fleet migrate``, the compose
    file's provisioner); repeating it changes nothing. Returns the versions applied and the machines added."""
    from trainguard.operators.control import Controller

    settings = settings or ControlSettings.from_env()
    store = FleetStore(settings.fleet_url, migrate=True)
    try:
        added = Controller(settings, fleet=store).sync_inventory()
    finally:
        store.close()
    applied = store.migrations_applied
    return {"fleet_url": settings.fleet_url, "migrations_applied": applied, "machines_added": added}


class FleetHook(BaseHook):
    """The fleet (database, cursors, machines) for one task, trigger or page.

    :param settings: the control plane's settings (default: read from the ``TG_*`` variables)
    :param ssh_conn_id: the Airflow connection with the machines' SSH login and key
    """

    # its own connection is the fleet database's; the machines' SSH login is its NodeHook's (``ssh_conn_id``)
    conn_type = FLEET_CONN_TYPE
    conn_name_attr = "fleet_conn_id"
    default_conn_name = DEFAULT_FLEET_CONN_ID
    hook_name = "trainguard fleet database"

    def __init__(self, *, settings: ControlSettings | None = None, ssh_conn_id: str | None = "tg_ssh",
                 fleet_conn_id: str | None = None) -> None:
        super().__init__()
        self._settings = settings
        self.ssh_conn_id = ssh_conn_id
        self.fleet_conn_id = fleet_conn_id

    @cached_property
    def settings(self) -> ControlSettings:
        """The settings; the fleet database's URL from ``fleet_conn_id`` when given (else as
        :meth:`ControlSettings.from_env` finds it: the ``TG_FLEET_CONN_ID`` connection, else ``TG_FLEET_URL``)."""
        settings = self._settings or ControlSettings.from_env()
        if self.fleet_conn_id:
            conn = get_connection(self.fleet_conn_id)
            if conn is None:
                raise FleetConnectionError(f"the fleet database's connection {self.fleet_conn_id!r} is not defined: "
                                           f"add it (type {FLEET_CONN_TYPE}, postgres or sqlite)")
            settings = settings.model_copy(update={"fleet_url": fleet_url_of(conn)})
        return settings

    @cached_property
    def store(self) -> FleetStore:
        """The fleet database (the process's engine for its URL)."""
        return fleet_store(self.settings.fleet_url)

    @cached_property
    def node(self) -> NodeHook:
        """The machines over SSH, one held connection each."""
        from trainguard.operators.hooks.node import NodeHook

        return NodeHook(self.settings.inventory, ssh_conn_id=self.ssh_conn_id, max_parallel=self.settings.ssh_fanout)

    @property
    def inventory(self) -> Inventory:
        return self.node.inventory

    def cursor(self, reader: str) -> dict[str, float]:
        """The bus names ``reader`` has read and recorded (name -> when first read)."""
        return self.store.cursor(reader)

    def get_controller(self) -> Controller:
        """A controller over this hook's fleet database, inventory and SSH connections."""
        from trainguard.operators.control import Controller

        return Controller(self.settings, transport=self.node.transport(), inventory=self.inventory,
                          fleet=self.store)

    def close(self) -> None:
        """End the held SSH connections (the database engine stays: it is the process's)."""
        if "node" in self.__dict__:
            self.node.close()
