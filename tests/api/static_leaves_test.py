"""Leaves that are not arrays are static, as eqx.filter_jit treats them; structure errors are
short and name what differs.

A module's callables, `functools.partial`s, strings and Python bools and ints are passed to the
step as they are (not traced, placed or counted) and kept in the state it returns. A Flax NNX
module holding a `functools.partial` (as the NNX MNIST CNN's `avg_pool`) has a tree structure
equal only to itself: two initialisations of it differ, though they print the same.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import jaxtier

ON_HOST = "optimizer_state_on_host"
TX = optax.adamw(1e-2)


def _images(i=0):
  x = jnp.linspace(-1.0, 1.0, 4 * 8 * 8).reshape(4, 8, 8, 1) * (1.0 + 0.1 * i)
  return x, jnp.arange(4, dtype=jnp.int32) % 10


class CNN(nnx.Module):
  """The NNX MNIST example's CNN, small: its pooling is a partial held by the module."""

  def __init__(self, *, rngs):
    self.conv = nnx.Conv(1, 4, kernel_size=(3, 3), rngs=rngs)
    self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
    self.linear = nnx.Linear(4 * 4 * 4, 10, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.conv(x)))
    return self.linear(x.reshape(x.shape[0], -1))


def _cnn_loss(model, batch):
  x, y = batch
  return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()


def _init_modules():
  model = CNN(rngs=nnx.Rngs(0))
  return model, nnx.Optimizer(model, TX, wrt=nnx.Param)


def _modules_step(state, batch):
  """The state is the modules themselves (NNX modules are pytrees)."""
  model, optimizer = state
  loss, grads = nnx.value_and_grad(_cnn_loss)(model, batch)
  optimizer.update(model, grads)
  return (model, optimizer), {"loss": loss}


@pytest.mark.parametrize("policy", [ON_HOST, "none"])
def test_nnx_modules_holding_a_partial_init_and_train_as_jit(policy):
  step = jaxtier.offload(_modules_step, policy=policy)
  state = step.init(_init_modules, example_args=(_images(),))
  ref_state = _init_modules()
  ref_step = jax.jit(_modules_step)
  for i in range(3):
    state, got = step(state, _images(i))
    ref_state, ref = ref_step(ref_state, _images(i))
    np.testing.assert_allclose(float(got["loss"]), float(ref["loss"]), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-7)
  assert isinstance(state[0].avg_pool, functools.partial)
  # One plan: the state each step returns has the structure planned.
  assert len(step._plans) == 1
  if policy == ON_HOST:
    moments = [l for l in step.plan.leaves if "mu" in l.path or "nu" in l.path]
    assert moments and {l.memory_kind for l in moments} == {"pinned_host"}


def test_nnx_state_split_from_a_module_holding_a_partial_inits_and_trains():
  # The example's form: nnx.split once, nnx.merge in the step, nnx.state as the state.
  graphdef, _ = nnx.split(_init_modules())

  def init():
    return nnx.state(_init_modules())

  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    loss, grads = nnx.value_and_grad(_cnn_loss)(model, batch)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer)), {"loss": loss}

  step = jaxtier.offload(train_step, policy=ON_HOST)
  state = step.init(init, example_args=(_images(),))
  ref_state = init()
  for i in range(2):
    state, got = step(state, _images(i))
    ref_state, ref = jax.jit(train_step)(ref_state, _images(i))
  np.testing.assert_allclose(float(got["loss"]), float(ref["loss"]), rtol=1e-6)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=["w", "use_bias", "depth", "act", "name"], meta_fields=[])
@dataclasses.dataclass
class Mlp:
  """A module whose config lives in its fields, as Equinox keeps it: a bool the step branches
  on, an int it loops over, a partial it calls and a string, beside its weights."""

  w: jax.Array
  use_bias: bool
  depth: int
  act: functools.partial
  name: str


def _mlp(use_bias=False):
  return Mlp(w=jnp.linspace(-0.5, 0.5, 32 * 32).reshape(32, 32), use_bias=use_bias, depth=2,
             act=functools.partial(jax.nn.gelu, approximate=True), name="mlp")


def _mlp_loss(w, m, x):
  h = x
  for _ in range(m.depth):  # a Python loop over a Python int: not traceable as an array
    h = m.act(h @ w)
  if m.use_bias:  # a Python branch on a Python bool
    h = h + 1.0
  return jnp.mean(h ** 2)


def _mlp_step(state, x):
  model = state["model"]
  loss, g = jax.value_and_grad(_mlp_loss)(model.w, model, x)
  u, opt = TX.update(g, state["opt"], model.w)
  model = dataclasses.replace(model, w=optax.apply_updates(model.w, u))
  return {"model": model, "opt": opt, "step": state["step"] + 1}, {"loss": loss,
                                                                    "name": model.name}


def _mlp_state(use_bias=False):
  model = _mlp(use_bias)
  return {"model": model, "opt": TX.init(model.w), "step": 0}


def _mlp_reference(use_bias, steps):
  """The same training with the static fields closed over, as jax.jit needs them."""
  model = _mlp(use_bias)

  @jax.jit
  def step(w, opt, x):
    loss, g = jax.value_and_grad(_mlp_loss)(w, model, x)
    u, opt = TX.update(g, opt, w)
    return optax.apply_updates(w, u), opt, loss
  w, opt, losses = model.w, TX.init(model.w), []
  for i in range(steps):
    w, opt, loss = step(w, opt, _x(i))
    losses.append(float(loss))
  return w, losses


def _x(i=0):
  return jnp.linspace(0.0, 1.0, 8 * 32).reshape(8, 32) + 0.05 * i


@pytest.mark.parametrize("policy", [ON_HOST, "none"])
def test_python_bool_int_and_partial_fields_are_static(policy):
  step = jaxtier.offload(_mlp_step, policy=policy)
  state = step.place(_mlp_state(), _x())
  # Static leaves are passed through, not placed; only the arrays are in the plan.
  assert state["model"].use_bias is False and state["model"].depth == 2
  assert state["model"].name == "mlp" and isinstance(state["model"].act, functools.partial)
  assert [l.path for l in step.plan.leaves if "model" in l.path] == ["['model'].w"]
  losses = []
  for i in range(3):
    state, m = step(state, _x(i))
    losses.append(float(m["loss"]))
  w, ref = _mlp_reference(False, 3)
  np.testing.assert_allclose(losses, ref, rtol=1e-5)
  np.testing.assert_allclose(np.asarray(state["model"].w), np.asarray(w), rtol=1e-5, atol=1e-7)
  assert state["model"].use_bias is False and state["model"].depth == 2
  assert m["name"] == "mlp"  # a static metric, returned as the step made it
  # The counter the step changes is traced, as jax.jit traces it.
  assert int(state["step"]) == 3 and state["step"].dtype == jnp.int32
  if policy == ON_HOST:
    assert {l.memory_kind for l in step.plan.leaves if ".mu" in l.path} == {"pinned_host"}


def test_a_changed_static_field_plans_the_step_again():
  # As jax.jit re-traces for a new static argument: the step branches the other way.
  step = jaxtier.offload(_mlp_step, policy=ON_HOST)
  state = step.place(_mlp_state(), _x())
  state, _ = step(state, _x())
  ref = _mlp_loss(state["model"].w, _mlp(True), _x())
  flipped = dict(state, model=dataclasses.replace(state["model"], use_bias=True))
  _, m = step(flipped, _x())
  assert len(step._plans) == 2
  np.testing.assert_allclose(float(m["loss"]), float(ref), rtol=1e-6)


def test_a_python_bool_argument_is_static():
  def step_fn(state, x, train):
    loss, g = jax.value_and_grad(lambda w: jnp.mean((x @ w) ** 2))(state["w"])
    if not train:  # a Python branch on the argument
      return state, {"loss": loss}
    return {"w": state["w"] - 0.1 * g}, {"loss": loss}
  state = {"w": jnp.linspace(-1.0, 1.0, 32 * 32).reshape(32, 32)}
  ref, _ = jax.jit(step_fn, static_argnums=2)(state, _x(), True)
  step = jaxtier.offload(step_fn)
  placed = step.place(state, _x(), True)
  new, _ = step(placed, _x(), True)
  np.testing.assert_allclose(np.asarray(new["w"]), np.asarray(ref["w"]), rtol=1e-6)
  same, _ = step(new, _x(), False)
  np.testing.assert_array_equal(np.asarray(same["w"]), np.asarray(ref["w"]))


def test_a_string_leaf_of_the_state_is_kept():
  step = jaxtier.offload(_mlp_step)
  state = dict(_mlp_state(), run="run-1")

  def with_run(s, x):
    new, m = _mlp_step({k: v for k, v in s.items() if k != "run"}, x)
    return dict(new, run=s["run"]), m
  step = jaxtier.offload(with_run)
  state, _ = step(step.place(state, _x()), _x())
  assert state["run"] == "run-1"


def test_a_new_state_of_another_structure_is_refused_naming_the_paths():
  def renamed(state, x):
    new, m = _mlp_step(state, x)
    return {"model": new["model"], "optimizer": new["opt"], "step": new["step"]}, m
  step = jaxtier.offload(renamed)
  with pytest.raises(TypeError) as err:
    step.place(_mlp_state(), _x())
  text = str(err.value)
  assert "['opt'][0].mu: float32[32, 32] in the state, absent from the new state" in text
  assert "['optimizer'][0].count: int32[] in the new state, absent from the state" in text
  assert "; and 2 more." in text  # at most a few lines
  assert len(text) < 700, text
  # A static leaf the step makes an array, named by its path.
  def traced_flag(state, x):
    new, m = _mlp_step(state, x)
    return dict(new, model=dataclasses.replace(new["model"], act=jnp.zeros(()))), m
  with pytest.raises(TypeError, match=r"state leaf \['model'\]\.act as an array, but it came "
                                      r"in as a static partial"):
    jaxtier.offload(traced_flag).place(_mlp_state(), _x())


def test_init_returning_another_structure_is_refused_briefly_naming_the_path():
  calls = []

  def init():
    calls.append(1)
    state = _mlp_state()
    if len(calls) > 1:  # planned from the first call; the second makes another state
      state["opt"] = TX.init(jnp.zeros((16, 32)))
    return state
  step = jaxtier.offload(_mlp_step)
  with pytest.raises(ValueError) as err:
    step.init(init, example_args=(_x(),))
  text = str(err.value)
  assert "OffloadedStep.init: init_fn returns another state than the one planned" in text
  assert ("['opt'][0].mu: float32[32, 32] in the state planned, float32[16, 32] in the state "
          "init_fn returns") in text
  assert len(text) < 600, text


def test_init_save_and_restore_keep_the_static_fields_and_the_counter(tmp_path):
  step = jaxtier.offload(_mlp_step, policy=ON_HOST)
  state = step.init(_mlp_state, example_args=(_x(),))
  assert state["model"].use_bias is False and isinstance(state["model"].act, functools.partial)
  assert state["step"].dtype == jnp.int32 and int(state["step"]) == 0  # traced: it counts
  assert {l.memory_kind for l in step.plan.leaves if ".mu" in l.path} == {"pinned_host"}
  for i in range(2):
    state, _ = step(state, _x(i))
  step.save(tmp_path / "ck", state)
  arrays = lambda tree: [x for x in jax.tree.leaves(tree) if isinstance(x, jax.Array)]
  want = [np.asarray(x) for x in arrays(state)]
  again = jaxtier.offload(_mlp_step, policy=ON_HOST)
  restored = again.restore(tmp_path / "ck", _mlp_state(), example_args=(_x(),))
  assert restored["model"].name == "mlp" and restored["model"].depth == 2
  assert len(arrays(restored)) == len(want) == 5  # w, count, mu, nu, step
  for a, b in zip(arrays(restored), want):
    np.testing.assert_array_equal(np.asarray(a), b)
  _, m = again(restored, _x(2))
  _, ref = step(state, _x(2))
  np.testing.assert_allclose(float(m["loss"]), float(ref["loss"]), rtol=1e-6)
