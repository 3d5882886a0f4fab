"""Pieces shared by the ``trainguard`` and ``tg-node`` command lines."""

from __future__ import annotations

import argparse

from trainguard.core.errors import TrainguardError


class OneLineParser(argparse.ArgumentParser):
    """argparse that raises a :class:`TrainguardError` (one line, exit 2) instead of printing usage."""

    def error(self, message: str) -> None:
        raise TrainguardError(f"{self.prog}: {message}; see '{self.prog} --help'")


def key_values(items: list[str], *, flag: str = "--param") -> dict[str, str]:
    """``["a=1", "b=x"]`` -> ``{"a": "1", "b": "x"}``; anything else is refused."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TrainguardError(f"{flag} {item!r} must be written key=value")
        out[key] = value
    return out
