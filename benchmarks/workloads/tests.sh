# tests: the test suite on the GPU with JAXTIER_REQUIRE_GPU=1 (a GPU test that skips fails), run
# from /tmp against the installed package. TESTS (run_gpu.sh's --tests) gives pytest's arguments
# (paths from the repo root, -k ...; default: tests, the whole suite: the slow set too, `-m ""`;
# a -m in TESTS narrows it). Its timeout is what is
# left of the call: run it last or alone; split the suite over calls if it does not fit.
# Log: $OUT/tests.log. Usage: bash benchmarks/run_gpu.sh [--tests="..."] tests
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
eval "_tests_args=(${TESTS:-tests})"
for _i in "${!_tests_args[@]}"; do
  _a=${_tests_args[$_i]}
  if [[ $_a != -* && -e "$ROOT/${_a%%::*}" ]]; then _tests_args[$_i]=$ROOT/$_a; fi
done
STEP_DIR=/tmp STEP_SHOW='^(FAILED|ERROR)|passed|failed|error' STEP_TAIL=25 \
  step tests "$CALL_SECS" python3 -m pytest -q -p no:cacheprovider -rfE -m "" "${_tests_args[@]}"
