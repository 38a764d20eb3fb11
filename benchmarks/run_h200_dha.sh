#!/usr/bin/env bash
# One device call: build jaxtier on the GPU machine, run the DHA tests (CPU and GPU: values,
# gradients, HLO guard), then the DHA crossover benchmark.
# Usage (device tool): bash benchmarks/run_h200_dha.sh
source "$(dirname "$0")/h200_build.sh"  # options, OUT, ROOT, stamp; builds jaxtier
cd /tmp  # import the installed package, not the checkout
python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/dha_test.py" 2>&1 | tee "$OUT/dha_gpu_tests.log" | tail -25
cd "$OLDPWD"
python3 benchmarks/dha_crossover.py --out="$OUT/dha_crossover.json" "$@" 2>&1 | tee "$OUT/dha_crossover.log" | tail -30
