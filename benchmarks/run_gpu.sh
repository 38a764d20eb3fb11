#!/usr/bin/env bash
# The entry point of the GPU runs, on any card: builds jaxtier on the machine once
# (benchmarks/prologue.sh), then runs the named workloads in the order given, each step under a
# timeout cut to what is left of the run's 570 s (CALL_SECS), so that a run ends within 10
# minutes. A workload is the file benchmarks/workloads/NAME.sh, named by NAME or by NAME's part
# before its first "_" (w1_streaming.sh: w1). Results are named by the card nvidia-smi reports
# (BENCH_CARD: h100, h200, ...), which each result records.
#
# Usage, from the repo root:
#   bash benchmarks/run_gpu.sh [--tests="PYTEST ARGS"] WORKLOAD...
#     --tests  what the `tests` workload runs (paths from the repo root, -k ...; default: tests)
# e.g. bash benchmarks/run_gpu.sh w1 w5
# Results: $OUT/<workload>/<configuration>_<card>.json, e.g. $OUT/w1/streaming_h200.json (copy
# them to the same path under benchmarks/results/), and one log per step.
set -uo pipefail
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
declare -A _file_of=()
_names=()
for _f in "$_here"/workloads/*.sh; do
  _stem=$(basename "$_f" .sh)
  _file_of[$_stem]=$_f
  _file_of[${_stem%%_*}]=$_f
  if [[ $_stem == *_* ]]; then _names+=("${_stem%%_*} (${_stem#*_})"); else _names+=("$_stem"); fi
done
_list=$(IFS=,; echo "${_names[*]}" | sed 's/,/, /g')

_usage() {
  echo "usage: bash benchmarks/run_gpu.sh [--tests=\"PYTEST ARGS\"] WORKLOAD..." >&2
  echo "workloads: $_list" >&2
  exit 2
}
_todo=()
for _arg in "$@"; do
  case $_arg in
    --tests=*) export TESTS=${_arg#--tests=} ;;
    -h|--help) _usage ;;
    -*) echo "run_gpu.sh: unknown flag '$_arg'" >&2; _usage ;;
    *)
      if [[ -z "${_file_of[$_arg]:-}" ]]; then
        echo "run_gpu.sh: no workload '$_arg'; the workloads are: $_list" >&2
        exit 2
      fi
      _todo+=("$_arg") ;;
  esac
done
(( ${#_todo[@]} )) || _usage

export BENCH_LAUNCHED_BY="bash benchmarks/run_gpu.sh $*"
source "$_here/prologue.sh"
for _w in "${_todo[@]}"; do
  stamp "workload $_w"
  source "${_file_of[$_w]}"
done
