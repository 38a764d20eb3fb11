"""Helpers the benchmark scripts share (imported as a sibling: `python3 benchmarks/<x>.py`)."""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import numpy as np


def log(msg: str) -> None:
  """Prints `msg` with the wall-clock time, flushed (the device tool streams stdout)."""
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(result: dict, out_dir: str, filename: str) -> str:
  """Writes `result` as `out_dir/filename` (numpy scalars as floats); returns the path."""
  os.makedirs(out_dir, exist_ok=True)
  path = os.path.join(out_dir, filename)
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=float)
  log(f"wrote {path}")
  return path


def median_secs(fn: Callable[[], Any], reps: int) -> tuple[float, list[float]]:
  """(median seconds, every time) of `reps` runs of `fn()` after one warm-up run.

  Each run is timed until its result is ready (`jax.block_until_ready`), so asynchronous
  dispatch does not hide device time; a `fn` that blocks itself is timed the same.
  """
  import jax  # pylint: disable=g-import-not-at-top  (the callers import jax first)
  jax.block_until_ready(fn())
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return float(np.median(times)), times


class Section:
  """Names one part of a benchmark run and times it; on an error, records the error in
  `result["error"]`, calls `on_error()` (to write what was measured so far) and exits with 1
  (fail fast: later parts would measure a broken state)."""

  def __init__(self, name: str, *, result: dict, on_error: Callable[[], Any]):
    self.name, self.result, self.on_error = name, result, on_error

  def __enter__(self):
    log(f"== {self.name}")
    self.t0 = time.perf_counter()
    return self

  def __exit__(self, exc_type, exc, tb):
    import sys  # pylint: disable=g-import-not-at-top
    import traceback  # pylint: disable=g-import-not-at-top
    if exc is None:
      log(f"   {self.name}: {time.perf_counter() - self.t0:.1f} s")
      return False
    self.result["error"] = {
        "section": self.name, "type": exc_type.__name__, "message": str(exc)[:4000],
        "traceback": "".join(traceback.format_exception(exc_type, exc, tb))[-8000:]}
    print(f"\nFAILED in section '{self.name}': {exc_type.__name__}: {str(exc)[:2000]}",
          file=sys.stderr, flush=True)
    traceback.print_exception(exc_type, exc, tb)
    self.on_error()
    sys.exit(1)


def versions(*modules: Any) -> dict:
  """Python, jax, jaxlib and numpy versions, each module's `__version__`, and jaxtier's git
  revision (`jaxtier_git`, when the benchmark runs from a git checkout)."""
  import platform  # pylint: disable=g-import-not-at-top
  import subprocess  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  v = {"python": platform.python_version(), "jax": jax.__version__, "numpy": np.__version__}
  try:
    import jaxlib  # pylint: disable=g-import-not-at-top
    v["jaxlib"] = jaxlib.__version__
  except ImportError:
    pass
  for m in modules:
    v[m.__name__] = getattr(m, "__version__", None)
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
    if rev.returncode == 0:
      v["jaxtier_git"] = rev.stdout.strip()
  except (OSError, subprocess.SubprocessError):
    pass
  return v
