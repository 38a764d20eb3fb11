"""DHA compute: gather, matmul and scatter_add on host-resident leaves, read or written in place.

Custom calls `jaxtier_dha_gather_ffi`, `jaxtier_dha_matmul_ffi` and `jaxtier_dha_scatter_add_ffi`
(C++: `xla_ffi/src/dha.cc` for the CPU handlers and the host-side scatter-add,
`xla_ffi/src/dha_kernels.cu` for the CUDA handlers, `xla_ffi/src/dha.h` for what they share;
contract: docs/design.md, "DHA compute: gather, matmul and scatter-add on host operands").
`jaxtier.experimental.dha` is this module.

The alternative to streaming (copying a host leaf to HBM before its use) for leaves read once
with little reuse: an embedding table of which a step touches a few rows, a weight multiplied by
a few tokens. The table / weight is passed whole as the operand of the custom call (a
`pinned_host` jit argument reaches the CUDA handler as the host pointer, uncopied, in S(5))
and the kernel reads it over PCIe, each needed byte once; nothing of it is copied to HBM.
`scatter_add` is the other direction, for the gradient of such a table: it writes a donated
pinned_host buffer in place (the host CPUs zero it and add the gradient rows), so no table-sized
gradient is ever built in HBM.

Never slice or transform the host operand in JAX before the call: XLA would copy the window to
the device first (or run host compute). A stacked weight [L, K, N] is therefore passed whole
with a static `index`, and the kernel reads layer `index` in place. `jaxtier._src.lowering.
hlo_violations(hlo, target=...)` checks a compiled program for such copies.

Operands other than the host leaf (ids, x, rows, cotangents) and every result but
scatter_add's are in device memory. Operands are single-device arrays (or replicated); there is
no sharding rule yet.

With `JAXTIER_DISABLE_FFI=1`, the pure-JAX references run instead (they copy the host leaf to
the device, or build scatter_add's result there: a correctness fallback, not a fast path).
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
SCATTER_ADD_TARGET = "jaxtier_dha_scatter_add_ffi"
TARGETS = (GATHER_TARGET, MATMUL_TARGET, SCATTER_ADD_TARGET)

GATHER_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
MATMUL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))
SCATTER_ADD_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


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
  cotangent. To keep the table's gradient off HBM, scatter-add the rows' cotangent into a
  donated pinned_host buffer with `scatter_add` instead of differentiating through `gather`.

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
  _check_ids("`dha.gather`", ids)
  num_rows = int(table.shape[0])
  return _gather_fn(num_rows, jc.memory_space_of(table))(table, _int32_ids(ids, num_rows))


def _check_ids(api: str, ids: jax.Array) -> None:
  """Raises TypeError naming `api` unless `ids` are integers (the gather's and the scatter's)."""
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise TypeError(f"{api}: expected integer ids, got {ids.dtype}; cast them with "
                    "ids.astype(jnp.int32)")


def _int32_ids(ids: jax.Array, num_rows: int) -> jax.Array:
  """Integer `ids` as int32, every value outside [0, num_rows) as -1 (out of range stays out)."""
  if jnp.dtype(ids.dtype) == jnp.dtype(jnp.int32):
    return ids
  valid = (ids >= 0) & (ids < num_rows)
  return jnp.where(valid, ids.astype(jnp.int32), jnp.int32(-1))


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
# scatter_add
# ------------------------------------------------------------------------------------------------

# Pinned staging of the CUDA handler, per call site and device: two slots (double buffering) of
# SCATTER_ADD_CHUNK_BYTES each (xla_ffi/src/dha_kernels.cu; JAXTIER_DHA_SCATTER_CHUNK_BYTES
# overrides it when an executable is loaded; a slot grows to one id and one row where a row is
# larger).
SCATTER_ADD_CHUNK_BYTES = 16 << 20
SCATTER_ADD_STAGING_SLOTS = 2


def scatter_add(buffer: jax.Array, ids: Any, rows: Any, *, zeroed: bool = False) -> jax.Array:
  """Scatter-adds rows into a zeroed host-resident buffer, in place: the gradient of `gather`.

  `result = zeros([V, D])`, then for each n in order, if `0 <= ids[n] < V`:
  `result[ids[n]] += rows[n]` (n runs over `ids` flattened in row-major order). An id outside
  [0, V), negative ids included, adds nothing: the rows that `gather` filled with zeros get no
  gradient. The whole buffer is zeroed, so its old contents never matter: it is the gradient
  of a whole [V, D] table, of which only the rows in `ids` are non-zero.

  Arithmetic: each row of the result is the sum of its rows in the order of n, in fp32 (rows
  are widened to fp32 exactly), starting from 0. A float32 buffer holds that sum; a bfloat16
  buffer gets it rounded once (to nearest even), not after each addition. Both handlers give
  the same bits (IEEE fp32, no flush of denormals): numpy's
  `acc = np.zeros((V, D), np.float32); np.add.at(acc, ids[valid], rows[valid].astype(np.float32))`
  cast to the buffer's dtype. Deterministic: no atomics, the order of n is kept per row.

  Where the work runs. On a GPU the buffer is written by the host CPUs, never by the GPU over
  PCIe (zeroing 2 GB there would alone take 40 ms of the link). The CUDA handler copies ids and
  rows to pinned staging with the copy engine, in chunks, through a region per call site and
  device of at most `SCATTER_ADD_STAGING_SLOTS` x `SCATTER_ADD_CHUNK_BYTES` = 32 MiB of pinned
  memory (less when a call's ids and rows fit in less; kept until the executable is freed;
  JAXTIER_DHA_SCATTER_CHUNK_BYTES, read when an executable is loaded, sets the bytes per slot,
  at least 4096; a slot grows to one id and one row where a row is larger). Meanwhile
  jaxtier's CPU thread pool (JAXTIER_CPU_THREADS) zeroes the buffer and adds each staged chunk
  (a bfloat16 buffer: adds into fp32 sums, then writes the buffer once, sums and zeros). XLA's
  stream waits for the last chunk, so everything after the call in the program sees the
  finished buffer. `ids.size * (4 + D * rows.itemsize)` bytes cross the link, nothing of the
  buffer: the cost is host memory traffic (about 60 ms for a 2 GiB float32 buffer and 65,536
  bfloat16 rows of 4,096 on the H200 machine's 16 CPUs, where a dense device gradient copied
  down took 41 ms and 2 GiB of HBM). A
  bfloat16 buffer also needs fp32 sums of the distinct valid ids, `min(ids.size, V) * D * 4`
  bytes of pageable host memory at most (reserved per call site, touched only for the distinct
  ids), and a V-entry int32 map (`V * 4` bytes). On the CPU backend the CPU handler does the
  same work on the same thread pool, without staging.

  In place: call it inside `jax.jit` with `buffer` donated (`donate_argnums` /
  `donate_argnames`) and the result given a `pinned_host` out-sharding (or returned as is). The
  result aliases the buffer (`input_output_aliases={0: 0}`) and is the same host memory; the
  caller's `buffer` is consumed. An undonated buffer is first copied by XLA (host to host,
  slow), and the copy is written instead.

  Not differentiable and not batchable (`vmap`): it writes one buffer.

  Args:
    buffer: [V, D] float32 or bfloat16, memory kind `pinned_host`, donated; passed whole,
      never sliced. Its values are not read.
    ids: [...] integers, on the device (int32; other integer dtypes are converted, out-of-range
      values stay out of range). Any rank; `ids.size` rows are added.
    rows: [..., D] float32 or bfloat16 (may differ from the buffer's dtype), on the device,
      with `rows.shape == ids.shape + (D,)`: row n is added into `buffer[ids[n]]`.
    zeroed: the buffer is all zeros already (its caller keeps it so, for example by zeroing
      the rows it read, as `host_update_rows(..., zero=...)` does): nothing is zeroed, and only
      the rows of `ids` are written (host memory traffic of those rows alone). The result is
      the same as without it for a zero buffer; a buffer that is not zero keeps its other
      rows, and its rows of `ids` start from their old values.

  Returns:
    [V, D] in the buffer's dtype, memory kind `pinned_host`: the buffer, written.

  Raises:
    TypeError: a buffer or rows dtype other than float32 / bfloat16, or ids that are not
      integers.
    ValueError: a buffer that is not 2-D, a (concrete) buffer of another memory kind than
      `pinned_host`, or rows whose shape is not `ids.shape + (D,)`. (A traced buffer is checked
      where the call runs: on a GPU the handler fails with "Invalid memory for input 0 (buffer)
      to jaxtier_dha_scatter_add" for device memory.)

  Example (the backward half of a host-resident embedding lookup: row n of the cotangent of
  `gather(table, ids)` goes to row `ids[n]` of the table's gradient):

    >>> import jax, jax.numpy as jnp, numpy as np
    >>> from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    >>> from jaxtier.experimental import dha
    >>> host = NamedSharding(Mesh(jax.devices()[:1], ("d",)), P(), memory_kind="pinned_host")
    >>> grad = jax.device_put(jnp.full((4, 2), 7.0), host)  # old values: not read
    >>> step = jax.jit(dha.scatter_add, donate_argnums=0, out_shardings=host)
    >>> ids = jnp.asarray([2, 0, 2, -1])  # -1: a padding id, adds nothing
    >>> rows = jnp.asarray([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 8.0]])
    >>> grad = step(grad, ids, rows)
    >>> grad.sharding.memory_kind, np.asarray(grad).tolist()
    ('pinned_host', [[3.0, 4.0], [0.0, 0.0], [6.0, 8.0], [0.0, 0.0]])
  """
  api = "`dha.scatter_add`"
  buffer = _as_array(buffer)
  ids = _as_array(ids)
  rows = _as_array(rows)
  if buffer.ndim != 2:
    raise ValueError(f"{api}: expected a 2-D buffer [V, D], got shape {tuple(buffer.shape)}; "
                     "pass the whole gradient buffer of the [V, D] table")
  if jnp.dtype(buffer.dtype) not in SCATTER_ADD_DTYPES:
    raise TypeError(f"{api}: expected a buffer of dtype float32 or bfloat16, got "
                    f"{buffer.dtype}; allocate the gradient buffer in one of them")
  _check_ids(api, ids)
  if jnp.dtype(rows.dtype) not in SCATTER_ADD_DTYPES:
    raise TypeError(f"{api}: expected rows of dtype float32 or bfloat16, got {rows.dtype}; "
                    "cast them with rows.astype(jnp.float32)")
  num_rows, dim = (int(d) for d in buffer.shape)
  want = tuple(ids.shape) + (dim,)
  if tuple(rows.shape) != want:
    raise ValueError(f"{api}: expected rows of shape {want} (ids.shape {tuple(ids.shape)} + "
                     f"[D] with D = {dim}, the buffer's row length), got {tuple(rows.shape)}; "
                     "pass one row of D values per id")
  _check_host_buffer(api, buffer)
  ids = _int32_ids(ids, num_rows)
  if ffi_disabled():
    return _scatter_add_reference(buffer, ids, rows, zeroed)
  call = ffi.ffi_call(SCATTER_ADD_TARGET, jax.typeof(buffer), aliases={0: 0})
  return call(buffer, ids, rows, zeroed=np.int32(bool(zeroed)))


def _check_host_buffer(api: str, buffer: jax.Array) -> None:
  """Raises for a buffer known to be in another memory than pinned_host.

  Known: a concrete array's sharding names its memory kind. A traced buffer is typed
  `<host>` when its jit argument's type says so (a `NamedSharding` in pinned_host); typed in
  device memory it may still be pinned_host (jax 0.10 types an argument whose `in_shardings`
  entry is pinned_host but whose lowering spec carries no sharding in device memory, while XLA
  puts it in host memory), so it passes here, and on a GPU the CUDA handler rejects a buffer
  that is really in device memory when the call runs.
  """
  if isinstance(buffer, jax.core.Tracer):
    return
  kind = jc.memory_kind_of(buffer)
  if kind not in (None, "pinned_host"):
    raise ValueError(
        f"{api}: expected a buffer in pinned_host memory, got memory kind {kind!r} (buffer "
        f"{tuple(buffer.shape)} {buffer.dtype}); put it there with jax.device_put(buffer, "
        "NamedSharding(mesh, P(), memory_kind='pinned_host')) (or jax.memory.Space.Host) and "
        "donate it to the jitted step")


def _scatter_add_reference(buffer: jax.Array, ids: jax.Array, rows: jax.Array,
                           zeroed: bool = False) -> jax.Array:
  """Pure-JAX scatter-add with the same rules: fp32 sums on the device ([V, D] of HBM; XLA's
  scatter chooses the order of the additions), rounded once, moved to the buffer's memory.
  With `zeroed` the sums start from the buffer's values."""
  num_rows, dim = buffer.shape
  valid = (ids >= 0) & (ids < num_rows)
  safe = jnp.where(valid, ids, num_rows).reshape(-1)  # out of range: dropped by the scatter
  start = (jax.device_put(buffer, jc.memory_space("device")).astype(jnp.float32) if zeroed
           else jnp.zeros((num_rows, dim), jnp.float32))
  acc = start.at[safe].add(rows.reshape(-1, dim).astype(jnp.float32), mode="drop")
  return jax.device_put(acc.astype(buffer.dtype), jc.memory_space_of(buffer))


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
