"""The state's leaves put where the plan places them: as arrays, in their planned shardings."""

from __future__ import annotations

from typing import Any, Sequence

import jax
import jax.numpy as jnp

from jaxtier._src.errors import AdmissionError
from jaxtier._src.planning.plan import LeafPlan
from jaxtier._src.units import format_bytes
from jaxtier._src.vocab import MemoryKind


def put(x: Any, sharding: Any, leaf: LeafPlan) -> Any:
  """`jax.device_put(x, sharding)`; an allocation failure is raised naming the leaf and sizes.

  Raises:
    jaxtier.AdmissionError: the memory kind's allocator could not hold the leaf (for pinned_host
      on a GPU: XLA's pinned pool, capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB, or the host's
      page-locking limits for one allocation of this size).
  """
  try:
    return jax.device_put(x, sharding)
  except Exception as e:  # pylint: disable=broad-except  (XlaRuntimeError has no stable home)
    text = str(e)
    if "RESOURCE_EXHAUSTED" not in text and "out of memory" not in text.lower():
      raise
    hint = ("XLA's pinned host pool is capped by XLA_PJRT_GPU_HOST_MEMORY_LIMIT_GB (64 by "
            "default) and allocates each leaf in one piece: raise the cap if the host has the "
            "memory, or keep the leaf on the device (policy)"
            if leaf.memory_kind == MemoryKind.PINNED_HOST
            else "lower device_budget so that the plan moves more state to the host")
    error = AdmissionError(
        f"OffloadedStep.place: could not allocate leaf {leaf.path} ({leaf.dtype}"
        f"{list(leaf.shape)}, {format_bytes(leaf.nbytes)} = {leaf.nbytes} bytes per "
        f"device) in {leaf.memory_kind}: {text.splitlines()[0][:300]}. Fix: {hint}.")
    error.limit = ("host_limit" if leaf.memory_kind == MemoryKind.PINNED_HOST
                   else "device_memory")
    raise error from e


def for_step(leaves: Sequence[Any], shardings: Sequence[Any]) -> list[Any]:
  """The state's flat `leaves` as a step takes them (to donate): each in its planned sharding
  (moved there unless it is), and no buffer twice.

  The same buffer twice in the state (e.g. an optimizer keeping a reference to the params)
  cannot be donated twice: later occurrences get their own copy. Two Array objects may share
  one buffer (device_put to the sharding an array already has returns a new Array over the
  same buffer): buffers are compared, not objects.
  """
  moved = [x if _same_placement(x, s) else jax.device_put(x, s)
           for x, s in zip(leaves, shardings)]
  seen: set[Any] = set()
  for i, x in enumerate(moved):
    key = buffer_key(x)
    if key in seen:
      moved[i] = jnp.copy(x)
    seen.add(key)
  return moved


def buffer_key(x: Any) -> Any:
  """What identifies `x`'s storage: its shards' (device, buffer address), else the object."""
  try:
    return tuple((sh.device.id, sh.data.unsafe_buffer_pointer()) for sh in x.addressable_shards)
  except Exception:  # pylint: disable=broad-except  (a backend without raw pointers)
    return id(x)


def _same_placement(x: Any, s: Any) -> bool:
  sh = getattr(x, "sharding", None)
  return sh is not None and getattr(sh, "memory_kind", None) == s.memory_kind and (
      sh.is_equivalent_to(s, x.ndim))
