"""The emulation's ``tg-node`` command (entry point group ``tg_node.commands``): ``tg-node fault``, the node
side of ``trainguard inject``, run over SSH on an emulated machine. It imports only the node side."""

from __future__ import annotations

import argparse
from typing import Any

from trainguard.core.errors import EXIT_OK
from trainguard.node_tools.cliutil import OneLineParser, key_values


def register_node(sub: Any) -> None:
    """Add ``tg-node fault inject|clear|list``."""
    fp = sub.add_parser("fault", help="inject or clear faults (emulated machines only)")
    fsub = fp.add_subparsers(dest="action", required=True, parser_class=OneLineParser)
    fi = fsub.add_parser("inject")
    fi.add_argument("--kind", required=True)
    fi.add_argument("--rank", type=int)
    fi.add_argument("--job")
    fi.add_argument("--param", action="append", default=[])
    fc = fsub.add_parser("clear")
    fc.add_argument("--kind")
    fsub.add_parser("list")
    fp.set_defaults(node_handler=_node_fault)


def _node_fault(ns: argparse.Namespace, cfg: Any) -> tuple[int, Any]:
    from trainguard.emulation import inject

    if ns.action == "inject":
        return EXIT_OK, inject.inject_on_node(cfg, ns.kind, rank=ns.rank, job_name=ns.job,
                                             params=key_values(ns.param))
    if ns.action == "clear":
        return EXIT_OK, inject.clear_on_node(cfg, ns.kind)
    return EXIT_OK, {"machine": cfg.machine, "active": inject.read_ledger(cfg)}
