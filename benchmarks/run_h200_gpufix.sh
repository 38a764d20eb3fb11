#!/usr/bin/env bash
# One device call to check the fixes for the GPU failures of notes/gpu1/gpu_tests.log: build
# jaxtier on the H200, run exactly the tests that failed there (apart from streaming_test.py's
# KeyError 'num_consts', fixed elsewhere) plus the new tests of the same fixes, then the DHA
# crossover benchmark. Each part has its own time limit.
# Usage (device tool, repo root): bash benchmarks/run_h200_gpufix.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 JAXTIER_REQUIRE_GPU=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
ROOT=$PWD
t0=$(date +%s)
stamp() { echo "== [$(( $(date +%s) - t0 )) s] $*"; }
python3 -m pip install --no-build-isolation --no-deps -q . 2>&1 | tail -5
stamp "built"
T=$ROOT/tests
FAILED=(
  "$T/stream_test.py::test_gpu_forward_and_sent_grads_equal_device"
  "$T/dha_test.py::test_gather_grad_matches_jnp"
  "$T/dha_test.py::test_gpu_matmul"
  "$T/dha_test.py::test_gpu_matmul_large_layer_unstacked"
  "$T/dha_test.py::test_gpu_matmul_grads_match_jnp"
  "$T/multipath_test.py::test_two_axis_mesh_splits_over_the_named_axis_only"
)
NEW=(
  "$T/dha_test.py::test_gpu_matmul_any_split_count"
  "$T/dha_test.py::test_partial_sums_shape_follows_the_kernel_tiles"
  "$T/dha_test.py::test_cpu_handler_ignores_gpu_sized_partial_sums"
  "$T/dha_test.py::test_handler_checks_shapes"
  "$T/dha_test.py::test_hlo_guard_gpu"
  "$T/dha_test.py::test_gpu_gather_grad"
  "$T/multipath_test.py::test_all_gather_groups_reads_every_replica_groups_form"
  "$T/offload_test.py::test_step_failing_at_run_time_leaves_host_leaves_intact"
)
cd /tmp  # import the installed package, not the checkout
timeout 150 python3 -m pytest -q -p no:cacheprovider -rfEs "${FAILED[@]}" "${NEW[@]}" 2>&1 \
    | tee "$OUT/gpufix_tests.log" | tail -25
echo "pytest rc=${PIPESTATUS[0]}"
# The offload test's callback error must no longer surface at interpreter exit.
if grep -q "Exception ignored in atexit" "$OUT/gpufix_tests.log"; then
  echo "atexit: the failed step's error still surfaced at exit"
fi
cd "$ROOT"
stamp "tests done"
timeout 70 python3 benchmarks/dha_crossover.py --out="$OUT/dha_crossover.json" 2>&1 \
    | tee "$OUT/dha_crossover.log" | tail -14
stamp "all done"
