"""`MasterCopies`: the fp32 master copies of the bf16/f16 params that host updates keep."""

from __future__ import annotations

import logging
from typing import Any, Iterator, Mapping, Sequence

import jax
import jax.numpy as jnp

log = logging.getLogger("jaxtier")


class MasterCopies:
  """The fp32 master copies of one plan's bf16/f16 params updated on the host.

  A host update of a bf16/f16 param reads and writes its fp32 master (pinned_host) and writes
  the param rounded: the caller's state holds only the rounded param, the master lives here.
  Each master belongs to the param value it was last written beside (its source): a state
  whose params are those sources continues from the masters; any other state re-derives them
  from its params (`refresh`).

  Iterating gives the masters in `indices` order (empty until first derived).

  Attributes:
    indices: the param leaves (state leaf indices) that carry a master, in the programs' order
      (`StepPrograms.master_indices`).
    shardings: one `NamedSharding` (pinned_host) per master, in `indices` order.
  """

  def __init__(self, indices: Sequence[int] = (), shardings: Sequence[Any] = (),
               carried: "Mapping[int, tuple[jax.Array, Any]] | None" = None):
    """Args:
      indices, shardings: as the attributes.
      carried: {param leaf index: (master, the param it is the master of)} kept from the
        plan before this one (`carried()` of its copies): `refresh` takes a master from there
        while the state passes that same param.
    """
    self.indices = list(indices)
    self.shardings = list(shardings)
    self._values: list[jax.Array] = []
    self._sources: tuple[Any, ...] = ()
    self._carried = dict(carried or {})

  def __iter__(self) -> Iterator[jax.Array]:
    return iter(self._values)

  def __len__(self) -> int:
    return len(self._values)

  def by_index(self) -> dict[int, jax.Array]:
    """{param leaf index: master} (empty until first derived)."""
    return dict(zip(self.indices, self._values))

  def carried(self) -> dict[int, tuple[jax.Array, Any]]:
    """{param leaf index: (master, its param)}: what a new plan's copies continue from."""
    return {i: (m, src) for i, m, src in zip(self.indices, self._values, self._sources)}

  def refresh(self, original: Sequence[Any], placed: Sequence[Any]) -> None:
    """Makes the masters those of the state's params: kept where `placed` (the state's flat
    leaves as the step will take them) holds the params they were written beside, else
    carried over from the plan before (the same param object in `original`, the flat leaves
    as given), else derived from the params (`original[i]` in fp32, put in pinned_host).
    Deriving masters that existed is logged (a warning): the fp32 bits they held are lost."""
    if not self.indices:
      return
    sources = tuple(placed[i] for i in self.indices)
    if len(self._sources) == len(sources) and all(
        a is b for a, b in zip(self._sources, sources)):
      return
    carried, self._carried = self._carried, {}
    if self._sources:
      log.warning("jaxtier: the state's bf16/f16 params are not the ones the last step returned; "
                  "re-deriving their fp32 master copies from them")

    def master(i, sh):
      if i in carried and original[i] is carried[i][1]:  # planned again: the same param
        return jax.device_put(carried[i][0], sh)
      return jax.device_put(jnp.asarray(original[i], jnp.float32), sh)
    self._values = [master(i, sh) for i, sh in zip(self.indices, self.shardings)]
    self._sources = sources

  def update(self, new: Mapping[int, jax.Array], outs: Sequence[Any]) -> None:
    """Takes the masters a step made ({param leaf index: master}; the others are kept), written
    beside the params in `outs` (the step's flat outputs, the new state's leaves first)."""
    of = self.by_index()
    of.update(new)
    self._values = [of[i] for i in self.indices]
    self._sources = tuple(outs[i] for i in self.indices)

  def forget(self) -> None:
    """Drops the masters (donated to a step that failed): the next step derives them again."""
    self._values, self._sources = [], ()

  # -- checkpoints ------------------------------------------------------------------------
  def keys(self) -> list[str]:
    """Checkpoint names of the masters: their param's leaf index."""
    return [f"leaf_{i}" for i in self.indices]

  def checkpoint_items(self) -> dict[str, jax.Array]:
    """{checkpoint name: master}, what `checkpoint.save` writes beside the state."""
    return dict(zip(self.keys(), self._values))

  def checkpoint_targets(self, leaves: Sequence[Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """{checkpoint name: fp32 spec in its pinned_host sharding} for the state's flat `leaves`
    (arrays or specs): where `checkpoint.restore` reads each master into."""
    return {k: jax.ShapeDtypeStruct(leaves[i].shape, jnp.float32, sharding=sh)
            for k, i, sh in zip(self.keys(), self.indices, self.shardings)}

  def restored(self, masters: Mapping[str, jax.Array], leaves: Sequence[Any]) -> None:
    """Takes the masters `checkpoint.restore` read ({checkpoint name: master}), as those of the
    restored state's flat `leaves`.

    Raises:
      KeyError: a master of `indices` is missing from `masters`.
    """
    self._values = [masters[k] for k in self.keys()]
    self._sources = tuple(leaves[i] for i in self.indices)
