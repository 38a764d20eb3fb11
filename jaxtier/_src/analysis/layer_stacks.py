"""Which state leaves are stacks of layers read one slice per iteration by a layer loop."""

from __future__ import annotations

from typing import Any

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import jaxpr_graph


def stacked_layers(jaxpr: Any, num_state: int) -> dict[int, tuple[int, int]]:
  """State leaves sliced per iteration by a top-level `scan`: {leaf index: (scan id, length)}.

  A leaf passed as a scanned-over operand (`xs`) of a scan is a stack of `length` layers (what
  Flax's `nnx.scan` / `nn.scan` make). Conversions and copies between the leaf and the scan are
  looked through. The scan id is the equation's index in the top-level jaxpr (one stage per
  scan).
  """
  j, _ = jc.open_jaxpr(jaxpr)
  origin = {v: i for i, v in enumerate(j.invars[:num_state])}
  out: dict[int, tuple[int, int]] = {}
  for k, eqn in enumerate(j.eqns):
    name = eqn.primitive.name
    if name in ("convert_element_type", "copy", "copy_p", "reduce_precision") and (
        eqn.invars[0] in origin if isinstance(eqn.invars[0], jc.Var) else False):
      origin[eqn.outvars[0]] = origin[eqn.invars[0]]
      continue
    if name != "scan":
      continue
    first_xs = sum(jc.scan_counts(eqn))
    for v in eqn.invars[first_xs:]:
      if isinstance(v, jc.Var) and v in origin and origin[v] not in out:
        out[origin[v]] = (k, int(eqn.params["length"]))
  return out


def stream_reason(jaxpr: Any, index: int) -> str:
  """Why state leaf `index` cannot be placed `host_stream` ('' when it can).

  It can when it is stacked (at least 1-d: the leading axis is the layer) and every top-level
  use is either a `scan` reading it as `xs` or an elementwise equation over all its elements
  (its update, served by the fused host update).
  """
  v = jaxpr.invars[index]
  if not v.aval.shape:
    return "a scalar is not a stack of layers"
  n = jaxpr_graph.size_of(v.aval)
  scans = 0
  for eqn in jaxpr.eqns:
    pos = [p for p, x in enumerate(eqn.invars) if x is v]
    if not pos:
      continue
    name = eqn.primitive.name
    if name == "scan":
      xs = jaxpr_graph.scan_xs_positions(eqn)
      if any(p not in xs for p in pos):
        return "a `scan` reads it whole (as a constant or carry), not layer by layer"
      scans += 1
      continue
    if name in jaxpr_graph.ELEMENTWISE or name in jaxpr_graph.FLAT_IDENTITY:
      if all(jaxpr_graph.size_of(o.aval) == n for o in eqn.outvars):
        continue
    return f"`{name}` reads it whole outside a layer loop"
  return "" if scans else "no `scan` reads it layer by layer"
