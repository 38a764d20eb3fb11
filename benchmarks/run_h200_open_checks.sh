#!/usr/bin/env bash
# The streaming and planner checks, in two device calls of under 10 minutes each (run in the
# fourth session: benchmarks/results/README.md). Usage (device tool, repo root):
#   bash benchmarks/run_h200_open_checks.sh stream   # build; streaming + optimizer GPU tests
#       (the optimizer table offloaded vs optax); W1; the 1b decoder streamed vs
#       device-resident
#   bash benchmarks/run_h200_open_checks.sh w5       # build; W5's three cases (issue 5)
#   bash benchmarks/run_h200_open_checks.sh planner_tests  # build; planner, offload and
#       executor tests on the GPU
#   bash benchmarks/run_h200_open_checks.sh calibrated  # build; `python -m jaxtier calibrate`
#       (stores this machine's profile), then W5 planned with that profile ($OUT/calibrated/)
source "$(dirname "$0")/h200_build.sh"  # options, OUT, ROOT, stamp; builds jaxtier
if [ "${1:-stream}" = "planner_tests" ]; then
  cd /tmp
  timeout 480 python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/planner_test.py" \
      "$ROOT/tests/offload_test.py" "$ROOT/tests/executors_test.py" > "$OUT/planner_gpu_tests.log" 2>&1
  grep -E "^FAILED|^ERROR|passed|failed" "$OUT/planner_gpu_tests.log" | tail -12
  stamp "all done"
  exit 0
fi
if [ "${1:-stream}" = "calibrated" ]; then
  timeout 150 python3 -m jaxtier calibrate > "$OUT/calibrate.log" 2>&1
  grep -vE "^\[.*\] [IW]1[0-9]{3}" "$OUT/calibrate.log" | tail -24
  stamp "calibrated"
  mkdir -p "$OUT/calibrated"
  timeout 400 python3 benchmarks/planner_bench.py --num_layers=6 --steps=5 --warmup=2 \
      --skip_cli --out="$OUT/calibrated" > "$OUT/calibrated/planner.log" 2>&1
  tail -8 "$OUT/calibrated/planner.log"
  stamp "all done"
  exit 0
fi
if [ "${1:-stream}" = "w5" ]; then
  timeout 540 python3 benchmarks/planner_bench.py --num_layers=6 --steps=5 --warmup=2 \
      --skip_cli --out="$OUT" > "$OUT/planner.log" 2>&1
  tail -8 "$OUT/planner.log"
  stamp "all done"
  exit 0
fi
cd /tmp
timeout 120 python3 -m pytest -q -p no:cacheprovider "$ROOT/tests/streaming_test.py" \
    "$ROOT/tests/stream_test.py" "$ROOT/tests/optimizers_test.py" > "$OUT/gpu_tests.log" 2>&1
grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpu_tests.log" | tail -8
cd "$ROOT"
stamp "tests done"
timeout 150 python3 benchmarks/streaming_bench.py --reps=3 --out="$OUT" > "$OUT/streaming.log" 2>&1
tail -10 "$OUT/streaming.log"
stamp "W1 done"
timeout 240 python3 benchmarks/e2e_smoke.py --out="$OUT" --config=1b --steps=8 \
    --variants=fp32:none,fp32:stream > "$OUT/e2e_stream.log" 2>&1
grep -vE "^\[.*\] [IW]1[0-9]{3}" "$OUT/e2e_stream.log" | tail -8
stamp "1b streamed done"
stamp "all done"
