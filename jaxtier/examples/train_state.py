"""The example's training state: the decoder, its optax AdamW and their state as one pytree."""

from __future__ import annotations

from collections.abc import Callable
import dataclasses

from flax import nnx
import jax
import optax

from . import llama


@dataclasses.dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
  """AdamW with linear warmup and cosine decay.

  Attributes:
    learning_rate: peak learning rate, reached after ``warmup_steps``.
    total_steps: steps of the whole schedule (warmup plus cosine decay).
    warmup_steps: linear warmup from 0; ``None`` means 5% of ``total_steps``
      (at least 1).
    end_learning_rate_ratio: final learning rate as a fraction of the peak.
    weight_decay: decoupled weight decay, applied to every parameter except the
      RMSNorm scales.
    b1: Adam first-moment decay.
    b2: Adam second-moment decay.
    clip_norm: if not ``None``, clip gradients to this global L2 norm first
      (``optax.clip_by_global_norm``).
  """

  learning_rate: float = 3e-3
  total_steps: int = 1000
  warmup_steps: int | None = None
  end_learning_rate_ratio: float = 0.1
  weight_decay: float = 0.1
  b1: float = 0.9
  b2: float = 0.95
  clip_norm: float | None = None

  def __post_init__(self):
    if not self.learning_rate > 0:
      raise ValueError(
          f"OptimizerConfig: expected learning_rate > 0, got {self.learning_rate}.")
    if self.total_steps < 1:
      raise ValueError(
          f"OptimizerConfig: expected total_steps >= 1, got {self.total_steps}.")
    if self.warmup_steps is not None and not 0 <= self.warmup_steps:
      raise ValueError(
          f"OptimizerConfig: expected warmup_steps >= 0 or None, got "
          f"{self.warmup_steps}.")
    if self.clip_norm is not None and not self.clip_norm > 0:
      raise ValueError(
          f"OptimizerConfig: expected clip_norm > 0 or None, got {self.clip_norm}.")

  @property
  def resolved_warmup_steps(self) -> int:
    if self.warmup_steps is None:
      return max(1, self.total_steps // 20)
    return self.warmup_steps


# optax.global_norm, by its newer name where optax has it (the old one warns that it is
# deprecated): the L2 norm of all the leaves together, as optax.clip_by_global_norm computes it.
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


def _decay_mask(params):
  """True for the leaves that get weight decay: all but the RMSNorm scales."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "norm" not in jax.tree_util.keystr(path), params)


def make_optimizer(config: OptimizerConfig) -> optax.GradientTransformation:
  """The optax transformation described by ``config``."""
  warmup = config.resolved_warmup_steps
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=config.learning_rate,
      warmup_steps=warmup,
      # The cosine part needs at least one step.
      decay_steps=max(config.total_steps, warmup + 1),
      end_value=config.learning_rate * config.end_learning_rate_ratio,
  )
  tx = optax.adamw(schedule, b1=config.b1, b2=config.b2,
                   weight_decay=config.weight_decay, mask=_decay_mask)
  if config.clip_norm is not None:
    tx = optax.chain(optax.clip_by_global_norm(config.clip_norm), tx)
  return tx


def make_train_state(
    config: llama.LlamaConfig | str,
    optimizer_config: OptimizerConfig | float,
    seed: int = 0,
    *,
    abstract: bool = False,
) -> tuple[nnx.GraphDef, nnx.State, Callable[[nnx.State, jax.Array],
                                             tuple[nnx.State, dict[str, jax.Array]]]]:
  """Builds the model, its optimizer and the functional train step.

  Args:
    config: a ``llama.LlamaConfig`` or a key of ``llama.CONFIGS``.
    optimizer_config: an ``OptimizerConfig``, or a float peak learning rate for
      ``OptimizerConfig(learning_rate=...)``.
    seed: seed of the weight initialisation.
    abstract: if True, allocate nothing: the leaves of ``state`` are
      ``jax.ShapeDtypeStruct`` (for planning models that do not fit, e.g.
      ``jaxtier.plan(train_step, state, batch_spec)`` with the ``13b`` config).

  Returns:
    ``(graphdef, state, train_step)``: ``state`` is ``nnx.State`` of
    ``(model, optimizer)`` (index ``0``: the parameters; index ``1``: the
    optimizer's ``opt_state`` and ``step``), allocated on the default device.
    ``train_step(state, batch)`` takes int ``[batch, seq_len + 1]`` tokens and
    returns ``(new_state, {"loss": float32 scalar})``, with ``"grad_norm"`` too where the
    gradients are clipped (``optimizer_config.clip_norm``): their global L2 norm before the
    clip (``optax.global_norm``; the step clips where it is over ``clip_norm``);
    ``new_state`` has the same pytree structure, shapes and dtypes as ``state``.
  """
  if isinstance(config, str):
    config = lookup_config(config)
  if not isinstance(optimizer_config, OptimizerConfig):
    optimizer_config = OptimizerConfig(learning_rate=float(optimizer_config))
  tx = make_optimizer(optimizer_config)

  def build():
    model = llama.init_model(config, seed)
    return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  graphdef, state = nnx.split(nnx.eval_shape(build) if abstract else build())

  def train_step(state, batch):
    model, optimizer = nnx.merge(graphdef, state)
    # The gradient of a copy of the model made from the params, discarded after: under
    # nnx.value_and_grad(model) the layer stack's nnx.scan hands each layer's params back out
    # as a stacked copy that is written into `model`, and the update would read that second
    # fp32 copy of every layer, held from the forward pass to the update (8b: 29 GiB).
    model_def, params, rest = nnx.split(model, nnx.Param, ...)
    loss, grads = jax.value_and_grad(
        lambda p: llama.loss_fn(nnx.merge(model_def, p, rest), batch))(params)
    optimizer.update(model, grads)
    metrics = {"loss": loss}
    if optimizer_config.clip_norm is not None:
      # The norm that clip_by_global_norm compares with clip_norm.
      metrics["grad_norm"] = _global_norm(grads)
    return nnx.state((model, optimizer)), metrics

  return graphdef, state, train_step


def state_initializer(config: llama.LlamaConfig | str, optimizer_config: OptimizerConfig | float,
                      seed: int = 0) -> Callable[[], nnx.State]:
  """`init() -> state`: the state ``make_train_state`` builds, as a pure function to jit.

  ``jax.jit(init)()`` (or ``OffloadedStep.init(init, ...)``, which jits it with the plan's
  shardings) creates the leaves where the jit's out_shardings put them. The state is
  ``nnx.State`` of ``(model, optimizer)``, of the structure ``make_train_state`` returns.
  """
  if isinstance(config, str):
    config = lookup_config(config)
  if not isinstance(optimizer_config, OptimizerConfig):
    optimizer_config = OptimizerConfig(learning_rate=float(optimizer_config))
  tx = make_optimizer(optimizer_config)

  def init() -> nnx.State:
    model = llama.init_model(config, seed)
    return nnx.state((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

  return init


def _role(path) -> str:
  top = path[0].key if hasattr(path[0], "key") else path[0]
  if top == 0:
    return "params"
  name = jax.tree_util.keystr(path)
  return "optimizer step" if "['step']" in name else "optimizer state"


def placement_table(state) -> str:
  """Bytes of ``state`` per role and memory kind, as printable lines."""
  rows: dict[tuple[str, str], list[int]] = {}
  for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
    sharding = getattr(leaf, "sharding", None)
    where = "?"
    if sharding is not None:
      kind = getattr(sharding, "memory_kind", None) or "device"
      platforms = sorted({d.platform for d in sharding.device_set})
      where = f"{kind} ({','.join(platforms)})"
    row = rows.setdefault((_role(path), where), [0, 0])
    row[0] += 1
    row[1] += int(leaf.nbytes)
  lines = [f"{'role':<16} {'memory kind':<22} {'leaves':>6} {'bytes':>14}"]
  for (role, where), (count, nbytes) in sorted(rows.items()):
    lines.append(f"{role:<16} {where:<22} {count:>6} {nbytes:>14,} "
                 f"({nbytes / 2**20:,.1f} MiB)")
  total = sum(r[1] for r in rows.values())
  lines.append(f"{'total':<16} {'':<22} {sum(r[0] for r in rows.values()):>6} "
               f"{total:>14,} ({total / 2**20:,.1f} MiB)")
  return "\n".join(lines)

def lookup_config(name: str) -> llama.LlamaConfig:
  try:
    return llama.CONFIGS[name]
  except KeyError:
    raise ValueError(
        f"train: expected a config in {sorted(llama.CONFIGS)}, got {name!r}.") from None
