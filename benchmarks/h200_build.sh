# Sourced by the benchmarks/run_h200_*.sh scripts (device tool, repo root): the common prologue.
# Sets strict-ish shell options, unbuffered Python, JAXTIER_REQUIRE_GPU=1 (a GPU test skip is a
# failure), OUT (where results go), ROOT (the checkout), t0 and `stamp` (elapsed-time lines),
# then builds and installs jaxtier on the machine and stamps "built".
set -uo pipefail
export PYTHONUNBUFFERED=1 JAXTIER_REQUIRE_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install --no-build-isolation --no-deps -q . 2>&1 | tail -5
stamp "built"
