"""Compiles one elementwise component of a traced step into an op program.

Input: the top-level jaxpr, a `jaxpr_graph.Component` (its equations read host leaves), and the
params whose fp32 master copy replaces them. Output: a `CompiledComponent` that says which
values become the custom call's operands (host leaves, masters, device values from the rest of
the step, constants), which results it produces (and which of them alias an operand, i.e. are
written in place), and the `Program` itself. Only avals are used, so the planner can compile at
plan time and fall back to XLA for a component the executors cannot run.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import jaxpr_graph
from jaxtier._src.primitives.host_update import BINARY, SUPPORTED_DTYPES, Op, Program, restrict

_UNARY = {
    "neg": Op.NEG, "abs": Op.ABS, "sqrt": Op.SQRT, "rsqrt": Op.RSQRT, "exp": Op.EXP,
    "log": Op.LOG, "tanh": Op.TANH, "logistic": Op.LOGISTIC, "sign": Op.SIGN, "floor": Op.FLOOR,
    "ceil": Op.CEIL, "log1p": Op.LOG1P, "expm1": Op.EXPM1, "sin": Op.SIN, "cos": Op.COS,
    "not": Op.NOT, "erf": Op.ERF, "is_finite": Op.ISFINITE,
}
_BINARY = {
    "add": Op.ADD, "sub": Op.SUB, "mul": Op.MUL, "div": Op.DIV, "max": Op.MAX, "min": Op.MIN,
    "pow": Op.POW, "atan2": Op.ATAN2, "gt": Op.GT, "ge": Op.GE, "lt": Op.LT, "le": Op.LE,
    "eq": Op.EQ, "ne": Op.NE, "and": Op.AND, "or": Op.OR, "rem": Op.REM,
}
_IDENTITY = frozenset({"convert_element_type", "copy", "copy_p", "reduce_precision",
                       "stop_gradient", "optimization_barrier", "reshape", "squeeze",
                       "expand_dims", "broadcast_in_dim"})


class Unsupported(ValueError):
  """The component contains an operation the op program cannot express."""


@dataclasses.dataclass(frozen=True)
class OperandSpec:
  """Where one operand of the custom call comes from.

  kind: 'host' (state leaf `index`, in pinned_host), 'master' (the fp32 master of param leaf
  `index`), 'value' (jaxpr value `var` computed on device or a state/arg leaf), or 'const'
  (the concrete array `value`).
  """

  kind: str
  index: int = -1
  var: Any = None
  value: Any = None


@dataclasses.dataclass(frozen=True)
class ResultSpec:
  """One result: the top-level outvar indices it provides (`outputs`), or the master of leaf
  `master` (-1 if none); its shape and dtype; `alias`: operand index it overwrites, or -1."""

  outputs: tuple[int, ...]
  master: int
  shape: tuple[int, ...]
  dtype: Any
  alias: int


@dataclasses.dataclass(frozen=True)
class CompiledComponent:
  """A component ready to run: its program, operands, results and executor.

  `executor` is 'host_dha', 'host_cpu' or 'split' (with `dha_fraction` of the elements on the
  DHA kernel); `dha_grid` is the share of the device's thread blocks the kernel takes in a layer
  call (`host_update_layer`), beside the compute. The planner sets them.
  """

  component: jaxpr_graph.Component
  program: Program
  operands: tuple[OperandSpec, ...]
  results: tuple[ResultSpec, ...]
  executor: str = "host_dha"
  dha_fraction: float = 0.5
  dha_grid: float = 1.0


@dataclasses.dataclass(frozen=True)
class Call:
  """One `host_update` custom call of a component.

  `program` reads `operands` (indices into the component's operands, in call order) and stores
  `results` (indices into its results); `aliases[k]` is the call operand that result k
  overwrites in place, or -1. `ordered` says the call must run after the component's previous
  call (which reads the operands this one overwrites): the lowering hands it one element of
  that call's first result as an extra operand it does not read.
  """

  program: Program
  operands: tuple[int, ...]
  results: tuple[int, ...]
  aliases: tuple[int, ...]
  ordered: bool = False


def is_host_result(cc: CompiledComponent, k: int) -> bool:
  """Whether result k of `cc` lands in pinned_host (a host leaf or an fp32 master, in place)."""
  r = cc.results[k]
  return r.master >= 0 or (r.alias >= 0 and cc.operands[r.alias].kind in ("host", "master"))


def calls_of(cc: CompiledComponent) -> tuple[Call, ...]:
  """The custom calls that run `cc`: one, or two where its results go to both memory kinds.

  XLA gives all results of one custom call the memory space of its host results, so a device
  result (a device param's new value) beside them would come out in pinned_host and be copied
  up: pinned bytes beyond the state, and a second copy of the param on the device. Such a
  component runs as two calls of the same program, each restricted to its results
  (`host_update.restrict`): first the device results, written in place over a device operand
  of the same shape and dtype that the second call does not read (the param itself, for
  AdamW) where there is one; then the host results, in place in pinned_host, ordered after the
  first because they overwrite host operands it reads. The device call reads those host
  operands once more over the link.
  """
  everything = tuple(range(len(cc.results)))
  host = tuple(k for k in everything if is_host_result(cc, k))
  device = tuple(k for k in everything if k not in host)
  if not host or not device:
    return (Call(cc.program, tuple(range(len(cc.operands))), everything,
                 tuple(r.alias for r in cc.results)),)
  host_program, host_reads = restrict(cc.program, host,
                                      also=[cc.results[k].alias for k in host])
  device_program, device_reads = restrict(cc.program, device)
  taken: set[int] = set()
  device_aliases = []
  for k in device:
    r = cc.results[k]
    target = -1
    for pos, i in enumerate(device_reads):
      spec = cc.operands[i]
      aval = getattr(spec.var, "aval", None)
      if (spec.kind == "value" and aval is not None and i not in host_reads
          and pos not in taken and tuple(aval.shape) == tuple(r.shape)
          and np.dtype(aval.dtype) == np.dtype(r.dtype)):
        target = pos
        break
    if target >= 0:
      taken.add(target)
    device_aliases.append(target)
  host_aliases = tuple(host_reads.index(cc.results[k].alias) for k in host)
  return (Call(device_program, tuple(device_reads), device, tuple(device_aliases)),
          Call(host_program, tuple(host_reads), host, host_aliases, ordered=True))


class _Emitter:
  """Emits instructions over virtual registers; `finish` allocates physical registers."""

  def __init__(self, n: int):
    self.n = n
    self.code: list[list[int]] = []
    self.consts: list[float] = []
    self.next_vreg = 0

  def vreg(self) -> int:
    self.next_vreg += 1
    return self.next_vreg - 1

  def const(self, value: float) -> int:
    value = float(np.float32(value))
    key = np.float32(value).tobytes()
    idx = next((k for k, c in enumerate(self.consts) if np.float32(c).tobytes() == key), None)
    if idx is None:
      self.consts.append(value)
      idx = len(self.consts) - 1
    r = self.vreg()
    self.code.append([Op.CONST, r, idx, 0, 0])
    return r

  def op(self, op: int, *srcs: int) -> int:
    r = self.vreg()
    srcs = list(srcs) + [0] * (3 - len(srcs))
    self.code.append([int(op), r, *srcs])
    return r


def _emit_integer_pow(em: _Emitter, x: int, y: int) -> int:
  if y == 0:
    return em.const(1.0)
  base, e, acc = x, abs(y), None
  while e:
    if e & 1:
      acc = base if acc is None else em.op(Op.MUL, acc, base)
    e >>= 1
    if e:
      base = em.op(Op.MUL, base, base)
  if y < 0:
    acc = em.op(Op.DIV, em.const(1.0), acc)
  return acc


def _is_int(aval: Any) -> bool:
  """Integer (not boolean) values."""
  return np.issubdtype(np.dtype(aval.dtype), np.integer)


def _trunc(em: _Emitter, x: int) -> int:
  """Rounds toward zero (XLA's float -> int conversion and integer division)."""
  return em.op(Op.MUL, em.op(Op.SIGN, x), em.op(Op.FLOOR, em.op(Op.ABS, x)))


def _emit_eqn(em: _Emitter, eqn: Any, ins: list[int]) -> list[int]:
  """Instructions for one equation; `ins` are the registers of its inputs.

  Integer values live in the fp32 registers too (exact for magnitudes below 2**24, integer
  division included): conversions to an integer type and integer division truncate toward
  zero; bitwise ops on integers are refused.
  """
  name = eqn.primitive.name
  if name in ("and", "or", "not") and any(_is_int(v.aval) for v in eqn.invars):
    raise Unsupported(f"`{name}` is bitwise on {eqn.invars[0].aval.dtype}")
  if name in _UNARY:
    return [em.op(_UNARY[name], ins[0])]
  if name == "div" and _is_int(eqn.outvars[0].aval):
    return [_trunc(em, em.op(Op.DIV, ins[0], ins[1]))]
  if name in _BINARY:
    return [em.op(_BINARY[name], ins[0], ins[1])]
  if name == "integer_pow":
    return [_emit_integer_pow(em, ins[0], int(eqn.params["y"]))]
  if name == "square":
    return [em.op(Op.MUL, ins[0], ins[0])]
  if name == "exp2":
    return [em.op(Op.EXP, em.op(Op.MUL, ins[0], em.const(math.log(2.0))))]
  if name == "round":
    if int(eqn.params.get("rounding_method", 0)) != 0:
      raise Unsupported("`round` to nearest even")
    return [em.op(Op.ROUND, ins[0])]
  if name == "select_n":  # select_n(which, *cases): cases[which], `which` bool or int.
    which, cases = ins[0], ins[1:]
    if len(cases) == 1:
      return [cases[0]]
    out = em.op(Op.SELECT, which, cases[0], cases[1])
    for k, case in enumerate(cases[2:], start=2):
      out = em.op(Op.SELECT, em.op(Op.EQ, which, em.const(k)), out, case)
    return [out]
  if name == "clamp":
    return [em.op(Op.CLAMP, ins[0], ins[1], ins[2])]
  if name == "convert_element_type":
    new = np.dtype(eqn.params["new_dtype"])
    if new == np.bool_:
      return [em.op(Op.NE, ins[0], em.const(0.0))]
    if np.issubdtype(new, np.integer):
      if np.issubdtype(new, np.unsignedinteger) or new.itemsize > 4:
        raise Unsupported(f"conversion to {new.name}")
      return [ins[0] if _is_int(eqn.invars[0].aval) else _trunc(em, ins[0])]
    if not (np.issubdtype(new, np.floating) or new.name == "bfloat16"):
      raise Unsupported(f"conversion to {new.name}")
    return [ins[0]]
  if name in _IDENTITY:
    return list(ins[:len(eqn.outvars)])
  raise Unsupported(f"`{name}` has no op-program form")


def _allocate(code: list[list[int]], num_vregs: int) -> tuple[np.ndarray, int]:
  """Maps virtual registers to at most MAX_REGISTERS physical ones (linear scan)."""
  last_use = [-1] * num_vregs
  for k, (op, dst, a, b, c) in enumerate(code):
    for src in _sources(op, a, b, c):
      last_use[src] = k
  free: list[int] = []
  phys: dict[int, int] = {}
  used = 0
  out = []
  for k, (op, dst, a, b, c) in enumerate(code):
    srcs = _sources(op, a, b, c)
    mapped = [phys[s] for s in srcs]
    for s in set(srcs):
      if last_use[s] == k:
        free.append(phys[s])
    if op == Op.STORE:
      out.append([op, dst, mapped[0], 0, 0])
      continue
    if free:
      p = free.pop()
    else:
      p, used = used, used + 1
    phys[dst] = p
    if last_use[dst] < 0:  # dead value (e.g. a DropVar-like intermediate): free at once.
      free.append(p)
    if op in (Op.LOAD, Op.CONST):
      out.append([op, p, a, 0, 0])
    else:
      mapped += [0] * (3 - len(mapped))
      out.append([op, p, *mapped])
  return np.asarray(out, dtype=np.int32).reshape(-1, 5), used


def _sources(op: int, a: int, b: int, c: int) -> list[int]:
  if op in (Op.LOAD, Op.CONST):
    return []
  if op in (Op.STORE, Op.COPY) or 10 <= op < 40:
    return [a]
  if op in BINARY:
    return [a, b]
  return [a, b, c]


def compile_component(jaxpr: Any, consts: list[Any], comp: jaxpr_graph.Component,
                      masters: frozenset[int], host_leaves: frozenset[int]) -> CompiledComponent:
  """Compiles `comp` (an elementwise component of `jaxpr`) into a `CompiledComponent`.

  Args:
    jaxpr: the traced step (open jaxpr; its first invars are the state leaves).
    consts: values of `jaxpr.constvars`.
    comp: the component.
    masters: state-leaf indices of params served through an fp32 master copy.
    host_leaves: state-leaf indices placed in pinned_host and updated by the program.

  Raises:
    Unsupported: an operation or dtype the executors cannot run.
    ProgramTooLarge: over the executors' limits.
  """
  em = _Emitter(comp.size)
  operands: list[OperandSpec] = []
  operand_of: dict[Any, int] = {}
  const_of = dict(zip(jaxpr.constvars, consts))
  invar_index = {v: i for i, v in enumerate(jaxpr.invars)}
  reg: dict[Any, int] = {}

  def operand(key: Any, spec: OperandSpec) -> int:
    if key not in operand_of:
      operands.append(spec)
      operand_of[key] = len(operands) - 1
    return operand_of[key]

  def load_outer(v: Any) -> int:
    """Register holding top-level value `v` (a Literal, a const, a leaf or a device value)."""
    if isinstance(v, jc.Literal):
      return em.const(float(np.asarray(v.val)))
    if v in reg:
      return reg[v]
    if v in const_of and np.size(const_of[v]) == 1:
      r = em.const(float(np.asarray(const_of[v]).reshape(())))
    else:
      i = invar_index.get(v, -1)
      if i in host_leaves:
        idx = operand(("host", i), OperandSpec("host", index=i))
      elif i in masters:
        idx = operand(("master", i), OperandSpec("master", index=i))
      elif v in const_of:
        idx = operand(v, OperandSpec("const", value=np.asarray(const_of[v])))
      else:
        idx = operand(v, OperandSpec("value", var=v, index=i))
      r = em.op(Op.LOAD, idx)
      em.code[-1][2] = idx
    reg[v] = r
    return r

  def emit_jaxpr(inner: Any, inner_consts: list[Any], in_regs: list[int]) -> list[int]:
    env = dict(zip(inner.invars, in_regs))
    for cv, cval in zip(inner.constvars, inner_consts):
      if np.size(cval) != 1:
        raise Unsupported("a non-scalar constant inside a nested call")
      env[cv] = em.const(float(np.asarray(cval).reshape(())))

    def read(v):
      return em.const(float(np.asarray(v.val))) if isinstance(v, jc.Literal) else env[v]

    for eqn in inner.eqns:
      outs = _emit_nested(eqn, [read(v) for v in eqn.invars])
      for v, r in zip(eqn.outvars, outs):
        env[v] = r
    return [read(v) for v in inner.outvars]

  def _emit_nested(eqn: Any, ins: list[int]) -> list[int]:
    inner = jaxpr_graph.bodies(eqn)
    if inner is not None:
      subs, offset = inner
      if offset < 0:
        raise Unsupported(f"`{eqn.primitive.name}` layout")
      outs = [emit_jaxpr(sub, sub_consts, ins[offset:]) for sub, sub_consts in subs]
      if len(outs) == 1:  # a call, or a `cond` with a static branch index.
        return outs[0]
      index = ins[0]  # `cond` on a traced index: every branch, selected per element.
      picked = list(outs[0])
      for k, branch in enumerate(outs[1:], start=1):
        which = index if len(outs) == 2 else em.op(Op.EQ, index, em.const(k))
        picked = [em.op(Op.SELECT, which, a, b) for a, b in zip(picked, branch)]
      return picked
    for v in eqn.outvars:
      if not isinstance(v, jc.DropVar) and jaxpr_graph.size_of(v.aval) not in (comp.size, 1):
        raise Unsupported(f"`{eqn.primitive.name}` produces {jaxpr_graph.size_of(v.aval)} "
                          f"elements, not {comp.size}")
    return _emit_eqn(em, eqn, ins)

  for k in comp.eqns:
    eqn = jaxpr.eqns[k]
    outs = _emit_nested(eqn, [load_outer(v) for v in eqn.invars])
    for v, r in zip(eqn.outvars, outs):
      if not isinstance(v, jc.DropVar):
        reg[v] = r

  # Results: each distinct value the rest of the program needs from this component.
  results: list[ResultSpec] = []
  by_var: dict[Any, list[int]] = {}
  for j in comp.outputs:
    by_var.setdefault(jaxpr.outvars[j], []).append(j)
  for v, outs in by_var.items():
    if v in invar_index:  # a leaf passed through unchanged: no work for the program.
      continue
    aval = v.aval
    if np.dtype(aval.dtype) not in SUPPORTED_DTYPES:
      raise Unsupported(f"a result of dtype {np.dtype(aval.dtype).name}")
    # Here only host leaves are aliased. A device param's new value is written over its old
    # value by a call of its own (`calls_of`): beside host results, XLA gives a result their
    # host memory space.
    alias = -1
    for j in outs:
      for key in (("host", j),):
        idx = operand_of.get(key, -1)
        if idx >= 0 and alias < 0:
          src = jaxpr.invars[j].aval
          if tuple(src.shape) == tuple(aval.shape) and np.dtype(src.dtype) == np.dtype(aval.dtype):
            alias = idx
    results.append(ResultSpec(tuple(outs), -1, tuple(aval.shape), np.dtype(aval.dtype), alias))
    em.code.append([Op.STORE, len(results) - 1, reg[v], 0, 0])
    for j in outs:
      if j in masters:
        m = operand_of.get(("master", j), -1)
        if m < 0:
          raise Unsupported(f"the update of leaf {j} does not read its master copy")
        results.append(ResultSpec((), j, tuple(aval.shape), np.dtype(np.float32), m))
        em.code.append([Op.STORE, len(results) - 1, reg[v], 0, 0])
  # Value operands of non-float dtype (e.g. boolean predicates) are converted on device.
  code, num_regs = _allocate(em.code, em.next_vreg)
  program = Program(code=code, consts=np.asarray(em.consts, np.float32), num_regs=max(num_regs, 1),
                    num_operands=len(operands), num_results=len(results))
  return CompiledComponent(comp, program, tuple(operands), tuple(results))
