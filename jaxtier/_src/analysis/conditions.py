"""Conditional state updates: a top-level `cond` that may keep training state becomes selects.

Optimizer wrappers that apply an update only under a condition trace one `lax.cond` whose
operands are every gradient and the whole inner optimizer state: `optax.apply_if_finite` keeps
the state when a gradient is not finite, `optax.MultiSteps(should_skip_update_fn=...)` when the
predicate says skip, `optax.conditionally_transform` / `conditionally_mask` until a step count.
In the traced step that `cond` is one equation reading leaves of every size, so the dataflow of
`jaxpr_graph.components` joins every moment into one component, which no op program can run
(its elements differ in number), and the moments fall back to XLA's memory-kind transfers.

`select_conds` rewrites such a `cond` into every branch's equations, inlined at top level, then
one `select_n(index, *branch_outputs)` per output. Each moment's update is then its own chain
of elementwise equations ending in a select on a scalar predicate, which fuses as any other
optimizer's does. The values are the same bit for bit: each primitive of a branch gets the
operands it got under the `cond`, and a select passes the chosen branch's value through
unchanged. (A compiler may still round the inlined equations otherwise than it did inside the
branch, as it may any two programs: XLA's CPU compiler contracts a multiply and an add into one
FMA where they meet in one fusion.) A predicate
that is a bool converted to the branch index (what `lax.cond` traces) selects on the bool; any
other index is first mapped into range as XLA's `Conditional` does (an index outside
[0, branches) runs the last branch).

The rule: a top-level `cond` equation is rewritten when

1. its branch index is traced (a literal index is already that branch: `jc.inline_calls`),
2. it has no effects (ordered effects, io or debug callbacks run as the branch says; both
   branches' effects would run), it is not `lax.platform_dependent`'s (its index names the
   platform the step is lowered for, and another platform's branch may not lower here), and
   every output is a numeric or bool array, and
3. it is a *conditional state update*: some branch leaves a state leaf i as it was
   (`kept_leaves`). Either the branch returns leaf i's old value (its operand is the step's
   input leaf i itself) unchanged, and the step's new value of leaf i is that output of the
   `cond`, directly or through equations each elementwise over leaf i's elements
   (`jaxpr_graph.elementwise_over`): a skipped optimizer state. Or the branch returns zeros,
   and the step adds that output to leaf i's old value (`add`, the leaf maybe converted), the
   sum making the new value through such equations: a skipped update
   (`optax.apply_updates(params, zeros)`, as apply_if_finite over a stateless SGD returns).

Why (3) and not "an output reaches the new state": a `cond` of the model's forward pass feeds
the loss, and reaches the new state only through the gradient's transposes; but the transpose
of a forward `cond`, in the backward pass, is a `cond` too, and may make a parameter's whole
gradient, which an optimizer such as SGD turns into the new parameter elementwise. Such a
`cond` never hands a state leaf back as it was, and a zero gradient it makes in a branch is
scaled or accumulated before any param adds it; the update that may be skipped keeps the state,
or adds nothing, in the branch that skips it. The conds of the model's forward and backward
passes are left alone, so their branches are not both evaluated.

Cost: every branch runs on every step. For the wrappers above the skipping branch is a copy or
zeros, so a step computes what the updating branch computes, also on the (rare) step it skips;
a select is one more instruction per element of the fused update, whose operands it already
reads. Conds nested in a rewritten branch become top-level equations and are judged by the same
rule, until none is left to rewrite. (JAX itself turns a `cond` into selects the same way when
`vmap` batches its predicate.)
"""

from __future__ import annotations

from typing import Any

import jax
from jax import lax
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import jaxpr_graph

# Rounds of rewriting, at most: each inlines one level of conds nested in rewritten branches.
_MAX_ROUNDS = 8


def kept_leaves(jaxpr: Any, k: int, num_state: int) -> list[int]:
  """The state leaves that equation `k` of the top-level `jaxpr`, a `cond`, keeps in a branch.

  Leaf i (`jaxpr.invars[i]` before the step, `jaxpr.outvars[i]` after, i < `num_state`) is kept
  when some branch returns, as output j,

  - the leaf's old value: the branch's operand bound to `jaxpr.invars[i]`, unchanged, and the
    step's new value of leaf i is output j, directly or through equations each elementwise over
    leaf i's elements (a skipped optimizer state); or
  - zeros, and the step adds output j to the leaf's old value (or a conversion of it), the sum
    making its new value through such equations (a skipped update:
    `optax.apply_updates(params, zeros)`).

  Sorted; empty when the `cond` keeps no leaf (rule 3 of the module docstring).
  """
  eqn = jaxpr.eqns[k]
  state = {v: i for i, v in enumerate(jaxpr.invars[:num_state])}
  passed: dict[int, set[int]] = {}  # output position -> leaves whose old value it may be
  zeros: set[int] = set()  # output positions that some branch makes zeros
  for branch in eqn.params["branches"]:
    body = jc.open_jaxpr(branch)[0]
    position = {v: p for p, v in enumerate(body.invars)}
    made = {o: e for e in body.eqns for o in e.outvars}
    for j, ov in enumerate(body.outvars):
      if _is_zeros(ov, made):
        zeros.add(j)
      p = position.get(ov) if isinstance(ov, jc.Var) else None
      operand = eqn.invars[1 + p] if p is not None else None
      if isinstance(operand, jc.Var) and operand in state:
        passed.setdefault(j, set()).add(state[operand])
  kept = set()
  for j, leaves in passed.items():
    kept.update(i for i in leaves if _reaches_elementwise(jaxpr, k, eqn.outvars[j], i))
  if zeros:
    made = {o: e for e in jaxpr.eqns for o in e.outvars}
    outputs = {eqn.outvars[j]: j for j in zeros if not isinstance(eqn.outvars[j], jc.DropVar)}
    for a, add in enumerate(jaxpr.eqns[k + 1:], start=k + 1):
      if add.primitive.name != "add" or not any(v in outputs for v in add.invars
                                                 if isinstance(v, jc.Var)):
        continue
      for x, y in (add.invars, add.invars[::-1]):
        old = _unconverted(y, made) if isinstance(x, jc.Var) and x in outputs else None
        i = state.get(old) if isinstance(old, jc.Var) else None
        if i is not None and _reaches_elementwise(jaxpr, a, add.outvars[0], i):
          kept.add(i)
  return sorted(kept)


def _is_zeros(var: Any, made: dict[Any, Any]) -> bool:
  """Whether `var` (of a jaxpr whose equations make the values in `made`) is the literal 0 or a
  broadcast of it (`jnp.zeros_like`)."""
  if isinstance(var, jc.Var) and var in made:
    eqn = made[var]
    if eqn.primitive.name != "broadcast_in_dim" or len(eqn.invars) != 1:
      return False
    var = eqn.invars[0]
  return isinstance(var, jc.Literal) and bool(np.all(np.asarray(var.val) == 0))


def _unconverted(var: Any, made: dict[Any, Any]) -> Any:
  """`var`, or the value it converts (`convert_element_type`, followed back)."""
  while isinstance(var, jc.Var) and var in made and (
      made[var].primitive.name == "convert_element_type"):
    var = made[var].invars[0]
  return var


def _reaches_elementwise(jaxpr: Any, k: int, var: Any, i: int) -> bool:
  """Whether `jaxpr.outvars[i]` is `var` (an output of equation k) or computed from it by
  equations after k each elementwise over the elements of input leaf i."""
  target = jaxpr.outvars[i]
  if isinstance(var, jc.DropVar) or not isinstance(target, jc.Var):
    return False
  n = jaxpr_graph.size_of(jaxpr.invars[i].aval)
  reached = {var}
  for eqn in jaxpr.eqns[k + 1:]:
    if target in reached:
      break
    if (any(isinstance(v, jc.Var) and v in reached for v in eqn.invars)
        and jaxpr_graph.elementwise_over(eqn, n)):
      reached.update(o for o in eqn.outvars if not isinstance(o, jc.DropVar))
  return target in reached


def _plain_array(aval: Any) -> bool:
  dtype = getattr(aval, "dtype", None)
  return (hasattr(aval, "shape") and dtype is not None
          and not jax.dtypes.issubdtype(dtype, jax.dtypes.extended))


def conditional_updates(jaxpr: Any, num_state: int) -> list[int]:
  """Indices of the equations of the top-level `jaxpr` that `select_conds` rewrites: `cond`s
  with a traced branch index, no effects, not platform dependent, array outputs, and a state
  leaf kept in a branch (`kept_leaves`). The first `num_state` invars and outvars of `jaxpr`
  are the state's."""
  found = []
  for k, eqn in enumerate(jaxpr.eqns):
    if (eqn.primitive.name != "cond" or isinstance(eqn.invars[0], jc.Literal) or eqn.effects
        or eqn.params.get("branches_platforms") is not None
        or not all(_plain_array(v.aval) for v in eqn.outvars)):
      continue
    if kept_leaves(jaxpr, k, num_state):
      found.append(k)
  return found


def select_conds(closed: Any, num_state: int) -> Any:
  """`closed` (a ClosedJaxpr of the step, inlined by `jc.inline_calls`) with each conditional
  state update (`conditional_updates`) replaced by its branches and a `select_n` per output.

  The result is inlined and dead equations are dropped, as `jc.inline_calls` leaves a step;
  `closed` itself is returned when there is nothing to rewrite. The first `num_state` invars
  and outvars are the state leaves', before and after.
  """
  for _ in range(_MAX_ROUNDS):
    found = conditional_updates(closed.jaxpr, num_state)
    if not found:
      break
    closed = jc.inline_calls(_rewrite(closed, set(found)))
  return closed


def _rewrite(closed: Any, rewrite: set[int]) -> Any:
  """Re-traces `closed` with the `cond` equations at indices `rewrite` evaluated branch by
  branch and selected (calls inside the branches are left for `jc.inline_calls`)."""
  jaxpr, consts = closed.jaxpr, list(closed.consts)
  producer = {o: e for e in jaxpr.eqns for o in e.outvars}

  def selected(k, eqn, invals, read):
    if k not in rewrite:
      return None
    return _selected(eqn, invals, _bool_source(eqn.invars[0], producer, read))

  def run(*args):
    return jc.eval_jaxpr(jaxpr, consts, args, selected)

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
  return jax.make_jaxpr(run)(*avals)


def _bool_source(index: Any, producer: dict[Any, Any], read: Any) -> Any:
  """The traced bool that the branch index `index` converts to 0 or 1, or None."""
  eqn = producer.get(index) if isinstance(index, jc.Var) else None
  if eqn is None or eqn.primitive.name != "convert_element_type":
    return None
  src = eqn.invars[0]
  if np.dtype(src.aval.dtype) != np.bool_ or getattr(src.aval, "shape", None) != ():
    return None
  return read(src)


def _selected(eqn: Any, invals: list[Any], pred: Any) -> list[Any]:
  """The outputs of `cond` equation `eqn` on `invals` (index first), every branch evaluated
  and each output selected from the branch the index names; `pred` is the bool the index was
  converted from (None when it was not one)."""
  branches = eqn.params["branches"]
  results = [jc.eval_jaxpr(*jc.open_jaxpr(branch), invals[1:]) for branch in branches]
  if len(branches) == 1:
    return results[0]
  if pred is not None and len(branches) == 2:
    which = pred
  else:  # XLA's Conditional runs the last branch for an index outside [0, len(branches)).
    index, last = invals[0], len(branches) - 1
    inside = lax.bitwise_and(lax.ge(index, np.int32(0)), lax.le(index, np.int32(last)))
    which = lax.select_n(inside, lax.full_like(index, last), index)
  return [lax.select_n(which, *cases) for cases in zip(*results)]
