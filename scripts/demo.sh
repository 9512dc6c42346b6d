#!/usr/bin/env bash
# The bundled digits model served through a real Redis queue by a real worker, end to end.
# Creates .venv, installs ortq[worker], starts a local Redis and a worker, prints the results.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
ortq_venv "worker"
exec .venv/bin/ortq demo "$@"
