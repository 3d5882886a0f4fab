"""What other installed packages add to trainguard through entry points (the emulation's commands, its NVML
backend and fault points): each group's objects, loaded, leaving out those of a package this installation
does not carry (the node and control-plane images leave the emulation out)."""

from __future__ import annotations

from typing import Any


def load_group(group: str) -> list[tuple[str, Any]]:
    """``(name, object)`` of every entry point of ``group`` whose module is installed, sorted by name.

    An entry point whose own package is missing is skipped; any other import failure (a bug in an
    installed plugin) is raised."""
    from importlib.metadata import entry_points

    found = []
    for ep in sorted(entry_points(group=group), key=lambda e: e.name):
        try:
            found.append((ep.name, ep.load()))
        except ModuleNotFoundError as exc:
            if exc.name and ep.module.startswith(exc.name):
                continue
            raise
    return found
