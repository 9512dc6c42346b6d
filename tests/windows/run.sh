#!/usr/bin/env bash
# The Windows test layer: build or check the Wine environment, then run tests/windows.
# Usage: bash tests/windows/run.sh [pytest args]      exit code: pytest's (setup failures: setup's)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."

bash tests/windows/setup.sh

if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
# The Linux side needs ortq, Linux onnxruntime (the CPU reference), onnx (the test models) and pytest.
if ! "$PY" -c 'import ortq, onnx, onnxruntime, pytest' 2>/dev/null; then
    if [ "$PY" = .venv/bin/python ] || [ ! -e .venv ]; then
        echo "[windows-run] installing ortq[worker,dev] into .venv (as scripts/test.sh does)"
        . scripts/_venv.sh
        ortq_venv "worker,dev"
        PY=.venv/bin/python
    else
        echo "[windows-run] $PY cannot import ortq, onnx, onnxruntime and pytest" >&2
        exit 2
    fi
fi

# setup.sh has just built the environment: from here on its absence is a failure, not a skip.
export ORTQ_REQUIRE_WINE=1
echo "[windows-run] $PY -m pytest tests/windows $*"
exec "$PY" -m pytest tests/windows "$@"
