# sanitizer (benchmarks/sanitizer.sh): compute-sanitizer memcheck and racecheck over each CUDA
# handler family (dha, stream, host_update), synccheck of dha, initcheck of each, memcheck of a
# tiny `jaxtier.offload` step (informational), each on its program in
# benchmarks/sanitizer_programs.py (checked against numpy), with planted-bug controls; only
# jaxtier's kernels are instrumented. Result: $OUT/sanitizer.txt (kept as
# benchmarks/results/sanitizer/<card>.txt), the runs' logs in $OUT/sanitizer_logs.tar.gz; SANITIZER_*
# (the script's header) change the runs. Usage: bash benchmarks/run_gpu.sh sanitizer
source "$(dirname "${BASH_SOURCE[0]}")/../prologue.sh"
STEP_TAIL=30 step sanitizer 450 bash benchmarks/sanitizer.sh
