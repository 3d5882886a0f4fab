"""trainguard's tests: unit tests beside the package they test (``tests/<package>/...``), the end-to-end tier
in ``tests/e2e/``, the repository's own checks in ``tests/repo/``; the shared fixtures and fakes at the top."""

from pathlib import Path

#: the repository's root
REPO = Path(__file__).resolve().parent.parent
