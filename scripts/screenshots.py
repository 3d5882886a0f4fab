"""Copy the Airflow UI screenshots the browser tests took (``artifacts/airflow-ui-*.png``, written by
``tests/e2e/test_user_jobs.py`` and ``tests/e2e/test_control_plane.py`` in ``make test-all``) into the documentation
(``docs/assets/screenshots/``), so that the pages show the UI as the tests last saw it, never a picture made by hand.

    make test-all                      (or: pytest -m full -k browser)
    python scripts/screenshots.py      copy the ones the tests wrote; list the ones still missing
"""

from __future__ import annotations

import re
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SHOTS = ROOT / "docs" / "assets" / "screenshots"


def taken_by_tests() -> set[str]:
    """The screenshot names the browser tests save (``airflow-ui-....png``)."""
    names: set[str] = set()
    for path in (ROOT / "tests").rglob("test_*.py"):
        names |= set(re.findall(r"airflow-ui-[\w.-]+?\.png", path.read_text()))
    return names


def main() -> int:
    wanted = taken_by_tests()
    copied, missing = [], []
    for name in sorted(wanted):
        src = ROOT / "artifacts" / name
        if src.is_file():
            SHOTS.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, SHOTS / name)
            copied.append(name)
        else:
            missing.append(name)
    print(f"copied {len(copied)}: {', '.join(copied) or 'none'}")
    if missing:
        print(f"not taken yet (run the browser tests): {', '.join(missing)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
