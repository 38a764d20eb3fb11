# calibrate: `python -m jaxtier calibrate` measures this machine (the link each way and in
# duplex, zero-copy, the executors, matmul, HBM, host DRAM) and stores the profile the planner
# uses; a w5 after it in the same call plans with that profile. Log: $OUT/calibrate/<card>.log
# (kept as benchmarks/results/calibrate/h200.log). Usage: bash benchmarks/run_gpu.sh calibrate
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
STEP_DIR=/tmp STEP_TAIL=24 step "calibrate/$BENCH_CARD" 150 python3 -m jaxtier calibrate
