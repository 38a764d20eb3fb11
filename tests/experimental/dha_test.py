"""DHA compute (gather, matmul on host-resident operands): values, gradients, HLO guard, GPU."""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxtier._src.primitives import base as ffi
from jaxtier.experimental import dha
from jaxtier._src.lowering import hlo as hlo_lib

DTYPES = [jnp.float32, jnp.bfloat16]


def _shardings(device):
  mesh = Mesh([device], ("d",))
  return (NamedSharding(mesh, P(), memory_kind="pinned_host"),
          NamedSharding(mesh, P(), memory_kind="device"))


def _cpu():
  return jax.devices("cpu")[0]


def _f64(a):
  return np.asarray(np.asarray(a, np.float32), np.float64)


def _assert_matmul_close(got, x, layer, dtype):
  """|got - x @ layer| within fp32 accumulation error, plus one rounding to `dtype`."""
  xf, wf = _f64(x), _f64(layer)
  want = xf @ wf
  scale = np.abs(xf) @ np.abs(wf)
  bound = 1e-5 * scale + 1e-30
  if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16):
    bound = bound + 2.0 ** -8 * np.abs(want)  # y rounded once to bf16 (half an ulp: 2^-9)
  err = np.abs(_f64(got) - want)
  assert got.shape == want.shape
  worst = np.unravel_index(np.argmax(err - bound), err.shape)
  assert np.all(err <= bound), (worst, err[worst], bound[worst])


def _gather_want(table, ids):
  t = np.asarray(table)
  ids = np.asarray(ids)
  valid = (ids >= 0) & (ids < t.shape[0])
  rows = t[np.where(valid, ids, 0)]
  return np.where(valid[..., None], rows, np.zeros((), t.dtype))


# ---- gather -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("ids_shape", [(), (1,), (37,), (4, 9), (0,)])
def test_gather_from_pinned_host_matches_numpy(dtype, ids_shape):
  host, dev = _shardings(_cpu())
  rng = np.random.default_rng(len(ids_shape))
  table = jnp.asarray(rng.normal(size=(50, 19)), dtype)
  ids = rng.integers(-8, 58, size=ids_shape).astype(np.int32)  # ~25% out of range
  if ids.size >= 4:
    ids.flat[:4] = [-1, 50, 49, 0]
  f = jax.jit(dha.gather, in_shardings=(host, dev))
  got = f(jax.device_put(table, host), jax.device_put(ids, dev))
  assert got.shape == ids_shape + (19,) and got.dtype == jnp.dtype(dtype)
  assert got.sharding.memory_kind == "device"
  np.testing.assert_array_equal(np.asarray(got), _gather_want(table, ids))


def test_gather_converts_other_integer_ids_keeping_out_of_range():
  table = jnp.arange(12.0, dtype=jnp.float32).reshape(6, 2)
  ids = jnp.asarray([0, 5, 6, 200], jnp.uint8)
  got = jax.jit(dha.gather)(table, ids)
  np.testing.assert_array_equal(np.asarray(got), [[0, 1], [10, 11], [0, 0], [0, 0]])
  got16 = jax.jit(dha.gather)(table, jnp.asarray([-1, 3], jnp.int16))
  np.testing.assert_array_equal(np.asarray(got16), [[0, 0], [6, 7]])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_gather_grad_matches_jnp(dtype):
  # The gradient sums the cotangent rows of repeated ids with a scatter-add, whose order of
  # additions (and, in bf16, whose accumulation) is the backend's. So the jnp reference runs on
  # the same backend as the call (the CPU, also on a GPU machine, where the default device is
  # the GPU: its scatter-add summed id 3's three rows in another order, 1 f32 ulp off, and in
  # bf16 rounded otherwise). Both are then checked against float64 numpy within the rounding
  # of the three additions.
  cpu = _cpu()
  host, dev = _shardings(cpu)
  rng = np.random.default_rng(1)
  ids = np.asarray([[3, 3, 0, -1], [11, 12, 3, 7]], np.int32)  # repeats and out-of-range
  with jax.default_device(cpu):
    table = jnp.asarray(rng.normal(size=(12, 5)), dtype)
    ct = jnp.asarray(rng.normal(size=(2, 4, 5)), dtype)

    def loss(t, i):
      return jnp.sum((dha.gather(t, i) * ct).astype(jnp.float32))

    def loss_jnp(t, i):
      valid = (i >= 0) & (i < t.shape[0])
      rows = jnp.take(t, jnp.clip(i, 0, t.shape[0] - 1), axis=0)
      return jnp.sum((jnp.where(valid[..., None], rows, 0) * ct).astype(jnp.float32))

    got = jax.jit(jax.grad(loss), in_shardings=(host, dev))(jax.device_put(table, host), ids)
    want = jax.grad(loss_jnp)(table, jnp.asarray(ids))
  assert got.sharding.memory_kind == "pinned_host"  # typed like its primal
  assert next(iter(want.devices())).platform == "cpu"
  got32 = np.asarray(got, np.float32)
  np.testing.assert_array_equal(got32, np.asarray(want, np.float32))
  # float64: row v gets the sum of ct's rows at the valid ids equal to v.
  valid = (ids >= 0) & (ids < 12)
  ct64 = _f64(ct).reshape(-1, 5)
  exact = np.zeros((12, 5))
  size = np.zeros((12, 5))
  np.add.at(exact, ids.reshape(-1)[valid.reshape(-1)], ct64[valid.reshape(-1)])
  np.add.at(size, ids.reshape(-1)[valid.reshape(-1)], np.abs(ct64[valid.reshape(-1)]))
  eps = 2.0 ** -24 if dtype == jnp.float32 else 2.0 ** -9  # half an ulp, relative
  assert np.all(np.abs(got32 - exact) <= 3 * eps * size), np.abs(got32 - exact) / size
  assert np.all(got32[[1, 2, 4, 5, 6, 8, 9, 10]] == 0)
  assert np.all(got32[[0, 3, 7, 11]] != 0)


# ---- matmul -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("m", [1, 5, 67])
def test_matmul_from_pinned_host_matches_numpy(dtype, stacked, transpose, m):
  host, dev = _shardings(_cpu())
  rng = np.random.default_rng(m)
  k, n = 130, 37  # odd sizes, not multiples of any tile
  w = jnp.asarray(rng.normal(size=(3, k, n) if stacked else (k, n)), dtype)
  x = jnp.asarray(rng.normal(size=(m, n if transpose else k)), dtype)
  index = 2 if stacked else None
  op = dha.matmul_t if transpose else dha.matmul
  f = jax.jit(lambda x, w: op(x, w, index=index), in_shardings=(dev, host))
  got = f(jax.device_put(x, dev), jax.device_put(w, host))
  layer = np.asarray(w[2] if stacked else w, np.float32)
  assert got.dtype == jnp.dtype(dtype) and got.sharding.memory_kind == "device"
  _assert_matmul_close(got, x, layer.T if transpose else layer, dtype)


def test_matmul_leading_dims_and_empty_contraction():
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(2, 3, 8)), jnp.float32)
  w = jnp.asarray(rng.normal(size=(8, 5)), jnp.float32)
  got = jax.jit(dha.matmul)(x, w)
  assert got.shape == (2, 3, 5)
  _assert_matmul_close(got.reshape(6, 5), x.reshape(6, 8), w, jnp.float32)
  empty = jax.jit(dha.matmul)(jnp.ones((4, 0)), jnp.ones((0, 3)))
  np.testing.assert_array_equal(np.asarray(empty), np.zeros((4, 3)))


def _loss_and_ref(index, transpose):
  op = dha.matmul_t if transpose else dha.matmul

  def loss(x, w):
    return jnp.sum(jnp.tanh(op(x, w, index=index).astype(jnp.float32)))

  def loss_jnp(x, w):
    layer = w if index is None else w[index]
    return jnp.sum(jnp.tanh((x @ (layer.T if transpose else layer)).astype(jnp.float32)))
  return loss, loss_jnp


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("stacked", [False, True])
@pytest.mark.parametrize("transpose", [False, True])
def test_matmul_grads_match_jnp(dtype, stacked, transpose):
  host, dev = _shardings(_cpu())
  rng = np.random.default_rng(3)
  k, n, m = 21, 13, 6
  w = jnp.asarray(rng.normal(size=(2, k, n) if stacked else (k, n)) * 0.3, dtype)
  x = jnp.asarray(rng.normal(size=(m, n if transpose else k)), dtype)
  index = 1 if stacked else None
  loss, loss_jnp = _loss_and_ref(index, transpose)
  gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=(dev, host))(
      jax.device_put(x, dev), jax.device_put(w, host))
  # The jnp reference in fp32 from the same (rounded) inputs.
  rx, rw = jax.grad(loss_jnp, argnums=(0, 1))(x.astype(jnp.float32), w.astype(jnp.float32))
  assert gx.dtype == jnp.dtype(dtype) and gw.dtype == jnp.dtype(dtype)
  assert gw.shape == w.shape and gw.sharding.memory_kind == "pinned_host"
  tol = dict(rtol=1e-5, atol=1e-6) if dtype == jnp.float32 else dict(rtol=2e-2, atol=2e-2)
  np.testing.assert_allclose(np.asarray(gx, np.float32), np.asarray(rx), **tol)
  np.testing.assert_allclose(np.asarray(gw, np.float32), np.asarray(rw), **tol)
  if stacked:  # the other layer gets nothing
    assert not np.any(np.asarray(gw, np.float32)[0])


def test_matmul_bwd_gives_one_layer_on_device():
  host, dev = _shardings(_cpu())
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.normal(size=(3, 9, 7)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(5, 9)), jnp.float32)
  g = jnp.asarray(rng.normal(size=(5, 7)), jnp.float32)
  f = jax.jit(lambda x, w, g: dha.matmul_bwd(x, w, g, index=2), in_shardings=(dev, host, dev))
  dx, dw = f(x, jax.device_put(w, host), g)
  _, vjp = jax.vjp(lambda x, l: x @ l, x, w[2])
  rx, rl = vjp(g)
  assert dw.shape == (9, 7) and dw.sharding.memory_kind == "device"
  np.testing.assert_allclose(np.asarray(dx), np.asarray(rx), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(dw), np.asarray(rl), rtol=1e-5, atol=1e-6)


# ---- the pure-JAX reference (JAXTIER_DISABLE_FFI=1) -------------------------------------------

def test_reference_path_matches_and_calls_nothing(monkeypatch):
  monkeypatch.setenv("JAXTIER_DISABLE_FFI", "1")
  host, dev = _shardings(_cpu())
  rng = np.random.default_rng(5)
  w = jax.device_put(jnp.asarray(rng.normal(size=(2, 11, 6)), jnp.float32), host)
  x = jnp.asarray(rng.normal(size=(4, 11)), jnp.float32)
  mm = jax.jit(lambda x, w: dha.matmul(x, w, index=1), in_shardings=(dev, host))
  assert dha.MATMUL_TARGET not in mm.lower(x, w).compile().as_text()
  _assert_matmul_close(mm(x, w), x, np.asarray(w)[1], jnp.float32)
  mt = jax.jit(lambda y, w: dha.matmul_t(y, w, index=0), in_shardings=(dev, host))
  y = jnp.asarray(rng.normal(size=(4, 6)), jnp.float32)
  _assert_matmul_close(mt(y, w), y, np.asarray(w)[0].T, jnp.float32)
  table = jax.device_put(jnp.asarray(rng.normal(size=(7, 3)), jnp.bfloat16), host)
  ids = jnp.asarray([6, 7, -1, 0], jnp.int32)
  ga = jax.jit(dha.gather, in_shardings=(host, dev))
  assert dha.GATHER_TARGET not in ga.lower(table, ids).compile().as_text()
  np.testing.assert_array_equal(np.asarray(ga(table, ids)), _gather_want(table, ids))
  loss, loss_jnp = _loss_and_ref(1, False)
  gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=(dev, host))(x, w)
  rx, rw = jax.grad(loss_jnp, argnums=(0, 1))(x, np.asarray(w))
  np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(np.asarray(gw), np.asarray(rw), rtol=1e-5, atol=1e-6)


# ---- HLO guard: the host operand reaches each custom call untouched ---------------------------

def _guarded_programs(device):
  host, dev = _shardings(device)
  w = jax.device_put(jnp.ones((3, 16, 8), jnp.float32), host)
  x = jax.device_put(jnp.ones((4, 16), jnp.float32), dev)
  table = jax.device_put(jnp.ones((10, 8), jnp.bfloat16), host)
  ids = jax.device_put(jnp.asarray([1, 2, 3], jnp.int32), dev)
  loss, _ = _loss_and_ref(1, False)
  grad_x = jax.jit(jax.grad(loss), in_shardings=(dev, host))
  return [
      (dha.MATMUL_TARGET, jax.jit(lambda x, w: dha.matmul(x, w, index=1),
                                  in_shardings=(dev, host)).lower(x, w), 1),
      (dha.MATMUL_TARGET, jax.jit(lambda y, w: dha.matmul_t(y, w, index=2),
                                  in_shardings=(dev, host)).lower(x[:, :8], w), 1),
      # Forward and backward: both calls read w in place (dx by matmul_t).
      (dha.MATMUL_TARGET, grad_x.lower(x, w), 2),
      (dha.GATHER_TARGET, jax.jit(dha.gather, in_shardings=(host, dev)).lower(table, ids), 1),
  ]


def _check_guard(device):
  for target, lowered, count in _guarded_programs(device):
    hlo = lowered.compile().as_text()
    assert "S(5)" in hlo  # the host operand is in the host memory space
    assert hlo.count(f'custom_call_target="{target}"') == count, hlo
    assert hlo_lib.hlo_violations(hlo, target=target) == [], hlo


def test_hlo_guard_cpu():
  _check_guard(_cpu())


def test_hlo_guard_flags_a_sliced_host_weight():
  # What the API forbids, done by hand: slicing w in JAX makes XLA move the window first.
  host, dev = _shardings(_cpu())
  w = jax.device_put(jnp.ones((3, 16, 8), jnp.float32), host)
  x = jnp.ones((4, 16), jnp.float32)
  bad = jax.jit(lambda x, w: dha.matmul(x, w[1]), in_shardings=(dev, host))
  hlo = bad.lower(x, w).compile().as_text()
  got = hlo_lib.hlo_violations(hlo, target=dha.MATMUL_TARGET)
  assert len(got) == 1 and "from a host parameter" in got[0], got


# ---- bad inputs -------------------------------------------------------------------------------

@pytest.mark.parametrize("call, err, match", [
    (lambda: dha.matmul(jnp.ones((2, 4), jnp.bfloat16), jnp.ones((4, 3), jnp.float32)),
     TypeError, "one dtype"),
    (lambda: dha.matmul(jnp.ones((2, 4), jnp.float16), jnp.ones((4, 3), jnp.float16)),
     TypeError, "float32 or bfloat16"),
    (lambda: dha.matmul(jnp.ones((2, 5)), jnp.ones((4, 3))), ValueError, r"K\) = 4"),
    (lambda: dha.matmul_t(jnp.ones((2, 4)), jnp.ones((4, 3))), ValueError, r"N\) = 3"),
    (lambda: dha.matmul(jnp.ones((2, 4)), jnp.ones((2, 4, 3)), index=2), ValueError,
     r"index in \[0, 2\)"),
    (lambda: dha.matmul(jnp.ones((2, 4)), jnp.ones((2, 4, 3)), index=-1), ValueError,
     r"index in \[0, 2\)"),
    (lambda: dha.matmul(jnp.ones((2, 4)), jnp.ones((2, 4, 3))), ValueError, "layer index"),
    (lambda: dha.matmul(jnp.ones((2, 4)), jnp.ones((4, 3)), index=0), ValueError,
     "index=None"),
    (lambda: dha.matmul(jnp.ones((2, 4)), jnp.ones((2, 4, 3)), index=1.0), TypeError,
     "static Python int"),
    (lambda: dha.matmul(jnp.ones((2, 4)), jnp.ones((4,))), ValueError, r"\[K, N\]"),
    (lambda: dha.gather(jnp.ones((5, 3)), jnp.asarray([0.0, 1.0])), TypeError, "integer ids"),
    (lambda: dha.gather(jnp.ones((5, 3)), jnp.asarray([True])), TypeError, "integer ids"),
    (lambda: dha.gather(jnp.ones((5,)), jnp.asarray([0])), ValueError, "2-D table"),
    (lambda: dha.gather(jnp.ones((5, 3), jnp.int32), jnp.asarray([0])), TypeError,
     "float32, bfloat16 or float16"),
])
def test_bad_inputs_raise_clear_errors(call, err, match):
  with pytest.raises(err, match=match):
    call()


def test_traced_index_is_rejected():
  with pytest.raises(TypeError, match="static Python int"):
    jax.jit(lambda x, w, i: dha.matmul(x, w, index=i))(jnp.ones((2, 4)), jnp.ones((2, 4, 3)),
                                                       jnp.int32(0))


def test_handler_checks_shapes():
  # Bypassing the Python checks: the handler itself names the op and the operand.

  ffi.ensure_registered()
  def call(x, w, index=0, partial=(0,)):
    f = jax.ffi.ffi_call(dha.MATMUL_TARGET, (jax.ShapeDtypeStruct((2, 3), jnp.float32),
                                             jax.ShapeDtypeStruct(partial, jnp.float32)))
    return jax.jit(lambda x, w: f(x, w, index=np.int64(index), transpose=np.int32(0))[0])(
        x, w).block_until_ready()

  with pytest.raises(Exception,
                     match=r"Invalid shape for input 0 \(x\) to jaxtier_dha_matmul"):
    call(jnp.ones((2, 5)), jnp.ones((4, 3)))
  with pytest.raises(Exception, match="Invalid value for attribute index to jaxtier_dha_matmul"):
    call(jnp.ones((2, 4)), jnp.ones((2, 4, 3)), index=3)
  with pytest.raises(Exception, match=r"Invalid shape for result 1 \(partial sums\) to "
                     r"jaxtier_dha_matmul. Expected \[S, 2, 3\] with S >= 2"):
    call(jnp.ones((2, 4)), jnp.ones((4, 3)), partial=(4, 3, 2))
  np.testing.assert_allclose(np.asarray(call(jnp.ones((2, 4)), jnp.ones((4, 3)),
                                             partial=(2, 2, 3))), np.full((2, 3), 4.0))


def test_partial_sums_shape_follows_the_kernel_tiles():
  # 132 SMs (H200): the kernel aims at 4 * 132 = 528 blocks.
  # m = 1 (tile MT 8, BO 256), bf16 (BR 64): 1030 columns -> 5 tiles; R = 1000 -> 16 stages.
  # ceil(528 / 5) = 106 splits, capped at the 16 stages.
  assert dha.matmul_partial_shape(1, 1000, 1030, jnp.bfloat16, 132) == (16, 1, 1030)
  # float32 (BR 32): 32 stages.
  assert dha.matmul_partial_shape(1, 1000, 1030, jnp.float32, 132) == (32, 1, 1030)
  # m = 600 (MT 512, BO 64): 2 chunks x 9 tiles = 18 blocks; ceil(528 / 18) = 30 splits of the
  # 32 stages -> 2 stages per split -> 16 splits.
  assert dha.matmul_partial_shape(600, 1024, 513, jnp.float32, 132) == (16, 600, 513)
  # One stage (R <= BR), enough column tiles, no GPU, or nothing to compute: no split.
  assert dha.matmul_partial_shape(8, 50, 1024, jnp.bfloat16, 132) == (0,)
  assert dha.matmul_partial_shape(4096, 8192, 8192, jnp.bfloat16, 132) == (0,)
  assert dha.matmul_partial_shape(1, 1000, 1030, jnp.bfloat16, 0) == (0,)
  assert dha.matmul_partial_shape(0, 1000, 1030, jnp.bfloat16, 132) == (0,)
  # The 256 MiB cap (binds only for GPUs far larger than an H200): [512, 4096] fp32 is 8 MiB,
  # so 32 of the 1024 stages' splits.
  assert dha.matmul_partial_shape(512, 65536, 4096, jnp.bfloat16, 100000) == (32, 512, 4096)


def test_cpu_handler_ignores_gpu_sized_partial_sums(monkeypatch):
  # On a machine with a GPU the partial sums are sized for it even when the call runs on the
  # CPU: the CPU handler must accept them (and give the same values).
  monkeypatch.setattr(dha, "_num_sms", lambda: 132)
  host, dev = _shardings(_cpu())
  rng = np.random.default_rng(11)
  w = jnp.asarray(rng.normal(size=(2, 300, 40)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(3, 300)), jnp.float32)
  assert dha.matmul_partial_shape(3, 300, 40, jnp.float32, 132)[0] > 1
  f = jax.jit(lambda x, w: dha.matmul(x, w, index=1), in_shardings=(dev, host))
  hlo = f.lower(x, jax.device_put(w, host)).compile().as_text()
  assert "f32[10,3,40]" in hlo, hlo  # the second result: 10 splits of the 10 stages
  got = f(x, jax.device_put(w, host))
  _assert_matmul_close(got, x, np.asarray(w)[1], jnp.float32)


# ---- GPU: the same on the device, the host operand read in place over PCIe ---------------------

@pytest.mark.parametrize("dtype, dim", [(jnp.bfloat16, 4096), (jnp.bfloat16, 67),
                                        (jnp.float32, 33), (jnp.float16, 136)])
def test_gpu_gather(gpu, dtype, dim):
  host, dev = _shardings(gpu)
  rng = np.random.default_rng(dim)
  table = jax.device_put(jnp.asarray(rng.normal(size=(3000, dim)), dtype), host)
  ids = rng.integers(-100, 3100, size=(5, 401)).astype(np.int32)
  f = jax.jit(dha.gather, in_shardings=(host, dev))
  got = f(table, jax.device_put(ids, dev))
  assert got.sharding.memory_kind == "device"
  np.testing.assert_array_equal(np.asarray(got), _gather_want(table, ids))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("transpose", [False, True])
@pytest.mark.parametrize("k, n", [(1000, 1030), (50, 1024), (1024, 513)])
@pytest.mark.parametrize("m", [1, 8, 33, 64, 100, 300, 600])
def test_gpu_matmul(gpu, dtype, transpose, k, n, m):
  host, dev = _shardings(gpu)
  rng = np.random.default_rng(m + k)
  w = jax.device_put(jnp.asarray(rng.normal(size=(2, k, n)), dtype), host)
  x = jax.device_put(jnp.asarray(rng.normal(size=(m, n if transpose else k)), dtype), dev)
  op = dha.matmul_t if transpose else dha.matmul
  got = jax.jit(lambda x, w: op(x, w, index=1), in_shardings=(dev, host))(x, w)
  layer = np.asarray(w, np.float32)[1]
  assert got.sharding.memory_kind == "device"
  _assert_matmul_close(got, x, layer.T if transpose else layer, dtype)


@pytest.mark.parametrize("num_sms", [0, 1, 8, 132])
def test_gpu_matmul_any_split_count(gpu, monkeypatch, num_sms):
  # The kernel splits the reduction as the partial sums' shape says: not at all (0: no GPU
  # seen), into 2 / none (1 SM), 11 / 6 ranges (8 SMs), one range per stage (132: the H200).
  # Each is within the fp32-accumulation bound and bitwise repeatable (fixed-order sums).
  monkeypatch.setattr(dha, "_num_sms", lambda: num_sms)
  host, dev = _shardings(gpu)
  rng = np.random.default_rng(12)
  for dtype, transpose in ((jnp.float32, False), (jnp.bfloat16, True)):
    w = jax.device_put(jnp.asarray(rng.normal(size=(3, 1000, 700)), dtype), host)
    r = 700 if transpose else 1000
    x = jax.device_put(jnp.asarray(rng.normal(size=(5, r)), dtype), dev)
    op = dha.matmul_t if transpose else dha.matmul
    f = jax.jit(lambda x, w, op=op: op(x, w, index=2), in_shardings=(dev, host))
    shape = dha.matmul_partial_shape(5, r, 1700 - r, dtype, num_sms)
    splits = {0: (0, 0), 1: (2, 0), 8: (11, 6), 132: (32, 11)}[num_sms][int(transpose)]
    assert shape == ((splits, 5, 1700 - r) if splits else (0,)), shape
    assert f"f32[{','.join(map(str, shape))}]" in f.lower(x, w).compile().as_text()
    got, again = f(x, w), f(x, w)
    layer = np.asarray(w, np.float32)[2]
    _assert_matmul_close(got, x, layer.T if transpose else layer, dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(again, np.float32))


def test_gpu_matmul_large_layer_unstacked(gpu):
  host, dev = _shardings(gpu)
  rng = np.random.default_rng(7)
  w = jax.device_put(jnp.asarray(rng.normal(size=(4096, 4096)), jnp.bfloat16), host)
  for m in (1, 64, 512):
    x = jax.device_put(jnp.asarray(rng.normal(size=(m, 4096)), jnp.bfloat16), dev)
    got = jax.jit(dha.matmul, in_shardings=(dev, host))(x, w)
    _assert_matmul_close(got, x, np.asarray(w, np.float32), jnp.bfloat16)


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_matmul_grads_match_jnp(gpu, dtype):
  host, dev = _shardings(gpu)
  rng = np.random.default_rng(8)
  w = jnp.asarray(rng.normal(size=(3, 300, 130)) * 0.05, dtype)
  x = jnp.asarray(rng.normal(size=(40, 300)), dtype)
  loss, loss_jnp = _loss_and_ref(2, False)
  gx, gw = jax.jit(jax.grad(loss, argnums=(0, 1)), in_shardings=(dev, host))(
      jax.device_put(x, dev), jax.device_put(w, host))
  rx, rw = jax.jit(jax.grad(loss_jnp, argnums=(0, 1)))(
      jax.device_put(x.astype(jnp.float32), gpu), jax.device_put(w.astype(jnp.float32), gpu))
  for got, want in ((gx, rx), (gw, rw)):
    got, want = np.asarray(got, np.float32), np.asarray(want)
    if dtype == jnp.float32:
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    else:
      # In bf16, y and its cotangent g are rounded to bf16 (2^-9 relative) before dw = x^T g
      # sums 40 of them: an element that cancels keeps the error of the terms, so the absolute
      # tolerance follows the gradient's scale (max |dw| ~ 17 here; measured error ~ 2^-8 of it).
      scale = np.abs(want).max()
      np.testing.assert_allclose(got, want, rtol=2e-2, atol=2.0 ** -6 * scale)
      assert np.linalg.norm(got - want) <= 2.0 ** -7 * np.linalg.norm(want)
  assert gw.sharding.memory_kind == "pinned_host"


def test_gpu_gather_grad(gpu):
  host, dev = _shardings(gpu)
  table = jax.device_put(jnp.ones((64, 40), jnp.float32), host)
  ids = jnp.asarray([3, 3, 70, -2, 5], jnp.int32)
  got = jax.jit(jax.grad(lambda t, i: jnp.sum(dha.gather(t, i))), in_shardings=(host, dev))(
      table, jax.device_put(ids, dev))
  want = np.zeros((64, 40), np.float32)
  want[3] = 2.0
  want[5] = 1.0
  np.testing.assert_array_equal(np.asarray(got), want)


def test_hlo_guard_gpu(gpu):
  _check_guard(gpu)


def test_vmap_over_ids_and_x():
  rng = np.random.default_rng(9)
  table = jnp.asarray(rng.normal(size=(9, 4)), jnp.float32)
  ids = jnp.asarray([[0, 8], [9, 2], [-1, 1]], jnp.int32)
  got = jax.jit(jax.vmap(lambda i: dha.gather(table, i)))(ids)
  np.testing.assert_array_equal(np.asarray(got), _gather_want(table, ids))
  w = jnp.asarray(rng.normal(size=(2, 6, 5)), jnp.float32)
  x = jnp.asarray(rng.normal(size=(3, 4, 6)), jnp.float32)
  got = jax.jit(jax.vmap(lambda x: dha.matmul(x, w, index=1)))(x)
  _assert_matmul_close(got.reshape(12, 5), x.reshape(12, 6), np.asarray(w)[1], jnp.float32)
