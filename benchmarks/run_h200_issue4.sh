#!/usr/bin/env bash
# One device call (issue 4 close-out): build; the GPU tests of the stream, DHA, multipath and
# streamed-offload code; the DHA crossover; the example 1b decoder with streamed layers against
# device-resident. Usage (device tool, repo root): bash benchmarks/run_h200_issue4.sh
source "$(dirname "$0")/h200_build.sh"  # options, OUT, ROOT, stamp; builds jaxtier
cd /tmp
timeout 200 python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/stream_test.py" \
    "$ROOT/tests/dha_test.py" "$ROOT/tests/multipath_test.py" "$ROOT/tests/streaming_test.py" \
    > "$OUT/gpu_tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -15
cd "$ROOT"
stamp "tests done"
timeout 70 python3 benchmarks/dha_crossover.py --out="$OUT/dha_crossover.json" \
    > "$OUT/dha_crossover.log" 2>&1; tail -14 "$OUT/dha_crossover.log"
stamp "dha done"
timeout 250 python3 benchmarks/e2e_smoke.py --out="$OUT" --config=1b --steps=8 \
    --variants=fp32:none,fp32:stream > "$OUT/e2e_stream.log" 2>&1
grep -v "^[IW]1129" "$OUT/e2e_stream.log" | tail -8
stamp "all done"
