# w4 capacity (benchmarks/capacity_bench.py): the largest example config that trains 10 steps
# with fp32 AdamW on one GPU and its host, run as a user runs it (XLA's defaults: the CLI
# raises the pinned pool and the allocator's fraction itself where its plan needs them),
# against (HBM + available host memory) / 16 B. First, where .baselines/deepspeed is carried
# (its README), DeepSpeed ZeRO-Offload and ZeRO-3 CPU offload at the same shapes, with the
# capacity configs added to its copy of the shapes. Result: $OUT/w4/capacity_<card>.json.
# W4_RUNS: config:offload[:batch],... (default auto: the configs of 0.8 to 1 of this card's bound,
# capacity_bench.capacity_runs); W4_DS_CONFIG (default 14b); W4_DS=0
# leaves DeepSpeed out.
# Usage: bash benchmarks/run_gpu.sh w4
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
if [[ -f .baselines/deepspeed/zero_offload_bench.py && "${W4_DS:-1}" != 0 ]]; then
  # The capacity configs' shapes (jaxtier/examples/llama.py), added to the peer's table.
  python3 - <<'PY'
import re
p = ".baselines/deepspeed/zero_offload_bench.py"
s = open(p).read()
if '"14b"' not in s:
  add = "".join(f'    "{n}": dict(d_model=5120, num_layers={l}, num_heads=40, d_ff=13824, '
                f'max_seq_len=2048, remat="full"),\n' for n, l in (("14b", 45), ("15b", 48)))
  s = s.replace('    "13b": dict(', add + '    "13b": dict(', 1)
  open(p, "w").write(s)
PY
  mkdir -p "$OUT/deepspeed"
  STEP_TAIL=6 OUT=$OUT/deepspeed MODES="zero2_offload zero3_offload" BUDGET=150 \
      step w4_deepspeed 170 bash .baselines/deepspeed/run.sh "${W4_DS_CONFIG:-14b}" 4 2048 4 2
fi
STEP_TAIL=12 step w4_capacity 480 python3 benchmarks/capacity_bench.py \
    --runs="${W4_RUNS:-auto}" --steps=10 --timeout=400 --out="$OUT" \
    --workload=w4_capacity --baseline_dir="$OUT/deepspeed"
