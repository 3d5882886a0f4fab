"""Make the README's benchmark table from the committed results in bench/results/.

    python bench/table.py            print the table
    python bench/table.py --update   rewrite the table between the markers in README.md
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench-table:begin -->", "<!-- bench-table:end -->"


def rows() -> list[str]:
    out = ["| benchmark | metric | median | p90 | n | target | command |", "|---|---|---|---|---|---|---|"]
    for path in sorted((ROOT / "bench" / "results").glob("*.json")):
        doc = json.loads(path.read_text())
        for key, m in doc["metrics"].items():
            cmd = f"`python bench/{m.get('script', doc['name'])}.py`"  # a metric another script adds to the file
            target = m.get("target")
            p90 = "" if m.get("p90") is None else f"{m['p90']:g}"
            value = m["median"] if "median" in m else m["value"]  # a rate or count has one value, not a spread
            out.append(
                f"| {doc['name']} | {key} | {value:g} {m['unit']} | {p90} | {m['n']} | "
                f"{'' if target is None else target} | {cmd} |"
            )
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--update", action="store_true")
    args = ap.parse_args()
    table = "\n".join(rows())
    if not args.update:
        print(table)
        return 0
    readme = ROOT / "README.md"
    text = readme.read_text()
    if BEGIN not in text or END not in text:
        print(f"README.md lacks the markers {BEGIN} ... {END}", file=sys.stderr)
        return 2
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
