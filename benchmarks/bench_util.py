"""Helpers the benchmark scripts share.

The workload scripts in `benchmarks/` import it as a sibling (`python3 benchmarks/<x>.py`); the
scripts in `benchmarks/diagnostics/` put `benchmarks/` on `sys.path` first.
"""

from __future__ import annotations

import datetime
import json
import os
import time
from typing import Any, Callable

import numpy as np


def log(msg: str) -> None:
  """Prints `msg` with the wall-clock time, flushed (the device tool streams stdout)."""
  print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def write_json(result: dict, out_dir: str, filename: str) -> str:
  """Writes `result` as `out_dir/filename` (numpy scalars as floats; `filename` may name a
  folder under `out_dir`, e.g. `w1/streaming_h200.json`); returns the path."""
  path = os.path.join(out_dir, filename)
  os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=float)
  log(f"wrote {path}")
  return path


def host_rss_peak_bytes() -> "int | None":
  """This process's peak resident set, bytes: VmHWM from /proc/self/status (Linux), else
  `resource.getrusage(RUSAGE_SELF).ru_maxrss` (KiB on Linux, bytes on macOS); None where
  neither can be read. It is what the kernel counts as resident: pages the CUDA driver maps for
  pinned buffers may not be counted (driver-dependent), so read it beside the pinned bytes."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          value, unit = line.split()[1:3]
          return int(value) * {"kB": 1024, "mB": 2**20, "gB": 2**30}.get(unit, 1)
  except (OSError, ValueError, IndexError):
    pass
  try:
    import resource  # pylint: disable=g-import-not-at-top
    import sys  # pylint: disable=g-import-not-at-top
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024
  except (ImportError, OSError, ValueError):
    return None


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


# ---- the result record: one schema for every workload --------------------------------------------
#
# A result file, `benchmarks/results/<workload>/<configuration>_<card>.json` (`result_name`:
# w1/streaming_h200.json, w3/1b_b8_h200.json, ...), holds one record:
#   workload  what was run, in a sentence
#   command   the script's command line
#   date      when it ran (UTC, ISO 8601)
#   commit    the checkout's short HEAD, "(tree uncommitted)" added when its files differed
#   card      the accelerator's short name (`card`): h200, h100, ...; cpu without one
#   device    the device it ran on
#   versions  python, jax, jaxlib, numpy and the script's other libraries
#   figures   what was measured, by name
#   bound     what the figures cannot beat (a link, host DRAM), by name: each a value named with
#             its unit and "is": how it was obtained
#   baseline  what the figures are compared with (the device-resident step, torch, a
#             measurement), by name, in the same form
#   ratio     name -> number, each name saying what over what
# with at least one of bound and baseline, then optionally `launched_by` (the run_gpu.sh command
# line that ran the script: BENCH_LAUNCHED_BY) and `error` (the section that failed). Any other
# key is the script's own detail (its docstring says what it holds).

RESULT_KEYS = ("workload", "command", "date", "commit", "card", "device", "versions", "figures",
               "ratio")
BOUND_KEYS = ("bound", "baseline")


def utc_now() -> str:
  """The time now, UTC, ISO 8601 to the second."""
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def device_name(device: Any = None) -> str:
  """'platform:device kind' of `device` (default: JAX's first device), e.g. 'gpu:NVIDIA H200'."""
  if device is None:
    import jax  # pylint: disable=g-import-not-at-top
    device = jax.devices()[0]
  return f"{device.platform}:{getattr(device, 'device_kind', '?')}"


def card(device: str) -> str:
  """The short name of the card `device` (a `device_name`) names, for result file names.

  The model in its device kind, lower case ('gpu:NVIDIA H200' -> 'h200', 'gpu:NVIDIA H100 80GB
  HBM3' -> 'h100'); 'cpu' on the CPU backend; else the device kind's letters and digits.
  """
  import re  # pylint: disable=g-import-not-at-top
  platform, _, kind = device.partition(":")
  if platform == "cpu":
    return "cpu"
  if not kind:
    return "unknown"
  model = re.search(r"\b([A-Z]{1,2}\d{2,4}[A-Z]?)\b", kind)
  if model:
    return model.group(1).lower()
  return re.sub(r"[^a-z0-9]+", "_", kind.lower()).strip("_") or "unknown"


def result_name(template: str, rec: dict, **fields: Any) -> str:
  """The file name of a result: `template` with `{card}` (from `rec`'s `card`) and `fields`
  filled in, e.g. result_name("w1/streaming_{card}.json", rec) -> "w1/streaming_h200.json"."""
  return template.format(card=rec.get("card") or card(rec["device"]), **fields)


def git_commit() -> str:
  """$BENCH_COMMIT where set (a copy of the tree on another machine may carry a git history
  that is not the tree's: benchmarks/prologue.sh sets it), else the short hash of HEAD of the
  checkout these scripts are in, with " (tree uncommitted)" when `git status` lists any file;
  "unknown (not a git checkout)" where git cannot say."""
  import subprocess  # pylint: disable=g-import-not-at-top
  if os.environ.get("BENCH_COMMIT"):
    return os.environ["BENCH_COMMIT"]
  here = os.path.dirname(os.path.abspath(__file__))
  try:
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                         cwd=here, timeout=10)
    if rev.returncode != 0:
      return "unknown (not a git checkout)"
    status = subprocess.run(["git", "status", "--porcelain"], capture_output=True, text=True,
                            cwd=here, timeout=30)
  except (OSError, subprocess.SubprocessError):
    return "unknown (not a git checkout)"
  dirty = status.returncode != 0 or status.stdout.strip()
  return rev.stdout.strip() + (" (tree uncommitted)" if dirty else "")


def check_record(rec: dict) -> None:
  """Raises ValueError naming the schema keys that `rec` lacks."""
  missing = [k for k in RESULT_KEYS if k not in rec]
  if not any(k in rec for k in BOUND_KEYS):
    missing.append(" or ".join(BOUND_KEYS))
  if missing:
    raise ValueError(f"result record lacks {', '.join(missing)} (bench_util's schema)")


def result_record(*, workload: str, command: str, device: str, versions: dict, figures: dict,
                  ratio: dict, bound: dict | None = None, baseline: dict | None = None,
                  date: str | None = None, commit: str | None = None, **detail: Any) -> dict:
  """A workload's result in the schema above: its keys first, in order, then `detail`.

  `date` and `commit` default to now and this checkout's, `card` is `device`'s (`card`);
  `versions` loses `jaxtier_git` (`commit` says it); `launched_by` is BENCH_LAUNCHED_BY's value
  when that is set and `detail` has none.
  """
  versions = {k: v for k, v in (versions or {}).items() if k != "jaxtier_git"}
  rec = {"workload": workload, "command": command, "date": date or utc_now(),
         "commit": commit or git_commit(), "card": detail.pop("card", None) or card(device),
         "device": device, "versions": versions, "figures": figures}
  if bound is not None:
    rec["bound"] = bound
  if baseline is not None:
    rec["baseline"] = baseline
  rec["ratio"] = ratio
  if os.environ.get("BENCH_LAUNCHED_BY") and "launched_by" not in detail:
    rec["launched_by"] = os.environ["BENCH_LAUNCHED_BY"]
  rec.update(detail)
  check_record(rec)
  return rec


def write_result(rec: dict, out_dir: str, filename: str) -> str:
  """Checks `rec` against the schema and writes it as `out_dir/filename`; returns the path."""
  check_record(rec)
  return write_json(rec, out_dir, filename)
