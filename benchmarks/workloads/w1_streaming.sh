# w1 streaming (benchmarks/streaming_bench.py): host_stream on 24 stacked 8192^2 bf16 matmul
# layers (3.2 GB in pinned_host), forward and forward+backward with the gradients sent to
# pinned_host, against the device-only step, the link (max(compute, transfer) bounds the
# forward) and XLA's own memory-kind transfers. Result: $OUT/w1/streaming_<card>.json; W1_FLAGS adds
# flags. Usage: bash benchmarks/run_gpu.sh w1
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
# shellcheck disable=SC2086  # W1_FLAGS: several flags
step w1_streaming 150 python3 benchmarks/streaming_bench.py --reps=3 --out="$OUT" ${W1_FLAGS:-}
