"""The reference pages' tables, made from the code they describe: the settings (``ControlSettings``), the alert
kinds with what the ladder does with each (``node_tools.alerts``, ``operators.policy.ladder``), the injectable
faults (``emulation.faults``), the exit codes (``node_tools.errors``), the Prometheus metrics (the collector
itself, scraped once from an empty fleet database) and the command line (every subcommand's ``--help``).

    python scripts/reference.py            print every table
    python scripts/reference.py --update   rewrite them between their markers in docs/reference/*.md

``tests/repo/test_docs.py`` keeps each page's table equal to what this makes.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ROOT / "docs" / "reference"


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def settings() -> str:
    from trainguard.operators.settings import markdown_table

    return markdown_table()


def alerts() -> str:
    """Every alert kind, what it means, the ladder's category for it alone and that category's first rung."""
    from trainguard.node_tools.alerts import ALERT_KINDS, NOTICE_KINDS
    from trainguard.operators.policy import ladder

    rows = ["| alert | what it means | category | first action |", "|---|---|---|---|"]
    for kind, meaning in ALERT_KINDS.items():
        if kind in NOTICE_KINDS:
            category, action = "(a notice: starts scheduled work, never an incident)", ""
        else:
            t = ladder.triage("job", [{"kind": kind, "machine": "m0", "job": "job", "rank": 0, "ts": 0.0}],
                              job_machines=["m0"])
            category, action = t.category, ladder.decide(t).action
        rows.append(f"| `{kind}` | {_cell(meaning)} | {category} | {action} |")
    return "\n".join(rows)


def faults() -> str:
    from trainguard.emulation import faults as f

    rows = ["| fault | target | what happens | parameters (default) |", "|---|---|---|---|"]
    for k in f.FAULT_KINDS.values():
        params = ", ".join(f"`{n}={v}`" for n, v in dict(k.params).items())
        rows.append(f"| `{k.name}` | {k.target} | {_cell(k.summary)} | {params} |")
    return "\n".join(rows)


def exit_codes() -> str:
    from trainguard.core import errors

    meaning = {"EXIT_OK": "success", "EXIT_UNHEALTHY": "unhealthy, or the job or check failed",
               "EXIT_USAGE": "bad input or a missing prerequisite: one line on stderr says what to do",
               "EXIT_REFUSED": "refused (a safety rule: the breaker, a job busy with an incident, ...)",
               "EXIT_INTERRUPTED": "interrupted (Ctrl-C)"}
    codes = {n: getattr(errors, n) for n in dir(errors) if n.startswith("EXIT_")}
    missing = set(codes) ^ set(meaning)
    if missing:
        raise SystemExit(f"scripts/reference.py: exit codes without a meaning here, or gone: {sorted(missing)}")
    rows = ["| code | constant | meaning |", "|---|---|---|"]
    rows += [f"| {code} | `{name}` | {meaning[name]} |" for name, code in sorted(codes.items(), key=lambda kv: kv[1])]
    return "\n".join(rows)


def metrics() -> str:
    """The collector's families, scraped once from an empty fleet database of the current schema."""
    from trainguard.operators.fleet import FleetStore
    from trainguard.operators.metrics import FleetCollector

    with tempfile.TemporaryDirectory() as tmp:
        store = FleetStore(str(Path(tmp) / "fleet.db"), migrate=True)
        try:
            families = list(FleetCollector(store).collect())
        finally:
            store.close()
    rows = ["| metric | type | what |", "|---|---|---|"]
    for fam in sorted(families, key=lambda m: m.name):
        suffix = {"counter": "_total", "info": "_info"}.get(fam.type, "")
        rows.append(f"| `{fam.name}{suffix}` | {fam.type} | {_cell(fam.documentation)} |")
    return "\n".join(rows)


def cli() -> str:
    """Every ``trainguard`` command and subcommand with its one-line help, as its parser says."""
    from trainguard.node_tools.cli import build_parser as node_parser
    from trainguard.operators.cli import build_parser

    rows = ["| command | what |", "|---|---|"]

    def walk(parser: argparse.ArgumentParser, prefix: str) -> None:
        for action in parser._actions:  # argparse keeps the subcommands' help only here
            if isinstance(action, argparse._SubParsersAction):
                helps = {a.dest: a.help for a in action._choices_actions}
                for name, sub in action.choices.items():
                    usage = " ".join(sub.format_usage().split()[1:]).replace(" [-h]", "")  # "usage: ..." less -h
                    what = helps.get(name) or sub.description or f"`{usage}`"
                    rows.append(f"| `{prefix} {name}` | {_cell(what)} |")
                    walk(sub, f"{prefix} {name}")

    walk(build_parser()[0], "trainguard")
    walk(node_parser(), "tg-node")
    return "\n".join(rows)


#: page -> table name -> maker
TABLES: dict[str, dict[str, Callable[[], str]]] = {
    "settings.md": {"settings": settings},
    "alerts.md": {"alerts": alerts},
    "cli.md": {"commands": cli, "faults": faults, "exit-codes": exit_codes},
    "metrics.md": {"metrics": metrics},
}


def markers(name: str) -> tuple[str, str]:
    return f"<!-- reference:{name}:begin -->", f"<!-- reference:{name}:end -->"


def between(text: str, name: str) -> str | None:
    begin, end = markers(name)
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--update", action="store_true", help="rewrite the tables in docs/reference/*.md")
    args = ap.parse_args()
    for page, tables in TABLES.items():
        path = PAGES / page
        text = path.read_text() if args.update else ""
        for name, make in tables.items():
            table = make()
            if not args.update:
                print(f"{page} {name}:\n{table}\n")
                continue
            if between(text, name) is None:
                print(f"docs/reference/{page} lacks the markers {' ... '.join(markers(name))}", file=sys.stderr)
                return 2
            begin, end = markers(name)
            head, rest = text.split(begin, 1)
            text = f"{head}{begin}\n{table}\n{end}{rest.split(end, 1)[1]}"
        if args.update:
            path.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
