# w3 end to end (benchmarks/e2e_smoke.py): the example 1b decoder (1.03e9 params, AdamW, batch
# 8 x 1024) trained 8 steps per variant, each in its own process: fp32 params device-resident,
# streamed (the layers' params host_stream) and with the optimizer state in pinned_host; bf16
# params device-resident and with the optimizer state (and fp32 masters) in pinned_host. Loss
# traces against the device-resident run's, step time and peak HBM over it. Result:
# $OUT/w3/1b_b8_<card>.json; W3_FLAGS adds flags (a later --variants replaces these).
# Usage: bash benchmarks/run_gpu.sh w3
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
# shellcheck disable=SC2086  # W3_FLAGS: several flags
STEP_TAIL=10 step w3_end_to_end 330 python3 benchmarks/e2e_smoke.py --out="$OUT" --config=1b \
    --steps=8 --variants=fp32:none,fp32:stream,fp32:auto,bf16:none,bf16:auto ${W3_FLAGS:-}
