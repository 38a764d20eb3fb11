"""DHA scatter_add (the gradient rows of a host-resident table, added into a pinned_host buffer
in place): values against numpy, in place, the compiled HLO, errors, GPU.

gather and matmul, the rest of the family, are tested through `jaxtier.experimental.dha`
(tests/experimental/dha_test.py).
"""

import doctest

import hypothesis
from hypothesis import strategies as st
import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxtier._src.lowering import hlo as hlo_lib
from jaxtier._src.primitives import base as ffi
from jaxtier._src.primitives import dha

# The CPU tests run on the CPU backend wherever they run (on the H200 too); the GPU tests below
# take the `gpu` fixture.
CPU = jax.devices("cpu")[0]
DTYPES = [jnp.float32, jnp.bfloat16]


pytestmark = pytest.mark.usefixtures("cpu_unless_gpu")


def _shardings(device=None):
  mesh = Mesh([device if device is not None else CPU], ("d",))
  return (NamedSharding(mesh, P(), memory_kind="pinned_host"),
          NamedSharding(mesh, P(), memory_kind="device"))


def _step(device=None):
  """scatter_add jitted as it is meant to run: the pinned_host buffer donated and returned."""
  host, dev = _shardings(device)
  return jax.jit(dha.scatter_add, donate_argnums=0, in_shardings=(host, dev, dev),
                 out_shardings=host)


def _read(x):
  """`x` as numpy, through a device copy (no numpy view of a pinned_host buffer survives)."""
  if x.sharding.memory_kind == "pinned_host":
    x = jax.device_put(x, x.sharding.with_memory_kind("device"))
  return np.asarray(x)


def _want(num_rows, dim, ids, rows, dtype):
  """numpy: fp32 sums in the order of n (np.add.at), rounded once to the buffer's dtype."""
  ids = np.asarray(ids).reshape(-1)
  rows = np.asarray(rows).reshape(-1, dim)
  valid = (ids >= 0) & (ids < num_rows)
  acc = np.zeros((num_rows, dim), np.float32)
  np.add.at(acc, ids[valid], rows[valid].astype(np.float32))
  return np.asarray(jnp.asarray(acc, dtype))


def _assert_bits_equal(got, want):
  got, want = np.asarray(got), np.asarray(want)
  assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.dtype)
  bits = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
  diff = np.flatnonzero(got.view(bits) != want.view(bits))
  assert diff.size == 0, (diff[:5], got.reshape(-1)[diff[:5]], want.reshape(-1)[diff[:5]])


def _problem(num_rows, dim, ids_shape, rows_dtype, seed):
  rng = np.random.default_rng(seed)
  ids = rng.integers(-8, num_rows + 8, size=ids_shape).astype(np.int32)  # some out of range
  flat = ids.reshape(-1)
  # Padding and edge ids, and one row hit three times (the order of its sums matters).
  flat[:7] = [-1, num_rows, num_rows - 1, 0, 3, 3, 3][:flat.size]
  rows = np.asarray(jnp.asarray(rng.normal(size=ids_shape + (dim,)), rows_dtype))
  return ids, rows


def _run(buffer_dtype, rows_dtype, num_rows, dim, ids, rows, device=None):
  host, _ = _shardings(device)
  buf = jax.device_put(jnp.full((num_rows, dim), 7.0, buffer_dtype), host)  # not read
  return _step(device)(buf, ids, rows)


# ---- values -----------------------------------------------------------------------------------

@pytest.mark.parametrize("buffer_dtype", DTYPES)
@pytest.mark.parametrize("rows_dtype", DTYPES)
@pytest.mark.parametrize("ids_shape", [(), (1,), (37,), (4, 9), (0,), (2, 0, 3)])
def test_scatter_add_matches_numpy(buffer_dtype, rows_dtype, ids_shape):
  ids, rows = _problem(50, 19, ids_shape, rows_dtype, seed=len(ids_shape))
  got = _run(buffer_dtype, rows_dtype, 50, 19, ids, rows)
  assert got.shape == (50, 19) and got.dtype == jnp.dtype(buffer_dtype)
  assert got.sharding.memory_kind == "pinned_host"
  _assert_bits_equal(_read(got), _want(50, 19, ids, rows, buffer_dtype))


def _zeroed_case(device, buffer_dtype, rows_dtype, num_rows=300, dim=19, seed=3):
  """A buffer zero but for two rows no id names: `zeroed=True` writes only the ids' rows."""
  ids, rows = _problem(num_rows, dim, (4, 37), rows_dtype, seed=seed)
  named = np.zeros(num_rows, bool)
  named[ids[(ids >= 0) & (ids < num_rows)]] = True
  start = np.zeros((num_rows, dim), np.float32)
  free = np.flatnonzero(~named)[:2]
  start[free] = 5.0
  host, dev = _shardings(device)
  f = jax.jit(lambda b, i, r: dha.scatter_add(b, i, r, zeroed=True), donate_argnums=0,
              in_shardings=(host, dev, dev), out_shardings=host)
  got = f(jax.device_put(jnp.asarray(start, buffer_dtype), host), ids, rows)
  want = np.asarray(_want(num_rows, dim, ids, rows, buffer_dtype)).copy()
  want[free] = np.asarray(jnp.asarray(start[free], buffer_dtype))
  _assert_bits_equal(_read(got), want)
  assert got.sharding.memory_kind == "pinned_host"


@pytest.mark.parametrize("buffer_dtype", DTYPES)
@pytest.mark.parametrize("rows_dtype", DTYPES)
def test_scatter_add_into_a_zeroed_buffer_writes_only_the_ids_rows(buffer_dtype, rows_dtype):
  _zeroed_case(CPU, buffer_dtype, rows_dtype)


@pytest.mark.parametrize("buffer_dtype", DTYPES)
def test_gpu_scatter_add_into_a_zeroed_buffer(gpu, buffer_dtype):
  _zeroed_case(gpu, buffer_dtype, jnp.bfloat16, num_rows=3000, dim=64)


@pytest.mark.parametrize("buffer_dtype", DTYPES)
def test_bf16_buffer_rounds_each_sum_once(buffer_dtype):
  # 1 + 256 * 2^-9: the fp32 sum is 1.5, exact in bf16. Added up in bf16 instead, each
  # 1 + 2^-9 would round back to 1 (half an ulp, to even): the sum would stay 1.
  ids = np.zeros((257,), np.int32)
  rows = np.full((257, 2), 2.0 ** -9, np.float32)
  rows[0] = 1.0
  got = _read(_run(buffer_dtype, jnp.float32, 3, 2, ids, rows))
  np.testing.assert_array_equal(got.astype(np.float32), [[1.5, 1.5], [0, 0], [0, 0]])


def test_large_call_runs_on_the_thread_pool_with_the_same_bits():
  # 20,000 ids x 128 (above the handler's 2^17 elements: the adds are split over the pool by
  # row), 20 / 10 MiB buffers (zeroed, or for bf16 written, by the pool in tasks of rows), a
  # skewed id distribution (row 0 hit often).
  rng = np.random.default_rng(7)
  num_rows, dim = 40_000, 128
  ids = np.where(rng.random(20_000) < 0.3, 0, rng.integers(-100, num_rows + 100, 20_000))
  ids = ids.astype(np.int32)
  for buffer_dtype in DTYPES:
    rows = np.asarray(jnp.asarray(rng.normal(size=(20_000, dim)), jnp.bfloat16))
    got = _read(_run(buffer_dtype, jnp.bfloat16, num_rows, dim, ids, rows))
    _assert_bits_equal(got, _want(num_rows, dim, ids, rows, buffer_dtype))


@hypothesis.settings(max_examples=25, deadline=None,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(num_rows=st.integers(1, 9), dim=st.integers(1, 4),
                  ids=st.lists(st.integers(-3, 11), max_size=24),
                  buffer_dtype=st.sampled_from(DTYPES), rows_dtype=st.sampled_from(DTYPES),
                  seed=st.integers(0, 2 ** 16))
def test_scatter_add_matches_numpy_hypothesis(num_rows, dim, ids, buffer_dtype, rows_dtype,
                                              seed):
  ids = np.asarray(ids, np.int32)
  rows = np.asarray(jnp.asarray(np.random.default_rng(seed).normal(size=ids.shape + (dim,)),
                                rows_dtype))
  with jax.default_device(CPU):
    got = _run(buffer_dtype, rows_dtype, num_rows, dim, ids, rows)
  _assert_bits_equal(_read(got), _want(num_rows, dim, ids, rows, buffer_dtype))


def test_other_integer_ids_keep_out_of_range_out():
  rows = np.arange(8.0, dtype=np.float32).reshape(4, 2)
  for ids in (np.asarray([0, 5, 6, 200], np.uint8), np.asarray([-1, 3, 5, -32768], np.int16),
              np.asarray([1, 2 ** 31 + 1, 6, 0], np.uint32)):
    got = _read(_run(jnp.float32, jnp.float32, 6, 2, ids, rows))
    np.testing.assert_array_equal(got, _want(6, 2, ids.astype(np.int64), rows, jnp.float32))


def test_empty_buffer():
  got = _run(jnp.float32, jnp.float32, 0, 3, np.asarray([0, -1], np.int32), np.ones((2, 3)))
  assert got.shape == (0, 3) and got.sharding.memory_kind == "pinned_host"
  got = _run(jnp.bfloat16, jnp.float32, 4, 0, np.asarray([0, 1], np.int32), np.ones((2, 0)))
  assert got.shape == (4, 0)


# ---- in place ---------------------------------------------------------------------------------

def test_donated_buffer_is_written_in_place():
  host, _ = _shardings()
  step = _step()
  ids, rows = _problem(30, 8, (25,), jnp.float32, seed=3)
  buf = jax.device_put(jnp.ones((30, 8), jnp.float32), host)
  pointer = buf.unsafe_buffer_pointer()
  out = step(buf, ids, rows)
  assert buf.is_deleted()  # donated: the caller's buffer is consumed
  assert out.sharding.memory_kind == "pinned_host"
  assert out.unsafe_buffer_pointer() == pointer  # the same host memory, written
  again = step(out, ids[::-1].copy(), rows[::-1].copy())  # and again: zeroed first
  assert again.unsafe_buffer_pointer() == pointer
  _assert_bits_equal(_read(again), _want(30, 8, ids[::-1], rows[::-1], jnp.float32))


def test_undonated_buffer_is_left_alone():
  # Without donation XLA copies the buffer first (slow; the docstring says so): the caller's
  # buffer keeps its values.
  host, dev = _shardings()
  buf = jax.device_put(jnp.full((5, 2), 7.0, jnp.float32), host)
  f = jax.jit(dha.scatter_add, in_shardings=(host, dev, dev), out_shardings=host)
  out = f(buf, np.asarray([1, 1], np.int32), np.ones((2, 2), np.float32))
  np.testing.assert_array_equal(_read(buf), np.full((5, 2), 7.0))
  np.testing.assert_array_equal(_read(out), [[0, 0], [2, 2], [0, 0], [0, 0], [0, 0]])


def test_docstring_example():
  finder = doctest.DocTestFinder()
  runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
  for test in finder.find(dha.scatter_add, "scatter_add", globs={}):
    runner.run(test)
  assert runner.failures == 0 and runner.tries > 0, (runner.failures, runner.tries)


# ---- HLO guard: the buffer reaches the call untouched, and the call writes it in place ---------

def _embedding_step(table, grad, ids, ct):
  """Forward gather from the host table, backward scatter-add of the rows' cotangent into the
  host gradient buffer: no table-sized array on the device."""
  rows, vjp = jax.vjp(lambda r: r, dha.gather(table, ids))
  (g_rows,) = vjp(ct * rows)  # the cotangent of the rows of some loss
  return dha.scatter_add(grad, ids, g_rows)


def _guarded_programs(device):
  host, dev = _shardings(device)
  grad = jax.device_put(jnp.zeros((64, 16), jnp.float32), host)
  grad_bf16 = jax.device_put(jnp.zeros((64, 16), jnp.bfloat16), host)
  table = jax.device_put(jnp.ones((64, 16), jnp.bfloat16), host)
  ids = jax.device_put(jnp.asarray([[1, 2, 3], [3, -1, 70]], jnp.int32), dev)
  rows = jax.device_put(jnp.ones((2, 3, 16), jnp.bfloat16), dev)
  step = jax.jit(_embedding_step, donate_argnums=1, in_shardings=(host, host, dev, dev),
                 out_shardings=host)
  return [
      _step(device).lower(grad, ids, rows),
      _step(device).lower(grad_bf16, ids, rows.astype(jnp.float32)),
      step.lower(table, grad_bf16, ids, rows),
  ]


def _check_guard(device):
  for lowered in _guarded_programs(device):
    hlo = lowered.compile().as_text()
    target = dha.SCATTER_ADD_TARGET
    calls = [l for l in hlo.splitlines() if f'custom_call_target="{target}"' in l]
    assert len(calls) == 1, hlo
    assert "output_to_operand_aliasing={{}: (0, {})}" in calls[0], calls[0]
    assert "S(5)" in hlo.split("\n", 1)[0]  # the buffer (and the result) in host memory
    assert "input_output_alias=" in hlo.split("\n", 1)[0]  # donated: the same buffer
    assert hlo_lib.hlo_violations(hlo, target=target) == [], hlo


def test_hlo_guard_cpu():
  _check_guard(CPU)


def test_hlo_guard_flags_a_sliced_buffer():
  # What the API forbids, done by hand: a transformed buffer is moved or computed on first.
  host, dev = _shardings()
  grad = jax.device_put(jnp.zeros((8, 4), jnp.float32), host)
  bad = jax.jit(lambda g, i, r: dha.scatter_add(jax.device_put(g[:6], jax.memory.Space.Host),
                                                i, r),
                in_shardings=(host, dev, dev))
  hlo = bad.lower(grad, jnp.asarray([1], jnp.int32), jnp.ones((1, 4))).compile().as_text()
  assert hlo_lib.hlo_violations(hlo, target=dha.SCATTER_ADD_TARGET) != []


# ---- the pure-JAX reference (JAXTIER_DISABLE_FFI=1) -------------------------------------------

@pytest.mark.parametrize("buffer_dtype", DTYPES)
def test_reference_path_matches_and_calls_nothing(monkeypatch, buffer_dtype):
  monkeypatch.setenv("JAXTIER_DISABLE_FFI", "1")
  host, _ = _shardings()
  ids, rows = _problem(40, 6, (3, 20), jnp.bfloat16, seed=9)
  buf = jax.device_put(jnp.zeros((40, 6), buffer_dtype), host)
  assert dha.SCATTER_ADD_TARGET not in _step().lower(buf, ids, rows).compile().as_text()
  got = _run(buffer_dtype, jnp.bfloat16, 40, 6, ids, rows)
  assert got.sharding.memory_kind == "pinned_host" and got.dtype == jnp.dtype(buffer_dtype)
  # XLA's scatter picks the order of the additions: equal within the rounding of the sums.
  want = _want(40, 6, ids, rows, buffer_dtype).astype(np.float32)
  tol = 1e-6 if buffer_dtype == jnp.float32 else 2.0 ** -8
  np.testing.assert_allclose(_read(got).astype(np.float32), want, rtol=tol, atol=1e-6)


# ---- bad inputs -------------------------------------------------------------------------------

def _host(x):
  return jax.device_put(x, _shardings()[0])


@pytest.mark.parametrize("make, err, match", [
    (lambda: (_host(jnp.zeros((5,))), [0], jnp.ones((1,))), ValueError, r"2-D buffer \[V, D\]"),
    (lambda: (_host(jnp.zeros((5, 3), jnp.int32)), [0], jnp.ones((1, 3))), TypeError,
     "buffer of dtype float32 or bfloat16, got int32"),
    (lambda: (_host(jnp.zeros((5, 3), jnp.float16)), [0], jnp.ones((1, 3))), TypeError,
     "buffer of dtype float32 or bfloat16, got float16"),
    (lambda: (_host(jnp.zeros((5, 3))), jnp.asarray([0.0]), jnp.ones((1, 3))), TypeError,
     "integer ids"),
    (lambda: (_host(jnp.zeros((5, 3))), jnp.asarray([True]), jnp.ones((1, 3))), TypeError,
     "integer ids"),
    (lambda: (_host(jnp.zeros((5, 3))), [0], jnp.ones((1, 3), jnp.float16)), TypeError,
     "rows of dtype float32 or bfloat16, got float16"),
    (lambda: (_host(jnp.zeros((5, 3))), [0, 1], jnp.ones((2, 4))), ValueError,
     r"rows of shape \(2, 3\) \(ids.shape \(2,\) \+ \[D\] with D = 3, the buffer's row length\), "
     r"got \(2, 4\)"),
    (lambda: (_host(jnp.zeros((5, 3))), [[0, 1]], jnp.ones((2, 3))), ValueError,
     r"rows of shape \(1, 2, 3\)"),
    (lambda: (jnp.zeros((5, 3)), [0], jnp.ones((1, 3))), ValueError,
     "buffer in pinned_host memory, got memory kind 'device' .* memory_kind='pinned_host'"),
])
def test_bad_inputs_raise_clear_errors(make, err, match):
  buffer, ids, rows = make()
  with pytest.raises(err, match=match):
    dha.scatter_add(buffer, jnp.asarray(ids), rows)


def test_traced_buffer_typed_in_device_memory_is_let_through():
  # Lowered from a spec without a sharding, a pinned_host argument is typed in device memory
  # inside the trace (jax 0.10) although XLA puts it in host memory: the call must compile,
  # in place, with nothing moved.
  host, dev = _shardings()
  spec = jax.ShapeDtypeStruct((64, 16), jnp.float32)
  hlo = _step().lower(spec, jnp.zeros((5,), jnp.int32), jnp.ones((5, 16))).compile().as_text()
  assert "S(5)" in hlo.split("\n", 1)[0]
  assert hlo_lib.hlo_violations(hlo, target=dha.SCATTER_ADD_TARGET) == [], hlo


def _raw_call(buffer, ids, rows, aliases):
  ffi.ensure_registered()
  call = jax.ffi.ffi_call(dha.SCATTER_ADD_TARGET, jax.typeof(buffer),
                          input_output_aliases=aliases)
  return jax.jit(lambda b, i, r: call(b, i, r, zeroed=np.int32(0)), donate_argnums=0)(
      buffer, ids, rows).block_until_ready()


def test_handler_checks_its_operands():
  # Bypassing the Python checks: the handler itself names the op and the operand.
  host, _ = _shardings()
  ids = jnp.asarray([0, 1], jnp.int32)
  with pytest.raises(Exception, match=r"Invalid alias for result 0 to jaxtier_dha_scatter_add. "
                     r"Expected the buffer of input 0"):
    _raw_call(jax.device_put(jnp.zeros((4, 3)), host), ids, jnp.ones((2, 3)), {})
  with pytest.raises(Exception, match=r"Invalid shape for input 2 \(rows\) to "
                     r"jaxtier_dha_scatter_add. Expected \[2, 3\] \(ids shape \+ \[D\]\), got "
                     r"\[2, 5\]"):
    _raw_call(jax.device_put(jnp.zeros((4, 3)), host), ids, jnp.ones((2, 5)), {0: 0})
  with pytest.raises(Exception, match=r"Invalid dtype for input 2 \(rows\) to "
                     r"jaxtier_dha_scatter_add. Expected float32 or bfloat16, got float16"):
    _raw_call(jax.device_put(jnp.zeros((4, 3)), host), ids, jnp.ones((2, 3), jnp.float16),
              {0: 0})


def test_not_batchable():
  host, _ = _shardings()
  buf = jax.device_put(jnp.zeros((4, 2)), host)
  with pytest.raises(Exception):
    jax.vmap(lambda r: dha.scatter_add(buf, jnp.asarray([0]), r))(jnp.ones((3, 1, 2)))


# ---- GPU: the host CPUs write the buffer, fed by staged chunks -------------------------------

@pytest.mark.parametrize("buffer_dtype", DTYPES)
@pytest.mark.parametrize("rows_dtype", DTYPES)
@pytest.mark.parametrize("chunk_bytes", [None, 4096])
def test_gpu_scatter_add(gpu, monkeypatch, buffer_dtype, rows_dtype, chunk_bytes):
  # 4 KiB slots (the minimum): 29 ids of 64 bf16 values or 14 of 64 f32 per chunk, so 2,000
  # ids run in 69 or 143 chunks through the two slots; else one chunk. Row 5, hit in every
  # chunk, is summed in fp32 across them (bf16 buffer) and rounded once.
  if chunk_bytes:
    monkeypatch.setenv("JAXTIER_DHA_SCATTER_CHUNK_BYTES", str(chunk_bytes))
  num_rows, dim = 3000, 64
  ids, rows = _problem(num_rows, dim, (4, 500), rows_dtype, seed=11)
  ids.reshape(-1)[::7] = 5
  host, dev = _shardings(gpu)
  f = jax.jit(lambda b, i, r: dha.scatter_add(b, i, r), donate_argnums=0,
              in_shardings=(host, dev, dev), out_shardings=host)
  buf = jax.device_put(jnp.full((num_rows, dim), 7.0, buffer_dtype), host)
  pointer = buf.unsafe_buffer_pointer()
  got = f(buf, ids, rows)
  assert got.sharding.memory_kind == "pinned_host" and got.unsafe_buffer_pointer() == pointer
  want = _want(num_rows, dim, ids, rows, buffer_dtype)
  _assert_bits_equal(_read(got), want)
  again = f(got, ids, rows)  # the staging and the bf16 sums reused: the same bits
  _assert_bits_equal(_read(again), want)


def test_gpu_two_calls_and_device_work_after(gpu, monkeypatch):
  # Two call sites in one program, each followed by device work that reads its buffer: XLA's
  # stream must see the buffers finished.
  monkeypatch.setenv("JAXTIER_DHA_SCATTER_CHUNK_BYTES", "8192")
  host, dev = _shardings(gpu)
  ids, rows = _problem(20_000, 32, (6000,), jnp.float32, seed=13)

  def prog(a, b, ids, rows):
    a = dha.scatter_add(a, ids, rows)
    b = dha.scatter_add(b, ids[::-1], rows[::-1] * 2)
    return a, b, jnp.sum(jax.device_put(a, jax.memory.Space.Device)) + jnp.sum(
        jax.device_put(b, jax.memory.Space.Device))

  f = jax.jit(prog, donate_argnums=(0, 1), in_shardings=(host, host, dev, dev),
              out_shardings=(host, host, dev))
  a = jax.device_put(jnp.ones((20_000, 32), jnp.float32), host)
  b = jax.device_put(jnp.ones((20_000, 32), jnp.bfloat16), host)
  a, b, total = f(a, b, ids, rows)
  want_a = _want(20_000, 32, ids, rows, jnp.float32)
  want_b = _want(20_000, 32, ids[::-1], rows[::-1] * 2, jnp.bfloat16)
  _assert_bits_equal(_read(a), want_a)
  _assert_bits_equal(_read(b), want_b)
  np.testing.assert_allclose(float(total), want_a.sum() + want_b.astype(np.float32).sum(),
                             rtol=1e-4)


def test_gpu_handler_rejects_a_device_buffer(gpu):
  _, dev = _shardings(gpu)
  with pytest.raises(Exception, match=r"Invalid memory for input 0 \(buffer\) to "
                     r"jaxtier_dha_scatter_add. Expected host memory"):
    _raw_call(jax.device_put(jnp.zeros((4, 3)), dev), jax.device_put(jnp.asarray([0, 1]), dev),
              jax.device_put(jnp.ones((2, 3)), dev), {0: 0})


def test_hlo_guard_gpu(gpu):
  _check_guard(gpu)
