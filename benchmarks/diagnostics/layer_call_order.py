"""The order XLA scheduled a compute program's layer calls in, among its matmuls and streams.

Reads the compiled HLO text of a step's compute program (`OffloadedStep.lower(...).compile()
.as_text()`, as `planner_bench.py --hlo_dir` writes it) and prints its entry computation as one
line of letters, in schedule order: m a cuBLAS matmul, L a layer call of the fused host update,
J a join, F a stream fetch, S a stream send, w a stream wait, and (n) a run of n fusions. Each
backward iteration of an unrolled layer loop shows as a run of matmuls: where its L calls
stand says how many iterations after its gradient a layer's update begins.

  python3 benchmarks/diagnostics/layer_call_order.py CASE.hlo.txt [...]
"""

import re
import sys

LETTERS = {"__cublas$lt$matmul": "m", "__cublas$gemm": "m", "jaxtier_host_update_layer_ffi": "L",
           "jaxtier_host_update_join_ffi": "J", "jaxtier_stream_fetch_ffi": "F",
           "jaxtier_stream_send_ffi": "S", "jaxtier_stream_wait_ffi": "w"}


def order(hlo_text: str) -> str:
  """The entry computation of `hlo_text` as the letters above, fusions counted in runs."""
  entry = hlo_text[hlo_text.index("\nENTRY"):]
  seq = []
  for line in entry.splitlines():
    target = re.search(r'custom_call_target="([^"]*)"', line)
    if target:
      seq.append(LETTERS.get(target.group(1), "?"))
    elif " fusion(" in line:
      seq.append(".")
  return re.sub(r"\.{2,}", lambda m: f"({len(m.group())})", "".join(seq))


def main(paths):
  for path in paths:
    with open(path) as f:
      text = order(f.read())
    print(f"{path}: {text.count('L')} layer calls, {text.count('m')} matmuls")
    print(text)


if __name__ == "__main__":
  main(sys.argv[1:])
