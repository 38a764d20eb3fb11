r"""Trains the Llama-style decoder on real text, with or without jaxtier offload.

Tokens are bytes (``--tokenizer=byte``, the default) or the ids of a byte-level BPE tokenizer
trained once on the same corpus and cached (``--tokenizer=bpe --vocab_size=32768``, 65536 or
131072: ``tokenizer.py``); the model's ``vocab_size`` follows.

The train step is a plain functional ``train_step(state, batch) -> (state, metrics)``
over ``nnx.split((model, optimizer))``; with ``--offload=auto`` it is wrapped,
unchanged, by ``jaxtier.offload``; with ``--offload=none`` by ``jax.jit``.

Usage::

  python -m jaxtier train --config=tiny --offload=none
  python -m jaxtier train --config=small --tokenizer=bpe --vocab_size=32768
  python -m jaxtier train --config=1b --device_budget=80GB
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
import math
import time
from typing import Any

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import jaxtier

from . import data as data_lib
from . import llama
from . import tokenizer as tokenizer_lib
from .budgets import (OFFLOAD_MODES, OverBudgetError, over_budget, stream_layers_policy,
                      verdicts_printed)
from .train_state import (OptimizerConfig, lookup_config, make_optimizer, make_train_state,
                          placement_table, state_initializer)

__all__ = [
    "OptimizerConfig",
    "OverBudgetError",
    "RUN_DEFAULTS",
    "RunDefaults",
    "main",
    "make_optimizer",
    "make_train_state",
    "over_budget",
    "run",
]


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunDefaults:
  """Per-config defaults of ``run`` (and of the flags left unset)."""

  steps: int
  batch_size: int
  learning_rate: float
  log_every: int


RUN_DEFAULTS: dict[str, RunDefaults] = {
    # About a minute on 2 CPU cores, compile included.
    "tiny": RunDefaults(steps=600, batch_size=16, learning_rate=3e-3, log_every=50),
    "small": RunDefaults(steps=2000, batch_size=16, learning_rate=1e-3, log_every=50),
    "1b": RunDefaults(steps=200, batch_size=8, learning_rate=3e-4, log_every=10),
    "8b": RunDefaults(steps=100, batch_size=4, learning_rate=1.5e-4, log_every=5),
    "13b": RunDefaults(steps=100, batch_size=4, learning_rate=1.5e-4, log_every=5),
    "14b": RunDefaults(steps=100, batch_size=4, learning_rate=1.5e-4, log_every=5),
    "15b": RunDefaults(steps=100, batch_size=4, learning_rate=1.5e-4, log_every=5),
    "16b": RunDefaults(steps=100, batch_size=4, learning_rate=1.5e-4, log_every=5),
}
_FALLBACK_DEFAULTS = RunDefaults(steps=100, batch_size=8, learning_rate=1e-3,
                                 log_every=10)


def _check_host_memory(config: llama.LlamaConfig, config_name: str,
                       optimizer_config: OptimizerConfig, seed: int) -> None:
  """Raises ValueError, before anything is allocated, when the initial state is built in host
  memory (the CPU backend) and needs more than 90% of what the host has available
  (MemAvailable): building it would end in the kernel's OOM killer or an allocator abort, not
  an error."""
  if jax.default_backend() != "cpu":
    return

  available = jaxtier.available_host_bytes()
  if available is None:
    return
  _, shapes, _ = make_train_state(config, optimizer_config, seed, abstract=True)
  need = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(shapes))
  if need > 0.9 * available:
    gib = lambda b: f"{b / 2**30:.2f} GiB"
    raise ValueError(
        f"run: the {config_name} state (params and optimizer state) needs {gib(need)} of host "
        f"memory to build here, and this host has {gib(available)} available; use a smaller "
        "--config (e.g. tiny or small), or a GPU machine whose host memory holds the state "
        "(--offload=auto places there what does not fit the GPU).")


def check_seq_len(config: llama.LlamaConfig, config_name: str, seq_len: int) -> None:
  """Raises ValueError, before anything is allocated, for a sequence longer than the model's
  maximum (`config.max_seq_len`)."""
  if seq_len > config.max_seq_len:
    raise ValueError(
        f"--seq_len={seq_len} is over the {config_name} model's maximum sequence length "
        f"of {config.max_seq_len}; use --seq_len={config.max_seq_len} or less (or a config "
        "with a longer max_seq_len).")


def _offload_step(train_step, *, device_budget, host_budget, policy="auto",
                  overlap_update=True):
  import jaxtier  # pylint: disable=g-import-not-at-top
  return jaxtier.offload(train_step, device_budget=device_budget, host_budget=host_budget,
                         policy=policy, overlap_update=overlap_update)


def _budget(value):
  return None if value in (None, "") else value


def run(
    *,
    config_name: str = "tiny",
    config: llama.LlamaConfig | None = None,
    steps: int | None = None,
    batch_size: int | None = None,
    seq_len: int | None = None,
    offload: str = "none",
    data: str | np.ndarray | None = None,
    seed: int = 0,
    learning_rate: float | None = None,
    warmup_steps: int | None = None,
    clip: bool = False,
    log_every: int | None = None,
    device_budget: str | int | None = None,
    host_budget: str | int | None = None,
    remat_policy: str | None = None,
    progress: bool = True,
    allow_over_budget: bool = True,
    overlap_update: bool = True,
    tokenizer: str = "byte",
    vocab_size: int | None = None,
    plan_details: bool = False,
) -> dict[str, Any]:
  """Trains ``steps`` steps and reports the losses and the speed.

  Args:
    config_name: key of ``llama.CONFIGS`` (and of ``RUN_DEFAULTS``).
    config: if given, this model config instead of ``CONFIGS[config_name]``
      (the run defaults still come from ``config_name``).
    steps: number of train steps; ``None``: the config's default.
    batch_size: sequences per step; ``None``: the config's default.
    seq_len: tokens per sequence (the batch holds ``seq_len + 1``); ``None``:
      ``config.max_seq_len``.
    offload: ``"none"`` (``jax.jit``, all state on the device), ``"auto"``
      (``jaxtier.offload`` plans where each leaf lives: everything on the device when it fits),
      ``"stream"`` (the layer stack's params placed ``host_stream``: fetched layer by layer
      from pinned_host; the rest auto) or ``"optimizer_state_on_host"`` (``jaxtier.offload``
      with that policy: every optimizer-state leaf in pinned_host, updated there).
    data: ``None``/``""`` for the standard-library corpus, a ``--data`` string
      (comma-separated text files or one uint16 token file; text files only with
      ``tokenizer="bpe"``), or a 1-D array of token ids (used as they are).
    seed: seed of the weights and of the batch order.
    learning_rate: peak learning rate; ``None``: the config's default.
    warmup_steps: warmup of the schedule; ``None``: 5% of ``steps``.
    clip: clip gradients to global norm 1.0 before AdamW.
    log_every: print the loss and sync every this many steps; ``None``: the
      config's default.
    device_budget: device bytes jaxtier may use per device, e.g. ``"80GB"``;
      ``None`` means no limit. Only with ``jaxtier.offload``.
    host_budget: pinned host bytes jaxtier may use, as ``device_budget``.
    remat_policy: ``None`` keeps the config's ``remat_policy``; ``"none"``
      turns rematerialisation off; any other value is a
      ``jax.checkpoint_policies`` name applied to each decoder layer.
    progress: show a tqdm progress bar.
    allow_over_budget: if False, raise `OverBudgetError` before the first step when a
      ``device_budget`` / ``host_budget`` was given and the plan does not fit it
      (`over_budget`); if True, only the plan's notes and jaxtier's warnings say so.
    overlap_update: update the layers' leaves inside the backward pass
      (`jaxtier.offload(overlap_update=...)`).
    tokenizer: ``"byte"`` (bytes are tokens; the config's ``vocab_size`` is kept) or
      ``"bpe"`` (a byte-level BPE tokenizer trained on ``data``'s text and cached:
      `tokenizer.load_corpus`; the config's ``vocab_size`` becomes ``vocab_size``).
    vocab_size: with ``"bpe"``, 32768 (``None``), 65536 or 131072; with ``"byte"``,
      ``None`` or 256.
    plan_details: print the plan's per-leaf table and every note (`Plan.table`).

  Returns:
    A dict with ``losses`` (one float per step), ``step_times`` (seconds per
    step; the loop syncs only at log points, so a step inside a log window is
    given the window's mean; entry 0 is the first step alone, compile
    included), ``tokens_per_sec`` (mean over all steps but the first),
    ``first_loss``, ``last_loss``, ``compile_secs``, ``total_secs``,
    ``num_params``, ``vocab_size``, ``state_bytes``, ``plan`` (``str(step.plan)`` or
    ``None``) and ``plan_bytes`` (state bytes per memory kind, fp32 masters
    included: ``{"device": ..., "pinned_host": ...}``) and ``memory`` (bytes: the peak device
    memory JAX's allocator saw, where the backend reports it, and the pinned_host bytes live
    after the run, beside the plan's predicted and compiled figures; None where unknown).

  Raises:
    ValueError: for an unknown config or offload mode, bad sizes, bad data, or a vocabulary
      size the tokenizer does not allow.
    OverBudgetError: the plan misses a budget given (only with ``allow_over_budget=False``).
    jaxtier.AdmissionError: the plan (or, with ``"none"``, the jitted step: `jaxtier.admit`)
      needs more memory than this machine gives, raised before the state is allocated.
    tokenizer.TokenizersMissingError: ``"bpe"`` without the ``tokenizers`` package.
  """
  if offload not in OFFLOAD_MODES:
    raise ValueError(f"run: expected offload in {OFFLOAD_MODES}, got {offload!r}.")
  defaults = RUN_DEFAULTS.get(config_name, _FALLBACK_DEFAULTS)
  if config is None:
    config = lookup_config(config_name)
  config = tokenizer_lib.model_config(config, tokenizer, vocab_size)
  if remat_policy is not None:
    config = dataclasses.replace(
        config, remat_policy=None if remat_policy == "none" else remat_policy)
  steps = defaults.steps if steps is None else steps
  batch_size = defaults.batch_size if batch_size is None else batch_size
  seq_len = config.max_seq_len if seq_len is None else seq_len
  learning_rate = defaults.learning_rate if learning_rate is None else learning_rate
  log_every = defaults.log_every if log_every is None else log_every
  if steps < 1 or batch_size < 1 or seq_len < 1 or log_every < 1:
    raise ValueError(
        f"run: expected steps, batch_size, seq_len and log_every >= 1, got "
        f"{steps}, {batch_size}, {seq_len}, {log_every}.")
  check_seq_len(config, config_name, seq_len)

  if isinstance(data, np.ndarray):
    tokens = data
    if tokens.size and int(tokens.max()) >= config.vocab_size:
      raise ValueError(
          f"run: expected token ids < vocab_size={config.vocab_size}, got "
          f"{int(tokens.max())}.")
  elif tokenizer == "bpe":
    _, tokens = tokenizer_lib.load_corpus(data, config.vocab_size, progress=progress)
  else:
    tokens = data_lib.load_corpus(data, vocab_size=config.vocab_size)
  batch_iter = data_lib.batches(tokens, batch_size, seq_len, seed)
  small = data_lib.corpus_size_warning(len(tokens), batch_size, seq_len, steps)
  if small:
    logging.warning("run: %s", small)

  if warmup_steps is not None and warmup_steps >= steps:
    # On stdout with the run's other output, as the budgets' warning.
    print(f"warning: warmup_steps={warmup_steps} is not under steps={steps}: the learning "
          f"rate never reaches its peak of {learning_rate:g}")
  optimizer_config = OptimizerConfig(
      learning_rate=learning_rate, total_steps=steps, warmup_steps=warmup_steps,
      clip_norm=1.0 if clip else None)
  _check_host_memory(config, config_name, optimizer_config, seed)
  t_start = time.perf_counter()
  # The state is built by a jitted initialiser: under jaxtier each leaf is born where the plan
  # puts it (`OffloadedStep.init`), never built on the device and moved out.
  _, shapes, train_step = make_train_state(config, optimizer_config, seed, abstract=True)
  init_state = state_initializer(config, optimizer_config, seed)
  num_params = llama.param_count(config)
  state_bytes = sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize
                    for x in jax.tree.leaves(shapes))
  vocab = f" (bpe, vocab {config.vocab_size:,})" if tokenizer == "bpe" else ""
  print(f"config {config_name}: {num_params:,} params, {len(tokens):,} tokens{vocab} of "
        f"data, batch {batch_size} x seq {seq_len}, {steps} step{'s' if steps != 1 else ''}, "
        f"offload={offload}")

  first_batch = jnp.asarray(next(batch_iter))
  plan = None
  plan_bytes = {"device": state_bytes, "pinned_host": 0}
  if offload != "none":
    step = _offload_step(train_step,
                         policy=stream_layers_policy if offload == "stream" else offload,
                         device_budget=_budget(device_budget), host_budget=_budget(host_budget),
                         overlap_update=overlap_update)
    with verdicts_printed():  # the plan printed below says whether it fits
      state = step.init(init_state, example_args=(first_batch,))
    plan = str(step.plan)
    plan_bytes = step.plan.bytes_by_memory_kind()
    if plan_details:
      print(step.plan.table(reasons=True))
    else:
      print(step.plan.format(reasons=False))
      print("(each leaf's reason: print(step.plan), or python -m jaxtier plan --verbose)")
    over = None if allow_over_budget else over_budget(step.plan, offload,
                                                      remat_policy=config.remat_policy)
    if over:
      raise OverBudgetError(over)
    print("state placement (jaxtier):")
    print(placement_table(state))
  else:
    given = [f"--{name}={value}" for name, value in (("device_budget", device_budget),
                                                      ("host_budget", host_budget))
             if _budget(value) is not None]
    if given:
      # On stdout with the run's other output: an absl log line on stderr went unseen.
      print(f"warning: {' and '.join(given)} not used: --offload=none runs jax.jit with all "
            "state on the device and applies no budget; use --offload=auto (or stream / "
            "optimizer_state_on_host) for jaxtier to plan within it")
    step = jax.jit(train_step, donate_argnums=0)
    # Refused before the state exists where the step would run out of device memory, as
    # jaxtier refuses a plan (the refusal names the allocator fraction that admits it).
    jaxtier.admit(step.lower(shapes, first_batch))
    state = jax.jit(init_state)()
    print("state placement (no offload):")
    print(placement_table(state))

  tokens_per_step = batch_size * seq_len
  losses: list[float] = []
  step_times: list[float] = []
  pending: list[jax.Array] = []
  # disable=None: a bar on a terminal, none in a log file.
  bar = tqdm.tqdm(total=steps, disable=None if progress else True, unit="step",
                  dynamic_ncols=True)
  window_start = time.perf_counter()
  window_steps = 0
  batch = first_batch
  compile_secs = 0.0
  try:
    for i in range(steps):
      if i > 0:
        batch = jnp.asarray(next(batch_iter))
      state, metrics = step(state, batch)
      pending.append(metrics["loss"])
      window_steps += 1
      bar.update(1)
      # Sync after the first (compiling) step, at each log point and at the end.
      if i == 0 or (i + 1) % log_every == 0 or i + 1 == steps:
        losses.extend(float(x) for x in jax.device_get(pending))
        pending.clear()
        now = time.perf_counter()
        secs = (now - window_start) / window_steps
        step_times.extend([secs] * window_steps)
        window_start, window_steps = now, 0
        if i == 0:
          compile_secs = secs
        tok_s = tokens_per_step / secs
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tok_s:,.0f}")
        if i > 0 or steps == 1:
          tqdm.tqdm.write(f"step {i + 1:>6}/{steps}  loss {losses[-1]:.4f}  "
                          f"{tok_s:,.0f} tokens/s  {secs * 1e3:.1f} ms/step")
  finally:
    bar.close()
  total_secs = time.perf_counter() - t_start

  timed = step_times[1:] or step_times
  tokens_per_sec = tokens_per_step * len(timed) / sum(timed)
  if not all(math.isfinite(x) for x in losses):
    print("warning: non-finite loss seen")
  print(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
        f"{tokens_per_sec:,.0f} tokens/s (mean, first step excluded), "
        f"first step {compile_secs:.2f} s, total {total_secs:.1f} s")
  memory = _memory_figures(step.plan if offload != "none" else None)
  partial = offload != "none" and _no_activations(step.plan)
  print("memory: " + ", ".join(
      f"{k} {jaxtier.format_bytes(v)}"
      f"{' (state and gradients only: no activations)' if partial and 'predicted' in k else ''}"
      for k, v in memory.items() if v is not None))
  measured = getattr(getattr(step, "plan", None), "measured_step_secs", None)
  if measured is not None and step.plan.predicted_step_secs is not None:
    rates = f" ({step.plan.rates_of})" if step.plan.rates_of else ""
    print(f"planner: step predicted {step.plan.predicted_step_secs * 1e3:.3g} ms{rates}, "
          f"measured {measured * 1e3:.3g} ms (calls 2-4)")
  return {
      "losses": losses,
      "step_times": step_times,
      "tokens_per_sec": tokens_per_sec,
      "first_loss": losses[0],
      "last_loss": losses[-1],
      "compile_secs": compile_secs,
      "total_secs": total_secs,
      "num_params": num_params,
      "vocab_size": config.vocab_size,
      "state_bytes": state_bytes,
      "plan_bytes": plan_bytes,
      "plan": plan,
      "memory": memory,
  }


def _no_activations(plan) -> bool:
  """Whether `plan`'s predicted peak leaves the activations out (a fixed policy compiles no
  device-only step; the plan's own line says so too)."""
  return any(n.startswith("transient device bytes") and "the gradients only" in n
             for n in getattr(plan, "notes", ()))


def _memory_figures(plan) -> dict[str, "int | None"]:
  """Peak device bytes JAX's allocator saw (`memory_stats`, None where the backend reports
  none) and pinned_host bytes live now (the state's host leaves, jaxtier's masters and
  scratch), beside the plan's predicted and compiled figures."""
  stats = jax.local_devices()[0].memory_stats() or {}
  pinned = sum(x.nbytes for x in jax.live_arrays()
               if getattr(x.sharding, "memory_kind", None) == "pinned_host")
  return {
      "peak device (measured)": stats.get("peak_bytes_in_use"),
      "peak device (predicted)": getattr(plan, "predicted_peak_hbm_bytes", None),
      "peak device (compiled)": getattr(plan, "compiler_peak_hbm_bytes", None),
      "pinned_host live (measured)": pinned,
      "pinned_host (planned)": getattr(plan, "pinned_bytes", None),
      "pinned_host beyond the state (compiled)": getattr(plan, "compiler_host_extra_bytes",
                                                         None),
  }


_CONFIG = flags.DEFINE_enum("config", "tiny", list(llama.CONFIGS),
                            "Model config (llama.CONFIGS).")
_STEPS = flags.DEFINE_integer("steps", None, "Train steps; default per config "
                              "(tiny: one to two minutes on 2 CPU cores).", lower_bound=1)
_BATCH_SIZE = flags.DEFINE_integer("batch_size", None,
                                   "Sequences per step; default per config.", lower_bound=1)
_SEQ_LEN = flags.DEFINE_integer("seq_len", None,
                                "Tokens per sequence; default config.max_seq_len.",
                                lower_bound=1)
_OFFLOAD = flags.DEFINE_enum("offload", "auto", list(OFFLOAD_MODES),
                             "none: jax.jit, all state on device; auto: "
                             "jaxtier.offload plans the placement (all on device when it "
                             "fits the device budget); stream: the layers' params stream from "
                             "pinned_host (host_stream), the rest auto; "
                             "optimizer_state_on_host: every optimizer-state leaf in "
                             "pinned_host, updated there.")
_DATA = flags.DEFINE_string("data", "", "Comma-separated text files, or one "
                            "uint16 token file (*.bin, *.u16); default: the "
                            "Python standard library's .py files.")
_TOKENIZER = flags.DEFINE_enum(
    "tokenizer", "byte", list(tokenizer_lib.TOKENIZERS), "byte: each byte of the text is a "
    "token (vocab 256); bpe: a byte-level BPE tokenizer (the tokenizers package) trained once "
    "on the --data text (default: the standard library's .py files) and cached under "
    "$XDG_CACHE_HOME/jaxtier/tokenizers; the model's vocab_size follows. train and plan.")
_VOCAB_SIZE = flags.DEFINE_integer(
    "vocab_size", None, "With --tokenizer=bpe: "
    f"{', '.join(map(str, tokenizer_lib.BPE_VOCAB_SIZES))} (default "
    f"{tokenizer_lib.DEFAULT_BPE_VOCAB_SIZE}); with byte: unset (256).")
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and batch order.", lower_bound=0)
_LEARNING_RATE = flags.DEFINE_float("learning_rate", None,
                                    "Peak learning rate; default per config.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", None,
                                     "Warmup steps; default 5% of --steps.", lower_bound=0)
_CLIP = flags.DEFINE_bool("clip", False, "Clip gradients to global norm 1.0.")
_LOG_EVERY = flags.DEFINE_integer("log_every", None,
                                  "Log (and sync) every N steps; default per config.",
                                  lower_bound=1)
_DEVICE_BUDGET = flags.DEFINE_string("device_budget", "", "Device memory jaxtier "
                                     "may use per device, e.g. 80GB; empty: no limit.")
_HOST_BUDGET = flags.DEFINE_string("host_budget", "", "Pinned host memory jaxtier "
                                   "may use, e.g. 400GB; empty: no limit.")


def _valid_size(value: str) -> bool:
  if not value:
    return True
  import jaxtier  # pylint: disable=g-import-not-at-top
  try:
    jaxtier.offload(lambda s, b: (s, {}), device_budget=value)
  except ValueError:
    raise flags.ValidationError(f"expected a size > 0 like 80GB, 16GiB or a number of bytes, "
                                f"got {value!r}; leave it empty for no limit") from None
  return True


flags.register_validator("device_budget", _valid_size)
flags.register_validator("host_budget", _valid_size)

_REMAT_POLICY = flags.DEFINE_string(
    "remat_policy", None, "Per-layer rematerialisation: 'none', or one of "
    f"{', '.join(llama.REMAT_POLICIES)} (jax.checkpoint_policies; the last sends the "
    "projections' outputs to pinned_host); default: the config's.")
_ALLOW_OVER_BUDGET = flags.DEFINE_bool(
    "allow_over_budget", False, "Train even when the plan does not fit the --device_budget / "
    "--host_budget given (by default that is an error before the first step).")


_OVERLAP_UPDATE = flags.DEFINE_bool(
    "overlap_update", True, "Update the layers' params and optimizer state layer by layer "
    "inside the backward pass, overlapped with it (--nooverlap_update: after it).")
_PLAN_DETAILS = flags.DEFINE_bool(
    "plan_details", False, "Print the plan's every leaf (its placement, bytes and why) and "
    "every note, at the terminal's width.")
_JSON_OUT = flags.DEFINE_string(
    "json_out", "", "Also write the run's results (losses, step times, tokens/s, memory "
    "figures; run()'s return value without the plan's text) as JSON to this file.")


def _valid_json_out(value: str) -> bool:
  """The --json_out file's folder exists and is writable: checked before training, so that a
  bad path does not cost the run its results."""
  import os  # pylint: disable=g-import-not-at-top
  if not value:
    return True
  folder = os.path.dirname(os.path.abspath(value))
  if not (os.path.isdir(folder) and os.access(folder, os.W_OK)):
    raise flags.ValidationError(
        f"the folder of {value!r} ({folder}) does not exist or is not writable; create it, or "
        "name a file in a folder that is")
  if os.path.isdir(value):
    raise flags.ValidationError(f"{value!r} is a folder; name a file in it, e.g. "
                                f"{os.path.join(value, 'result.json')}")
  return True


flags.register_validator("json_out", _valid_json_out)


def main(argv: Sequence[str]) -> None:
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  result = run(config_name=_CONFIG.value, steps=_STEPS.value, batch_size=_BATCH_SIZE.value,
      seq_len=_SEQ_LEN.value, offload=_OFFLOAD.value, data=_DATA.value,
      seed=_SEED.value, learning_rate=_LEARNING_RATE.value,
      warmup_steps=_WARMUP_STEPS.value, clip=_CLIP.value, log_every=_LOG_EVERY.value,
      device_budget=_DEVICE_BUDGET.value, host_budget=_HOST_BUDGET.value,
      remat_policy=_REMAT_POLICY.value, allow_over_budget=_ALLOW_OVER_BUDGET.value,
      overlap_update=_OVERLAP_UPDATE.value, tokenizer=_TOKENIZER.value,
      vocab_size=_VOCAB_SIZE.value, plan_details=_PLAN_DETAILS.value)
  if _JSON_OUT.value:
    import json  # pylint: disable=g-import-not-at-top
    with open(_JSON_OUT.value, "w") as f:
      json.dump({k: v for k, v in result.items() if k != "plan"}, f, indent=1)


if __name__ == "__main__":
  app.run(main)
