r"""Planning cost: the time from an offloaded step's creation to ready-to-run, over the time of
the same step's own `jax.jit` compile, for five steps that others wrote.

Cases (the CPU backend, fp32 state):

  gemma      Gemma 3 (the `gemma` 3.3.0 package: `gm.nn.Transformer`, a tiny config of 4
             layers), optax clip_by_global_norm + adamw; the state (params, opt_state)
  nnx_cnn    the Flax NNX MNIST tutorial's CNN (its `avg_pool` a `functools.partial` held by
             the module), nnx.Optimizer(adamw); the state the modules themselves
  nnx_gpt    a small NNX GPT (4 blocks, dropout with the module's own `nnx.Rngs`), adamw
  equinox    an Equinox model partitioned with `eqx.partition(model, eqx.is_array)`, adamw
  maxtext    MaxText 0.2.4's own trainer (`maxtext.trainers.pre_train.train`, a 2-layer
             decoder), its `train_step` under `python -m jaxtier run` (`launcher.main`)

Each measurement runs in a fresh process (`--worker`), after one unrelated compile (so that
neither side pays JAX's warm-up), timing one side:

  jit                       `jax.jit(step, donate_argnums=0).lower(state, batch).compile()`
                            (MaxText: its own `p_train_step.lower(...).compile()` as its
                            trainer calls it, plus its first call less its second)
  optimizer_state_on_host   `jaxtier.offload(step, policy='optimizer_state_on_host')`: from
                            its creation to ready-to-run: `place(state, batch)` (tracing,
                            planning, every compile it does) plus its first call less its
                            second (a compile at the first call counts)
  auto                      the same with policy='auto' and no budget, as
                            `jaxtier.offload(step)` plans by default (on the CPU backend: no
                            device limit, every leaf on the device)
  auto_budget               the same with policy='auto' and a device budget between the
                            compiled peak of optimizer_state_on_host's plan and that of the
                            all-device step (found by a probe process per case): auto must
                            put state on the host, and its plan may be escalated
  auto_budget_warm          the same, a later process: the figures cache (JAXTIER_FIGURES_CACHE)
                            holds what an earlier, untimed auto_budget process of the case
                            compiled (the device-only step's figures, the plans found over)

Every other side runs with an empty figures cache of its own.

The ratio is the median of the offloaded side over the median of jit (`--reps` processes
each, sides alternated). Backend compiles are counted from JAX's
'/jax/core/compile/backend_compile_duration' events; jaxtier's own phase times are the plan's
`planning` record. Planning runs with the built-in H200 profile (JAXTIER_AUTO_CALIBRATE=0 and
an empty XDG_CACHE_HOME, as the tests run): with a calibrated profile on the CPU, 'auto' also
compiles and runs the device-only step to time it (`step_costs.time_step`).

Cases whose package is absent in their Python are reported as skipped with the install
command. Gemma and MaxText run in Pythons of their own (`--gemma_python`, `--maxtext_python`),
jaxtier from this checkout on their path (MaxText's needs the `_jaxtier_ffi` extension built
for its Python: README, "Try it on MaxText").

Usage:
  python benchmarks/planning_cost.py --gemma_python=/path/to/gemma/venv/bin/python \
      --maxtext_python=/path/to/maxtext/venv/bin/python --reps=3
  # -> benchmarks/results/planning_cost/planning_cost_cpu.{json,log}
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OUT_DIR = os.path.join(HERE, "results", "planning_cost")
BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
CASES = ("gemma", "nnx_cnn", "nnx_gpt", "equinox", "maxtext")
SIDES = ("jit", "optimizer_state_on_host", "auto", "auto_budget", "auto_budget_warm")
# What each case imports, and how to install it where it is absent.
NEEDS = {
    "gemma": ("gemma", "python3.11 -m venv gemma && gemma/bin/pip install jax==0.10.2 "
              "gemma==3.3.0 kauldron==1.4.2 'protobuf>=7' flax optax  # jaxtier: on "
              "PYTHONPATH, its _jaxtier_ffi extension built for that Python"),
    "nnx_cnn": ("flax", "pip install flax optax"),
    "nnx_gpt": ("flax", "pip install flax optax"),
    "equinox": ("equinox", "pip install equinox optax"),
    "maxtext": ("maxtext", "README.md, 'Try it on MaxText' (Python >= 3.12)"),
}
# MaxText's tiny decoder on the CPU (benchmarks/maxtext_run.py's), two steps.
MAXTEXT_TRAIN = "maxtext.trainers.pre_train.train"
MAXTEXT_ARGS = (
    "src/maxtext/configs/base.yml", "hardware=cpu", "skip_jax_distributed_system=true",
    "dataset_type=synthetic", "enable_checkpointing=false", "enable_goodput_recording=false",
    "monitor_goodput=false", "enable_tensorboard=false", "per_device_batch_size=1",
    "max_target_length=64", "vocab_size=256", "base_num_decoder_layers=2", "base_emb_dim=64",
    "base_mlp_dim=128", "base_num_query_heads=2", "base_num_kv_heads=2", "head_dim=32",
    "attention=dot_product", "learning_rate=1e-3", "log_period=1", "run_name=tiny", "steps=2",
    # No persistent compilation cache (MaxText's default is ~/jax_cache): each run compiles.
    "jax_cache_dir=")
MAXTEXT_BUDGET = 2_000_000


# -- the cases ---------------------------------------------------------------------------------

def _adamw():
  import optax  # pylint: disable=g-import-not-at-top
  return optax.adamw(1e-3, weight_decay=0.01)


def case_gemma():
  """(step, state, batch): a tiny Gemma 3, clip_by_global_norm + adamw, fp32."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from kauldron import checkpoints  # pylint: disable=g-import-not-at-top
  from kauldron.checkpoints import partial_loader  # pylint: disable=g-import-not-at-top
  # gemma 3.3.0 names kauldron's `AbstractPartialLoader`, which kauldron 1.4 renamed
  # `InitTransform` (kauldron 1.3's own jax.random patch fails on jax 0.10).
  if not hasattr(checkpoints, "AbstractPartialLoader"):
    checkpoints.AbstractPartialLoader = partial_loader.InitTransform
  from gemma import gm  # pylint: disable=g-import-not-at-top
  from gemma.gm.nn import _config, _gemma  # pylint: disable=g-import-not-at-top

  config = dataclasses.replace(
      gm.nn.Gemma3_270M.config, num_embed=512, embed_dim=128, hidden_dim=256, num_heads=4,
      head_dim=32, num_kv_heads=1, sliding_window_size=16,
      attention_types=_config.make_attention_layers_types(_gemma.GEMMA3_ATTENTION_PATTERN,
                                                          num_layers=4))
  model = gm.nn.Transformer(config=config)
  tokens = jax.random.randint(jax.random.key(1), (4, 64), 0, 512)
  params = model.init(jax.random.key(0), tokens)["params"]
  params = jax.tree.map(lambda x: x.astype(jnp.float32), params)
  tx = optax.chain(optax.clip_by_global_norm(1.0), _adamw())

  def loss_fn(params, tokens):
    logits = model.apply({"params": params}, tokens[:, :-1]).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(state, tokens):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (optax.apply_updates(params, updates), opt_state), {"loss": loss}

  return step, (params, tx.init(params)), (tokens,)


def case_nnx_cnn():
  """The Flax NNX MNIST tutorial's CNN and its train step (nnx.Optimizer, adamw)."""
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  class CNN(nnx.Module):
    def __init__(self, *, rngs):
      self.conv1 = nnx.Conv(1, 32, kernel_size=(3, 3), rngs=rngs)
      self.conv2 = nnx.Conv(32, 64, kernel_size=(3, 3), rngs=rngs)
      self.avg_pool = functools.partial(nnx.avg_pool, window_shape=(2, 2), strides=(2, 2))
      self.linear1 = nnx.Linear(3136, 256, rngs=rngs)
      self.linear2 = nnx.Linear(256, 10, rngs=rngs)

    def __call__(self, x):
      x = self.avg_pool(nnx.relu(self.conv1(x)))
      x = self.avg_pool(nnx.relu(self.conv2(x)))
      x = x.reshape(x.shape[0], -1)
      return self.linear2(nnx.relu(self.linear1(x)))

  def loss_fn(model, batch):
    logits = model(batch["image"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

  def step(state, batch):
    model, optimizer = state
    loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
    optimizer.update(model, grads)
    return (model, optimizer), {"loss": loss}

  model = CNN(rngs=nnx.Rngs(0))
  state = (model, nnx.Optimizer(model, _adamw(), wrt=nnx.Param))
  batch = {"image": jnp.linspace(0, 1, 32 * 28 * 28).reshape(32, 28, 28, 1),
           "label": jnp.arange(32, dtype=jnp.int32) % 10}
  return step, state, (batch,)


def case_nnx_gpt():
  """A small NNX GPT (4 blocks, d_model 128, dropout 0.1 drawn from the module's Rngs)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top
  from flax import nnx  # pylint: disable=g-import-not-at-top

  vocab, d, heads, layers, seq = 256, 128, 4, 4, 64

  class Block(nnx.Module):
    def __init__(self, rngs):
      self.ln1, self.ln2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
      self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
      self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)
      self.drop = nnx.Dropout(0.1, rngs=rngs)

    def __call__(self, x, mask):
      x = x + self.drop(self.attn(self.ln1(x), mask=mask))
      return x + self.drop(self.down(nnx.gelu(self.up(self.ln2(x)))))

  class GPT(nnx.Module):
    def __init__(self, rngs):
      self.embed = nnx.Embed(vocab, d, rngs=rngs)
      self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, d)) * 0.02)
      self.blocks = nnx.List([Block(rngs) for _ in range(layers)])
      self.ln = nnx.LayerNorm(d, rngs=rngs)
      self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):
      x = self.embed(tokens) + self.pos[:tokens.shape[1]]
      mask = nnx.make_causal_mask(tokens)
      for block in self.blocks:
        x = block(x, mask)
      return self.head(self.ln(x))

  def loss_fn(model, tokens):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  def step(state, tokens):
    model, optimizer = state
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return (model, optimizer), {"loss": loss}

  model = GPT(nnx.Rngs(params=0, dropout=1))
  state = (model, nnx.Optimizer(model, _adamw(), wrt=nnx.Param))
  tokens = jax.random.randint(jax.random.key(2), (8, seq + 1), 0, vocab)
  return step, state, (tokens,)


def case_equinox():
  """An Equinox model (a conv and an MLP), `eqx.partition(model, eqx.is_array)`, adamw."""
  import equinox as eqx  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import optax  # pylint: disable=g-import-not-at-top

  class Net(eqx.Module):
    conv: eqx.nn.Conv2d
    mlp: eqx.nn.MLP

    def __init__(self, key):
      k1, k2 = jax.random.split(key)
      self.conv = eqx.nn.Conv2d(1, 16, 3, key=k1)
      self.mlp = eqx.nn.MLP(16 * 26 * 26, 10, 256, depth=3, activation=jax.nn.relu, key=k2)

    def __call__(self, x):
      return self.mlp(jax.nn.relu(self.conv(x)).reshape(-1))

  model = Net(jax.random.key(0))
  params, static = eqx.partition(model, eqx.is_array)
  tx = _adamw()

  def loss_fn(params, x, y):
    logits = jax.vmap(eqx.combine(params, static))(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  def step(state, x, y):
    params, opt_state = state
    loss, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = tx.update(grads, opt_state, params)
    return (eqx.apply_updates(params, updates), opt_state), {"loss": loss}

  x = jnp.linspace(-1, 1, 32 * 28 * 28).reshape(32, 1, 28, 28)
  return step, (params, tx.init(params)), (x, jnp.arange(32, dtype=jnp.int32) % 10)


# -- the worker --------------------------------------------------------------------------------

class Compiles:
  """The backend compiles JAX reports while it listens: (name, seconds) each."""

  def __init__(self):
    import jax  # pylint: disable=g-import-not-at-top
    self.seen: list[tuple[str, float]] = []
    self.on = False

    def listen(event, secs, **kwargs):
      if self.on and event == BACKEND_COMPILE:
        self.seen.append((str(kwargs.get("fun_name", "")), float(secs)))
    jax.monitoring.register_event_duration_secs_listener(listen)

  @contextlib.contextmanager
  def counting(self):
    self.seen, self.on = [], True
    try:
      yield self
    finally:
      self.on = False


def _warm_up() -> None:
  """One compile of something unrelated: JAX's and XLA's first-use costs paid before timing."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  x = jnp.linspace(0.0, 1.0, 64 * 64).reshape(64, 64)
  jax.block_until_ready(jax.jit(lambda a: jnp.tanh(a @ a.T).sum(axis=0))(x))


def _plan_record(plan) -> dict:
  esc = plan.escalation
  return {
      "one_line": plan.one_line(),
      "pinned_bytes": plan.pinned_bytes, "device_bytes": plan.device_bytes,
      "compiler_peak_hbm_bytes": plan.compiler_peak_hbm_bytes,
      "escalation": None if esc is None else {
          "kept": esc.kept, "tried": [(a.name, a.compiler_peak_hbm_bytes, a.why)
                                      for a in esc.tried]},
      "planning": None if getattr(plan, "planning", None) is None else plan.planning.record(),
  }


def _offload_ready(step_fn, state, batch, policy: str, budget) -> tuple[float, dict]:
  """Seconds from `jaxtier.offload` to ready-to-run (place + first call less the second)."""
  import jax  # pylint: disable=g-import-not-at-top
  import jaxtier  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  step = jaxtier.offload(step_fn, policy=policy, device_budget=budget)
  state = step.place(state, *batch)
  placed = time.perf_counter() - t0
  t1 = time.perf_counter()
  state, metrics = step(state, *batch)
  jax.block_until_ready((state, metrics))
  first = time.perf_counter() - t1
  t2 = time.perf_counter()
  state, metrics = step(state, *batch)
  jax.block_until_ready((state, metrics))
  second = time.perf_counter() - t2
  return placed + max(0.0, first - second), {"place_secs": placed, "first_call_secs": first,
                                             "second_call_secs": second,
                                             "plan": _plan_record(step.plan)}


def _jit_ready(step_fn, state, batch) -> tuple[float, dict]:
  import jax  # pylint: disable=g-import-not-at-top
  t0 = time.perf_counter()
  compiled = jax.jit(step_fn, donate_argnums=0).lower(state, *batch).compile()
  secs = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  peak = None if mem is None else (mem.argument_size_in_bytes + mem.output_size_in_bytes
                                   - mem.alias_size_in_bytes + mem.temp_size_in_bytes)
  return secs, {"all_device_peak_bytes": peak}


class _Timed:
  """Wraps MaxText's jitted train step: times `lower(...).compile()` and its first two calls."""

  def __init__(self, fn, record):
    self._fn, self._record = fn, record

  def __getattr__(self, name):
    return getattr(self._fn, name)

  def lower(self, *args, **kwargs):
    t0 = time.perf_counter()
    lowered = self._fn.lower(*args, **kwargs)
    lower_secs = time.perf_counter() - t0
    record = self._record

    class Lowered:
      def __getattr__(self, name):
        return getattr(lowered, name)

      def compile(self, *a, **k):
        t1 = time.perf_counter()
        out = lowered.compile(*a, **k)
        record["lower_compile_secs"] = lower_secs + time.perf_counter() - t1
        return out
    return Lowered()

  def __call__(self, *args, **kwargs):
    import jax  # pylint: disable=g-import-not-at-top
    t0 = time.perf_counter()
    out = self._fn(*args, **kwargs)
    jax.block_until_ready(out)
    self._record.setdefault("call_secs", []).append(time.perf_counter() - t0)
    return out


def _maxtext_ready(side: str, budget) -> tuple[float, dict]:
  """MaxText's trainer run in this process (alone, or under `python -m jaxtier run`), its
  train step's `lower().compile()` and first two calls timed."""
  from maxtext.utils import train_utils  # pylint: disable=g-import-not-at-top
  record: dict = {}
  make = train_utils.jit_train_and_eval_step

  def timed_make(*args, **kwargs):
    train, evaluate = make(*args, **kwargs)
    return _Timed(train, record), evaluate
  train_utils.jit_train_and_eval_step = timed_make
  from maxtext.trainers.pre_train import train as train_mod  # pylint: disable=g-import-not-at-top
  if hasattr(train_mod, "jit_train_and_eval_step"):
    train_mod.jit_train_and_eval_step = timed_make
  import tempfile  # pylint: disable=g-import-not-at-top
  args = [*MAXTEXT_ARGS, f"base_output_directory={tempfile.mkdtemp(prefix='maxtext-')}/out"]
  out = io.StringIO()
  with contextlib.redirect_stdout(out):
    if side == "jit":
      import runpy  # pylint: disable=g-import-not-at-top
      sys.argv = [MAXTEXT_TRAIN, *args]
      try:
        runpy.run_module(MAXTEXT_TRAIN, run_name="__main__", alter_sys=True)
      except SystemExit:
        pass
    else:
      from jaxtier._src import launcher  # pylint: disable=g-import-not-at-top
      flags = {"optimizer_state_on_host": ["--policy=optimizer_state_on_host"],
               "auto": ["--policy=auto"]}.get(side, ["--policy=auto",
                                                     f"--device_budget={budget}"])
      launcher.main([*flags, "--", "-m", MAXTEXT_TRAIN, *args])
  calls = record.get("call_secs", [])
  if len(calls) < 2 or "lower_compile_secs" not in record:
    raise RuntimeError(f"MaxText's train step was not timed: {record}; output:\n"
                       + out.getvalue()[-3000:])
  return record["lower_compile_secs"] + max(0.0, calls[0] - calls[1]), record


def worker(case: str, side: str, budget) -> dict:
  import jax  # pylint: disable=g-import-not-at-top
  counter = Compiles()
  _warm_up()
  if case == "maxtext":
    with counter.counting():
      secs, extra = _maxtext_ready(side, budget)
  else:
    step_fn, state, batch = globals()[f"case_{case}"]()
    jax.block_until_ready(jax.tree.leaves(state))
    with counter.counting():
      if side == "jit":
        secs, extra = _jit_ready(step_fn, state, batch)
      else:
        auto = side.startswith("auto_budget")
        secs, extra = _offload_ready(step_fn, state, batch, "auto" if auto else side,
                                     budget if auto else None)
  return {"case": case, "side": side, "secs": secs,
          "compiles": [(n, round(s, 4)) for n, s in counter.seen],
          "compile_secs": sum(s for _, s in counter.seen), **extra}


# -- the driver --------------------------------------------------------------------------------

def _python_for(case: str, args) -> str:
  return {"gemma": args.gemma_python, "maxtext": args.maxtext_python}.get(case) or sys.executable


def _has(python: str, module: str) -> bool:
  return subprocess.run([python, "-c", f"import {module}"], capture_output=True).returncode == 0


# The jaxtier the workers import (`--jaxtier_root`: another checkout, to compare commits).
JAXTIER_ROOT = [ROOT]


def _run_worker(python: str, case: str, side: str, budget, log,
                figures_cache: "str | None" = None) -> dict:
  """One measurement in a fresh process; its figures cache `figures_cache` (None: an empty
  one of its own)."""
  env = dict(os.environ, PYTHONPATH=os.pathsep.join(
      filter(None, [JAXTIER_ROOT[0], ROOT, os.environ.get("PYTHONPATH")])),
      JAXTIER_AUTO_CALIBRATE="0",
      # No stored profile either (a calibrated CPU's would have auto time the whole step).
      XDG_CACHE_HOME=tempfile.mkdtemp(prefix="xdg-cache-"),
      JAXTIER_FIGURES_CACHE=figures_cache or tempfile.mkdtemp(prefix="figures-cold-"))
  cmd = [python, os.path.abspath(__file__), "--worker", f"--case={case}", f"--side={side}"]
  if budget is not None:
    cmd.append(f"--budget={budget}")
  proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                        cwd=tempfile.gettempdir() if case == "maxtext" else ROOT)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  if proc.returncode != 0 or not lines:
    log(f"  {case} {side}: failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return {"case": case, "side": side, "error": proc.stderr[-4000:]}
  return json.loads(lines[-1][len("RESULT "):])


def _budget(python: str, case: str, log) -> "int | None":
  """A device budget between the compiled peak of optimizer_state_on_host's plan and the
  all-device step's (probed once)."""
  if case == "maxtext":  # benchmarks/maxtext_run.py's: under the all-device step's 2.66 MiB
    return MAXTEXT_BUDGET
  on_host = _run_worker(python, case, "optimizer_state_on_host", None, log)
  jit = _run_worker(python, case, "jit", None, log)
  low = on_host.get("plan", {}).get("compiler_peak_hbm_bytes")
  high = jit.get("all_device_peak_bytes")
  if low is None or high is None or high <= low:
    log(f"  {case}: no budget between {low} and {high}")
    return None
  return (low + high) // 2


def main() -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--cases", default=",".join(CASES))
  parser.add_argument("--sides", default=",".join(SIDES))
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--gemma_python", default=None)
  parser.add_argument("--maxtext_python", default=None)
  parser.add_argument("--out", default="planning_cost_cpu")
  parser.add_argument("--jaxtier_root", default=ROOT,
                      help="the checkout whose jaxtier the workers import (default: this one)")
  parser.add_argument("--worker", action="store_true")
  parser.add_argument("--case")
  parser.add_argument("--side")
  parser.add_argument("--budget", type=int, default=None)
  args = parser.parse_args()
  if args.worker:
    print("RESULT " + json.dumps(worker(args.case, args.side, args.budget), default=str),
          flush=True)
    return 0

  os.makedirs(OUT_DIR, exist_ok=True)
  JAXTIER_ROOT[0] = os.path.abspath(args.jaxtier_root)
  log_lines: list[str] = []

  def log(msg: str) -> None:
    line = f"[{time.strftime('%H:%M:%S')}] {msg}"
    print(line, flush=True)
    log_lines.append(line)

  commit = subprocess.run(["git", "-C", JAXTIER_ROOT[0], "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
  result = {"command": "python " + " ".join([os.path.relpath(__file__, ROOT), *sys.argv[1:]]),
            "commit": commit, "machine": f"cpu ({os.cpu_count()} cores)",
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M UTC",
                                                                       time.gmtime()),
            "profile": "built-in H200 rates (JAXTIER_AUTO_CALIBRATE=0)", "reps": args.reps,
            "cases": {}}
  sides = args.sides.split(",")
  for case in args.cases.split(","):
    python = _python_for(case, args)
    module, install = NEEDS[case]
    if not _has(python, module) or not _has(python, "jaxtier"):
      log(f"{case}: skipped ({module} or jaxtier absent in {python}): {install}")
      result["cases"][case] = {"skipped": f"install: {install}"}
      continue
    budget = (_budget(python, case, log) if any(s.startswith("auto_budget") for s in sides)
              else None)
    log(f"{case}: auto's device budget {budget} bytes")
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    warm = tempfile.mkdtemp(prefix=f"figures-{case}-")
    if "auto_budget_warm" in sides and budget is not None:
      log(f"  {case}: an untimed auto_budget process fills the figures cache")
      _run_worker(python, case, "auto_budget", budget, log, figures_cache=warm)
    for rep in range(args.reps):
      order = sides if rep % 2 == 0 else list(reversed(sides))
      for side in order:
        if side.startswith("auto_budget") and budget is None:
          continue
        r = _run_worker(python, case, side, budget, log,
                        figures_cache=warm if side == "auto_budget_warm" else None)
        runs[side].append(r)
        if "secs" in r:
          log(f"  {case} {side} rep {rep}: {r['secs']:.2f} s, {len(r['compiles'])} backend "
              f"compiles ({r['compile_secs']:.2f} s)")
    med = {s: statistics.median([r["secs"] for r in rs if "secs" in r])
           for s, rs in runs.items() if any("secs" in r for r in rs)}
    entry = {"device_budget": budget, "median_secs": med, "runs": runs}
    if "jit" in med:
      entry["ratio"] = {s: med[s] / med["jit"] for s in med if s != "jit"}
    result["cases"][case] = entry
    log(f"{case}: " + ", ".join(f"{s} {m:.2f} s" for s, m in med.items())
        + "".join(f"; {s}/jit {r:.2f}" for s, r in entry.get("ratio", {}).items()))
  path = os.path.join(OUT_DIR, args.out + ".json")
  with open(path, "w") as f:
    json.dump(result, f, indent=1, default=str)
  with open(os.path.join(OUT_DIR, args.out + ".log"), "w") as f:
    f.write("\n".join(log_lines) + "\n")
  log(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
