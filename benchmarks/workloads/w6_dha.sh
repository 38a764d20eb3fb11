# w6 (benchmarks/w6_dha.py): the example decoder with a 32K and a 128K vocabulary, its embedding
# table on the device, its moments on the host, streamed whole (host_xla) and read in place
# (host_dha: the DHA gather and the host scatter-add of its gradient rows); one process per
# variant. 1b at batch 8 x 1024 with the rest on the device, then 8b at 4 x 2048 with a 128K
# vocabulary and the rest's optimizer state on the host (W6_8B=0 skips it). Result:
# $OUT/w6/1b_32k_128k_<card>.json and $OUT/w6/8b_128k_<card>.json. Usage: bash benchmarks/run_gpu.sh w6
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
STEP_TAIL=12 step w6_dha 330 python3 benchmarks/w6_dha.py --out="$OUT" --configs=1b \
    --vocabs=32768,131072 --steps=8 --batch_size=8 --seq_len=1024 --timeout=120
if [[ ${W6_8B:-1} != 0 ]]; then
  XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB=110 STEP_TAIL=12 step w6_dha_8b 260 python3 \
      benchmarks/w6_dha.py --out="$OUT" --configs=8b --vocabs=131072 --rest=host \
      --variants=state_host,host_dha --steps=6 --batch_size=4 --seq_len=2048 --timeout=200
fi
