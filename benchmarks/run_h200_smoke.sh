#!/usr/bin/env bash
# One device call: build jaxtier on the GPU machine, run the GPU tests (HLO guard, numerics),
# then the end-to-end smoke benchmark. Usage (device tool): bash benchmarks/run_h200_smoke.sh
source "$(dirname "$0")/h200_build.sh"  # options, OUT, ROOT, stamp; builds jaxtier
cd /tmp  # import the installed package, not the checkout
python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/host_update_test.py" "$OLDPWD/tests/offload_test.py" 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
cd "$OLDPWD"
python3 benchmarks/e2e_smoke.py --out="$OUT" "$@" 2>&1 | tee "$OUT/e2e_smoke.log" | tail -30
