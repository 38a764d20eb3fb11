"""Lowering: the traced step rewritten so that its host-resident leaves are served by plan.

The step becomes two programs (`SplitStep`). `compute` re-binds every equation of the traced
step that no fused host update takes (the forward, the backward, the scalar bookkeeping);
scans over host_stream leaves are unrolled and fed layer by layer (`lowering/streaming.py`); leaves
placed `host_xla` are copied to the device (XLA's memory-kind transfer) and their new values go
back to pinned_host through the output shardings. `update` runs each elementwise component
that updates host leaves as one `host_update` custom call, in place on the donated host
buffers. Only `update` donates host leaves: a step that fails in `compute` (after some
transfers, say) leaves them intact.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis.program_compiler import CompiledComponent
from jaxtier._src.lowering import streaming
from jaxtier._src.planning.plan import Plan
from jaxtier._src.primitives import host_update as hu
from jaxtier._src.vocab import Placement


@dataclasses.dataclass
class SplitStep:
  """The traced step lowered as two programs run one after the other.

  `compute(device_leaves, host_leaves, args, scratch) -> (outs, feeds, more_outs, scratch)`:
  the forward,
  backward and everything else on the device, with host_stream leaves fetched layer by layer
  and their gradients sent into `scratch`. It reads host leaves but never donates them, so a
  step that fails here leaves every host-resident leaf intact and usable.

  `update(updated_host, read_host, masters, feeds, scratch) -> (outs, masters)`: the fused host
  updates, in place on the donated `updated_host` leaves and masters; `feeds` are the values
  `compute` made for them (gradients, device params, scalars).

  Index lists (into the state leaves / the step's outvars) say what goes where; `assemble`
  puts the step's flattened outputs back together.
  """

  compute: Callable[..., tuple[list[Any], list[Any], list[Any], list[Any]]]
  update: Callable[..., tuple[list[Any], list[Any]]]
  device_leaves: list[int]     # state leaves in device memory (donated to `compute`)
  host_leaves: list[int]       # state leaves in pinned_host (read by `compute`, not donated)
  updated_host: list[int]      # host leaves updated in place by `update` (donated there)
  read_host: list[int]         # host leaves `update` only reads
  compute_outs: list[int]      # outvars `compute` returns, in order
  update_outs: list[int]       # outvars `update` returns, in order
  passthrough: dict[int, int]  # outvar -> state leaf returned unchanged (a host leaf)
  num_feeds: int
  num_first: int               # compute_outs[:num_first] come before the feeds
  stream: streaming.StreamSchedule = streaming.EMPTY  # the streamed layer loops

  def assemble(self, state_leaves: Sequence[Any], compute_outs: Sequence[Any],
               update_outs: Sequence[Any], num_outvars: int) -> list[Any]:
    out: list[Any] = [None] * num_outvars
    for j, x in zip(self.compute_outs, compute_outs):
      out[j] = x
    for j, x in zip(self.update_outs, update_outs):
      out[j] = x
    for j, i in self.passthrough.items():
      out[j] = state_leaves[i]
    return out


def rewrite(closed_jaxpr: Any, plan: Plan, shardings: "Sequence[Any] | None" = None
            ) -> SplitStep:
  """Lowers the traced step by `plan` into a `SplitStep` (compute, then fused host updates).

  Every equation that no fused host update (`plan.components`) takes is re-bound as traced;
  the layer loops over `host_stream` leaves are unrolled, their leaves fetched layer by layer
  (`streaming.schedule`); each compiled component becomes one `host_update` call.
  `shardings` (one `NamedSharding` per state leaf, as the state is sharded) lets a component
  whose leaves are sharded over a mesh run per shard: each device updates its own shard of the
  host buffers (`shard_map`), with no all-gather. Masters are ordered like
  `master_indices(plan.components)`, scratch buffers like `SplitStep.stream.scratch`.
  """
  compiled = plan.components
  stream = streaming.schedule(
      closed_jaxpr.jaxpr, [l.index for l in plan.leaves if l.placement == Placement.HOST_STREAM],
      {k for cc in compiled for k in cc.component.eqns})
  jaxpr, consts = closed_jaxpr.jaxpr, list(closed_jaxpr.consts)
  n_state = len(plan.leaves)
  skip = {k for cc in compiled for k in cc.component.eqns}
  xla_host = {l.index for l in plan.leaves if l.placement == Placement.HOST_XLA}
  host = [l.index for l in plan.leaves if l.memory_kind == "pinned_host"]
  device = [l.index for l in plan.leaves if l.memory_kind != "pinned_host"]
  masters = master_indices(compiled)
  by_update = {j for cc in compiled for r in cc.results for j in r.outputs}
  host_set = set(host)
  invar_pos = {v: i for i, v in enumerate(jaxpr.invars)}
  passthrough = {j: invar_pos[v] for j, v in enumerate(jaxpr.outvars)
                 if j not in by_update and isinstance(v, jc.Var) and invar_pos.get(v) in host_set}
  # `compute` returns the device leaves' new values first, in the order the leaves are
  # donated, then the feeds, then the rest: JAX pairs donated inputs with outputs of the same
  # shape in order, and (jax 0.10) not always by memory kind. A device leaf whose new value
  # `update` makes (a bf16 param from its master) then pairs with a feed (its gradient).
  compute_outs = [j for j in range(len(jaxpr.outvars)) if j not in by_update
                  and j not in passthrough]
  rank = {i: r for r, i in enumerate(device)}
  compute_outs.sort(key=lambda j: (0, rank[j]) if j in rank else (1, j))
  num_first = sum(1 for j in compute_outs if j in rank)
  update_outs = sorted(by_update)
  updated = sorted({cc.operands[r.alias].index for cc in compiled for r in cc.results
                    if r.alias >= 0 and cc.operands[r.alias].kind == "host"})
  read_only = sorted({spec.index for cc in compiled for spec in cc.operands
                      if spec.kind == "host"} - set(updated))
  # Device values the fused updates read, in a fixed order (a gradient sent to a scratch
  # buffer is read there instead).
  feed_vars: list[Any] = []
  for cc in compiled:
    for spec in cc.operands:
      if spec.kind == "value" and spec.var not in stream.sent_vars and spec.var not in feed_vars:
        feed_vars.append(spec.var)

  def compute(device_leaves, host_leaves, arg_leaves, scratch_leaves):
    state = [None] * n_state
    for i, x in zip(device, device_leaves):
      state[i] = x
    for i, x in zip(host, host_leaves):
      state[i] = jax.device_put(x, jc.memory_space("device")) if i in xla_host else x
    env: dict[Any, Any] = dict(zip(jaxpr.invars, state + list(arg_leaves)))
    env.update(zip(jaxpr.constvars, consts))
    scratch = list(scratch_leaves)

    def read(v):
      if isinstance(v, jc.Literal):
        return v.val
      val = env[v]
      return val.whole() if isinstance(val, streaming.Stacked) else val

    for k, eqn in enumerate(jaxpr.eqns):
      if k in skip:
        continue
      if k in stream.scans:  # a layer loop over host_stream leaves: unrolled, streamed
        outs = streaming.run_scan(eqn, stream.scans[k], [
            v.val if isinstance(v, jc.Literal) else env[v] for v in eqn.invars], scratch)
      else:
        outs = jc.bind_eqn(eqn, [read(v) for v in eqn.invars])
      for v, val in zip(eqn.outvars, outs):
        if not isinstance(v, jc.DropVar):
          env[v] = val
    feeds = [read(v) for v in feed_vars]
    outs = [read(jaxpr.outvars[j]) for j in compute_outs]
    return outs[:num_first], feeds, outs[num_first:], scratch

  def update(updated_leaves, read_leaves, master_leaves, feeds, scratch):
    host_of = dict(zip(updated, updated_leaves)) | dict(zip(read_only, read_leaves))
    master_of = dict(zip(masters, master_leaves))
    feed_of = dict(zip(feed_vars, feeds))
    outs: dict[int, Any] = {}
    new_masters: dict[int, Any] = {}
    for cc in compiled:
      operands = []
      for spec in cc.operands:
        if spec.kind == "host":
          x = host_of[spec.index]
        elif spec.kind == "master":
          x = master_of[spec.index]
        elif spec.kind == "const":
          x = jnp.asarray(spec.value)
        elif spec.var in stream.sent_vars:
          x = scratch[stream.sent_vars[spec.var]]
        else:
          x = feed_of[spec.var]
        if jnp.dtype(x.dtype) not in hu.SUPPORTED_DTYPES:
          x = jnp.asarray(x).astype(jnp.float32)
        operands.append(x)
      for r, val in zip(cc.results, _call(cc, operands, shardings)):
        for j in r.outputs:
          outs[j] = val
        if r.master >= 0:
          new_masters[r.master] = val
    return [outs[j] for j in update_outs], [new_masters[i] for i in masters]

  return SplitStep(compute=compute, update=update, device_leaves=device, host_leaves=host,
                   updated_host=updated, read_host=read_only, compute_outs=compute_outs,
                   update_outs=update_outs, passthrough=passthrough, num_feeds=len(feed_vars),
                   num_first=num_first, stream=stream)


def _call(cc: CompiledComponent, operands: list[Any], shardings: "Sequence[Any] | None"
          ) -> list[Any]:
  """One host_update call for `cc`, per shard when its seed leaf is sharded over a mesh."""
  aliases = [r.alias for r in cc.results]
  kw = dict(executor=cc.executor, dha_fraction=cc.dha_fraction)
  seed = cc.component.seeds[0]
  sh = shardings[seed] if shardings is not None else None
  shape = tuple(cc.results[0].shape) if cc.results else ()
  sharded = (sh is not None and sh.mesh.size > 1 and any(a is not None for a in sh.spec)
             and all(tuple(np.shape(x)) in (shape, ()) or np.size(x) == 1 for x in operands))
  if not sharded:
    shapes = [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in cc.results]
    return hu.host_update(cc.program, operands, shapes, aliases, **kw)
  spec = sh.spec
  in_specs = tuple(spec if tuple(np.shape(x)) == shape and np.size(x) != 1 else P()
                   for x in operands)
  operands = [x if tuple(np.shape(x)) == shape or np.ndim(x) == 0 else jnp.reshape(x, ())
              for x in operands]
  local = [jax.ShapeDtypeStruct(sh.shard_shape(r.shape), r.dtype) for r in cc.results]

  def per_shard(*ops):
    return tuple(hu.host_update(cc.program, list(ops), local, aliases, **kw))
  return list(jax.shard_map(per_shard, mesh=sh.mesh, in_specs=in_specs,
                            out_specs=tuple(spec for _ in cc.results), check_vma=False)(*operands))


def master_indices(compiled: Sequence[CompiledComponent]) -> list[int]:
  """State-leaf indices that carry an fp32 master copy, in a fixed order."""
  return sorted({r.master for cc in compiled for r in cc.results if r.master >= 0})


