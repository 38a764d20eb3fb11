"""A small model the tests share: a stack of tanh layers read by `nnx.scan`, as the example
decoder's layers are (its params and optimizer state stacked `[layers, ...]`)."""

import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
  """One layer: tanh(x W + b), computed in the param dtype (or `compute_dtype`: the params
  cast to it), returned in fp32."""

  def __init__(self, width: int, rngs: nnx.Rngs, compute_dtype=None):
    self.w = nnx.Linear(width, width, dtype=compute_dtype, rngs=rngs)

  def __call__(self, x):
    return jnp.tanh(self.w(x.astype(self.w.kernel.get_value().dtype)).astype(jnp.float32))


class Stack(nnx.Module):
  """[w_in (inputs -> width)] -> `layers` Blocks under nnx.scan -> [head (width -> head)].

  The stacked layers live under the attribute `name` (their leaf paths say it); `body` is one
  iteration of the scan (a subclass may wrap it).
  """

  def __init__(self, rngs: nnx.Rngs, *, layers: int, width: int, head: int = 0,
               inputs: int = 0, name: str = "blocks", compute_dtype=None):
    self.name = name
    if inputs:
      self.w_in = nnx.Linear(inputs, width, rngs=rngs)

    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def make(rngs):
      return Block(width, rngs, compute_dtype)
    setattr(self, name, make(rngs))
    if head:
      self.head = nnx.Linear(width, head, rngs=rngs)

  def body(self, h, block):
    return block(h)

  def __call__(self, x):
    if hasattr(self, "w_in"):
      x = self.w_in(x)

    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def run(h, block):
      return self.body(h, block)
    h = run(x, getattr(self, self.name))
    return self.head(h) if hasattr(self, "head") else h


def failing_stack(fail_at, *, layers: int, width: int, head: int = 2):
  """A `Stack` whose backward pass raises once `fail_at()` says so: each layer's input goes
  through an identity whose gradient is a host callback calling `fail_at()` (it raises
  RuntimeError when that returns True). Counts the calls in `fail_at` itself."""
  import jax  # pylint: disable=g-import-not-at-top

  def check(x):
    if fail_at():
      raise RuntimeError("injected failure in the backward pass")
    return x

  @jax.custom_vjp
  def probe(h):
    return h

  def probe_fwd(h):
    return h, None

  def probe_bwd(_, g):
    return (jax.pure_callback(check, jax.ShapeDtypeStruct(g.shape, g.dtype), g),)
  probe.defvjp(probe_fwd, probe_bwd)

  class Probed(Stack):

    def body(self, h, block):
      return block(probe(h))

  return Probed(nnx.Rngs(0), layers=layers, width=width, head=head)
