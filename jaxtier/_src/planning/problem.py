"""The planning problem: items (params, fused updates) with their costs per placement."""

from __future__ import annotations

import dataclasses
import functools
import operator
import re
from typing import Any, Mapping, Sequence

import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import jaxpr_graph
from jaxtier._src.analysis import layer_stacks
from jaxtier._src.analysis import op_program_compiler
from jaxtier._src.analysis import step_costs as step_costs_lib
from jaxtier._src.analysis import update_schedule
from jaxtier._src.hardware.profile import HardwareProfile
from jaxtier._src.planning import cost_model
from jaxtier._src.planning import placements
from jaxtier._src.planning.placements import Schedule, schedule_of, served
from jaxtier._src.vocab import Placement


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
    dha_nbytes: bytes the zero-copy path moves per step each way when it is `host_dha`: the
      rows an embedding lookup gathers (and their gradient rows, sent down); None: the whole
      leaf is read (a weight multiplied in place).
    sent_grad_nbytes: its gradient's bytes sent down and held in pinned_host per step when it
      is `host_stream` (None: `grad_nbytes`; half of it where the gradient is a bf16 value
      widened and goes down in bf16, `lowering/streaming.py`).
  """

  index: int
  path: str
  nbytes: int
  grad_nbytes: int
  stage: str
  stage_order: int
  num_layers: int
  compute_secs: float
  options: tuple[str, ...] = (Placement.DEVICE,)
  update: "int | None" = None
  dha_nbytes: "int | None" = None
  sent_grad_nbytes: "int | None" = None

  @property
  def stream_grad_nbytes(self) -> int:
    """Gradient bytes sent down (and held in pinned_host) per step when placed `host_stream`."""
    return self.grad_nbytes if self.sent_grad_nbytes is None else self.sent_grad_nbytes

  @property
  def dha_read_nbytes(self) -> int:
    """Bytes read over the link per step when placed `host_dha`."""
    return self.nbytes if self.dha_nbytes is None else self.dha_nbytes

  @property
  def dha_write_nbytes(self) -> int:
    """Gradient bytes sent down per step when placed `host_dha`."""
    return self.grad_nbytes if self.dha_nbytes is None else self.dha_nbytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpdateItem:
  """The optimizer-state leaves of one fused host-update call.

  Attributes:
    seeds: their state leaf indices.
    label: a path naming them (for reasons).
    device_nbytes: their bytes when they stay on the device.
    pinned_nbytes: pinned host bytes when on the host (fp32 masters included).
    costs: {executor: cost_model.Cost} for each host executor allowed.
    fixed: an executor (or 'device') the user's policy fixed, else None.
    result_nbytes: device bytes of the results it writes to a fresh device buffer (new params
      its call cannot write over their old value, `fresh_result_bytes`): while the old
      param is still read the step's peak holds one more.
    num_layers: L where the update runs layer by layer inside the backward pass (one call per
      layer, each writing its window in place: `update_schedule.Mode.LAYERED`); 0 where it
      runs after it.
    table: (the table's param leaf, the fraction of its rows one step's ids name at most)
      where this is the update of an embedding table that, read in place (`host_dha`), is
      updated row by row on the host CPUs (`update_schedule.Mode.ROWS`): the other rows while
      the step computes, the named ones after its backward pass; where the table is not yet
      placed, the update of the table the solver may place so; None otherwise.
    table_fixed: the table is placed `host_dha` by the cut (the user's policy), not by the
      solver.
  """

  seeds: tuple[int, ...]
  label: str
  device_nbytes: int
  pinned_nbytes: int
  costs: Mapping[str, cost_model.Cost]
  fixed: "str | None" = None
  result_nbytes: int = 0
  num_layers: int = 0
  table: "tuple[int, float] | None" = None
  table_fixed: bool = False

  def by_rows(self, params: Mapping[int, str]) -> bool:
    """Whether it runs row by row under the solver's parameter placements `params`."""
    return self.table is not None and (
        self.table_fixed or params.get(self.table[0]) == Placement.HOST_DHA)

  def rows_cost(self) -> cost_model.Cost:
    """The cost of the row-by-row update of a table read in place (it runs on the host CPUs)."""
    return self.costs.get(Placement.HOST_CPU) or self.best()[1]

  def best(self) -> tuple[str, cost_model.Cost]:
    """(executor, cost) of the fastest allowed host executor; for a layered update, host_cpu
    or host_split (host_dha's kernel would take the GPU's SMs beside the compute for the
    whole update; `planner._layered_executor` then picks between the two)."""
    if self.fixed and self.fixed != Placement.DEVICE:
      return self.fixed, self.costs[self.fixed]
    names = [e for e in self.costs if not self.num_layers or e != Placement.HOST_DHA]
    name = min(names or self.costs, key=lambda e: (self.costs[e].secs, e))
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
      host (`step_costs.StepCosts.update_credit`; 0: none assumed). At most the transient bytes
      beyond the gradients are freed in all.
    other_compute_secs: compute outside the parameters' stages, seconds.
    backward_share: the backward pass's share of the layer stages' time: the timed scans'
      (`step_costs.TimedScans.backward_share`), else `cost_model.BACKWARD_SHARE`.
    layer_flops_secs: seconds of compute the parameters' stages hold (sum of their
      compute_secs; the activation policy's extra FLOPs scale them).
    activations: the model's activation options (None: keep the traced policy).
    device_budget, host_budget: per device, bytes (None: no limit).
    profile, platform: rates, and 'gpu' / 'cpu'.
    schedule: when each update runs under the placements the problem was built for, one
      `update_schedule.UpdateSchedule` per update (`update_schedule.decide`): its
      `num_layers` and `table` follow it.
  """

  params: tuple[ParamItem, ...]
  updates: tuple[UpdateItem, ...]
  fixed_device_bytes: int
  fixed_pinned_bytes: int
  fixed_costs: tuple[cost_model.Cost, ...] = ()
  transient_bytes: int
  fixed_buffer_bytes: int = 0
  update_credit: float = 0.0
  other_compute_secs: float
  backward_share: float = cost_model.BACKWARD_SHARE
  activations: "cost_model.ActivationModel | None" = None
  device_budget: "int | None" = None
  host_budget: "int | None" = None
  profile: HardwareProfile
  platform: str = "gpu"
  schedule: tuple[update_schedule.UpdateSchedule, ...] = ()


_LAYER_INDEX = re.compile(r"^(.*?(?:\[|_|\.|/)(\d+)\]?)")


def stage_key(path: str) -> "tuple[str, int] | None":
  """(stage key, layer number) of a leaf path naming a numbered layer, else None.

  The key is the path up to its first number (`['params']['layers_3']`, `.blocks[3]`,
  `['h'][3]`); leaves with the same key belong to the same layer.
  """
  m = _LAYER_INDEX.match(path)
  return (m.group(1), int(m.group(2))) if m else None


def update_traffic(cc: Any, leaves: Sequence[Any], master_nbytes: Mapping[int, int],
                   call: Any = None, on_host: "frozenset[int]" = frozenset(),
                   itemsizes: "Mapping[int, int] | None" = None) -> cost_model.UpdateTraffic:
  """The bytes one host-update call of `cc` moves, per device.

  `call` is one of `op_program_compiler.calls_of(cc)` (None: the whole component as one call).
  Host operands (state leaves, fp32 masters, and the operand positions `on_host`: gradients a
  streamed layer loop sends to pinned_host) are read from pinned_host; results that alias
  them are written back there; other operands (gradients, device params) are device reads and
  other results (new params) device writes. Sizes per device: the global sizes scaled by the
  component's first leaf's shard fraction. `itemsizes` gives the operand positions read in
  another dtype than their own (a gradient that is a bf16 value widened, passed in bf16).
  """
  seed = leaves[cc.component.seeds[0]]
  itemsizes = itemsizes or {}
  frac = _shard_fraction(cc, leaves)
  operands = range(len(cc.operands)) if call is None else call.operands
  results = range(len(cc.results)) if call is None else call.results
  read = write = dev_in = dev_out = 0.0
  for i in operands:
    spec = cc.operands[i]
    if spec.kind == "host":
      read += leaves[spec.index].nbytes
    elif spec.kind == "master":
      read += master_nbytes.get(spec.index, 0)
    elif spec.kind == "value" and spec.var is not None:
      aval = spec.var.aval
      n = int(np.prod(aval.shape, dtype=np.int64))
      size = itemsizes.get(i, _itemsize(aval.dtype))
      if i in on_host:
        read += n * size * frac
      elif n > 1:
        dev_in += n * size * frac
  for k in results:
    r = cc.results[k]
    nbytes = int(np.prod(r.shape, dtype=np.int64)) * np.dtype(r.dtype).itemsize * frac
    if op_program_compiler.is_host_result(cc, k):
      write += nbytes
    else:
      dev_out += nbytes
  elements = int(np.prod(seed.shape, dtype=np.int64) * frac)
  return cost_model.UpdateTraffic(host_read_bytes=int(read), host_write_bytes=int(write),
                          device_in_bytes=int(dev_in), device_out_bytes=int(dev_out),
                          elements=elements)


def _grad_itemsizes(scan: Any, grads: Mapping[int, int]) -> dict[int, int]:
  """{operand position: the itemsize its gradient is sent (streamed) or handed to a layered
  update in} for the gradients `grads` ({operand position: outvar position}) of the layer loop
  `scan`: bf16 where the gradient is a bf16 value widened (`jaxpr_graph.narrow_source_dtype`)."""
  return {p: _itemsize(jaxpr_graph.scan_ys_narrow_dtype(scan, j) or scan.outvars[j].aval.dtype)
          for p, j in grads.items()}


def _streams(scan: Any, jaxpr: Any, placement: Mapping[int, str]) -> bool:
  """Whether the top-level `scan` reads a `host_stream` state leaf."""
  streamed = {jaxpr.invars[i] for i, p in placement.items() if placements.streamed(p)}
  return any(isinstance(v, jc.Var) and v in streamed for v in scan.invars)


def fresh_result_bytes(cc: Any, leaves: Sequence[Any]) -> int:
  """Device bytes, per device, of `cc`'s results that get a buffer of their own (a device
  result its call cannot write over a device operand)."""
  frac = _shard_fraction(cc, leaves)
  total = 0.0
  for call in op_program_compiler.calls_of(cc):
    for k, a in zip(call.results, call.aliases):
      if a < 0 and not op_program_compiler.is_host_result(cc, k):
        r = cc.results[k]
        total += int(np.prod(r.shape, dtype=np.int64)) * np.dtype(r.dtype).itemsize * frac
  return int(total)


def _shard_fraction(cc: Any, leaves: Sequence[Any]) -> float:
  """The share of `cc`'s global sizes each device holds: its first leaf's shard fraction."""
  return _shard_fraction_of(leaves[cc.component.seeds[0]])


def _shard_fraction_of(leaf: Any) -> float:
  """The share of `leaf`'s global bytes each device holds."""
  global_bytes = int(np.prod(leaf.shape, dtype=np.int64)) * _itemsize(leaf.dtype)
  return leaf.nbytes / global_bytes if global_bytes else 1.0


def _itemsize(dtype: Any) -> int:
  try:
    return np.dtype(dtype).itemsize
  except TypeError:
    import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
    return jnp.dtype(dtype).itemsize


def host_executors(platform: str) -> tuple[str, ...]:
  """The host-update executors a plan may choose on `platform` (on the CPU backend every
  executor is the CPU handler)."""
  if platform == "gpu":
    return placements.EXECUTOR_PLACEMENTS
  return (Placement.HOST_CPU,)


def build_problem(*, leaves: Sequence[Any], jaxpr: Any, compiled: Sequence[Any],
                  master_nbytes: Mapping[int, int], placement: Mapping[int, str],
                  user_fixed: set[int], param_role: str, step_costs: step_costs_lib.StepCosts,
                  streamable: frozenset[int] = frozenset(),
                  dha_readable: "frozenset[int] | Mapping[int, int]" = frozenset(),
                  tables: "Mapping[int, int] | None" = None,
                  activations: "cost_model.ActivationModel | None" = None,
                  device_budget: "int | None", host_budget: "int | None",
                  profile: HardwareProfile, platform: str,
                  overlap_update: bool = True,
                  meshed: "frozenset[int] | set[int]" = frozenset(),
                  layered_dha_fraction: "float | None" = None,
                  speculate: "bool | frozenset[int]" = True) -> Problem:
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
    streamable, dha_readable: parameter leaves that may be `host_stream` / `host_dha`; a
      mapping {leaf: bytes} for `dha_readable` gives the bytes its zero-copy reads move per step
      (an embedding table's gathered rows: `analysis/lookups.py`), else the whole leaf.
    tables: {leaf: bytes of the rows one step gathers} of every embedding table the lowering
      can read in place, the user's placements included (None: `dha_readable` where it is a
      mapping): an update of one placed `host_dha` runs row by row (`UpdateItem.table`).
    activations: the model's activation options, or None.
    device_budget, host_budget: per device, bytes (None: no limit).
    profile, platform: the rates and 'gpu' / 'cpu'.
    overlap_update: updates may run during the step, layer by layer inside the backward pass
      or row by row (`OffloadOptions.overlap_update`), where `update_schedule.decide` says
      they do.
    meshed: state leaves on a mesh of more than one device (besides those `leaves` shows
      sharded): their updates run after the backward pass.
    speculate: False costs the guarded updates (`update_schedule.UpdateSchedule.guards`) as
      serial: the step whose guess failed, or that was not guessed. A set of component
      indices: a guessed step whose spares fit for those guarded updates alone; the others
      are serial (`update_schedule.Why.NO_ROOM_FOR_SPARES`).
    layered_dha_fraction: the DHA kernel's share of a layered host_split update's elements
      (None: the profile's `split_fraction`); the other updates' splits keep the profile's.
  """
  executors = host_executors(platform)
  if tables is None:
    tables = dha_readable if isinstance(dha_readable, Mapping) else {}
  loops = layer_stacks.LayerLoops(jaxpr)
  decided = update_schedule.decide(
      jaxpr, compiled, leaves,
      pinned={i for i, p in placement.items() if p in placements.HOST_PLACEMENTS},
      tables={i for i, p in placement.items()
              if p == Placement.HOST_DHA and leaves[i].role == param_role},
      meshed=set(meshed) | {l.index for l in leaves
                            if l.is_float and _shard_fraction_of(l) < 1.0},
      overlap_update=overlap_update)
  # A guarded update's serial call (a missed guess, or no guess) is the call its layered
  # lowering makes, run whole: at the layered split's DHA share (`cc.dha_fraction`).
  serial_of_layered: set[int] = set()
  if speculate is not True:
    keep = frozenset(speculate or ())
    serial_of_layered = {u for u, s in enumerate(decided)
                         if s.guarded and s.mode == update_schedule.Mode.LAYERED
                         and s.component not in keep}
    decided = update_schedule.unguessed(decided, keep)
  # A table the solver may still place `host_dha` is costed row by row where it does
  # (`UpdateItem.by_rows`); under a schedule that runs nothing during the step, never.
  runs_during = not any(s.reason is not None and s.reason.kind in (
      update_schedule.Why.OVERLAP_OFF, update_schedule.Why.FFI_DISABLED) for s in decided)
  seeded: dict[int, int] = {}
  sent_ratio: dict[int, float] = {}  # streamed param leaf -> its gradient's sent/full bytes
  updates: list[UpdateItem] = []
  for u, cc in enumerate(compiled):
    seeds = tuple(cc.component.seeds)
    calls = op_program_compiler.calls_of(cc)
    ms = sum(master_nbytes.get(r.master, 0) for r in cc.results if r.master >= 0)
    fixed = None
    if any(i in user_fixed for i in seeds):
      # The call's executor (a call of host_stream leaves has one too: the cut's choice).
      fixed = placements.of_executor(cc.executor)
    names = executors + ((fixed,) if fixed is not None and fixed not in executors else ())
    got = (update_schedule.layer_loop(loops, cc) if _shard_fraction(cc, leaves) == 1.0
           else update_schedule.Refusal(update_schedule.Why.ON_MESH))
    # A layer loop that streams leaves sends the gradients only host updates read to a
    # pinned_host scratch buffer (`lowering/streaming.py`): the update reads them there.
    # A gradient that is a bf16 value widened is sent in bf16 (the bytes streaming would send),
    # and a layered update takes it in bf16 on the device too (`overlap.LayeredUpdate.narrow`).
    sizes = ({} if isinstance(got, update_schedule.Refusal)
             else _grad_itemsizes(jaxpr.eqns[got[0]], got[1]))
    if sizes:
      ratio = sum(sizes.values()) / sum(_itemsize(cc.operands[p].var.aval.dtype) for p in sizes)
      for i in set(seeds) | set(cc.component.outputs):
        if i < len(leaves) and leaves[i].role == param_role:
          sent_ratio[i] = ratio
    streams = bool(sizes) and _streams(jaxpr.eqns[got[0]], jaxpr, placement)
    sent = frozenset(sizes) if streams else frozenset()
    mode = decided[u].mode
    num_layers = decided[u].length if mode == update_schedule.Mode.LAYERED else 0
    read_as = sizes if sent or num_layers else {}
    # The calls run one after the other: their costs add. A layered update is one call per
    # layer, writing device and host results in place alike.
    calls = (None,) if num_layers else calls
    costs = {e: functools.reduce(operator.add, [
        cost_model.update_cost(e, update_traffic(cc, leaves, master_nbytes, call, sent,
                                                 read_as),
                               profile,
                               platform=platform,
                               dha_fraction=(layered_dha_fraction
                                             if num_layers or u in serial_of_layered else None),
                               grid=profile.dha_layer_grid if num_layers else 1.0)
        for call in calls]) for e in names}
    table = None
    if mode == update_schedule.Mode.ROWS:
      j = decided[u].table
      table = (j, min(1.0, tables.get(j, leaves[j].nbytes) / max(1, leaves[j].nbytes)))
    elif runs_during and not num_layers:
      named = [j for j in cc.component.outputs if j in tables]
      if len(named) == 1 and placement.get(named[0]) != Placement.HOST_DHA:
        j = named[0]
        table = (j, min(1.0, tables[j] / max(1, leaves[j].nbytes)))
    updates.append(UpdateItem(
        seeds=seeds, label=leaves[seeds[0]].path, device_nbytes=sum(leaves[i].nbytes
                                                                   for i in seeds),
        pinned_nbytes=sum(leaves[i].nbytes for i in seeds) + ms, costs=costs, fixed=fixed,
        result_nbytes=0 if num_layers else fresh_result_bytes(cc, leaves),
        num_layers=num_layers, table=table,
        table_fixed=table is not None and placement.get(table[0]) is not None
        and schedule_of(placement[table[0]], param_role) is Schedule.GATHERED))
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
  stacked = layer_stacks.stacked_layers(jaxpr, len(leaves))
  # The parameters the caller says can take each of the solver's host placements, by schedule.
  candidates = {Schedule.STREAMED: streamable, Schedule.GATHERED: dha_readable}
  params = [
      l for l in leaves
      if l.role == param_role and l.index not in user_fixed and l.index not in seeded and l.is_float
      and placement.get(l.index) in placements.PARAM_PLACEMENTS
  ]
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
    opts = [Placement.DEVICE]
    if placements.record(placement[l.index]).on_host:
      opts = [placement[l.index]]  # already placed (re-evaluating a plan)
    else:
      # The host placements the caller says this parameter may take, in the registry's order.
      opts += [p for p in placements.PARAM_PLACEMENTS if placements.record(p).on_host
               and l.index in candidates[placements.record(p).param_schedule]]
    items.append(ParamItem(index=l.index, path=l.path, nbytes=l.nbytes, grad_nbytes=l.nbytes,
                           stage=key, stage_order=order, num_layers=layers,
                           compute_secs=total * n / elements if elements else 0.0,
                           options=tuple(opts), update=update_of_param.get(l.index),
                           sent_grad_nbytes=int(l.nbytes * sent_ratio.get(l.index, 1.0)),
                           dha_nbytes=(dha_readable.get(l.index)
                                       if isinstance(dha_readable, Mapping) else None)))
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
    rec = placements.record(placement.get(l.index, Placement.DEVICE))
    schedule = rec.schedule_of(l.role)
    if schedule in (Schedule.RESIDENT, Schedule.COPIED):
      # On the device during the step (a copied leaf: XLA copies it in).
      fixed_device += l.nbytes
    if schedule is Schedule.COPIED:
      fixed_costs.append(cost_model.xla_copy_cost(l.nbytes, profile, platform=platform))
    # Pinned between steps.
    fixed_pinned += rec.pinned_bytes(l.nbytes, role=l.role,
                                     sent_grad_nbytes=int(l.nbytes * sent_ratio.get(l.index, 1.0)))
  transient = max(int(step_costs.transient_bytes), grads)
  # Parameters already streamed (or read zero-copy) whose update call the cut seeded with them
  # are not decision units, but they still hold no gradient on the device (it goes down layer
  # by layer) and a streamed one has its layers double-buffered: as `_evaluate` counts a
  # streamed ParamItem, so that a plan re-evaluated after its cut predicts what the search did.
  placed_off = [l for l in leaves if l.role == param_role and l.is_float and l.index in seeded
                and l.index in placement and served(placement[l.index], param_role)]
  transient -= sum(l.nbytes for l in placed_off)
  fixed_buffers = max((4 * l.nbytes // max(1,
                                           stacked.get(l.index, (0, 1))[1])
                       for l in placed_off
                       if placements.streamed(placement[l.index])),
                      default=0)
  return Problem(params=tuple(items), updates=tuple(updates), fixed_device_bytes=fixed_device,
                 fixed_pinned_bytes=fixed_pinned, fixed_costs=tuple(fixed_costs),
                 transient_bytes=transient, fixed_buffer_bytes=fixed_buffers,
                 update_credit=float(step_costs.update_credit),
                 other_compute_secs=0.0 if elements else total,
                 backward_share=_backward_share(step_costs), activations=activations,
                 device_budget=device_budget, host_budget=host_budget, profile=profile,
                 platform=platform, schedule=decided)


def _backward_share(step_costs: step_costs_lib.StepCosts) -> float:
  """The backward pass's share of the layer loops' time: measured where the timed scans give it
  (a body rematerialised in the backward pass makes it about 3/4), else the two-matmuls-per-
  forward-one rule (`cost_model.BACKWARD_SHARE`)."""
  timed = step_costs.timed
  if timed is not None and timed.backward_share is not None:
    return timed.backward_share
  return cost_model.BACKWARD_SHARE
