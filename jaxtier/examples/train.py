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

if __name__ == "__main__":  # Ctrl-C while the trainer imports: one line, exit 130
  from jaxtier._src import early_interrupt  # pylint: disable=g-import-not-at-top
  early_interrupt.install(early_interrupt.BEFORE_TRAINING)

from collections.abc import Sequence
import contextlib
import dataclasses
import math
import os
import shutil
import sys
import textwrap
import time
from typing import Any

from absl import app, flags, logging
import jax
import jax.numpy as jnp
import numpy as np
import tqdm

import jaxtier
from jaxtier._src import command_help
from jaxtier._src import early_interrupt
from jaxtier._src import paths

from . import checkpoints as checkpoints_lib
from . import data as data_lib
from . import llama
from . import tokenizer as tokenizer_lib
from .budgets import (OFFLOAD_MODES, OverBudgetError, cpu_device_budget, jit_over_budget,
                      over_budget, placement_line, stream_layers_policy, verdicts_printed)
from .train_state import (OptimizerConfig, lookup_config, make_optimizer, make_train_state,
                          state_initializer)

__all__ = [
    "Interrupted",
    "NonFiniteLossError",
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


class NonFiniteLossError(ValueError):
  """`run` stopped at the first step whose loss is not finite (NaN or inf).

  Attributes:
    step: that step (counted from 1).
    loss: its loss.
    result: what `run` returns, for the steps run (``losses`` ends with this one).
  """

  def __init__(self, message: str, *, step: int, loss: float, result: dict[str, Any]):
    super().__init__(message)
    self.step, self.loss, self.result = step, loss, result


class Interrupted(KeyboardInterrupt):
  """`run` stopped by Ctrl-C (SIGINT) in its training loop.

  With a ``checkpoint_dir`` the run stops at the end of the step it was in and saves a
  checkpoint there first; without one it stops at once.

  Attributes:
    step: the steps completed and saved (with a checkpoint), else those whose loss was read.
    checkpoint: the newest complete checkpoint's path, or None (none written yet, or no
      ``checkpoint_dir``).
    result: what `run` returns, for the steps in ``result["losses"]``.
    unfinished: the path of the checkpoint a second Ctrl-C stopped being written (incomplete:
      a resumed run skips it), else None.
    twice: whether a second Ctrl-C stopped the run (before, or while, its checkpoint was
      written).
  """

  def __init__(self, *, step: int, checkpoint: "str | None", result: dict[str, Any],
               unfinished: "str | None" = None, twice: bool = False):
    super().__init__(step, checkpoint)
    self.step, self.checkpoint, self.result = step, checkpoint, result
    self.unfinished, self.twice = unfinished, twice


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


def _check_step_memory(config: llama.LlamaConfig, batch_size: int, seq_len: int,
                       state_bytes: int) -> None:
  """Raises jaxtier.AdmissionError, from the shapes alone (before the step is traced or
  compiled), where the step's activations cannot fit however its state is placed.

  What the backward pass needs whatever the activation policy: each layer's input (kept even
  under ``nothing_saveable``) and the logits, ``(num_layers * d_model + vocab_size) * T`` bytes
  of ``config.dtype`` for ``T = batch_size * seq_len`` tokens. On the CPU backend these and the
  state (`state_bytes`) share the host's available memory; on a GPU they must fit what JAX's
  allocator holds. A lower bound: a step under it may still be refused by its plan.
  """
  tokens = batch_size * seq_len
  need = (config.num_layers * config.d_model + config.vocab_size) * tokens * jnp.dtype(
      config.dtype).itemsize
  if jax.default_backend() == "cpu":
    need += state_bytes
    limit, limit_name = jaxtier.available_host_bytes(), "host_memory"
    what = "the state and the step's activations", "this host has available"
  else:
    limit = (jax.local_devices()[0].memory_stats() or {}).get("bytes_limit")
    limit_name = "device_memory"
    what = "the step's activations alone", "JAX's allocator holds on this device"
  if limit is None or need <= limit:
    return
  reason = (f"a batch of {batch_size} x {seq_len} tokens needs at least "
            f"{jaxtier.format_bytes(need)} for {what[0]} (each layer's input, kept for the "
            f"backward pass, and the logits), over the {jaxtier.format_bytes(limit)} {what[1]}")
  error = jaxtier.AdmissionError(f"step refused before compiling it: {reason}. Fix: a smaller "
                                 "batch or sequence.")
  error.reason, error.limit = reason, limit_name
  raise error


def check_seq_len(config: llama.LlamaConfig, config_name: str, seq_len: int) -> None:
  """Raises ValueError, before anything is allocated, for a sequence longer than the model's
  maximum (`config.max_seq_len`)."""
  if seq_len > config.max_seq_len:
    raise ValueError(
        f"--seq_len={seq_len} is over the {config_name} model's maximum sequence length "
        f"of {config.max_seq_len}; use --seq_len={config.max_seq_len} or less (or a config "
        "with a longer max_seq_len).")


def clip_norm_of(clip: bool, clip_norm: "float | None") -> "float | None":
  """The global norm the gradients are clipped to: `clip_norm` where given (it implies
  clipping), else 1.0 with `clip`, else None (no clipping).

  Raises:
    ValueError: `clip_norm` is not a finite number > 0.
  """
  if clip_norm is None:
    return 1.0 if clip else None
  if isinstance(clip_norm, bool) or not (math.isfinite(clip_norm) and clip_norm > 0):
    raise ValueError(f"run: expected clip_norm > 0 (finite) or None, got {clip_norm!r}.")
  return float(clip_norm)


def _clip_figures(grad_norms: list[float], clip_norm: "float | None") -> dict[str, Any]:
  """`run`'s clip figures: ``clip_norm``, ``grad_norms`` (each step's), ``grad_norm`` (min,
  median and max over the timed steps: all but the first, unless it is the only one) and
  ``clipped_fraction`` (the share of those whose norm is over ``clip_norm``)."""
  timed = grad_norms[1:] or grad_norms
  if clip_norm is None or not timed:
    return {"clip_norm": clip_norm, "grad_norms": list(grad_norms), "grad_norm": None,
            "clipped_fraction": None}
  return {"clip_norm": clip_norm, "grad_norms": list(grad_norms),
          "grad_norm": {"min": float(np.min(timed)), "median": float(np.median(timed)),
                        "max": float(np.max(timed)), "steps": len(timed)},
          "clipped_fraction": sum(g > clip_norm for g in timed) / len(timed)}


def _offload_step(train_step, *, device_budget, host_budget, policy="auto",
                  overlap_update=True, allow_over_budget=False):
  import jaxtier  # pylint: disable=g-import-not-at-top
  return jaxtier.offload(train_step, device_budget=device_budget, host_budget=host_budget,
                         policy=policy, overlap_update=overlap_update,
                         allow_over_budget=allow_over_budget)


def _show_plan(plan, why: str, plan_details: bool) -> None:
  """Prints where `plan` puts the state (`why`: what decided it) and the plan itself."""
  if not plan.fits and why.startswith("to fit "):
    why = f"aiming at {why.removeprefix('to fit ')}, which it does not fit (below)"
  _say(placement_line(plan, why))
  if plan_details:
    print(plan.table(reasons=True))
  else:
    print(plan.summary(more="--plan_details"))


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
    clip_norm: float | None = None,
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
    checkpoint_dir: str | None = None,
    checkpoint_every: int | None = None,
    keep_checkpoints: int = 3,
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
      (``jaxtier.offload`` plans where each leaf lives: everything on the device when it fits;
      on the CPU backend, where no ``device_budget`` is given, under a budget below the step's
      need, so that part of the state goes to pinned_host: `budgets.cpu_device_budget`),
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
    clip_norm: clip gradients to this global norm before AdamW (> 0; implies ``clip``, whose
      norm it replaces); ``None``: 1.0 with ``clip``, else no clipping.
    log_every: print the loss and sync every this many steps; ``None``: the
      config's default.
    device_budget: device bytes jaxtier may use per device, e.g. ``"80GB"``;
      ``None`` means no limit (under ``"auto"`` on the CPU backend: the example's own budget,
      above). Under ``"none"`` the ``jax.jit`` step's compiled peak is checked against it
      (`budgets.jit_over_budget`), as a plan is under the other modes.
    host_budget: pinned host bytes jaxtier may use, as ``device_budget``.
    remat_policy: ``None`` keeps the config's ``remat_policy``; ``"none"``
      turns rematerialisation off; any other value is a
      ``jax.checkpoint_policies`` name applied to each decoder layer.
    progress: show a tqdm progress bar.
    allow_over_budget: if False, raise `OverBudgetError` before the first step when a
      ``device_budget`` / ``host_budget`` was given and the plan does not fit it
      (`over_budget`; over the ``device_budget``, ``jaxtier.offload`` refuses the plan before
      the state exists, and that refusal is raised as `OverBudgetError`); if True, only the
      plan's notes and jaxtier's warnings say so (``jaxtier.offload(allow_over_budget=True)``).
    overlap_update: update the layers' leaves inside the backward pass
      (`jaxtier.offload(overlap_update=...)`).
    tokenizer: ``"byte"`` (bytes are tokens; the config's ``vocab_size`` is kept) or
      ``"bpe"`` (a byte-level BPE tokenizer trained on ``data``'s text and cached:
      `tokenizer.load_corpus`; the config's ``vocab_size`` becomes ``vocab_size``).
    vocab_size: with ``"bpe"``, 32768 (``None``), 65536 or 131072; with ``"byte"``,
      ``None`` or 256.
    plan_details: print the plan's per-leaf table and every note (`Plan.table`).
    checkpoint_dir: keep the run in this directory (`checkpoints`): a checkpoint (the state
      with orbax, the step, the losses so far) every ``checkpoint_every`` steps, after the last
      step and on Ctrl-C; where it holds a complete checkpoint of this run, the newest is
      restored and the run goes on from its step, reading the batches an uninterrupted run
      reads from there (so its losses are that run's). ``None``: nothing is kept.
    checkpoint_every: steps between checkpoints; ``None``: only after the last step and on
      Ctrl-C.
    keep_checkpoints: how many of the newest checkpoints to keep (older ones are deleted).

  Returns:
    A dict with ``losses`` (one float per step), ``step_times`` (seconds per
    step; the loop syncs only at log points, so a step inside a log window is
    given the window's mean; entry 0 is the first step alone, compile
    included), ``tokens_per_sec`` (mean over all steps but the first),
    ``first_loss``, ``last_loss``, ``compile_secs``, ``total_secs``,
    ``num_params``, ``vocab_size``, ``state_bytes``, ``plan`` (``step.plan.table()``: every
    leaf and note, or ``None``) and ``plan_bytes`` (state bytes per memory kind, fp32 masters
    included: ``{"device": ..., "pinned_host": ...}``) and ``memory`` (bytes: the peak device
    memory JAX's allocator saw, where the backend reports it, and the pinned_host bytes live
    after the run, beside the plan's predicted and compiled figures; None where unknown).
    With clipping it also has ``clip_norm``, ``grad_norms`` (each step's gradient global norm
    before the clip, this run's steps), ``grad_norm`` (their ``min``, ``median`` and ``max``
    over the timed steps: all but this run's first, as ``tokens_per_sec``) and
    ``clipped_fraction`` (the fraction of those steps whose norm is over ``clip_norm``: the
    steps the clip scaled); without, ``clip_norm`` and those are ``None`` (``grad_norms``
    empty). Where the plan runs a clipped step's updates on a guess (`Plan.speculation`),
    ``guessed`` gives the steps whose guess ``held``, ``missed``, and ran ``serial`` with no
    guess, and the planner's ``predicted_mean_step_secs`` over them (seconds); else None.

  Raises:
    ValueError: for an unknown config or offload mode, bad sizes, bad data, or a vocabulary
      size the tokenizer does not allow.
    OverBudgetError: the plan misses a budget given (only with ``allow_over_budget=False``).
    jaxtier.AdmissionError: the plan (or, with ``"none"``, the jitted step: `jaxtier.admit`)
      needs more memory than this machine gives, raised before the state is allocated; or the
      batch's activations alone cannot fit (`_check_step_memory`), raised before the step is
      compiled.
    tokenizer.TokenizersMissingError: ``"bpe"`` without the ``tokenizers`` package.
    NonFiniteLossError: a step's loss is NaN or inf; raised at it (the next step may have been
      dispatched, none after), with the results so far.
    Interrupted: Ctrl-C in the training loop (a KeyboardInterrupt), with the results so far
      and, given ``checkpoint_dir``, the checkpoint saved at the step's end.
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
  clip_norm = clip_norm_of(clip, clip_norm)
  if checkpoint_every is not None and checkpoint_every < 1 or keep_checkpoints < 1:
    raise ValueError(f"run: expected checkpoint_every >= 1 (or None) and keep_checkpoints >= 1, "
                     f"got {checkpoint_every} and {keep_checkpoints}.")
  settings = dict(config=config_name, batch_size=batch_size, seq_len=seq_len, seed=seed,
                  data=(f"<{data.size} token ids>" if isinstance(data, np.ndarray)
                        else data or ""), tokenizer=tokenizer, vocab_size=config.vocab_size,
                  learning_rate=learning_rate, warmup_steps=warmup_steps,
                  clip=clip_norm is not None, clip_norm=clip_norm, offload=offload, steps=steps)
  resumed = None
  if checkpoint_dir:
    kept = checkpoints_lib.complete(checkpoint_dir)
    if kept:
      resumed = kept[-1]
      checkpoints_lib.check_resumable(resumed, settings)
  start = resumed.step if resumed else 0

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
  batch_iter = data_lib.batches(tokens, batch_size, seq_len, seed, start=start)
  small = data_lib.corpus_size_warning(len(tokens), batch_size, seq_len, steps)
  if small:
    logging.warning("run: %s", small)

  if warmup_steps is not None and warmup_steps >= steps:
    # On stdout with the run's other output, as the budgets' warning.
    print(f"warning: warmup_steps={warmup_steps} is not under steps={steps}: the learning "
          f"rate never reaches its peak of {learning_rate:g}")
  optimizer_config = OptimizerConfig(
      learning_rate=learning_rate, total_steps=steps, warmup_steps=warmup_steps,
      clip_norm=clip_norm)
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
  _say(f"config {config_name}: {num_params:,} params, {len(tokens):,} tokens{vocab} of "
       f"data, batch {batch_size} x seq {seq_len}, {steps} step{'s' if steps != 1 else ''}, "
       f"offload={offload}")
  if resumed:
    _say(f"resuming from {resumed.path} (step {start} of {steps})")
    saved_steps = resumed.settings.get("steps")
    if saved_steps is not None and saved_steps != steps:
      # The schedule is a function of --steps: the steps run so far took the old one.
      _say(f"warning: the checkpoint's run had --steps={saved_steps}; the learning-rate "
           f"schedule (its warmup and cosine decay span --steps) is now {steps} steps long, "
           f"so from step {start + 1} on the learning rates are those of a {steps}-step run, "
           f"and the run matches neither a {saved_steps}-step nor a {steps}-step run "
           "from the start")
  unfinished = checkpoints_lib.incomplete(checkpoint_dir) if checkpoint_dir else []
  if unfinished:
    _say(f"skipping {len(unfinished)} incomplete checkpoint{'s' if len(unfinished) > 1 else ''} "
         f"(a save stopped midway): {', '.join(unfinished)}"
         + ("" if resumed else f"; no complete one in {checkpoint_dir}: starting at step 0"))
  _check_step_memory(config, batch_size, seq_len, state_bytes)

  first_batch = jnp.asarray(next(batch_iter))
  plan = None
  plan_bytes = {"device": state_bytes, "pinned_host": 0}
  if offload != "none":
    budget = _budget(device_budget)
    why = {"stream": "as --offload=stream asks",
           "optimizer_state_on_host": "as --offload=optimizer_state_on_host asks"}.get(offload)
    if budget is not None:
      why = why or f"to fit --device_budget={device_budget}"
    elif offload == "auto" and jax.default_backend() == "cpu":
      # The CPU's device memory is its RAM: the example sets a device budget under the step's
      # need, so that the planner places part of the state in pinned_host.
      figures = cpu_device_budget(train_step, shapes, first_batch,
                                  overlap_update=overlap_update)
      if figures is not None:
        budget = figures[0]
        why = f"to fit a {jaxtier.format_bytes(budget)} device budget (CPU default)"
    # jaxtier refuses a plan over the --device_budget given before the state exists, unless
    # allow_over_budget (the CPU example's own budget is a demonstration: not refused).
    step = _offload_step(train_step,
                         policy=stream_layers_policy if offload == "stream" else offload,
                         device_budget=budget, host_budget=_budget(host_budget),
                         overlap_update=overlap_update,
                         allow_over_budget=allow_over_budget or _budget(device_budget) is None)
    try:
      with verdicts_printed():  # the plan printed below says whether it fits
        if resumed:  # restored straight into its planned memory kinds
          state = step.restore(resumed.path, jax.eval_shape(init_state),
                               example_args=(first_batch,))
        else:
          state = step.init(init_state, example_args=(first_batch,))
    except jaxtier.AdmissionError as e:
      if e.limit != "device_budget" or e.plan is None:
        raise
      # Refused over --device_budget: the refused plan is printed as an admitted one is, and
      # the refusal said in the command line's terms (its flags and fixes).
      _show_plan(e.plan, why or "as it fits there", plan_details)
      raise OverBudgetError(over_budget(e.plan, offload, remat_policy=config.remat_policy)
                            or str(e).removeprefix("jaxtier: ")) from e
    plan = step.plan.table()
    plan_bytes = step.plan.bytes_by_memory_kind()
    _show_plan(step.plan, why or "as it fits there", plan_details)
    # Only a budget the user gave is checked (the CPU example's own is a demonstration).
    over = (None if allow_over_budget or _budget(device_budget) is None and
            _budget(host_budget) is None else
            over_budget(step.plan, offload, remat_policy=config.remat_policy))
    if over:
      raise OverBudgetError(over)
  else:
    step = jax.jit(train_step, donate_argnums=0)
    lowered = step.lower(shapes, first_batch)
    # Refused before the state exists where the step would run out of device memory, as
    # jaxtier refuses a plan (the refusal names the allocator fraction that admits it).
    jaxtier.admit(lowered)
    # And where its compiled peak is over the --device_budget given, as a plan over it is (the
    # state pins no host memory: a host budget holds).
    over = jit_over_budget(lowered, _budget(device_budget), state_bytes,
                           remat_policy=config.remat_policy)
    if over and not allow_over_budget:
      raise OverBudgetError(f"{over}; or --allow_over_budget to train anyway")
    if over:
      # On stdout with the run's other output, as the plan's verdicts are.
      print(f"warning: {over.removesuffix('.')}")
    state = _restore_jitted(resumed.path, init_state) if resumed else jax.jit(init_state)()
    on_host = sum(x.nbytes for x in jax.tree.leaves(state)
                  if getattr(x.sharding, "memory_kind", None) == "pinned_host")
    if on_host:  # jitted by another's hand (python -m jaxtier run), which placed it
      _say(f"offload: --offload=none (jax.jit), yet {jaxtier.format_bytes(on_host)} of the "
           f"{jaxtier.format_bytes(state_bytes)} of state was built in pinned_host")
    elif resumed:  # (restored on the device; what jits the step may place it elsewhere)
      _say(f"offload: --offload=none (jax.jit); {jaxtier.format_bytes(state_bytes)} of state "
           "restored on the device")
    else:
      _say(f"offload: all {jaxtier.format_bytes(state_bytes)} of state on the device, as "
           "--offload=none asks (jax.jit)")

  tokens_per_step = batch_size * seq_len
  losses: list[float] = list(resumed.losses) if resumed else []
  step_times: list[float] = []
  grad_norms: list[float] = []  # with clipping: each step's gradient norm before the clip
  unread: list[dict[str, jax.Array]] = []  # the metrics of the steps run, not read yet
  # disable=None: a bar on a terminal, none in a log file.
  bar = tqdm.tqdm(total=steps, initial=start, disable=None if progress else True, unit="step",
                  dynamic_ncols=True)
  window_start = time.perf_counter()
  window_steps = 0
  compile_secs = 0.0
  saved = resumed.path if resumed else None
  sigint = checkpoints_lib.SigintDeferred()

  def result(**figures) -> dict[str, Any]:
    timed = step_times[1:] or step_times
    return {
        "losses": list(losses),
        "step_times": list(step_times),
        "tokens_per_sec": tokens_per_step * len(timed) / sum(timed) if sum(timed) else None,
        "first_loss": losses[0] if losses else None,
        "last_loss": losses[-1] if losses else None,
        "compile_secs": compile_secs,
        "total_secs": time.perf_counter() - t_start,
        "num_params": num_params,
        "vocab_size": config.vocab_size,
        "state_bytes": state_bytes,
        "plan_bytes": plan_bytes,
        "plan": plan,
        "memory": None,
        "resumed_from": start,
        "checkpoint": saved,
    } | _clip_figures(grad_norms, clip_norm) | figures

  def read(keep: int) -> None:
    """Reads the losses of all but the newest `keep` steps run; raises at a non-finite one."""
    while len(unread) > keep:
      metrics = unread.pop(0)
      losses.append(float(metrics["loss"]))
      if "grad_norm" in metrics:
        grad_norms.append(float(metrics["grad_norm"]))
      if not math.isfinite(losses[-1]):
        raise NonFiniteLossError(
            f"the loss at step {len(losses)} is {losses[-1]}: training stopped there (the "
            f"first non-finite loss); lower --learning_rate (it is {learning_rate:g})"
            + ("" if clip_norm is not None else
               ", or pass --clip (gradients clipped to norm 1.0)"),
            step=len(losses), loss=losses[-1], result=result())

  writing = None  # the step whose checkpoint is being written

  def save(done: int) -> str:
    nonlocal writing
    read(0)
    write = ((lambda path: step.save(path, state)) if offload != "none" else
             (lambda path: _save_jitted(path, state)))
    writing = done
    path = checkpoints_lib.save(checkpoint_dir, done, losses, settings, write, keep_checkpoints)
    writing = None
    return path

  def stopped() -> Interrupted:
    """Mid-step, or a second Ctrl-C before or during a save: the losses read so far, and the
    newest complete checkpoint (if any) as it was."""
    return Interrupted(step=len(losses), checkpoint=saved, result=result(), unfinished=(
        None if writing is None else checkpoints_lib.unfinished_state(checkpoint_dir, writing)),
                       twice=sigint.forced)

  batch = first_batch
  try:
    # With a checkpoint directory a first Ctrl-C ends the run at the end of its step, saved.
    with sigint.deferred() if checkpoint_dir else contextlib.nullcontext():
      for i in range(start, steps):
        if i > start:
          batch = jnp.asarray(next(batch_iter))
        state, metrics = step(state, batch)
        unread.append({k: metrics[k] for k in ("loss", "grad_norm") if k in metrics})
        window_steps += 1
        bar.update(1)
        done = i + 1
        # Sync after the first (compiling) step, at each log point and at the end; else read
        # the step before's loss (done, or nearly) while this one runs.
        logged = i == start or done % log_every == 0 or done == steps
        read(0 if logged else 1)
        if logged:
          now = time.perf_counter()
          secs = (now - window_start) / window_steps
          step_times.extend([secs] * window_steps)
          window_start, window_steps = now, 0
          if i == start:
            compile_secs = secs
          tok_s = tokens_per_step / secs
          bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{tok_s:,.0f}")
          if i > start or steps - start == 1:
            gnorm = f"  gnorm {grad_norms[-1]:.3g}" if grad_norms else ""
            tqdm.tqdm.write(f"step {done:>6}/{steps}  loss {losses[-1]:.4f}  "
                            f"{tok_s:,.0f} tokens/s  {secs * 1e3:.1f} ms/step{gnorm}")
        if checkpoint_dir and (done == steps or sigint.asked or (
            checkpoint_every and done % checkpoint_every == 0)):
          saved = save(done)
        if sigint.asked and done < steps:
          raise Interrupted(step=done, checkpoint=saved, result=result())
  except Exception as e:  # pylint: disable=broad-except
    if not sigint.forced:
      raise
    # A second Ctrl-C raised inside a library mid-save (orbax's threads), which failed
    # otherwise on its way out: the interrupt is what happened.
    raise stopped() from None
  except KeyboardInterrupt as e:
    if isinstance(e, Interrupted):
      raise
    raise stopped() from None
  finally:
    bar.close()
  total_secs = time.perf_counter() - t_start

  timed = step_times[1:] or step_times
  tokens_per_sec = tokens_per_step * len(timed) / sum(timed)
  _say(f"done: loss {losses[0]:.4f} -> {losses[-1]:.4f}, "
       f"{tokens_per_sec:,.0f} tokens/s (mean, first step excluded), "
       f"first step {compile_secs:.2f} s, total {total_secs:.1f} s")
  clipped = _clip_figures(grad_norms, clip_norm)
  if clipped["grad_norm"]:
    g = clipped["grad_norm"]
    _say(f"clip: max norm {clip_norm:g}, over it (clipped) on "
         f"{round(clipped['clipped_fraction'] * g['steps'])} of {g['steps']} timed steps; "
         f"gradient norm min {g['min']:.4g}, median {g['median']:.4g}, max {g['max']:.4g}")
  memory = _memory_figures(step.plan if offload != "none" else None)
  partial = offload != "none" and _no_activations(step.plan)
  _say("memory: " + ", ".join(
      f"{k} {jaxtier.format_bytes(v)}"
      f"{' (state and gradients only: no activations)' if partial and 'predicted' in k else ''}"
      for k, v in memory.items() if v is not None))
  held, missed, serial = step.guesses if offload != "none" else (0, 0, 0)
  speculation = getattr(getattr(step, "plan", None), "speculation", None)
  guessed = None
  if held + missed + serial:
    predicted = speculation.mean_step_secs(held, missed, serial)
    guessed = {"held": held, "missed": missed, "serial": serial,
               "predicted_mean_step_secs": predicted,
               "speculative_step_secs": speculation.speculative_step_secs,
               "serial_step_secs": speculation.serial_step_secs}
    _say(f"updates run on a guess that the clip does not bind: it held on {held} steps and "
         f"missed on {missed} (each then ran the serial schedule too); {serial} ran serially "
         f"with no guess (recent steps clipped); planner: mean step {predicted * 1e3:.4g} ms "
         "over these steps")
  measured = getattr(getattr(step, "plan", None), "measured_step_secs", None)
  if measured is not None and step.plan.predicted_step_secs is not None:
    # (Whether the rates are this machine's the plan's summary said.)
    _say(f"planner: step predicted {step.plan.predicted_step_secs * 1e3:.3g} ms, measured "
         f"{measured * 1e3:.3g} ms (calls 2-4)")
  if saved:
    _say(f"checkpoint: {saved}")
  return result(tokens_per_sec=tokens_per_sec, total_secs=total_secs, memory=memory,
                guessed=guessed)


def _save_jitted(path: str, state: Any) -> None:
  """Writes the state of a `jax.jit` step (``offload="none"``) with orbax to `path`."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  with ocp.StandardCheckpointer() as ckptr:
    ckptr.save(path, {"state": state})
    ckptr.wait_until_finished()


def _restore_jitted(path: str, init_state) -> Any:
  """Reads `_save_jitted`'s state, each leaf on the default device (where `jax.jit(init_state)`
  puts it)."""
  import orbax.checkpoint as ocp  # pylint: disable=g-import-not-at-top
  device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device),
                        jax.eval_shape(init_state))
  with ocp.StandardCheckpointer() as ckptr:
    return ckptr.restore(path, {"state": target})["state"]


def _say(text: str) -> None:
  """Prints `text` wrapped at words to the terminal's width (80 columns where unknown)."""
  width = shutil.get_terminal_size((80, 24)).columns
  print(textwrap.fill(text, width=max(width, 40), subsequent_indent="  ",
                      break_long_words=False, break_on_hyphens=False))


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
  # Each buffer once: two Array objects may share one (orbax's save leaves such an alias of
  # each saved leaf until the next step donates the buffer).
  buffers: dict[Any, int] = {}
  for x in jax.live_arrays():
    if getattr(x.sharding, "memory_kind", None) != "pinned_host":
      continue
    for shard in x.addressable_shards:
      try:
        key = (shard.device.id, shard.data.unsafe_buffer_pointer())
      except Exception:  # pylint: disable=broad-except  (a backend without raw pointers)
        key = id(shard.data)
      buffers[key] = shard.data.nbytes
  pinned = sum(buffers.values())
  return {
      "peak device (measured)": stats.get("peak_bytes_in_use"),
      "peak device (predicted)": getattr(plan, "predicted_peak_hbm_bytes", None),
      "peak device (compiled)": getattr(plan, "compiler_peak_hbm_bytes", None),
      "pinned_host live (measured)": pinned,
      "pinned_host (planned)": getattr(plan, "pinned_bytes", None),
      "pinned_host beyond the state (compiled)": getattr(plan, "compiler_host_extra_bytes",
                                                         None),
      "pinned_host spares (planned)": (
          plan.speculation.spare_pinned_bytes
          if getattr(plan, "speculation", None) is not None and plan.speculation.enabled
          else None),
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
                             "fits the device budget; on the CPU without --device_budget, "
                             "under one below the step's need, so that part of the state goes "
                             "to pinned_host); stream: the layers' params stream from "
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
    "$XDG_CACHE_HOME/jaxtier/tokenizers; the model's vocab_size follows.")
_VOCAB_SIZE = flags.DEFINE_integer(
    "vocab_size", None, "With --tokenizer=bpe: "
    f"{', '.join(map(str, tokenizer_lib.BPE_VOCAB_SIZES))} (default "
    f"{tokenizer_lib.DEFAULT_BPE_VOCAB_SIZE}); with byte: unset (256).")


def _valid_vocabulary(values: dict[str, Any]) -> bool:
  """--tokenizer and --vocab_size agree (`tokenizer.vocab_size_for`): checked where the flags
  are parsed, before anything is loaded."""
  try:
    tokenizer_lib.vocab_size_for(values["tokenizer"], values["vocab_size"])
  except ValueError as e:
    raise flags.ValidationError(str(e)) from None
  return True


flags.register_multi_flags_validator(["tokenizer", "vocab_size"], _valid_vocabulary)
_SEED = flags.DEFINE_integer("seed", 0, "Seed of the weights and batch order.", lower_bound=0)
_LEARNING_RATE = flags.DEFINE_float("learning_rate", None,
                                    "Peak learning rate; default per config.")
_WARMUP_STEPS = flags.DEFINE_integer("warmup_steps", None,
                                     "Warmup steps; default 5% of --steps.", lower_bound=0)
_CLIP = flags.DEFINE_bool("clip", False, "Clip gradients to global norm 1.0.")
_CLIP_NORM = flags.DEFINE_float(
    "clip_norm", None, "Clip gradients to this global norm (> 0; implies --clip, whose 1.0 it "
    "replaces).")
flags.register_validator("clip_norm", lambda v: v is None or (math.isfinite(v) and v > 0),
                         "--clip_norm must be a finite number > 0")
flags.register_multi_flags_validator(
    ["clip", "clip_norm"],
    lambda f: not (f["clip_norm"] is not None and flags.FLAGS["clip"].present
                   and not f["clip"]),
    "--clip_norm clips: drop --noclip (or --clip_norm, to train unclipped)")
_LOG_EVERY = flags.DEFINE_integer("log_every", None,
                                  "Log (and sync) every N steps; default per config.",
                                  lower_bound=1)
_DEVICE_BUDGET = flags.DEFINE_string("device_budget", "", "Device memory jaxtier "
                                     "may use per device, e.g. 80GB; empty: no limit (with "
                                     "--offload=auto on the CPU: the example's own, below "
                                     "the step's need).")
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
                                f"got {value!r}; leave it empty for the default (the flag's "
                                "help says what it is)") from None
  return True


flags.register_validator("device_budget", _valid_size)
flags.register_validator("host_budget", _valid_size)

_REMAT_POLICY = flags.DEFINE_string(
    "remat_policy", None, "Per-layer rematerialisation: 'none', or one of "
    f"{', '.join(llama.REMAT_POLICIES)} (jax.checkpoint_policies; the last sends the "
    "projections' outputs to pinned_host); default: the config's.")
flags.register_validator(
    "remat_policy", lambda v: v in (None, "none") or v in llama.REMAT_POLICIES,
    f"expected 'none' or one of {', '.join(llama.REMAT_POLICIES)}")


def _valid_seq_len(values: dict[str, Any]) -> bool:
  """--seq_len is within the --config model's maximum (`check_seq_len`)."""
  if values["seq_len"] is not None and values["config"] in llama.CONFIGS:
    try:
      check_seq_len(llama.CONFIGS[values["config"]], values["config"], values["seq_len"])
    except ValueError as e:
      raise flags.ValidationError(str(e)) from None
  return True


flags.register_multi_flags_validator(["config", "seq_len"], _valid_seq_len)
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
    "figures; with --clip or --clip_norm, clip_norm, each step's gradient norm (grad_norms) "
    "and the share of timed steps the clip scaled (clipped_fraction); run()'s return value "
    "without the plan's text) as JSON to this file, however "
    "the run ends: its field 'ended' says how ('completed', 'interrupted', 'non_finite_loss', "
    "'refused' before training, or 'error'), 'error' what stopped it.")
_CHECKPOINT_DIR = flags.DEFINE_string(
    "checkpoint_dir", "", "Keep the run here: orbax checkpoints of the state (step_<n>/, with "
    "the step and the losses so far beside it) every --checkpoint_every steps, after the last "
    "step and on Ctrl-C. Where it holds a checkpoint of this run, the run resumes from the "
    "newest (the same flags; --steps may be larger, which stretches the learning-rate "
    "schedule from there on).")
_CHECKPOINT_EVERY = flags.DEFINE_integer(
    "checkpoint_every", None, "With --checkpoint_dir: steps between checkpoints; default: only "
    "after the last step and on Ctrl-C.", lower_bound=1)
_KEEP_CHECKPOINTS = flags.DEFINE_integer(
    "keep_checkpoints", 3, "With --checkpoint_dir: the newest checkpoints kept (older ones are "
    "deleted).", lower_bound=1)


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


def _valid_learning_rate(value: "float | None") -> bool:
  if value is not None and not (math.isfinite(value) and value > 0):
    raise flags.ValidationError(f"expected a finite learning rate > 0, got {value}")
  return True


def _missing_data(value: str) -> "str | None":
  """What --data names that is not a file, else None: checked in `main`, before the model is
  built (not an absl validator: `plan` reads this module's flags too, and ignores --data)."""
  missing = [f for f in value.split(",") if f and not os.path.isfile(f)]
  return f"no such file: {', '.join(missing)}" if missing else None


flags.register_validator("learning_rate", _valid_learning_rate)


def main(argv: Sequence[str]) -> None:
  """Runs `run` with the flags; writes --json_out however it ends, then re-raises what ended
  it (the command line turns that into its message and exit status)."""
  if len(argv) > 1:
    raise app.UsageError(f"Unexpected arguments: {argv[1:]}")
  # Flags of --checkpoint_dir, given without it, would keep no checkpoint and say nothing (not
  # an absl validator: `plan` reads these flags' module too, and ignores them).
  kept = [f"--{name}" for name in ("checkpoint_every", "keep_checkpoints")
          if flags.FLAGS[name].present]
  if kept and not _CHECKPOINT_DIR.value:
    raise app.UsageError(f"{' and '.join(kept)} without --checkpoint_dir: no checkpoint is "
                         "kept; add --checkpoint_dir=DIR (or drop "
                         f"{'them' if len(kept) > 1 else 'it'})")
  # Before training, so that a bad path costs the run nothing (its checkpoints, say).
  for flag, problem in ((_DATA, _missing_data(_DATA.value)),
                        (_CHECKPOINT_DIR, _CHECKPOINT_DIR.value
                         and paths.why_unwritable_folder(_CHECKPOINT_DIR.value))):
    if problem:
      raise app.UsageError(f"flag --{flag.name}={flag.value}: {problem}")
  # absl prints INFO by default: JAX's that it found no TPU, orbax's per checkpoint. The run's
  # own lines are printed; --verbosity brings the libraries' back.
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  try:
    # From here a Ctrl-C raises KeyboardInterrupt (--json_out is written below); until now it
    # ended the process at once.
    early_interrupt.restore()
    result = run(config_name=_CONFIG.value, steps=_STEPS.value, batch_size=_BATCH_SIZE.value,
        seq_len=_SEQ_LEN.value, offload=_OFFLOAD.value, data=_DATA.value,
        seed=_SEED.value, learning_rate=_LEARNING_RATE.value,
        warmup_steps=_WARMUP_STEPS.value, clip=_CLIP.value, clip_norm=_CLIP_NORM.value,
        log_every=_LOG_EVERY.value,
        device_budget=_DEVICE_BUDGET.value, host_budget=_HOST_BUDGET.value,
        remat_policy=_REMAT_POLICY.value, allow_over_budget=_ALLOW_OVER_BUDGET.value,
        overlap_update=_OVERLAP_UPDATE.value, tokenizer=_TOKENIZER.value,
        vocab_size=_VOCAB_SIZE.value, plan_details=_PLAN_DETAILS.value,
        checkpoint_dir=_CHECKPOINT_DIR.value or None,
        checkpoint_every=_CHECKPOINT_EVERY.value, keep_checkpoints=_KEEP_CHECKPOINTS.value)
  except Interrupted as e:
    _write_json_out(e.result, "interrupted", None)
    raise
  except KeyboardInterrupt:  # before the training loop
    _write_json_out({}, "interrupted", None)
    raise
  except NonFiniteLossError as e:
    _write_json_out(e.result, "non_finite_loss", e)
    raise
  except (ValueError, OSError, tokenizer_lib.TokenizersMissingError) as e:
    # Refused before training (a bad setting or file, a plan over a budget or the machine).
    _write_json_out({}, "refused", e)
    raise
  except Exception as e:
    _write_json_out({}, "error", e)
    raise
  _write_json_out(result, "completed", None)


def _write_json_out(result: dict[str, Any], ended: str, error: "BaseException | None") -> None:
  """Writes --json_out (where given): `result` without the plan's text, `ended` (how the run
  ended) and `error` (what stopped it, or None)."""
  if not _JSON_OUT.value:
    return
  import json  # pylint: disable=g-import-not-at-top
  out = {k: v for k, v in result.items() if k != "plan"}
  out.update(ended=ended, error=None if error is None else
             f"{type(error).__name__}: {str(error).removeprefix('jaxtier: ')}")
  with open(_JSON_OUT.value, "w") as f:
    json.dump(out, f, indent=1)


def exit_interrupted(e: KeyboardInterrupt) -> None:
  """Says on stderr how Ctrl-C ended the run (`e`: an `Interrupted` from the training loop,
  else before it) and what it saved, then exits with status 130 at once: the interpreter's
  teardown, with XLA's threads still mid-compile or mid-step, can crash (a segfault), and a
  traceback through the training loop would say nothing more. --json_out is written by `main`
  before this."""
  if not isinstance(e, Interrupted):
    said = early_interrupt.BEFORE_TRAINING  # as a Ctrl-C while the trainer starts
  elif e.unfinished or e.twice:
    what = (f"the checkpoint {e.unfinished} being written; it is incomplete, and a resumed "
            "run skips it" if e.unfinished else "the run before its checkpoint was written")
    said = (f"interrupted at step {e.step} (Ctrl-C twice): the second stopped {what}. "
            + (f"The newest complete checkpoint is {e.checkpoint}; the same command resumes "
               "from it" if e.checkpoint else "No complete checkpoint was saved"))
  elif e.checkpoint:
    said = (f"interrupted at step {e.step} (Ctrl-C): the newest checkpoint is "
            f"{e.checkpoint}; the same command resumes from it")
  else:
    said = (f"interrupted at step {e.step} (Ctrl-C): nothing was saved (--checkpoint_dir "
            "keeps the run)")
  print(f"\n{said}", file=sys.stderr)
  sys.stdout.flush()
  sys.stderr.flush()
  os._exit(130)


if __name__ == "__main__":
  try:
    # A bad flag said in one line, exit status 2, as `python -m jaxtier train` says it.
    app.run(main, flags_parser=lambda argv: command_help.parse_flags(
        argv, program="python -m jaxtier.examples.train"))
  except KeyboardInterrupt as interrupt:
    exit_interrupted(interrupt)
