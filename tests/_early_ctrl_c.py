"""Ctrl-C at a chosen point while a command starts, for the tests of the entry points.

The command runs under `python -X importtime`, which writes a line on stderr as each import
ends: the test sends SIGINT after the line of a given module (the point in the imports), some
further import lines, and some seconds, wherever the process is by then.
"""

import os
import signal
import subprocess
import sys
import threading
import time

_IMPORT_LINE = "import time:"


def _imported(line: str) -> str:
  """The module of an import line of `-X importtime` (its last column), else ''."""
  return line.rsplit("|", 1)[-1].strip() if line.startswith(_IMPORT_LINE) else ""


def ctrl_c_while_starting(args, *, after: str, lines: int = 0, delay: float = 0.0, cwd,
                          env=None, timeout: float = 120) -> subprocess.CompletedProcess:
  """Runs `python -X importtime *args` in `cwd` (on the CPU, its profile cache in `cwd`) and
  sends it SIGINT `delay` seconds after the import of `after` ends, or the `lines`-th import
  after it; returns the ended process with stderr less the import lines (and, where `after`
  was never imported, a line that says so, which no test expects)."""
  env = dict(os.environ, XDG_CACHE_HOME=os.path.join(cwd, "cache"), JAX_PLATFORMS="cpu",
             PYTHONUNBUFFERED="1", **(env or {}))
  proc = subprocess.Popen([sys.executable, "-X", "importtime", *map(str, args)],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                          env=env)
  err, left = [], None
  for line in proc.stderr:
    err.append(line)
    if left is None and _imported(line) == after:
      left = lines
    if left is not None and _imported(line):
      if left == 0:
        break
      left -= 1
  else:
    err.append(f"(the test: no import of {after} seen)\n")
  # The rest of stderr (the imports go on) and stdout are read while the test waits: a full
  # pipe would stop the process where it writes, not where it imports.
  out = []
  readers = [threading.Thread(target=lambda: err.extend(proc.stderr)),
             threading.Thread(target=lambda: out.extend(proc.stdout))]
  for reader in readers:
    reader.start()
  time.sleep(delay)
  if proc.poll() is None:
    proc.send_signal(signal.SIGINT)
  try:
    proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    proc.kill()
    proc.wait()
  for reader in readers:
    reader.join()
  said = "".join(l for l in err if not l.startswith(_IMPORT_LINE))
  return subprocess.CompletedProcess(proc.args, proc.returncode, "".join(out), said)
