"""Helpers the benchmark scripts share (imported as a sibling: `python3 benchmarks/<x>.py`)."""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np


def log(msg: str) -> None:
  """Prints `msg` with the wall-clock time, flushed (the device tool streams stdout)."""
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


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
