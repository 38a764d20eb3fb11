"""The fused host update custom call: op programs against references, the HLO guard, GPU runs."""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier
from jaxtier._src.analysis import op_program_compiler
from jaxtier._src.lowering import hlo as hlo_lib
from jaxtier._src.primitives import base as ffi
from jaxtier._src.primitives import host_update as hu
from jaxtier._src.primitives.host_update import Op

UNARY = [Op.NEG, Op.ABS, Op.SQRT, Op.RSQRT, Op.EXP, Op.LOG, Op.TANH, Op.LOGISTIC, Op.SIGN,
         Op.FLOOR, Op.CEIL, Op.LOG1P, Op.EXPM1, Op.SIN, Op.COS, Op.NOT, Op.ERF, Op.ROUND,
         Op.ISFINITE]
BINARY = [Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX, Op.MIN, Op.POW, Op.ATAN2, Op.GT, Op.GE,
          Op.LT, Op.LE, Op.EQ, Op.NE, Op.AND, Op.OR, Op.REM]
NP_UNARY = {
    Op.NEG: np.negative, Op.ABS: np.abs, Op.SQRT: np.sqrt, Op.RSQRT: lambda x: 1 / np.sqrt(x),
    Op.EXP: np.exp, Op.LOG: np.log, Op.TANH: np.tanh, Op.LOGISTIC: lambda x: 1 / (1 + np.exp(-x)),
    Op.SIGN: np.sign, Op.FLOOR: np.floor, Op.CEIL: np.ceil, Op.LOG1P: np.log1p,
    Op.EXPM1: np.expm1, Op.SIN: np.sin, Op.COS: np.cos, Op.NOT: lambda x: (x == 0) * 1.0,
    Op.ERF: None, Op.ROUND: lambda x: np.sign(x) * np.floor(np.abs(x) + 0.5),
    Op.ISFINITE: lambda x: np.isfinite(x) * 1.0,
}
NP_BINARY = {
    Op.ADD: np.add, Op.SUB: np.subtract, Op.MUL: np.multiply, Op.DIV: np.divide,
    Op.MAX: np.maximum, Op.MIN: np.minimum, Op.POW: np.power, Op.ATAN2: np.arctan2,
    Op.GT: np.greater, Op.GE: np.greater_equal, Op.LT: np.less, Op.LE: np.less_equal,
    Op.EQ: np.equal, Op.NE: np.not_equal, Op.AND: lambda a, b: (a != 0) & (b != 0),
    Op.OR: lambda a, b: (a != 0) | (b != 0), Op.REM: np.fmod,
}


def _program(code, consts=(), num_operands=1, num_results=1, num_regs=8):
  return hu.Program(code=np.asarray(code, np.int32).reshape(-1, 5),
                    consts=np.asarray(consts, np.float32), num_regs=num_regs,
                    num_operands=num_operands, num_results=num_results)


def _run(program, operands, results, aliases, donate=()):
  f = jax.jit(lambda *xs: hu.host_update(program, xs, results, aliases), donate_argnums=donate)
  return [np.asarray(y) for y in f(*operands)]


def _inputs(n, seed):
  rng = np.random.default_rng(seed)
  a = rng.uniform(-3, 3, n).astype(np.float32)
  b = rng.uniform(0.1, 2, n).astype(np.float32)
  a[:4] = [0.0, -0.0, 0.5, -2.5]  # exercise signs and round-half-away cases.
  return a, b


@pytest.mark.parametrize("op", UNARY)
def test_unary_op_matches_numpy(op):
  a, b = _inputs(1000, int(op))
  x = np.abs(a) + 0.1 if op in (Op.SQRT, Op.RSQRT, Op.LOG) else a
  prog = _program([[Op.LOAD, 0, 0, 0, 0], [int(op), 1, 0, 0, 0], [Op.STORE, 0, 1, 0, 0]])
  (got,) = _run(prog, [jnp.asarray(x)], [jax.ShapeDtypeStruct(x.shape, jnp.float32)], [-1])
  if op == Op.ERF:
    want = np.asarray(jax.scipy.special.erf(jnp.asarray(x, jnp.float64 if jax.config.x64_enabled
                                                        else jnp.float32)))
  else:
    with np.errstate(invalid="ignore"):  # NaN where the op is undefined (log1p below -1):
      want = NP_UNARY[op](x.astype(np.float64)).astype(np.float32)  # compared NaN to NaN
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("op", BINARY)
def test_binary_op_matches_numpy(op):
  a, b = _inputs(1000, 100 + int(op))
  prog = _program([[Op.LOAD, 0, 0, 0, 0], [Op.LOAD, 1, 1, 0, 0], [int(op), 2, 0, 1, 0],
                   [Op.STORE, 0, 2, 0, 0]], num_operands=2)
  (got,) = _run(prog, [jnp.asarray(a), jnp.asarray(b)],
                [jax.ShapeDtypeStruct(a.shape, jnp.float32)], [-1])
  with np.errstate(invalid="ignore"):  # NaN where undefined (a negative base to a fractional
    # power), compared NaN to NaN
    want = NP_BINARY[op](a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
  np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-6)


def test_nan_propagates_through_max_min():
  a = jnp.asarray([np.nan, 1.0, 2.0], jnp.float32)
  b = jnp.asarray([0.0, np.nan, 1.0], jnp.float32)
  prog = _program([[Op.LOAD, 0, 0, 0, 0], [Op.LOAD, 1, 1, 0, 0], [Op.MAX, 2, 0, 1, 0],
                   [Op.MIN, 3, 0, 1, 0], [Op.STORE, 0, 2, 0, 0], [Op.STORE, 1, 3, 0, 0]],
                  num_operands=2, num_results=2)
  shp = jax.ShapeDtypeStruct((3,), jnp.float32)
  mx, mn = _run(prog, [a, b], [shp, shp], [-1, -1])
  np.testing.assert_array_equal(mx, np.asarray(jax.lax.max(a, b)))
  np.testing.assert_array_equal(mn, np.asarray(jax.lax.min(a, b)))


@pytest.mark.parametrize("n", [1, 1000, 300_000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
def test_select_clamp_scalar_operand_and_dtypes_in_place(n, dtype):
  rng = np.random.default_rng(n)
  x = jnp.asarray(rng.normal(size=n), dtype)
  s = jnp.asarray([0.25], jnp.float32)  # a broadcast scalar operand.
  # y = select(x > 0, clamp(-1, x * s, 1), x + 2.5) ; written in place into x.
  prog = _program([[Op.LOAD, 0, 0, 0, 0], [Op.LOAD, 1, 1, 0, 0], [Op.CONST, 2, 0, 0, 0],
                   [Op.GT, 3, 0, 2, 0], [Op.MUL, 4, 0, 1, 0], [Op.CONST, 5, 1, 0, 0],
                   [Op.CONST, 6, 2, 0, 0], [Op.CLAMP, 4, 5, 4, 6], [Op.CONST, 7, 3, 0, 0],
                   [Op.ADD, 7, 0, 7, 0], [Op.SELECT, 2, 3, 7, 4], [Op.STORE, 0, 2, 0, 0]],
                  consts=[0.0, -1.0, 1.0, 2.5], num_operands=2)
  xf = np.asarray(x, np.float32)
  want = np.where(xf > 0, np.clip(xf * 0.25, -1, 1), xf + 2.5).astype(jnp.dtype(dtype))
  (got,) = _run(prog, [x, s], [jax.ShapeDtypeStruct(x.shape, dtype)], [0], donate=(0,))
  np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_empty_leaf():
  prog = _program([[Op.LOAD, 0, 0, 0, 0], [Op.STORE, 0, 0, 0, 0]])
  (got,) = _run(prog, [jnp.zeros((0,), jnp.float32)], [jax.ShapeDtypeStruct((0,), jnp.float32)],
                [-1])
  assert got.shape == (0,)


def test_reference_equals_handler_on_adamw_program():
  tx = optax.adamw(1e-3, weight_decay=0.1)
  params = {"w": jnp.asarray(np.random.default_rng(0).normal(size=(300, 257)), jnp.float32)}
  state = {"params": params, "opt": tx.init(params)}

  def step(state, g):
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}
  g = jax.tree.map(lambda p: p * 0.01 + 0.1, params)
  want, _ = jax.jit(step)(jax.tree.map(jnp.copy, state), g)
  off = jaxtier.offload(step, policy="optimizer_state_on_host")
  placed = off.place(jax.tree.map(jnp.copy, state), g)
  assert off.plan.num_host_updates == 1
  got, _ = off(placed, g)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-9)


def test_handler_rejects_bad_program():
  # Register index 70 is beyond the 64 registers: the handler says so (the Python-side
  # Program check is bypassed by building the call directly).

  ffi.ensure_registered()
  call = jax.ffi.ffi_call(hu.TARGET, jax.ShapeDtypeStruct((4,), jnp.float32))
  with pytest.raises(Exception, match="jaxtier_host_update"):
    jax.jit(lambda x: call(x, program=np.asarray([Op.LOAD, 70, 0, 0, 0, Op.STORE, 0, 70, 0, 0],
                                                 np.int32),
                           consts=np.zeros(0, np.float32), num_regs=np.int32(8),
                           aliases=np.asarray([-1], np.int32)))(jnp.ones(4)).block_until_ready()


# ---- the layer call and the join (per-layer updates inside the backward pass) ---------------

# m' = 0.5 m + g (into operand 0), p' = p - m' (into operand 2, bf16), lr-like scalar operand 3.
_LAYER_PROGRAM = hu.Program(
    code=np.asarray([[Op.LOAD, 0, 0, 0, 0], [Op.LOAD, 1, 1, 0, 0], [Op.CONST, 2, 0, 0, 0],
                     [Op.MUL, 3, 0, 2, 0], [Op.ADD, 4, 3, 1, 0], [Op.STORE, 0, 4, 0, 0],
                     [Op.LOAD, 5, 2, 0, 0], [Op.LOAD, 6, 3, 0, 0], [Op.MUL, 7, 4, 6, 0],
                     [Op.SUB, 8, 5, 7, 0], [Op.STORE, 1, 8, 0, 0]], np.int32),
    consts=np.asarray([0.5], np.float32), num_regs=9, num_operands=4, num_results=2)


def _host(x):
  return jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                             memory_kind="pinned_host"))


@pytest.mark.parametrize("executor,dha_grid", [("host_cpu", 1.0), ("split", 1.0),
                                               ("host_dha", 1.0), ("host_dha", 0.01)])
def test_layer_calls_write_their_windows_and_join_hands_the_buffers_back(executor, dha_grid):
  layers, n = 5, 1000
  rng = np.random.default_rng(0)
  m0 = rng.normal(size=(layers, n)).astype(np.float32)
  p0 = rng.normal(size=(layers, n)).astype(jnp.bfloat16)
  g = rng.normal(size=(layers, n)).astype(np.float32)
  lr = np.float32(0.25)

  def step(m, p, g):
    slices = [g[t] for t in (4, 2, 0)]  # layers 1 and 3 untouched
    # dha_grid 0.01: on a GPU a few blocks stride over the whole window.
    tokens = [hu.host_update_layer(_LAYER_PROGRAM, [m, g_t, p, lr], [0, 2], offset=t * n,
                                   count=n, executor=executor, dha_fraction=0.5,
                                   dha_grid=dha_grid)
              for t, g_t in zip((4, 2, 0), slices)]
    # The slices stay alive until the joins: a GPU call reads them after XLA's stream moved on.
    m, = hu.join([m], after=tokens + slices)
    p, = hu.join([p], after=tokens + slices)
    return m, p
  out_sh = (jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"),
            None)
  m, p = jax.jit(step, donate_argnums=(0, 1), out_shardings=out_sh)(
      _host(m0), jnp.asarray(p0), jnp.asarray(g))
  want_m, want_p = m0.copy(), np.asarray(p0, np.float32).copy()
  for t in (4, 2, 0):
    want_m[t] = np.float32(0.5) * m0[t] + g[t]
    want_p[t] = np.asarray((np.asarray(p0[t], np.float32) - want_m[t] * lr).astype(jnp.bfloat16),
                           np.float32)
  np.testing.assert_array_equal(np.asarray(m), want_m)
  np.testing.assert_array_equal(np.asarray(p, np.float32), want_p)
  assert m.sharding.memory_kind == "pinned_host"


def test_join_refuses_a_buffer_no_layer_call_wrote():
  # A copy between the layer calls and the join (here explicit) would lose their writes: the
  # join says so instead of handing the copy back.
  layers, n = 2, 8
  m, p, g = jnp.zeros((layers, n)), jnp.ones((layers, n)), jnp.ones((layers, n))

  def step(m, p, g):
    token = hu.host_update_layer(_LAYER_PROGRAM, [m, g[0], p, np.float32(1)], [0, 2],
                                 offset=0, count=n, executor="host_cpu")
    copy = m + 1.0  # not the buffer the call wrote
    return hu.join([copy], after=[token, g])[0], hu.join([p], after=[token, g])[0]
  # m not donated: else XLA may compute the copy into m's buffer (GPU), the one the call wrote.
  with pytest.raises(Exception, match="jaxtier_host_update_join.*a buffer the layer calls wrote"):
    jax.block_until_ready(jax.jit(step, donate_argnums=(1,))(m, p, g))


@pytest.mark.parametrize("executor", ["host_cpu", "split", "host_dha"])
def test_a_released_slice_is_read_before_its_buffer_is_reused(executor):
  # Each layer's gradient is made in the program and released after its call: XLA may give its
  # buffer to what follows (the next layer's work, of the same size). On a GPU the call reads
  # the slice after XLA's stream has moved on; the release makes the stream wait for that read,
  # else the call would read the next layer's values.
  layers, n = 4, 1 << 20
  rng = np.random.default_rng(1)
  m0 = rng.normal(size=(layers, n)).astype(np.float32)
  p0 = rng.normal(size=(layers, n)).astype(jnp.bfloat16)
  g = rng.normal(size=(layers, n)).astype(np.float32)
  lr = np.float32(0.25)

  def step(m, p, g):
    tokens, carry = [], jnp.zeros((n,), jnp.float32)
    for t in range(layers):
      g_t = g[t] * 2.0 + carry * 0.0  # a buffer of its own, made after the last release
      token = hu.host_update_layer(_LAYER_PROGRAM, [m, g_t, p, lr], [0, 2], offset=t * n,
                                   count=n, executor=executor, dha_fraction=0.5)
      released = hu.release([g_t], after=[token])
      carry, _ = jax.lax.optimization_barrier((carry, released))
      carry = carry * 1.5 + g[t] * 3.0  # may take g_t's buffer
      tokens.append(token)
    m, = hu.join([m], after=tokens)
    p, = hu.join([p], after=tokens)
    return m, p, carry
  out_sh = (jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind="pinned_host"),
            None, None)
  m, p, carry = jax.jit(step, donate_argnums=(0, 1), out_shardings=out_sh)(
      _host(m0), jnp.asarray(p0), jnp.asarray(g))
  want_m = np.float32(0.5) * m0 + np.float32(2.0) * g
  want_p = np.asarray((np.asarray(p0, np.float32) - want_m * lr).astype(jnp.bfloat16), np.float32)
  np.testing.assert_array_equal(np.asarray(m), want_m)
  np.testing.assert_array_equal(np.asarray(p, np.float32), want_p)
  want_carry = np.zeros(n, np.float32)
  for t in range(layers):
    want_carry = want_carry * np.float32(1.5) + g[t] * np.float32(3.0)
  np.testing.assert_allclose(np.asarray(carry), want_carry, rtol=1e-5, atol=1e-5)


def test_release_refuses_more_values_than_operands():
  ffi.ensure_registered()
  call = jax.ffi.ffi_call(hu.RELEASE_TARGET, jax.ShapeDtypeStruct((1,), jnp.float32),
                          has_side_effect=True)
  with pytest.raises(Exception,
                     match=r"num_values to jaxtier_host_update_release.*in \[0, 1\].*got 3"):
    jax.block_until_ready(jax.jit(lambda x: call(x, num_values=np.int32(3)))(jnp.ones(4)))


# ---- rows calls (the update of a table read in place, row by row) -----------------------------

def _rows_step(num_rows, dim):
  """The two calls of a table's step: the rows the ids do not name with a zero gradient, then
  the rows they name with their gradient rows, zeroed after use."""
  def step(m, p, g, ids):
    t0 = hu.host_update_rows(_LAYER_PROGRAM, [m, jnp.zeros((1,), jnp.float32), p,
                                              np.float32(0.25)], [0, 2], ids=ids,
                             row_length=dim, rows="others")
    t1 = hu.host_update_rows(_LAYER_PROGRAM, [m, g, p, np.float32(0.25)], [0, 2], ids=ids,
                             row_length=dim, rows="ids", zero=1, after=[t0])
    after = [t0, t1, ids]
    return tuple(hu.join([x], after=after)[0] for x in (m, p, g))
  return step


def _rows_case(device, num_rows=37, dim=24, num_ids=50, seed=0):
  rng = np.random.default_rng(seed)
  m0 = rng.normal(size=(num_rows, dim)).astype(np.float32)
  p0 = np.asarray(jnp.asarray(rng.normal(size=(num_rows, dim)), jnp.bfloat16))
  # Repeated ids, and two out of range (they name no row).
  ids = rng.integers(0, num_rows // 2, size=num_ids).astype(np.int32)
  ids[:2] = [-1, num_rows + 3]
  g0 = np.zeros((num_rows, dim), np.float32)
  g0[ids[2:]] = rng.normal(size=(num_ids - 2, dim)).astype(np.float32)[:len(ids[2:])]
  g0[num_rows - 1] = 7.0  # a row no id names: never read, not zeroed
  host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  m, p, g = (jax.device_put(x, host) for x in (m0, p0, g0))
  got = jax.jit(_rows_step(num_rows, dim), donate_argnums=(0, 1, 2),
                out_shardings=(host, host, host))(m, p, g, jax.device_put(ids, device))
  named = np.zeros(num_rows, bool)
  named[ids[(ids >= 0) & (ids < num_rows)]] = True
  grad = np.where(named[:, None], g0, np.float32(0))
  want_m = np.float32(0.5) * m0 + grad
  want_p = np.asarray(jnp.asarray(np.asarray(p0, np.float32) - want_m * np.float32(0.25),
                                  jnp.bfloat16))
  want_g = np.where(named[:, None], np.float32(0), g0)
  return got, (want_m, want_p, want_g)


def _assert_rows(got, want):
  for name, x, w in zip(("m", "p", "g"), got, want):
    np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(w, np.float32),
                                  err_msg=name)
    assert x.sharding.memory_kind == "pinned_host"


def test_rows_calls_update_the_named_rows_and_the_others_and_zero_the_gradient_rows():
  _assert_rows(*_rows_case(jax.devices()[0]))
  # Many rows (the pool splits them by rows), every one named, and none named.
  _assert_rows(*_rows_case(jax.devices()[0], num_rows=3000, dim=256, num_ids=4000, seed=1))
  _assert_rows(*_rows_case(jax.devices()[0], num_rows=64, dim=8, num_ids=2, seed=2))


def test_rows_calls_on_gpu(gpu):
  _assert_rows(*_rows_case(gpu))
  _assert_rows(*_rows_case(gpu, num_rows=3000, dim=256, num_ids=4000, seed=1))


def _assert_rows_hlo_clean(device):
  num_rows, dim = 37, 24
  host = jax.sharding.SingleDeviceSharding(device, memory_kind="pinned_host")
  m, p, g = (jax.device_put(np.zeros((num_rows, dim), dt), host)
             for dt in (np.float32, jnp.bfloat16, np.float32))
  ids = jax.device_put(np.arange(5, dtype=np.int32), device)
  hlo = jax.jit(_rows_step(num_rows, dim), donate_argnums=(0, 1, 2),
                out_shardings=(host, host, host)).lower(m, p, g, ids).compile().as_text()
  assert hlo_lib.hlo_violations(hlo, target=hu.LAYER_TARGET) == []
  assert hlo.count(f'custom_call_target="{hu.LAYER_TARGET}"') == 2


def test_rows_call_hlo_guard_cpu():
  _assert_rows_hlo_clean(jax.devices()[0])


def test_rows_call_hlo_guard_gpu(gpu):
  _assert_rows_hlo_clean(gpu)


def test_rows_call_refuses_bad_operands():
  m, ids = jnp.zeros((4, 8)), jnp.arange(3)
  ops = [m, m, m, jnp.ones(())]
  with pytest.raises(ValueError, match="row length > 0 that divides the tables' 32"):
    hu.host_update_rows(_LAYER_PROGRAM, ops, [0, 2], ids=ids, row_length=5, rows="ids")
  with pytest.raises(ValueError, match="rows in"):
    hu.host_update_rows(_LAYER_PROGRAM, ops, [0, 2], ids=ids, row_length=8, rows="all")
  with pytest.raises(ValueError, match="expected zero to name a vector operand"):
    hu.host_update_rows(_LAYER_PROGRAM, ops, [0, 2], ids=ids, row_length=8, rows="others",
                        zero=1)
  with pytest.raises(ValueError, match="expected zero to name a vector operand"):
    hu.host_update_rows(_LAYER_PROGRAM, ops, [0, 2], ids=ids, row_length=8, rows="ids", zero=0)
  with pytest.raises(TypeError, match="integer ids"):
    hu.host_update_rows(_LAYER_PROGRAM, ops, [0, 2], ids=ids * 1.0, row_length=8, rows="ids")
  with pytest.raises(ValueError, match="1 or 32"):
    hu.host_update_rows(_LAYER_PROGRAM, [m, m[0], m, jnp.ones(())], [0, 2], ids=ids,
                        row_length=8, rows="ids")
  # The handler checks the rows attributes too (the Python checks bypassed by a direct call).
  ffi.ensure_registered()
  call = jax.ffi.ffi_call(hu.LAYER_TARGET, jax.ShapeDtypeStruct((1,), jnp.float32),
                          has_side_effect=True)
  attrs = dict(program=np.asarray(_LAYER_PROGRAM.code.reshape(-1), np.int32),
               consts=_LAYER_PROGRAM.consts, num_regs=np.int32(9), executor=np.int32(1),
               dha_fraction=np.float32(0.5), offset=np.int64(0), count=np.int64(32),
               targets=np.asarray([0, 2], np.int32), num_operands=np.int32(4))
  args = (jnp.zeros(32), jnp.zeros(32), jnp.zeros(32), jnp.ones(1))
  with pytest.raises(Exception, match="jaxtier_host_update_layer.*multiple of row_length"):
    jax.jit(lambda *a: call(*a, **attrs, rows=np.int32(1), row_length=np.int64(5)))(
        *args, jnp.arange(3, dtype=jnp.int32)).block_until_ready()
  with pytest.raises(Exception, match="jaxtier_host_update_layer.*int32"):
    jax.jit(lambda *a: call(*a, **attrs, rows=np.int32(1), row_length=np.int64(8)))(
        *args, jnp.arange(3, dtype=jnp.float32)).block_until_ready()
  with pytest.raises(Exception, match="zero_operand to jaxtier_host_update_layer"):
    jax.jit(lambda *a: call(*a, **attrs, rows=np.int32(2), row_length=np.int64(8),
                            zero_operand=np.int32(1)))(
        *args, jnp.arange(3, dtype=jnp.int32)).block_until_ready()


def test_layer_call_refuses_bad_operands():
  m = jnp.zeros((4, 8))
  with pytest.raises(ValueError, match="distinct vector operands"):
    hu.host_update_layer(_LAYER_PROGRAM, [m, m[0], m, jnp.ones(())], [0, 3], offset=0, count=8)
  with pytest.raises(ValueError, match="at least 40"):
    hu.host_update_layer(_LAYER_PROGRAM, [m, m[0], jnp.zeros(12), jnp.ones(())], [0, 2],
                         offset=32, count=8)
  with pytest.raises(ValueError, match="executor"):
    hu.host_update_layer(_LAYER_PROGRAM, [m, m[0], m, jnp.ones(())], [0, 2], offset=0,
                         count=8, executor="gpu")
  for bad in (0.0, 1.5, float("nan")):
    with pytest.raises(ValueError, match=r"expected dha_grid in \(0, 1\]"):
      hu.host_update_layer(_LAYER_PROGRAM, [m, m[0], m, jnp.ones(())], [0, 2], offset=0,
                           count=8, executor="host_dha", dha_grid=bad)
  # The handler checks the window and the grid share too (the Python checks bypassed by a
  # direct call).
  ffi.ensure_registered()
  call = jax.ffi.ffi_call(hu.LAYER_TARGET, jax.ShapeDtypeStruct((1,), jnp.float32),
                          has_side_effect=True)

  def direct(**attrs):
    jax.jit(lambda a, b: call(
        a, b, program=np.asarray(_LAYER_PROGRAM.code.reshape(-1), np.int32),
        consts=_LAYER_PROGRAM.consts, num_regs=np.int32(9), count=np.int64(8),
        targets=np.asarray([0, 0], np.int32), num_operands=np.int32(2), **attrs))(
            jnp.zeros(12), jnp.zeros(8)).block_until_ready()
  with pytest.raises(Exception, match="jaxtier_host_update_layer.*at least 40"):
    direct(executor=np.int32(1), dha_fraction=np.float32(0.5), offset=np.int64(32))
  with pytest.raises(Exception, match="attribute dha_grid"):
    direct(executor=np.int32(0), dha_grid=np.float32(0.0), offset=np.int64(0))


# ---- the CPU executor's plan rewrites (fusion, in-place loads, folded stores) -----------------

# Operands of the random programs: 0-2 f32 vectors, 3 a bf16 vector, 4 an f32 scalar. Results:
# 0 f32 in place of operand 0, 1 f32 in place of operand 1, 2 bf16 in place of operand 3, 3 f32.
_RANDOM_ALIASES = [0, 1, 3, -1]
_RANDOM_RESULT_DTYPES = [np.float32, np.float32, jnp.bfloat16, np.float32]
_RANDOM_BINARY = [Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.MAX]


def _random_program(rng, num_regs=6):
  """A random valid program that redefines registers, stores results more than once and loads
  aliased operands after their results are stored: the cases the CPU plan must keep exact."""
  consts = rng.uniform(-2, 2, 4).astype(np.float32)
  code, written = [], set()
  for _ in range(int(rng.integers(8, 40))):
    kind = rng.choice(["load", "load", "const", "unary", "binary", "binary", "binary", "binary",
                       "select", "copy", "store"]) if written else "load"
    dst = int(rng.integers(num_regs))
    regs = sorted(written)
    pick = lambda: int(rng.choice(regs))  # noqa: E731
    if kind == "load":
      code.append([Op.LOAD, dst, int(rng.integers(5)), 0, 0])
    elif kind == "const":
      code.append([Op.CONST, dst, int(rng.integers(len(consts))), 0, 0])
    elif kind == "unary":
      code.append([int(rng.choice([Op.NEG, Op.SQRT, Op.ABS])), dst, pick(), 0, 0])
    elif kind == "binary":
      code.append([int(rng.choice(_RANDOM_BINARY)), dst, pick(), pick(), 0])
    elif kind == "select":
      code.append([Op.SELECT, dst, pick(), pick(), pick()])
    elif kind == "copy":
      code.append([Op.COPY, dst, pick(), 0, 0])
    else:
      code.append([Op.STORE, int(rng.integers(4)), pick(), 0, 0])
      continue
    written.add(dst)
  for r in range(4):  # every result stored at least once, last
    code.append([Op.STORE, r, int(rng.choice(sorted(written))), 0, 0])
  return _program(code, consts, num_operands=5, num_results=4, num_regs=num_regs)


def _numpy_run(program, operands):
  """The program on numpy arrays, one op at a time over every element, each op rounded to
  float32; a result in place of an operand shares its array (a later LOAD sees the store)."""
  f32 = np.float32
  mem = [np.array(x, copy=True) for x in operands]
  outs = [mem[a] if a >= 0 else None for a in _RANDOM_ALIASES]
  n = operands[0].shape[0]
  regs = {}
  with np.errstate(all="ignore"):
    for op, dst, a, b, c in program.code.tolist():
      if op == Op.LOAD:
        regs[dst] = np.broadcast_to(mem[a].astype(f32), (n,)).copy()
      elif op == Op.CONST:
        regs[dst] = np.full(n, program.consts[a], f32)
      elif op == Op.STORE:
        value = regs[a].astype(_RANDOM_RESULT_DTYPES[dst])
        if outs[dst] is None:
          outs[dst] = value
        else:
          outs[dst][...] = value
      elif op == Op.COPY:
        regs[dst] = regs[a].copy()
      elif op == Op.SELECT:
        regs[dst] = np.where(regs[a] != 0, regs[c], regs[b])
      elif op == Op.MAX:
        x, y = regs[a], regs[b]
        regs[dst] = np.where(np.isnan(x) | np.isnan(y), x + y, np.where(x >= y, x, y))
      elif op in NP_BINARY:
        regs[dst] = NP_BINARY[Op(op)](regs[a], regs[b]).astype(f32)
      else:
        regs[dst] = NP_UNARY[Op(op)](regs[a]).astype(f32)
  return outs


def _assert_same_bits(got, want, what):
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  nan = np.isnan(want)
  np.testing.assert_array_equal(np.isnan(got), nan, err_msg=what)
  np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan],
                                err_msg=what)


@pytest.mark.parametrize("seed", range(60))
def test_random_programs_match_numpy_bitwise(seed):
  rng = np.random.default_rng(seed)
  n = [1000, 70_001][seed % 2]  # odd sizes; 70001 also spreads over the CPU thread pool
  program = _random_program(rng)
  operands = [rng.uniform(0.5, 2, n).astype(np.float32) for _ in range(3)]
  operands += [rng.uniform(-2, 2, n).astype(jnp.bfloat16), np.asarray([1.5], np.float32)]
  want = _numpy_run(program, operands)
  shapes = [jax.ShapeDtypeStruct((n,), d) for d in _RANDOM_RESULT_DTYPES]
  got = _run(program, [jnp.asarray(x) for x in operands], shapes, _RANDOM_ALIASES,
             donate=(0, 1, 3))
  for r, (g, w) in enumerate(zip(got, want)):
    _assert_same_bits(g, w, f"result {r} of\n{program}")


def test_fused_pairs_keep_operand_order_and_uniforms():
  # Every first op x second op x operand order x uniform mode the CPU plan fuses, in one program
  # per pair: t = op1(u, v), w = op2(t, z) or op2(z, t), with u / v / z vectors or a scalar.
  rng = np.random.default_rng(7)
  n = 3000
  vec = [rng.uniform(0.5, 2, n).astype(np.float32) for _ in range(3)]
  scalar = np.asarray([0.75], np.float32)
  for op1 in [Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.SQRT]:
    for op2 in [Op.ADD, Op.SUB, Op.MUL, Op.DIV]:
      for second in (False, True):
        for ua, ub, uc in [(0, 0, 0), (1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 0, 1), (0, 1, 1)]:
          if op1 == Op.SQRT and (ua or ub):
            continue
          # Operands 0-2 vectors, 3 the scalar; registers 0-2 inputs u, v, z.
          code = [[Op.LOAD, 0, 3 if ua else 0, 0, 0], [Op.LOAD, 1, 3 if ub else 1, 0, 0],
                  [Op.LOAD, 2, 3 if uc else 2, 0, 0],
                  [int(op1), 3, 0, 1, 0],
                  [int(op2), 4, 2, 3, 0] if second else [int(op2), 4, 3, 2, 0],
                  [Op.STORE, 0, 4, 0, 0]]
          prog = _program(code, num_operands=4, num_results=1)
          u, v, z = (np.broadcast_to(scalar, (n,)) if k else x for k, x in zip((ua, ub, uc), vec))
          with np.errstate(all="ignore"):
            t = np.sqrt(u) if op1 == Op.SQRT else NP_BINARY[op1](u, v)
            want = NP_BINARY[op2](z, t) if second else NP_BINARY[op2](t, z)
          (got,) = _run(prog, [jnp.asarray(x) for x in vec] + [jnp.asarray(scalar)],
                        [jax.ShapeDtypeStruct((n,), jnp.float32)], [-1])
          _assert_same_bits(got, want.astype(np.float32), f"{op1!r} {op2!r} {second} "
                            f"{ua}{ub}{uc}")


# ---- restrict: the part of a program that computes some of its results -------------------

def test_restrict_keeps_the_bits_of_the_results_it_keeps():
  from jaxtier._src.primitives import op_programs
  prog = op_programs.adamw_program(weight_decay=0.1)
  n = 1000
  rng = np.random.default_rng(3)
  master, mu, g = (rng.normal(size=n).astype(np.float32) for _ in range(3))
  nu = rng.uniform(0.1, 1.0, n).astype(np.float32)
  ops = [master, mu, nu, g, np.float32([1e-2]), np.float32([0.1]), np.float32([0.001])]
  shape = jax.ShapeDtypeStruct((n,), jnp.float32)
  full = _run(prog, [jnp.asarray(x) for x in ops], [shape] * 4, [-1] * 4)
  # The moments alone read neither the master nor the step's scalars.
  moments, reads = hu.restrict(prog, [1, 2])
  assert reads == [1, 2, 3] and moments.num_operands == 3 and moments.num_results == 2
  assert len(moments.code) < len(prog.code)
  got = _run(moments, [jnp.asarray(ops[i]) for i in reads], [shape] * 2, [-1, -1])
  for a, b in zip(got, full[1:3]):
    _assert_same_bits(a, b, "moments")
  # `also` keeps an operand no LOAD reads (one a result overwrites in place, say).
  assert hu.restrict(prog, [2, 1], also=[0])[1] == [0, 1, 2, 3]
  # The new param alone reads everything.
  param, reads = hu.restrict(prog, [3])
  assert reads == list(range(7))
  (got,) = _run(param, [jnp.asarray(ops[i]) for i in reads], [shape], [-1])
  _assert_same_bits(got, full[3], "param")
  with pytest.raises(ValueError, match="distinct results"):
    hu.restrict(prog, [1, 1])
  with pytest.raises(ValueError, match="distinct results"):
    hu.restrict(prog, [4])


# ---- the HLO guard: no copy / slice / host compute before the custom call ------------------

def _offloaded_mlp(device=None):
  tx = optax.adamw(1e-3, weight_decay=0.1)
  params = {"w1": jnp.ones((64, 128)) * 0.01, "w2": jnp.ones((128, 8)) * 0.01}
  if device is not None:
    params = jax.device_put(params, device)
  state = {"params": params, "opt": tx.init(params)}

  def step(state, batch):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(batch @ p["w1"]) @ p["w2"]))(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}
  batch = jnp.ones((16, 64)) if device is None else jax.device_put(jnp.ones((16, 64)), device)
  off = jaxtier.offload(step, policy="optimizer_state_on_host")
  return off, off.place(state, batch), batch


def _assert_hlo_clean(off, state, batch):
  # The fused updates run in the step's second program; the first has none of them.
  assert hu.TARGET not in off.lower(state, batch).compile().as_text()
  hlo = off.lower_update(state, batch).compile().as_text()
  assert hlo_lib.hlo_violations(hlo) == []
  # A component with device results runs as two calls (op_program_compiler.calls_of).
  assert hlo.count(f'custom_call_target="{hu.TARGET}"') == sum(
      len(op_program_compiler.calls_of(cc)) for cc in off.plan.components)
  # Every result is written in place: each new param over its donated old value on the device,
  # the moments in pinned_host. No result has a buffer of its own, and nothing is staged in
  # pinned_host (where XLA would put a device result of a call with host results).
  # (The output tuple's own index table, 8 bytes per output, is not aliased.)
  ma = off.lower_update(state, batch).compile().memory_analysis()
  assert ma.output_size_in_bytes - ma.alias_size_in_bytes <= 8 * 16, ma  # w2 alone is 4 KiB
  assert ma.host_output_size_in_bytes - ma.host_alias_size_in_bytes <= 8 * 16, ma
  assert ma.host_temp_size_in_bytes == 0, ma
  return hlo


def test_hlo_guard_cpu():
  off, state, batch = _offloaded_mlp()
  hlo = _assert_hlo_clean(off, state, batch)
  assert "S(5)" in hlo  # the host leaves are in the host memory space.


def test_hlo_guard_flags_a_copy():
  bad = """ENTRY %main {
  %p0 = f32[8]{0:S(5)} parameter(0)
  %copy.1 = f32[8]{0} copy(%p0)
  ROOT %cc = f32[8]{0} custom-call(%copy.1), custom_call_target="jaxtier_host_update_ffi"
}"""
  assert hlo_lib.hlo_violations(bad) == [
      "cc: operand copy.1 is produced by `copy` from a host parameter"]
  # The same copy from a device parameter is no violation (XLA may copy device operands).
  assert hlo_lib.hlo_violations(bad.replace("{0:S(5)}", "{0}")) == []
  # Layout-only S(5) (the CPU backend prints it only in the entry layout) counts too.
  with_layout = "HloModule m, entry_computation_layout={(f32[8]{0:S(5)})->f32[8]{0}}\n" + (
      bad.replace("{0:S(5)}", "{0}"))
  assert len(hlo_lib.hlo_violations(with_layout)) == 1


def test_hlo_guard_gpu(gpu):
  off, state, batch = _offloaded_mlp(gpu)
  hlo = _assert_hlo_clean(off, state, batch)
  assert "S(5)" in hlo


def test_adamw_on_gpu_matches_optax_device(gpu):
  tx = optax.adamw(optax.cosine_decay_schedule(1e-2, 20), weight_decay=0.1)
  rng = np.random.default_rng(0)
  params = jax.device_put({"w": jnp.asarray(rng.normal(size=(1024, 333)), jnp.float32),
                           "b": jnp.asarray(rng.normal(size=(333,)), jnp.float32)}, gpu)

  def step(state, batch):
    g = jax.grad(lambda p: jnp.mean(jnp.tanh(batch @ p["w"] + p["b"]) ** 2))(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}
  batch = jax.device_put(jnp.asarray(rng.normal(size=(64, 1024)), jnp.float32), gpu)
  ref = jax.jit(step, donate_argnums=0)
  s_ref = {"params": jax.tree.map(jnp.copy, params), "opt": tx.init(params)}
  off = jaxtier.offload(step, policy="optimizer_state_on_host")
  s_off = off.place({"params": jax.tree.map(jnp.copy, params), "opt": tx.init(params)}, batch)
  assert set(off.plan.placements().values()) == {"device", "host_dha"}
  # One step: the same fp32 arithmetic (XLA may contract a*b+c into an FMA, the kernel does
  # not, so allow a few ulps), every leaf. Twenty steps: the params, against each leaf's own
  # scale. Adam divides by sqrt(nu), so the moments of elements whose gradient is near zero
  # turn those ulps into other values (a sign, a few per cent of the leaf: H200), while the
  # params they move stay close.
  for i in range(20):
    s_ref, _ = ref(s_ref, batch)
    s_off, _ = off(s_off, batch)
    if i == 0:
      for a, b in zip(jax.tree.leaves(s_off), jax.tree.leaves(s_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)

  def close(a, b, rtol, share):  # all but a `share` of elements within rtol of the leaf
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    scale = float(np.abs(b).max()) or 1.0
    return np.mean(np.abs(a - b) <= rtol * (np.abs(b) + scale)) >= 1 - share
  for a, b in zip(jax.tree.leaves(s_off["params"]), jax.tree.leaves(s_ref["params"])):
    assert close(a, b, 1e-3, 0.0) and close(a, b, 1e-4, 0.01)
  assert s_off["opt"][0].mu["w"].sharding.memory_kind == "pinned_host"


def test_import_jaxtier_first_in_fresh_process(tmp_path):
  # The package imports jax before its extension (the other order crashed inside ml_dtypes
  # on the H200); a fresh process that imports jaxtier first must run a host update.
  code = ("import jaxtier, jax, jax.numpy as jnp, numpy as np\n"
          "from jaxtier._src.primitives import host_update as hu\n"
          "p = hu.Program(code=np.array([[1,0,0,0,0],[42,1,0,0,0],[3,0,1,0,0]], np.int32), "
          "consts=np.zeros(0, np.float32), num_regs=2, num_operands=1, num_results=1)\n"
          "y = jax.jit(lambda x: hu.host_update(p, [x], [jax.ShapeDtypeStruct((3,), jnp.float32)],"
          " [-1])[0])(jnp.arange(3.0))\n"
          "assert np.asarray(y).tolist() == [0.0, 1.0, 4.0], y\nprint('ok')\n")
  env = dict(os.environ)
  env.pop("JAXTIER_DISABLE_FFI", None)
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300, cwd=tmp_path)
  assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
