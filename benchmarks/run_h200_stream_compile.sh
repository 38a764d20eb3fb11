#!/usr/bin/env bash
# One device call (issue 4): which XLA pass makes the streamed decoder's compute program compile
# superlinearly on the GPU (4 layers: > 60 s; 2 layers: 6 s), and the 1b decoder streamed vs
# device-resident once it compiles. Usage (device tool, repo root):
#   bash benchmarks/run_h200_stream_compile.sh
source "$(dirname "$0")/h200_build.sh"  # options, OUT, ROOT, stamp; builds jaxtier
python3 benchmarks/compile_scaling.py --layers=4 --timeout=45 --gdb_after=1000 \
  --flags=--xla_disable_hlo_passes=host-offload-legalize,--xla_disable_hlo_passes=host-offloader \
  2>&1 | tail -4 | tee "$OUT/compile_passes.log"
stamp "pass probe done"
flag=""
grep -q "host-offload-legalize .*[0-9] *$" "$OUT/compile_passes.log" && flag=host-offload-legalize
[ -z "$flag" ] && grep -q "host-offloader .*[0-9] *$" "$OUT/compile_passes.log" && flag=host-offloader
echo "pass to disable: ${flag:-none found}"
if [ -n "$flag" ]; then
  XLA_FLAGS="--xla_disable_hlo_passes=$flag" timeout $(( 560 - ($(date +%s) - t0) )) \
    python3 benchmarks/e2e_smoke.py --out="$OUT" --config=1b --steps=6 \
    --variants=fp32:none,fp32:stream > "$OUT/e2e_stream.log" 2>&1
  grep -vE "^\[.*\] [IW]1129" "$OUT/e2e_stream.log" | tail -9
fi
stamp "all done"
