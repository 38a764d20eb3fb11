"""Checkpoints of an offloaded step's state through orbax-checkpoint, fp32 masters included.

What jaxtier keeps for the user beside the state (the fp32 master copies of bf16/f16 params
updated on the host, in pinned_host) is saved with it, so a restored run continues bit for bit.
Each array is written by orbax from where it lives (a pinned_host leaf from host memory) and
restored straight into the sharding and memory kind it is given.
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax

# The checkpoint's top-level entries.
STATE, MASTERS = "state", "masters"


def _checkpointer():
  try:
    import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  except ImportError as e:
    raise ImportError("jaxtier checkpoints need orbax-checkpoint: pip install orbax-checkpoint "
                      "(it comes with flax)") from e
  return ocp.StandardCheckpointer()


def save(directory: "str | os.PathLike[str]", state: Any, masters: Mapping[str, jax.Array]
         ) -> None:
  """Writes `state` and `masters` ({name: fp32 array}) to `directory`, which must not exist.

  Returns when the files are written (the arrays may be donated to a step after).

  Raises:
    ValueError: `directory` exists (orbax refuses to overwrite a checkpoint).
  """
  path = os.path.abspath(os.fspath(directory))
  if os.path.exists(path):
    raise ValueError(f"jaxtier checkpoint: {path} exists; save to a new directory (for example "
                     "one per step)")
  with _checkpointer() as ckptr:
    ckptr.save(path, {STATE: state, MASTERS: dict(masters)})
    ckptr.wait_until_finished()


def restore(directory: "str | os.PathLike[str]", state: Any, masters: Mapping[str, Any]
            ) -> tuple[Any, dict[str, jax.Array]]:
  """Reads a checkpoint written by `save`: (state, masters), each leaf in the sharding (and so
  the memory kind) of its target in `state` / `masters` (`jax.ShapeDtypeStruct`s).

  Raises:
    FileNotFoundError: no checkpoint at `directory`.
    ValueError: the checkpoint's structure, shapes or dtypes differ from the targets'.
  """
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"jaxtier checkpoint: no checkpoint at {path}")
  with _checkpointer() as ckptr:
    try:
      out = ckptr.restore(path, {STATE: state, MASTERS: dict(masters)})
    except (ValueError, KeyError, TypeError) as e:
      said = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
      raise ValueError(
          f"jaxtier checkpoint: {path} does not hold a state like the one given (its "
          f"structure, shapes, dtypes or fp32 masters differ; orbax says: {said}). Restore "
          "with the state the checkpoint was saved from, planned the same way (the same "
          "policy and budgets)") from e
  return out[STATE], dict(out[MASTERS])
