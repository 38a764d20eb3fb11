# tests: the test suite on the GPU with JAXTIER_REQUIRE_GPU=1 (a GPU test that skips fails), run
# from /tmp against the installed package. TESTS (run_gpu.sh's --tests) gives pytest's arguments
# (paths from the repo root, -k ...; default: tests, the whole suite: the slow set too, `-m ""`;
# a -m in TESTS narrows it). Unless TESTS says how (-n), the tests run on TEST_WORKERS (8)
# pytest-xdist workers sharing the GPU: XLA_PYTHON_CLIENT_PREALLOCATE=false, so that each worker
# allocates what its tests use rather than 75% of the card each (the allocator's limit, which
# the plans read, stays the default fraction); the whole suite then fits one call on an H100 or
# an H200. Its timeout is what is left of the call: run it last or alone.
# Log: $OUT/tests.log (with the 30 slowest tests). Usage: bash benchmarks/run_gpu.sh [--tests="..."] tests
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
eval "_tests_args=(${TESTS:-tests})"
_workers=(-n "${TEST_WORKERS:-8}" --dist worksteal)
for _i in "${!_tests_args[@]}"; do
  _a=${_tests_args[$_i]}
  if [[ $_a == -n* || $_a == --numprocesses* ]]; then _workers=(); fi
  if [[ $_a != -* && -e "$ROOT/${_a%%::*}" ]]; then _tests_args[$_i]=$ROOT/$_a; fi
done
XLA_PYTHON_CLIENT_PREALLOCATE=${XLA_PYTHON_CLIENT_PREALLOCATE:-false} \
STEP_DIR=/tmp STEP_SHOW='^(FAILED|ERROR)|passed|failed|error' STEP_TAIL=25 \
  step tests "$CALL_SECS" python3 -m pytest -q -p no:cacheprovider -rfE -m "" \
    --durations=30 "${_workers[@]}" "${_tests_args[@]}"
