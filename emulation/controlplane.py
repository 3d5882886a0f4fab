"""``trainguard controlplane up|down|status``: the control plane over the emulated cluster, as a service.

Two profiles:

- ``embedded`` (the default, what the demo runs): ``airflow standalone`` (SQLite, LocalExecutor) and a SQLite
  fleet database, the bus a spool folder;
- ``scaleout`` (:mod:`trainguard.emulation.scaleout`): PostgreSQL, the CeleryExecutor with Redis, Celery workers each in
  a network namespace of its own, two schedulers, a separate api-server, dag-processor and triggerer, the bus
  on S3 (``moto_server``).

``up`` brings the cluster up first (the scale-out plane's servers before it: its agents publish to the S3
bus), provisions the fleet database and starts the plane; run again while it runs, it changes nothing.
``down`` stops the plane, its servers, then the cluster. The plane's folder is ``control`` beside the
cluster's state (``$TG_HOME``, default ``./.tg``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from trainguard.core.errors import EXIT_UNHEALTHY, TrainguardError
from trainguard.core.procs import group_alive
from trainguard.emulation import cluster, scaleout
from trainguard.emulation.standalone import Standalone

PROFILE_FILE = "profile.json"


def _home(state: Path) -> Path:
    return state.parent / "control"


def status(state: Path) -> dict[str, Any]:
    """Which profile runs in ``state``'s control folder, its processes (running or not) and its UI."""
    home = _home(state)
    try:
        doc = json.loads((home / PROFILE_FILE).read_text())
    except (OSError, ValueError):
        return {"profile": "", "url": "", "processes": {}}
    if doc["profile"] == "scaleout":
        with contextlib.suppress(OSError, ValueError):
            pids = json.loads((home / scaleout.STATE).read_text()).get("pids", {})
            doc["processes"] = {name: group_alive(int(pid)) for name, pid in pids.items()}
    else:
        with contextlib.suppress(OSError, ValueError):
            pid = int((home / "airflow" / "standalone.pid").read_text())
            doc["processes"] = {"airflow standalone": group_alive(pid)}
    doc.setdefault("processes", {})
    return doc


def up(args: argparse.Namespace, state: Path, *, log: Callable[[str], None]) -> dict[str, Any]:
    """Bring the cluster and the control plane of ``args.profile`` up; the plane's description."""
    home = _home(state)
    running = status(state)
    if running["processes"] and any(running["processes"].values()):
        if running["profile"] != args.profile:
            raise TrainguardError(f"the {running['profile']} control plane runs in {home}; "
                                  f"run 'trainguard controlplane down' first to change the profile")
        if all(running["processes"].values()):
            log(f"the {args.profile} control plane is already up")
            return running
    spec = cluster.ClusterSpec(name=args.name, machines=args.machines, standbys=args.standbys, subnet=args.subnet)
    spec.validate()
    shape = scaleout.Shape(workers=args.workers, schedulers=args.schedulers, concurrency=args.concurrency)
    shape.validate()  # bad input is refused before anything starts
    inventory = state / "inventory.json"
    settings = {"TG_INVENTORY": str(inventory)}
    port = args.port or None
    home.mkdir(parents=True, exist_ok=True)
    if args.profile == "scaleout":
        scaled = scaleout.ScaleOut(home, settings, spec, shape=shape, port=port)
        log("starting PostgreSQL, Redis and moto_server on the cluster's bridge")
        scaled.servers_up()
        spec = replace(spec, bus_url=scaleout.bus_url(spec))
        fleet_url = scaled.fleet_url
        env = {"TG_FLEET_URL": fleet_url, "TG_INVENTORY": str(inventory), "PGPASSFILE": scaled.env["PGPASSFILE"],
               "AWS_SHARED_CREDENTIALS_FILE": scaled.env["AWS_SHARED_CREDENTIALS_FILE"]}
        plane: Standalone = scaled
    else:
        fleet_url = str(home / "fleet.db")
        (home / "airflow").mkdir(exist_ok=True)
        plane = Standalone(home / "airflow", {**settings, "TG_FLEET_URL": fleet_url}, port=port)
        env = {"TG_FLEET_URL": fleet_url, "TG_INVENTORY": str(inventory)}
    log(f"bringing the cluster {spec.name} up ({spec.machines} machines)")
    inv = cluster.up(spec, state, log=log)
    os.environ.update(env)  # this process provisions the fleet database as the plane's components reach it
    from trainguard.operators.control import ControlConfig, Controller

    Controller(ControlConfig.from_env(env)).sync_inventory()
    log(f"starting the {args.profile} control plane")
    try:
        plane.start()
    except TimeoutError as exc:  # a host short of CPU, most often: nothing is left half-started
        if args.profile == "scaleout":
            scaleout.down(home)
        else:
            Standalone.stop_kept(home / "airflow")
        raise TrainguardError(f"the {args.profile} control plane did not come up: {exc} (its logs: {home}); "
                              "it was stopped and the cluster left up: run 'trainguard controlplane up' again, "
                              "with less else running on this host", exit_code=EXIT_UNHEALTHY) from None
    doc = {"profile": args.profile, "url": plane.url, "fleet_url": fleet_url, "bus_url": inv.bus_url,
           "passwords": str(plane.home / "simple_auth_manager_passwords.json.generated"), "env": env}
    (home / PROFILE_FILE).write_text(json.dumps(doc, indent=1))
    doc["processes"] = status(state)["processes"]
    return doc


def down(state: Path) -> dict[str, Any]:
    """Stop the control plane in ``state``'s control folder (whichever profile), its servers, then the
    cluster. Safe to repeat."""
    home = _home(state)
    stopped = list(scaleout.down(home)["stopped"])
    if Standalone.stop_kept(home / "airflow"):
        stopped.append("airflow standalone")
    (home / PROFILE_FILE).unlink(missing_ok=True)
    report = cluster.down(state, log=lambda *_: None)
    return {"stopped": stopped, "cluster": report}
