# e8b defaults (benchmarks/capacity_bench.py): `python -m jaxtier train --config=8b --steps=20`
# as a user runs it, with XLA's defaults (no environment variable set by hand), with
# --offload=auto and with --offload=optimizer_state_on_host. Result: $OUT/e8b/defaults_<card>.json.
# E8B_RUNS: config:offload,... (default 8b:auto,8b:optimizer_state_on_host).
# Usage: bash benchmarks/run_gpu.sh e8b
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
STEP_TAIL=12 step e8b_defaults 520 python3 benchmarks/capacity_bench.py \
    --runs="${E8B_RUNS:-8b:auto,8b:optimizer_state_on_host}" --steps=20 --timeout=300 \
    --out="$OUT" --workload=e8b_defaults --result="e8b/defaults_{card}.json"
