"""The fused host update: one pass of an elementwise op program over host-resident leaves.

Custom call `jaxtier_host_update_ffi` (C++: `xla_ffi/src/host_update.cc` for the CPU handler,
`xla_ffi/src/host_update_kernels.cu` for the CUDA handler; format: docs/design.md, "Op program
format"). The lowering stage (`jaxtier/_src/lowering/rewrite.py`) compiles the elementwise part
of an
optimizer update (any optax chain of elementwise maps) into a `Program`; `host_update` runs it.

Operands are arrays of N elements (read at element i) or 1 element (broadcast scalars); results
have N elements. A result listed in `aliases` is written in place into the operand's buffer:
with a donated `pinned_host` operand this updates host memory without a copy.

Executors (attribute `executor`; on a GPU):
- `host_dha`: the CUDA kernel reads and writes the host pages directly over PCIe (direct host
  access, zero-copy).
- `host_cpu`: host CPU threads compute the update, driven from the CUDA handler (host functions
  on jaxtier's own streams); device operands and results (gradients, device params, device
  scalars) are staged through pinned buffers in pipelined chunks.
- `split`: the kernel takes elements [0, k) and the CPU [k, N) at once, k = `dha_fraction` * N
  rounded to a multiple of 256.
On the CPU backend the CPU handler runs every executor the same way (it is the host CPU
executor); the pure-JAX reference ignores the executor.

Per-layer updates inside the backward pass use two more targets of the family:
`host_update_layer` (`jaxtier_host_update_layer_ffi`) runs a program over one layer's window of
leaves stacked over layers and writes its results into the window of operands (not as XLA
results: a chain of in-place results through every layer would cost XLA's host-offload passes
one path per result per call); on a GPU its CPU and kernel parts run on jaxtier's streams
while XLA's stream goes on. `join` (`jaxtier_host_update_join_ffi`) hands the written buffers
back as results, in place, once every layer call before it is done; `release`
(`jaxtier_host_update_release_ffi`) ends the calls' reads of the values it names, so that XLA
may free them before the join. `host_update_rows` binds the
layer target over whole rows of tables (an embedding table read in place and its state): the
rows some ids name, or every other row, on the host CPUs.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src.primitives import base as ffi
from jaxtier._src.primitives.base import ffi_disabled
from jaxtier._src.vocab import Executor

TARGET = "jaxtier_host_update_ffi"
LAYER_TARGET = "jaxtier_host_update_layer_ffi"
JOIN_TARGET = "jaxtier_host_update_join_ffi"
RELEASE_TARGET = "jaxtier_host_update_release_ffi"

MAX_INSTRUCTIONS = 256
MAX_REGISTERS = 64
MAX_CONSTS = 64
MAX_OPERANDS = 32
MAX_RESULTS = 16
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))

# Executor names -> attribute `executor` (xla_ffi/src/op_program.h, enum Executor).
EXECUTORS = {Executor.HOST_DHA: 0, Executor.HOST_CPU: 1, Executor.SPLIT: 2}


class Op(enum.IntEnum):
  """Opcodes of the op program (must match `xla_ffi/src/op_program.h`)."""

  LOAD = 1
  CONST = 2
  STORE = 3
  COPY = 4
  NEG = 10
  ABS = 11
  SQRT = 12
  RSQRT = 13
  EXP = 14
  LOG = 15
  TANH = 16
  LOGISTIC = 17
  SIGN = 18
  FLOOR = 19
  CEIL = 20
  LOG1P = 21
  EXPM1 = 22
  SIN = 23
  COS = 24
  NOT = 25
  ERF = 26
  ROUND = 27
  ISFINITE = 28
  ADD = 40
  SUB = 41
  MUL = 42
  DIV = 43
  MAX = 44
  MIN = 45
  POW = 46
  ATAN2 = 47
  GT = 48
  GE = 49
  LT = 50
  LE = 51
  EQ = 52
  NE = 53
  AND = 54
  OR = 55
  REM = 56
  SELECT = 60
  CLAMP = 61


UNARY = frozenset(range(10, 29))
BINARY = frozenset(range(40, 57))
TERNARY = frozenset((60, 61))


@dataclasses.dataclass(frozen=True, kw_only=True)
class Program:
  """An op program: instructions over fp32 registers, run once per element index.

  Attributes:
    code: int32 array [num_instructions, 5] of (op, dst, a, b, c).
    consts: float32 array [num_consts] of immediates.
    num_regs: registers used (<= MAX_REGISTERS).
    num_operands: operands the program LOADs from.
    num_results: results the program STOREs to.
  """

  code: np.ndarray
  consts: np.ndarray
  num_regs: int
  num_operands: int
  num_results: int

  def __post_init__(self):
    if self.code.ndim != 2 or self.code.shape[1] != 5:
      raise ValueError(f"Program: expected code of shape [n, 5], got {self.code.shape}")
    for name, value, limit in (("instructions", len(self.code), MAX_INSTRUCTIONS),
                               ("registers", self.num_regs, MAX_REGISTERS),
                               ("constants", len(self.consts), MAX_CONSTS),
                               ("operands", self.num_operands, MAX_OPERANDS),
                               ("results", self.num_results, MAX_RESULTS)):
      if value > limit:
        raise ProgramTooLarge(f"op program needs {value} {name}; the executors allow {limit}")

  def __str__(self) -> str:
    lines = []
    for op, dst, a, b, c in self.code.tolist():
      name = Op(op).name
      if op == Op.LOAD:
        lines.append(f"r{dst} = operand[{a}]")
      elif op == Op.CONST:
        lines.append(f"r{dst} = {float(self.consts[a])!r}")
      elif op == Op.STORE:
        lines.append(f"result[{dst}] = r{a}")
      elif op == Op.COPY:
        lines.append(f"r{dst} = r{a}")
      elif op in UNARY:
        lines.append(f"r{dst} = {name.lower()}(r{a})")
      elif op in BINARY:
        lines.append(f"r{dst} = {name.lower()}(r{a}, r{b})")
      else:
        lines.append(f"r{dst} = {name.lower()}(r{a}, r{b}, r{c})")
    return "\n".join(lines)


class ProgramTooLarge(ValueError):
  """An elementwise update needs more instructions/registers/operands than the executors take."""


def host_update(program: Program, operands: Sequence[jax.Array],
                results: Sequence[jax.ShapeDtypeStruct], aliases: Sequence[int], *,
                executor: str = Executor.HOST_DHA, dha_fraction: float = 0.5) -> list[jax.Array]:
  """Runs `program` once per element over `operands`, producing `results`.

  Args:
    program: the op program (see `Program`).
    operands: arrays of dtype float32/bfloat16/float16, each with N elements or 1 (a
      broadcast scalar). Host-resident operands (memory kind `pinned_host`) are read in place.
    results: shapes and dtypes of the results; every result has N elements.
    aliases: for each result, the index of the operand whose buffer it overwrites in place
      (that operand must be donated by the enclosing jit), or -1.
    executor: who computes the update on a GPU: 'host_dha' (the CUDA kernel, zero-copy),
      'host_cpu' (host CPU threads driven from the CUDA handler) or 'split' (both at once).
      The CPU backend's handler and the pure-JAX reference compute the same either way.
    dha_fraction: for 'split', the fraction of the N elements the kernel takes (the first
      ones; rounded to a multiple of 256); the CPU takes the rest. In [0, 1]; ignored by the
      other executors.

  Returns:
    The results, as a list of arrays.

  Raises:
    ValueError: a dtype outside float32/bfloat16/float16, element counts that differ, an
      unknown executor, or a dha_fraction outside [0, 1].
  """
  n = _check(program, operands, results, aliases)
  del n
  if executor not in EXECUTORS:
    raise ValueError(f"host_update: expected executor in {tuple(EXECUTORS)}, got {executor!r}")
  try:
    fraction = float(dha_fraction)
  except (TypeError, ValueError):
    fraction = math.nan
  if not 0.0 <= fraction <= 1.0:
    raise ValueError(f"host_update: expected dha_fraction in [0, 1], got {dha_fraction!r}")
  if ffi_disabled():
    return _reference(program, operands, results)
  call = ffi.ffi_call(TARGET, tuple(results),
                      aliases={a: r for r, a in enumerate(aliases) if a >= 0})
  out = call(*operands,
             program=np.ascontiguousarray(program.code.reshape(-1), dtype=np.int32),
             consts=np.ascontiguousarray(program.consts, dtype=np.float32),
             num_regs=np.int32(program.num_regs),
             aliases=np.asarray(list(aliases), dtype=np.int32),
             executor=np.int32(EXECUTORS[executor]),
             dha_fraction=np.float32(fraction))
  return list(out)


def host_update_layer(program: Program, operands: Sequence[jax.Array], targets: Sequence[int],
                      *, offset: int, count: int, after: Sequence[jax.Array] = (),
                      executor: str = Executor.HOST_CPU, dha_fraction: float = 0.5,
                      dha_grid: float = 1.0) -> jax.Array:
  """Runs `program` over elements [offset, offset + count) and writes result r into that window
  of operand ``targets[r]``, in place; returns a token (f32[1], not written).

  The call is the per-layer host update of the backward pass: operands stacked over layers
  (``[L, ...]``, read from element `offset`), one layer's values (`count` elements, read as
  they are: the layer's gradient) and broadcast scalars (1 element). XLA sees the operands read
  and the token made, not the writes; the caller keeps them safe: every other use of a written
  window comes before the call (name its values in `after`), and the written buffers are read
  afterwards only through `join`'s results (pass the token there).

  Args:
    program: the op program; result r is stored into operand ``targets[r]``.
    operands: float32/bfloat16/float16 arrays of 1, `count`, or at least offset + count
      elements; any memory kind (pinned_host operands are used in place).
    targets: per result, the operand it is written into (a vector operand, each at most once).
    offset: first element of the window in the stacked operands (a static int).
    count: elements in the window.
    after: order-only operands: the call runs after their producers; not read.
    executor: 'host_cpu', 'split' or 'host_dha', as for `host_update`. On a GPU none holds
      XLA's stream: the CPU part runs on jaxtier's streams, the kernel part (host_dha's whole,
      the split's share) on a lowest-priority stream beside XLA's compute, whose SMs it
      shares.
    dha_fraction: the kernel's share for 'split', in [0, 1].
    dha_grid: the share of the device's resident thread blocks the kernel part runs on, in
      (0, 1]. Its blocks hold their SMs until the window is done, so a share below 1 leaves
      XLA's compute the rest (`HardwareProfile.dha_layer_grid`).

  Returns:
    The token.

  Raises:
    ValueError: a dtype outside float32/bfloat16/float16, an operand of another element count,
      a target that is not a distinct vector operand, an unknown executor, a dha_fraction
      outside [0, 1], or a dha_grid outside (0, 1].
    NotImplementedError: under `JAXTIER_DISABLE_FFI=1` (the lowering then keeps the serial
      update).
  """
  operands, targets, after = list(operands), [int(t) for t in targets], list(after)
  offset, count = int(offset), int(count)
  if len(operands) != program.num_operands or len(targets) != program.num_results:
    raise ValueError(f"host_update_layer: expected {program.num_operands} operands and "
                     f"{program.num_results} targets, got {len(operands)} and {len(targets)}")
  if offset < 0 or count < 0:
    raise ValueError(f"host_update_layer: expected offset, count >= 0, got {offset}, {count}")
  for i, x in enumerate(operands):
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
      raise ValueError(f"host_update_layer: operand {i} has dtype {x.dtype}; expected one of "
                       "float32, bfloat16, float16")
    size = int(np.prod(np.shape(x)))
    if size not in (1, count) and size < offset + count:
      raise ValueError(f"host_update_layer: operand {i} has {size} elements; expected 1, "
                       f"{count}, or at least {offset + count} (a stack holding the window)")
  sizes = [int(np.prod(np.shape(x))) for x in operands]
  if len(set(targets)) != len(targets) or any(
      not 0 <= t < len(operands) or (sizes[t] == 1 and count != 1) for t in targets):
    raise ValueError(f"host_update_layer: expected distinct vector operands as targets, got "
                     f"{targets} for operands of {sizes} elements")
  if executor not in EXECUTORS:
    raise ValueError(f"host_update_layer: expected executor in {tuple(EXECUTORS)}, got "
                     f"{executor!r}")
  if not 0.0 <= float(dha_fraction) <= 1.0:
    raise ValueError(f"host_update_layer: expected dha_fraction in [0, 1], got {dha_fraction!r}")
  if not 0.0 < float(dha_grid) <= 1.0:
    raise ValueError(f"host_update_layer: expected dha_grid in (0, 1], got {dha_grid!r}")
  if ffi_disabled():
    raise NotImplementedError("host_update_layer: needs the FFI handlers "
                              "(JAXTIER_DISABLE_FFI is set)")
  return _bind_layer(program, operands, targets, after, executor, dha_fraction,
                     f"jaxtier.host_update_layer[{offset // count if count else 0}]",
                     offset=np.int64(offset), count=np.int64(count),
                     dha_grid=np.float32(dha_grid))


def _bind_layer(program: Program, operands: list[Any], targets: list[int], after: list[Any],
                executor: str, dha_fraction: float, scope: str, ids: Any = None,
                **attrs: Any) -> jax.Array:
  call = ffi.ffi_call(LAYER_TARGET, jax.ShapeDtypeStruct((1,), jnp.float32),
                      has_side_effect=True, scope=scope)
  return call(*operands, *([] if ids is None else [ids]), *after,
              program=np.ascontiguousarray(program.code.reshape(-1), dtype=np.int32),
              consts=np.ascontiguousarray(program.consts, dtype=np.float32),
              num_regs=np.int32(program.num_regs), executor=np.int32(EXECUTORS[executor]),
              dha_fraction=np.float32(dha_fraction), targets=np.asarray(targets, dtype=np.int32),
              num_operands=np.int32(len(operands)), **attrs)


# Which rows a rows call updates (attribute `rows`, op_program.h).
ROWS = {"ids": 1, "others": 2}


def host_update_rows(program: Program, operands: Sequence[jax.Array], targets: Sequence[int], *,
                     ids: jax.Array, row_length: int, rows: str, zero: "int | None" = None,
                     after: Sequence[jax.Array] = ()) -> jax.Array:
  """Runs `program` over whole rows of tables and writes result r into those rows of operand
  ``targets[r]``, in place; returns a token (f32[1], not written), as `host_update_layer`.

  The vector operands are tables of N = V * `row_length` elements (row v at elements
  [v * row_length, (v + 1) * row_length)); `rows` picks the rows: 'ids' the distinct ids of
  `ids` in [0, V), each once, or 'others' every row that no id names. Out-of-range ids name no
  row. The call is the update of an embedding table read in place (`host_dha`): its untouched
  rows (gradient zero) updated while the step computes, the touched ones once their gradient
  rows have landed. Runs on the host CPUs (jaxtier's CPU thread pool; on a GPU from a host
  function on jaxtier's stream, after XLA's stream reaches the call, and a `join` waits for
  it), in place on host memory: on a GPU every vector operand must be `pinned_host`.

  Args:
    program: the op program; result r is stored into operand ``targets[r]``.
    operands: float32/bfloat16/float16 arrays of N or 1 elements.
    targets: per result, the operand it is written into (a distinct vector operand).
    ids: integer array (any shape, on the device or the host), cast to int32.
    row_length: elements per row (D > 0, dividing N).
    rows: 'ids' or 'others'.
    zero: with rows='ids', an operand (not a target) whose picked rows are set to zero after
      they are used: the gradient buffer a `dha.scatter_add(..., zeroed=True)` adds into,
      kept zero for the next step. It counts as written: hand it back through `join`.
    after: order-only operands: the call runs after their producers; not read.

  Returns:
    The token.

  Raises:
    ValueError: a dtype outside float32/bfloat16/float16, an operand of another element count,
      a row length that does not divide N, `rows` not 'ids' or 'others', a target that is not
      a distinct vector operand, or a `zero` operand that is a target, a scalar, or given with
      rows='others'.
    TypeError: ids that are not integers.
    NotImplementedError: under `JAXTIER_DISABLE_FFI=1`.
  """
  operands, targets, after = list(operands), [int(t) for t in targets], list(after)
  row_length = int(row_length)
  if len(operands) != program.num_operands or len(targets) != program.num_results:
    raise ValueError(f"host_update_rows: expected {program.num_operands} operands and "
                     f"{program.num_results} targets, got {len(operands)} and {len(targets)}")
  if rows not in ROWS:
    raise ValueError(f"host_update_rows: expected rows in {tuple(ROWS)}, got {rows!r}")
  sizes = [int(np.prod(np.shape(x))) for x in operands]
  count = max(sizes, default=0)
  if row_length <= 0 or count % row_length:
    raise ValueError(f"host_update_rows: expected a row length > 0 that divides the tables' "
                     f"{count} elements, got {row_length}")
  for i, x in enumerate(operands):
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
      raise ValueError(f"host_update_rows: operand {i} has dtype {x.dtype}; expected one of "
                       "float32, bfloat16, float16")
    if sizes[i] not in (1, count):
      raise ValueError(f"host_update_rows: operand {i} has {sizes[i]} elements; expected 1 or "
                       f"{count} (a whole table)")
  if len(set(targets)) != len(targets) or any(
      not 0 <= t < len(operands) or (sizes[t] == 1 and count != 1) for t in targets):
    raise ValueError(f"host_update_rows: expected distinct vector operands as targets, got "
                     f"{targets} for operands of {sizes} elements")
  if zero is not None and (rows != "ids" or zero in targets or not 0 <= zero < len(operands)
                           or sizes[zero] != count):
    raise ValueError(f"host_update_rows: expected zero to name a vector operand that is not a "
                     f"target, with rows='ids'; got zero={zero} with rows={rows!r}")
  if not jnp.issubdtype(jnp.dtype(ids.dtype), jnp.integer):
    raise TypeError(f"host_update_rows: expected integer ids, got {ids.dtype}")
  if ffi_disabled():
    raise NotImplementedError("host_update_rows: needs the FFI handlers "
                              "(JAXTIER_DISABLE_FFI is set)")
  return _bind_layer(program, operands, targets, after, Executor.HOST_CPU, 0.0,
                     f"jaxtier.host_update_rows[{rows}]", ids=jnp.reshape(ids, (-1,)).astype(
                         jnp.int32),
                     offset=np.int64(0), count=np.int64(count), rows=np.int32(ROWS[rows]),
                     row_length=np.int64(row_length),
                     zero_operand=np.int32(-1 if zero is None else zero))


def join(arrays: Sequence[jax.Array], *, after: Sequence[jax.Array] = ()) -> list[jax.Array]:
  """Hands `arrays` back, in place, once every `host_update_layer` call before it has finished.

  On a GPU XLA's stream waits here for the layer calls' work on jaxtier's streams (all of it
  issued so far on this device); on the CPU backend those calls have run already.

  Args:
    arrays: the buffers the layer calls wrote (donated by the enclosing jit); any memory kind.
    after: order-only operands: the layer calls' tokens, and every device value they read
      (kept alive until here: a GPU layer call reads them after XLA's stream has moved on).

  Returns:
    `arrays` as new values (the same buffers): read the written buffers through these.
  """
  arrays, after = list(arrays), list(after)
  if not arrays:
    return []
  # Each result has its operand's type (memory space included: a host leaf stays pinned_host).
  call = ffi.ffi_call(JOIN_TARGET, [jax.typeof(a) for a in arrays],
                      aliases={k: k for k in range(len(arrays))}, has_side_effect=True)
  return list(call(*arrays, *after))


def release(values: Sequence[jax.Array], *, after: Sequence[jax.Array] = ()) -> jax.Array:
  """Ends the layer calls' reads of `values`, so that XLA may free or reuse their buffers.

  A GPU layer call reads its operands after XLA's stream has moved on; a value it reads as it
  is (`count` elements: a layer's gradient slice) must stay alive until that read is done. On a
  GPU, XLA's stream waits here for the layer calls that read one of `values` (each value's
  calls since the last `join`; values no call read wait for nothing); on the CPU backend those
  calls have run already. The lowering issues it a layer or two after the calls, so that the
  device never holds every layer's gradient at once (`lowering/rewrite.py`).

  Args:
    values: device arrays that earlier `host_update_layer` calls read; their last use should be
      this call (or `join`).
    after: order-only operands: the release runs after their producers; not read.

  Returns:
    A token (f32[1], not written): order later work after the release with it.
  """
  values, after = list(values), list(after)
  call = ffi.ffi_call(RELEASE_TARGET, jax.ShapeDtypeStruct((1,), jnp.float32),
                      has_side_effect=True)
  return call(*values, *after, num_values=np.int32(len(values)))


def restrict(program: Program, keep: Sequence[int], also: Sequence[int] = ()
             ) -> tuple[Program, list[int]]:
  """The part of `program` that computes results `keep`, over the operands it still reads.

  Stores of the other results are dropped, then every instruction whose value no kept store
  needs (backward liveness over the registers), then the operands no remaining LOAD reads
  (except those in `also`: e.g. the operands the kept results overwrite in place).
  Result k of the new program is result `keep[k]` of `program`; the arithmetic of what is kept
  is unchanged, so each kept result has the same bits.

  Args:
    program: the op program.
    keep: indices of the results to keep, in the new program's result order.
    also: operand indices to keep even where no LOAD reads them.

  Returns:
    (the new program, `operands`): its operand j is operand `operands[j]` of `program`.

  Raises:
    ValueError: an index in `keep` that is not a result of `program`, or one kept twice.
  """
  keep = [int(k) for k in keep]
  if len(set(keep)) != len(keep) or any(not 0 <= k < program.num_results for k in keep):
    raise ValueError(f"restrict: expected distinct results in [0, {program.num_results}), "
                     f"got {keep}")
  position = {k: i for i, k in enumerate(keep)}
  live: set[int] = set()
  rows: list[list[int]] = []
  for op, dst, a, b, c in reversed(program.code.tolist()):
    if op == Op.STORE:
      if dst in position:
        live.add(a)
        rows.append([op, position[dst], a, b, c])
      continue
    if dst not in live:
      continue
    live.discard(dst)
    if op in UNARY or op == Op.COPY:
      live.add(a)
    elif op in BINARY:
      live.update((a, b))
    elif op in TERNARY:
      live.update((a, b, c))
    rows.append([op, dst, a, b, c])
  rows.reverse()
  used = sorted({a for op, _, a, _, _ in rows if op == Op.LOAD} | {int(i) for i in also})
  renumber = {old: new for new, old in enumerate(used)}
  for row in rows:
    if row[0] == Op.LOAD:
      row[2] = renumber[row[2]]
  code = np.asarray(rows, np.int32).reshape(-1, 5)
  return Program(code=code, consts=program.consts, num_regs=program.num_regs,
                 num_operands=len(used), num_results=len(keep)), used


def _check(program, operands, results, aliases) -> int:
  if len(results) != program.num_results or len(aliases) != len(results):
    raise ValueError(f"host_update: expected {program.num_results} results and aliases, got "
                     f"{len(results)} results and {len(aliases)} aliases")
  if len(operands) != program.num_operands:
    raise ValueError(f"host_update: expected {program.num_operands} operands, got {len(operands)}")
  sizes = {int(np.prod(r.shape)) for r in results}
  if len(sizes) != 1:
    raise ValueError(f"host_update: results must have one element count, got {sorted(sizes)}")
  (n,) = sizes
  for i, x in enumerate(list(operands) + list(results)):
    kind = "operand" if i < len(operands) else "result"
    if jnp.dtype(x.dtype) not in SUPPORTED_DTYPES:
      raise ValueError(f"host_update: {kind} {i} has dtype {x.dtype}; expected one of "
                       f"float32, bfloat16, float16")
    size = int(np.prod(x.shape))
    if size not in (n, 1) or (kind == "result" and size != n):
      raise ValueError(f"host_update: {kind} {i} has {size} elements, expected {n}")
  for r, a in enumerate(aliases):
    if a >= 0 and (jnp.dtype(operands[a].dtype) != jnp.dtype(results[r].dtype)
                   or operands[a].shape != tuple(results[r].shape)):
      raise ValueError(f"host_update: result {r} aliases operand {a} but their shapes/dtypes "
                       f"differ: {results[r]} vs {operands[a].shape} {operands[a].dtype}")
  return n


_UNARY_FNS = {
    Op.NEG: jnp.negative, Op.ABS: jnp.abs, Op.SQRT: jnp.sqrt, Op.RSQRT: lambda x: 1.0 / jnp.sqrt(x),
    Op.EXP: jnp.exp, Op.LOG: jnp.log, Op.TANH: jnp.tanh, Op.LOGISTIC: jax.nn.sigmoid,
    Op.SIGN: jnp.sign, Op.FLOOR: jnp.floor, Op.CEIL: jnp.ceil, Op.LOG1P: jnp.log1p,
    Op.EXPM1: jnp.expm1, Op.SIN: jnp.sin, Op.COS: jnp.cos,
    Op.NOT: lambda x: jnp.where(x == 0, 1.0, 0.0).astype(jnp.float32),
    Op.ERF: jax.scipy.special.erf, Op.ROUND: lambda x: jax.lax.round(x),
    Op.ISFINITE: lambda x: jnp.isfinite(x).astype(jnp.float32),
}
_BINARY_FNS = {
    Op.ADD: jnp.add, Op.SUB: jnp.subtract, Op.MUL: jnp.multiply, Op.DIV: jnp.divide,
    Op.MAX: jax.lax.max, Op.MIN: jax.lax.min, Op.POW: jnp.power, Op.ATAN2: jnp.arctan2,
    Op.GT: jnp.greater, Op.GE: jnp.greater_equal, Op.LT: jnp.less, Op.LE: jnp.less_equal,
    Op.EQ: jnp.equal, Op.NE: jnp.not_equal,
    Op.AND: lambda a, b: jnp.logical_and(a != 0, b != 0),
    Op.OR: lambda a, b: jnp.logical_or(a != 0, b != 0), Op.REM: jnp.fmod,
}


def _reference(program: Program, operands, results) -> list[jax.Array]:
  """Pure-JAX interpretation of `program` (the `JAXTIER_DISABLE_FFI=1` path and test oracle)."""
  n = int(np.prod(results[0].shape)) if results else 0
  # XLA computes on device memory: bring host operands over (the kill-switch path is a
  # correctness fallback, not a fast one).
  operands = [jax.device_put(x, jax.memory.Space.Device) for x in operands]
  flat = [jnp.reshape(x, (-1,)).astype(jnp.float32) for x in operands]
  regs: dict[int, jax.Array] = {}
  outs: list[jax.Array | None] = [None] * len(results)
  for op, dst, a, b, c in program.code.tolist():
    if op == Op.LOAD:
      regs[dst] = flat[a] if flat[a].shape[0] == n else jnp.broadcast_to(flat[a][0], (n,))
    elif op == Op.CONST:
      regs[dst] = jnp.full((n,), program.consts[a], jnp.float32)
    elif op == Op.STORE:
      outs[dst] = regs[a].astype(results[dst].dtype).reshape(results[dst].shape)
    elif op == Op.COPY:
      regs[dst] = regs[a]
    elif op in UNARY:
      regs[dst] = _UNARY_FNS[Op(op)](regs[a]).astype(jnp.float32)
    elif op in BINARY:
      regs[dst] = _BINARY_FNS[Op(op)](regs[a], regs[b]).astype(jnp.float32)
    elif op == Op.SELECT:
      regs[dst] = jnp.where(regs[a] != 0, regs[c], regs[b])
    elif op == Op.CLAMP:
      regs[dst] = jnp.minimum(jnp.maximum(regs[b], regs[a]), regs[c])
    else:
      raise ValueError(f"host_update: unknown opcode {op}")
  missing = [i for i, o in enumerate(outs) if o is None]
  if missing:
    raise ValueError(f"host_update: program never stores results {missing}")
  return outs  # type: ignore[return-value]
