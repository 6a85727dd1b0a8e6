#!/usr/bin/env bash
# The engine tests on a machine in trouble, before a user's machine shows it: each case runs the
# given test files (default: the HTTP engine tests) once and prints its outcome and seconds.
#   hog          a spinning process beside the tests (half of a 2-core machine)
#   one_core     the tests and every server they start pinned to one core (taskset)
#   new_session  the servers the tests start in a session of their own, as megarl started them
#                before (with autogroup scheduling their streams stalled for seconds)
#
#   tools/engine_tests_under_stress.sh [CASE ...]       (FILES="tests/e2e/..." to choose the tests)
set -u
cd "$(dirname "$0")/.." || exit 1
PY=.venv/bin/python
FILES=${FILES:-tests/e2e/test_http_engine.py}
CASES=("$@")
[ ${#CASES[@]} -eq 0 ] && CASES=(hog one_core new_session)
HOGS=()
stop_hogs() {
    for pid in "${HOGS[@]}"; do kill "$pid" 2>/dev/null; done
    HOGS=()
}
trap stop_hogs EXIT

run_case() {
    local name=$1 start rc
    shift
    start=$(date +%s)
    # shellcheck disable=SC2086  # FILES is a list of paths
    "$@" "$PY" -m pytest -q -p no:xdist $FILES > ".tmp/stress_$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc in $(( $(date +%s) - start )) s, $(tail -n 1 ".tmp/stress_$name.log")"
}

mkdir -p .tmp
for case in "${CASES[@]}"; do
    case $case in
        hog)
            "$PY" -c "while True: pass" &
            HOGS+=($!)
            run_case hog
            stop_hogs ;;
        one_core) run_case one_core taskset -c 0 ;;
        new_session) run_case new_session env MEGARL_TEST_SERVERS_NEW_SESSION=1 ;;
        *) echo "unknown case $case (hog, one_core, new_session)" >&2; exit 2 ;;
    esac
done
