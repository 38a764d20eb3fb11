"""The largest device allocations of the biggest program XLA dumped, for reading a peak.

Run a workload with `XLA_FLAGS=--xla_dump_to=DIR`, then:

  python3 benchmarks/diagnostics/peak_buffers.py DIR [--top=30] > peak.txt

Picks the buffer assignment (`*buffer-assignment.txt`) whose allocations sum largest (the
step's compute program), prints its allocations by size (bytes, the allocation's header and its
first values), then the head of the matching memory-usage report, if XLA wrote one.
"""

import glob
import os
import re
import sys

from absl import app, flags

_TOP = flags.DEFINE_integer("top", 30, "Allocations to print.")


def allocations(text: str) -> list[tuple[int, str, list[str]]]:
  """(size, header, value lines) of each `allocation N: size S, ...` block."""
  out = []
  for block in re.split(r"\n(?=allocation \d+:)", text):
    m = re.match(r"allocation \d+: size (\d+)", block)
    if m:
      lines = block.splitlines()
      out.append((int(m.group(1)), lines[0][:200], [l.strip()[:160] for l in lines[1:4]]))
  return out


def main(argv):
  if len(argv) != 2:
    raise app.UsageError("usage: peak_buffers.py DUMP_DIR")
  files = glob.glob(os.path.join(argv[1], "*buffer-assignment.txt"))
  if not files:
    print(f"no buffer assignment under {argv[1]}")
    return
  best = max(files, key=lambda f: sum(a[0] for a in allocations(open(f).read())))
  allocs = sorted(allocations(open(best).read()), key=lambda a: -a[0])
  print(f"{os.path.basename(best)}: {len(allocs)} allocations, "
        f"{sum(a[0] for a in allocs) / 2**30:.3f} GiB in all")
  for size, head, values in allocs[:_TOP.value]:
    print(f"{size / 2**20:12.1f} MiB  {head}")
    for v in values:
      print(f"{'':18}{v}")
  stem = best.replace("buffer-assignment.txt", "")
  for report in glob.glob(stem + "*memory-usage-report.txt"):
    print(f"\n{os.path.basename(report)}:")
    print("\n".join(open(report).read().splitlines()[:120]))


if __name__ == "__main__":
  app.run(main)
