"""Compiled memory figures kept on disk between processes.

A step's compiled memory figures (`step_costs.MemoryFigures`) are a function of what was
compiled and of the compiler: the same program, compiled again by the same jax and XLA with the
same options for the same device kind, has the same figures. Planning reads them from the
device-only step (`step_costs.measure_step`) and from each plan it compiles; the second run of
a training script plans the same steps again. This cache keeps those figures under the user's
cache directory, so that a later process reads them instead of compiling for them. On a
calibrated CPU, where the device-only step is also run to time it, its time on this machine is
kept beside its figures (the stored profile is this machine's measurement too), until a run's
measured step contradicts it (`step_costs.check_step_time` removes it: the next process times
the step again).

A key hashes the program's text (a plan's lowered compute program; the device-only step's
jaxpr with its arguments' types and shardings, which is not lowered where found) with
everything else the figures depend on (`key`): jax and jaxlib versions, the backend, the
device kind, XLA_FLAGS and the compile options. A missing,
unreadable or foreign entry is a miss, never an error: the caller compiles.

Environment:
  JAXTIER_FIGURES_CACHE: '0' (or 'off') turns the cache off; a path puts it there (default
    `$XDG_CACHE_HOME/jaxtier/figures`, else `~/.cache/jaxtier/figures`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from typing import Any, Iterable

from jaxtier._src import paths

# Entries kept (each one file of about 300 bytes); beyond it the oldest are removed.
MAX_ENTRIES = 2048
# Bumped when the entries' content changes meaning.
FORMAT_VERSION = 1
_OFF = ("0", "off", "false", "no")
# Folders found unwritable, each said once per process.
_WARNED: set = set()
log = logging.getLogger("jaxtier")


def directory() -> "str | None":
  """The cache's folder, or None where JAXTIER_FIGURES_CACHE turns it off."""
  given = os.environ.get("JAXTIER_FIGURES_CACHE", "").strip()
  if given.lower() in _OFF:
    return None
  if given:
    return given
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxtier", "figures")


def key(program_text: str, *, backend: str, options: "dict[str, Any] | None" = None,
        extra: Iterable[str] = ()) -> str:
  """A hex digest naming the figures of `program_text` compiled on `backend` with `options`
  by this jax and jaxlib, for this machine's device kind, under this XLA_FLAGS."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxlib  # pylint: disable=g-import-not-at-top
  try:
    kind = jax.devices(backend)[0].device_kind
  except Exception:  # pylint: disable=broad-except  (no such backend here: the name alone)
    kind = backend
  h = hashlib.sha256()
  for part in (str(FORMAT_VERSION), jax.__version__, jaxlib.__version__, backend, kind,
               os.environ.get("XLA_FLAGS", ""), json.dumps(options or {}, sort_keys=True,
                                                           default=str), *extra):
    h.update(part.encode())
    h.update(b"\0")
  h.update(program_text.encode())
  return h.hexdigest()


def load(digest: str, cls: type) -> Any:
  """The figures stored under `digest` as a `cls` (a dataclass of ints), or None (a miss)."""
  folder = directory()
  if folder is None:
    return None
  try:
    with open(os.path.join(folder, f"{digest}.json")) as f:
      record = json.load(f)
    if record.get("format_version") != FORMAT_VERSION:
      return None
    fields = {f.name for f in dataclasses.fields(cls)}
    values = record["figures"]
    if set(values) != fields or not all(isinstance(v, int) for v in values.values()):
      return None
    return cls(**values)
  except (OSError, ValueError, KeyError, TypeError, AttributeError):
    return None


def store(digest: str, figures: Any) -> None:
  """Keeps `figures` (a dataclass of ints) under `digest`; written whole or not at all (a
  temporary file renamed). Failing to write loses nothing but the next process's time."""
  folder = directory()
  if folder is None or figures is None:
    return
  try:
    paths.write_json(os.path.join(folder, f"{digest}.json"),
                     {"format_version": FORMAT_VERSION, "figures": dataclasses.asdict(figures)})
    _prune(folder)
  except OSError as e:
    if folder not in _WARNED:
      _WARNED.add(folder)
      log.warning("jaxtier: cannot write the figures cache at %s (%s): a later process will "
                  "compile what it could have read; set JAXTIER_FIGURES_CACHE to a writable "
                  "folder, or to 0", folder, e.strerror or e)


def remove(digest: str) -> bool:
  """Removes the entry stored under `digest`; whether there was one (a folder turned off or an
  entry already gone: False)."""
  folder = directory()
  if folder is None:
    return False
  try:
    os.unlink(os.path.join(folder, f"{digest}.json"))
    return True
  except OSError:
    return False


def _prune(folder: str) -> None:
  """Removes the oldest entries beyond MAX_ENTRIES."""
  entries = [e for e in os.scandir(folder) if e.name.endswith(".json")
             and not e.name.startswith(".")]
  if len(entries) <= MAX_ENTRIES:
    return
  entries.sort(key=lambda e: e.stat().st_mtime)
  for e in entries[:len(entries) - MAX_ENTRIES]:
    try:
      os.unlink(e.path)
    except OSError:
      pass
