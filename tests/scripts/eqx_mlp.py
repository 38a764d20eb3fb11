"""An Equinox training script (it imports nothing from jaxtier): an `eqx.nn.MLP` on synthetic
data, optax AdamW, an `eqx.filter_jit(donate="all")` train step that returns the new model and
optimizer state. Prints each step's loss."""

import argparse

import equinox as eqx
import jax
import jax.numpy as jnp
import optax


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--hidden", type=int, default=512)
  args = parser.parse_args()
  kmodel, kx, kw = jax.random.split(jax.random.key(0), 3)
  model = eqx.nn.MLP(128, 10, args.hidden, depth=2, activation=jax.nn.relu, key=kmodel)
  optim = optax.adamw(1e-3, weight_decay=0.01)
  opt_state = optim.init(eqx.filter(model, eqx.is_array))
  x = jax.random.normal(kx, (64, 128))
  y = jnp.argmax(x @ jax.random.normal(kw, (128, 10)), axis=-1)

  def loss_fn(model, x, y):
    logits = jax.vmap(model)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  @eqx.filter_jit(donate="all")
  def train_step(model, opt_state, x, y):
    loss, grads = eqx.filter_value_and_grad(loss_fn)(model, x, y)
    updates, opt_state = optim.update(grads, opt_state, eqx.filter(model, eqx.is_array))
    model = eqx.apply_updates(model, updates)
    return model, opt_state, loss

  for step in range(args.steps):
    # The batch is donated too (donate="all"): pass a copy each step.
    model, opt_state, loss = train_step(model, opt_state, jnp.copy(x), jnp.copy(y))
    print(f"step {step} loss {float(loss)!r}")


if __name__ == "__main__":
  main()
