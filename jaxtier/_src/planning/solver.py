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
from typing import Mapping, Sequence

import numpy as np

from jaxtier._src.analysis import update_schedule
from jaxtier._src.hardware.profile import HardwareProfile
from jaxtier._src.planning import cost_model, placements
from jaxtier._src.planning.problem import ParamItem, Problem
from jaxtier._src.vocab import Placement

NUM_BUCKETS = 1024
# Stages with more choosable parameters than this consider, per host placement, only "the j
# largest parameters" for each j (instead of every subset).
MAX_ENUMERATED = 4
MAX_LEVELS = 64


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
  prediction: cost_model.Prediction
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
  out = [{**fixed, **{p.index: Placement.DEVICE for p in free}}]
  for host in placements.PARAM_PLACEMENTS:
    if not placements.record(host).on_host:
      continue
    eligible = sorted((p for p in free if host in p.options), key=lambda p: -p.nbytes)
    for j in range(1, len(eligible) + 1):
      chosen = {p.index for p in eligible[:j]}
      out.append({
          **fixed,
          **{
              p.index: (host if p.index in chosen else Placement.DEVICE) for p in free
          }
      })
  return out


def _stage_cost(stage: list[ParamItem], assign: Mapping[int, str], *, scale: float,
                act_offload_bytes: float, profile: HardwareProfile) -> cost_model.Cost:
  compute = scale * sum(p.compute_secs for p in stage)
  layers = max(p.num_layers for p in stage)
  # Each parameter's traffic, as its placement's record charges it.
  traffic = [placements.record(assign[p.index]).traffic(p) for p in stage]
  return cost_model.stream_stage(
      compute_secs=compute, num_layers=layers,
      fetch_bytes=sum(t.fetch_bytes for t in traffic),
      grad_bytes=sum(t.grad_bytes for t in traffic),
      dha_read_bytes=sum(t.dha_read_bytes for t in traffic),
      dha_write_bytes=sum(t.dha_write_bytes for t in traffic),
      act_offload_bytes=act_offload_bytes, profile=profile)


def _evaluate(problem: Problem, host_updates: frozenset[int],
              act: "cost_model.ActivationChoice | None",
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
  any_host_param = allow_host_params and any(len(p.options) > 1 or p.options[0] != Placement.DEVICE
                                             for p in problem.params)
  buffers = problem.fixed_buffer_bytes
  if any_host_param:
    # The largest buffers a parameter may hold on the device while its stage runs, as its
    # placements' records say (a streamed layer's double buffers, a table's gathered rows).
    buffers = max([placements.record(o).buffers(p) for p in problem.params for o in p.options
                   if placements.record(o).on_host] + [buffers])

  # One DP item per stage: (weight bytes, cost, extra update secs, assignment) per option.
  stage_opts: list[list[tuple[int, cost_model.Cost, dict[int, str], frozenset[int]]]] = []
  for stage in stages:
    share = sum(p.compute_secs for p in stage) / total_layer if total_layer > 0 else 0.0
    opts = []
    free = {p.index for p in stage if len(p.options) > 1}
    for assign in _stage_options(stage):
      if not allow_host_params and any(assign[i] != Placement.DEVICE for i in free):
        continue
      weight = 0
      forced: set[int] = set()
      for p in stage:
        upd_on_device = p.update is not None and p.update not in host_updates
        if assign[p.index] == Placement.DEVICE:
          # On a GPU a layered host update frees each layer's gradient a few layers after
          # reading it. A CPU plan counts it whole: XLA:CPU's schedule makes every slice of the
          # stacked params at the start of the unrolled backward pass, as many bytes.
          weight += p.nbytes + (
              p.grad_nbytes if p.update is None or upd_on_device or problem.platform != "gpu"
              else int(p.grad_nbytes
                       * update_schedule.held_gradient_share(updates[p.update].num_layers)))
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
    # A table read in place is updated row by row: the rows its ids name after the backward
    # pass, the others hidden under the step's compute.
    return opt[1].secs + sum(
        updates[u].rows_cost().secs * updates[u].table[1]
        if updates[u].by_rows(opt[2])
        else updates[u].best()[1].secs for u in opt[3])

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
  streamed = any(v != Placement.DEVICE for v in params.values()) or problem.fixed_buffer_bytes > 0
  # The host updates run one after another after the backward pass; each writes its new
  # device params to a fresh buffer while the old ones are still alive: the largest counts.
  # A parameter placed off the device is updated in place on the host: no device buffer.
  off_device = {}
  for p in problem.params:
    if p.update is not None and params.get(p.index, Placement.DEVICE) != Placement.DEVICE:
      off_device[p.update] = off_device.get(p.update, 0) + p.nbytes
  results = max((max(0, updates[u].result_nbytes - off_device.get(u, 0)) for u in on_host),
                default=0)
  peak = base + used + (buffers if streamed else 0) + results
  peak -= credit(on_host) - credit(host_updates)
  pinned = problem.fixed_pinned_bytes + sum(updates[u].pinned_nbytes for u in on_host)
  pinned += sum(cost_model.placed_pinned_bytes(params[p.index], p.nbytes, p.stream_grad_nbytes)
                for p in problem.params if params[p.index] != Placement.DEVICE)
  layers = sum((opt[1] for opt in chosen), cost_model.ZERO)
  by_rows = {u for u in on_host if updates[u].by_rows(params)}
  update_costs = [updates[u].best()[1] for u in sorted(on_host)
                  if not updates[u].num_layers and u not in by_rows]
  overlapped = [(updates[u].best()[1], updates[u].num_layers) for u in sorted(on_host)
                if updates[u].num_layers]
  rows = [(updates[u].rows_cost(), updates[u].table[1]) for u in sorted(by_rows)]
  pred = cost_model.predict(layers=layers, layer_compute_secs=total_layer * scale,
                    other_compute_secs=other_compute, updates=update_costs,
                    overlapped=overlapped, rows=rows, backward_share=problem.backward_share,
                    sent_lag_layers=int(problem.fixed_buffer_bytes > 0 or any(
                        placements.streamed(v) for v in params.values())),
                    xla_copies=problem.fixed_costs, peak_hbm_bytes=peak, pinned_bytes=pinned,
                    profile=prof)
  fits = (budget is None or peak <= budget) and (
      problem.host_budget is None or pinned <= problem.host_budget)
  upd = {
      u: ((Placement.HOST_CPU if u in by_rows and Placement.HOST_CPU in updates[u].costs
           else updates[u].best()[0]) if u in on_host else Placement.DEVICE)
      for u in range(len(updates))
  }
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
  fixed_host = frozenset(
      u for u, it in enumerate(updates) if it.fixed and it.fixed != Placement.DEVICE)
  movable = [u for u, it in enumerate(updates) if not it.fixed]
  # Greedy knapsack order: least seconds added per device byte freed first.
  movable.sort(key=lambda u: (updates[u].best()[1].secs / max(1, updates[u].device_nbytes), u))
  levels = range(len(movable) + 1)
  if len(movable) > MAX_LEVELS:
    levels = sorted(set(np.linspace(0, len(movable), MAX_LEVELS + 1).astype(int).tolist()))
  acts: list["cost_model.ActivationChoice | None"] = [None]
  if problem.activations is not None:
    acts = list(cost_model.activation_choices(problem.activations).values())
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
    act = cost_model.activation_choices(problem.activations)[problem.activations.traced]
  unlimited = dataclasses.replace(problem, device_budget=None, host_budget=None)
  host = frozenset(u for u, it in enumerate(problem.updates) if it.fixed != Placement.DEVICE)
  sol = _evaluate(unlimited, host, act, False)
  budget = problem.device_budget
  pred = sol.prediction
  fits = (budget is None or pred.peak_hbm_bytes <= budget) and (
      problem.host_budget is None or pred.pinned_bytes <= problem.host_budget)
  return dataclasses.replace(sol, fits=fits, device_free_bytes=None if budget is None else int(
      budget - pred.peak_hbm_bytes))


# ---- building the problem from a traced step ----------------------------------------------------


def evaluate_fixed(problem: Problem, params: Mapping[int, str], host_updates: Mapping[int, str],
                   activation: "str | None" = None) -> Solution:
  """The prediction for given placements (an explicit policy's plan), budgets not enforced."""
  fixed_params = tuple(dataclasses.replace(p, options=(params.get(p.index, Placement.DEVICE),))
                       for p in problem.params)
  fixed_updates = tuple(dataclasses.replace(it, fixed=host_updates.get(u, Placement.DEVICE))
                        for u, it in enumerate(problem.updates))
  prob = dataclasses.replace(problem, params=fixed_params, updates=fixed_updates,
                             device_budget=None, host_budget=None)
  act = None
  if problem.activations is not None:
    act = cost_model.activation_choices(problem.activations)[activation or
                                                             problem.activations.traced]
  host = frozenset(u for u, e in host_updates.items() if e != Placement.DEVICE)
  sol = _evaluate(prob, host, act, True)
  budget = problem.device_budget
  fits = (budget is None or sol.prediction.peak_hbm_bytes <= budget) and (
      problem.host_budget is None or sol.prediction.pinned_bytes <= problem.host_budget)
  return dataclasses.replace(sol, fits=fits, device_free_bytes=None if budget is None else int(
      budget - sol.prediction.peak_hbm_bytes))
