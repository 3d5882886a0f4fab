"""trainguard: keeps large PyTorch training jobs productive.

Every module of the project lives under this one import name, so nothing it
installs can collide with a training script's own modules (a ``checkpoint.py``
or an ``operators.py`` beside the script is common):

``trainguard.torch``
    The face a training loop meets (:class:`trainguard.torch.Guard`).
``trainguard.checkpoint``
    The per-step checkpoint library that runs inside the job.
``trainguard.node_tools``
    The node side: the agent, the in-job monitor hook, ``tg-node``.
``trainguard.operators``
    The control plane: Airflow hooks, sensors, triggers, tasks, policy.
``trainguard.emulation``
    The emulated cluster and the demo (not part of a node or control-plane install).

The source tree keeps those packages as top-level folders (``checkpoint/``,
``node_tools/``, ``operators/``, ``emulation/``); an installed wheel places them
under ``trainguard/``. Run from a source tree (a checkout on ``PYTHONPATH``, as
the emulated machines and the Airflow harness do), this package also looks in
the checkout's root for its subpackages.
"""

from __future__ import annotations

from pathlib import Path as _Path

__version__ = "0.1.0"

SUBPACKAGES = ("checkpoint", "node_tools", "operators", "emulation", "dags")

_root = _Path(__file__).resolve().parent.parent
# A source checkout (its pyproject.toml names this project): the subpackages are the checkout's top-level folders.
# An installed wheel has no pyproject.toml beside it and its subpackages inside this folder.
if (_root / "pyproject.toml").is_file() and (_root / "node_tools" / "__init__.py").is_file():
    __path__.append(str(_root))
del _root
