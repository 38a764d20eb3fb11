"""The hardware profile this machine plans with: the stored one, a quick calibration of it
where its device has no built-in figures, or the built-in profile of its card.

`profile.py` holds what a profile is (and the cards' built-in ones), `calibrate.py` how a
machine is measured; this module chooses among them, once per process and path.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from jaxtier._src.hardware import calibrate as calibration
from jaxtier._src.hardware.profile import (BUILTIN_PROFILES, DEFAULT_PROFILE, PROFILE_FORMAT_VERSION,
                                           HardwareProfile, cache_path, card_of,
                                           check_device_kind, save)

log = logging.getLogger("jaxtier")

_WARNED: set[str] = set()


# The environment variable that turns off the quick calibration `load` runs where this machine
# has no stored profile: "0", "false", "no" or "off" (any case).
AUTO_CALIBRATE_ENV = "JAXTIER_AUTO_CALIBRATE"


def auto_calibrate_enabled() -> bool:
  """Whether `load` measures this machine where it has no stored profile (AUTO_CALIBRATE_ENV
  unset, or set to anything but "0", "false", "no" or "off")."""
  value = os.environ.get(AUTO_CALIBRATE_ENV, "").strip().lower()
  return value not in ("0", "false", "no", "off")


def _has_no_builtin_here() -> bool:
  """Whether this machine's compute device has no built-in figures: the CPU backend (an H200's
  rates describe no CPU), or a GPU whose card has no built-in profile."""
  import jax  # pylint: disable=g-import-not-at-top
  backend = jax.default_backend()
  if backend == "gpu":
    return card_of(jax.devices()[0].device_kind) is None
  return backend == "cpu"


# The quick calibrations this process ran, by the path they were stored at: the profile, or None
# where it failed (not tried again in this process).
_AUTO_CALIBRATED: "dict[str, HardwareProfile | None]" = {}


def _auto_calibrated(path: str) -> "HardwareProfile | None":
  """This machine's profile from a quick calibration (`calibrate.quick_calibrate`), stored at
  `path`, where auto-calibration is on and the device has no built-in figures; None where it
  is off, not needed, or failed (said in one warning)."""
  if not auto_calibrate_enabled() or not _has_no_builtin_here():
    return None
  if path in _AUTO_CALIBRATED:
    return _AUTO_CALIBRATED[path]
  _AUTO_CALIBRATED[path] = None
  try:
    measured = calibration.quick_calibrate()
  except Exception as e:  # pylint: disable=broad-except  (a plan is made with the defaults then)
    _, named = builtin_here()
    log.warning("jaxtier: no hardware profile at %s, and measuring this machine failed (%s: %s); "
                "planning with %s, so the plan's times are not this machine's. Run `python -m "
                "jaxtier calibrate`.", path, type(e).__name__, e, named)
    return None
  prof = _AUTO_CALIBRATED[path] = measured.profile
  try:
    stored = f"stored at {save(prof, path)}"
  except OSError as e:
    stored = f"not stored ({e}): measured again by the next process"
  log.warning("jaxtier: no hardware profile for %s: measured this machine in %.1f s (matmul %.3g "
              "TFLOP/s, memory %.3g GB/s, CPU AdamW %.3g params/s), %s. %s=0 turns this off; "
              "`python -m jaxtier calibrate` measures it at full size.", prof.device_kind,
              measured.secs, prof.matmul_tflops, prof.hbm_gbps, prof.cpu_adamw_params_per_sec,
              stored, AUTO_CALIBRATE_ENV)
  return prof


def builtin_here() -> "tuple[HardwareProfile, str]":
  """(the profile, how the warnings name it) used where this machine has no stored profile:
  on a GPU the built-in profile of its card (`builtin_profile`), else the defaults."""
  import jax  # pylint: disable=g-import-not-at-top
  if jax.default_backend() != "gpu":
    return DEFAULT_PROFILE, "the defaults"
  kind = jax.devices()[0].device_kind
  card = card_of(kind)
  if card is None:
    return DEFAULT_PROFILE, (f"the H200 defaults (no built-in figures for {kind}; known: "
                             f"{', '.join(BUILTIN_PROFILES)})")
  if card == "H200":
    return DEFAULT_PROFILE, "the H200 defaults"
  return BUILTIN_PROFILES[card], (f"the built-in {card} figures (the H200's measured rates "
                                  f"scaled by the {card}'s datasheet; not calibrated)")


def load(path: "str | None" = None, *, platform: "str | None" = None,
         device_kind: "str | None" = None, warn: bool = True) -> HardwareProfile:
  """The stored profile for this machine's device, else one measured now, else a built-in one.

  Where this machine has no stored profile at `cache_path()` (none, not JSON, or of an older
  format) and its device has no built-in figures (the CPU backend, or a GPU whose card is not
  one of `BUILTIN_PROFILES`), the first `load` measures it: a quick calibration
  (`calibrate.quick_calibrate`: what a plan reads of the profile, at sizes that keep it within
  `calibrate.QUICK_BUDGET_SECS`, 10 s; some 2.5 s of CPU time on 2 cores), stored at
  `cache_path()` for the next ones and said in one warning. Setting the environment variable
  JAXTIER_AUTO_CALIBRATE=0 (`AUTO_CALIBRATE_ENV`) turns this off; where it is off or the
  measurement fails (said in a warning), the H200 defaults are returned, and a plan made with
  them says that its times are not this machine's (`Plan.rates_of`). `python -m jaxtier
  calibrate` (`jaxtier.calibrate`) measures everything at full size.

  Args:
    path: a profile JSON written by `save` (default: `cache_path()` of this machine's device).
      A `path` given is only read: no calibration runs for it.
    platform: the platform being planned for ('cpu'/'gpu'); when it is not this machine's
      backend (planning for a GPU on a machine without one), a built-in profile is returned
      (`device_kind`'s, else `DEFAULT_PROFILE`): a stored profile describes this machine's
      devices, not the absent GPU.
    device_kind: the GPU planned for on a machine without one ('H100', 'H200', 'A100', or a
      device kind naming one: `check_device_kind`); None: the H200 (`DEFAULT_PROFILE`). On a
      GPU it may name only this machine's card. Not read where `path` is given.
    warn: log a warning (once per path) when a built-in profile is returned for want of a
      stored one, or because the stored one is stale. (A quick calibration's line is logged
      whatever `warn` says: it happens once per machine.)

  Returns:
    The profile. Where none is stored, where the file is not JSON, or where the stored one was
    written in an older format (its "format_version" missing or below
    `PROFILE_FORMAT_VERSION`): the quick calibration's, where it runs (above); else on a GPU the
    built-in profile of its card (`builtin_profile(jax.devices()[0].device_kind)`), else
    `DEFAULT_PROFILE`.

  Raises:
    ValueError: the file holds unknown fields or non-positive rates.
    jaxtier.OptionError: `device_kind` has no built-in profile, or does not fit `platform`
      (`check_device_kind`).
  """
  import json  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  given = path is not None
  if not given:
    card = check_device_kind(device_kind, platform or jax.default_backend())
    if platform is not None and platform != jax.default_backend():
      return BUILTIN_PROFILES[card] if card else DEFAULT_PROFILE
  path = path or cache_path()

  def without_stored(why: "str | None") -> HardwareProfile:
    # No profile at `path` that this jaxtier reads (`why`: what is wrong with the file there;
    # None: no file): measured now where that runs, else the built-in one, said once.
    measured = None if given else _auto_calibrated(path)
    if measured is not None:
      return measured
    fallback, named = builtin_here()
    if warn and path not in _WARNED and (why is not None or jax.default_backend() == "gpu"):
      _WARNED.add(path)
      if why is None:
        log.warning("jaxtier: no hardware profile at %s; planning with %s. Run "
                    "`python -m jaxtier calibrate` once on this machine.", path, named)
      else:
        log.warning("jaxtier: ignoring %s: %s; planning with %s. Run "
                    "`python -m jaxtier calibrate`.", path, why, named)
    return fallback

  if not os.path.exists(path):
    return without_stored(None)
  try:
    with open(path) as f:
      data = json.load(f)
  except ValueError as e:  # not JSON (a truncated or overwritten file): as a stale profile
    return without_stored(f"not a profile ({e})")
  version = data.pop("format_version", None) if isinstance(data, dict) else None
  if not isinstance(version, int) or version < PROFILE_FORMAT_VERSION:
    return without_stored(
        f"written by an older jaxtier (profile format "
        f"{version if version is not None else 'unversioned'}, this one reads "
        f"{PROFILE_FORMAT_VERSION})")
  names = {f.name for f in dataclasses.fields(HardwareProfile)}
  unknown = sorted(set(data) - names)
  if unknown:
    raise ValueError(f"jaxtier profile {path}: unknown fields {unknown}; delete it and run "
                     "`python -m jaxtier calibrate` again")
  return HardwareProfile(**data)
