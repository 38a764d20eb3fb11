"""Checkpoints of an offloaded step: saved at step 10, restored in a new process, 10 more steps
give the losses of an uninterrupted 20-step run exactly, for fp32 params and for bf16 params
with fp32 masters in pinned_host."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import jaxtier

# One script for both processes: `run DIR DTYPE` trains 20 steps, saving after the 10th;
# `resume DIR DTYPE` restores that checkpoint and trains steps 11 to 20.
SCRIPT = r"""
import json, sys
import jax, jax.numpy as jnp, numpy as np, optax, jaxtier

mode, path, dtype = sys.argv[1], sys.argv[2], jnp.dtype(sys.argv[3])
tx = optax.adamw(1e-2, weight_decay=0.1)

def init(key):
  k1, k2 = jax.random.split(key)
  params = {"w1": (jax.random.normal(k1, (32, 64)) * 0.1).astype(dtype),
            "w2": (jax.random.normal(k2, (64, 4)) * 0.1).astype(dtype)}
  return {"params": params, "opt": tx.init(params)}

def step(state, batch):
  x, y = batch
  def loss_fn(p):
    h = jnp.tanh(x @ p["w1"].astype(jnp.float32))
    return jnp.mean((h @ p["w2"].astype(jnp.float32) - y) ** 2)
  loss, g = jax.value_and_grad(loss_fn)(state["params"])
  u, o = tx.update(g, state["opt"], state["params"])
  return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": loss}

def batch(i):
  rng = np.random.default_rng(i)
  return (jnp.asarray(rng.normal(size=(16, 32)), jnp.float32),
          jnp.asarray(rng.normal(size=(16, 4)), jnp.float32))

off = jaxtier.offload(step, policy="optimizer_state_on_host")
key = jax.random.key(0)
if mode == "run":
  state, first = off.init(init, key, example_args=(batch(0),)), 0
else:
  state, first = off.restore(path, jax.eval_shape(init, key), example_args=(batch(0),)), 10
kinds = sorted({x.sharding.memory_kind for x in jax.tree.leaves(state)})
losses = []
for i in range(first, 20):
  state, m = off(state, batch(i))
  losses.append(float(m["loss"]))
  if mode == "run" and i == 9:
    off.save(path, state)
print(json.dumps({"losses": losses, "kinds": kinds,
                  "masters": [str(x.sharding.memory_kind) for x in off._masters]}))
"""


def _run(tmp_path, *args):
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      [os.path.dirname(os.path.dirname(jaxtier.__file__)), os.environ.get("PYTHONPATH", "")]))
  out = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True,
                       cwd=tmp_path, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_run_resumed_in_a_new_process_gives_the_same_losses_exactly(tmp_path, dtype):
  path = str(tmp_path / "step10")
  whole = _run(tmp_path, "run", path, dtype)
  resumed = _run(tmp_path, "resume", path, dtype)
  assert resumed["losses"] == whole["losses"][10:]
  assert resumed["kinds"] == ["device", "pinned_host"]  # restored into the planned kinds
  # bf16 params carry fp32 masters in pinned_host; without them the resumed run diverges.
  assert resumed["masters"] == (["pinned_host"] * 2 if dtype == "bfloat16" else [])


def test_save_refuses_an_existing_directory_and_restore_a_missing_one(tmp_path):
  tx = optax.sgd(0.1)
  params = {"w": jnp.ones((4, 4))}
  state = {"params": params, "opt": tx.init(params)}

  def step(state, x):
    g = jax.grad(lambda p: jnp.sum(x @ p["w"]))(state["params"])
    u, o = tx.update(g, state["opt"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}
  off = jaxtier.offload(step)
  with pytest.raises(ValueError, match="no plan yet"):
    off.save(tmp_path / "early", state)
  placed = off.place(state, jnp.ones((2, 4)))
  off.save(tmp_path / "ck", placed)
  with pytest.raises(ValueError, match="exists; save to a new directory"):
    off.save(tmp_path / "ck", placed)
  with pytest.raises(FileNotFoundError, match="no checkpoint at"):
    off.restore(tmp_path / "missing", placed)
  back = off.restore(tmp_path / "ck", placed)
  np.testing.assert_array_equal(np.asarray(back["params"]["w"]), np.ones((4, 4)))
  # A state of other shapes than the one saved: the first leaf that differs is named, with
  # its shape and dtype on each side.
  wrong = jax.tree.map(lambda x: jax.ShapeDtypeStruct((8, 4), x.dtype) if x.ndim == 2 else x,
                       back)
  with pytest.raises(ValueError, match=r"does not hold a state like the one given: its first "
                     r"leaf that differs is \['params'\]\['w'\], float32\[4, 4\] in "
                     r"the checkpoint and float32\[8, 4\] in the state given") as err:
    off.restore(tmp_path / "ck", wrong)
  assert isinstance(err.value, jaxtier.CheckpointMismatchError)
  assert (err.value.leaf, err.value.given, err.value.saved) == (
      "['params']['w']", "float32[8, 4]", "float32[4, 4]")


def test_restore_into_another_structure_names_the_first_leaf_before_tracing(tmp_path):
  # restore(path, {"params": jnp.asarray(1)}) in a new step failed with a jax.grad error from tracing the
  # user's step for that state; now the checkpoint's metadata is read first.
  tx = optax.adam(0.1)
  params = {"w": jnp.ones((4, 4))}
  traced = []

  def step(state, x):
    traced.append(1)
    g = jax.grad(lambda p: jnp.sum(x @ p["w"]))(state["params"])
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}
  off = jaxtier.offload(step)
  off.save(tmp_path / "ck", off.place({"params": params, "opt": tx.init(params)},
                                      jnp.ones((2, 4))))
  fresh, traced[:] = jaxtier.offload(step), []
  with pytest.raises(jaxtier.CheckpointMismatchError, match=r"its first leaf that differs is "
                     r"\['params'\], absent in the checkpoint and int32\[\] in the state given"
                     ) as err:
    fresh.restore(tmp_path / "ck", {"params": jnp.asarray(1)}, example_args=(jnp.ones((2, 4)),))
  assert (err.value.leaf, err.value.given, err.value.saved) == ("['params']", "int32[]", None)
  assert not traced and fresh.plan is None  # refused before the step was traced
  # A leaf only the checkpoint has: named after the state's own leaves.
  with pytest.raises(jaxtier.CheckpointMismatchError) as err:
    fresh.restore(tmp_path / "ck", {"params": params}, example_args=(jnp.ones((2, 4)),))
  assert (err.value.leaf, err.value.given, err.value.saved) == (
      "['opt'][0]['count']", None, "int32[]")
