"""MkDocs hooks of the documentation site (``mkdocs.yml``).

- The site's home page is the README, its links into ``docs/`` made relative to the site: one text, never two
  that drift apart.
- The charts the benchmarks commit in ``bench/results/`` are served as ``assets/<name>.png`` without a copy in
  ``docs/``, so a page shows what the last committed run drew.
"""

from __future__ import annotations

from pathlib import Path

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"


def home_page(readme: str) -> str:
    """The README as the site's ``index.md``: links to ``docs/X`` become links to ``X``."""
    return readme.replace("](docs/", "](")


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, "index.md", content=home_page((ROOT / "README.md").read_text())))
    for chart in sorted(RESULTS.glob("*.png")):
        files.append(File.generated(config, f"assets/{chart.name}", abs_src_path=str(chart)))
    return files
