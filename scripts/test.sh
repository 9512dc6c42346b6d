#!/usr/bin/env bash
# ortq's checks from a fresh checkout, in three passes:
#   1. in .venv (the RQ that ortq's dependency range resolves to, the newest series): lint, types,
#      then the whole test suite (real Redis, real workers);
#   2. in .venv-rq2 (the oldest releases pyproject allows of RQ, redis-py, numpy, msgpack, click,
#      prometheus-client and, for the worker, onnxruntime; the `test` extra, without `dev`'s newer
#      onnxruntime and WebGPU EP): the tests marked `rqcompat`, i.e.
#      the RQ contract tests (tests/rqcontract), an end-to-end subset, raw Redis clients, the
#      error messages redis-py's words go into, and the providers, adapters and worker starts.
#   3. in .venv again, against Valkey instead of Redis (every server the tests start is
#      valkey-server: ORTQ_TEST_SERVER, tests/conftest.py): the `rqcompat` tests of VALKEY_TESTS
#      below (RQ's contract, the scripts under the ACL, raw clients, end to end, and
#      tests/test_sentinel.py's failovers under Valkey's own sentinels), ~40 s (~2 min in one process). The whole
#      rqcompat set, test_reliability.py and test_job_ownership.py pass on Valkey too, ~10 min more on
#      the 2-core CI VM: ORTQ_TEST_SERVER=valkey-server .venv/bin/python -m pytest FILES runs them.
#      valkey-server comes from Debian bookworm-backports (scripts/valkey.sh; .ci/run installs it);
#      without it the pass is skipped, saying so, except under CI=true, where that is a failure.
# Extra arguments go to pytest in every pass, e.g. `bash scripts/test.sh -k wire` (a pass that
# then selects no test at all is not a failure). ORTQ_TEST_PASS=main runs only pass 1,
# ORTQ_TEST_PASS=rq2 only pass 2, ORTQ_TEST_PASS=valkey only pass 3. The script exits non-zero if any
# pass failed. Its last lines summarise every pass: passed/failed/errors/skipped counts of each
# that ran, and why any other did not (skipped, not selected, or the script stopped before it).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/_venv.sh
test_pass="${ORTQ_TEST_PASS:-all}"
case "$test_pass" in
    all | main | rq2 | valkey) ;;
    *) echo "ORTQ_TEST_PASS must be all, main, rq2 or valkey (got '$test_pass')" >&2; exit 2 ;;
esac
status=0

# The summary printed last (an EXIT trap: also when lint, types or an install stop the script under set -e):
# one line a pass, from each pass's JUnit XML report (pytest --junitxml, in a directory of the script's own).
reports=$(mktemp -d "${TMPDIR:-/tmp}/ortq-test-reports.XXXXXX")
declare -A summary=()
current=""  # the pass under way: what the summary names if the script stops inside it
pass_label() {
    case "$1" in
        main) echo "pass 1 (whole suite, .venv)" ;;
        rq2) echo "pass 2 (rqcompat, oldest dependencies, .venv-rq2)" ;;
        valkey) echo "pass 3 (rqcompat on Valkey, .venv)" ;;
    esac
}
# "N passed, N failed, N errors, N skipped" from a JUnit XML report (any python3 reads it).
junit_counts() {
    python3 - "$1" <<'PY'
import sys
import xml.etree.ElementTree as ET

try:
    root = ET.parse(sys.argv[1]).getroot()
except (OSError, ET.ParseError) as exc:
    print(f"no report ({type(exc).__name__}: pytest did not write {sys.argv[1]})")
    raise SystemExit
suites = [root] if root.tag == "testsuite" else root.findall("testsuite")
n = {key: sum(int(suite.get(key, 0)) for suite in suites) for key in ("tests", "failures", "errors", "skipped")}
passed = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
print(f"{passed} passed, {n['failures']} failed, {n['errors']} errors, {n['skipped']} skipped")
PY
}
# record PASS PYTEST_EXIT_STATUS: the pass's summary line, from its report.
record() {
    local what
    what="$(junit_counts "$reports/$1.xml")"
    case "$2" in
        0) what+=" (pytest exit status 0)" ;;
        5) what+=" (pytest exit status 5: no test selected)" ;;
        *) what+=" (pytest exit status $2: FAILED)" ;;
    esac
    summary[$1]="$what"
    current=""
}
print_summary() {
    local exit_status=$? name
    if [ -n "$current" ]; then
        summary[$current]="stopped before its tests ended (exit status $exit_status; see above: lint, types, an install or an interrupt)"
    fi
    echo "== summary (exit status $exit_status)"
    for name in main rq2 valkey; do
        if [ -n "${summary[$name]+set}" ]; then
            echo "   $(pass_label "$name"): ${summary[$name]}"
        elif [ "$test_pass" = all ] || [ "$test_pass" = "$name" ]; then
            echo "   $(pass_label "$name"): not run (the script stopped before it)"
        else
            echo "   $(pass_label "$name"): not run (ORTQ_TEST_PASS=$test_pass)"
        fi
    done
    rm -rf "$reports"
}
trap print_summary EXIT

# Every pass runs its tests in parallel (pytest-xdist): ORTQ_TEST_WORKERS pytest processes, by default two a
# CPU core up to 8 (most tests wait on worker processes and Redis: on CI's 2-core VM pass 1 took 17 min in one
# process, 6.5 min in 3, 5-6 min in 4, and no less in 6 or 8, where the load made tests fail). Each process has
# its own redis-server; a test goes to whichever is free, except that tests sharing a module-scoped fixture, and
# tests/windows, stay on one (tests/xdist_groups.py). ORTQ_TEST_WORKERS=0, or `-n 0` or `-p no:xdist` among
# the extra arguments, runs a pass in one process, as before (for --pdb and the like).
cores=$(nproc 2>/dev/null || echo 2)
workers="${ORTQ_TEST_WORKERS:-$((2 * cores < 8 ? 2 * cores : 8))}"
xdist=(-n "$workers" --dist loadgroup)
if [ "$workers" = 0 ] || [[ " $* " == *no:xdist* ]]; then xdist=(); fi

rq_version() { "$1/bin/python" -c 'import rq; print(rq.__version__)'; }

if [ "$test_pass" = all ] || [ "$test_pass" = main ]; then
    current=main
    # --upgrade rq: an existing .venv moves to the newest RQ that ortq's range allows, as a fresh one has.
    ortq_venv "worker,dev" .venv --upgrade rq
    echo "== pass 1: whole suite, RQ $(rq_version .venv), in .venv"
    .venv/bin/ruff check ortq tests bench scripts
    .venv/bin/ruff format --check ortq tests bench scripts
    .venv/bin/mypy
    # The Windows layer (tests/windows: the real worker on Windows CPython with DirectML, under Wine)
    # needs root and apt; CI always builds it (and its tests then must run), elsewhere ORTQ_WINE=1 asks.
    if [ "${CI:-}" = "true" ] || [ "${ORTQ_WINE:-0}" = "1" ]; then
        bash tests/windows/setup.sh
    fi
    main_status=0
    .venv/bin/python -m pytest "${xdist[@]}" --junitxml="$reports/main.xml" "$@" || main_status=$?
    record main "$main_status"
    # pytest's 5: nothing selected, which only the caller's own -k/-m/path arguments can cause.
    if [ "$main_status" -eq 5 ] && [ $# -gt 0 ]; then main_status=0; fi
    status=$main_status
fi

if [ "$test_pass" = all ] || [ "$test_pass" = rq2 ]; then
    current=rq2
    ortq_venv "worker,test" .venv-rq2 "rq==2.12.*" "redis[hiredis]==5.0.*" "numpy==1.26.*" "msgpack==1.0.7" \
        "click==8.1.*" "prometheus-client==0.20.*" "onnxruntime==1.20.*"
    echo "== pass 2: tests marked rqcompat, RQ $(rq_version .venv-rq2), redis-py $(.venv-rq2/bin/python -c 'import redis; print(redis.__version__)'), onnxruntime $(.venv-rq2/bin/python -c 'import onnxruntime; print(onnxruntime.__version__)'), in .venv-rq2"
    if [ -x .venv/bin/python ] && [ "$(rq_version .venv | cut -d. -f1)" = "$(rq_version .venv-rq2 | cut -d. -f1)" ]; then
        echo "warning: .venv has RQ $(rq_version .venv) too: only one RQ series is being tested" >&2
    fi
    rq2_status=0
    # The cache stays apart from pass 1's, whose entries were written under another RQ.
    .venv-rq2/bin/python -m pytest "${xdist[@]}" -m rqcompat -o cache_dir=.pytest_cache/rq2 \
        --junitxml="$reports/rq2.xml" "$@" || rq2_status=$?
    record rq2 "$rq2_status"
    if [ "$rq2_status" -eq 5 ] && [ $# -gt 0 ]; then rq2_status=0; fi
    if [ "$rq2_status" -ne 0 ]; then status=$rq2_status; fi
fi

# Pass 3's files: where a server's own behaviour shows (RQ's contract, the scripts under the ACL,
# raw clients, Sentinel failovers, a whole job's path); the whole rqcompat set on Valkey passed too
# (353 tests, 4.3 min), kept out of CI for its time.
VALKEY_TESTS=(tests/rqcontract tests/test_sentinel.py tests/test_transport_security.py tests/test_raw_redis.py
              tests/test_end_to_end.py tests/test_priority.py
              tests/test_worker_inprocess.py::test_a_worker_whose_acl_lacks_a_script_command_exits_2_saying_so)
if [ "$test_pass" = all ] || [ "$test_pass" = valkey ]; then
    if ! command -v valkey-server >/dev/null 2>&1; then
        if [ "${CI:-}" = "true" ]; then
            echo "== pass 3: no valkey-server (CI installs it: .ci/run, scripts/valkey.sh)" >&2
            summary[valkey]="FAILED: no valkey-server on PATH, which CI must have (.ci/run, scripts/valkey.sh)"
            status=1
        else
            echo "== pass 3 skipped: no valkey-server on PATH (bash scripts/valkey.sh installs it, as root)" >&2
            summary[valkey]="SKIPPED: no valkey-server on PATH (bash scripts/valkey.sh installs it, as root)"
        fi
    else
        current=valkey
        [ -x .venv/bin/python ] || ortq_venv "worker,dev" .venv
        echo "== pass 3: tests marked rqcompat of ${VALKEY_TESTS[*]} on $(valkey-server --version | cut -d' ' -f1-3), in .venv"
        valkey_status=0
        ORTQ_TEST_SERVER=valkey-server .venv/bin/python -m pytest "${xdist[@]}" -m rqcompat \
            -o cache_dir=.pytest_cache/valkey --junitxml="$reports/valkey.xml" "${VALKEY_TESTS[@]}" "$@" || valkey_status=$?
        record valkey "$valkey_status"
        if [ "$valkey_status" -eq 5 ] && [ $# -gt 0 ]; then valkey_status=0; fi
        if [ "$valkey_status" -ne 0 ]; then status=$valkey_status; fi
    fi
fi
exit "$status"
