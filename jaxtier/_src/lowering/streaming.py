"""Streaming host-resident stacked parameters through the layer loops of a traced step.

A leaf placed `host_stream` lives in `pinned_host` as a stack of layers `[L, ...]` and is read by
`scan`s as their `xs` (Flax `nnx.scan` and linen `scan` stack a layer's params that way; after
`jax.grad` the forward scan reads them in order and the backward scan in reverse). Each such
scan is unrolled when the step is lowered, and at iteration t:

    w_t   = wait(buf_t, after=outputs of iteration t-1)   # XLA's stream waits for fetch t
    buf_{t+1}, w_t = fetch(W, index of t+1, after=w_t)   # copy engine starts layer t+1 ...
    outs_t = body(carry_t, w_t, other xs[t])              # ... while layer t computes
    G      = wait(G, after=[y_{t-1}, outs_t], 'd2h')      # layer t-1's gradient has landed
    G      = send(G, y_t, index of t)                     # layer t's gradient goes down

(`jaxtier/_src/primitives/stream.py`). The data dependencies alone fix the order: the fetch of
layer t+1 is issued after layer t-1's compute (so its destination may reuse freed memory) and
before layer t's, so the copy runs under layer t's compute; at most two layers' weights are on
the device at a time (plus the first fetch, issued early). A `ys` output of the scan that only a
fused host update reads (the gradient of a host-resident parameter) is sent slice by slice into
a donated `pinned_host` scratch buffer as soon as each slice exists, in the other direction of
the link (duplex), and the host update reads it there; the device never holds it whole. Where
the gradient is a bf16 value widened (an fp32 weight that the layer casts to bf16), it is sent
and kept in bf16: exactly the same values in half the bytes, widened as the update loads them.

Why unroll rather than keep the loop: a copy engine needs the slice's host address when the copy
is issued, and a loop's index lives on the device; unrolled, each fetch has its index as a
static attribute, and a failed step cannot leave a counter out of step. XLA compiles one copy of
the body per layer.

Autodiff needs nothing here: the traced step already holds its backward scan (jax.grad ran
when the step was traced), and both scans are rewritten the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import jaxpr_graph


@dataclasses.dataclass(frozen=True)
class StreamedScan:
  """One top-level `scan` whose `xs` include host_stream leaves.

  Attributes:
    eqn: index of the scan equation in the top-level jaxpr.
    streamed: positions in the equation's invars of the streamed leaves (all `xs`).
    sent: (position in the equation's outvars, scratch index) of each `ys` output sent to a
      pinned_host scratch buffer slice by slice.
  """

  eqn: int
  streamed: tuple[int, ...]
  sent: tuple[tuple[int, int], ...]


@dataclasses.dataclass(frozen=True)
class Scratch:
  """A persistent pinned_host buffer that receives a stacked gradient, layer by layer.

  Attributes:
    shape: [L, ...] of the gradient.
    dtype: its dtype, or the narrower float dtype it exactly widens
      (`jaxpr_graph.narrow_source_dtype`: bf16 for a weight a bf16 layer casts), sent so.
    leaf: index of the streamed state leaf whose sharding it follows.
  """

  shape: tuple[int, ...]
  dtype: Any
  leaf: int


@dataclasses.dataclass(frozen=True)
class StreamSchedule:
  """What the lowering streams: the scans it unrolls and the scratch buffers it sends into.

  Attributes:
    scans: top-level equation index -> `StreamedScan`.
    scratch: the scratch buffers (step arguments, donated, returned).
    sent_vars: outer jaxpr var (a scan's stacked `ys`) -> scratch index; the fused host update
      reads the scratch buffer in its place.
  """

  scans: dict[int, StreamedScan]
  scratch: tuple[Scratch, ...]
  sent_vars: dict[Any, int]


EMPTY = StreamSchedule({}, (), {})


def schedule(jaxpr: Any, streamed: Sequence[int], host_eqns: "set[int]") -> StreamSchedule:
  """The streaming schedule for leaves `streamed` of the traced step `jaxpr`.

  Args:
    jaxpr: the top-level jaxpr of the traced step (state leaves first among its invars).
    streamed: indices of the state leaves placed `host_stream`.
    host_eqns: indices of the equations the fused host updates run (their components).

  Returns:
    The scans to unroll, and a scratch buffer for each scan `ys` output that only host
    updates read.
  """
  if not streamed:
    return EMPTY
  svars = {jaxpr.invars[i]: i for i in streamed}
  uses: dict[Any, list[int]] = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for x in eqn.invars:
      if isinstance(x, jc.Var):
        uses.setdefault(x, []).append(k)
  outs = {x for x in jaxpr.outvars if isinstance(x, jc.Var)}
  scans: dict[int, StreamedScan] = {}
  scratch: list[Scratch] = []
  sent_vars: dict[Any, int] = {}
  for k, eqn in enumerate(jaxpr.eqns):
    if eqn.primitive.name != "scan":
      continue
    xs = jaxpr_graph.scan_xs_positions(eqn)
    pos = tuple(p for p in xs if eqn.invars[p] in svars)
    if not pos:
      continue
    seed = svars[eqn.invars[pos[0]]]
    _, nk = jc.scan_counts(eqn)
    sent = []
    for j, ov in enumerate(eqn.outvars[nk:], start=nk):
      if (isinstance(ov, jc.DropVar) or ov in outs or not uses.get(ov)
          or not set(uses[ov]) <= host_eqns or not jnp.issubdtype(ov.aval.dtype, jnp.floating)):
        continue
      sent_vars[ov] = len(scratch)
      sent.append((j, len(scratch)))
      # A gradient that is a bf16 value widened goes down in bf16, exactly (half the bytes
      # over the link and in host DRAM); the host update widens it back as it loads it.
      dtype = jaxpr_graph.scan_ys_narrow_dtype(eqn, j) or ov.aval.dtype
      scratch.append(Scratch(tuple(ov.aval.shape), dtype, seed))
    scans[k] = StreamedScan(k, pos, tuple(sent))
  return StreamSchedule(scans, tuple(scratch), sent_vars)


class Stacked:
  """A scan's stacked `ys` output kept as its per-layer slices (stacked only when read whole).

  A later unrolled scan reading it as `xs` takes the slices directly: no concatenation, no
  slicing (the backward scan reads the forward's residuals this way).
  """

  def __init__(self, slices: list[Any]):
    self.slices = slices
    self._whole = None

  def whole(self) -> Any:
    if self._whole is None:
      self._whole = jnp.stack(self.slices)
    return self._whole


def run_scan(eqn: Any, scan: StreamedScan, invals: list[Any], scratch: list[Any],
             read_body: "Callable[[Any, list[Any]], list[Any]] | None" = None,
             on_layer: "Callable[[int, list[Any]], list[Any] | None] | None" = None,
             on_landed: "Callable[[int, list[Any], list[Any]], list[Any]] | None" = None
             ) -> list[Any]:
  """Runs one streamed scan unrolled; returns its outputs (stacked ys as `Stacked`).

  Each scratch buffer gets its own send and d2h wait calls, each with that buffer as its only
  aliased operand and result. XLA's GPU passes `host-offload-legalize` and `host-offloader`
  follow every pinned_host entry parameter through the custom calls that alias it; at a call
  with several results they follow all of them, so a chain of L calls of k aliased results
  costs them k**L paths. Measured on the H200 (`benchmarks/diagnostics/offload_pass_trace.py`):
  with one
  send and one wait per layer for the 1b decoder's 9 gradients, 2 layers cost 729 visits of
  each call and 4 layers did not compile in 5 minutes; with one call per buffer the walks are
  linear. (The fetch reads its host leaves without aliasing them, so one fetch serves all.)

  Args:
    eqn: the `scan` equation.
    scan: its `StreamedScan`.
    invals: the equation's inputs (the streamed ones: the pinned_host leaves, whole;
      others: arrays or `Stacked`).
    scratch: the scratch buffers (pinned_host), updated in place in this list by the sends.
    read_body: evaluates the body (a ClosedJaxpr) on a list of inputs (default: equation by
      equation with `jax_compat.bind_eqn`).
    on_layer: called as `on_layer(layer, outs)` after each iteration with the body's outputs
      (carry, then ys slices): the per-layer host updates (`lowering/overlap.py`). It may
      return the outputs to go on with (the same values, the carry ordered after its calls),
      or None. A scan with no streamed leaves is unrolled for it alone (no fetch or wait).
    on_landed: called as `on_landed(layer, outs, scratch)` once that layer's sent slices have
      landed in the scratch buffers (after the d2h wait, before the next layer's sends): the
      per-layer host updates that read a scratch window in place. It returns tokens; each
      scratch buffer then passes through one more d2h wait after them, so that the next send,
      which writes the buffer in place, is ordered after every read of the landed value (else
      XLA copies the whole buffer to keep that value for its readers).

  Returns:
    The scan's outputs: final carry values, then ys (a `Stacked` each, or for a sent ys the
    scratch buffer after its last slice has landed).
  """
  from jaxtier._src.primitives import stream  # pylint: disable=g-import-not-at-top

  p = eqn.params
  (nc, nk), length, reverse = jc.scan_counts(eqn), p["length"], p["reverse"]
  body = p["jaxpr"]
  run_body = read_body or eval_closed
  consts, carry = list(invals[:nc]), list(invals[nc:nc + nk])
  xs_pos = list(range(nc + nk, len(invals)))
  streamed = list(scan.streamed)
  host = [invals[q] for q in streamed]
  sent = dict(scan.sent)
  order = list(range(length - 1, -1, -1)) if reverse else list(range(length))
  num_ys = len(eqn.outvars) - nk
  ys: list[list[Any]] = [[None] * length for _ in range(num_ys)]
  bufs, _ = stream.fetch(host, order[0]) if order and host else ([], [])
  prev_outs: list[Any] = list(carry)
  pending: list[Any] = []  # last iteration's sent slices (alive until their copies land)
  for t, layer in enumerate(order):
    cur = stream.wait(bufs, after=arrays_of(prev_outs)) if host else []
    if t + 1 < length and host:
      bufs, cur = stream.fetch(host, order[t + 1], after=cur)
    fetched = dict(zip(streamed, cur))
    x_t = []
    for q in xs_pos:
      if q in fetched:
        x_t.append(fetched[q])
      elif isinstance(invals[q], Stacked):
        x_t.append(invals[q].slices[layer])
      else:
        x_t.append(jax.lax.index_in_dim(invals[q], layer, keepdims=False))
    outs = run_body(body, consts + carry + x_t)
    if on_layer is not None:
      outs = on_layer(layer, outs) or outs
    carry = outs[:nk]
    sends = []
    for j in range(num_ys):
      if nk + j in sent:
        sends.append((sent[nk + j], outs[nk + j]))
      else:
        ys[j][layer] = outs[nk + j]
    if sends:
      idx = [s for s, _ in sends]
      if pending:
        # The compute stream waits for last layer's sends (keeping their values alive until
        # then) after this layer's compute, before this layer's sends reuse the buffers.
        for s in idx:
          scratch[s], = stream.wait([scratch[s]], after=pending + arrays_of(outs),
                                    direction="d2h")
        _landed(on_landed, order[t - 1], prev_outs, scratch, idx, reorder=True)
      # A narrowed buffer takes the slice in its dtype: exact (`Scratch`); the convert is one
      # layer's slice on the device.
      sends = [(s, y if y.dtype == scratch[s].dtype else y.astype(scratch[s].dtype))
               for s, y in sends]
      for s, y in sends:
        scratch[s], = stream.send([scratch[s]], [y], layer)
      pending = [y for _, y in sends]
    prev_outs = list(outs)
  if pending:
    for _, s in scan.sent:
      scratch[s], = stream.wait([scratch[s]], after=pending, direction="d2h")
    _landed(on_landed, order[-1], prev_outs, scratch, [s for _, s in scan.sent], reorder=False)
  results: list[Any] = list(carry)
  for j in range(num_ys):
    results.append(scratch[sent[nk + j]] if nk + j in sent else Stacked(ys[j]))
  return results


def _landed(on_landed: Any, layer: int, outs: list[Any], scratch: list[Any], idx: list[int],
            reorder: bool) -> None:
  """Runs `on_landed` for `layer`; with `reorder`, passes scratch buffers `idx` through a d2h
  wait after its tokens (the next sends into them then come after its reads)."""
  from jaxtier._src.primitives import stream  # pylint: disable=g-import-not-at-top

  if on_landed is None:
    return
  tokens = on_landed(layer, outs, scratch)
  if tokens and reorder:
    for s in idx:
      scratch[s], = stream.wait([scratch[s]], after=list(tokens), direction="d2h")


def arrays_of(values: Sequence[Any]) -> list[Any]:
  """The arrays (or tracers) among `values`: what order-only operands may name."""
  return [v for v in values if isinstance(v, jax.Array) or hasattr(v, "aval")]


def eval_closed(closed: Any, args: list[Any]) -> list[Any]:
  """Evaluates a ClosedJaxpr equation by equation (`jax_compat.bind_eqn`)."""
  jaxpr, consts = jc.open_jaxpr(closed)
  env: dict[Any, Any] = dict(zip(jaxpr.constvars, consts))
  env.update(zip(jaxpr.invars, args))

  def read(v):
    return v.val if isinstance(v, jc.Literal) else env[v]

  for eqn in jaxpr.eqns:
    for v, val in zip(eqn.outvars, jc.bind_eqn(eqn, [read(v) for v in eqn.invars])):
      if not isinstance(v, jc.DropVar):
        env[v] = val
  return [read(v) for v in jaxpr.outvars]


def device_bytes_bound(schedule_: StreamSchedule, jaxpr: Any) -> int:
  """Bytes of streamed weights the unrolled scans hold on the device at once, at most.

  By construction (`run_scan`): the layer in use, the layer in flight, and the first layer
  of the next scan fetched early; per scan, the sum of one layer of each streamed leaf.
  """
  per_layer = []
  for scan in schedule_.scans.values():
    eqn = jaxpr.eqns[scan.eqn]
    per_layer.append(sum(int(np.prod(eqn.invars[q].aval.shape[1:]))
                         * jnp.dtype(eqn.invars[q].aval.dtype).itemsize for q in scan.streamed))
  return 3 * max(per_layer, default=0)
