#!/usr/bin/env bash
# One device call (session 3 start): build; W2 with the honest DRAM bound (issue 3); the tiny
# decoder streamed on the GPU (examples test); the 1b decoder streamed, with compile logs and
# Python stack dumps every 30 s, to find where it stalls (issue 4).
# Usage (device tool, repo root): bash benchmarks/run_h200_diag.sh
source "$(dirname "$0")/h200_build.sh"  # options, OUT, ROOT, stamp; builds jaxtier
timeout 170 python3 benchmarks/host_update_bench.py --reps=3 --out="$OUT" > "$OUT/host_update.log" 2>&1
tail -22 "$OUT/host_update.log"
stamp "W2 done"
cd /tmp
timeout 80 python3 -m pytest -q -p no:cacheprovider -k "stream" "$ROOT/tests/examples_test.py" \
    > "$OUT/examples_stream_gpu.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/examples_stream_gpu.log" | tail -5
cd "$ROOT"
stamp "tiny decoder stream test done"
JAX_LOG_COMPILES=1 timeout $(( 570 - ($(date +%s) - t0) )) python3 benchmarks/e2e_smoke.py \
    --out="$OUT" --config=1b --steps=4 --stack_every=30 --variants=fp32:stream \
    > "$OUT/e2e_stream_diag.log" 2>&1
stamp "1b stream diag ended (rc $?)"
grep -vE "^\s+File .*(site-packages/(absl|jax/_src/(traceback|profiler|api_util|linear_util)))" \
    "$OUT/e2e_stream_diag.log" | grep -E "ompil|jaxtier|Thread|File|step|plan|done|Error" | tail -60
