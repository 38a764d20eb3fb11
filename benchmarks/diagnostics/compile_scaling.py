"""How long XLA takes to compile the streamed decoder's compute program, by layer count and flags.

Each variant runs in its own process: the example decoder's 1b widths with `--num_layers` layers,
`offload="stream"`, two steps, `JAX_LOG_COMPILES=1`; the script reads the compile times of the
device-only step (the planner's cost compile) and of jaxtier's compute program from the log. A
variant still compiling after `--gdb_after` seconds gets its native stacks sampled with gdb (if
present), to name the XLA pass that takes the time.

  python3 benchmarks/diagnostics/compile_scaling.py --layers=2,4 --flags=,--xla_gpu_autotune_level=0
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import threading
import time

from absl import app
from absl import flags

_LAYERS = flags.DEFINE_list("layers", ["2", "4"], "Layer counts.")
_FLAGS = flags.DEFINE_list("flags", [""], "XLA_FLAGS variants ('' = default); ';' separates "
                           "several flags of one variant; a token ENV:NAME=VALUE sets an environment variable instead.")
_TIMEOUT = flags.DEFINE_integer("timeout", 90, "Seconds per variant.")
_GDB_AFTER = flags.DEFINE_integer("gdb_after", 40, "Sample native stacks after this many s.")
_DUMP = flags.DEFINE_bool("dump", False, "Dump the HLO after every XLA pass (--xla_dump_to) and, "
                          "at --gdb_after, print the newest dump files: the pass after the last "
                          "one dumped is the one running.")
_CHILD = flags.DEFINE_integer("child_layers", 0, "Internal.")

_FINISHED = re.compile(r"Finished XLA compilation of jit\((\w+)\) in ([0-9.]+) sec")


def child(layers):
  import dataclasses  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import llama, train  # pylint: disable=g-import-not-at-top
  config = dataclasses.replace(llama.CONFIGS["1b"], num_layers=layers)
  r = train.run(config_name="1b", config=config, steps=2, batch_size=8, seq_len=1024,
                offload="stream", progress=False, log_every=1)
  print("STEP_SECS", r["step_times"][-1], flush=True)


def main(argv):
  del argv
  if _CHILD.value:
    child(_CHILD.value)
    return
  gdb = shutil.which("gdb")
  print("gdb:", gdb, flush=True)
  rows = []
  for xla_flags in _FLAGS.value:
    for layers in map(int, _LAYERS.value):
      tokens = [t for t in xla_flags.split(";") if t]
      env = dict(os.environ, JAX_LOG_COMPILES="1",
                 XLA_FLAGS=" ".join(t for t in tokens if not t.startswith("ENV:")))
      env.update(t[4:].split("=", 1) for t in tokens if t.startswith("ENV:"))
      dump_dir = f"/tmp/xla_dump_{layers}_{len(rows)}"
      if _DUMP.value:
        env["XLA_FLAGS"] += f" --xla_dump_to={dump_dir} --xla_dump_hlo_pass_re=.*"
      t0 = time.time()
      p = subprocess.Popen([sys.executable, __file__, f"--child_layers={layers}"], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      sampled = False
      lines = []
      reader = threading.Thread(target=lambda: lines.extend(l.rstrip("\n") for l in p.stdout))
      reader.start()
      while p.poll() is None and time.time() - t0 < _TIMEOUT.value:
        if _DUMP.value and not sampled and time.time() - t0 > _GDB_AFTER.value:
          names = sorted((os.path.getmtime(os.path.join(dump_dir, f)), f)
                         for f in os.listdir(dump_dir) if "compute" in f)
          print(f"--- {len(names)} dump files of jit(compute); newest (age s, name):")
          passes = [x for x in names if ".after_" in x[1] or "before_" in x[1]]
          for mtime, f in names[-3:] + passes[-4:]:
            print(f"    {time.time() - mtime:6.1f}  {f}")
        if gdb and not sampled and time.time() - t0 > _GDB_AFTER.value:
          bt = subprocess.run([gdb, "-p", str(p.pid), "-batch", "-ex", "thread apply all bt 40"],
                              capture_output=True, text=True, timeout=60).stdout
          frames = [l for l in bt.splitlines() if "xla::" in l or "mlir::" in l or "llvm::" in l]
          sampled = True
          print(f"--- native frames, layers={layers} flags={xla_flags!r} at "
                f"{time.time() - t0:.0f} s ---")
          for f in frames[:60]:
            print("   ", re.sub(r"\(.*", "", f.split(" in ", 1)[-1])[:160])
        if time.time() - t0 > _GDB_AFTER.value:
          sampled = True
        time.sleep(0.5)
      timed_out = p.poll() is None
      if timed_out:
        p.kill()
      reader.join()
      compiles = {}
      for l in lines:
        m = _FINISHED.search(l)
        if m and m.group(1) in ("compute", "jaxpr_as_fun", "update"):
          compiles.setdefault(m.group(1), float(m.group(2)))
      step = [l.split()[1] for l in lines if l.startswith("STEP_SECS")]
      rows.append((layers, xla_flags or "(default)", compiles.get("jaxpr_as_fun"),
                   compiles.get("compute"), step[0] if step else None, timed_out))
      print(rows[-1], flush=True)
      if timed_out or p.returncode:
        print("\n".join(l for l in lines[-15:] if "Compiling" not in l))
        # With TF_CPP_VMODULE=hlo_pass_pipeline=1, XLA logs each pass before running it: the
        # last ones logged name the pass still running.
        passes = [l for l in lines if "hlo_pass_pipeline" in l]
        if passes:
          print(f"--- last passes started ({len(passes)} logged):")
          print("\n".join("    " + l[-160:] for l in passes[-6:]))
  print(f"\n{'layers':>6} {'flags':<40} {'device-only s':>13} {'compute s':>10} {'step s':>8}")
  for layers, fl, dev, comp, step, to in rows:
    print(f"{layers:>6} {fl:<40} {dev or float('nan'):>13.1f} "
          f"{comp if comp is not None else float('nan'):>10.1f} {step or '-':>8} "
          f"{'TIMEOUT' if to else ''}")


if __name__ == "__main__":
  app.run(main)
