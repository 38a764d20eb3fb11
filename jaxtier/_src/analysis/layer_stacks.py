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
    if jaxpr_graph.elementwise_over(eqn, n):
      continue
    axis = _layer_axis(jaxpr, eqn)
    if axis:
      return (f"it is a stack of layers along axis {axis} (a `transpose` brings that axis first "
              "for the layer loop, reading the stack whole): streaming fetches layers along "
              "axis 0 only; store the stack with its layers first (MaxText: "
              "param_scan_axis=0; flax `nn.scan`: variable_axes={'params': 0})")
    return f"`{name}` reads it whole outside a layer loop"
  return "" if scans else "no `scan` reads it layer by layer"


def _layer_axis(jaxpr: Any, eqn: Any) -> int:
  """The axis a `transpose` equation brings first where its result is read only as a top-level
  scan's `xs` (a stack scanned along that axis: flax's `nn.scan` with `variable_axes` other
  than 0), else 0."""
  if eqn.primitive.name != "transpose" or eqn.params["permutation"][0] == 0:
    return 0
  out = eqn.outvars[0]
  readers = [(e, [p for p, x in enumerate(e.invars) if x is out]) for e in jaxpr.eqns]
  readers = [(e, pos) for e, pos in readers if pos]
  if not readers or any(e.primitive.name != "scan"
                        or any(p not in jaxpr_graph.scan_xs_positions(e) for p in pos)
                        for e, pos in readers):
    return 0
  return int(eqn.params["permutation"][0])


class LayerLoops:
  """The top-level equations' dataflow, for the updates run inside a layer loop
  (`update_schedule.layer_loop`): each var's producer and readers, each scan's `ys` outputs,
  and what depends on an equation."""

  def __init__(self, jaxpr: Any):
    self.jaxpr = jaxpr
    self.scan_out: dict[Any, tuple[int, int]] = {}  # ys var -> (scan eqn, outvar position)
    self.producer: dict[Any, int] = {}
    self.uses: dict[Any, list[int]] = {}
    for k, eqn in enumerate(jaxpr.eqns):
      for v in eqn.outvars:
        if isinstance(v, jc.Var):
          self.producer[v] = k
      for x in eqn.invars:
        if isinstance(x, jc.Var):
          self.uses.setdefault(x, []).append(k)
      if eqn.primitive.name == "scan":
        _, nk = jc.scan_counts(eqn)
        for pos, v in enumerate(eqn.outvars):
          if pos >= nk and isinstance(v, jc.Var) and not isinstance(v, jc.DropVar):
            self.scan_out[v] = (k, pos)
    self._tainted: dict[int, set[Any]] = {}

  def tainted(self, k: int) -> set[Any]:
    """Values that depend on what top-level equation k computes."""
    if k not in self._tainted:
      t = {v for v in self.jaxpr.eqns[k].outvars if isinstance(v, jc.Var)}
      for eqn in self.jaxpr.eqns[k + 1:]:
        if any(isinstance(x, jc.Var) and x in t for x in eqn.invars):
          t.update(v for v in eqn.outvars if isinstance(v, jc.Var))
      self._tainted[k] = t
    return self._tainted[k]
