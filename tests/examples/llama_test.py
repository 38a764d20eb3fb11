"""The example decoder (jaxtier/examples/llama.py): shapes, parameter counts, init, loss, bf16,
config errors (CPU, seconds)."""

import dataclasses
import math

from examples._micro import MICRO
from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier.examples import data, llama


def test_model_output_shape_and_param_count():
  model = llama.init_model(MICRO, seed=0)
  logits = model(jnp.zeros((3, 10), jnp.int32))
  assert logits.shape == (3, 10, MICRO.vocab_size)
  assert logits.dtype == jnp.float32
  params = nnx.state(model, nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(params)) == llama.param_count(MICRO)
  # Layer weights are stacked: one leaf per weight with a leading num_layers axis.
  assert params["layers"]["attn"]["wq"][...].shape == (2, 32, 2, 16)
  assert params["layers"]["mlp"]["w_down"][...].shape == (2, 64, 32)


@pytest.mark.parametrize("name", list(llama.CONFIGS))
def test_param_count_of_named_configs(name):
  count = llama.param_count(llama.CONFIGS[name])
  expected = {"tiny": (3e5, 1e6), "small": (1.5e7, 2.5e7), "1b": (0.95e9, 1.1e9),
              "8b": (7e9, 9e9), "13b": (12e9, 14e9), "14b": (14e9, 14.5e9),
              "15b": (15e9, 15.5e9), "16b": (16e9, 17e9), "12b": (11.5e9, 12e9),
              "17b": (17e9, 17.5e9)}[name]
  assert expected[0] <= count <= expected[1]


def test_init_is_deterministic_and_causal():
  a, b = llama.init_model(MICRO, 7), llama.init_model(MICRO, 7)
  for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
    np.testing.assert_array_equal(x, y)
  tokens = jnp.arange(12, dtype=jnp.int32)[None]
  changed = tokens.at[0, 8].set(200)
  np.testing.assert_allclose(a(tokens)[0, :8], a(changed)[0, :8], atol=1e-5)


def test_initial_loss_near_uniform(corpus):
  model = llama.init_model(MICRO, seed=0)
  batch = jnp.asarray(next(data.batches(corpus, 4, 32, seed=0)))
  loss = llama.loss_fn(model, batch)
  assert loss.dtype == jnp.float32
  assert abs(float(loss) - math.log(256)) < 0.3


@pytest.mark.slow
def test_bf16_compute():
  config = llama.LlamaConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64,
                             max_seq_len=16, dtype=jnp.bfloat16,
                             remat_policy="nothing_saveable")
  model = llama.init_model(config, seed=0)
  batch = jnp.ones((2, 9), jnp.int32)
  # Jitted: one compile instead of one per op of the remat'd forward and backward (seconds on
  # a CPU); the dtypes are the same, and the other tests here run the model eagerly.
  loss, grads = nnx.jit(nnx.value_and_grad(llama.loss_fn))(model, batch)
  assert loss.dtype == jnp.float32 and math.isfinite(float(loss))
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_config_errors():
  with pytest.raises(ValueError, match="num_heads"):
    llama.LlamaConfig(d_model=30, num_layers=1, num_heads=4, d_ff=8, max_seq_len=8)
  with pytest.raises(ValueError, match="remat_policy"):
    llama.LlamaConfig(d_model=32, num_layers=1, num_heads=2, d_ff=8,
                      max_seq_len=8, remat_policy="nope")
  # A jax.checkpoint_policies factory needs arguments: refused by name, not crashed on.
  with pytest.raises(ValueError, match=r"got 'save_only_these_names'\. \(The other "
                     r"jax\.checkpoint_policies names take arguments"):
    llama.LlamaConfig(d_model=32, num_layers=1, num_heads=2, d_ff=8,
                      max_seq_len=8, remat_policy="save_only_these_names")


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["nothing_saveable", "offload_dot_with_no_batch_dims"])
def test_remat_policies_give_the_same_loss_and_gradients(policy):
  # Each policy the planner may name (`activation_model`) runs and changes no value: the
  # offload one sends the projections' outputs to pinned_host and back.
  base = llama.LlamaConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64, max_seq_len=16)
  batch = jnp.asarray(np.random.default_rng(0).integers(0, 256, (2, 9)), jnp.int32)
  grad = nnx.jit(nnx.value_and_grad(llama.loss_fn))
  want_loss, want = grad(llama.init_model(base, seed=0), batch)
  loss, got = grad(llama.init_model(dataclasses.replace(base, remat_policy=policy), seed=0),
                   batch)
  np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-7)


def _assert_within_dot_bound(got, want, magnitude, n, out_dtype):
  """`got` equals the float64 `want` within the forward error bound of a length-`n` dot
  product accumulated in float32, |error| <= gamma_n * sum|x_i y_i| with gamma_n = n u / (1 - n
  u), u = 2**-24 (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5),
  plus the final rounding to `out_dtype`. It holds for any order of summation, so for any
  card's kernels."""
  u = 2.0 ** -24
  gamma = n * u / (1 - n * u)
  bound = gamma * magnitude + float(jnp.finfo(out_dtype).eps) / 2 * np.abs(want)
  err = np.abs(np.asarray(got, np.float64) - want)
  assert np.all(err <= bound), (err.max(), bound[np.argmax(err - bound)])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_head_logits_gradients(dtype):
  # The head's backward multiplies in the compute dtype: its gradients are the products of the
  # cotangent rounded to that dtype, computed here with numpy in float64 and compared within
  # the float32-accumulation error bound, which holds for any card's kernels; in float32
  # autodiff's gradients are within the same bounds.
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((2, 3, 8)), dtype)
  kernel = jnp.asarray(rng.standard_normal((8, 5)), dtype)
  g = jnp.asarray(rng.standard_normal((2, 3, 5)), jnp.float32)
  logits, vjp = jax.vjp(llama.head_logits, x, kernel)
  dx, dk = vjp(g)
  assert logits.dtype == jnp.float32 and dx.dtype == dtype and dk.dtype == dtype
  x64, k64 = np.asarray(x, np.float64), np.asarray(kernel, np.float64)
  g64 = np.asarray(g.astype(dtype), np.float64)
  ax, ak, ag = np.abs(x64), np.abs(k64), np.abs(g64)
  _assert_within_dot_bound(logits, np.einsum("btd,dv->btv", x64, k64),
                           np.einsum("btd,dv->btv", ax, ak), 8, jnp.float32)
  _assert_within_dot_bound(dx, np.einsum("btv,dv->btd", g64, k64),
                           np.einsum("btv,dv->btd", ag, ak), 5, dtype)
  _assert_within_dot_bound(dk, np.einsum("btd,btv->dv", x64, g64),
                           np.einsum("btd,btv->dv", ax, ag), 6, dtype)
  if dtype == jnp.float32:
    # With float32 operands the custom backward is autodiff's: autodiff's gradients, and those
    # of a dot accumulating in float32, are within the same bounds of the float64 products
    # (not equal bit for bit: each program may pick kernels that sum in other orders).
    autodiff = jax.vjp(lambda a, b: jnp.einsum("btd,dv->btv", a, b), x, kernel)[1](g)
    plain = jax.vjp(lambda a, b: jnp.einsum("btd,dv->btv", a, b,
                                            preferred_element_type=jnp.float32), x, kernel)[1](g)
    for want_dx, want_dk in (autodiff, plain):
      _assert_within_dot_bound(want_dx, np.einsum("btv,dv->btd", g64, k64),
                               np.einsum("btv,dv->btd", ag, ak), 5, dtype)
      _assert_within_dot_bound(want_dk, np.einsum("btd,btv->dv", x64, g64),
                               np.einsum("btd,btv->dv", ax, ag), 6, dtype)
  with pytest.raises(ValueError, match="one floating dtype, got float32 and bfloat16"):
    llama.head_logits(x.astype(jnp.float32), kernel.astype(jnp.bfloat16))
  with pytest.raises(ValueError, match="one floating dtype, got int32 and int32"):
    llama.head_logits(x.astype(jnp.int32), kernel.astype(jnp.int32))
  with pytest.raises(ValueError, match=r"expected x \[batch, seq, d_model\] and kernel "
                     r"\[d_model, vocab\], got \(2, 3, 8\) and \(9, 5\)"):
    llama.head_logits(x, jnp.zeros((9, 5), dtype))
  with pytest.raises(ValueError, match=r"got \(6, 8\) and \(8, 5\)"):
    llama.head_logits(x.reshape(6, 8), kernel)


def test_head_backward_makes_no_float32_kernel():
  # In bf16 compute the head's backward reads the bf16 kernel and a bf16 cotangent: the step's
  # HLO converts no [vocab-sized] kernel to float32 beyond the param's own gradient.
  config = llama.LlamaConfig(vocab_size=384, d_model=32, num_layers=1, num_heads=2, d_ff=64,
                             max_seq_len=16, dtype=jnp.bfloat16)
  model = llama.init_model(config, seed=0)
  batch = jnp.ones((2, 9), jnp.int32)
  graphdef, state = nnx.split(model)

  def loss(state):
    return llama.loss_fn(nnx.merge(graphdef, state), batch)

  hlo = jax.jit(jax.grad(loss)).lower(state).as_text()
  dots = [line for line in hlo.splitlines() if "dot_general" in line and "384" in line]
  assert dots, hlo
  assert not [line for line in dots if "tensor<32x384xf32>" in line.split("->")[0]], dots
