"""The step's two jitted programs (compute, then update), with the plan's shardings.

They are called as `lowering/calling.py` declares: a `ComputeIn` in, a `ComputeOut` out; an
`UpdateIn` in, an `UpdateOut` out.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import inventory as inv_lib
from jaxtier._src.lowering import calling
from jaxtier._src.lowering import rewrite as rewrite_lib
from jaxtier._src.lowering import streaming
from jaxtier._src.planning.plan import Plan
from jaxtier._src.units import format_bytes
from jaxtier._src.vocab import MemoryKind

log = logging.getLogger("jaxtier")


def state_shardings(state: Any, plan: Plan) -> list[NamedSharding]:
  """One `NamedSharding` per state leaf: its mesh and spec, in the plan's memory kind."""
  leaves = jax.tree_util.tree_leaves(state)
  mesh = jc.common_mesh(leaves)
  return [jc.named_sharding(x, lp.memory_kind, mesh) for x, lp in zip(leaves, plan.leaves)]


@dataclasses.dataclass
class StepPrograms:
  """The lowered step of one plan: `compute` jitted, `update` jitted on first use.

  Attributes:
    split: the rewritten step (`rewrite.SplitStep`): which leaves go where, and `assemble`;
      `split.stream` (also `stream`) the layer loops served by streaming and their gradient
      (scratch) buffers.
    state_shardings: one per state leaf, in its planned memory kind.
    scratch_shardings: one per `stream.scratch` buffer (pinned_host).
    master_shardings: one per fp32 master copy (pinned_host), ordered as `master_indices`.
    arg_memory_kinds: the memory kind each argument leaf after the state was compiled for.
    compute: `split.compute` jitted (`calling.Program`), donating `calling.ComputeIn`'s
      donated fields: the device leaves, the scratch buffers, the layered host leaves and
      their masters.
    make_update: feeds' shardings -> `split.update` jitted, donating `calling.UpdateIn`'s
      donated fields: the updated host leaves, their masters and `split.donated_feeds`.
    master_indices: the param leaves that carry an fp32 master copy, in a fixed order.
    speculative: the programs of the speculative lowering (`rewrite(..., speculate=True)`:
      `compute` takes a `calling.SpeculativeIn`), where the plan speculates
      (`Plan.speculation.enabled`); else None.
  """

  split: rewrite_lib.SplitStep
  state_shardings: list[Any]
  scratch_shardings: list[Any]
  master_shardings: list[Any]
  arg_memory_kinds: list[str]
  compute: calling.Program
  make_update: Callable[[Sequence[Any]], calling.Program]
  master_indices: list[int]
  speculative: "StepPrograms | None" = None
  _update: Any = None

  @property
  def stream(self) -> streaming.StreamSchedule:
    return self.split.stream

  def update(self, feed_shardings: Sequence[Any]) -> calling.Program:
    """`split.update` jitted for the feeds' shardings (those of `ComputeOut.feeds`; made once,
    on first use)."""
    if self._update is None:
      self._update = self.make_update(list(feed_shardings))
    return self._update

  def master_specs(self, leaves: Sequence[Any]) -> dict[int, jax.ShapeDtypeStruct]:
    """The fp32 masters as specs ({param leaf index: spec}) for the state's flat `leaves`."""
    return {i: jax.ShapeDtypeStruct(np.shape(leaves[i]), np.float32, sharding=sh)
            for i, sh in zip(self.master_indices, self.master_shardings)}

  def state_specs(self, state: Any) -> list[jax.ShapeDtypeStruct]:
    """The state's leaves as shapes with the shardings the call will see (placed or not)."""
    return [jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=sh)
            for x, sh in zip(jax.tree_util.tree_leaves(state), self.state_shardings)]

  def scratch_specs(self) -> list[jax.ShapeDtypeStruct]:
    return [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh)
            for s, sh in zip(self.stream.scratch, self.scratch_shardings)]

  def lower_for_check(self, state: Any, args: Sequence[Any]) -> tuple[Any, int, int]:
    """Lowers `compute` for the state as it will be placed: (lowered, device argument bytes,
    pinned_host argument bytes), bytes per device (what `verify` compares with the budget)."""
    specs = self.state_specs(state)
    arg_specs = [jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=getattr(x, "sharding", None))
                 for x in jax.tree_util.tree_leaves(args)]
    inputs = self.split.compute_inputs(specs, arg_specs, self.scratch_specs(),
                                       self.master_specs(specs))
    lowered = self.compute.lower(inputs)
    every = jax.tree_util.tree_leaves(inputs)
    host_bytes = sum(inv_lib.bytes_per_device(a) for a in every
                     if jc.memory_kind_of(a) == MemoryKind.PINNED_HOST)
    return lowered, sum(inv_lib.bytes_per_device(a) for a in every) - host_bytes, host_bytes

  def lower_update_for_check(self, state: Any, compiled_compute: Any) -> Any:
    """Lowers the fused host-update program for the state as it will be placed, its feeds as
    `compiled_compute` (the compiled `compute`) returns them; None when the step has no host
    update. What `verify` reads its pinned_host figures from."""
    if not self.split.has_update:
      return None
    specs = self.state_specs(state)
    feed_sh = list(compiled_compute.output_shardings.feeds)
    feeds = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sh)
             for a, sh in zip(compiled_compute.out_info.feeds, feed_sh)]
    return self.update(feed_sh).lower(self.split.update_inputs(
        specs, self.master_specs(specs), feeds, self.scratch_specs()))


def build(inventory: inv_lib.Inventory, plan: Plan, state: Any, args: Sequence[Any],
          overlap_update: bool = True) -> StepPrograms:
  """Lowers the traced step by `plan` and jits its two programs (`rewrite.SplitStep`);
  `overlap_update`: update leaves stacked over layers inside the backward pass, where they
  qualify (`lowering/overlap.py`)."""
  state_sh = state_shardings(state, plan)
  programs = _programs(rewrite_lib.rewrite(inventory.closed_jaxpr, plan, state_sh,
                                           overlap_update), plan, state, args, state_sh)
  if overlap_update and plan.speculation is not None and plan.speculation.enabled:
    spec = rewrite_lib.rewrite(inventory.closed_jaxpr, plan, state_sh, overlap_update,
                               speculate=True)
    if spec.guesses:
      programs.speculative = _programs(spec, plan, state, args, state_sh)
  return programs


def _programs(split: rewrite_lib.SplitStep, plan: Plan, state: Any, args: Sequence[Any],
              state_sh: list[Any]) -> StepPrograms:
  """The jitted programs of one lowering (`split`) of `plan`."""
  stream = split.stream
  n_state = len(plan.leaves)
  masters = rewrite_lib.master_indices(plan.components)
  master_sh = [state_sh[i].with_memory_kind(MemoryKind.PINNED_HOST) for i in masters]
  master_sh_of = dict(zip(masters, master_sh))
  # A gradient buffer is sharded like its leaf (else replicated on the leaf's mesh).
  scratch_sh = [
      state_sh[s.leaf].with_memory_kind(MemoryKind.PINNED_HOST)
      if tuple(s.shape) == tuple(plan.leaves[s.leaf].shape) else
      NamedSharding(state_sh[s.leaf].mesh, PartitionSpec(), memory_kind=MemoryKind.PINNED_HOST)
      for s in stream.scratch]
  # Explicit in_shardings for every argument (the batch too): JAX pairs donated buffers
  # with outputs by memory kind only when every argument's memory kind is known; otherwise
  # (jax 0.11) it paired a device param with a same-shaped pinned_host moment, which XLA's
  # verifier rejects.
  mesh = jc.common_mesh((state, args))
  arg_sh = [jc.named_sharding(x, jc.memory_kind_of(x) or MemoryKind.DEVICE, mesh)
            for x in jax.tree_util.tree_leaves(args)]
  out_sh = lambda js: [state_sh[j] if j < n_state else None for j in js]
  # A metric the update program returns (an updated leaf, or an elementwise function of one,
  # computed by a host update) comes out of the custom call in pinned_host: the step's
  # outputs other than the state are on the device, as under jax.jit (replicated over the
  # state's mesh: XLA copies them there). The late predicates (`ComputeOut.guards`) too.
  metric_mesh = mesh if mesh is not None else (state_sh[0].mesh if state_sh else None)
  metric_sh = (None if metric_mesh is None
               else NamedSharding(metric_mesh, PartitionSpec(), memory_kind=MemoryKind.DEVICE))
  if split.speculative:
    compute_in_sh = split.speculative_inputs(state_sh, arg_sh, scratch_sh, master_sh_of,
                                             split.by_spare_key(state_sh, master_sh_of))
    layered_master_sh = list(compute_in_sh.spare_masters)
  else:
    compute_in_sh = split.compute_inputs(state_sh, arg_sh, scratch_sh, master_sh_of)
    layered_master_sh = list(compute_in_sh.layered_masters)
  out_class = calling.SpeculativeOut if split.speculative else calling.ComputeOut
  compute = calling.Program(split.compute, compute_in_sh, out_class(
      first=out_sh(split.compute_outs[:split.num_first]), feeds=[None] * split.num_feeds,
      rest=out_sh(split.compute_outs[split.num_first:]), scratch=scratch_sh,
      layered_host=out_sh(split.layered_host), layered_masters=layered_master_sh,
      guards=[metric_sh] * split.guards))

  update_out_sh = [state_sh[j] if j < n_state else metric_sh for j in split.update_outs]

  def make_update(feed_sh):
    update_in_sh = split.update_inputs(state_sh, master_sh_of, feed_sh, scratch_sh)
    return calling.Program(split.update, update_in_sh, calling.UpdateOut(
        outs=update_out_sh, masters=list(update_in_sh.masters)))

  return StepPrograms(split=split, state_shardings=state_sh,
                      scratch_shardings=scratch_sh, master_shardings=master_sh,
                      arg_memory_kinds=[sh.memory_kind for sh in arg_sh], compute=compute,
                      make_update=make_update, master_indices=masters)


# Below this many pinned bytes per device the pool's regions are left to grow as they do.
RESERVE_MIN_BYTES = 1 << 30


def reserve_pinned_pool(plan: Plan, shardings: Sequence[Any]) -> bool:
  """Makes XLA's pinned pool hold the plan's pinned bytes as one region, before any leaf is
  created there; on a GPU, where the plan pins at least RESERVE_MIN_BYTES per device.

  XLA's pinned pool is a BFC allocator that grows in regions of doubling size (2 MiB, 4 MiB,
  ...; a request larger than the next region gets one of the smallest such size that holds
  it), and a buffer must fit in one free piece of one region. Leaves created one by one then
  leave pieces of each region too small for the next large leaf: 14b's 106.4 GiB of moments
  in a 108 GiB pool left an 11.9 GiB leaf no region to go in (H200). One buffer of all the
  bytes the plan pins (`pinned_bytes` and the compiled programs' `compiler_host_extra_bytes`)
  is allocated and freed first: its region (the smallest power-of-two size that holds it, at
  most what the pool has left) stays in the pool, and the leaves pack into it.

  Returns:
    Whether the buffer was made (False: nothing to do, or it could not be allocated; the pool
    then grows as it does, and the failure is logged).
  """
  need = plan.pinned_need_bytes
  host = [sh for sh, leaf in zip(shardings, plan.leaves)
          if leaf.memory_kind == MemoryKind.PINNED_HOST]
  if plan.platform != "gpu" or need < RESERVE_MIN_BYTES or not host:
    return False
  # Replicated over the leaves' mesh: one buffer in each device's pool.
  sharding = NamedSharding(host[0].mesh, PartitionSpec(), memory_kind=MemoryKind.PINNED_HOST)
  try:
    buffer = jax.jit(lambda: jnp.zeros((need,), jnp.uint8), out_shardings=sharding)()
    buffer.block_until_ready()
    buffer.delete()
  except Exception as e:  # pylint: disable=broad-except  (the leaves are then made as usual)
    log.warning("jaxtier: could not reserve %s of pinned host memory as one region of XLA's "
                "pool (%s); creating the pinned_host leaves one by one", format_bytes(need), e)
    return False
  return True


# The most bytes of pinned_host leaves one initialiser program computes when the plan gives no
# device headroom to size it by (the CPU backend, or no budget).
INIT_CHUNK_BYTES = 4 << 30


def initializers(init_fn: Callable[..., Any], plan: Plan, shardings: Sequence[Any],
                 treedef: Any, chunk_bytes: "int | None" = None
                 ) -> list[tuple[list[int], Any]]:
  """Jitted programs that create the state's leaves where `plan` puts them.

  Each program computes some leaves of `init_fn(*args)` (XLA drops the rest of the
  computation) with the plan's shardings as its `out_shardings`, so every leaf is born in its
  memory kind: the device leaves in one program; the pinned_host leaves in programs of at most
  `chunk_bytes` each (a leaf larger than that alone), so that no program holds the whole host
  state on the device while it computes it. By default `chunk_bytes` is half the device
  memory the plan leaves free (its planned budget less its device bytes), else
  INIT_CHUNK_BYTES.

  Args:
    init_fn: `init_fn(*args) -> state`, a pure function (e.g. of a PRNG key) whose output has
      the pytree structure `treedef` the plan was made for.
    plan: the plan of the state's leaves (`LeafPlan.memory_kind`, `nbytes` per device).
    shardings: one `NamedSharding` per leaf (`state_shardings`).
    treedef: the state's pytree structure.
    chunk_bytes: bytes of pinned_host leaves per program (None: as above).

  Returns:
    [(leaf indices, jitted program returning those leaves as a list)], device leaves first.

  Raises:
    ValueError: `init_fn`'s output is not of structure `treedef`.
  """
  if chunk_bytes is None:
    budget = plan.device_budget.usable
    free = None if budget is None else budget - plan.device_bytes
    chunk_bytes = max(free // 2, 1) if free and free > 0 else INIT_CHUNK_BYTES
  device = [l.index for l in plan.leaves if l.memory_kind == MemoryKind.DEVICE]
  groups, size = [device] if device else [], 0
  for leaf in plan.leaves:
    if leaf.memory_kind == MemoryKind.DEVICE:
      continue
    if not groups or groups[-1] is device or size + leaf.nbytes > chunk_bytes:
      groups.append([])
      size = 0
    groups[-1].append(leaf.index)
    size += leaf.nbytes

  def program(indices: list[int]) -> Any:
    def leaves_of(*args):
      out = init_fn(*args)
      flat, got = jax.tree_util.tree_flatten(out)
      if got != treedef:
        raise ValueError("OffloadedStep.init: expected init_fn to return a state of the planned "
                         f"structure {treedef}, got {got}")
      return [flat[i] for i in indices]
    return jax.jit(leaves_of, out_shardings=[shardings[i] for i in indices])

  return [(g, program(g)) for g in groups]
