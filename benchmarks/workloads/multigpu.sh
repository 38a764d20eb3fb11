# multigpu (benchmarks/multigpu_bench.py; kind nvidia-h200-x2, or more GPUs): the GPUs'
# topology, the multi-path GPU tests, then the multi-path fetch of a replicated host leaf and
# offloaded data-parallel training on all GPUs against one. NVLink multicast stays off
# (KINDS.md). Results: $OUT/multigpu/<n>gpu_<card>.json (the script's own form, not the results schema),
# topo.log and the logs; MULTIGPU_FLAGS adds flags. Usage: bash benchmarks/run_gpu.sh multigpu
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
STEP_TAIL=20 step topo 30 nvidia-smi topo -m
_multipath_test=$(find "$ROOT/tests" -name multipath_test.py | head -1)
if [[ -n $_multipath_test ]]; then
  STEP_DIR=/tmp STEP_SHOW='^(FAILED|ERROR)|passed|failed|error' \
    step multipath_tests 200 python3 -m pytest -q -p no:cacheprovider -rfE "$_multipath_test"
else
  stamp "no multipath_test.py under tests/: multipath_tests not run"
fi
# shellcheck disable=SC2086  # MULTIGPU_FLAGS: several flags
STEP_TAIL=40 step multigpu 300 python3 benchmarks/multigpu_bench.py --out="$OUT" \
    ${MULTIGPU_FLAGS:-}
