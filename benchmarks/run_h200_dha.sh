#!/usr/bin/env bash
# One device call: build jaxtier on the GPU machine, run the DHA tests (CPU and GPU: values,
# gradients, HLO guard), then the DHA crossover benchmark.
# Usage (device tool): bash benchmarks/run_h200_dha.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 JAXTIER_REQUIRE_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
t0=$(date +%s)
python3 -m pip install --no-build-isolation --no-deps -q . 2>&1 | tail -5
echo "build: $(( $(date +%s) - t0 )) s"
cd /tmp  # import the installed package, not the checkout
python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/dha_test.py" 2>&1 | tee "$OUT/dha_gpu_tests.log" | tail -25
cd "$OLDPWD"
python3 benchmarks/dha_crossover.py --out="$OUT/dha_crossover.json" "$@" 2>&1 | tee "$OUT/dha_crossover.log" | tail -30
