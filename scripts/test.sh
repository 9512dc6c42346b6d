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
exec .venv/bin/python -m pytest "$@"
