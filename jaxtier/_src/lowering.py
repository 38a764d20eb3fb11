"""Lowering: the traced step rewritten so that its host-resident leaves are served by plan.

Every equation of the traced step that does not touch a host leaf is re-bound as traced (the
forward, the backward, the scalar bookkeeping). Each elementwise component that updates host
leaves becomes one `host_update` custom call, in place on the donated host buffers. Leaves
placed `host_xla` are copied to the device at the start of the step (XLA's memory-kind
transfer) and their new values go back to pinned_host through the output shardings.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.planner import HOST_XLA, Plan
from jaxtier._src.primitives import host_update as hu
from jaxtier._src.program_compiler import CompiledComponent


def rewrite(closed_jaxpr: Any, plan: Plan, compiled: Sequence[CompiledComponent],
            shardings: "Sequence[Any] | None" = None
            ) -> Callable[[list[Any], list[Any], list[Any]], tuple[list[Any], list[Any]]]:
  """Returns `run(state_leaves, master_leaves, arg_leaves) -> (out_leaves, new_masters)`.

  `master_leaves` are ordered like `master_indices(compiled)`; `out_leaves` are the step's
  flattened outputs (new state leaves first, then metrics). `shardings` (one `NamedSharding`
  per state leaf) lets a component whose leaves are sharded over a mesh run per shard: each
  device updates its own shard of the host buffers (`shard_map`), with no all-gather.
  """
  jaxpr, consts = closed_jaxpr.jaxpr, list(closed_jaxpr.consts)
  skip = {k for cc in compiled for k in cc.component.eqns}
  xla_host = [l.index for l in plan.leaves if l.placement == HOST_XLA]
  masters = master_indices(compiled)

  def run(state_leaves, master_leaves, arg_leaves):
    env: dict[Any, Any] = {}
    invals = list(state_leaves) + list(arg_leaves)
    for i in xla_host:
      invals[i] = jax.device_put(invals[i], jc.memory_space("device"))
    env.update(zip(jaxpr.invars, invals))
    env.update(zip(jaxpr.constvars, consts))
    master_of = dict(zip(masters, master_leaves))

    def read(v):
      return v.val if isinstance(v, jc.Literal) else env[v]

    for k, eqn in enumerate(jaxpr.eqns):
      if k in skip:
        continue
      outs = jc.bind_eqn(eqn, [read(v) for v in eqn.invars])
      for v, val in zip(eqn.outvars, outs):
        if not isinstance(v, jc.DropVar):
          env[v] = val
    new_masters: dict[int, Any] = {}
    for cc in compiled:
      operands = []
      for spec in cc.operands:
        if spec.kind == "host":
          x = state_leaves[spec.index]
        elif spec.kind == "master":
          x = master_of[spec.index]
        elif spec.kind == "const":
          x = jnp.asarray(spec.value)
        else:
          x = read(spec.var)
        if jnp.dtype(x.dtype) not in hu.SUPPORTED_DTYPES:
          x = jnp.asarray(x).astype(jnp.float32)
        operands.append(x)
      outs = _call(cc, operands, shardings)
      for r, val in zip(cc.results, outs):
        for j in r.outputs:
          env[jaxpr.outvars[j]] = val
        if r.master >= 0:
          new_masters[r.master] = val
    out_leaves = [read(v) for v in jaxpr.outvars]
    return out_leaves, [new_masters[i] for i in masters]

  return run


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


def _split_top(text: str) -> list[str]:
  """Splits `text` at commas that are not inside (), [] or {}."""
  parts, depth, cur = [], 0, []
  for ch in text:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return [p.strip() for p in parts]


def _host_parameters(hlo_text: str) -> set[int]:
  """Entry parameter numbers whose layout is in the host memory space S(5)."""
  m = re.search(r"entry_computation_layout=\{\((.*?)\)->", hlo_text)
  if not m:
    return set()
  params = _split_top(re.sub(r"/\*.*?\*/", "", m.group(1)))
  return {k for k, p in enumerate(params) if "S(5)" in p}


def hlo_violations(hlo_text: str, target: str = hu.TARGET) -> list[str]:
  """What in compiled HLO moves or computes on a host operand before a `target` custom call.

  The alarm for XLA's undocumented behaviour on host operands (../shared/MEASURED.md): a
  pinned_host leaf must reach the custom call as the entry parameter itself. For each operand
  of each `target` call in the entry computation, follow its producers back through copy,
  copy-start/-done, slice, dynamic-slice, bitcast and fusion instructions: reaching an entry
  parameter in the host memory space (S(5)) through any of them is a violation. Any host
  compute (`_xla_compute_type="host"`) in the entry computation is one too.

  Returns:
    Human-readable violations; empty when clean, or a single line when no `target` call exists.
  """
  host_params = _host_parameters(hlo_text)
  defs: dict[str, str] = {}
  calls: list[tuple[str, list[str]]] = []
  bad: list[str] = []
  in_entry = False
  for line in hlo_text.splitlines():
    s = line.strip()
    if s.startswith("ENTRY"):
      in_entry = True
      continue
    if in_entry and s == "}":
      in_entry = False
    if not in_entry or " = " not in s:
      continue
    lhs, rhs = s.split(" = ", 1)
    name = lhs.replace("ROOT", "").strip().lstrip("%")
    defs[name] = rhs
    if "_xla_compute_type" in rhs:
      bad.append(f"{name}: host compute in the entry computation")
    if f'custom_call_target="{target}"' in rhs:
      calls.append((name, _operands(rhs)))

  def opcode(rhs: str) -> str:
    m = _OPCODE.search(rhs)
    return m.group(1) if m else "?"

  def host_source(name: str, depth: int = 0) -> bool:
    rhs = defs.get(name, "")
    op = opcode(rhs)
    if op == "parameter":
      num = re.search(r"parameter\((\d+)\)", rhs)
      return ("S(5)" in rhs.split(" parameter(")[0]) or (
          num is not None and int(num.group(1)) in host_params)
    if depth > 8 or op not in _MOVES:
      return False
    return any(host_source(a, depth + 1) for a in _operands(rhs))

  for name, args in calls:
    for a in args:
      op = opcode(defs.get(a, ""))
      if op in _MOVES and host_source(a):
        bad.append(f"{name}: operand {a} is produced by `{op}` from a host parameter")
  if not calls:
    bad.append(f"no custom call to {target} in the entry computation")
  return bad


_MOVES = frozenset({"copy", "copy-start", "copy-done", "dynamic-slice", "slice", "bitcast",
                    "fusion", "get-tuple-element", "reshape", "transpose", "convert"})


_OPCODE = re.compile(r"(?:^|\s)([a-z][a-z0-9\-]*)\(")


def _operands(rhs: str) -> list[str]:
  """Instruction names an HLO instruction's right-hand side reads."""
  m = _OPCODE.search(rhs)
  inner = rhs[m.end():] if m else ""
  depth, out = 1, []
  for ch in inner:
    if ch == "(":
      depth += 1
    elif ch == ")":
      depth -= 1
      if depth == 0:
        break
    out.append(ch)
  names = []
  for tok in _split_top("".join(out)):
    tok = re.sub(r"/\*.*?\*/", "", tok).strip()
    if tok:
      names.append(tok.split()[-1].lstrip("%"))
  return names
