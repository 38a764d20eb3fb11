#!/usr/bin/env bash
# One device call on nvidia-h200-x2: build jaxtier there, run the multi-path GPU test, then the
# multi-GPU benchmark (multi-path fetch, data-parallel offload on 2 GPUs vs 1).
# Usage (device tool, kind nvidia-h200-x2): bash benchmarks/run_h200_x2.sh [bench flags]
source "$(dirname "$0")/h200_build.sh"  # options, OUT, ROOT, stamp; builds jaxtier
export NCCL_NVLS_ENABLE=0
nvidia-smi topo -m 2>&1 | tee "$OUT/topo.txt" | head -20
cd /tmp  # import the installed package, not the checkout
python3 -m pytest -q -p no:cacheprovider "$OLDPWD/tests/multipath_test.py" 2>&1 | tee "$OUT/multipath_gpu_tests.log" | tail -15
cd "$OLDPWD"
python3 benchmarks/multigpu_bench.py --out="$OUT" "$@" 2>&1 | tee "$OUT/multigpu.log" | tail -40
