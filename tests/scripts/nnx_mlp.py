"""A Flax NNX training script written as the NNX tutorials write one (it imports nothing from
jaxtier): an MLP on synthetic data, optax AdamW, a `nnx.jit` train step that donates the model
and the optimizer. Prints each step's loss."""

import argparse

from flax import nnx
import jax
import jax.numpy as jnp
import optax


class MLP(nnx.Module):

  def __init__(self, din: int, dhidden: int, dout: int, *, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(din, dhidden, rngs=rngs)
    self.linear2 = nnx.Linear(dhidden, dhidden, rngs=rngs)
    self.linear3 = nnx.Linear(dhidden, dout, rngs=rngs)

  def __call__(self, x):
    x = nnx.relu(self.linear1(x))
    x = nnx.relu(self.linear2(x))
    return self.linear3(x)


def loss_fn(model, x, y):
  logits = model(x)
  return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


@nnx.jit(donate_argnames=("model", "optimizer"))
def train_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
  optimizer.update(model, grads)
  return loss


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=8)
  parser.add_argument("--hidden", type=int, default=512)
  args = parser.parse_args()
  model = MLP(128, args.hidden, 10, rngs=nnx.Rngs(0))
  optimizer = nnx.Optimizer(model, optax.adamw(1e-3, weight_decay=0.01), wrt=nnx.Param)
  kx, kw = jax.random.split(jax.random.key(1))
  x = jax.random.normal(kx, (64, 128))
  y = jnp.argmax(x @ jax.random.normal(kw, (128, 10)), axis=-1)
  for step in range(args.steps):
    loss = train_step(model, optimizer, x, y)
    print(f"step {step} loss {float(loss)!r}")


if __name__ == "__main__":
  main()
