#!/usr/bin/env bash
# One device call for the streaming issue: build jaxtier on the H200, W1 (streaming vs device,
# link and XLA native), the example decoder with streamed layers vs device-resident, the GPU
# tests of the stream / DHA / streamed-offload code, the DHA crossover and the stream
# primitives check. Each part has its own time limit so that one slow part cannot take the rest.
# Usage (device tool, repo root): bash benchmarks/run_h200_streaming.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 JAXTIER_REQUIRE_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install --no-build-isolation --no-deps -q . 2>&1 | tail -5
stamp "built"
timeout 170 python3 benchmarks/streaming_bench.py --out="$OUT" --reps=5 2>&1 | tee "$OUT/streaming.log" | tail -14
stamp "W1 done"
timeout 150 python3 benchmarks/e2e_smoke.py --out="$OUT" --config=1b --steps=12 \
    --variants=fp32:none,fp32:stream 2>&1 | tee "$OUT/e2e_stream.log" | tail -8
stamp "decoder done"
cd /tmp
timeout 140 python3 -m pytest -q -p no:cacheprovider \
    "$ROOT/tests/stream_test.py" "$ROOT/tests/streaming_test.py" "$ROOT/tests/dha_test.py" \
    "$ROOT/tests/multipath_test.py" "$ROOT/tests/offload_test.py" 2>&1 | tee "$OUT/gpu_tests.log" | tail -12
cd "$ROOT"
stamp "tests done"
timeout 70 python3 benchmarks/dha_crossover.py --out="$OUT/dha_crossover.json" 2>&1 | tee "$OUT/dha_crossover.log" | tail -14
stamp "dha done"
timeout 45 python3 benchmarks/streaming_primitives_check.py --out="$OUT/streaming_primitives.json" 2>&1 | tail -8
stamp "all done"
