"""Make the benchmark tables from the committed results in bench/results/: the full table of the documentation's
benchmarks page (every metric of every file) and the README's headline table (the few figures a newcomer asks
for first, named in ``HEADLINE``).

    python bench/table.py            print the full table
    python bench/table.py --update   rewrite both tables between their markers (docs/benchmarks.md, README.md)
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BEGIN, END = "<!-- bench-table:begin -->", "<!-- bench-table:end -->"
HEAD_BEGIN, HEAD_END = "<!-- bench-headline:begin -->", "<!-- bench-headline:end -->"
PEERS_BEGIN, PEERS_END = "<!-- bench-peers:begin -->", "<!-- bench-peers:end -->"
# bench/peers.py's systems: (metric prefix, distribution, name for people)
SYSTEMS = (("trainguard", "trainguard", "trainguard"),
           ("trainguard_replicas", "trainguard", "trainguard, replica groups"),
           ("nvrx", "nvidia-resiliency-ext", "NVRx"), ("torchft", "torchft", "torchft"))
PAGE = ROOT / "docs" / "benchmarks.md"
README = ROOT / "README.md"

# (results file, metric, what it means to a reader): the README's headline rows, in this order
HEADLINE: tuple[tuple[str, str, str], ...] = (
    ("detection", "detect_s.crash", "a rank crashes: detected"),
    ("detection", "detect_s.gpu_lost", "a GPU falls off the bus: detected"),
    ("recovery", "resume_s.gpu_lost", "a GPU lost: fault to training again on a warm standby"),
    ("recovery", "lost_steps.gpu_lost", "steps lost to that fault"),
    ("checkpoint", "device.step_overhead_ratio", "a checkpoint every step: step time added (emulated device)"),
    ("checkpoint", "dcp.device.step_overhead_ratio", "the same with DCP `async_save`, in the same run"),
    ("chaos", "trials", "chaos campaign: trials (two faults at once, outages, forged input)"),
    ("chaos", "jobs_dead", "chaos campaign: jobs left dead"),
    ("campaign", "ettr", "random faults every few minutes: effective training time"),
    ("day", "incidents_healthy", "a stranger's Lightning job (8 ms steps) trained healthy for 30 min: incidents"),
    ("day", "ettr", "the same through 5 faults and a resubmit: effective training time (samples: docs/benchmarks.md)"),
    ("false_slow", "incidents_healthy.10ms", "the same job beside two CPU hogs for 30 min: incidents (a 30% straggler "
                                             "voted out)"),
    ("simulate", "ettr.measured", "9,600 GPUs for 90 days (simulated): effective training time"),
    ("simulate", "ettr.measured_degrade", "the same, training through a lost replica on the others"),
    ("replicas", "survivor_stall_s", "a replica group dies: the other's stall (trainguard.replicas)"),
    ("degrade", "ratio.gpu_lost", "a GPU lost: GPU-seconds lost training on the other replicas, over stopping all"),
    ("degrade", "ratio.crash", "the same for a crash"),
    ("degrade", "ratio.hang", "the same for a hang"),
)


def _documents() -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((ROOT / "bench" / "results").glob("*.json"))}


def _value(m: dict[str, Any]) -> str:
    value = m["median"] if "median" in m else m["value"]  # a rate or count has one value, not a spread
    return f"{value:g} {m['unit']}"


def rows() -> list[str]:
    out = ["| benchmark | metric | median | p90 | n | target | command |", "|---|---|---|---|---|---|---|"]
    for stem, doc in _documents().items():  # a file's name: one script may write several (chaos, chaos_joins)
        for key, m in doc["metrics"].items():
            cmd = f"`python bench/{m.get('script', doc['name'])}.py`"  # a metric another script adds to the file
            target = m.get("target")
            p90 = "" if m.get("p90") is None else f"{m['p90']:g}"
            out.append(
                f"| {stem} | {key} | {_value(m)} | {p90} | {m['n']} | "
                f"{'' if target is None else target} | {cmd} |"
            )
    return out


def headline() -> list[str]:
    docs = _documents()
    out = ["| what | measured | n | target |", "|---|---|---|---|"]
    for name, key, what in HEADLINE:
        m = docs[name]["metrics"].get(key)
        if m is None:
            raise KeyError(f"bench/results/{name}.json has no metric {key!r}; fix HEADLINE in bench/table.py")
        target = m.get("target")
        out.append(f"| {what} | {_value(m)} | {m['n']} | {'' if target is None else target} |")
    return out


def peers_rows(doc: dict[str, Any] | None = None, *, detail: bool = True) -> list[str]:
    """The side-by-side table of ``bench/results/peers.json``: a row per fault, a column per system, each cell
    the median GPU-seconds lost in the window after the fault (when the result has them), the trials resumed, the
    median fault -> training again (and -> full width, steps done again) and, with ``detail``, what a human had
    to do."""
    doc = doc or _documents().get("peers")
    if doc is None:
        return ["(no bench/results/peers.json yet: `python bench/peers.py --out bench/results/peers.json`)"]
    m, setup = doc["metrics"], doc["setup"]
    order = ("crash", "hang", "hang_collective", "machine_lost", "nan", "slow")  # bench/peers.py's FAULTS
    faults = sorted(dict.fromkeys(t["fault"] for t in setup["trials"]),
                    key=lambda f: (order.index(f) if f in order else len(order), f))
    systems = [s for s in SYSTEMS if any(t["peer"] == s[0] for t in setup["trials"])]  # a system run at all
    names = [f"{label} {setup['versions'].get(dist, '?')}" for _, dist, label in systems]
    out = [f"| fault | {' | '.join(names)} |", "|---" * (len(systems) + 1) + "|"]
    for fault in faults:
        cells = []
        for prefix, _, _ in systems:
            key = f"{prefix}.{fault}"
            rate = m.get(f"{key}.resumed_rate")
            if rate is None:
                cells.append("not run")
                continue
            n = rate["n"]
            ok = round(rate["value"] * n)
            lost = m.get(f"{key}.gpu_s_lost")
            cell = f"**{lost['median']:g} GPU-s lost**; " if lost else ""
            if ok == 0:
                cell += f"not resumed (0/{n})"
            else:
                cell += f"{ok}/{n} resumed, {m[f'{key}.resume_s']['median']:g} s"
                if f"{key}.full_width_s" in m and fault != "slow":
                    cell += f"; full width {m[f'{key}.full_width_s']['median']:g} s"
                if f"{key}.steps_lost" in m:
                    cell += f"; {m[f'{key}.steps_lost']['median']:g} steps again"
            taken = m.get(f"{key}.healthy_taken_out", {}).get("value")
            if taken:
                cell += f"; {taken} healthy machines out"
            human = [h for h in setup.get("human", {}).get(key, []) if h != "nothing"]
            if detail and human:
                cell += f". A human: {'; or '.join(human)}"
            cells.append(cell)
        out.append(f"| {fault} | {' | '.join(cells)} |")
    return out


def between(text: str, begin: str, end: str) -> str | None:
    """What ``text`` holds between the two markers (None when one is missing)."""
    if begin not in text or end not in text:
        return None
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def _replace(path: Path, begin: str, end: str, table: str) -> None:
    text = path.read_text()
    if between(text, begin, end) is None:
        raise SystemExit(f"{path.relative_to(ROOT)} lacks the markers {begin} ... {end}; put them where the table goes")
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    path.write_text(f"{head}{begin}\n{table}\n{end}{tail}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--update", action="store_true")
    args = ap.parse_args()
    if not args.update:
        print("\n".join(rows()))
        return 0
    try:
        _replace(PAGE, BEGIN, END, "\n".join(rows()))
        _replace(README, HEAD_BEGIN, HEAD_END, "\n".join(headline()))
        _replace(PAGE, PEERS_BEGIN, PEERS_END, "\n".join(peers_rows()))
        _replace(README, PEERS_BEGIN, PEERS_END, "\n".join(peers_rows(detail=False)))
    except (SystemExit, KeyError) as e:
        print(e.args[0] if e.args else e, file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
