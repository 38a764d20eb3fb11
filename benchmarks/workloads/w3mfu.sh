# w3 MFU (benchmarks/capacity_bench.py): issue 15's MFU rows through the CLI as a user runs it
# (XLA's defaults: the CLI raises the pinned pool and the allocator's fraction itself where its
# plan or its jax.jit step needs them): the 8b example decoder device-only at batch 4 x 2048,
# with its optimizer state on the host at batch 16, and the largest capacity config (14b) with
# its optimizer state on the host at batch 12, where the update hides under the compute. Each
# run's `mfu_over_8b_device_only` is its MFU over the device-only run's of the same call.
# Result: $OUT/w3/cli_mfu_8b_14b_<card>.json (about 7.5 minutes on the H200, the build aside). W3_MFU_RUNS
# replaces the runs.
# Usage: bash benchmarks/run_gpu.sh w3mfu (a name of its own: "w3" is w3_end_to_end.sh)
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
STEP_TAIL=20 step w3_mfu 545 python3 benchmarks/capacity_bench.py --steps=5 --timeout=340 \
    --out="$OUT" --workload=w3_mfu --result="w3/cli_mfu_8b_14b_{card}.json" \
    --runs="${W3_MFU_RUNS:-8b:none:4,8b:optimizer_state_on_host:16,14b:optimizer_state_on_host:12}"
