"""Output files the command line will write: checked before any work starts."""

from __future__ import annotations

import os
import tempfile


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
