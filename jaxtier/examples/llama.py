"""A Llama-style byte-level decoder in Flax NNX, with its layers stacked for ``nnx.scan``.

Architecture: token embedding; ``num_layers`` pre-norm decoder layers, each
``x + attn(rms_norm(x))`` (causal multi-head self-attention with rotary position
embeddings) followed by ``x + mlp(rms_norm(x))`` (SwiGLU); a final RMSNorm and an
untied output projection to ``vocab_size`` logits.

The decoder layers are created once under ``nnx.vmap`` and run under ``nnx.scan``,
so every per-layer weight is a single leaf with a leading ``[num_layers, ...]``
axis. The leaves of a model's state (``nnx.state(model)``) are:

=============================  ==========================================  ============
path                           shape                                       role
=============================  ==========================================  ============
``embed/embedding``            ``[vocab_size, d_model]``                   param
``layers/attn_norm/scale``     ``[num_layers, d_model]``                   param
``layers/attn/wq|wk|wv``       ``[num_layers, d_model, num_heads, head_dim]``  param
``layers/attn/wo``             ``[num_layers, num_heads, head_dim, d_model]``  param
``layers/mlp_norm/scale``      ``[num_layers, d_model]``                   param
``layers/mlp/w_gate|w_up``     ``[num_layers, d_model, d_ff]``             param
``layers/mlp/w_down``          ``[num_layers, d_ff, d_model]``             param
``final_norm/scale``           ``[d_model]``                               param
``head/kernel``                ``[d_model, vocab_size]``                   param
=============================  ==========================================  ============

Example:
  >>> from jaxtier.examples import llama
  >>> config = llama.CONFIGS["tiny"]
  >>> model = llama.init_model(config, seed=0)
  >>> logits = model(jnp.zeros((2, 16), jnp.int32))   # doctest: +SKIP
  >>> logits.shape                                    # doctest: +SKIP
  (2, 16, 256)
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import optax

import jaxtier

__all__ = [
    "CONFIGS",
    "activation_model",
    "LlamaConfig",
    "Llama",
    "head_logits",
    "init_model",
    "loss_fn",
    "param_count",
]


# The per-layer rematerialisation policies the decoder takes by name: the jax.checkpoint_policies
# entries that are policies, and the factory the planner's `offload` option names, built to
# send the projections' outputs from the device to pinned_host.
REMAT_POLICIES = {
    name: (lambda name=name: getattr(jax.checkpoint_policies, name))
    for name in ("everything_saveable", "nothing_saveable", "dots_saveable",
                 "checkpoint_dots", "dots_with_no_batch_dims_saveable",
                 "checkpoint_dots_with_no_batch_dims")
} | {"offload_dot_with_no_batch_dims": lambda: (
    jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", "pinned_host"))}


@dataclasses.dataclass(frozen=True, kw_only=True)
class LlamaConfig:
  """Shape and numerics of a Llama-style decoder.

  Attributes:
    vocab_size: number of token ids; 256 for byte-level text.
    d_model: width of the residual stream.
    num_layers: number of decoder layers (the leading axis of every layer weight).
    num_heads: number of attention heads; must divide ``d_model``.
    d_ff: hidden width of the SwiGLU MLP.
    max_seq_len: longest sequence the model is meant for (the trainer's default
      sequence length); RoPE itself has no table and no hard limit.
    dtype: compute dtype of activations and matmuls (norms, softmax and the loss
      are computed in float32).
    param_dtype: storage dtype of the parameters.
    rope_theta: base of the rotary embedding frequencies.
    norm_eps: epsilon of RMSNorm.
    remat_policy: ``None`` to keep all activations of a layer for the backward
      pass, or the name of a ``jax.checkpoint_policies`` member (for example
      ``"nothing_saveable"``) to rematerialise each layer under that policy.
  """

  vocab_size: int = 256
  d_model: int
  num_layers: int
  num_heads: int
  d_ff: int
  max_seq_len: int
  dtype: Any = jnp.float32
  param_dtype: Any = jnp.float32
  rope_theta: float = 10_000.0
  norm_eps: float = 1e-5
  remat_policy: str | None = None

  def __post_init__(self):
    for name in ("vocab_size", "d_model", "num_layers", "num_heads", "d_ff",
                 "max_seq_len"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"LlamaConfig: expected {name} to be a positive int, got {value!r}.")
    if self.d_model % self.num_heads:
      raise ValueError(
          f"LlamaConfig: expected num_heads to divide d_model, got d_model="
          f"{self.d_model}, num_heads={self.num_heads}; pick a divisor.")
    if self.head_dim % 2:
      raise ValueError(
          f"LlamaConfig: expected an even head_dim for RoPE, got "
          f"d_model / num_heads = {self.head_dim}.")
    if self.remat_policy is not None and self.remat_policy not in REMAT_POLICIES:
      raise ValueError(
          f"LlamaConfig: expected remat_policy to be None (--remat_policy=none) or one of "
          f"{', '.join(REMAT_POLICIES)}, got {self.remat_policy!r}. (The "
          f"other jax.checkpoint_policies names take arguments; pass such a "
          f"policy to nnx.remat in a model of your own.)")

  @property
  def head_dim(self) -> int:
    return self.d_model // self.num_heads


# A Llama-2-13B decoder layer (without grouped-query attention), bf16 compute, each layer
# rematerialised: the 13b config and the deeper capacity configs stack it.
_LLAMA2_13B_LAYER = dict(d_model=5120, num_heads=40, d_ff=13824, max_seq_len=2048,
                         dtype=jnp.bfloat16, remat_policy="nothing_saveable")

CONFIGS: dict[str, LlamaConfig] = {
    # ~0.49M params: trains in about a minute on 2 CPU cores (see train.py).
    "tiny": LlamaConfig(
        d_model=128, num_layers=2, num_heads=4, d_ff=384, max_seq_len=128),
    # ~19.5M params.
    "small": LlamaConfig(
        d_model=512, num_layers=6, num_heads=8, d_ff=1408, max_seq_len=512),
    # ~1.03e9 params, bf16 compute.
    "1b": LlamaConfig(
        d_model=2048, num_layers=20, num_heads=16, d_ff=5632, max_seq_len=2048,
        dtype=jnp.bfloat16, remat_policy="dots_with_no_batch_dims_saveable"),
    # Llama-3-8B shapes (without grouped-query attention), vocab 256: ~7.8e9 params.
    "8b": LlamaConfig(
        d_model=4096, num_layers=32, num_heads=32, d_ff=14336, max_seq_len=2048,
        dtype=jnp.bfloat16, remat_policy="nothing_saveable"),
    # Capacity configs: Llama-2-13B layers, stacked shallower or deeper, toward what one GPU
    # and its host hold at 16 B/param (fp32 params, gradients, m and v; an H100 with 125 GiB
    # of host about 13.3e9, an H200 about 17.9e9): ~11.7e9, ~12.7e9 (13b: Llama-2-13B's
    # shapes, vocab 256), ~14.3e9, ~15.2e9, ~16.5e9, ~17.1e9 params, in the order of their
    # size.
    "12b": LlamaConfig(num_layers=37, **_LLAMA2_13B_LAYER),
    "13b": LlamaConfig(num_layers=40, **_LLAMA2_13B_LAYER),
    "14b": LlamaConfig(num_layers=45, **_LLAMA2_13B_LAYER),
    "15b": LlamaConfig(num_layers=48, **_LLAMA2_13B_LAYER),
    "16b": LlamaConfig(num_layers=52, **_LLAMA2_13B_LAYER),
    "17b": LlamaConfig(num_layers=54, **_LLAMA2_13B_LAYER),
}


def param_count(config: LlamaConfig) -> int:
  """Number of parameters of ``Llama(config)``, computed without allocating.

  Args:
    config: the model shape.

  Returns:
    The total number of parameter elements (not bytes).
  """
  d, f, v = config.d_model, config.d_ff, config.vocab_size
  per_layer = 4 * d * d + 3 * d * f + 2 * d  # q, k, v, o; gate, up, down; 2 norms
  return v * d + config.num_layers * per_layer + d + d * v


# How the traced step's remat policy maps to the planner's activation options.
_TRACED_POLICY = {None: "keep", "everything_saveable": "keep",
                  "dots_with_no_batch_dims_saveable": "save_dots", "nothing_saveable": "remat",
                  "offload_dot_with_no_batch_dims": "offload"}


def activation_model(config: LlamaConfig, batch_size: int, seq_len: int):
  """The planner's activation options for this decoder (a `jaxtier.ActivationModel`).

  Estimates, per step and device (one device), of what the backward pass needs from the
  forward pass of the ``num_layers`` decoder layers, in ``config.dtype`` bytes ``e`` (attention
  scores in float32), with tokens ``T = batch_size * seq_len``, width ``d``, MLP width ``f``,
  heads ``h``:

  - ``keep`` (no rematerialisation): per layer ``10 T d e`` (norm inputs and outputs, q, k, v,
    rotated q and k, attention output, residuals) + ``h T s (4 + e)`` (scores and
    probabilities) + ``4 T f e`` (gate, up, their SwiGLU product and its input).
  - ``save_dots`` (``dots_with_no_batch_dims_saveable``): the projections' outputs,
    ``(5 T d + 2 T f) e`` per layer; the backward recomputes the attention (its dots have batch
    dimensions): ``4 T s d`` FLOP per layer.
  - ``remat`` (``nothing_saveable``): each layer's input, ``T d e`` per layer; the backward
    recomputes the whole forward of the layers: ``2 P_layers T + 4 T s d L`` FLOP.
  - ``offload`` (``offload_dot_with_no_batch_dims('device', 'pinned_host')``): the projections'
    outputs go to pinned_host in the forward pass and come back in the backward pass; the
    layer input stays; the attention is recomputed as for ``save_dots``.

  Returns:
    The model, with ``traced`` set from ``config.remat_policy`` (None when that policy is not
    one of those above).
  """

  traced = _TRACED_POLICY.get(config.remat_policy)
  if traced is None:
    return None
  e = jnp.dtype(config.dtype).itemsize
  t, d, f, h, n = batch_size * seq_len, config.d_model, config.d_ff, config.num_heads, \
      config.num_layers
  keep = n * (10 * t * d * e + h * t * seq_len * (4 + e) + 4 * t * f * e)
  dots = n * (5 * t * d + 2 * t * f) * e
  layer_input = n * t * d * e
  attention_fwd = 4.0 * t * seq_len * d * n
  layer_params = n * (4 * d * d + 3 * d * f)
  return jaxtier.ActivationModel(traced=traced, options={
      "keep": jaxtier.ActivationOption(held_bytes=keep, checkpoint_policy="everything_saveable"),
      "save_dots": jaxtier.ActivationOption(held_bytes=dots + layer_input,
                                       recompute_flops=attention_fwd,
                                       checkpoint_policy="dots_with_no_batch_dims_saveable"),
      "remat": jaxtier.ActivationOption(held_bytes=layer_input,
                                   recompute_flops=2.0 * layer_params * t + attention_fwd,
                                   checkpoint_policy="nothing_saveable"),
      "offload": jaxtier.ActivationOption(held_bytes=layer_input, recompute_flops=attention_fwd,
                                     offload_bytes=dots,
                                     checkpoint_policy="offload_dot_with_no_batch_dims"),
  })


def _truncated_normal(key, shape, std, dtype):
  # A unit-variance truncated normal at +-2 has std ~0.88; rescale so `std` holds.
  x = jax.random.truncated_normal(key, -2.0, 2.0, shape, jnp.float32)
  return (x * (std / 0.8796256610342398)).astype(dtype)


class RMSNorm(nnx.Module):
  """``x / rms(x) * scale``, computed in float32, returned in ``dtype``."""

  def __init__(self, dim: int, *, eps: float, dtype, param_dtype):
    self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
    self.eps = eps
    self.dtype = dtype

  def __call__(self, x):
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
    return (x32 * self.scale[...].astype(jnp.float32)).astype(self.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float):
  """cos and sin of the rotary angles, each float32 ``[seq_len, head_dim // 2]``."""
  inv_freq = theta ** (-jnp.arange(0, head_dim // 2, dtype=jnp.float32) * 2.0 / head_dim)
  angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
  return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x, cos, sin):
  """Rotates pairs (i, i + head_dim/2) of ``x`` ``[batch, seq, heads, head_dim]``."""
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  cos, sin = cos[None, :, None, :], sin[None, :, None, :]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)


class Attention(nnx.Module):
  """Causal multi-head self-attention with rotary position embeddings."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    d, h, hd = config.d_model, config.num_heads, config.head_dim
    in_std = d ** -0.5
    out_std = (h * hd) ** -0.5 / math.sqrt(2 * config.num_layers)
    pd = config.param_dtype
    self.wq = nnx.Param(_truncated_normal(rngs.params(), (d, h, hd), in_std, pd))
    self.wk = nnx.Param(_truncated_normal(rngs.params(), (d, h, hd), in_std, pd))
    self.wv = nnx.Param(_truncated_normal(rngs.params(), (d, h, hd), in_std, pd))
    self.wo = nnx.Param(_truncated_normal(rngs.params(), (h, hd, d), out_std, pd))
    self.dtype = config.dtype

  def __call__(self, x, cos, sin):
    dt = self.dtype
    q = jnp.einsum("btd,dhk->bthk", x, self.wq[...].astype(dt))
    k = jnp.einsum("btd,dhk->bthk", x, self.wk[...].astype(dt))
    v = jnp.einsum("btd,dhk->bthk", x, self.wv[...].astype(dt))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    scores = jnp.einsum("bqhk,bshk->bhqs", q, k, preferred_element_type=jnp.float32)
    scores = scores * (q.shape[-1] ** -0.5)
    seq_len = x.shape[1]
    causal = jnp.tril(jnp.ones((seq_len, seq_len), jnp.bool_))
    scores = jnp.where(causal[None, None], scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(dt)
    out = jnp.einsum("bhqs,bshk->bqhk", probs, v)
    return jnp.einsum("bthk,hkd->btd", out, self.wo[...].astype(dt))


class SwiGLU(nnx.Module):
  """``w_down(silu(x @ w_gate) * (x @ w_up))``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    d, f, pd = config.d_model, config.d_ff, config.param_dtype
    in_std = d ** -0.5
    out_std = f ** -0.5 / math.sqrt(2 * config.num_layers)
    self.w_gate = nnx.Param(_truncated_normal(rngs.params(), (d, f), in_std, pd))
    self.w_up = nnx.Param(_truncated_normal(rngs.params(), (d, f), in_std, pd))
    self.w_down = nnx.Param(_truncated_normal(rngs.params(), (f, d), out_std, pd))
    self.dtype = config.dtype

  def __call__(self, x):
    dt = self.dtype
    gate = x @ self.w_gate[...].astype(dt)
    up = x @ self.w_up[...].astype(dt)
    return (jax.nn.silu(gate) * up) @ self.w_down[...].astype(dt)


class DecoderLayer(nnx.Module):
  """Pre-norm block: ``x + attn(norm(x))``, then ``x + mlp(norm(x))``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    norm = dict(eps=config.norm_eps, dtype=config.dtype,
                param_dtype=config.param_dtype)
    self.attn_norm = RMSNorm(config.d_model, **norm)
    self.attn = Attention(config, rngs=rngs)
    self.mlp_norm = RMSNorm(config.d_model, **norm)
    self.mlp = SwiGLU(config, rngs=rngs)

  def __call__(self, x, cos, sin):
    x = x + self.attn(self.attn_norm(x), cos, sin)
    return x + self.mlp(self.mlp_norm(x))


class Embed(nnx.Module):
  """Token embedding table ``[vocab_size, d_model]``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.embedding = nnx.Param(_truncated_normal(
        rngs.params(), (config.vocab_size, config.d_model), 1.0,
        config.param_dtype))
    self.dtype = config.dtype

  def __call__(self, tokens):
    return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)


@jax.custom_vjp
def head_logits(x, kernel):
  """float32 logits ``[batch, seq, vocab]`` of ``x`` ``[batch, seq, d_model]`` and ``kernel``
  ``[d_model, vocab]``, both of one dtype (the compute dtype), with float32 accumulation.

  The backward pass multiplies in that dtype, as the layers' matmuls do: the float32 logits'
  cotangent is rounded to it first, and both gradients come out in the operands' dtype (as
  autodiff's do). Autodiff of the forward would instead multiply the float32
  cotangent by a float32 copy of the kernel, made in the backward pass (4 bytes per kernel
  element: 1 GiB for a 131,072-token vocabulary at d_model 2,048). With float32 operands this
  is autodiff's result.

  Raises:
    ValueError: ``x`` not 3-d, ``kernel`` not 2-d, their ``d_model`` unequal, or the two of
      different dtypes or of a dtype that is not floating.
  """
  if x.ndim != 3 or kernel.ndim != 2 or x.shape[-1] != kernel.shape[0]:
    raise ValueError(f"head_logits: expected x [batch, seq, d_model] and kernel [d_model, "
                     f"vocab], got {tuple(x.shape)} and {tuple(kernel.shape)}.")
  if x.dtype != kernel.dtype or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"head_logits: expected x and kernel of one floating dtype, got "
                     f"{x.dtype} and {kernel.dtype}; cast both to the compute dtype.")
  return jnp.einsum("btd,dv->btv", x, kernel, preferred_element_type=jnp.float32)


def _head_logits_fwd(x, kernel):
  return head_logits(x, kernel), (x, kernel)


def _head_logits_bwd(residuals, g):
  x, kernel = residuals
  g = g.astype(x.dtype)
  return jnp.einsum("btv,dv->btd", g, kernel), jnp.einsum("btd,btv->dv", x, g)


head_logits.defvjp(_head_logits_fwd, _head_logits_bwd)


class Head(nnx.Module):
  """Untied output projection ``[d_model, vocab_size]``; float32 logits (`head_logits`)."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    # Small init: the initial loss is close to ln(vocab_size).
    self.kernel = nnx.Param(_truncated_normal(
        rngs.params(), (config.d_model, config.vocab_size), 1.0 / config.d_model,
        config.param_dtype))
    self.dtype = config.dtype

  def __call__(self, x):
    return head_logits(x.astype(self.dtype), self.kernel[...].astype(self.dtype))


class Llama(nnx.Module):
  """The decoder. ``model(tokens)`` maps int ``[batch, seq]`` to float32 logits
  ``[batch, seq, vocab_size]``."""

  def __init__(self, config: LlamaConfig, *, rngs: nnx.Rngs):
    self.config = config
    self.embed = Embed(config, rngs=rngs)
    layer_keys = jax.random.split(rngs.params(), config.num_layers)

    @nnx.vmap(in_axes=0, out_axes=0)
    def make_layers(key):
      return DecoderLayer(config, rngs=nnx.Rngs(params=key))

    self.layers = make_layers(layer_keys)
    self.final_norm = RMSNorm(config.d_model, eps=config.norm_eps,
                              dtype=config.dtype, param_dtype=config.param_dtype)
    self.head = Head(config, rngs=rngs)

  def __call__(self, tokens):
    config = self.config
    cos, sin = rope_tables(tokens.shape[1], config.head_dim, config.rope_theta)

    def layer_fn(x, layer, cos, sin):
      return layer(x, cos, sin)

    if config.remat_policy is not None:
      layer_fn = nnx.remat(layer_fn, policy=REMAT_POLICIES[config.remat_policy]())
    scan_layers = nnx.scan(layer_fn, in_axes=(nnx.Carry, 0, None, None),
                           out_axes=nnx.Carry)
    x = self.embed(tokens)
    x = scan_layers(x, self.layers, cos, sin)
    return self.head(self.final_norm(x))


def init_model(config: LlamaConfig, seed: int = 0) -> Llama:
  """Builds ``Llama(config)`` with weights drawn deterministically from ``seed``.

  Args:
    config: the model shape; allocates ``param_count(config)`` elements of
      ``config.param_dtype`` on the default device.
    seed: integer seed of the weight initialisation.

  Returns:
    The model.
  """
  return Llama(config, rngs=nnx.Rngs(params=seed))


def loss_fn(model: Llama, batch: jax.Array) -> jax.Array:
  """Mean next-token cross-entropy, in float32.

  Args:
    model: the decoder.
    batch: int ``[batch, seq_len + 1]`` token ids; position ``t + 1`` is the
      target of position ``t``.

  Returns:
    float32 scalar, the mean loss over ``batch * seq_len`` predictions (nats).
  """
  inputs, targets = batch[:, :-1], batch[:, 1:]
  logits = model(inputs).astype(jnp.float32)
  losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
  return jnp.mean(losses)
