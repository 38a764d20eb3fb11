"""`jaxtier.offload`, `jaxtier.plan` and `jaxtier.admit`: the public entry points (re-exported by
`jaxtier`)."""

from __future__ import annotations

import logging
from typing import Any, Callable

import jax

from jaxtier._src import pipeline
from jaxtier._src.analysis import statics
from jaxtier._src.analysis import step_costs
from jaxtier._src.hardware import calibrate as calibration
from jaxtier._src.hardware import profile
from jaxtier._src.options import MISSING, OffloadOptions
from jaxtier._src.planning import admission, cost_model
from jaxtier._src.planning import plan as plan_lib
from jaxtier._src.runtime import OffloadedStep
from jaxtier._src.hardware import host as host_lib

log = logging.getLogger("jaxtier")


def offload(fun: Callable[..., Any] = MISSING, *, device_budget: Any = None,
            host_budget: Any = None, policy: Any = "auto",
            donate_argnums: "int | tuple[int, ...]" = (0,), overlap_update: bool = True,
            allow_over_budget: bool = False) -> Any:
  """Wraps an unchanged train step so that its state spans device and pinned host memory.

  Works bare (`@jaxtier.offload`) or with options (`jaxtier.offload(step, host_budget='64GB')`).

  Args:
    fun: `train_step(state, *args) -> (new_state, metrics)`; `state` is a pytree and
      `new_state` has its structure, shapes and dtypes. Any outputs the JAX tracer accepts
      (constants, the inputs themselves, metrics of the updated params, of the gradients or of
      the optimizer state); leaves that are not arrays (callables, `functools.partial`s, a
      module's Python bools and ints) are static, as `eqx.filter_jit` treats them
      (`OffloadedStep`).
    device_budget: device memory the step may use at its peak (state and transient buffers),
      bytes per device or a size string ('80GB', '16GiB'); None: no limit (on a GPU, what the
      device has). The compiled step's peak (`memory_analysis()`) is checked against it; when
      it is over, 'auto' tries the plan with every optimizer-state leaf on the host, then
      the layers' params streamed too (two compiles at most; `plan.escalation` lists them),
      and a policy leaving leaves to the solver re-plans (up to twice); a plan still over it
      is refused, the refusal listing the plans tried (below), unless `allow_over_budget`.
    host_budget: pinned host memory the plan may pin, bytes per device or a size string; None:
      limited only by what the host can pin.
    policy: 'auto' (the planner's solver: the fastest predicted placement within the budgets;
      everything on the device when it fits), 'optimizer_state_on_host' (every optimizer-state
      leaf to pinned_host, updated there), 'none' (all on device), a callable
      `(path, LeafInfo) -> placement | None`, or a `{regex: placement}` dict matched against
      leaf paths (leaves it leaves to None/no match are planned as 'auto'). Placements:
      'device', 'host_dha', 'host_cpu', 'host_split', 'host_xla', 'host_stream' (a stack of
      layers read by a layer loop; a stream pattern's match on optimizer state puts that
      state on the host).
    donate_argnums: arguments donated to the step; must include 0.
    overlap_update: update leaves stacked over layers (a `scan` over layers' params and their
      optimizer state) layer by layer inside the backward pass, overlapped with the compute;
      the serial step's arithmetic (the unrolled backward pass may round a gradient
      differently in the last bit). Updates that need every gradient first (a
      global-norm clip) stay after the backward pass, the reason in `plan.notes`. An
      embedding table read in place (`host_dha`) is updated row by row instead: the rows the
      step's ids do not name while the step computes, the others after the backward pass
      (the serial update's bits). False: every host update runs after the backward pass. A step that fails after its layered updates
      began leaves those leaves partly updated (the error names them; restore a checkpoint).
    allow_over_budget: run a plan that does not fit the `device_budget` given, as planned,
      warning "DOES NOT FIT" (its `plan.fits` is False). False: such a plan is refused (below).
      No effect without a `device_budget` (the budget the planner then sets itself is not
      checked so).

  Returns:
    An `OffloadedStep` (or a decorator making one, when `fun` is omitted).

  Raises:
    TypeError: `fun` not callable.
    jaxtier.OptionError (a ValueError and a TypeError): an option of the wrong type or form,
      named in its `option` field: a budget that is not a whole number of bytes > 0 nor a size
      string, `overlap_update` or `allow_over_budget` not a bool, `donate_argnums` not ints.
    ValueError: donate_argnums without 0.
    jaxtier.PlanError (a ValueError): a policy that is none of the forms above. Errors that
      need the traced step (a bad regex, an unknown placement, a budget the state cannot fit)
      are raised by `place`, `init`, `restore` or the first call, naming the leaf, before
      anything is allocated (the state passed is left as it was). Among them
      `jaxtier.AdmissionError` with `limit` 'device_budget': the plan, judged with the
      compiled step's peak where the step was compiled, does not fit the `device_budget` given
      (and `allow_over_budget` is False); its `need_bytes` is that peak, `limit_bytes` the
      budget, `plan` the plan refused (`plan.fits` False, `plan.violations` the limits missed).

  Example:
    >>> step = jaxtier.offload(train_step)            # doctest: +SKIP
    >>> state = step.place(state, batch)              # doctest: +SKIP
    >>> state, metrics = step(state, batch)           # doctest: +SKIP
    >>> print(step.plan)                              # doctest: +SKIP
  """
  options = OffloadOptions(device_budget=device_budget, host_budget=host_budget, policy=policy,
                           donate_argnums=donate_argnums, overlap_update=overlap_update,
                           allow_over_budget=allow_over_budget)
  if fun is MISSING:
    return lambda f: OffloadedStep(_callable(f), options)
  return OffloadedStep(_callable(fun), options)


def _callable(fun: Any) -> Callable[..., Any]:
  if not callable(fun):
    raise TypeError(f"jaxtier.offload: expected the train step, a callable "
                    f"`train_step(state, *args) -> (new_state, metrics)`, got "
                    f"{type(fun).__name__} {fun!r:.80}")
  return fun


def calibrate(*, save: bool = True, path: "str | None" = None,
              **options: Any) -> profile.HardwareProfile:
  """Measures this machine's `HardwareProfile` and stores it where the planner finds it.

  What is measured, and how, is `jaxtier._src.hardware.calibrate.calibrate` (on a GPU: the
  link each way
  and in duplex, zero-copy read / write / read+write, both host-update executors' AdamW rates,
  bf16 matmul, HBM bandwidth and capacity; everywhere: host DRAM bandwidth, the CPU executor,
  the pinnable host memory; without a GPU the GPU figures stay the H200 defaults, with a
  warning). Units: GB/s, params/s, TFLOP/s, bytes.

  Args:
    save: store the profile as JSON (default: yes), in the user's cache directory keyed by
      device kind and jax version (`$XDG_CACHE_HOME/jaxtier/profile-<device>-jax<version>.json`)
      or at `path`. `offload` and `plan` load it from there.
    path: where to store it instead.
    **options: passed to the measurement (`measure_cpu`, `measure_device`, `num_params`).

  Returns:
    The measured profile.
  """
  measured = calibration.calibrate(**options)
  if save:
    where = profile.save(measured, path)
    log.info("jaxtier.calibrate: profile stored at %s", where)
  return measured


def plan(fun: Callable[..., Any], state: Any, *args: Any, device_budget: Any = None,
         host_budget: Any = None, policy: Any = "auto", platform: "str | None" = None,
         streamable: Any = None, dha_readable: Any = None,
         activations: "cost_model.ActivationModel | None" = None,
         overlap_update: bool = True, device_kind: "str | None" = None) -> plan_lib.Plan:
  """The plan `offload` would make for `fun(state, *args)`, without placing anything.

  `state` and `args` may be arrays or `jax.ShapeDtypeStruct`s (to plan a model that is not
  allocated); their leaves that are not arrays are static, as `offload` treats them.
  `platform` ('cpu' or 'gpu'; default: JAX's default backend) picks the executors the plan
  names; for a platform this machine does not have, the stored or default hardware profile
  gives the rates and the pinnable host memory, and the plan's notes say so.

  The plan carries the cost model's predictions: `predicted_step_secs`, `critical_path`,
  `predicted_peak_hbm_bytes`, `resource_secs`. `streamable` / `dha_readable` (state leaf
  indices) allow `host_stream` / `host_dha` placements of parameters (None: every parameter the
  lowering can stream, and every embedding table it can read in place, as `offload` plans); `activations` (a
  `jaxtier.ActivationModel`) lets the plan choose the activation policy. `overlap_update` as
  `offload`'s: the plan's notes say which host updates run layer by layer, and why the others
  do not. `device_kind` names the GPU planned for on a machine without one (`platform="gpu"`):
  "H100", "H200" or "A100", any case, or a device kind naming one ("NVIDIA H100 80GB HBM3"); its
  built-in profile (the H200's measured rates scaled by the card's datasheet, not calibrated:
  `plan.hardware_kind` names it) gives the rates and the memory. None: the H200 (the default
  profile). On a GPU it may name only this machine's card.

  Returns:
    The `jaxtier.Plan`: each leaf's placement, bytes and reason, and the predictions above
    (seconds, bytes per device); `print(plan)` shows them, `plan.fits` says whether it is
    within the budgets. Budgets are bytes or size strings as `offload`'s.

  Raises:
    jaxtier.PlanError, jaxtier.AdmissionError, TypeError: as `OffloadedStep.place`.
    jaxtier.OptionError: `device_kind` names no card with a built-in profile (the message lists
      them), is given for a CPU plan, or names another card than this machine's GPU.
  """
  options = OffloadOptions(device_budget=device_budget, host_budget=host_budget, policy=policy,
                           overlap_update=overlap_update)
  platform = platform or jax.default_backend()
  if platform not in ("cpu", "gpu"):
    raise ValueError(f"jaxtier.plan: expected platform 'cpu' or 'gpu', got {platform!r}")
  profile.check_device_kind(device_kind, platform)  # before tracing the step
  counters: set[str] = set()  # the state's Python numbers the step changes: traced
  while True:
    state_s = statics.split(state, lambda path, x: path in counters)
    args_s = statics.split(tuple(args), statics.traced_argument)
    try:
      return pipeline.plan_only(
          statics.StepCall(fun, state_s, args_s, "jaxtier.plan"), options, state_s.arrays,
          args_s.arrays, platform=platform, streamable=streamable, dha_readable=dha_readable,
          activations=activations, device_kind=device_kind)
    except statics.NumbersChanged as e:
      counters.update(e.paths)


def available_host_bytes() -> "int | None":
  """The host's available memory (MemAvailable), bytes; None where it cannot be read.

  On the CPU backend this is the memory that device and pinned_host leaves share.
  """
  return host_lib.available_bytes()


def admit(program: Any) -> None:
  """Refuses a program jaxtier did not plan, a `jax.jit` step with all its state on the device,
  before anything is allocated, where it would run out of device memory on this GPU.

  `program` is `jax.jit(f).lower(*args)` (compiled here, only on a GPU) or its `.compile()`;
  `args` may be `jax.ShapeDtypeStruct`s, so that nothing is allocated. Its peak device memory,
  per device, is argument + output - alias + temp bytes of `memory_analysis()` (XLA's own peak
  where that is larger, as offloaded steps are verified), and it must fit
  in what JAX's allocator holds on this GPU (`memory_stats()['bytes_limit']`) less 5% for
  fragmentation, as the device peak of an offloaded step must.

  Returns:
    None: the program fits, or there is nothing to check (below).

  Raises:
    TypeError: `program` neither a `jax.stages.Lowered` nor a `jax.stages.Compiled` (e.g. the
      `jax.jit` function itself: lower it first).
    jaxtier.AdmissionError: the peak over that limit; `limit` is 'device_memory' and, where the
      allocator's fraction is what stops it and the GPU has the memory, `settings` holds the
      XLA_PYTHON_CLIENT_MEM_FRACTION that admits it (to set before JAX starts). No GPU here, or
      a backend that reports no figures: nothing is checked.
  """
  if not isinstance(program, (jax.stages.Lowered, jax.stages.Compiled)):
    raise TypeError(f"jaxtier.admit: expected jax.jit(f).lower(*args) or its .compile(), got "
                    f"{type(program).__name__} {program!r:.80}")
  limit = host_lib.allocator_limit_bytes()
  if limit is None:
    return
  figures = step_costs.memory_figures(program)
  admission.admit_device_peak(
      figures and figures.peak_bytes, limit, source="the compiled step's peak", what="step",
      fix=("place state in pinned_host (jaxtier.offload), a smaller batch or sequence, or "
           "rematerialise more (jax.checkpoint)"))
