"""A `jax.jit` train step over a mesh of every device, its shardings given by `in_shardings`
and `out_shardings` (it imports nothing from jaxtier): the 2-D params and their moments split
by rows, the rest replicated, the batch split. Prints each step's loss, then one JSON line: each
state leaf's partition spec and memory kind, and the loss's spec."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

STEPS = 6

mesh = Mesh(np.array(jax.devices()), ("d",))
rows, replicated = NamedSharding(mesh, P("d")), NamedSharding(mesh, P())
tx = optax.adamw(1e-2, weight_decay=0.1)
k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
params = {"w1": jax.random.normal(k1, (512, 256)) * 0.05, "b1": jnp.zeros((256,)),
          "w2": jax.random.normal(k2, (256, 8)) * 0.05}
state = {"params": params, "opt": tx.init(params)}
x = jax.random.normal(k3, (64, 512))
y = jnp.sin(x[:, :8])


def loss_fn(p, x, y):
  return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)


def train_step(state, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
  updates, opt = tx.update(grads, state["opt"], state["params"])
  return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, {"loss": loss}


state_shardings = jax.tree.map(lambda a: rows if np.ndim(a) == 2 else replicated, state)
step = jax.jit(train_step, in_shardings=(state_shardings, rows, rows),
               out_shardings=(state_shardings, replicated), donate_argnums=0)
for i in range(STEPS):
  state, metrics = step(state, x, y)
  print(f"step {i} loss {float(metrics['loss'])!r}")
leaves = jax.tree_util.tree_flatten_with_path(state)[0]
print(json.dumps({
    "state": {jax.tree_util.keystr(path): [str(leaf.sharding.spec), leaf.sharding.memory_kind]
              for path, leaf in leaves},
    "loss": str(metrics["loss"].sharding.spec)}))
