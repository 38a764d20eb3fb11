"""Executors of the fused host update: host_dha (CUDA kernel, zero-copy), host_cpu (host CPU
threads driven from the CUDA handler), split (both at once).

On the CPU backend: the attribute plumbing (every executor gives the same bits; bad values are
refused by Python and by the handler). On a GPU: an AdamW-like program over pinned_host state
(master, mu, nu, updated in place), a device gradient, device scalars, a device fp32 param read
and its new value written to the device, and a new bf16 param written to the device; host_cpu and
split must give the DHA kernel's bits exactly (the same IEEE fp32 operations, no contraction on
either side), for N not a multiple of the chunk, N = 1 and N = 0; and the HLO guard holds for each
executor. With every buffer on the device, the state is updated in place on the device (staged
aliased pairs on the host_cpu path).

(A donated device f32[N] next to donated pinned_host f32[N] leaves makes jax 0.11 / XLA pair a
device operand with a host result ("Different aliasing shapes: f32[N]{0} vs f32[N]{0:S(5)}"),
so in the mixed case the device param is not donated.)
"""

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import numpy as np
import pytest

from jaxtier._src.primitives import base as ffi
from jaxtier._src.primitives import host_update as hu
from jaxtier._src.primitives import op_programs
from jaxtier._src.primitives.host_update import Op
from jaxtier._src.lowering import hlo as hlo_lib

# The executors compared with host_dha on the GPU: (executor, dha_fraction).
OTHERS = [("host_cpu", 0.5), ("split", 0.37), ("split", 0.0), ("split", 1.0)]
ALL = [("host_dha", 0.5)] + OTHERS

# profile.adamw_program, plus a device-resident fp32 param (operand 7) to which the same update is
# applied (result 4, a new device array). Donated, aliased state: master, mu, nu.
ALIASES = [0, 1, 2, -1, -1]


def _program() -> hu.Program:
  base = op_programs.adamw_program(b1=0.9, b2=0.999, eps=1e-8, weight_decay=1e-4)
  code = base.code.tolist()
  assert code[29] == [Op.ADD, 0, 0, 13, 0] and code[30][0] == Op.STORE  # u * -lr is in r13
  extra = [[Op.LOAD, 14, 7, 0, 0], [Op.ADD, 14, 14, 13, 0], [Op.STORE, 4, 14, 0, 0]]
  return hu.Program(code=np.asarray(code + extra, np.int32), consts=base.consts,
                    num_regs=base.num_regs, num_operands=8, num_results=5)


def _inputs(n: int, seed: int = 0) -> list[np.ndarray]:
  """[master, mu, nu, device param, grad (bf16), lr, 1 - b1**t, 1 - b2**t] as numpy arrays."""
  rng = np.random.default_rng(seed)
  f32 = np.float32
  master = rng.normal(size=n).astype(f32)
  mu = (rng.normal(size=n) * 1e-3).astype(f32)
  nu = (np.abs(rng.normal(size=n)) * 1e-6).astype(f32)
  pdev = rng.normal(size=n).astype(f32)
  if n > 4:
    nu[:4] = [0.0, 1e-40, 3e-39, 1.0]  # zero and fp32 subnormals: exercised without flushing
  grad = np.asarray(jnp.asarray(rng.normal(size=n) * 0.1, jnp.bfloat16))
  scalars = [np.asarray([v], f32) for v in (1e-3, 1 - 0.9 ** 3, 1 - 0.999 ** 3)]
  return [master, mu, nu, pdev, grad] + scalars


def _shapes(n):
  f32 = jax.ShapeDtypeStruct((n,), jnp.float32)
  return [f32, f32, f32, jax.ShapeDtypeStruct((n,), jnp.bfloat16), f32]


def _compiled(device, n, executor, fraction, state_kind="pinned_host"):
  """The jitted step, compiled: state (master, mu, nu) in `state_kind`, donated and aliased."""
  mesh = Mesh([device], ("d",))
  host = NamedSharding(mesh, PartitionSpec(), memory_kind=state_kind)
  dev = NamedSharding(mesh, PartitionSpec(), memory_kind="device")
  prog, shapes = _program(), _shapes(n)

  def step(master, mu, nu, pdev, grad, lr, bc1, bc2):
    return tuple(hu.host_update(prog, [master, mu, nu, grad, lr, bc1, bc2, pdev], shapes,
                                ALIASES, executor=executor, dha_fraction=fraction))

  in_sh = (host, host, host, dev, dev, dev, dev, dev)
  out_sh = (host, host, host, dev, dev)
  f = jax.jit(step, donate_argnums=(0, 1, 2), in_shardings=in_sh, out_shardings=out_sh)
  args = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s)
          for a, s in zip(_inputs(n), in_sh)]
  return f.lower(*args).compile(), in_sh


def _run(device, n, executor, fraction, *, steps=2, state_kind="pinned_host"):
  """Runs `steps` steps; returns [master, mu, nu, bf16 param, device param] as numpy."""
  compiled, in_sh = _compiled(device, n, executor, fraction, state_kind)
  arrays = [jax.device_put(a, s) for a, s in zip(_inputs(n), in_sh)]
  state, rest = arrays[:4], arrays[4:]
  for _ in range(steps):
    master, mu, nu, param, pdev = compiled(*state, *rest)
    state = [master, mu, nu, pdev]
  assert master.sharding.memory_kind == state_kind
  assert param.sharding.memory_kind == "device"
  return [np.asarray(x) for x in (master, mu, nu, param, pdev)]


def _assert_bits_equal(got, want, what):
  assert len(got) == len(want)
  for k, (a, b) in enumerate(zip(got, want)):
    assert a.shape == b.shape and a.dtype == b.dtype, (what, k)
    bits = np.uint16 if a.dtype.itemsize == 2 else np.uint32
    diff = np.flatnonzero(a.view(bits) != b.view(bits))
    assert diff.size == 0, (f"{what}: result {k} differs at {diff.size} of {a.size} elements, "
                            f"first at {diff[:5]}: {a[diff[:5]]} vs {b[diff[:5]]}")


def _numpy_reference(inputs, steps):
  """The program in numpy fp32, one IEEE-rounded operation at a time (no FMA contraction)."""
  master, mu, nu, pdev, grad, lr, bc1, bc2 = [np.array(x) for x in inputs]
  f32 = np.float32
  g = grad.astype(f32)
  lr, bc1, bc2 = lr[0], bc1[0], bc2[0]
  with np.errstate(all="ignore"):
    for _ in range(steps):
      mu = f32(1 - 0.9) * g + f32(0.9) * mu
      nu = f32(1 - 0.999) * (g * g) + f32(0.999) * nu
      u = (mu / bc1) / (np.sqrt(nu / bc2) + f32(1e-8))
      u = (u + f32(1e-4) * master) * -lr
      master = master + u
      pdev = pdev + u
  return [master, mu, nu, master.astype(jnp.bfloat16), pdev]


# ---- CPU backend: attribute plumbing ------------------------------------------------------------

@pytest.mark.parametrize("n", [0, 1, 1000, 300_001])
def test_all_executors_give_the_same_bits_on_cpu(n):
  cpu = jax.devices("cpu")[0]
  results = {(e, f): _run(cpu, n, e, f) for e, f in ALL}
  want = results[("host_dha", 0.5)]
  for key, got in results.items():
    _assert_bits_equal(got, want, f"{key} vs host_dha on the CPU backend")
  # And they are the program's arithmetic: fp32 IEEE, one rounding per operation.
  _assert_bits_equal(want, _numpy_reference(_inputs(n), steps=2), "CPU handler vs numpy")


def test_bad_executor_and_fraction_rejected_in_python():
  prog = op_programs.adamw_program()
  x = jnp.ones((8,), jnp.float32)
  ops = [x, x, x, x, x[:1], x[:1], x[:1]]
  shapes = [jax.ShapeDtypeStruct((8,), jnp.float32)] * 4
  with pytest.raises(ValueError, match="expected executor in"):
    hu.host_update(prog, ops, shapes, [0, 1, 2, -1], executor="gpu")
  for bad in (1.5, -0.1, float("nan"), "half"):
    with pytest.raises(ValueError, match="expected dha_fraction in"):
      hu.host_update(prog, ops, shapes, [0, 1, 2, -1], executor="split", dha_fraction=bad)


def _direct_call(device, **attrs):
  """The custom call built by hand, so that attribute values the Python side refuses reach it."""

  ffi.ensure_registered()
  code = np.asarray([Op.LOAD, 0, 0, 0, 0, Op.NEG, 1, 0, 0, 0, Op.STORE, 0, 1, 0, 0], np.int32)
  call = jax.ffi.ffi_call(hu.TARGET, jax.ShapeDtypeStruct((4,), jnp.float32))
  x = jax.device_put(jnp.arange(4.0), device)
  return np.asarray(jax.jit(lambda x: call(
      x, program=code, consts=np.zeros(0, np.float32), num_regs=np.int32(2),
      aliases=np.asarray([-1], np.int32), **attrs))(x))


def _assert_handler_checks_attributes(device):
  np.testing.assert_array_equal(_direct_call(device), [-0.0, -1.0, -2.0, -3.0])  # defaults
  np.testing.assert_array_equal(
      _direct_call(device, executor=np.int32(1), dha_fraction=np.float32(0.25)),
      [-0.0, -1.0, -2.0, -3.0])
  for attrs, match in [
      (dict(executor=np.int32(7)), "attribute executor to jaxtier_host_update. Expected 0"),
      (dict(executor=np.int32(-1)), "attribute executor"),
      (dict(dha_fraction=np.float32(1.5)), "attribute dha_fraction"),
      (dict(dha_fraction=np.float32(np.nan)), "attribute dha_fraction"),
      (dict(executor=np.float32(1.0)), "Invalid type for attribute executor"),
      (dict(executr=np.int32(1)), "Invalid attribute for the call"),
  ]:
    with pytest.raises(Exception, match=match):
      _direct_call(device, **attrs)


def test_handler_checks_executor_attributes_cpu():
  _assert_handler_checks_attributes(jax.devices("cpu")[0])


def test_reference_path_ignores_executor(monkeypatch):
  cpu = jax.devices("cpu")[0]
  want = _run(cpu, 1000, "host_dha", 0.5)
  monkeypatch.setenv("JAXTIER_DISABLE_FFI", "1")
  for executor, fraction in ALL:
    got = _run(cpu, 1000, executor, fraction)
    for a, b in zip(got, want):  # XLA's own arithmetic (it may contract to FMA): close, not equal
      np.testing.assert_allclose(a.astype(np.float32), b.astype(np.float32), rtol=1e-5,
                                 atol=1e-8)


@pytest.mark.parametrize("executor,fraction", ALL)
def test_hlo_guard_cpu(executor, fraction):
  compiled, _ = _compiled(jax.devices("cpu")[0], 4096, executor, fraction)
  hlo = compiled.as_text()
  assert hlo_lib.hlo_violations(hlo) == []
  assert hlo.count(f'custom_call_target="{hu.TARGET}"') == 1


# ---- GPU: executors against the DHA kernel, bit for bit -----------------------------------------

_DHA = {}


def _dha_result(gpu, n, state_kind="pinned_host"):
  key = (n, state_kind)
  if key not in _DHA:
    _DHA[key] = _run(gpu, n, "host_dha", 0.5, state_kind=state_kind)
  return _DHA[key]


def _require_cuda_build():

  if not ffi.has_cuda():
    pytest.fail("jaxtier was built without CUDA; reinstall with "
                "-Ccmake.define.JAXTIER_ENABLE_CUDA=ON")


# 1_000_003 with 1 MiB staging slots (8 bytes staged per element: 131072-element chunks, 8 chunks
# over the 3 streams, the last partial); 9_000_001 with the default 32 MiB slots (3 chunks).
@pytest.mark.parametrize("n,chunk_bytes", [(0, None), (1, None), (1_000_003, 1 << 20),
                                           (9_000_001, None)])
@pytest.mark.parametrize("executor,fraction", OTHERS)
def test_executor_matches_dha_bitwise(gpu, monkeypatch, n, chunk_bytes, executor, fraction):
  _require_cuda_build()
  if n in (0, 1) and fraction not in (0.5, 0.37):
    pytest.skip("fractions 0 and 1 are covered at the larger sizes")
  want = _dha_result(gpu, n)
  if chunk_bytes is not None:
    monkeypatch.setenv("JAXTIER_HOST_CPU_CHUNK_BYTES", str(chunk_bytes))  # read at instantiate
  got = _run(gpu, n, executor, fraction)
  _assert_bits_equal(got, want, f"{executor} (dha_fraction={fraction}) vs host_dha, N={n}")
  if 0 < n <= 300_001:
    _assert_bits_equal(want, _numpy_reference(_inputs(n), steps=2), "DHA kernel vs numpy")


@pytest.mark.parametrize("executor,fraction", [("host_cpu", 0.5), ("split", 0.37)])
def test_executor_with_every_buffer_on_device(gpu, monkeypatch, executor, fraction):
  # No host-resident operand at all: everything goes through the staging pipeline.
  _require_cuda_build()
  n = 700_001
  want = _dha_result(gpu, n, state_kind="device")
  monkeypatch.setenv("JAXTIER_HOST_CPU_CHUNK_BYTES", str(1 << 20))
  got = _run(gpu, n, executor, fraction, state_kind="device")
  _assert_bits_equal(got, want, f"{executor} vs host_dha, all buffers on the device")


def test_bad_chunk_bytes_environment_rejected(gpu, monkeypatch):
  _require_cuda_build()
  monkeypatch.setenv("JAXTIER_HOST_CPU_CHUNK_BYTES", "12 MiB")
  with pytest.raises(Exception, match="JAXTIER_HOST_CPU_CHUNK_BYTES"):
    _run(gpu, 5000, "host_cpu", 0.5)


def test_handler_checks_executor_attributes_gpu(gpu):
  _require_cuda_build()
  _assert_handler_checks_attributes(gpu)


@pytest.mark.parametrize("executor,fraction", ALL)
def test_hlo_guard_gpu(gpu, executor, fraction):
  _require_cuda_build()
  compiled, _ = _compiled(gpu, 1 << 20, executor, fraction)
  hlo = compiled.as_text()
  assert hlo_lib.hlo_violations(hlo) == []
  assert "S(5)" in hlo  # the state reaches the call in the host memory space
  assert hlo.count(f'custom_call_target="{hu.TARGET}"') == 1
