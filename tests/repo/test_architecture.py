"""The packages' dependencies, read from the code (every import, top-level or inside a function): which
way they go (docs/architecture.md), and no cycle between modules."""

from __future__ import annotations

import ast
from pathlib import Path

from tests import REPO

PACKAGES = ("checkpoint", "node_tools", "operators", "emulation")  # each installed as trainguard.<name>
CORE = "trainguard.core"  # the ground floor, inside trainguard/ itself


def _module(path: Path) -> str:
    """The import name of a file of the source tree: ``checkpoint/engine.py`` is ``trainguard.checkpoint.engine``."""
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] != "trainguard":
        parts = ["trainguard", *parts]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _package(module: str) -> str:
    """``trainguard.checkpoint.engine`` -> ``checkpoint``; ``trainguard.core.files`` -> ``core``;
    ``trainguard.torch`` -> ``trainguard``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in (*PACKAGES, "core") else parts[0]


def _imports(path: Path, modules: set[str], *, top_level: bool = False) -> set[str]:
    """The repository modules ``path`` imports, at module level or inside a function (``top_level``: at module
    level only). ``from pkg import sub`` imports the module ``pkg.sub``, not ``pkg``'s own code."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    every: set[str] = set()
    for node in (tree.body if top_level else ast.walk(tree)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        every.update(n for n in names if n.split(".")[0] == "trainguard")
    return every


def _graph() -> dict[str, set[str]]:
    files = {_module(p): p for pkg in (*PACKAGES, "trainguard") for p in (REPO / pkg).rglob("*.py")}
    return {mod: {n for n in _imports(path, set(files)) if n in files and n != mod} for mod, path in files.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    seen: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str, path: list[str]) -> None:
        if node in path:
            found.append([*path[path.index(node):], node])
            return
        if node in seen:
            return
        seen.add(node)
        for nxt in sorted(graph.get(node, ())):
            visit(nxt, [*path, node])

    for node in sorted(graph):
        visit(node, [])
    return found


def test_no_module_imports_itself_back_through_others():
    graph = _graph()
    assert len(graph) > 50 and graph["trainguard.operators.control"]  # the graph is read, not empty
    assert "trainguard.emulation.standalone" in graph["trainguard.emulation.guarded"]
    assert _cycles(graph) == []
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]  # and a cycle is seen


def test_the_packages_depend_one_way_and_stand_on_one_ground_floor():
    """``trainguard.core`` (errors, topology, atomic writes, processes) imports nothing else of trainguard; the
    checkpoint library takes nothing from the node tools, and the node tools reach the checkpoint library only
    inside the functions of ``tg-node ckpt`` (its commands read the copies), never at a module's top."""
    graph = _graph()
    assert {"trainguard.core.errors", "trainguard.core.topology", "trainguard.core.files",
            "trainguard.core.procs"} <= set(graph)
    for mod, deps in graph.items():
        pkg = _package(mod)
        if pkg == "core":
            assert {d for d in deps if _package(d) != "core"} == set(), (mod, deps)
        if pkg in ("checkpoint", "node_tools", "trainguard", "core"):  # the machines' side: never the control plane
            assert not [d for d in deps if _package(d) == "operators"], (mod, deps)
        if pkg != "emulation":  # the harness (Airflow standalone, the guarded job, the demo) is not the product's
            assert not [d for d in deps if _package(d) == "emulation"], (mod, deps)
        if pkg == "checkpoint":
            assert {d for d in deps if _package(d) == "node_tools"} == set(), (mod, deps)
    top = {mod: {n for n in _imports(_path(mod), set(graph), top_level=True) if _package(n) == "checkpoint"}
           for mod in graph if _package(mod) == "node_tools"}
    assert {m: d for m, d in top.items() if d} == {}
    assert "trainguard.checkpoint.layout" in graph["trainguard.node_tools.ckpt"]  # read inside its functions


def _path(module: str) -> Path:
    parts = module.split(".")[1:]
    base = REPO / ("trainguard" if parts[0] == "core" else "") / Path(*parts)
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _reach(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for nxt in graph.get(todo.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    return seen


#: the harness: the emulated cluster, fault injection, the in-job fault points and the emulated NVML backend
HARNESS = ("trainguard.emulation.cluster", "trainguard.emulation.inject", "trainguard.emulation.faults",
           "trainguard.emulation.nvml")


def test_no_product_module_reaches_the_fault_injection_or_the_emulation():
    """Not even through another module: a node installed without ``emulation/`` imports every product module.
    The product asks for the harness's parts by entry point only (node_tools/plugins.py)."""
    graph = _graph()
    assert set(HARNESS) <= set(graph)  # the harness is where it belongs
    assert "trainguard.emulation.faults" in _reach(graph, "trainguard.emulation.inject")  # and reaching is seen
    product = [m for m in graph if _package(m) != "emulation"]
    assert "trainguard.node_tools.monitor" in product and "trainguard.torch" in product
    reached = {m: sorted(d for d in _reach(graph, m) if _package(d) == "emulation") for m in product}
    assert {m: d for m, d in reached.items() if d} == {}
    names = {p.stem for pkg in ("node_tools", "checkpoint", "operators") for p in (REPO / pkg).rglob("*.py")}
    assert not names & {"cluster", "inject", "faults"}, names & {"cluster", "inject", "faults"}


def test_the_dags_import_only_the_control_planes_airflow_facing_modules():
    """DAG files are wiring: they import the sensors, triggers, forms, schedules and rung registry, and the
    task bodies only inside their tasks; never the harness."""
    for path in (REPO / "dags").glob("*.py"):
        body = ast.parse(path.read_text(encoding="utf-8")).body
        top = [n for n in body if isinstance(n, (ast.Import, ast.ImportFrom))]
        names = {a.name if isinstance(n, ast.Import) else n.module for n in top for a in n.names}
        banned = ("trainguard.operators.tasks", "trainguard.operators.control", "trainguard.emulation")
        assert not {m for m in names if m and m.startswith(banned)}, \
            (path.name, names)


#: Airflow modules the product may not import: the task SDK's internals and the core's ORM (public: airflow.sdk,
#: the providers, airflow.triggers.base, airflow.plugins_manager, airflow.exceptions, airflow.configuration)
PRIVATE_AIRFLOW = ("airflow.sdk.execution_time", "airflow.sdk._shared", "airflow.models", "airflow.utils.session",
                   "airflow.jobs", "airflow.executors")


def _airflow_imports(path: Path) -> set[str]:
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("airflow"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("airflow"):
            out.add(node.module)
    return out


def test_the_product_imports_no_private_airflow_module():
    files = [p for d in ("operators", "dags", "trainguard") for p in (REPO / d).rglob("*.py")]
    seen = {m for p in files for m in _airflow_imports(p)}
    assert "airflow.sdk" in seen  # the imports are read
    private = {(p.relative_to(REPO).as_posix(), m) for p in files for m in _airflow_imports(p)
               if m.startswith(PRIVATE_AIRFLOW)}
    assert private == set()


def test_the_provider_keeps_operators_sensors_and_triggers_apart_and_its_sensors_defer():
    """As Airflow's providers are laid out: every class in ``sensors/`` is a sensor, every one in ``operators/`` an
    operator that is not, every one in ``triggers/`` a trigger; and each sensor defers (its ``execute`` calls
    ``self.defer``: no sensor holds a worker slot poking)."""
    from airflow.sdk import BaseOperator, BaseSensorOperator
    from airflow.triggers.base import BaseTrigger

    def classes(folder: str) -> dict[str, type]:
        import importlib
        import inspect

        found = {}
        for path in sorted((REPO / "operators" / folder).glob("*.py")):
            mod = importlib.import_module(f"trainguard.operators.{folder}.{path.stem}".replace(".__init__", ""))
            found.update({f"{path.stem}.{n}": c for n, c in inspect.getmembers(mod, inspect.isclass)
                          if c.__module__ == mod.__name__ and not n.startswith("_")})
        return found

    sensors, operators, triggers = classes("sensors"), classes("operators"), classes("triggers")
    assert {"resume.ResumeSensor", "alerts.AlertSensor"} <= set(sensors) and "vote.SlowVoteOperator" in operators
    assert [n for n, c in sensors.items() if not issubclass(c, BaseSensorOperator)] == []
    assert [n for n, c in operators.items() if not issubclass(c, BaseOperator) or issubclass(c, BaseSensorOperator)] \
        == []
    assert [n for n, c in triggers.items() if not issubclass(c, BaseTrigger)] == []
    import inspect

    poking = [n for n, c in sensors.items() if "self.defer(" not in inspect.getsource(c.execute)]
    assert poking == []


#: what a trigger may not call: the fleet database's writes, DAG runs started, the bus's objects moved or removed,
#: machines acted on (the tasks do all of it; the triggers watch and emit events)
NOT_FROM_A_TRIGGER = {"ingest", "advance_cursor", "beat", "record_liveness", "record_action", "finish_action",
                      "update_incident", "transition", "take_over", "claim_watched", "claim_run", "wait_for_human",
                      "swap", "retire", "quarantine", "archive", "publish", "start_runs", "start_soon",
                      "trigger_run", "set_run_note", "replay_stop", "replay_launch", "launch", "stop", "evict",
                      "recover", "group_alerts", "incident_of_run", "reconcile_act"}


def test_the_triggers_only_watch_and_emit_events():
    """Read from the code: no trigger module calls anything that writes the fleet database, starts a DAG run,
    moves or removes a bus object or acts on a machine (tests/operators/triggers/test_alerts.py runs the alert
    watcher over a real bus and database and finds both as they were)."""
    called: dict[str, set[str]] = {}
    for path in sorted((REPO / "operators" / "triggers").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                called.setdefault(path.name, set()).add(name)
    assert {"alerts.py", "reconcile.py", "resume.py", "vote.py", "replay.py"} <= set(called)
    assert "observe" in called["alerts.py"] and "reconcile_pass" in called["reconcile.py"]  # the calls are read
    assert {f: sorted(c & NOT_FROM_A_TRIGGER) for f, c in called.items() if c & NOT_FROM_A_TRIGGER} == {}
