#!/usr/bin/env bash
# Create or refresh ./.venv with trainguard's pinned dependencies, its tools (requirements-dev.txt) and trainguard itself
# (editable), bytecode compiled. Idempotent: a stamp of requirements.txt, constraints.txt, setup.py,
# pyproject.toml and this script skips the install when nothing changed. Uses uv when it is on PATH or
# can be installed into the venv (seconds), pip otherwise (minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
stamp=.venv/.trainguard-stamp
want=$(cat requirements.txt requirements-dev.txt constraints.txt pyproject.toml setup.py scripts/venv.sh | sha256sum | cut -d' ' -f1)
if [ -x .venv/bin/python ] && [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then
  exit 0
fi
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "trainguard needs Python >= 3.11; set PYTHON=/path/to/python3.11" >&2
  exit 2
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# uv does not read pip's configuration: hand it pip's find-links (where a CPU torch
# build may be waiting) so it does not fetch the CUDA build.
if [ -n "${PIP_FIND_LINKS:-}" ]; then export UV_FIND_LINKS="${UV_FIND_LINKS:-$PIP_FIND_LINKS}"; fi
uv=""
if command -v uv >/dev/null 2>&1; then
  uv=uv
elif .venv/bin/python -m pip install -q uv==0.13.8 >/dev/null 2>&1; then
  uv=.venv/bin/uv
fi
echo "setting up .venv (${uv:-pip}) ..." >&2
if [ -n "$uv" ]; then
  # --compile-bytecode: with PYTHONDONTWRITEBYTECODE set (common in CI and containers) no .pyc is
  # ever cached, and every process that imports torch compiles it again (about 4.8 s instead of 2.3 s
  # here; the demo starts dozens of them: ranks, diagnosis tests, Airflow tasks)
  "$uv" pip install -q --compile-bytecode --python .venv/bin/python -r requirements-dev.txt -c constraints.txt
  "$uv" pip install -q --python .venv/bin/python --no-deps -e .
else
  .venv/bin/python -m pip install -q -r requirements-dev.txt -c constraints.txt
  .venv/bin/python -m compileall -q .venv/lib/python3*/site-packages >/dev/null || true
  .venv/bin/python -m pip install -q --no-deps -e .
fi
echo "$want" > "$stamp"
