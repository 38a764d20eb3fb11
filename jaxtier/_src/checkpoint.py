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
import numpy as np

from jaxtier._src.errors import CheckpointMismatchError

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


def check_like(directory: "str | os.PathLike[str]", state: Any) -> None:
  """Checks that the checkpoint at `directory` holds a state of the structure, shapes and
  dtypes of `state` (arrays or `jax.ShapeDtypeStruct`s), from the checkpoint's metadata alone.

  Raises:
    FileNotFoundError: no checkpoint at `directory`.
    CheckpointMismatchError: the first leaf that differs, named with its dtype and shape on
      each side. A checkpoint whose metadata cannot be read is not checked here (`restore`
      says what orbax says of it).
  """
  path = os.path.abspath(os.fspath(directory))
  if not os.path.isdir(path):
    raise FileNotFoundError(f"jaxtier checkpoint: no checkpoint at {path}")
  with _checkpointer() as ckptr:
    try:
      saved = ckptr.metadata(path).item_metadata[STATE]
    except Exception:  # pylint: disable=broad-except  (restore reports what orbax finds)
      return
  key = lambda p: tuple(str(getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))))
                        for k in p)
  held = {key(p): (jax.tree_util.keystr(p), leaf)
          for p, leaf in jax.tree_util.tree_flatten_with_path(saved)[0]}
  given = jax.tree_util.tree_flatten_with_path(state)[0]
  what = lambda x: f"{np.dtype(x.dtype).name}{list(x.shape)}"

  def differs(leaf: str, mine: "str | None", theirs: "str | None") -> CheckpointMismatchError:
    return CheckpointMismatchError(
        f"jaxtier checkpoint: {path} does not hold a state like the one given: its first leaf "
        f"that differs is {leaf}, {theirs or 'absent'} in the checkpoint and "
        f"{mine or 'absent'} in the state given. Restore with the state the checkpoint was "
        "saved from (or `jax.eval_shape` of its initialiser)", leaf=leaf, given=mine,
        saved=theirs)

  for p, x in given:
    _, leaf = held.get(key(p), (None, None))
    if leaf is None:
      raise differs(jax.tree_util.keystr(p), what(x), None)
    if tuple(leaf.shape) != tuple(x.shape) or np.dtype(leaf.dtype) != np.dtype(x.dtype):
      raise differs(jax.tree_util.keystr(p), what(x), what(leaf))
  extra = sorted(set(held) - {key(p) for p, _ in given})
  if extra:
    name, leaf = held[extra[0]]
    raise differs(name, None, what(leaf))


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
