# The shared prologue of the GPU runs (device tool, from the repo root). benchmarks/run_gpu.sh
# and each benchmarks/workloads/*.sh source it; a second source in the same shell returns at
# once, so several workloads in one call build once.
#
# It sets shell options, PYTHONUNBUFFERED=1, JAXTIER_REQUIRE_GPU=1 (a GPU test that skips
# fails), OUT (where results go: the device tool's $OUT, else /tmp/out), ROOT (the checkout),
# t0, CALL_SECS (the call's budget, 570 s: the tool stops a command at 600 s), BENCH_LAUNCHED_BY
# (the command line that launched the run, recorded in each result), BENCH_CARD (the GPU's short
# name, e.g. h200: result files are named by it), BENCH_COMMIT (the checkout's HEAD, unless set
# before the run) and the helpers `stamp` and `step`
# (below). Then it installs
# the wheels carried in .whl/, if any, to /tmp/site (the device image has no registry), builds
# and installs jaxtier, and stamps "built". On exit it names the steps that failed, timed out or
# were skipped, and exits 1 if there are any.
#
# Run as a command, it does the same and then runs its arguments, `step` included (a diagnostic):
#   bash benchmarks/prologue.sh step dha_crossover 120 \
#       python3 benchmarks/diagnostics/dha_crossover.py --out=$OUT
if [[ -n "${_JAXTIER_PROLOGUE:-}" ]]; then return 0; fi
_JAXTIER_PROLOGUE=1
set -uo pipefail
export PYTHONUNBUFFERED=1 JAXTIER_REQUIRE_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
t0=$(date +%s)
CALL_SECS=${CALL_SECS:-570}
export BENCH_LAUNCHED_BY=${BENCH_LAUNCHED_BY:-"bash $0 $*"}
BENCH_CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 \
    | grep -oE '\b[A-Z]{1,2}[0-9]{2,4}[A-Z]?\b' | head -1 | tr '[:upper:]' '[:lower:]')
export BENCH_CARD=${BENCH_CARD:-cpu}
# A BENCH_COMMIT set before the run is kept: the checkout's HEAD here may not be the commit the
# tree holds (a copy of a worktree has no git history of its own).
if [[ -z "${BENCH_COMMIT:-}" ]]; then
  BENCH_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
  [[ -n "$(git status --porcelain 2>/dev/null)" ]] && BENCH_COMMIT+=" (tree uncommitted)"
fi
export BENCH_COMMIT
FAILED=()

stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }

# step NAME SECS CMD...: runs CMD in $ROOT (or in STEP_DIR) under `timeout`, SECS cut to what is
# left of the call's budget; its output goes to $OUT/NAME.log (NAME may name a folder under
# $OUT), after two header lines (card, commit, date; the command), of which the last STEP_TAIL (12)
# lines are printed without XLA's and absl's info and warning lines, or, with STEP_SHOW set,
# the last of the lines that match that regex. With under 20 s left the step is skipped.
step() {
  local name=$1 secs=$2 rc left
  shift 2
  left=$(( CALL_SECS - ($(date +%s) - t0) ))
  if (( left < 20 )); then
    stamp "$name skipped: ${left} s left of the call's ${CALL_SECS} s"
    FAILED+=("$name (skipped)")
    return 1
  fi
  (( secs > left )) && secs=$left
  mkdir -p "$(dirname "$OUT/$name.log")"
  { echo "# card $BENCH_CARD, commit $BENCH_COMMIT, $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "# command: $*"; } > "$OUT/$name.log"
  ( cd "${STEP_DIR:-$ROOT}" && exec timeout "$secs" "$@" ) >> "$OUT/$name.log" 2>&1
  rc=$?
  if [[ -n "${STEP_SHOW:-}" ]]; then
    grep -E "$STEP_SHOW" "$OUT/$name.log" | tail -n "${STEP_TAIL:-12}"
  else
    grep -vE '^(\[[^]]*\] )?[IW][0-9]{4} ' "$OUT/$name.log" | tail -n "${STEP_TAIL:-12}"
  fi
  if (( rc == 124 )); then
    stamp "$name timed out after $secs s (log: $name.log)"
    FAILED+=("$name (timed out)")
  elif (( rc )); then
    stamp "$name failed (rc $rc, log: $name.log)"
    FAILED+=("$name (rc $rc)")
  else
    stamp "$name done"
  fi
  return "$rc"
}

_prologue_exit() {
  local rc=$?
  if (( ${#FAILED[@]} )); then
    stamp "not done: ${FAILED[*]}"
    exit 1
  fi
  stamp "all done"
  exit "$rc"
}
trap _prologue_exit EXIT

if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if ! python3 -m pip install --no-build-isolation --no-deps -q . > /tmp/jaxtier_build.log 2>&1; then
  cp /tmp/jaxtier_build.log "$OUT/build.log"
  tail -30 /tmp/jaxtier_build.log
  stamp "build failed (log: build.log)"
  FAILED+=("build")
  exit 1
fi
tail -5 /tmp/jaxtier_build.log
stamp "built"

if [[ "${BASH_SOURCE[0]}" == "$0" && $# -gt 0 ]]; then
  "$@"
fi
