"""Sizes and rates as people write them: bytes from '80GB' / '16GiB', and back."""

from __future__ import annotations

import fractions
import math
import re

import numpy as np

from jaxtier._src.errors import OptionError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(value: int | float | str | None, name: str = "parse_bytes",
                no_limit: str = "pass None for no limit") -> int | None:
  """Bytes from an int/float (bytes) or a string like '80GB', '16GiB', '512MiB'; None = no limit.

  'GB', 'MB', 'KB', 'TB' are powers of 10; 'GiB', 'MiB', 'KiB', 'TiB' powers of 2; no unit (or
  'B') is bytes. The size must be a whole number of bytes: '1.5GiB' is (1,610,612,736), 1.5 and
  '1.5B' are not, and are refused rather than rounded.

  Args:
    value: the size, or None.
    name: what the size is, for the error message (e.g. 'jaxtier.offload: device_budget'); its
      last part (after ': ') is the error's `option`.
    no_limit: how the caller asks for no limit, said where a size <= 0 is refused (a command
      line: 'leave --device_budget out for no limit').

  Returns:
    The size in bytes (int), or None for None.

  Raises:
    OptionError (a PlanError, ValueError and TypeError): not a size (a string in no unit above,
      a bool or another type), a size <= 0 or not finite, or not a whole number of bytes.
  """
  if value is None:
    return None

  def refuse(why: str) -> OptionError:
    return OptionError(f"{name}: {why}", option=name.rpartition(": ")[2], value=value,
                       expected="a whole number of bytes > 0, or a size string such as '80GB'")

  if isinstance(value, str):
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
      raise refuse(f"expected a size like 80GB, 16GiB or a number of bytes, got {value!r}")
    # Exact: '0.1KB' is 100 bytes, not 100.00000000000001.
    nbytes = fractions.Fraction(m.group(1)) * _UNITS[m.group(2).lower()]
  elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
    nbytes = fractions.Fraction(int(value))
  elif isinstance(value, (float, np.floating)):
    if not math.isfinite(value):
      raise refuse(f"expected a finite size, got {value!r}; {no_limit}")
    nbytes = fractions.Fraction(float(value))
  else:
    raise refuse(f"expected bytes (int) or a size string, got {type(value).__name__} "
                 f"{value!r:.80}")
  if not nbytes > 0:
    raise refuse(f"expected a size > 0 bytes, got {value!r}; {no_limit}")
  if nbytes.denominator != 1:
    raise refuse(f"expected a whole number of bytes, got {value!r} ({float(nbytes):g} bytes); "
                 f"give an int (e.g. {math.floor(nbytes) or 1}) or a size that is whole in its "
                 "unit's bytes ('1.5GiB' is)")
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


def format_share(share: float) -> str:
  """A share (0 to 1) as a percentage: whole percents from 1%, two significant digits below
  (0.0042 -> '0.42%'), so that a small share does not read as 0%."""
  if share == 0 or share >= 0.01:
    return f"{share:.0%}"
  return f"{share * 100:.2g}%"
