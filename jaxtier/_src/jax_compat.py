"""The one place where jaxtier touches JAX internals or papers over API differences.

Supported: jax >= 0.10.2 (CI) and 0.11.x (the H200 machine). Everything version- or
internals-dependent goes through the names defined here, so that a JAX upgrade breaks one
module, not many.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
from jax import extend as jex
from jax.sharding import Mesh, NamedSharding, PartitionSpec

# Jaxpr data structures (public through jax.extend since jax 0.4.3x).
Jaxpr = jex.core.Jaxpr
ClosedJaxpr = jex.core.ClosedJaxpr
JaxprEqn = jex.core.JaxprEqn
Literal = jex.core.Literal
Var = jex.core.Var
DropVar = jex.core.DropVar

def bind_eqn(eqn: Any, invals: list[Any]) -> list[Any]:
  """Evaluates one jaxpr equation on concrete or traced values; returns its outputs as a list.

  Mirrors `jax.core.eval_jaxpr` (equation context included): `Primitive.get_bind_params`
  returns the bind params in jax >= 0.10, and `(subfuns, params)` in older releases.
  """
  got = eqn.primitive.get_bind_params(eqn.params)
  if isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], (list, tuple)):
    subfuns, params = got
  else:
    subfuns, params = (), got
  ctx = getattr(getattr(eqn, "ctx", None), "manager", None)
  if ctx is not None:
    with ctx:
      out = eqn.primitive.bind(*subfuns, *invals, **params)
  else:
    out = eqn.primitive.bind(*subfuns, *invals, **params)
  return list(out) if eqn.primitive.multiple_results else [out]


def eval_jaxpr(jaxpr: Any, consts: Sequence[Any], args: Sequence[Any],
               override: "Callable[[int, Any, list[Any], Callable[[Any], Any]], Any] | None"
               = None) -> list[Any]:
  """The outputs of open `jaxpr` on `args` (its consts `consts`), each equation bound in turn
  (`bind_eqn`), as `jax.core.eval_jaxpr`. `override(k, eqn, invals, read)` may return the
  outputs of equation k instead (None: it is bound); `read(var)` is a value computed so far.
  """
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(v):
    return v.val if isinstance(v, Literal) else env[v]

  for k, eqn in enumerate(jaxpr.eqns):
    invals = [read(v) for v in eqn.invars]
    outs = override(k, eqn, invals, read) if override is not None else None
    if outs is None:
      outs = bind_eqn(eqn, invals)
    for v, val in zip(eqn.outvars, outs):
      if not isinstance(v, DropVar):
        env[v] = val
  return [read(v) for v in jaxpr.outvars]


def scan_counts(eqn: Any) -> tuple[int, int]:
  """(number of consts, number of carries) of a `scan` equation.

  jax <= 0.10 keeps them as params `num_consts` / `num_carry`; jax 0.11 keeps the flat tree
  structures `ft_in` (consts, carry, xs) and `ft_out` (carry, ys) instead.
  """
  params = eqn.params
  if "num_consts" in params:
    return int(params["num_consts"]), int(params["num_carry"])
  consts, carry, _ = params["ft_in"].unpack()
  return len(consts), len(carry)


def inner_jaxpr(eqn: Any) -> "ClosedJaxpr | Jaxpr | None":
  """The body of a call-like equation whose outputs are a pure function of its inputs.

  Covers `pjit` (named `jit` in newer JAX), `closed_call`, `core_call`, `custom_jvp_call` and
  `custom_vjp_call`. Returns None for any other primitive.
  """
  name = eqn.primitive.name
  params = eqn.params
  if name in ("pjit", "jit", "closed_call", "core_call", "remat", "checkpoint"):
    return params.get("jaxpr") or params.get("call_jaxpr")
  if name in ("custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"):
    return params.get("call_jaxpr") or params.get("fun_jaxpr")
  return None


# jax.checkpoint's primitive: named 'remat2' in jax 0.10, 'checkpoint' in 0.11.
_CHECKPOINT_NAMES = ("remat2", "checkpoint", "remat")


def call_body(eqn: Any) -> "ClosedJaxpr | Jaxpr | None":
  """The body of a call-like equation (`inner_jaxpr`) or of a jax.checkpoint equation, whose
  outvars are the equation's outvars in order; None for any other primitive."""
  inner = inner_jaxpr(eqn)
  if inner is None and eqn.primitive.name in _CHECKPOINT_NAMES:
    inner = eqn.params.get("jaxpr")
  return inner


def open_jaxpr(j: Any) -> tuple[Any, list[Any]]:
  """(jaxpr, consts) for a ClosedJaxpr or an open Jaxpr (which then has no consts)."""
  if isinstance(j, ClosedJaxpr):
    return j.jaxpr, list(j.consts)
  return j, []


def memory_space(kind: str) -> Any:
  """`jax.memory.Space` member for a memory kind name ('device' or 'pinned_host')."""
  return {"device": jax.memory.Space.Device, "pinned_host": jax.memory.Space.Host}[kind]


def memory_space_of(x: Any) -> Any:
  """`jax.memory.Space` of an array or traced value (its aval's memory space; Device if none)."""
  return getattr(jax.typeof(x), "memory_space", jax.memory.Space.Device)


def explicit_axes(x: Any) -> tuple[str, ...]:
  """The axes of array `x`'s mesh that are `jax.sharding.AxisType.Explicit` (sharding in
  types: `jax.make_mesh`'s default in recent jax), () when none or on a jax without them."""
  mesh = getattr(getattr(x, "sharding", None), "mesh", None)
  types = getattr(mesh, "axis_types", None)
  explicit = getattr(getattr(jax.sharding, "AxisType", None), "Explicit", None)
  if not types or explicit is None:
    return ()
  return tuple(n for n, t in zip(mesh.axis_names, types) if t == explicit)


def common_mesh(trees: Any) -> "Mesh | None":
  """The largest mesh among the `NamedSharding`s of the arrays in `trees` (None if there is none)."""
  best = None
  for x in jax.tree_util.tree_leaves(trees):
    sh = getattr(x, "sharding", None)
    if isinstance(sh, NamedSharding) and (best is None or sh.mesh.size > best.size):
      best = sh.mesh
  return best


def named_sharding(x: Any, memory_kind: str, mesh: "Mesh | None" = None) -> NamedSharding:
  """A `NamedSharding` for array `x` in `memory_kind`, keeping x's mesh and spec.

  Only `NamedSharding` carries the memory kind into JAX's types. Another sharding (what `jnp`
  arrays get by default, e.g. an optimizer's step count) becomes replicated over `mesh` (the
  state's mesh, from `common_mesh`) or, without one, a one-device mesh on x's device (a numpy
  array: this process's first device; `jax.devices()[0]` belongs to process 0 under
  `jax.distributed`, where another process's data put there would silently leave it).
  """
  sharding = getattr(x, "sharding", None)
  if isinstance(sharding, NamedSharding):
    return sharding.with_memory_kind(memory_kind)
  if mesh is None:
    if sharding is not None and len(sharding.device_set) == 1:
      device = next(iter(sharding.device_set))
    else:
      device = jax.local_devices()[0]
    mesh = Mesh([device], ("_jaxtier",))
  return NamedSharding(mesh, PartitionSpec(), memory_kind=memory_kind)


def platform_of(x: Any) -> str:
  """'cpu', 'gpu' or 'tpu' for a jax.Array's devices (default backend for other values)."""
  sharding = getattr(x, "sharding", None)
  if sharding is not None:
    return next(iter(sharding.device_set)).platform
  return jax.default_backend()


# Call-like primitives whose body is a pure function of the inputs: inlining them changes no
# value. remat/checkpoint is excluded (it carries the user's memory policy).
_INLINABLE = frozenset({"pjit", "jit", "closed_call", "core_call", "custom_jvp_call",
                        "custom_vjp_call", "custom_vjp_call_jaxpr"})


def inline_calls(closed: Any) -> Any:
  """Re-traces `closed` (a ClosedJaxpr) with nested pure calls (jit, custom_jvp/vjp) inlined,
  dead equations dropped (`dce`).

  Also forwards scan outputs that are inputs passed through unchanged (Flax's `nnx.scan` and
  a remat'ed layer stack hand the stacked params back out of the scan): their users read the
  input itself, so an optimizer update reads the param leaf, not an equal copy of it.

  Why: libraries wrap tree-wide helpers in `jax.jit` (optax's bias correction on jax 0.11 is one
  `jit` over every moment leaf at once). Dataflow per leaf needs per-leaf equations, so the
  calls are flattened into their primitives. Custom derivative rules are dropped, which is
  harmless here: the traced train step already contains its gradients and is not
  differentiated again. A `cond` whose branch index is a literal becomes that branch. Other
  control flow (scan, while, cond) and remat are kept as they are.
  """
  jaxpr, consts = closed.jaxpr, list(closed.consts)

  def eval_inlined(j, cs, args):
    return eval_jaxpr(j, cs, args, inline)

  def inline(k, eqn, invals, read):
    del k, read
    inner = inner_jaxpr(eqn) if eqn.primitive.name in _INLINABLE else None
    if eqn.primitive.name == "cond" and isinstance(eqn.invars[0], Literal):
      # A branch index known at trace time (optax.MultiSteps' default predicate): only
      # that branch runs, so it is the program (lax.cond clamps the index the same way).
      branches = eqn.params["branches"]
      b = min(max(int(eqn.invars[0].val), 0), len(branches) - 1)
      return eval_inlined(branches[b].jaxpr, list(branches[b].consts), invals[1:])
    if inner is not None:
      ij, ic = open_jaxpr(inner)
      offset = len(invals) - len(ij.invars)
      return eval_inlined(ij, ic, invals[offset:]) if offset >= 0 else None
    if eqn.primitive.name == "scan":
      return _forward_scan_passthrough(eqn, invals, bind_eqn(eqn, invals))
    return None

  avals = [jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype) for v in jaxpr.invars]
  inlined = jax.make_jaxpr(lambda *args: eval_inlined(jaxpr, consts, list(args)))(*avals)
  return dce(inlined)


def dce(closed: Any) -> Any:
  """`closed` without the equations no output depends on (and no effect needs), every input
  kept: as jax.jit drops them, so that a value the step computes and never returns (a metric
  left unused) does not read as a use of a state leaf."""
  from jax._src.interpreters import partial_eval as pe  # pylint: disable=g-import-not-at-top
  jaxpr = closed.jaxpr
  pruned, _ = pe.dce_jaxpr(jaxpr, [True] * len(jaxpr.outvars), instantiate=True)
  if len(pruned.eqns) == len(jaxpr.eqns):
    return closed
  return type(closed)(pruned, list(closed.consts))


def _forward_scan_passthrough(eqn: Any, invals: list[Any], outs: list[Any]) -> list[Any]:
  """`outs` of a scan with each output that is an input passed through replaced by that input.

  A carry returned unchanged by the body equals its initial value; a `ys` output that is the
  body's `xs` slice unchanged equals the whole `xs` (scan stacks slice i at index i, in either
  direction).
  """
  body = eqn.params["jaxpr"].jaxpr
  nc, nk = scan_counts(eqn)
  pos = {v: i for i, v in enumerate(body.invars)}
  outs = list(outs)
  for k, ov in enumerate(body.outvars):
    i = pos.get(ov) if isinstance(ov, Var) else None
    if i is None:
      continue
    if (k < nk and i == nc + k) or (k >= nk and i >= nc + nk):
      outs[k] = invals[i]
  return outs


def memory_kind_of(x: Any) -> "str | None":
  """The memory kind of an array's (or aval's) sharding, None if it has none."""
  return getattr(getattr(x, "sharding", None), "memory_kind", None)


# XLA options the installed jaxlib refused by name ("No such compile option"): an XLA flag is
# renamed or removed between releases (jax 0.11's CPU backend has no
# `xla_cpu_use_fusion_emitters`, which jax 0.10's has).
_UNKNOWN_COMPILE_OPTIONS: set[str] = set()


def known_compile_options(options: dict[str, Any]) -> dict[str, Any]:
  """`options` less those this jaxlib's XLA refused by name earlier in this process."""
  return {k: v for k, v in options.items() if k not in _UNKNOWN_COMPILE_OPTIONS}


def compile_with_options(lowered: Any, options: dict[str, Any]) -> Any:
  """`lowered.compile(compiler_options=options)`, dropping each option this jaxlib's XLA does
  not know (said by its INVALID_ARGUMENT error "No such compile option: 'name'") and trying
  again; later calls leave it out from the start (`known_compile_options`).

  Raises:
    whatever `Lowered.compile` raises for any other reason.
  """
  import re  # pylint: disable=g-import-not-at-top
  options = known_compile_options(options)
  while True:
    try:
      return lowered.compile(compiler_options=options or None)
    except Exception as e:  # pylint: disable=broad-except  (jaxlib's error types vary)
      unknown = re.search(r"No such compile option: '([^']+)'", str(e))
      if unknown is None or unknown.group(1) not in options:
        raise
      _UNKNOWN_COMPILE_OPTIONS.add(unknown.group(1))
      options = known_compile_options(options)
