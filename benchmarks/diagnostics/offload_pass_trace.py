"""Which instructions XLA's host-offload passes walk in the streamed decoder's compute program.

Runs `compile_scaling.py`'s child (the example decoder at the 1b widths, `--layers` layers,
offload="stream") for `--seconds` with XLA's verbose log on for `host_offloader`,
`host_offload_legalize` and `host_offload_utils`, keeps the first `--max_mb` of it, and prints
how often each instruction was visited, the walks' starting points and the log's first lines of
each kind: the instructions visited thousands of times name the paths that multiply.

  python3 benchmarks/diagnostics/offload_pass_trace.py --layers=4 --seconds=40
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import time

from absl import app
from absl import flags

_LAYERS = flags.DEFINE_integer("layers", 4, "Decoder layers.")
_SECONDS = flags.DEFINE_integer("seconds", 40, "How long to let the compile run.")
_MAX_MB = flags.DEFINE_integer("max_mb", 300, "Log bytes kept (MB).")
_OUT = flags.DEFINE_string("out", "/tmp", "Where the log goes.")
_VMODULE = flags.DEFINE_string(
    "vmodule", "host_offloader=4,host_offload_legalize=5,host_offload_utils=5",
    "TF_CPP_VMODULE for the child.")


def main(argv):
  del argv
  here = os.path.dirname(os.path.abspath(__file__))
  log_path = os.path.join(_OUT.value, "offload_pass_trace.log")
  env = dict(os.environ, JAX_LOG_COMPILES="1", TF_CPP_MIN_LOG_LEVEL="0",
             TF_CPP_VMODULE=_VMODULE.value)
  limit = _MAX_MB.value << 20
  t0 = time.time()
  with open(log_path, "wb") as log:
    p = subprocess.Popen([sys.executable, os.path.join(here, "compile_scaling.py"),
                          f"--child_layers={_LAYERS.value}"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    os.set_blocking(p.stdout.fileno(), False)
    kept = 0
    while p.poll() is None and time.time() - t0 < _SECONDS.value:
      chunk = p.stdout.read(1 << 20)
      if chunk:
        if kept < limit:
          log.write(chunk[: limit - kept])
          kept += len(chunk)
      else:
        time.sleep(0.05)
    if p.poll() is None:
      p.kill()
  print(f"child ran {time.time() - t0:.0f} s, rc={p.poll()}, log kept {kept >> 20} MB "
        f"({log_path})")
  visits = collections.Counter()
  kinds = collections.Counter()
  firsts = {}
  with open(log_path, errors="replace") as f:
    for line in f:
      m = re.search(r"\] (.*)", line)
      msg = m.group(1) if m else line
      kind = re.sub(r"[\"(%{].*", "", msg)[:60]
      kinds[kind] += 1
      firsts.setdefault(kind, msg[:300])
      v = re.search(r"Visiting instruction: \{Instr: ([\w.\-]+), ShapeIndex: (\{[^}]*\})", msg)
      if v:
        visits[v.groups()] += 1
      v = re.search(r"Current value before down: %?([\w.\-]+) ", msg)
      if v:
        visits[(v.group(1), "legalize")] += 1
  print("log lines by kind (count, first):")
  for kind, n in kinds.most_common(25):
    print(f"  {n:>10}  {firsts[kind][:220]}")
  print("most visited (instruction, shape index):")
  for key, n in visits.most_common(40):
    print(f"  {n:>10}  {key}")
  for l in open(log_path, errors="replace"):
    if "Finished XLA compilation" in l:
      print(l.rstrip()[-120:])


if __name__ == "__main__":
  app.run(main)
