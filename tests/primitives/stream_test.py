"""Streaming custom calls (fetch / wait / send): values, gradients, the compiled HLO, errors, GPU."""

import re

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxtier._src.lowering import hlo as hlo_lib
from jaxtier._src.primitives import base as ffi
from jaxtier._src.primitives import stream

# The CPU tests run on the CPU backend wherever they run (on the H200 too: the GPU has its own
# tests below, whose reference programs allow for the GPU's fusion choices).
CPU = jax.devices("cpu")[0]


pytestmark = pytest.mark.usefixtures("cpu_unless_gpu")


def _sharding(kind, device=None):
  device = device if device is not None else CPU
  return NamedSharding(jax.sharding.Mesh(np.array([device]), ("x",)), P(), memory_kind=kind)


def _put(x, kind, device=None):
  return jax.device_put(x, _sharding(kind, device))


def _layer(h, w):
  return jnp.tanh(h @ w)


def _streamed_forward(W, x, keep=None, fetched=None):
  """The double-buffered loop: slice l + 1 is fetched before layer l computes. `keep` collects
  each layer's input, `fetched` each slice as the layer uses it."""
  num_layers = W.shape[0]
  (buf,), _ = stream.fetch([W], 0)
  h = x
  for l in range(num_layers):
    w, = stream.wait([buf], after=[h])
    if l + 1 < num_layers:
      (buf,), (w,) = stream.fetch([W], l + 1, after=[w])
    if keep is not None:
      keep.append(h)
    if fetched is not None:
      fetched.append(w)
    h = _layer(h, w)
  return h


def _streamed_forward_backward(W, G, x, fetched=None):
  """Forward, then backward with the slices fetched again in reverse (double-buffered), each
  layer's weight gradient sent into slice l of the host buffer G, one final d2h wait.
  `fetched` collects the slices as used: layers 0 .. L-1, then L-1 .. 0."""
  num_layers = W.shape[0]
  hs = []
  h = _streamed_forward(W, x, keep=hs, fetched=fetched)
  dh = jnp.ones_like(h)  # d sum(h) / d h
  (buf,), (dh,) = stream.fetch([W], num_layers - 1, after=[dh])
  dws = []
  for l in reversed(range(num_layers)):
    w, = stream.wait([buf], after=[dh])
    if l > 0:
      (buf,), (w,) = stream.fetch([W], l - 1, after=[w])
    if fetched is not None:
      fetched.append(w)
    _, vjp = jax.vjp(_layer, hs[l], w)
    dh, dw = vjp(dh)
    G, = stream.send([G], [dw], l)
    dws.append(dw)
  G, = stream.wait([G], after=dws, direction="d2h")
  return h, G


def _plain_forward(W, x):
  h = x
  for l in range(W.shape[0]):
    h = _layer(h, W[l])
  return h


def _materialized_forward(W, x):
  """The plain loop with each slice materialised first (an optimization barrier), so that on the
  GPU each dot reads a whole buffer as in the streamed program (not a slice fused into it)."""
  ws = jax.lax.optimization_barrier([W[l] for l in range(W.shape[0])])
  h = x
  for w in ws:
    h = _layer(h, w)
  return h


def _plain_grad(W, x):
  return jax.grad(lambda W: jnp.sum(_plain_forward(W, x).astype(jnp.float32)))(W)


def _problem(dtype, num_layers=4, m=16, batch=8, seed=0):
  rng = np.random.default_rng(seed)
  W = (rng.normal(size=(num_layers, m, m)) * 0.4).astype(np.float32)
  x = rng.normal(size=(batch, m)).astype(np.float32)
  return jnp.asarray(W, dtype), jnp.asarray(x, dtype)


def _run_streamed(W_np, x, device=None):
  W = _put(W_np, "pinned_host", device)
  G = _put(jnp.zeros_like(W_np), "pinned_host", device)
  x = _put(x, "device", device)
  f = jax.jit(_streamed_forward_backward, donate_argnums=1,
              out_shardings=(_sharding("device", device), _sharding("pinned_host", device)))
  h, G = f(W, G, x)
  assert G.sharding.memory_kind == "pinned_host"
  assert not W.is_deleted() and W.sharding.memory_kind == "pinned_host"
  return h, G


@pytest.fixture(params=["ffi", "reference"])
def mode(request, monkeypatch):
  """The kill switch is read while tracing: clear jit's trace caches around each mode."""
  if request.param == "reference":
    monkeypatch.setenv("JAXTIER_DISABLE_FFI", "1")
  else:
    monkeypatch.delenv("JAXTIER_DISABLE_FFI", raising=False)
  jax.clear_caches()
  yield request.param
  jax.clear_caches()


# ---- values: the double-buffered loop and its gradient against plain JAX --------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_double_buffered_forward_and_grads_equal_plain_jax(dtype, mode):
  W, x = _problem(dtype)
  h, G = _run_streamed(W, x)
  ref_h = jax.jit(_plain_forward)(W, x)
  ref_g = jax.jit(_plain_grad)(W, x)
  assert h.dtype == dtype and G.dtype == dtype
  np.testing.assert_array_equal(np.asarray(h), np.asarray(ref_h))
  # Same primitives, same order (the per-layer vjp is what jax.grad builds): the same bits.
  np.testing.assert_array_equal(np.asarray(G), np.asarray(ref_g))
  assert np.abs(np.asarray(G, np.float32)).min() > 0  # every slice was written
  text = jax.jit(_streamed_forward_backward, donate_argnums=1).lower(
      _put(W, "pinned_host"), _put(jnp.zeros_like(W), "pinned_host"), x).as_text()
  calls = {t: text.count(f"@{t}(") for t in stream.TARGETS}
  if mode == "ffi":  # 2 L fetches, 2 L h2d waits + 1 d2h wait, L sends
    assert calls == {stream.FETCH_TARGET: 8, stream.WAIT_TARGET: 9, stream.SEND_TARGET: 4}
  else:
    assert calls == {t: 0 for t in stream.TARGETS}


def test_forward_only_program_and_fetch_of_several_leaves(mode):
  # Two leaves of different L and dtype in one fetch; `after` values come back unchanged.
  rng = np.random.default_rng(1)
  A = rng.normal(size=(3, 4, 5)).astype(np.float32)
  B = rng.integers(-100, 100, size=(6, 7)).astype(np.int32)
  z = jnp.arange(3.0)

  def f(A, B, z):
    (a, b), (z2,) = stream.fetch([A, B], 2, after=[z])
    return stream.wait([a, b], after=[z2]) + [z2]
  a, b, z2 = jax.jit(f)(_put(A, "pinned_host"), _put(B, "pinned_host"), z)
  np.testing.assert_array_equal(np.asarray(a), A[2])
  np.testing.assert_array_equal(np.asarray(b), B[2])
  np.testing.assert_array_equal(np.asarray(z2), np.arange(3.0))
  assert a.sharding.memory_kind == "device"


def test_send_writes_only_its_slice(mode):
  G0 = np.arange(5 * 2 * 3, dtype=np.float32).reshape(5, 2, 3)
  v = np.full((2, 3), -1.0, np.float32)

  def f(G, v):
    G, = stream.send([G], [v], 3)
    return stream.wait([G], after=[v], direction="d2h")[0]
  G = jax.jit(f, donate_argnums=0, out_shardings=_sharding("pinned_host"))(
      _put(G0, "pinned_host"), v)
  want = G0.copy()
  want[3] = v
  np.testing.assert_array_equal(np.asarray(G), want)


# ---- has_side_effect: why it is set (stream.py's docstring) ---------------------------------

def _counts(compiled_text):
  return {t: compiled_text.count(f'custom_call_target="{t}"') for t in stream.TARGETS}


def test_calls_are_neither_merged_nor_dropped(monkeypatch):
  monkeypatch.delenv("JAXTIER_DISABLE_FFI", raising=False)
  W = _put(np.ones((4, 8, 8), np.float32), "pinned_host")
  G = _put(np.zeros((4, 8, 8), np.float32), "pinned_host")
  x = jnp.ones((2, 8))

  def same_fetch_twice(W, x):  # forward and backward fetch of one layer, same operands
    (a,), _ = stream.fetch([W], 1)
    a, = stream.wait([a], after=[x])
    (b,), _ = stream.fetch([W], 1)
    b, = stream.wait([b], after=[x])
    return jnp.tanh(x @ a) @ b

  def unused_results(G, x):  # a wait whose results are unused; a send whose leaf is dropped
    G2, = stream.send([G], [x.sum() * jnp.ones((8, 8))], 1)
    stream.wait([], after=[G2], direction="d2h")
    stream.send([G2], [jnp.ones((8, 8))], 2)
    return x

  text = jax.jit(same_fetch_twice).lower(W, x).compile().as_text()
  assert _counts(text) == {stream.FETCH_TARGET: 2, stream.WAIT_TARGET: 2, stream.SEND_TARGET: 0}
  with pytest.warns(UserWarning, match="donated buffers were not usable"):
    text = jax.jit(unused_results, donate_argnums=0).lower(G, x).compile().as_text()
  assert _counts(text) == {stream.FETCH_TARGET: 0, stream.WAIT_TARGET: 1, stream.SEND_TARGET: 2}


# ---- the HLO guard: host leaves reach the custom calls as the entry parameters ---------------

def _entry(text):
  """The entry computation of an HLO module's text."""
  return text[re.search(r"(?m)^ENTRY", text).start():]


def _call_operands(text, target):
  """Operand names of each `target` custom call in the entry computation."""
  entry = _entry(text)
  out = []
  for line in entry.splitlines():
    if f'custom_call_target="{target}"' in line:
      rhs = line.split(" custom-call(", 1)[1]
      out.append([a.strip().lstrip("%") for a in rhs.split(")", 1)[0].split(",")])
  return out


def _entry_parameters(text):
  entry = _entry(text)
  return {line.split(" = ")[0].strip().lstrip("%") for line in entry.splitlines()
          if " parameter(" in line}


def _host_writes(text):
  """Entry instructions that XLA made to write host memory (S(5)): copies, dynamic-update-slices,
  fusions. Empty when host buffers are written only by jaxtier's custom calls (in place).
  Needs a backend that prints memory spaces on instructions (the GPU; the CPU prints them only
  in the entry layout)."""
  entry = _entry(text)
  out = []
  for line in entry.splitlines():
    if " = " not in line:
      continue
    rhs = line.split(" = ", 1)[1]
    m = re.search(r"(?:^|\s)([a-z][a-z0-9\-]*)\(", rhs)
    if m and "S(5)" in rhs[:m.start()] and m.group(1) not in (
        "parameter", "custom-call", "get-tuple-element", "bitcast", "tuple"):
      out.append(line.strip()[:200])
  return out


def test_host_writes_flags_an_xla_copy_into_host_memory():
  text = """ENTRY %main {
  %p0 = f32[4,8]{1,0:S(5)} parameter(0)
  %v = f32[8]{0} parameter(1)
  %cc = f32[4,8]{1,0:S(5)} custom-call(%p0, %v), custom_call_target="jaxtier_stream_send_ffi"
  ROOT %copy.1 = f32[4,8]{1,0:S(5)} copy(%cc)
}"""
  assert _host_writes(text) == ["ROOT %copy.1 = f32[4,8]{1,0:S(5)} copy(%cc)"]
  assert _host_writes(text.replace("ROOT %copy.1", "%unused")
                      .replace("copy(%cc)", "bitcast(%cc)")) == []


def _compiled_single_calls():
  W = _put(np.ones((4, 8, 8), np.float32), "pinned_host")
  G = _put(np.zeros((4, 8, 8), np.float32), "pinned_host")
  v = jnp.ones((8, 8))
  host = _sharding("pinned_host")
  return {
      stream.FETCH_TARGET: jax.jit(lambda W, v: stream.wait(
          stream.fetch([W], 2, after=[v])[0], after=[v])).lower(W, v),
      stream.SEND_TARGET: jax.jit(lambda G, v: stream.send([G], [v], 1)[0],
                                  donate_argnums=0, out_shardings=host).lower(G, v),
      stream.WAIT_TARGET: jax.jit(lambda G, v: stream.wait([G], after=[v], direction="d2h")[0],
                                  donate_argnums=0, out_shardings=host).lower(G, v),
  }


@pytest.mark.parametrize("target", stream.TARGETS)
def test_hlo_guard_host_leaf_is_the_entry_parameter(target, monkeypatch):
  monkeypatch.delenv("JAXTIER_DISABLE_FFI", raising=False)
  text = _compiled_single_calls()[target].compile().as_text()
  assert hlo_lib.hlo_violations(text, target=target) == []
  assert hlo_lib.host_parameters(text) == {0}  # the host leaf is in S(5)
  # The call reads the entry parameter itself: no copy, slice or fusion in between.
  (operands,) = _call_operands(text, target)
  params = _entry_parameters(text)
  assert operands[0] in params, (operands, params)


def test_hlo_guard_flags_sliced_or_undonated_host_leaf(monkeypatch):
  monkeypatch.delenv("JAXTIER_DISABLE_FFI", raising=False)
  W = _put(np.ones((4, 8, 8), np.float32), "pinned_host")
  v = jnp.ones((8, 8))
  # A host leaf sliced in JAX before the fetch: XLA copies the window.
  text = jax.jit(lambda W, v: stream.wait(stream.fetch([W[1:]], 0)[0], after=[v])).lower(
      W, v).compile().as_text()
  bad = hlo_lib.hlo_violations(text, target=stream.FETCH_TARGET)
  assert len(bad) == 1 and "from a host parameter" in bad[0], bad
  # A send into a host leaf that is not donated: XLA copies the whole leaf first.
  text = jax.jit(lambda G, v: stream.send([G], [v], 1)[0],
                 out_shardings=_sharding("pinned_host")).lower(W, v).compile().as_text()
  bad = hlo_lib.hlo_violations(text, target=stream.SEND_TARGET)
  assert len(bad) == 1 and "from a host parameter" in bad[0], bad


# ---- errors -----------------------------------------------------------------------------------

def test_python_errors():
  W = jnp.zeros((4, 3, 2))
  with pytest.raises(ValueError, match=r"`jaxtier.stream.fetch`: expected index in \[0, 4\) for "
                                       r"host leaf 1 of shape \(4, 3, 2\), got 4"):
    stream.fetch([jnp.zeros((9, 2)), W], 4)
  with pytest.raises(ValueError, match=r"expected index in \[0, 4\).*got -1"):
    stream.fetch([W], -1)
  with pytest.raises(TypeError, match="static Python int index"):
    jax.jit(lambda W, i: stream.fetch([W], i))(W, 1)
  with pytest.raises(ValueError, match="expected host leaf 0 to be stacked"):
    stream.fetch([jnp.float32(1)], 0)
  with pytest.raises(ValueError, match=r"`jaxtier.stream.send`: expected value 0 of shape "
                                       r"\(3, 2\) and dtype float32 .* got shape \(2, 3\)"):
    stream.send([W], [jnp.zeros((2, 3))], 0)
  with pytest.raises(ValueError, match=r"dtype float32 .* got shape \(3, 2\) and dtype bfloat16"):
    stream.send([W], [jnp.zeros((3, 2), jnp.bfloat16)], 0)
  with pytest.raises(ValueError, match="expected one value per host leaf, got 1 host leaves and "
                                       "2 values"):
    stream.send([W], [W[0], W[0]], 0)
  with pytest.raises(ValueError, match=r"`jaxtier.stream.send`: expected index in \[0, 4\)"):
    stream.send([W], [W[0]], 7)
  with pytest.raises(ValueError, match=r"`jaxtier.stream.wait`: expected direction in "
                                       r"\('h2d', 'd2h'\), got 'up'"):
    stream.wait([W], direction="up")
  with pytest.raises(ValueError, match="expected at least one array"):
    stream.wait([])


def test_handler_errors(monkeypatch):
  # The C++ checks, reached by calling the targets directly (the Python wrappers never pass
  # such calls).
  monkeypatch.delenv("JAXTIER_DISABLE_FFI", raising=False)

  ffi.ensure_registered()
  W = jnp.zeros((4, 3, 2))
  bad_index = jax.ffi.ffi_call(stream.FETCH_TARGET, [jax.ShapeDtypeStruct((3, 2), W.dtype)],
                               has_side_effect=True)
  with pytest.raises(Exception, match="Invalid value for attribute index.*to jaxtier_stream_fetch."
                                      " Expected a value in \\[0, 4\\), got 4"):
    jax.block_until_ready(bad_index(W, index=np.int64(4), num_leaves=np.int64(1)))
  bad_shape = jax.ffi.ffi_call(stream.FETCH_TARGET, [jax.ShapeDtypeStruct((2, 3), W.dtype)],
                               has_side_effect=True)
  with pytest.raises(Exception, match=r"Invalid shape for result 0 to jaxtier_stream_fetch. "
                                      r"Expected \[3, 2\]"):
    jax.block_until_ready(bad_shape(W, index=np.int64(0), num_leaves=np.int64(1)))
  # A send whose result is not the host leaf's buffer (no input_output_aliases).
  unaliased = jax.ffi.ffi_call(stream.SEND_TARGET, [jax.ShapeDtypeStruct(W.shape, W.dtype)],
                               has_side_effect=True)
  with pytest.raises(Exception, match="host leaf must be donated"):
    jax.block_until_ready(unaliased(W, W[0], index=np.int64(1)))
  bad_direction = jax.ffi.ffi_call(stream.WAIT_TARGET, [], has_side_effect=True)
  with pytest.raises(Exception, match="Invalid value for attribute direction"):
    jax.block_until_ready(jax.jit(lambda w: (bad_direction(w, direction=np.int32(2)), w)[1])(W))


# ---- memory: fetched slices do not pile up ----------------------------------------------------

def _fetch_all_first(W, x):
  """All slices fetched up front, then used: what streaming must not do."""
  bufs = [stream.fetch([W], l)[0][0] for l in range(W.shape[0])]
  h = x
  for w in stream.wait(bufs, after=[x]):
    h = _layer(h, w)
  return h


def _bounded_temp_check(device, num_layers, m, batch, dtype, forward=_streamed_forward):
  """Temp bytes of the streamed forward vs 4 slices + what one device layer needs."""
  W = _put(jnp.zeros((num_layers, m, m), dtype), "pinned_host", device)
  x = _put(jnp.zeros((batch, m), dtype), "device", device)
  streamed = jax.jit(forward).lower(W, x).compile()
  one_layer = jax.jit(_layer).lower(x, _put(jnp.zeros((m, m), dtype), "device", device)).compile()
  slice_bytes = m * m * jnp.dtype(dtype).itemsize
  act_bytes = batch * m * jnp.dtype(dtype).itemsize
  # One layer's temp (workspace) + in/out activations of a layer + 4 slices (double buffering
  # keeps 2 live; 4 leaves slack for XLA's buffer assignment). All 8 would be 8 slices.
  budget = one_layer.memory_analysis().temp_size_in_bytes + 2 * act_bytes + 4 * slice_bytes
  temp = streamed.memory_analysis().temp_size_in_bytes
  assert temp <= budget, (temp, budget, slice_bytes)
  return temp


def test_fetched_slices_stay_bounded_cpu(monkeypatch):
  monkeypatch.delenv("JAXTIER_DISABLE_FFI", raising=False)
  _bounded_temp_check(CPU, 8, 128, 16, jnp.float32)
  with pytest.raises(AssertionError):  # the check catches slices that pile up
    _bounded_temp_check(CPU, 8, 128, 16, jnp.float32, forward=_fetch_all_first)


# ---- GPU (skipped without one; JAXTIER_REQUIRE_GPU=1 makes the skip a failure) ----------------

def test_gpu_double_buffered_forward_equals_device(gpu):
  W, x = _problem(jnp.bfloat16, num_layers=8, m=1024, batch=512)
  Wh = _put(W, "pinned_host", gpu)
  xd = _put(x, "device", gpu)
  h = jax.jit(_streamed_forward)(Wh, xd)
  Wd = _put(W, "device", gpu)
  ref = jax.jit(_materialized_forward)(Wd, xd)
  assert h.sharding.memory_kind == "device"
  np.testing.assert_array_equal(np.asarray(h.astype(jnp.float32)),
                                np.asarray(ref.astype(jnp.float32)))
  # Against the plain loop (XLA may fuse the slice into the dot: another gemm, maybe other bits).
  plain = np.asarray(jax.jit(_plain_forward)(Wd, xd).astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(h.astype(jnp.float32)), plain, rtol=2 ** -7, atol=1e-6)
  # Run it again on the same host leaf: copies of one call must not leak into the next.
  np.testing.assert_array_equal(np.asarray(jax.jit(_streamed_forward)(Wh, xd)), np.asarray(h))
  text = jax.jit(_streamed_forward).lower(Wh, xd).compile().as_text()
  assert "S(5)" in text
  assert hlo_lib.hlo_violations(text, target=stream.FETCH_TARGET) == []
  assert _host_writes(text) == []


def test_gpu_forward_and_sent_grads_equal_device(gpu):
  W, x = _problem(jnp.bfloat16, num_layers=8, m=1024, batch=512, seed=3)
  h, G = _run_streamed(W, x, gpu)
  text = jax.jit(_streamed_forward_backward, donate_argnums=1,
                 out_shardings=(_sharding("device", gpu), _sharding("pinned_host", gpu))).lower(
      _put(W, "pinned_host", gpu), _put(jnp.zeros_like(W), "pinned_host", gpu),
      _put(x, "device", gpu)).compile().as_text()
  for target in stream.TARGETS:
    assert hlo_lib.hlo_violations(text, target=target) == [], target
  # G is written only by the sends, in place: XLA adds no copy into host memory.
  assert _host_writes(text) == []
  # The fetches are copies: each slice the loop used has exactly the bytes of its layer.
  def with_slices(W, G, x):
    fetched = []
    h, G = _streamed_forward_backward(W, G, x, fetched=fetched)
    return h, G, fetched
  _, _, fetched = jax.jit(with_slices, donate_argnums=1, out_shardings=(
      _sharding("device", gpu), _sharding("pinned_host", gpu), _sharding("device", gpu)))(
          _put(W, "pinned_host", gpu), _put(jnp.zeros_like(W), "pinned_host", gpu),
          _put(x, "device", gpu))
  W_bits = np.asarray(W).view(np.uint16)
  layers = list(range(W.shape[0])) + list(reversed(range(W.shape[0])))
  assert len(fetched) == len(layers)
  for l, w in zip(layers, fetched):
    assert w.sharding.memory_kind == "device"
    np.testing.assert_array_equal(np.asarray(w).view(np.uint16), W_bits[l], err_msg=f"layer {l}")
  # The loop's result against the same layers on device-resident weights. Not bitwise: the two
  # programs are fused differently and cuBLAS picks its bf16 gemm algorithm per program (on the
  # H200 ~2% of h were 1 bf16 ulp apart, at most 2^-8); after 8 tanh layers of 1024 the gap
  # stays at a few bf16 ulps of values in [-1, 1].
  xd = _put(x, "device", gpu)
  Wd = _put(W, "device", gpu)
  ref_h = jax.jit(_materialized_forward)(Wd, xd)
  ref_g = jax.jit(_plain_grad)(Wd, xd)
  hf, rh = np.asarray(h.astype(jnp.float32)), np.asarray(ref_h.astype(jnp.float32))
  np.testing.assert_allclose(hf, rh, rtol=2 ** -7, atol=2 ** -6,
                             err_msg=f"max abs diff {np.abs(hf - rh).max()}")
  if not np.array_equal(hf, rh):
    print(f"h differs from the device program's in {np.mean(hf != rh):.2%} of elements, "
          f"max {np.abs(hf - rh).max()}")
  g, rg = np.asarray(G.astype(jnp.float32)), np.asarray(ref_g.astype(jnp.float32))
  # Same per-layer primitives in both programs; should XLA fuse the two differently on the GPU,
  # the difference stays at bf16 rounding (the message reports it).
  # bf16 backpropagation through 8 layers: the two programs' roundings compound (seen on the
  # H200: up to 2% of the largest gradient in single elements), so compare as a whole.
  rel = float(np.linalg.norm(g - rg) / np.linalg.norm(rg))
  assert rel <= 2 ** -5, f"relative L2 difference {rel}, max abs diff {np.abs(g - rg).max()}"
  if not np.array_equal(g, rg):
    print(f"sent grads differ from jax.grad's at bf16 rounding: max {np.abs(g - rg).max()}")


def test_gpu_fetched_slices_stay_bounded(gpu):
  temp = _bounded_temp_check(gpu, 8, 1024, 512, jnp.bfloat16)
  print(f"temp_size_in_bytes={temp}")
