# w5 planner (benchmarks/planner_bench.py): the planner's predicted step time and peak HBM
# against measured, on the 1b decoder's widths with 6 layers, in three cases: it fits, the
# optimizer state must go to the host, only streaming fits. Plans with the stored profile if
# `calibrate` ran before it in the same call, else with the defaults (the plan notes say which).
# Result: $OUT/w5/planner_<card>.json; W5_FLAGS adds flags. Usage: bash benchmarks/run_gpu.sh w5
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
# shellcheck disable=SC2086  # W5_FLAGS: several flags
STEP_TAIL=8 step w5_planner 420 python3 benchmarks/planner_bench.py --num_layers=6 --steps=5 \
    --warmup=2 --skip_cli --out="$OUT" ${W5_FLAGS:-}
