"""Inventory: the training state's leaves, their sizes and roles, and the traced step.

Stage 1 of jaxtier's data flow (docs/design.md, "Where things are"): trace
`train_step(state, *args)`, list every leaf
of `state` with its pytree path, shape, dtype, sharding and bytes per device, and give it a role
from its uses in the traced jaxpr:

- `param`: a floating leaf read by non-elementwise ops (matmuls, gathers, reductions).
- `optimizer_state`: a floating leaf that feeds its own new value and whose every use is
  elementwise (moments, accumulators, EMA copies): touched once per step, the first to go to
  host. Also such a carried leaf whose update is not one elementwise pass (Adafactor's factored
  moments, a preconditioner) when the leaf itself is read elementwise (scaled, added to) and
  does not reach the step's metrics: a param is read by a matmul or broadcast against
  activations, and it reaches the loss. The plan then serves it by XLA's transfers and says why.
- `other`: integer, boolean, key or 0-d leaves (step counts, RNG keys); they stay on device.

Roles come from what the step does to make its new state: equations that only compute
metrics (a norm of the updated params, of the gradients, of the optimizer state) are not
looked at. The metrics that read an updated leaf or the optimizer state are cut off the traced
step into a `MetricTail`, run after the update on the values it made, wherever they live: the
step the rest of jaxtier plans and lowers computes the new state and the other metrics.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import conditions
from jaxtier._src.analysis import jaxpr_graph
from jaxtier._src.analysis import statics
from jaxtier._src.vocab import Role


@dataclasses.dataclass(frozen=True, kw_only=True)
class LeafInfo:
  """One leaf of the training state.

  Attributes:
    index: position among the flattened state leaves.
    path: the pytree path, as `jax.tree_util.keystr` writes it (e.g. `[1].opt_state[0].mu`).
    shape: the global shape.
    dtype: the dtype name (e.g. 'float32').
    nbytes: bytes held per device (one shard; the whole leaf when unsharded).
    role: `param`, `optimizer_state` or `other` (module docstring).
    why: how the role was decided, for the plan.
  """

  index: int
  path: str
  shape: tuple[int, ...]
  dtype: str
  nbytes: int
  role: str
  why: str

  @property
  def is_float(self) -> bool:
    return self.dtype in ("float32", "bfloat16", "float16", "float64")


@dataclasses.dataclass(frozen=True)
class MetricTail:
  """The metrics computed from what the update makes: run after it, on the device.

  A metric that reads an updated leaf or the optimizer state (a norm of the new params, of the
  moments or of the update) needs the update's results, and a reduction of them is no part of
  an elementwise host update. The traced step is cut in two: the step's part (`Inventory.
  closed_jaxpr`) returns, after the step's own outputs that it computes, the values the tail
  reads; the tail computes the rest of the step's outputs from them.

  Attributes:
    closed_jaxpr: the tail: `inputs` (in order) -> the outputs at `outputs`.
    inputs: positions among the step part's outvars that the tail reads.
    outputs: positions among the step's flattened outputs that the tail computes.
    kept: positions among the step's flattened outputs of the step part's first
      `len(kept)` outvars (its other outvars are only read by the tail).
    num_outputs: the step's flattened outputs.
  """

  closed_jaxpr: Any
  inputs: tuple[int, ...]
  outputs: tuple[int, ...]
  kept: tuple[int, ...]
  num_outputs: int

  def outputs_of(self, part: Sequence[Any], tail: Sequence[Any]) -> list[Any]:
    """The step's flattened outputs from the step part's (`part`) and the tail's (`tail`)."""
    out: list[Any] = [None] * self.num_outputs
    for j, x in zip(self.kept, part):
      out[j] = x
    for j, x in zip(self.outputs, tail):
      out[j] = x
    return out


@dataclasses.dataclass(frozen=True)
class Inventory:
  """The traced step and the state's leaves.

  Attributes:
    leaves: one `LeafInfo` per state leaf, in flattening order.
    closed_jaxpr: the traced step (without its `tail`); its first `len(leaves)` invars are the
      state leaves and its first `len(leaves)` outvars the new state leaves.
    state_treedef: the state's pytree structure.
    out_treedef: the structure of the step's whole output.
    num_args: flattened leaves of the other arguments.
    tail: the metrics computed after the update (`MetricTail`), or None: `closed_jaxpr`'s
      outvars are then the step's flattened outputs.
  """

  leaves: tuple[LeafInfo, ...]
  closed_jaxpr: Any
  state_treedef: Any
  out_treedef: Any
  num_args: int
  tail: "MetricTail | None" = None


def bytes_per_device(x: Any) -> int:
  """Bytes one device holds for array-like `x` (its shard when it carries a sharding)."""
  shape = tuple(x.shape)
  sharding = getattr(x, "sharding", None)
  if sharding is not None and hasattr(sharding, "shard_shape"):
    try:
      shape = tuple(sharding.shard_shape(shape))
    except Exception:  # pylint: disable=broad-except
      pass
  return int(np.prod(shape, dtype=np.int64)) * _itemsize(x.dtype)


def _itemsize(dtype: Any) -> int:
  """Bytes per element; extended dtypes (PRNG keys) report theirs through `itemsize`."""
  return int(getattr(dtype, "itemsize", 0)) or np.dtype(dtype).itemsize


def dtype_name(dtype: Any) -> str:
  """'float32', 'bfloat16', ..., or e.g. 'key<fry>' for a PRNG key dtype."""
  return jax.numpy.dtype(dtype).name if not jax.dtypes.issubdtype(
      dtype, jax.dtypes.extended) else str(dtype)


def check_leaves(api: str, state: Any, allow_abstract: bool = False) -> list[tuple[Any, Any]]:
  """Flattens `state` with paths; raises TypeError naming the first leaf that is not an array.

  With `allow_abstract`, `jax.ShapeDtypeStruct` leaves are accepted too (planning only).

  Raises:
    TypeError: a leaf is not a `jax.Array`/`np.ndarray` (e.g. a Python int or a string), or a
      jax.Array leaf was deleted (donated to an earlier step).
  """
  flat, _ = jax.tree_util.tree_flatten_with_path(state)
  for path, leaf in flat:
    name = jax.tree_util.keystr(path)
    if isinstance(leaf, jax.Array):
      if leaf.is_deleted():
        raise ValueError(
            f"{api}: state leaf {name} ({leaf.dtype}{list(leaf.shape)}) was deleted: it was "
            "donated to an earlier step, which consumed it. Pass the state returned by that "
            "step (`state, metrics = step(state, batch)`), not the one passed into it.")
      continue
    if isinstance(leaf, np.ndarray) or (allow_abstract and isinstance(leaf, jax.ShapeDtypeStruct)):
      continue
    raise TypeError(
        f"{api}: state leaf {name} is a {type(leaf).__name__} ({leaf!r:.60}), not an array; "
        "jaxtier places array leaves only. Make it an array (jnp.asarray) or move it out of "
        "the state (close over it, or mark it static).")
  return flat


def take_inventory(fn: Callable[..., Any], state: Any, args: Sequence[Any], *,
                   api: str = "jaxtier.offload", allow_abstract: "bool | None" = None
                   ) -> Inventory:
  """Traces `fn(state, *args)` and classifies the state's leaves.

  `allow_abstract`: accept `jax.ShapeDtypeStruct` state leaves (None: only for `jaxtier.plan`).

  Raises:
    TypeError: a non-array state leaf (named by path), or an output that is not
      `(new_state, metrics)` with the state's structure.
  """
  if allow_abstract is None:
    allow_abstract = api == "jaxtier.plan"
  flat = check_leaves(api, state, allow_abstract=allow_abstract)
  for what, tree in (("state leaf", state), ("argument", tuple(args))):
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
      axes = jc.explicit_axes(x)
      if axes:
        raise ValueError(
            f"{api}: {what} {jax.tree_util.keystr(path)} is sharded over a mesh with Explicit "
            f"axes {axes} (sharding in types, jax.make_mesh's default); jaxtier traces the step "
            "on shapes and lowers it with the leaves' shardings, which needs Auto axes. Make "
            "the mesh with axis_types=(jax.sharding.AxisType.Auto,) for each of its axes, e.g. "
            "jax.make_mesh((n,), ('d',), axis_types=(jax.sharding.AxisType.Auto,)).")
  # Trace on shapes alone: a state already placed in pinned_host (a re-plan after a new batch
  # shape, or a second wrapper) would otherwise trace host-memory avals into the user's ops.
  abstract = lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype) if hasattr(x, "dtype") else x
  closed, out_shape = jax.make_jaxpr(fn, return_shape=True)(
      jax.tree.map(abstract, state), *jax.tree.map(abstract, tuple(args)))
  closed = jc.inline_calls(closed)
  # A `cond` that may skip a state update (optax.apply_if_finite's) becomes selects, so that
  # each leaf's update is its own dataflow; planning and lowering both read this jaxpr.
  closed = conditions.select_conds(closed, num_state=len(flat))
  state_treedef = jax.tree_util.tree_structure(state)
  out_treedef = jax.tree_util.tree_structure(out_shape)
  if not (isinstance(out_shape, (tuple, list)) and len(out_shape) == 2):
    raise TypeError(
        f"{api}: expected the step to return (new_state, metrics), got output structure "
        f"{str(out_treedef)[:200]}. Return the updated state as the first element.")
  if jax.tree_util.tree_structure(out_shape[0]) != state_treedef:
    diff = statics.structure_diff(state, out_shape[0], ("state", "new state")) or [
        "the structures differ only in data their nodes hold (such as a functools.partial, "
        "which compares equal only to itself)"]
    raise TypeError(
        f"{api}: expected the step to return (new_state, metrics) with new_state structured "
        f"like its first argument (the state); they differ: {'; '.join(diff)}. Return the "
        "updated state as the first element, each leaf where it came in.")
  # Each leaf keeps its placement from step to step (its buffer is donated to, and returned
  # in, the same memory kind): a leaf whose shape or dtype the step changes cannot.
  for (path, leaf), new in zip(flat, jax.tree_util.tree_leaves(out_shape[0])):
    if tuple(np.shape(leaf)) != tuple(new.shape) or leaf.dtype != new.dtype:
      raise TypeError(
          f"{api}: the step returns state leaf {jax.tree_util.keystr(path)} as "
          f"{dtype_name(new.dtype)}{list(new.shape)}, but it came in as "
          f"{dtype_name(leaf.dtype)}{list(np.shape(leaf))}; jaxtier keeps each state leaf where "
          "it was placed, step after step, so a step must return every leaf with the shape and "
          "dtype it was given (check for broadcasting or a dtype promotion in the update of "
          "this leaf, or of the leaves it is computed from).")
  jaxpr = closed.jaxpr
  n_state = len(flat)
  metrics_only = metric_equations(jaxpr, n_state)
  roles = _roles(jaxpr, flat, metrics_only)
  leaves = []
  for i, (path, leaf) in enumerate(flat):
    role, why = roles[i]
    leaves.append(LeafInfo(index=i, path=jax.tree_util.keystr(path), shape=tuple(leaf.shape),
                           dtype=dtype_name(leaf.dtype), nbytes=bytes_per_device(leaf),
                           role=role, why=why))
  late = _late_metrics(jaxpr, leaves, metrics_only)
  closed, tail = _cut_tail(closed, late) if late else (closed, None)
  return Inventory(leaves=tuple(leaves), closed_jaxpr=closed, state_treedef=state_treedef,
                   out_treedef=out_treedef, num_args=len(jaxpr.invars) - n_state, tail=tail)


def metric_equations(jaxpr: Any, num_state: int) -> frozenset[int]:
  """The top-level equations of `jaxpr` that no new state leaf (its first `num_state` outvars)
  depends on: they compute metrics only."""
  live = {v for v in jaxpr.outvars[:num_state] if isinstance(v, jc.Var)}
  found = set()
  for k in range(len(jaxpr.eqns) - 1, -1, -1):
    eqn = jaxpr.eqns[k]
    if any(v in live for v in eqn.outvars if not isinstance(v, jc.DropVar)):
      live.update(v for v in eqn.invars if isinstance(v, jc.Var))
    else:
      found.add(k)
  return frozenset(found)


def _roles(jaxpr: Any, flat: list[tuple[Any, Any]], metrics_only: frozenset[int]
           ) -> list[tuple[str, str]]:
  """Each state leaf's (role, why), from the equations that make the new state (the
  equations in `metrics_only` are not looked at)."""
  n_state = len(flat)
  new_state = {v for v in jaxpr.outvars[:n_state] if isinstance(v, jc.Var)}
  # What the metrics read: a leaf reaches them through a value other than a new state leaf
  # (a param through the loss), not through one (a moment through a norm of the new params).
  to_metrics = {v for v in jaxpr.outvars[n_state:] if isinstance(v, jc.Var)}
  to_metrics.update(v for k in metrics_only for v in jaxpr.eqns[k].invars
                    if isinstance(v, jc.Var))
  out = []
  # What each leaf reaches, every leaf in one walk (`taint_masks`: bit i is leaf i).
  eqn_masks, var_masks = jaxpr_graph.taint_masks(jaxpr, range(n_state), skip=metrics_only)
  for i, (_, leaf) in enumerate(flat):
    if not jax.dtypes.issubdtype(leaf.dtype, jax.numpy.floating):
      out.append((Role.OTHER, f"{dtype_name(leaf.dtype)} leaf"))
      continue
    if len(leaf.shape) == 0:
      out.append((Role.OTHER, "0-d leaf"))
      continue
    bit = 1 << i
    eqns = [k for k, m in enumerate(eqn_masks) if m & bit]
    if not eqns:
      out.append((Role.OTHER, "not read by the step's update"))
      continue
    why = jaxpr_graph.check_elementwise(jaxpr_graph._SubJaxpr(jaxpr, eqns),  # pylint: disable=protected-access
                                        [k == i for k in range(len(jaxpr.invars))],
                                        jaxpr_graph.size_of(jaxpr.invars[i].aval))
    own_out = i < len(jaxpr.outvars) and isinstance(jaxpr.outvars[i], jc.Var) and bool(
        var_masks.get(jaxpr.outvars[i], 0) & bit)
    reaches = any(var_masks.get(v, 0) & bit for v in to_metrics
                  if v not in new_state and v is not jaxpr.invars[i])
    if not why and own_out:
      out.append((Role.OPTIMIZER_STATE, "read only elementwise; feeds its own update"))
    elif (why and own_out and not reaches
          and not jaxpr_graph.first_use_why(jaxpr, i, skip=metrics_only)):
      out.append((Role.OPTIMIZER_STATE, f"read elementwise, feeds its own update and not the "
                  f"metrics; its update is not elementwise ({why})"))
    elif why:
      out.append((Role.PARAM, f"read by non-elementwise ops ({why})"))
    else:
      out.append((Role.OTHER, "read elementwise but not carried to the next step"))
  return out


def _late_metrics(jaxpr: Any, leaves: Sequence[LeafInfo], metrics_only: frozenset[int]
                  ) -> set[int]:
  """The metric equations (`metrics_only`) that read, directly or not, an optimizer-state
  leaf or the new value of a param or optimizer-state leaf: what `MetricTail` runs."""
  n_state = len(leaves)
  seeds = {jaxpr.invars[l.index] for l in leaves if l.role == Role.OPTIMIZER_STATE}
  olds = set(jaxpr.invars)
  seeds.update(v for l, v in zip(leaves, jaxpr.outvars[:n_state])
               if l.role in (Role.PARAM, Role.OPTIMIZER_STATE) and isinstance(v, jc.Var)
               and v not in olds)
  late = set()
  for k, eqn in enumerate(jaxpr.eqns):
    if any(isinstance(v, jc.Var) and v in seeds for v in eqn.invars):
      seeds.update(v for v in eqn.outvars if not isinstance(v, jc.DropVar))
      if k in metrics_only:
        late.add(k)
  return late


class _Part(NamedTuple):
  """Some equations of a jaxpr with their own invars and outvars (for `jc.eval_jaxpr`)."""

  constvars: Any
  invars: Any
  eqns: Any
  outvars: Any


def _cut_tail(closed: Any, late: set[int]) -> tuple[Any, MetricTail]:
  """`closed` without the equations `late`, returning what they read, and the `MetricTail`
  that computes the step's outputs they made from that. What they read that depends on no
  input of the step (`jnp.zeros_like` of an array, as `optax.tree.norm` takes the imaginary
  part of a real one) is computed again in the tail rather than handed over."""
  jaxpr, consts = closed.jaxpr, list(closed.consts)
  eqns = jaxpr.eqns
  made = {v for k in late for v in eqns[k].outvars if not isinstance(v, jc.DropVar)}
  outputs = [j for j, v in enumerate(jaxpr.outvars) if isinstance(v, jc.Var) and v in made]
  kept = [j for j in range(len(jaxpr.outvars)) if j not in set(outputs)]
  part_outvars = [jaxpr.outvars[j] for j in kept]
  position: dict[Any, int] = {}
  for k, v in enumerate(part_outvars):
    if isinstance(v, jc.Var):
      position.setdefault(v, k)
  consts_of = set(jaxpr.constvars)
  constant, producer = set(consts_of), {}
  for k, eqn in enumerate(eqns):
    outs = [v for v in eqn.outvars if not isinstance(v, jc.DropVar)]
    producer.update((v, k) for v in outs)
    if not eqn.effects and all(not isinstance(v, jc.Var) or v in constant for v in eqn.invars):
      constant.update(outs)
  in_tail = set(late)
  pending = [v for k in late for v in eqns[k].invars]
  while pending:
    v = pending.pop()
    k = producer.get(v) if isinstance(v, jc.Var) and v in constant else None
    if k is not None and k not in in_tail:
      in_tail.add(k)
      pending.extend(eqns[k].invars)
  made |= {v for k in in_tail for v in eqns[k].outvars if not isinstance(v, jc.DropVar)}
  needs: list[Any] = []
  for k in sorted(in_tail):
    for v in eqns[k].invars:
      if (isinstance(v, jc.Var) and v not in made and v not in consts_of
          and not any(v is w for w in needs)):
        needs.append(v)
  for v in needs:
    if v not in position:
      position[v] = len(part_outvars)
      part_outvars.append(v)
  part = _Part(jaxpr.constvars, jaxpr.invars, [e for k, e in enumerate(eqns) if k not in late],
               part_outvars)
  tail = _Part(jaxpr.constvars, needs, [eqns[k] for k in sorted(in_tail)],
               [jaxpr.outvars[j] for j in outputs])
  spec = lambda v: jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype,
                                        weak_type=getattr(v.aval, "weak_type", False))
  part_closed = jc.dce(jax.make_jaxpr(lambda *a: jc.eval_jaxpr(part, consts, a))(
      *[spec(v) for v in jaxpr.invars]))
  tail_closed = jax.make_jaxpr(lambda *a: jc.eval_jaxpr(tail, consts, a))(
      *[spec(v) for v in needs])
  return part_closed, MetricTail(
      closed_jaxpr=tail_closed, inputs=tuple(position[v] for v in needs),
      outputs=tuple(outputs), kept=tuple(kept), num_outputs=len(jaxpr.outvars))
