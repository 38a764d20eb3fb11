"""Files jaxtier writes: output paths checked before any work starts, and JSON written whole
or not at all."""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any


def why_unwritable(path: str, example: str = "out.json") -> "str | None":
  """Why the file `path` cannot be written (a directory, a folder that does not exist, no
  permission), else None. Checked by a real write of a temporary file beside it: permission
  bits do not tell root (or /proc) the truth. Nothing is left behind.

  `example`: a file name the message offers where `path` is a directory.
  """
  folder = os.path.dirname(os.path.abspath(path))
  if os.path.isdir(path):
    return f"expected a file name (e.g. {example}), got a directory"
  if os.path.exists(folder) and not os.path.isdir(folder):
    return f"{folder} is a file, not a directory; pick another path"
  if not os.path.isdir(folder):
    return f"the directory {folder} does not exist; create it or pick another path"
  try:
    with tempfile.NamedTemporaryFile(dir=folder, prefix=".jaxtier-write-check-"):
      pass
    if os.path.exists(path) and not os.access(path, os.W_OK):
      raise PermissionError(f"{path} is read-only")
  except OSError as e:
    return f"cannot write there ({e.strerror or e}); pick a writable path"
  return None


def why_unwritable_folder(path: str) -> "str | None":
  """Why the folder `path` cannot be made or written (a file there, or no permission in the
  nearest folder that exists), else None. Checked as `why_unwritable` checks a file: by a
  real write of a temporary file, in `path` or in the folder it would be made in."""
  full = os.path.abspath(path)
  if os.path.exists(full) and not os.path.isdir(full):
    return f"{path!r} is a file, not a folder; name a folder"
  existing = full
  while not os.path.exists(existing):
    existing = os.path.dirname(existing)
  if not os.path.isdir(existing):
    return f"{path!r} cannot be made: {existing} is a file"
  try:
    with tempfile.NamedTemporaryFile(dir=existing, prefix=".jaxtier-write-check-"):
      pass
  except OSError as e:
    return f"{path!r} cannot be written: {existing} is not writable ({e.strerror or e})"
  return None


def write_json(path: str, obj: Any, *, indent: "int | None" = None) -> None:
  """Writes `obj` as JSON to `path` whole or not at all: a temporary file beside it, renamed,
  so that a process reading `path` meanwhile never reads half of it. Makes the folder.

  Raises:
    OSError: the folder or file cannot be written (nothing is left behind).
  """
  folder = os.path.dirname(os.path.abspath(path))
  os.makedirs(folder, exist_ok=True)
  fd, partial = tempfile.mkstemp(prefix=".jaxtier-", suffix=".json", dir=folder)
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(obj, f, indent=indent)
    os.chmod(partial, 0o644)
    os.replace(partial, path)
  except BaseException:
    os.unlink(partial)
    raise
