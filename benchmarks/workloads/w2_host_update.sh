# w2 host update (benchmarks/host_update_bench.py): one AdamW step of 2.15e9 params, fp32
# master, mu and nu in pinned_host updated in place by each executor (host_dha, host_cpu, split),
# against the host-DRAM, link and split bounds, torch's fused CPU AdamW and XLA native; then C1
# (1.3e9 params, the best executor, checked against optax). Result: $OUT/w2/host_update_<card>.json;
# W2_FLAGS adds flags. Usage: bash benchmarks/run_gpu.sh w2
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
# shellcheck disable=SC2086  # W2_FLAGS: several flags
STEP_TAIL=14 step w2_host_update 170 python3 benchmarks/host_update_bench.py --reps=3 \
    --out="$OUT" ${W2_FLAGS:-}
