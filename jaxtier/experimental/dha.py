"""DHA compute: GPU kernels that read a host-resident leaf in place (gather, matmul).

Custom calls `jaxtier_dha_gather_ffi` and `jaxtier_dha_matmul_ffi` (C++: `xla_ffi/src/dha.cc` for
the CPU handlers, `xla_ffi/src/dha_kernels.cu` for the CUDA handlers; contract:
docs/design.md, "DHA compute: gather and matmul on host operands").

The alternative to streaming (copying a host leaf to HBM before its use) for leaves read once
with little reuse: an embedding table of which a step touches a few rows, a weight multiplied by
a few tokens. The table / weight is passed whole as the operand of the custom call (a
`pinned_host` jit argument reaches the CUDA handler as the host pointer: ../shared/MEASURED.md)
and the kernel reads it over PCIe, each needed byte once; nothing of it is copied to HBM.

Never slice or transform the host operand in JAX before the call: XLA would copy the window to
the device first (or run host compute). A stacked weight [L, K, N] is therefore passed whole
with a static `index`, and the kernel reads layer `index` in place. `jaxtier._src.lowering.
hlo_violations(hlo, target=...)` checks a compiled program for such copies.

Operands other than the host leaf (ids, x, cotangents) and every result are in device memory.
Operands are single-device arrays (or replicated); there is no sharding rule yet.

With `JAXTIER_DISABLE_FFI=1`, the pure-JAX references run instead (they copy the host leaf to
the device: a correctness fallback, not a fast path).
"""

from __future__ import annotations

import functools
import math
import operator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.primitives import base as ffi
from jaxtier._src.primitives.base import ffi_disabled

GATHER_TARGET = "jaxtier_dha_gather_ffi"
MATMUL_TARGET = "jaxtier_dha_matmul_ffi"
TARGETS = (GATHER_TARGET, MATMUL_TARGET)

GATHER_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MATMUL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _as_array(x: Any) -> Any:
  return x if isinstance(x, jax.Array) else jnp.asarray(x)


def _to_device(x: jax.Array) -> jax.Array:
  """`x` in device memory (the reference path: XLA computes on device memory)."""
  return jax.device_put(x, jax.memory.Space.Device)


def _in_space(ct: jax.Array, space: Any) -> jax.Array:
  """`ct` (computed on the device) in memory space `space` (a `jax.memory.Space`).

  JAX types a cotangent with its primal's memory space (`float32<host>[...]` for a pinned_host
  leaf) and `custom_vjp` checks it, so the cotangent of a host leaf is moved to host memory
  (one device-to-host copy of the cotangent, by XLA).
  """
  return ct if space == jax.memory.Space.Device else jax.device_put(ct, space)


# ------------------------------------------------------------------------------------------------
# gather
# ------------------------------------------------------------------------------------------------

def gather(table: jax.Array, ids: Any) -> jax.Array:
  """Rows of a host-resident table, read in place: `rows[..., :] = table[ids[...], :]`.

  The CUDA kernel reads only the selected rows over PCIe (one warp per row, 16-byte loads when
  the row length and the buffers allow): `ids.size * D * itemsize` bytes cross the link, not
  the table.

  Out-of-range ids: an id outside [0, V) (negative ids included: there is no wrap-around)
  gives a row of zeros and receives no gradient. This is `jnp.take(table, ids, axis=0,
  mode='fill', fill_value=0)` for non-negative ids; unlike it, -1 is a padding id, not the last
  row.

  Gradient (`jax.custom_vjp`): the table's cotangent is computed as a dense device array
  `zeros([V, D]).at[ids].add(rows_cotangent)` in the table's dtype (as `jax.grad` of
  `jnp.take` gives it), then moved to the table's memory space (JAX types a cotangent like its
  primal: a pinned_host table gets a pinned_host cotangent, one device-to-host copy). It holds
  V * D * itemsize bytes of HBM: differentiating a large host-resident table this way costs as
  much device memory as the table itself, and the whole of it crosses the link. ids get no
  cotangent.

  Args:
    table: [V, D] float32, bfloat16 or float16; memory kind `pinned_host` in real use (any
      memory kind works). Passed whole, never sliced.
    ids: [...] integers (int32; other integer dtypes are converted, out-of-range values stay
      out of range), on the device.

  Returns:
    [..., D] in the table's dtype, in device memory.

  Raises:
    TypeError: ids that are not integers, or a table dtype other than float32 / bfloat16 /
      float16.
    ValueError: a table that is not 2-D.
  """
  table = _as_array(table)
  ids = _as_array(ids)
  if table.ndim != 2:
    raise ValueError(f"`dha.gather`: expected a 2-D table [V, D], got shape {table.shape}; "
                     "reshape the host leaf to rows once, outside the step")
  if jnp.dtype(table.dtype) not in GATHER_DTYPES:
    raise TypeError(f"`dha.gather`: expected a table of dtype float32, bfloat16 or float16, got "
                    f"{table.dtype}")
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"`dha.gather`: expected integer ids, got {ids.dtype}; cast them with "
                    "ids.astype(jnp.int32)")
  num_rows = int(table.shape[0])
  if jnp.dtype(ids.dtype) != jnp.dtype(jnp.int32):
    # Keep out-of-range values out of range through the conversion.
    ids = jnp.where((ids >= 0) & (ids < num_rows), ids, -1).astype(jnp.int32)
  return _gather_fn(num_rows, jc.memory_space_of(table))(table, ids)


@functools.cache
def _gather_fn(num_rows: int, space: Any):
  """The differentiable gather for a table of `num_rows` rows in memory space `space`."""

  @jax.custom_vjp
  def f(table, ids):
    return _gather_impl(table, ids)

  def fwd(table, ids):
    return _gather_impl(table, ids), ids

  def bwd(ids, g):
    valid = (ids >= 0) & (ids < num_rows)
    safe = jnp.where(valid, ids, num_rows)  # out of range: dropped by the scatter
    dtable = jnp.zeros((num_rows, g.shape[-1]), g.dtype).at[safe].add(g, mode="drop")
    return _in_space(dtable, space), None

  f.defvjp(fwd, bwd)
  return f


def _gather_impl(table: jax.Array, ids: jax.Array) -> jax.Array:
  if ffi_disabled():
    return _gather_reference(table, ids)

  out = jax.ShapeDtypeStruct(tuple(ids.shape) + (table.shape[1],), table.dtype)
  return ffi.ffi_call(GATHER_TARGET, out, vmap_method="sequential")(table, ids)


def _gather_reference(table: jax.Array, ids: jax.Array) -> jax.Array:
  """Pure-JAX gather with the same out-of-range rule (copies the table to the device)."""
  num_rows, dim = table.shape
  if num_rows == 0:
    return jnp.zeros(tuple(ids.shape) + (dim,), table.dtype)
  table = _to_device(table)
  valid = (ids >= 0) & (ids < num_rows)
  rows = jnp.take(table, jnp.clip(ids, 0, num_rows - 1), axis=0)
  return jnp.where(valid[..., None], rows, jnp.zeros((), table.dtype))


# ------------------------------------------------------------------------------------------------
# matmul
# ------------------------------------------------------------------------------------------------

def matmul(x: jax.Array, w: jax.Array, *, index: "int | None" = None) -> jax.Array:
  """`x @ w[index]` (or `x @ w`) with the host-resident weight read in place.

  The CUDA kernel reads each element of the weight (layer `index` of a stacked one) from host
  memory once for up to 512 rows of x (the link is the bound: K * N * itemsize bytes; a larger
  x is cut into chunks of 512 rows, each reading w again), keeps x tiles in shared memory and
  accumulates in fp32.

  Gradient (`jax.custom_vjp`): dx = `matmul_t(g, w, index=index)` (w read in place again) and
  dw = x^T @ g on the device (fp32 accumulation, w's dtype). For a 2-D w that dw is w's
  cotangent. For a stacked w, w's cotangent must have w's shape, so it is dw scattered into
  device zeros [L, K, N] (L times the memory of one layer: correct, not cheap). JAX types a
  cotangent like its primal, so for a pinned_host w the cotangent is then copied to pinned_host
  (K * N, or L * K * N, elements down the link). Use `matmul_bwd` to get dw on the device with
  the shape of one layer and route it yourself.

  Args:
    x: [..., K] float32 or bfloat16, on the device.
    w: [K, N] or stacked [L, K, N], x's dtype; memory kind `pinned_host` in real use. Passed
      whole, never sliced.
    index: for a stacked w, the layer to multiply by: a static Python int in [0, L). Must be
      None for a 2-D w.

  Returns:
    [..., N] in x's dtype (fp32 accumulation, rounded once), in device memory.

  Raises:
    TypeError: dtypes other than float32 / bfloat16 or that differ between x and w; an index
      that is not a static int.
    ValueError: ranks or contraction sizes that do not match, an index out of range, an index
      for a 2-D w, or no index for a stacked w.
  """
  x, w, idx = _check_matmul("matmul", x, w, index, transpose=False)
  lead = x.shape[:-1]
  y = _matmul_fn(idx, False)(_rows(x), w)
  return y.reshape(lead + (y.shape[-1],))


def matmul_t(x: jax.Array, w: jax.Array, *, index: "int | None" = None) -> jax.Array:
  """`x @ w[index].T` (or `x @ w.T`) with the host-resident weight read in place.

  What the backward pass of `matmul` needs for dx; the same kernel, w's layer read once over
  PCIe (each of its rows is a column of the product). Differentiable the same way as `matmul`
  (dx = `matmul(g, w, index=index)`, dw = g^T @ x on the device).

  Args:
    x: [..., N] float32 or bfloat16, on the device.
    w: [K, N] or stacked [L, K, N], x's dtype; memory kind `pinned_host` in real use.
    index: as for `matmul`.

  Returns:
    [..., K] in x's dtype, in device memory.

  Raises:
    TypeError, ValueError: as for `matmul`.
  """
  x, w, idx = _check_matmul("matmul_t", x, w, index, transpose=True)
  lead = x.shape[:-1]
  y = _matmul_fn(idx, True)(_rows(x), w)
  return y.reshape(lead + (y.shape[-1],))


def matmul_bwd(x: jax.Array, w: jax.Array, g: jax.Array, *, index: "int | None" = None
               ) -> tuple[jax.Array, jax.Array]:
  """The two cotangents of `y = matmul(x, w, index=index)`, dw with one layer's shape.

  Args:
    x: [..., K] as given to `matmul`.
    w: [K, N] or [L, K, N] as given to `matmul` (host-resident; read in place for dx).
    g: [..., N], y's cotangent, x's dtype.
    index: as given to `matmul`.

  Returns:
    (dx [..., K] in x's dtype, dw [K, N] in w's dtype), both in device memory. dw = x^T @ g
    with fp32 accumulation, for a stacked w the cotangent of layer `index` only.

  Raises:
    TypeError, ValueError: as for `matmul`, or a g whose shape is not [..., N].
  """
  x, w, idx = _check_matmul("matmul_bwd", x, w, index, transpose=False)
  g = _as_array(g)
  want = x.shape[:-1] + (w.shape[-1],)
  if tuple(g.shape) != want or jnp.dtype(g.dtype) != jnp.dtype(x.dtype):
    raise ValueError(f"`dha.matmul_bwd`: expected g of shape {want} and dtype {x.dtype}, got "
                     f"{tuple(g.shape)} {g.dtype}")
  x2 = _rows(x)
  g2 = _rows(g)
  dx = _matmul_impl(g2, w, idx, True).reshape(x.shape)
  return dx, _outer(x2, g2, w.dtype)


def _rows(a: jax.Array) -> jax.Array:
  """[..., C] -> [prod(...), C] (also when a dimension is 0)."""
  return a.reshape(math.prod(a.shape[:-1]), a.shape[-1])


def _check_matmul(api: str, x: Any, w: Any, index: Any, *, transpose: bool
                  ) -> tuple[jax.Array, jax.Array, int]:
  """Checks a call; returns (x, w, layer index) with the index 0 for a 2-D w."""
  x = _as_array(x)
  w = _as_array(w)
  for name, a in (("x", x), ("w", w)):
    if jnp.dtype(a.dtype) not in MATMUL_DTYPES:
      raise TypeError(f"`dha.{api}`: expected {name} of dtype float32 or bfloat16, got {a.dtype}")
  if jnp.dtype(x.dtype) != jnp.dtype(w.dtype):
    raise TypeError(f"`dha.{api}`: expected x and w of one dtype, got x {x.dtype} and w "
                    f"{w.dtype}; cast x (w is the host leaf: cast it once, outside the step)")
  if x.ndim < 1:
    raise ValueError(f"`dha.{api}`: expected x of shape [..., {'N' if transpose else 'K'}], "
                     "got a scalar")
  if w.ndim not in (2, 3):
    raise ValueError(f"`dha.{api}`: expected w of shape [K, N] or [L, K, N], got {w.shape}")
  k, n = w.shape[-2:]
  need = n if transpose else k
  if x.shape[-1] != need:
    what = "w.shape[-1] (N)" if transpose else "w.shape[-2] (K)"
    raise ValueError(f"`dha.{api}`: expected x's last dimension to equal {what} = {need}, got "
                     f"x {x.shape} and w {w.shape}")
  if w.ndim == 2:
    if index is not None:
      raise ValueError(f"`dha.{api}`: expected index=None for a 2-D w {w.shape}, got {index!r}")
    return x, w, 0
  if index is None:
    raise ValueError(f"`dha.{api}`: expected a layer index for the stacked w {w.shape}, got "
                     "None; pass index=l (a static int)")
  if isinstance(index, bool) or not _is_static_int(index):
    raise TypeError(f"`dha.{api}`: expected a static Python int index, got {index!r}; a traced "
                    "index is not supported (the layer is an attribute of the call)")
  idx = operator.index(index)
  if not 0 <= idx < w.shape[0]:
    raise ValueError(f"`dha.{api}`: expected index in [0, {w.shape[0]}) for w {w.shape}, got "
                     f"{idx}")
  return x, w, idx


def _is_static_int(v: Any) -> bool:
  if isinstance(v, jax.Array):  # a traced or device value (tracers are jax.Arrays too)
    return False
  try:
    operator.index(v)
  except TypeError:
    return False
  return True


def _outer(x: jax.Array, g: jax.Array, dtype: Any) -> jax.Array:
  """x^T @ g for x [M, K], g [M, O]: [K, O] in `dtype`, fp32 accumulation, on the device."""
  out = jax.lax.dot_general(x, g, (((0,), (0,)), ((), ())),
                            precision=jax.lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)
  return out.astype(dtype)


@functools.cache
def _matmul_fn(index: int, transpose: bool):
  """The differentiable 2-D product for layer `index`: x @ B with B = w[index] or w[index]^T."""

  @jax.custom_vjp
  def f(x, w):
    return _matmul_impl(x, w, index, transpose)

  def fwd(x, w):
    return _matmul_impl(x, w, index, transpose), (x, w)

  def bwd(res, g):
    x, w = res
    # y = x @ B: dx = g @ B^T, dB = x^T @ g. B = w[index] (transpose 0) or w[index]^T.
    dx = _matmul_impl(g, w, index, not transpose)
    dlayer = _outer(g, x, w.dtype) if transpose else _outer(x, g, w.dtype)
    if w.ndim == 3:
      dw = jnp.zeros(w.shape, w.dtype).at[index].set(dlayer)
    else:
      dw = dlayer
    return dx, _in_space(dw, jc.memory_space_of(w))

  f.defvjp(fwd, bwd)
  return f


def _matmul_impl(x: jax.Array, w: jax.Array, index: int, transpose: bool) -> jax.Array:
  """One custom call: x [M, R] times layer `index` of w (transposed if asked) -> [M, O].

  The call has a second result, the fp32 partial sums of the CUDA kernel's split reduction
  ([S, M, O], or [0] for no split; `matmul_partial_shape`): XLA allocates it like any result
  and it is dropped here. The CPU handler ignores it.
  """
  out_cols = w.shape[-2] if transpose else w.shape[-1]
  if ffi_disabled():
    return _matmul_reference(x, w, index, transpose)

  m, r = x.shape
  out = jax.ShapeDtypeStruct((m, out_cols), x.dtype)
  partial = jax.ShapeDtypeStruct(
      matmul_partial_shape(m, r, out_cols, x.dtype, _num_sms()), jnp.float32)
  call = ffi.ffi_call(MATMUL_TARGET, (out, partial), vmap_method="sequential")
  y, _ = call(x, w, index=np.int64(index), transpose=np.int32(int(transpose)))
  return y


# The CUDA kernel's tiles by M (dha_kernels.cu, `DispatchTile`): (largest M, x rows per block MT,
# y columns per block BO); the last one serves every larger M, in chunks of 512 rows.
_MATMUL_TILES = ((8, 8, 256), (16, 16, 256), (32, 32, 256), (64, 64, 256), (128, 128, 128),
                 (256, 256, 64), (None, 512, 64))
_BLOCKS_PER_SM = 4  # blocks in flight per SM that the split reduction aims at
MAX_PARTIAL_BYTES = 256 << 20  # cap on the partial sums (fewer splits beyond it)
_MAX_GRID_Y = 65535  # CUDA's limit on gridDim.y, the split index


@functools.cache
def _num_sms() -> int:
  """Streaming multiprocessors of this process's first GPU; 0 without a GPU backend."""
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return 0
  if not gpus:
    return 0
  try:  # a PJRT device attribute of CUDA devices; only the split's size depends on it
    count = int(getattr(gpus[0], "core_count", 0) or 0)
  except Exception:  # pylint: disable=broad-except
    count = 0
  return count if count > 0 else 132  # 132: H100 / H200 SXM


def matmul_partial_shape(m: int, r: int, o: int, dtype: Any, num_sms: int) -> tuple[int, ...]:
  """Shape of the fp32 partial-sums result of one `jaxtier_dha_matmul_ffi` call.

  The CUDA kernel gives each block of 256 threads MT rows of x and BO columns of y
  (`_MATMUL_TILES`); when those blocks are fewer than `_BLOCKS_PER_SM * num_sms` (small M or
  O), it splits the reduction over R into S ranges of stages (BR = 128 bytes / itemsize rows
  each), each block of split s writes its fp32 sums to partial[s], and a second kernel adds
  the S partials in split order (deterministic for a given S) and rounds once. The kernel takes
  S from this result's shape, so this function is the one place where the split is chosen:
  enough splits to keep every SM busy, capped at `MAX_PARTIAL_BYTES`.

  Args:
    m, r, o: x is [m, r], y is [m, o].
    dtype: x's dtype (float32 or bfloat16).
    num_sms: SMs of the GPU that runs the call; 0 (no GPU: the CPU handler) means no split.

  Returns:
    (S, m, o) with S >= 2, or (0,) when the kernel runs unsplit (it then writes y directly).
  """
  if num_sms <= 0 or m == 0 or o == 0 or r == 0:
    return (0,)
  mt, bo = next((mt, bo) for top, mt, bo in _MATMUL_TILES if top is None or m <= top)
  br = 128 // jnp.dtype(dtype).itemsize
  col_tiles = -(-o // bo)
  m_chunks = -(-m // mt)
  stages = -(-r // br)
  splits = max(1, -(-(_BLOCKS_PER_SM * num_sms) // (col_tiles * m_chunks)))
  splits = min(splits, stages, _MAX_GRID_Y)
  if splits > 1:
    splits = min(splits, max(1, MAX_PARTIAL_BYTES // (m * o * 4)))
  if splits <= 1:
    return (0,)
  per_split = -(-stages // splits)
  splits = -(-stages // per_split)  # no split without a stage
  return (splits, m, o) if splits > 1 else (0,)


def _matmul_reference(x: jax.Array, w: jax.Array, index: int, transpose: bool) -> jax.Array:
  """Pure-JAX product with fp32 accumulation (copies w to the device)."""
  w = _to_device(w)
  layer = w[index] if w.ndim == 3 else w
  contract = 1 if transpose else 0
  y = jax.lax.dot_general(x, layer, (((1,), (contract,)), ((), ())),
                          precision=jax.lax.Precision.HIGHEST,
                          preferred_element_type=jnp.float32)
  return y.astype(x.dtype)
