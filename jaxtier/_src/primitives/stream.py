"""Streaming: asynchronous copies of stacked host leaves to the device and back, layer by layer.

Three custom calls (C++: `xla_ffi/src/stream.cc` for the CPU handlers,
`xla_ffi/src/stream_kernels.cu` for the CUDA handlers, `xla_ffi/src/stream.h` for what they
share; why: docs/design.md, "Streaming"). This docstring is their contract:

- `fetch(host_leaves, index, after=...)` starts copying slice `index` (axis 0) of each stacked
  leaf (memory kind `pinned_host`, passed whole) into a new device array, on jaxtier's h2d copy
  stream. The slices are NOT valid until a `wait(..., direction='h2d')` issued later.
- `wait(arrays, after=..., direction=...)` makes XLA's compute stream wait for every copy jaxtier
  has issued so far on the device in that direction, and hands `arrays` back (in place).
- `send(host_leaves, values, index)` starts copying each device value into slice `index` of its
  (donated) host leaf, in place, on jaxtier's d2h copy stream. The values must stay alive until
  a later `wait(..., direction='d2h', after=values)`.

Ordering is expressed with data dependencies only: `after` operands are passed through fetch
(aliased, so whatever consumes them runs after the copy was issued) and are order-only operands
of wait (which orders the wait after their producers and keeps their buffers alive until then).
The double-buffered loop the lowering stage builds:

    (buf,), _ = fetch([W], 0)
    for l in range(L):
      w, = wait([buf], after=[h])                   # slice l has arrived
      if l + 1 < L:
        (buf,), (w,) = fetch([W], l + 1, after=[w])  # slice l + 1 is on its way ...
      h = jnp.tanh(h @ w)                           # ... while layer l computes

Every fetch must be followed by an h2d wait, and every send by a d2h wait, before the
program ends (an unwaited copy may outlive the buffers it reads or writes).

Why `has_side_effect=True` on all three calls. Their results are pure functions of their
operands only from XLA's point of view; what matters here is when the copies run. Without the
flag (checked on XLA:CPU, jax 0.10.2; tests/primitives/stream_test.py keeps the checks):
- XLA's CSE merges two fetches of the same leaf and index with the same `after` operands (the
  forward and the backward fetch of a layer, when the rewrite gives them no distinct `after`):
  the first slice then stays alive from the forward pass to the backward pass, which is the
  device memory streaming exists to save.
- Two waits with the same operands are merged, but a wait's meaning depends on the copies issued
  before it (hidden state): the second one would no longer wait for copies issued in between.
- A wait whose results are unused (the final `wait(direction='d2h', after=grads)` that makes the
  program wait for its sends) and a send whose host leaf is not returned are dead code to XLA,
  and removed.
The flag marks the custom calls side-effecting in HLO (no CSE, no DCE); JAX gives them an
unordered FFI effect, which jit, scan and cond accept.

On the CPU backend the handlers copy synchronously (memcpy); the pure-JAX `_reference`
(`JAXTIER_DISABLE_FFI=1`) computes the same values with static slicing and `device_put`.
"""

from __future__ import annotations

import operator
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src.primitives import base as ffi
from jaxtier._src.primitives.base import ffi_disabled

FETCH_TARGET = "jaxtier_stream_fetch_ffi"
WAIT_TARGET = "jaxtier_stream_wait_ffi"
SEND_TARGET = "jaxtier_stream_send_ffi"
TARGETS = (FETCH_TARGET, WAIT_TARGET, SEND_TARGET)

# Direction names -> attribute `direction` (xla_ffi/src/stream.h, enum Direction).
H2D = "h2d"
D2H = "d2h"
DIRECTIONS = {H2D: 0, D2H: 1}


def fetch(host_leaves: Sequence[jax.Array], index: int, *, after: Sequence[jax.Array] = ()
          ) -> tuple[list[jax.Array], list[jax.Array]]:
  """Starts copying slice `index` (along axis 0) of each stacked leaf into a new device array.

  Args:
    host_leaves: stacked arrays ``[L_k, ...]`` of any dtype, normally of memory kind
      `pinned_host` (a device array works too). Passed whole to the custom call: never slice
      them in JAX (XLA would copy the window first). Each leaf has its own ``L_k``.
    index: static Python int, the slice to copy; in ``[0, L_k)`` for every leaf.
    after: arrays (any memory kind the enclosing computation allows) passed through unchanged,
      in place (`input_output_aliases`): work that consumes `after_out` is ordered after the
      copies were issued. An `after` array that is still used elsewhere is copied by XLA first
      (so pass values whose only later use is through `after_out`).

  Returns:
    ``(slices, after_out)``: ``slices[k]`` has shape ``host_leaves[k].shape[1:]``, the same
    dtype, memory kind `device`, and is NOT valid until a later ``wait(..., direction='h2d')``
    (which may name it in `arrays`) has been enqueued before its first use; ``after_out[j]``
    is ``after[j]``.

  Raises:
    TypeError: `index` is not a Python int (a traced index cannot be an attribute).
    ValueError: a leaf of rank 0, or `index` outside ``[0, L_k)`` for some leaf.
  """
  api = "`jaxtier.stream.fetch`"
  host_leaves, after = list(host_leaves), list(after)
  index = _check_index(api, host_leaves, index)
  if not host_leaves and not after:
    return [], []
  if ffi_disabled():
    return _reference_fetch(host_leaves, index), list(after)
  n = len(host_leaves)
  results = ([jax.ShapeDtypeStruct(x.shape[1:], x.dtype) for x in host_leaves]
             + [_same_type(a) for a in after])
  out = _call(FETCH_TARGET, results, {n + j: n + j for j in range(len(after))},
              [*host_leaves, *after], index=np.int64(index), num_leaves=np.int64(n))
  return list(out[:n]), list(out[n:])


def wait(arrays: Sequence[jax.Array], *, after: Sequence[jax.Array] = (),
         direction: str = H2D) -> list[jax.Array]:
  """Makes XLA's compute stream wait for the copies jaxtier has issued so far in `direction`.

  Args:
    arrays: arrays handed back unchanged, in place (`input_output_aliases`); typically the
      slices of earlier fetches, which are valid from the results of this call on (use the
      results, not the inputs). Any memory kind (a host leaf written by sends may pass through
      a 'd2h' wait before it is fetched again).
    after: order-only operands, not read: the wait runs after their producers, and their
      buffers stay alive until the wait (a send's values must be named here).
    direction: 'h2d' (the copies of `fetch`) or 'd2h' (the copies of `send`).

  Returns:
    `arrays`, as a list of new values (same buffers).

  Raises:
    ValueError: an unknown `direction`.
  """
  api = "`jaxtier.stream.wait`"
  if direction not in DIRECTIONS:
    raise ValueError(f"{api}: expected direction in {tuple(DIRECTIONS)}, got {direction!r}; "
                     "use 'h2d' to wait for fetches, 'd2h' to wait for sends")
  arrays, after = list(arrays), list(after)
  if not arrays and not after:
    # Nothing orders it: a wait with no operands could run anywhere in the program.
    raise ValueError(f"{api}: expected at least one array or `after` operand, got none; "
                     "name the values the wait must follow (e.g. the values sent)")
  if ffi_disabled():
    return list(arrays)
  out = _call(WAIT_TARGET, [_same_type(a) for a in arrays], {k: k for k in range(len(arrays))},
              [*arrays, *after], direction=np.int32(DIRECTIONS[direction]))
  return list(out)


def send(host_leaves: Sequence[jax.Array], values: Sequence[jax.Array], index: int
         ) -> list[jax.Array]:
  """Starts copying ``values[k]`` into slice `index` of ``host_leaves[k]``, in place.

  Args:
    host_leaves: stacked arrays ``[L_k, ...]``, normally of memory kind `pinned_host`, donated
      by the enclosing jit (`donate_argnums`) or produced by an earlier send: the results alias
      them (`input_output_aliases`). A leaf that is not donated is copied by XLA first.
    values: device arrays, ``values[k]`` of shape ``host_leaves[k].shape[1:]`` and the same
      dtype. Each buffer must stay alive until a later
      ``wait(..., direction='d2h', after=[values[k], ...])``.
    index: static Python int in ``[0, L_k)`` for every leaf.

  Returns:
    The host leaves (the same buffers), slice `index` overwritten once the copy completes:
    read them only after a ``wait(..., direction='d2h')`` (pass them through its `arrays`).

  Raises:
    TypeError: `index` is not a Python int.
    ValueError: a different number of leaves and values, a value whose shape or dtype is not
      that of its leaf's slice, or `index` outside ``[0, L_k)``.
  """
  api = "`jaxtier.stream.send`"
  host_leaves, values = list(host_leaves), list(values)
  if len(host_leaves) != len(values):
    raise ValueError(f"{api}: expected one value per host leaf, got {len(host_leaves)} host "
                     f"leaves and {len(values)} values; pass the lists in the same order")
  index = _check_index(api, host_leaves, index)
  for k, (leaf, value) in enumerate(zip(host_leaves, values)):
    want = (tuple(leaf.shape[1:]), jnp.dtype(leaf.dtype))
    got = (tuple(np.shape(value)), jnp.dtype(value.dtype))
    if want != got:
      raise ValueError(
          f"{api}: expected value {k} of shape {want[0]} and dtype {want[1]} (one slice of host "
          f"leaf {k}, shape {tuple(leaf.shape)}), got shape {got[0]} and dtype {got[1]}; "
          "reshape or cast the value to the slice's shape and dtype")
  if not host_leaves:
    return []
  if ffi_disabled():
    return _reference_send(host_leaves, values, index)
  n = len(host_leaves)
  out = _call(SEND_TARGET, [_same_type(x) for x in host_leaves], {k: k for k in range(n)},
              [*host_leaves, *values], index=np.int64(index))
  return list(out)


def _call(target: str, results: list[Any], aliases: dict[int, int], operands: list[Any],
          **attributes: Any) -> Sequence[jax.Array]:
  # Traces name each fetch and send with its layer: `jaxtier.stream_fetch[3]`.
  scope = ffi.scope_name(target)
  if "index" in attributes:
    scope += f"[{int(attributes['index'])}]"
  call = ffi.ffi_call(target, results, aliases=aliases, has_side_effect=True, scope=scope)
  return call(*operands, **attributes)


def _same_type(x: Any) -> Any:
  """The result type of a pass-through or in-place result: `x`'s own type (shape, dtype,
  sharding and memory space: a host leaf's result stays `pinned_host` in the jaxpr)."""
  return jax.typeof(x)


def _check_index(api: str, host_leaves: list[Any], index: Any) -> int:
  if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
    try:
      index = operator.index(index)
    except TypeError:
      raise TypeError(f"{api}: expected a static Python int index, got {index!r} "
                      f"(type {type(index).__name__}); the slice index is an attribute of the "
                      "custom call: unroll the layer loop in Python") from None
  index = int(index)
  for k, leaf in enumerate(host_leaves):
    shape = tuple(np.shape(leaf))
    if not shape:
      raise ValueError(f"{api}: expected host leaf {k} to be stacked, [L, ...] with rank >= 1, "
                       "got a scalar; pass the whole stacked leaf")
    if not 0 <= index < shape[0]:
      raise ValueError(f"{api}: expected index in [0, {shape[0]}) for host leaf {k} of shape "
                       f"{shape}, got {index}; index the leading (layer) axis")
  return index


def _memory_space(x: Any) -> Any:
  return getattr(jax.typeof(x), "memory_space", None)


def _reference_fetch(host_leaves: list[jax.Array], index: int) -> list[jax.Array]:
  """Pure-JAX fetch: a static slice of each leaf, moved to device memory."""
  return [jax.device_put(jax.lax.index_in_dim(x, index, 0, keepdims=False),
                         jax.memory.Space.Device)
          for x in host_leaves]


def _reference_send(host_leaves: list[jax.Array], values: list[jax.Array], index: int
                    ) -> list[jax.Array]:
  """Pure-JAX send: the leaf with slice `index` replaced, in the leaf's memory space."""
  out = []
  for leaf, value in zip(host_leaves, values):
    space = _memory_space(leaf)
    on_device = jax.device_put(leaf, jax.memory.Space.Device)
    new = jax.lax.dynamic_update_index_in_dim(
        on_device, jax.device_put(value, jax.memory.Space.Device), index, 0)
    out.append(new if space in (None, jax.memory.Space.Device) else jax.device_put(new, space))
  return out
