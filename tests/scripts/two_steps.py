"""Two models, each trained by its own `jax.jit` step that donates its state, and an evaluation
jitted without donation (it imports nothing from jaxtier). Prints each step's losses."""

import sys

import jax
import jax.numpy as jnp
import optax

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 4


def make(key, width):
  k1, k2 = jax.random.split(key)
  params = {"w1": jax.random.normal(k1, (256, width)) * 0.05,
            "w2": jax.random.normal(k2, (width, 4)) * 0.05}
  return params


def loss_fn(params, x, y):
  return jnp.mean((jnp.tanh(x @ params["w1"]) @ params["w2"] - y) ** 2)


adam, sgd = optax.adamw(1e-2), optax.sgd(1e-1, momentum=0.9)


def step_a(state, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(state["params"], x, y)
  updates, opt = adam.update(grads, state["opt"], state["params"])
  return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss


def step_b(params, opt, x, y):
  loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
  updates, opt = sgd.update(grads, opt, params)
  return optax.apply_updates(params, updates), opt, loss


train_a = jax.jit(step_a, donate_argnums=0)
train_b = jax.jit(step_b, donate_argnums=(0, 1))
evaluate = jax.jit(loss_fn)

ka, kb, kx = jax.random.split(jax.random.key(0), 3)
params_a = make(ka, 512)
state_a = {"params": params_a, "opt": adam.init(params_a)}
params_b = make(kb, 384)
opt_b = sgd.init(params_b)
x = jax.random.normal(kx, (32, 256))
y = jnp.cos(x[:, :4])
for i in range(STEPS):
  state_a, loss_a = train_a(state_a, x, y)
  params_b, opt_b, loss_b = train_b(params_b, opt_b, x, y)
  print(f"step {i} a {float(loss_a)!r} b {float(loss_b)!r} "
        f"eval {float(evaluate(state_a['params'], x, y))!r}")
