#!/usr/bin/env bash
# ortq's checks from a fresh checkout: lint, types, then the test suite (real Redis, real workers).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k wire`.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
ortq_venv "worker,dev"
.venv/bin/ruff check ortq tests bench scripts
.venv/bin/ruff format --check ortq tests bench scripts
.venv/bin/mypy
# The Windows layer (tests/windows: the real worker on Windows CPython with DirectML, under Wine)
# needs root and apt; CI always builds it (and its tests then must run), elsewhere ORTQ_WINE=1 asks.
if [ "${CI:-}" = "true" ] || [ "${ORTQ_WINE:-0}" = "1" ]; then
    bash tests/windows/setup.sh
fi
exec .venv/bin/python -m pytest "$@"
