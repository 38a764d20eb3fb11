"""What the command lines (`python -m jaxtier`, the example trainer) let the libraries log."""

from __future__ import annotations

import logging


def quiet_library_logs() -> None:
  """Keeps the libraries' INFO lines out of a command's output unless absl's --verbosity is
  given (absl prints INFO by default): JAX's that it found no TPU, jaxtier's own (the compiled
  peak, re-plans), orbax's (some twenty lines per checkpoint saved, through absl's logger).
  Call it after absl has parsed the flags."""
  from absl import flags  # pylint: disable=g-import-not-at-top
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  if not flags.FLAGS["verbosity"].present:
    logging.getLogger("jaxtier").setLevel(logging.WARNING)
    logging.getLogger("absl").setLevel(logging.WARNING)
