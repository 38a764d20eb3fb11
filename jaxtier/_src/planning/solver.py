"""The planner's solver: placements that minimise the predicted step time under both budgets.

Decision units (all byte counts per device):
- `UpdateItem`: one fused host-update call's optimizer-state leaves (they move together: the
  call is cut around them). On the device, or on the host with one executor (`host_dha`,
  `host_cpu`, `host_split`). On the host it frees its leaves' device bytes and adds its
  update's seconds after the backward pass (`cost_model.update_cost`).
- `ParamItem`: one parameter leaf (a stacked leaf is a stack of layers). `device`, or
  `host_stream` (where the caller says it can be streamed), or `host_dha` (where the caller says
  a zero-copy read kernel exists). A host parameter frees its bytes and its gradient's, and
  forces its optimizer state to the host.
- the activation policy (keep / remat / offload) when the caller gives an `ActivationModel`.

Search: for each activation policy, and for each number k of optimizer-state items moved to the
host (taken in order of seconds added per byte freed: a greedy knapsack order), a dynamic
programme over the layer sequence (stages of parameters, in order) chooses each stage's
parameter placements to minimise the sum of stage times (`cost_model.stream_stage`) subject to
the device bytes left by the budget (MemFerry's DP, with device bytes discretised into
`NUM_BUCKETS`). The fastest feasible combination wins; ties go to fewer pinned bytes. When none
fits, the solution that needs the least device memory is returned with `fits=False` (the planner
then reports the budget error with that plan).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from typing import Any, Mapping, Sequence

import numpy as np

from jaxtier._src import cost_model as cm
from jaxtier._src import jax_compat as jc
from jaxtier._src.profile import HardwareProfile

DEVICE, HOST_DHA, HOST_CPU, HOST_SPLIT, HOST_STREAM = (
    cm.DEVICE, cm.HOST_DHA, cm.HOST_CPU, cm.HOST_SPLIT, cm.HOST_STREAM)
NUM_BUCKETS = 1024
# Stages with more choosable parameters than this consider, per host placement, only "the j
# largest parameters" for each j (instead of every subset).
MAX_ENUMERATED = 4
MAX_LEVELS = 64


@dataclasses.dataclass(frozen=True, kw_only=True)
class ParamItem:
  """A parameter leaf the solver may place.

  Attributes:
    index: state leaf index.
    path: its pytree path (for reasons).
    nbytes: its bytes per device.
    grad_nbytes: its gradient's bytes per device (freed on the device when it lives on the
      host: the gradient goes down layer by layer).
    stage: the key of its stage (a stack of layers, or one layer) in the layer sequence.
    stage_order: position of the stage in the sequence.
    num_layers: layers in the stage (a stacked leaf's leading axis; 1 otherwise).
    compute_secs: its share of the step's compute, seconds (forward + backward).
    options: placements allowed: a subset of ('device', 'host_stream', 'host_dha'); one option
      when the user's policy fixed it.
    update: index into `Problem.updates` of the call that updates it (None: none).
  """

  index: int
  path: str
  nbytes: int
  grad_nbytes: int
  stage: str
  stage_order: int
  num_layers: int
  compute_secs: float
  options: tuple[str, ...] = (DEVICE,)
  update: "int | None" = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateItem:
  """The optimizer-state leaves of one fused host-update call.

  Attributes:
    seeds: their state leaf indices.
    label: a path naming them (for reasons).
    device_nbytes: their bytes when they stay on the device.
    pinned_nbytes: pinned host bytes when on the host (fp32 masters included).
    costs: {executor: cm.Cost} for each host executor allowed.
    fixed: an executor (or 'device') the user's policy fixed, else None.
    result_nbytes: device bytes of the results it writes to the device (new params): a fresh
      buffer while the old param is still read, so the step's peak holds one more.
  """

  seeds: tuple[int, ...]
  label: str
  device_nbytes: int
  pinned_nbytes: int
  costs: Mapping[str, cm.Cost]
  fixed: "str | None" = None
  result_nbytes: int = 0

  def best(self) -> tuple[str, cm.Cost]:
    """(executor, cost) of the fastest allowed host executor."""
    if self.fixed and self.fixed != DEVICE:
      return self.fixed, self.costs[self.fixed]
    name = min(self.costs, key=lambda e: (self.costs[e].secs, e))
    return name, self.costs[name]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Problem:
  """Everything the solver weighs.

  Attributes:
    params, updates: the decision units.
    fixed_device_bytes: state bytes on the device whatever the solver does (step counts, keys,
      leaves the user placed on the device, `host_xla` leaves: XLA copies them in for the step).
    fixed_pinned_bytes: pinned bytes whatever the solver does (leaves the user placed on host).
    fixed_costs: costs of leaves placed by the user (host_xla copies), added to the step.
    transient_bytes: device bytes at the peak beyond the state, with every gradient on the
      device and the traced activation policy (less the gradients of parameters already
      placed off the device outside `params`: they never sit whole on the device).
    fixed_buffer_bytes: the double buffers (layer weights and gradients, x 2) of parameters
      already placed `host_stream` outside `params` (0 if none).
    update_credit: transient device bytes freed per device byte of an `UpdateItem` on the
      host (`cm.StepCosts.update_credit`; 0: none assumed). At most the transient bytes
      beyond the gradients are freed in all.
    other_compute_secs: compute outside the parameters' stages, seconds.
    layer_flops_secs: seconds of compute the parameters' stages hold (sum of their
      compute_secs; the activation policy's extra FLOPs scale them).
    activations: the model's activation options (None: keep the traced policy).
    device_budget, host_budget: per device, bytes (None: no limit).
    profile, platform: rates, and 'gpu' / 'cpu'.
  """

  params: tuple[ParamItem, ...]
  updates: tuple[UpdateItem, ...]
  fixed_device_bytes: int
  fixed_pinned_bytes: int
  fixed_costs: tuple[cm.Cost, ...] = ()
  transient_bytes: int
  fixed_buffer_bytes: int = 0
  update_credit: float = 0.0
  other_compute_secs: float
  activations: "cm.ActivationModel | None" = None
  device_budget: "int | None" = None
  host_budget: "int | None" = None
  profile: HardwareProfile
  platform: str = "gpu"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Solution:
  """The solver's answer.

  Attributes:
    params: {leaf index: 'device' | 'host_stream' | 'host_dha'}.
    updates: {update item index: 'device' | executor}.
    activation_policy: 'keep' / 'remat' / 'offload', or None (the traced one, unmodelled).
    prediction: the predicted step.
    fits: whether the prediction is within both budgets.
    device_free_bytes: budget minus predicted peak (None without a budget).
  """

  params: Mapping[int, str]
  updates: Mapping[int, str]
  activation_policy: "str | None"
  prediction: cm.Prediction
  fits: bool
  device_free_bytes: "int | None"


def _stages(params: Sequence[ParamItem]) -> list[list[ParamItem]]:
  groups: dict[str, list[ParamItem]] = {}
  for p in sorted(params, key=lambda p: (p.stage_order, p.stage, p.index)):
    groups.setdefault(p.stage, []).append(p)
  return list(groups.values())


def _stage_options(stage: list[ParamItem]) -> list[dict[int, str]]:
  """Candidate assignments {leaf index: placement} for one stage's parameters."""
  free = [p for p in stage if len(p.options) > 1]
  fixed = {p.index: p.options[0] for p in stage if len(p.options) == 1}
  if len(free) <= MAX_ENUMERATED:
    out = []
    for combo in itertools.product(*[p.options for p in free]):
      out.append({**fixed, **{p.index: c for p, c in zip(free, combo)}})
    return out
  out = [{**fixed, **{p.index: DEVICE for p in free}}]
  for host in (HOST_STREAM, HOST_DHA):
    eligible = sorted((p for p in free if host in p.options), key=lambda p: -p.nbytes)
    for j in range(1, len(eligible) + 1):
      chosen = {p.index for p in eligible[:j]}
      out.append({**fixed, **{p.index: (host if p.index in chosen else DEVICE) for p in free}})
  return out


def _stage_cost(stage: list[ParamItem], assign: Mapping[int, str], *, scale: float,
                act_offload_bytes: float, profile: HardwareProfile) -> cm.Cost:
  compute = scale * sum(p.compute_secs for p in stage)
  layers = max(p.num_layers for p in stage)
  fetch = sum(p.nbytes for p in stage if assign[p.index] == HOST_STREAM)
  grads = sum(p.grad_nbytes for p in stage if assign[p.index] == HOST_STREAM)
  dha_r = sum(p.nbytes for p in stage if assign[p.index] == HOST_DHA)
  dha_w = sum(p.grad_nbytes for p in stage if assign[p.index] == HOST_DHA)
  return cm.stream_stage(compute_secs=compute, num_layers=layers, fetch_bytes=fetch,
                         grad_bytes=grads, dha_read_bytes=dha_r, dha_write_bytes=dha_w,
                         act_offload_bytes=act_offload_bytes, profile=profile)


def _evaluate(problem: Problem, host_updates: frozenset[int], act: "cm.ActivationChoice | None",
              allow_host_params: bool) -> "Solution | None":
  """Best parameter placements given the optimizer items on the host and the activation policy."""
  prof = problem.profile
  stages = _stages(problem.params)
  total_layer = sum(p.compute_secs for p in problem.params)
  extra_secs = (act.extra_flops / (prof.matmul_tflops * 1e12)) if act else 0.0
  scale = (total_layer + extra_secs) / total_layer if total_layer > 0 else 1.0
  other_compute = problem.other_compute_secs + (extra_secs if total_layer <= 0 else 0.0)
  act_delta = act.device_delta_bytes if act else 0
  act_offload = act.offload_bytes if act else 0
  updates = problem.updates
  tied = {p.update for p in problem.params if p.update is not None}

  # Device bytes that do not depend on the parameters' placements.
  base = problem.fixed_device_bytes + problem.transient_bytes + act_delta
  base -= sum(p.grad_nbytes for p in problem.params)  # re-added per parameter below
  for u, item in enumerate(updates):
    if u not in host_updates and u not in tied:
      base += item.device_nbytes
  # The update temporaries of the items on the host (the knapsack counts only these: a
  # parameter's choice may send its own item to the host too, credited after it).
  credit_cap = max(0, problem.transient_bytes - sum(p.grad_nbytes for p in problem.params))

  def credit(on_host) -> int:
    if problem.update_credit <= 0:
      return 0
    freed = problem.update_credit * sum(updates[u].device_nbytes for u in on_host)
    return int(min(credit_cap, freed))
  base -= credit(host_updates)
  any_host_param = allow_host_params and any(len(p.options) > 1 or p.options[0] != DEVICE
                                             for p in problem.params)
  buffers = problem.fixed_buffer_bytes
  if any_host_param:
    # Double buffers of the largest layer that may be fetched: params + gradients, x 2.
    buffers = max([2 * (p.nbytes + p.grad_nbytes) // max(1, p.num_layers)
                   for p in problem.params if set(p.options) - {DEVICE}] + [buffers])

  # One DP item per stage: (weight bytes, cost, extra update secs, assignment) per option.
  stage_opts: list[list[tuple[int, cm.Cost, dict[int, str], frozenset[int]]]] = []
  for stage in stages:
    share = sum(p.compute_secs for p in stage) / total_layer if total_layer > 0 else 0.0
    opts = []
    free = {p.index for p in stage if len(p.options) > 1}
    for assign in _stage_options(stage):
      if not allow_host_params and any(assign[i] != DEVICE for i in free):
        continue
      weight = 0
      forced: set[int] = set()
      for p in stage:
        upd_on_device = p.update is not None and p.update not in host_updates
        if assign[p.index] == DEVICE:
          weight += p.nbytes + p.grad_nbytes
          if upd_on_device:
            weight += updates[p.update].device_nbytes
        elif p.update is not None and p.update not in host_updates:
          forced.add(p.update)
      cost = _stage_cost(stage, assign, scale=scale, act_offload_bytes=act_offload * share,
                         profile=prof)
      opts.append((weight, cost, assign, frozenset(forced)))
    if not opts:
      return None
    stage_opts.append(opts)

  budget = problem.device_budget
  capacity = None if budget is None else budget - base - buffers

  def option_secs(opt) -> float:
    return opt[1].secs + sum(updates[u].best()[1].secs for u in opt[3])

  if capacity is None:
    chosen = [min(opts, key=option_secs) for opts in stage_opts]
  else:
    if capacity < 0:
      return None
    chosen = _knapsack(stage_opts, capacity, option_secs)
    if chosen is None:
      return None

  params = {}
  for opt in chosen:
    params.update(opt[2])
  forced = set().union(*[opt[3] for opt in chosen]) if chosen else set()
  on_host = set(host_updates) | forced
  used = sum(opt[0] for opt in chosen)
  streamed = any(v != DEVICE for v in params.values()) or problem.fixed_buffer_bytes > 0
  # The host updates run one after another after the backward pass; each writes its new
  # device params to a fresh buffer while the old ones are still alive: the largest counts.
  # A parameter placed off the device is updated in place on the host: no device buffer.
  off_device = {}
  for p in problem.params:
    if p.update is not None and params.get(p.index, DEVICE) != DEVICE:
      off_device[p.update] = off_device.get(p.update, 0) + p.nbytes
  results = max((max(0, updates[u].result_nbytes - off_device.get(u, 0)) for u in on_host),
                default=0)
  peak = base + used + (buffers if streamed else 0) + results
  peak -= credit(on_host) - credit(host_updates)
  pinned = problem.fixed_pinned_bytes + sum(updates[u].pinned_nbytes for u in on_host)
  pinned += sum(p.nbytes for p in problem.params if params[p.index] != DEVICE)
  layers = sum((opt[1] for opt in chosen), cm.ZERO)
  update_costs = [updates[u].best()[1] for u in sorted(on_host)]
  pred = cm.predict(layers=layers, layer_compute_secs=total_layer * scale,
                    other_compute_secs=other_compute, updates=update_costs,
                    xla_copies=problem.fixed_costs, peak_hbm_bytes=peak, pinned_bytes=pinned,
                    profile=prof)
  fits = (budget is None or peak <= budget) and (
      problem.host_budget is None or pinned <= problem.host_budget)
  upd = {u: (updates[u].best()[0] if u in on_host else DEVICE) for u in range(len(updates))}
  return Solution(params=params, updates=upd, activation_policy=act.policy if act else None,
                  prediction=pred, fits=fits,
                  device_free_bytes=None if budget is None else int(budget - peak))


def _knapsack(stage_opts, capacity: int, secs_of) -> "list | None":
  """Min total seconds over stages, one option each, total weight <= capacity (bytes).

  Weights are discretised into buckets of capacity / NUM_BUCKETS bytes: first rounded to the
  nearest bucket (an exact fit stays feasible); if the choice's exact bytes exceed the
  capacity, again rounded up (never under-counted).
  """
  for rounding in (round, math.ceil):
    chosen = _knapsack_rounded(stage_opts, capacity, secs_of, rounding)
    if chosen is not None and sum(opt[0] for opt in chosen) <= capacity:
      return chosen
  return None


def _knapsack_rounded(stage_opts, capacity: int, secs_of, rounding) -> "list | None":
  unit = max(1.0, capacity / NUM_BUCKETS)
  nb = int(math.floor(capacity / unit))
  inf = math.inf
  dp = np.full(nb + 1, inf)
  dp[0] = 0.0
  choice = []
  for opts in stage_opts:
    new = np.full(nb + 1, inf)
    arg = np.full(nb + 1, -1, np.int64)
    for k, opt in enumerate(opts):
      w = int(rounding(opt[0] / unit)) if opt[0] > 0 else 0
      if w > nb:
        continue
      cand = np.full(nb + 1, inf)
      cand[w:] = dp[:nb + 1 - w] + secs_of(opt)
      better = cand < new
      new[better] = cand[better]
      arg[better] = k
    dp = new
    choice.append(arg)
    if not np.isfinite(dp).any():
      return None
  end = int(np.argmin(dp))
  if not np.isfinite(dp[end]):
    return None
  out = []
  for s in range(len(stage_opts) - 1, -1, -1):
    k = int(choice[s][end])
    opt = stage_opts[s][k]
    out.append(opt)
    w = int(rounding(opt[0] / unit)) if opt[0] > 0 else 0
    end -= w
  return out[::-1]


def solve(problem: Problem) -> Solution:
  """Minimises the predicted step time under the device and host budgets.

  Returns:
    The fastest `Solution` that fits; when none fits, the rule-based plan (every movable
    optimizer-state item on the host, parameters on the device, the traced activation policy)
    with `fits=False`.
  """
  updates = problem.updates
  fixed_host = frozenset(u for u, it in enumerate(updates) if it.fixed and it.fixed != DEVICE)
  movable = [u for u, it in enumerate(updates) if not it.fixed]
  # Greedy knapsack order: least seconds added per device byte freed first.
  movable.sort(key=lambda u: (updates[u].best()[1].secs / max(1, updates[u].device_nbytes), u))
  levels = range(len(movable) + 1)
  if len(movable) > MAX_LEVELS:
    levels = sorted(set(np.linspace(0, len(movable), MAX_LEVELS + 1).astype(int).tolist()))
  acts: list["cm.ActivationChoice | None"] = [None]
  if problem.activations is not None:
    acts = list(cm.activation_choices(problem.activations).values())
  best: "Solution | None" = None
  for act in acts:
    for k in levels:
      host = fixed_host | frozenset(movable[:k])
      for allow in (False, True):
        sol = _evaluate(problem, host, act, allow)
        if sol is None or not sol.fits:
          continue
        key = (sol.prediction.step_secs, sol.prediction.pinned_bytes)
        if best is None or key < (best.prediction.step_secs, best.prediction.pinned_bytes):
          best = sol
  if best is not None:
    return best
  return rule_based(problem)


def rule_based(problem: Problem) -> Solution:
  """Every movable optimizer-state item on the host (fastest executor), parameters on the
  device, the traced activation policy: the plan of policy 'optimizer_state_on_host'."""
  act = None
  if problem.activations is not None:
    act = cm.activation_choices(problem.activations)[problem.activations.traced]
  unlimited = dataclasses.replace(problem, device_budget=None, host_budget=None)
  host = frozenset(u for u, it in enumerate(problem.updates) if it.fixed != DEVICE)
  sol = _evaluate(unlimited, host, act, False)
  budget = problem.device_budget
  pred = sol.prediction
  fits = (budget is None or pred.peak_hbm_bytes <= budget) and (
      problem.host_budget is None or pred.pinned_bytes <= problem.host_budget)
  return dataclasses.replace(sol, fits=fits, device_free_bytes=None if budget is None else int(
      budget - pred.peak_hbm_bytes))


# ---- building the problem from a traced step ----------------------------------------------------

_LAYER_INDEX = re.compile(r"^(.*?(?:\[|_|\.|/)(\d+)\]?)")


def stage_key(path: str) -> "tuple[str, int] | None":
  """(stage key, layer number) of a leaf path naming a numbered layer, else None.

  The key is the path up to its first number (`['params']['layers_3']`, `.blocks[3]`,
  `['h'][3]`); leaves with the same key belong to the same layer.
  """
  m = _LAYER_INDEX.match(path)
  return (m.group(1), int(m.group(2))) if m else None


def update_traffic(cc: Any, leaves: Sequence[Any], master_nbytes: Mapping[int, int]
                   ) -> cm.UpdateTraffic:
  """The bytes one compiled host-update call moves, per device.

  Host operands (state leaves, fp32 masters) are read from pinned_host; results that alias
  them are written back there; other operands (gradients, device params) are device reads and
  other results (new params) device writes. Sizes per device: the global sizes scaled by the
  component's first leaf's shard fraction.
  """
  seed = leaves[cc.component.seeds[0]]
  global_bytes = int(np.prod(seed.shape, dtype=np.int64)) * _itemsize(seed.dtype)
  frac = seed.nbytes / global_bytes if global_bytes else 1.0
  read = write = dev_in = dev_out = 0.0
  for spec in cc.operands:
    if spec.kind == "host":
      read += leaves[spec.index].nbytes
    elif spec.kind == "master":
      read += master_nbytes.get(spec.index, 0)
    elif spec.kind == "value" and spec.var is not None:
      aval = spec.var.aval
      n = int(np.prod(aval.shape, dtype=np.int64))
      if n > 1:
        dev_in += n * _itemsize(aval.dtype) * frac
  for r in cc.results:
    nbytes = int(np.prod(r.shape, dtype=np.int64)) * np.dtype(r.dtype).itemsize * frac
    if r.alias >= 0:
      write += nbytes
    else:
      dev_out += nbytes
  elements = int(np.prod(seed.shape, dtype=np.int64) * frac)
  return cm.UpdateTraffic(host_read_bytes=int(read), host_write_bytes=int(write),
                          device_in_bytes=int(dev_in), device_out_bytes=int(dev_out),
                          elements=elements)


def _itemsize(dtype: Any) -> int:
  try:
    return np.dtype(dtype).itemsize
  except TypeError:
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    return jnp.dtype(dtype).itemsize


def host_executors(platform: str) -> tuple[str, ...]:
  """The host-update executors a plan may choose on `platform`."""
  return (HOST_DHA, HOST_CPU, HOST_SPLIT) if platform == "gpu" else (HOST_CPU,)


def build_problem(*, leaves: Sequence[Any], jaxpr: Any, compiled: Sequence[Any],
                  master_nbytes: Mapping[int, int], placement: Mapping[int, str],
                  user_fixed: set[int], param_role: str, step_costs: cm.StepCosts,
                  streamable: frozenset[int] = frozenset(),
                  dha_readable: frozenset[int] = frozenset(),
                  activations: "cm.ActivationModel | None" = None,
                  device_budget: "int | None", host_budget: "int | None",
                  profile: HardwareProfile, platform: str) -> Problem:
  """The solver's `Problem` for a traced step, from the planner's first cut.

  Args:
    leaves: the inventory's `LeafInfo`s (bytes per device).
    jaxpr: the traced step's (open) jaxpr; its first invars are the state leaves.
    compiled: the `CompiledComponent`s of the cut with every candidate optimizer-state leaf
      on the host (one `UpdateItem` each).
    master_nbytes: {param leaf index: bytes of its fp32 master} for that cut.
    placement: {leaf index: placement} of that cut (host_xla for leaves whose update is not
      one elementwise pass).
    user_fixed: leaf indices the user's policy placed (not the solver's to move).
    param_role: the inventory's role name of parameters.
    step_costs: FLOPs and transient bytes of the device-only step, per device.
    streamable, dha_readable: parameter leaves that may be `host_stream` / `host_dha`.
    activations: the model's activation options, or None.
    device_budget, host_budget: per device, bytes (None: no limit).
    profile, platform: the rates and 'gpu' / 'cpu'.
  """
  executors = host_executors(platform)
  seeded: dict[int, int] = {}
  updates: list[UpdateItem] = []
  for u, cc in enumerate(compiled):
    seeds = tuple(cc.component.seeds)
    traffic = update_traffic(cc, leaves, master_nbytes)
    ms = sum(master_nbytes.get(r.master, 0) for r in cc.results if r.master >= 0)
    fixed = None
    if any(i in user_fixed for i in seeds):
      # The call's executor (a call of host_stream leaves has one too: the cut's choice).
      fixed = {"split": "host_split"}.get(cc.executor, cc.executor)
    names = executors + ((fixed,) if fixed is not None and fixed not in executors else ())
    costs = {e: cm.update_cost(e, traffic, profile, platform=platform) for e in names}
    updates.append(UpdateItem(
        seeds=seeds, label=leaves[seeds[0]].path, device_nbytes=sum(leaves[i].nbytes
                                                                   for i in seeds),
        pinned_nbytes=sum(leaves[i].nbytes for i in seeds) + ms, costs=costs, fixed=fixed,
        result_nbytes=traffic.device_out_bytes))
    for i in seeds:
      seeded[i] = u
  update_of_param: dict[int, int] = {}
  for u, cc in enumerate(compiled):
    for j in cc.component.outputs:
      if j < len(leaves) and leaves[j].role == param_role and j not in seeded:
        update_of_param.setdefault(j, u)

  first_use: dict[Any, int] = {}
  for k, eqn in enumerate(jaxpr.eqns):
    for v in eqn.invars:
      if not isinstance(v, jc.Literal):
        first_use.setdefault(v, k)
  stacked = cm.stacked_layers(jaxpr, len(leaves))
  params = [l for l in leaves if l.role == param_role and l.index not in user_fixed
            and l.index not in seeded and l.is_float
            and placement.get(l.index) in (DEVICE, HOST_STREAM, HOST_DHA)]
  total = step_costs.compute_secs(profile)
  elements = sum(int(np.prod(l.shape, dtype=np.int64)) for l in params)
  items = []
  for l in params:
    n = int(np.prod(l.shape, dtype=np.int64))
    if l.index in stacked:
      k, length = stacked[l.index]
      key, order, layers = f"scan@{k}", k, length
    else:
      sk = stage_key(l.path)
      key = sk[0] if sk else l.path
      order = first_use.get(jaxpr.invars[l.index], len(jaxpr.eqns))
      layers = 1
    opts = [DEVICE]
    if placement.get(l.index) in (HOST_STREAM, HOST_DHA):
      opts = [placement[l.index]]  # already placed (re-evaluating a plan)
    else:
      if l.index in streamable:
        opts.append(HOST_STREAM)
      if l.index in dha_readable:
        opts.append(HOST_DHA)
    items.append(ParamItem(index=l.index, path=l.path, nbytes=l.nbytes, grad_nbytes=l.nbytes,
                           stage=key, stage_order=order, num_layers=layers,
                           compute_secs=total * n / elements if elements else 0.0,
                           options=tuple(opts), update=update_of_param.get(l.index)))
  # A stage's order is that of its earliest member.
  order_of: dict[str, int] = {}
  for p in items:
    order_of[p.stage] = min(order_of.get(p.stage, p.stage_order), p.stage_order)
  items = [dataclasses.replace(p, stage_order=order_of[p.stage]) for p in items]

  in_items = {p.index for p in items} | set(seeded)
  fixed_device = fixed_pinned = 0
  fixed_costs = []
  grads = 0
  for l in leaves:
    if l.role == param_role and l.is_float:
      grads += l.nbytes
    if l.index in in_items:
      continue
    p = placement.get(l.index, DEVICE)
    if p == DEVICE:
      fixed_device += l.nbytes
    elif p == cm.HOST_XLA:
      # On the device during the step (XLA copies it in), pinned between steps.
      fixed_device += l.nbytes
      fixed_pinned += l.nbytes
      fixed_costs.append(cm.xla_copy_cost(l.nbytes, profile, platform=platform))
    else:
      fixed_pinned += l.nbytes
  transient = max(int(step_costs.transient_bytes), grads)
  # Parameters already streamed (or read zero-copy) whose update call the cut seeded with them
  # are not decision units, but they still hold no gradient on the device (it goes down layer
  # by layer) and a streamed one has its layers double-buffered: as `_evaluate` counts a
  # streamed ParamItem, so that a plan re-evaluated after its cut predicts what the search did.
  placed_off = [l for l in leaves if l.role == param_role and l.is_float and l.index in seeded
                and placement.get(l.index) in (HOST_STREAM, HOST_DHA)]
  transient -= sum(l.nbytes for l in placed_off)
  fixed_buffers = max((4 * l.nbytes // max(1, stacked.get(l.index, (0, 1))[1])
                       for l in placed_off if placement.get(l.index) == HOST_STREAM), default=0)
  return Problem(params=tuple(items), updates=tuple(updates), fixed_device_bytes=fixed_device,
                 fixed_pinned_bytes=fixed_pinned, fixed_costs=tuple(fixed_costs),
                 transient_bytes=transient, fixed_buffer_bytes=fixed_buffers,
                 update_credit=float(step_costs.update_credit),
                 other_compute_secs=0.0 if elements else total, activations=activations,
                 device_budget=device_budget, host_budget=host_budget, profile=profile,
                 platform=platform)


def evaluate_fixed(problem: Problem, params: Mapping[int, str], host_updates: Mapping[int, str],
                   activation: "str | None" = None) -> Solution:
  """The prediction for given placements (an explicit policy's plan), budgets not enforced."""
  fixed_params = tuple(dataclasses.replace(p, options=(params.get(p.index, DEVICE),))
                       for p in problem.params)
  fixed_updates = tuple(dataclasses.replace(it, fixed=host_updates.get(u, DEVICE))
                        for u, it in enumerate(problem.updates))
  prob = dataclasses.replace(problem, params=fixed_params, updates=fixed_updates,
                             device_budget=None, host_budget=None)
  act = None
  if problem.activations is not None:
    act = cm.activation_choices(problem.activations)[activation or problem.activations.traced]
  host = frozenset(u for u, e in host_updates.items() if e != DEVICE)
  sol = _evaluate(prob, host, act, True)
  budget = problem.device_budget
  fits = (budget is None or sol.prediction.peak_hbm_bytes <= budget) and (
      problem.host_budget is None or sol.prediction.pinned_bytes <= problem.host_budget)
  return dataclasses.replace(sol, fits=fits, device_free_bytes=None if budget is None else int(
      budget - sol.prediction.peak_hbm_bytes))
