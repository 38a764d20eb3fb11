"""Sizes and rates as people write them: bytes from '80GB' / '16GiB', and back."""

from __future__ import annotations

import math
import re

import numpy as np

from jaxtier._src.errors import PlanError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str | None, name: str = "parse_bytes") -> int | None:
  """Bytes from an int/float (bytes) or a string like '80GB', '16GiB', '512MiB'; None = no limit.

  'GB', 'MB', 'KB', 'TB' are powers of 10; 'GiB', 'MiB', 'KiB', 'TiB' powers of 2; no unit (or
  'B') is bytes.

  Args:
    value: the size, or None.
    name: what the size is, for the error message (e.g. 'jaxtier.offload: device_budget').

  Returns:
    The size in bytes (int), or None for None.

  Raises:
    PlanError (a ValueError): not a size, or a size <= 0.
  """
  if value is None:
    return None
  if isinstance(value, str):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
      raise PlanError(f"{name}: expected a size like 80GB, 16GiB or a number of bytes, got "
                      f"{value!r}")
    nbytes = float(m.group(1)) * _UNITS[m.group(2).lower()]
  elif isinstance(value, (int, float, np.integer, np.floating)) and not isinstance(value, bool):
    nbytes = float(value)
  else:
    raise PlanError(f"{name}: expected bytes (int) or a size string, got {type(value).__name__}")
  if not nbytes > 0:
    raise PlanError(f"{name}: expected a size > 0 bytes, got {value!r}; pass None for no limit")
  return int(nbytes)


def format_bytes(n: int) -> str:
  """`n` bytes as people read them: '1.50 GiB', '3.00 MiB', '12 B' (powers of 2, two decimals)."""
  for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
    if abs(n) >= size:
      return f"{n / size:.2f} {unit}"
  return f"{n} B"


def format_rate(value: float) -> str:
  """`value` to 3 significant digits, for printing rates (GB/s, TFLOP/s, params/s).

  Without an exponent from 1e-3 to below 1e6 (0.000412, 0.438, 80.5, 700, 4000), with one
  elsewhere (2.3e+09).
  """
  if not value or not math.isfinite(value):
    return f"{value:g}"
  magnitude = math.floor(math.log10(abs(value)))
  if -3 <= magnitude < 6:
    digits = max(0, 2 - magnitude)
    return f"{round(value, digits):.{digits}f}"
  return f"{value:.3g}"
