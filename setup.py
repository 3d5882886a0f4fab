"""Where the packages come from: the source tree's top-level folders ``checkpoint/``, ``node_tools/``,
``operators/`` and ``emulation/`` are installed as ``trainguard.checkpoint`` ... ``trainguard.emulation``, so no
name the project installs can collide with a training script's own modules. Everything else is in
pyproject.toml. A folder that is not there (the images leave ``emulation/`` out) is not installed."""

from pathlib import Path

from setuptools import find_namespace_packages, setup

HERE = Path(__file__).resolve().parent
SUBPACKAGES = ("checkpoint", "node_tools", "operators", "emulation", "dags")  # trainguard.SUBPACKAGES

package_dir = {"trainguard": "trainguard"}
packages = ["trainguard", *(f"trainguard.{p}" for p in find_namespace_packages(
    where=str(HERE / "trainguard"), include=["core", "core.*"]))]
for name in SUBPACKAGES:
    if (HERE / name / "__init__.py").is_file():
        package_dir[f"trainguard.{name}"] = name
        found = find_namespace_packages(where=str(HERE), include=[name, f"{name}.*"], exclude=["*.__pycache__"])
        packages += [f"trainguard.{p}" for p in found]

setup(packages=packages, package_dir=package_dir,
      package_data={p: ["*.yaml"] for p in packages})
