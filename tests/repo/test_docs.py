"""The documentation cannot drift from the code: the README stays one screen, the site builds with
``mkdocs build --strict`` (a broken link, page or anchor fails), the snippets are lines of the tested examples,
and the tables generated from code or results are what the code and results say today."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests import REPO
from tests.conftest import load_script, marked_bash_blocks
from trainguard.operators.settings import ControlSettings, markdown_table

table = load_script("bench_table", REPO / "bench" / "table.py")  # the benchmark tables' maker

README = (REPO / "README.md").read_text()
MKDOCS = Path(sys.executable).with_name("mkdocs")


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, env=env, timeout=300)


def test_the_readme_is_one_screen_and_points_into_the_docs():
    assert len(README.splitlines()) <= 150
    for page in ("getting-started.md", "guard-your-job.md", "deploy.md", "operate.md", "reference/cli.md",
                 "benchmarks.md"):
        assert f"](docs/{page})" in README
        assert (REPO / "docs" / page).is_file()


def test_the_site_builds_strict_and_a_broken_link_fails_it(tmp_path):
    """The real site builds with no warning; the same site with one link to a missing anchor does not (the
    build is strict for anchors, not only for pages)."""
    built = _build(REPO / "mkdocs.yml", tmp_path / "site")
    assert built.returncode == 0, built.stderr[-3000:]
    index = (tmp_path / "site" / "index.html").read_text()
    assert "Guard your own job" in index and 'href="guard-your-job/"' in index  # the README, links made relative
    assert (tmp_path / "site" / "assets" / "simulate.png").is_file()  # the committed chart, served
    copy = tmp_path / "copy"
    shutil.copytree(REPO / "docs", copy / "docs")
    shutil.copytree(REPO / "scripts", copy / "scripts")
    for name in ("mkdocs.yml", "README.md"):
        shutil.copy(REPO / name, copy / name)
    page = copy / "docs" / "deploy.md"
    page.write_text(page.read_text() + "\nSee [the rungs](operate.md#no-such-section).\n")
    broken = _build(copy / "mkdocs.yml", tmp_path / "broken")
    assert broken.returncode != 0 and "no-such-section" in broken.stderr


@pytest.mark.parametrize("path", ["README.md", "docs/guard-your-job.md"])
def test_the_guard_snippets_are_lines_of_the_tested_examples(path):
    """Each Python block that names its source (``# from examples/...``) is that file's lines, in order (``...``
    elides lines): what a reader copies is what the tests run."""
    text = (REPO / path).read_text()
    blocks = [b.split("```", 1)[0] for b in text.split("```python\n")[1:]]
    sourced = [b for b in blocks if b.startswith("# from examples/")]
    assert sourced, f"{path} shows no example"
    if path.startswith("docs/"):
        assert {b.splitlines()[0].split()[-1] for b in sourced} == {
            "examples/plain/train.py", "examples/lightning/train.py", "examples/hf/train.py",
            "examples/replicas/train.py", "examples/recipes/train.py"}
    for block in sourced:
        head, *lines = block.splitlines()
        source = [line.strip() for line in (REPO / head.split()[-1]).read_text().splitlines()]
        at = 0
        for line in lines:
            if line.strip() in ("", "..."):
                continue
            assert line.strip() in source[at:], f"{head}: {line.strip()!r} is not a line of the example (in order)"
            at = source.index(line.strip(), at) + 1


reference = load_script("docs_reference", REPO / "scripts" / "reference.py")  # the reference tables' maker


@pytest.mark.parametrize("page,name", [(p, n) for p, tables in reference.TABLES.items() for n in tables])
def test_the_reference_pages_tables_are_what_the_code_says(page, name):
    """Each reference table (settings, alerts, commands, faults, exit codes, metrics) is what
    ``python scripts/reference.py --update`` makes from the code today."""
    text = (REPO / "docs" / "reference" / page).read_text()
    assert reference.between(text, name) == reference.TABLES[page][name](), \
        f"docs/reference/{page}'s {name} table is stale: run python scripts/reference.py --update"


def test_the_settings_table_lists_every_setting():
    page = (REPO / "docs" / "reference" / "settings.md").read_text()
    assert markdown_table() in page
    assert page.count("\n| `TG_") == len(ControlSettings.model_fields)


def test_the_benchmark_tables_are_the_committed_results():
    """The benchmarks page holds every metric of bench/results/*.json and the README its headline rows, as
    ``python bench/table.py --update`` writes them from the committed results."""
    page = (REPO / "docs" / "benchmarks.md").read_text()
    assert table.between(page, table.BEGIN, table.END) == "\n".join(table.rows())
    assert table.between(README, table.HEAD_BEGIN, table.HEAD_END) == "\n".join(table.headline())
    assert table.between(page, table.PEERS_BEGIN, table.PEERS_END) == "\n".join(table.peers_rows())
    assert table.between(README, table.PEERS_BEGIN, table.PEERS_END) == "\n".join(table.peers_rows(detail=False))


@pytest.mark.parametrize("path", ["README.md", "docs/getting-started.md", "docs/guard-your-job.md"])
def test_every_command_block_runs_or_says_why_not(path):
    """A newcomer's pages: each shell block is run here (``<!-- test: runs -->``) or says why a test cannot run it
    (``<!-- test: skip (reason) -->``), so no command on them is left unchecked by accident."""
    blocks = marked_bash_blocks((REPO / path).read_text())
    assert blocks
    for kind, reason, body in blocks:
        assert kind == "runs" or (kind == "skip" and len(reason) >= 12), \
            f"{path}: a block without its marker (or reason): {body!r}"
        if kind == "runs":
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", body], cwd=REPO, capture_output=True, text=True,
                                  timeout=300)
            assert done.returncode == 0, f"{path}: {body!r}: {done.stderr[-2000:]}"


def test_the_job_specs_the_pages_show_are_valid_specs():
    """The YAML job specs of the README and the guard page are what ``trainguard job submit`` accepts."""
    import yaml

    from trainguard.operators.jobspec import parse_spec

    specs = [b.split("```", 1)[0] for path in ("README.md", "docs/guard-your-job.md")
             for b in (REPO / path).read_text().split("```yaml\n")[1:]]
    assert specs
    for block in specs:
        spec = parse_spec(yaml.safe_load(block), source="the docs' spec")
        assert spec.name and spec.command


def test_the_screenshots_the_pages_show_are_the_browser_tests_own():
    """Every UI picture in the docs is one a browser test saves (its name appears in a test's
    ``save_screenshot``; ``scripts/screenshots.py`` copies them from ``artifacts/``), and each is there."""
    import re

    taken = load_script("docs_screenshots", REPO / "scripts" / "screenshots.py").taken_by_tests()
    shown = {m for page in (REPO / "docs").rglob("*.md")
             for m in re.findall(r"assets/screenshots/([\w.-]+\.png)", page.read_text())}
    assert shown and shown <= taken, shown - taken
    for name in shown:
        assert (REPO / "docs" / "assets" / "screenshots" / name).stat().st_size > 10_000
