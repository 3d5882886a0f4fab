"""What an installation of one side carries: a training machine (``trainguard[node]``) needs no Airflow and the
control plane (``trainguard[control]``) no torch. Each side's every module is imported in a process where the
other side's heavy package cannot be imported at all, and the extras say the same."""

from __future__ import annotations

import subprocess
import sys
import tomllib

import pytest

from tests import REPO

PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    import re

    return {re.split(r"[<>=\[;! ]", r, maxsplit=1)[0].lower() for r in requirements}


def test_the_extras_split_the_sides():
    extras = PROJECT["optional-dependencies"]
    base, node, control = (_names(PROJECT["dependencies"]), _names(extras["node"]), _names(extras["control"]))
    assert "torch" in node and "torch" not in base | control
    assert not {n for n in base | node if n.startswith(("apache-airflow", "celery"))}
    assert {"apache-airflow", "sqlalchemy"} <= control
    assert extras["all"] == ["trainguard[node,control]"]


def _modules(*packages: str) -> list[str]:
    out = []
    for pkg in packages:
        for path in sorted((REPO / pkg).rglob("*.py")):
            rel = path.relative_to(REPO).with_suffix("")
            if rel.name == "__main__":  # a package's command (python -m), run rather than imported
                continue
            parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
            if pkg == "trainguard":
                parts = parts[1:]
            out.append(".".join(("trainguard", *parts)))
    return out


BLOCK = """
import importlib, sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not installed on this side")
sys.meta_path.insert(0, Blocked())
for name in {blocked!r}:  # the blocker works: the other side's packages are out of reach
    try:
        importlib.import_module(name)
    except ImportError:
        continue
    raise SystemExit(f"{{name}} was importable")
for mod in {modules!r}:
    importlib.import_module(mod)
print("imported", len({modules!r}))
"""


@pytest.mark.parametrize("side,blocked,packages", [
    ("node", {"airflow", "celery", "sqlalchemy", "pydantic_settings", "great_expectations"},
     ("node_tools", "checkpoint")),
    ("control", {"torch", "safetensors", "pynvml", "lightning", "transformers"}, ("operators",)),
])
def test_each_side_imports_without_the_other_sides_packages(side, blocked, packages):
    modules = _modules(*packages) \
        + (["trainguard.torch"] if side == "node" else [])
    done = subprocess.run([sys.executable, "-c", BLOCK.format(blocked=sorted(blocked), modules=modules)],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, f"{side}: {done.stderr[-2000:]}"
    assert f"imported {len(modules)}" in done.stdout
