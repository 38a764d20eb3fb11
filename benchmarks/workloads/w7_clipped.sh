# w7 (benchmarks/w7_clipped.py): gradient clipping with the optimizer state on the host. Per
# group (1b at batch 8 x 1024, 1b at 32 x 1024, 8b at 16 x 2048), in this order: unclipped; a
# probe clipped at a norm no step reaches (each step's gradient norm); clipped at a norm chosen
# from the probe's to bind on under 10% of the timed steps (1 in 20) and at half its min (on
# every step); DeepSpeed ZeRO-Offload with --clip 1.0 where .baselines/deepspeed is carried
# (1b at batch 8); the rare clip again where it bound on none; the every-step clip with
# --nooverlap_update (serial); device-only where the state fits. Each run is `python -m
# jaxtier train` in its own process; one that cannot start in what is left of the call is
# skipped with the reason, and the JSON is written after every run:
# $OUT/w7/w7_clipped_<card>.json (w7_clipped_<groups>[_part]_<card>.json for another
# selection), every run's log in $OUT/w7/w7_logs_<card>.tar.gz.
# A call holds about one group (a 1b run takes about 45 s, an 8b one about 80 s + 4.9 s a step
# on the H200, the build aside): W7_ONLY=GROUP[:VARIANT+...],... picks them (1b_b8, or
# 8b_b16:unclipped+probe+clip_rare then 8b_b16:unclipped+clip_always+serial);
# W7_NORMS=GROUP=RARE:ALWAYS gives the max norms without a probe (an earlier call's "norms");
# W7_FLAGS adds flags. BENCH_COMMIT, where set, is the commit recorded.
# Usage: W7_ONLY=1b_b8 bash benchmarks/run_gpu.sh w7   (carry .baselines for DeepSpeed)
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
_w7_left=$(( CALL_SECS - ($(date +%s) - t0) ))
# The script's own budget ends 20 s before the step's timeout, so that it writes its JSON.
STEP_TAIL=40 step w7_clipped 570 python3 benchmarks/w7_clipped.py --out="$OUT" \
    --groups="${W7_ONLY:-1b_b8,1b_b32,8b_b16}" --budget_secs=$(( _w7_left - 20 )) \
    ${W7_NORMS:+--norms="$W7_NORMS"} ${W7_FLAGS:-}
