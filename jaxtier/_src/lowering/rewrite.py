"""Lowering: the traced step rewritten so that its host-resident leaves are served by plan.

The step becomes two programs (`SplitStep`), called as `lowering/calling.py` declares.
`compute` re-binds every equation of the traced step that no fused host update takes (the
forward, the backward, the scalar bookkeeping); scans over host_stream leaves are unrolled and
fed layer by layer (`lowering/streaming.py`); embedding tables placed host_dha are gathered in
place and their gradients scatter-added into pinned_host buffers (`lowering/dha_tables.py`);
leaves placed `host_xla` are copied to the device (XLA's memory-kind transfer) and their new
values go back to pinned_host through the output shardings; components of leaves stacked over
layers are updated layer by layer in the backward pass (`lowering/overlap.py`). `update` runs
each other elementwise component that updates host leaves as one `host_update` custom call, in
place on the donated host buffers. Host leaves are donated only to the program that updates
them: `compute` the layered ones (and their masters, and the gradient buffers), `update` the
others it writes. A step that fails in `compute` leaves every other host leaf intact.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np

from jaxtier._src import jax_compat as jc
from jaxtier._src.analysis import op_program_compiler
from jaxtier._src.analysis import update_schedule
from jaxtier._src.analysis.op_program_compiler import CompiledComponent
from jaxtier._src.lowering import calling
from jaxtier._src.lowering import dha_tables
from jaxtier._src.lowering import overlap as overlap_lib
from jaxtier._src.lowering import streaming
from jaxtier._src.planning.plan import Plan
from jaxtier._src.primitives import dha
from jaxtier._src.primitives import host_update as hu
from jaxtier._src.primitives import stream
from jaxtier._src.planning.placements import Schedule, schedule_of
from jaxtier._src.vocab import MemoryKind


@dataclasses.dataclass
class SplitStep:
  """The traced step lowered as two programs run one after the other.

  `compute(calling.ComputeIn) -> calling.ComputeOut`: the forward, backward and everything
  else on the device, with host_stream leaves fetched layer by layer and their gradients sent
  into `scratch`, and the components of `overlap` updated layer by layer in the backward pass,
  in place on the donated `layered_host` leaves and masters (`lowering/overlap.py`). Other host
  leaves are read, never donated: where nothing is layered, a step that fails here leaves every
  host-resident leaf intact and usable.

  `update(calling.UpdateIn) -> calling.UpdateOut`: the fused host updates, in place on the
  donated `updated_host` leaves and masters; the feeds are the values `compute` made for them
  (gradients, device params, scalars), split by `split_feeds`: a device param's new value is
  written in place over the donated one.

  Index lists (into the state leaves / the step's outvars) say what goes where;
  `compute_inputs` and `update_inputs` group the state's leaves by them, `assemble` puts the
  step's flattened outputs back together.
  """

  compute: Callable[[calling.ComputeIn], calling.ComputeOut]
  update: Callable[[calling.UpdateIn], calling.UpdateOut]
  device_leaves: list[int]     # state leaves in device memory (donated to `compute`)
  host_leaves: list[int]       # state leaves in pinned_host (read by `compute`, not donated)
  updated_host: list[int]      # host leaves updated in place by `update` (donated there)
  read_host: list[int]         # host leaves `update` only reads
  compute_outs: list[int]      # outvars `compute` returns, in order
  update_outs: list[int]       # outvars `update` returns, in order
  passthrough: dict[int, int]  # outvar -> state leaf returned unchanged (a host leaf)
  num_feeds: int
  num_first: int               # compute_outs[:num_first] come before the feeds
  stream: streaming.StreamSchedule = streaming.EMPTY  # the streamed layer loops
  donated_feeds: tuple[int, ...] = ()  # feeds `update` overwrites in place (donated there)
  overlap: overlap_lib.OverlapSchedule = overlap_lib.EMPTY  # the per-layer host updates
  layered_host: list[int] = dataclasses.field(default_factory=list)  # donated to `compute`
  layered_masters: list[int] = dataclasses.field(default_factory=list)  # param leaves
  update_masters: list[int] = dataclasses.field(default_factory=list)  # `update`'s masters
  lookup: dha_tables.LookupSchedule = dha_tables.EMPTY  # tables read in place (host_dha)
  guards: int = 0  # late predicates the guarded updates read (`ComputeOut.guards`)
  guesses: tuple[tuple[float, ...], ...] = ()  # speculative: the assignment its calls run on
  speculative: bool = False  # `compute` takes a `SpeculativeIn` (writes spare buffers)
  spare_device: list[int] = dataclasses.field(default_factory=list)  # device leaves written

  def by_spare_key(self, leaves: Sequence[Any], masters: Mapping[int, Any]
                   ) -> dict[tuple[str, int], Any]:
    """{('leaf', i): leaves[i], ('master', i): masters[i]} over the buffers the speculative
    `compute` writes to spares: `layered_host`, `spare_device` and `layered_masters`."""
    return ({("leaf", i): leaves[i] for i in self.layered_host + self.spare_device}
            | {("master", i): masters[i] for i in self.layered_masters})

  def speculative_inputs(self, leaves: Sequence[Any], args: Sequence[Any],
                         scratch: Sequence[Any], masters: Mapping[int, Any],
                         spares: Mapping[tuple[str, int], Any]) -> calling.SpeculativeIn:
    """The speculative `compute`'s inputs: as `compute_inputs`, the layered buffers' spares
    from `spares` ({('leaf', i) or ('master', i): array})."""
    return calling.SpeculativeIn(
        device_leaves=[leaves[i] for i in self.device_leaves],
        host_leaves=[leaves[i] for i in self.host_leaves], args=list(args),
        scratch=list(scratch), masters=[masters[i] for i in self.layered_masters],
        spare_host=[spares["leaf", i] for i in self.layered_host],
        spare_masters=[spares["master", i] for i in self.layered_masters],
        spare_device=[spares["leaf", i] for i in self.spare_device])

  @property
  def has_update(self) -> bool:
    """Whether any component runs in the serial `update` program."""
    return bool(self.update_outs or self.update_masters)

  def split_feeds(self, feeds: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """(kept, donated) feeds, as `update` takes them."""
    donated = set(self.donated_feeds)
    return ([x for k, x in enumerate(feeds) if k not in donated],
            [feeds[k] for k in self.donated_feeds])

  def compute_inputs(self, leaves: Sequence[Any], args: Sequence[Any], scratch: Sequence[Any],
                     masters: Mapping[int, Any]) -> calling.ComputeIn:
    """`compute`'s inputs from the state's flat `leaves` (arrays, shardings or specs alike),
    the step's other flattened `args`, the gradient buffers and the fp32 masters by param
    leaf index (those of `layered_masters` are taken)."""
    return calling.ComputeIn(
        device_leaves=[leaves[i] for i in self.device_leaves],
        host_leaves=[leaves[i] for i in self.host_leaves], args=list(args),
        scratch=list(scratch), layered_host=[leaves[i] for i in self.layered_host],
        layered_masters=[masters[i] for i in self.layered_masters])

  def update_inputs(self, leaves: Sequence[Any], masters: Mapping[int, Any],
                    feeds: Sequence[Any], scratch: Sequence[Any]) -> calling.UpdateIn:
    """`update`'s inputs from the state's flat `leaves`, the fp32 masters by param leaf index
    (those of `update_masters` are taken), `compute`'s feeds and the gradient buffers."""
    kept, donated = self.split_feeds(feeds)
    return calling.UpdateIn(
        updated_host=[leaves[i] for i in self.updated_host],
        read_host=[leaves[i] for i in self.read_host],
        masters=[masters[i] for i in self.update_masters], feeds=kept, donated_feeds=donated,
        scratch=list(scratch))

  def new_masters(self, computed: calling.ComputeOut,
                  updated: "calling.UpdateOut | None") -> dict[int, Any]:
    """The masters the programs made, by param leaf index (`updated`: None where `update`
    did not run)."""
    out = dict(zip(self.layered_masters, computed.layered_masters))
    if updated is not None:
      out.update(zip(self.update_masters, updated.masters))
    return out

  def assemble(self, state_leaves: Sequence[Any], computed: calling.ComputeOut,
               updated: "calling.UpdateOut | None", num_outvars: int) -> list[Any]:
    """The step's flattened outputs: from the programs' outputs (`updated`: None where
    `update` did not run) and, for outvars that return a host leaf unchanged, `state_leaves`
    (not donated to either program)."""
    out: list[Any] = [None] * num_outvars
    for j, x in zip(self.compute_outs, list(computed.first) + list(computed.rest)):
      out[j] = x
    for j, x in zip(self.layered_host, computed.layered_host):  # leaf j's new value: outvar j
      out[j] = x
    for j, x in zip(self.update_outs, updated.outs if updated is not None else ()):
      out[j] = x
    for j, i in self.passthrough.items():
      out[j] = state_leaves[i]
    return out


def rewrite(closed_jaxpr: Any, plan: Plan, shardings: "Sequence[Any] | None" = None,
            overlap_update: bool = True, speculate: bool = False) -> SplitStep:
  """Lowers the traced step by `plan` into a `SplitStep` (compute, then fused host updates).

  Every equation that no fused host update (`plan.components`) takes is re-bound as traced;
  the layer loops over `host_stream` leaves are unrolled, their leaves fetched layer by layer
  (`streaming.schedule`); each compiled component becomes one `host_update` call.
  `shardings` (one `NamedSharding` per state leaf, as the state is sharded) lets a component
  whose leaves are sharded over a mesh run per shard: each device updates its own shard of the
  host buffers (`shard_map`), with no all-gather. Components of leaves stacked over layers run
  layer by layer inside the backward pass where `overlap_update` and `overlap.schedule` allow
  (`SplitStep.overlap`). The update program's masters are ordered like
  `master_indices(serial components)`, scratch buffers like `SplitStep.stream.scratch`.

  `speculate`: the speculative lowering: the guarded components (`Plan.schedule`'s `guards`)
  run layered on the guessed late predicates (`SplitStep.guesses[0]`), their op programs
  specialized to it, and `compute` takes a `calling.SpeculativeIn`: it
  reads the state and writes every layered update's results to spare buffers (module doc of
  `analysis/update_schedule.py`). Otherwise they are serial.
  """
  every = plan.components
  jaxpr, consts = closed_jaxpr.jaxpr, list(closed_jaxpr.consts)
  # Tables read in place: their gradients go to scratch buffers after the streamed ones'.
  stream, ov, lookup = overlap_lib.schedules(jaxpr, plan, shardings, overlap_update,
                                             speculate)
  # The late predicates of the guarded components (their values are `ComputeOut.guards`),
  # and, speculating, the assignment of them the guarded calls run on.
  guarded = [s for s in plan.schedule if s.guarded]
  guard_vars: list[Any] = []
  for rec in guarded:
    for p in rec.guards:
      if every[rec.component].operands[p].var not in guard_vars:
        guard_vars.append(every[rec.component].operands[p].var)
  # The first assignment every guarded component may run on (all true where it is one: the
  # clip does not bind, the gradients are finite); their op programs are specialized to it.
  guesses = tuple(
      g for g in itertools.product((1.0, 0.0), repeat=len(guard_vars))
      if all(tuple(g[guard_vars.index(every[rec.component].operands[p].var)]
                   for p in rec.guards) in rec.guesses for rec in guarded)
  )[:1] if speculate else ()
  guess = dict(zip(guard_vars, guesses[0])) if guesses else {}
  compiled = [cc for c, cc in enumerate(every) if c not in ov.components]
  n_state = len(plan.leaves)
  skip = {k for cc in every for k in cc.component.eqns}
  xla_host = {l.index for l in plan.leaves
              if schedule_of(l.placement, l.role) is Schedule.COPIED}
  layered_host = list(ov.host_leaves)
  # Speculating, `compute` reads every host leaf and writes the layered ones' spares.
  host = [l.index for l in plan.leaves if l.memory_kind == "pinned_host"
          and (speculate or l.index not in ov.host_leaves)]
  device = [l.index for l in plan.leaves if l.memory_kind != "pinned_host"]
  spare_device = list(ov.device_leaves) if speculate else []
  masters = master_indices(compiled)
  layered_masters = list(ov.masters)
  # The layered host leaves' new values (outvar j for leaf j) are returned last, after the
  # scratch buffers, in the order the leaves are donated, so that JAX pairs each with its own
  # buffer.
  by_update = {j for cc in compiled for r in cc.results for j in r.outputs}
  host_set = set(host)
  invar_pos = {v: i for i, v in enumerate(jaxpr.invars)}
  # A new state leaf that is a host leaf unchanged is that leaf. A metric that is one (its old
  # value: `update` may overwrite the buffer in place) is a device copy `compute` makes.
  passthrough = {j: invar_pos[v] for j, v in enumerate(jaxpr.outvars[:n_state])
                 if j not in by_update and isinstance(v, jc.Var) and invar_pos.get(v) in host_set}
  host_invars = {jaxpr.invars[i] for i in host + layered_host if i not in xla_host}
  # `compute` returns the device leaves' new values first, in the order the leaves are
  # donated, then the feeds, then the rest: JAX pairs donated inputs with outputs of the same
  # shape in order, and (jax 0.10) not always by memory kind. A device leaf whose new value
  # `update` makes (a bf16 param from its master) then pairs with a feed (its gradient).
  compute_outs = [j for j in range(len(jaxpr.outvars)) if j not in by_update
                  and j not in passthrough and j not in layered_host]
  # Speculating, the device leaves are read, not donated: the outputs first paired are the
  # new values in the spare buffers.
  rank = {i: r for r, i in enumerate(spare_device if speculate else device)}
  compute_outs.sort(key=lambda j: (0, rank[j]) if j in rank else (1, j))
  num_first = sum(1 for j in compute_outs if j in rank)
  update_outs = sorted(by_update)
  updated = sorted({cc.operands[r.alias].index for cc in compiled for r in cc.results
                    if r.alias >= 0 and cc.operands[r.alias].kind == "host"})
  read_only = sorted({spec.index for cc in compiled for spec in cc.operands
                      if spec.kind == "host"} - set(updated))
  # Device values the fused updates read, in a fixed order (a gradient sent to a scratch
  # buffer is read there instead).
  feed_vars: list[Any] = []
  for cc in compiled:
    for spec in cc.operands:
      if spec.kind == "value" and spec.var not in stream.sent_vars and spec.var not in feed_vars:
        feed_vars.append(spec.var)
  calls = [op_program_compiler.calls_of(cc) for cc in compiled]
  calls, donated_vars = _donations(compiled, calls, feed_vars, jaxpr, compute_outs, n_state,
                                   plan, update_outs)
  donated_feeds = tuple(feed_vars.index(v) for v in donated_vars)
  kept_vars = [v for v in feed_vars if v not in donated_vars]

  layered_scans = ov.scans
  # The serial lowering of a plan that speculates unrolls the guarded components' scans as
  # the speculative lowering does, with no calls: a missed guess reruns the serial programs,
  # and their gradients must be the guessed step's, bit for bit (a rolled loop compiles apart
  # from an unrolled one and may round a gradient otherwise on a GPU).
  guarded_scans = ({s.loop for s in plan.schedule
                    if s.guarded and s.mode == update_schedule.Mode.LAYERED}
                   if plan.speculation is not None and plan.speculation.enabled else set())
  unrolled = set(layered_scans) | guarded_scans
  # Gradient buffers kept zero between steps: their tables' updates zero the rows they read.
  kept_zero = {u.rows.scratch for u in ov.tables}

  def compute(inputs: "calling.ComputeIn | calling.SpeculativeIn"
              ) -> "calling.ComputeOut | calling.SpeculativeOut":
    state = [None] * n_state
    for i, x in zip(device, inputs.device_leaves):
      state[i] = x
    for i, x in zip(host, inputs.host_leaves):
      state[i] = jax.device_put(x, jc.memory_space("device")) if i in xla_host else x
    if speculate:
      masters = dict(zip(layered_masters, inputs.masters))
      spares = ({("leaf", i): x for i, x in zip(layered_host, inputs.spare_host)}
                | {("master", i): x for i, x in zip(layered_masters, inputs.spare_masters)}
                | {("leaf", i): x for i, x in zip(spare_device, inputs.spare_device)})
    else:
      for i, x in zip(layered_host, inputs.layered_host):
        state[i] = x
      masters, spares = dict(zip(layered_masters, inputs.layered_masters)), {}
    env: dict[Any, Any] = dict(zip(jaxpr.invars, state + list(inputs.args)))
    env.update(zip(jaxpr.constvars, consts))
    scratch = list(inputs.scratch)
    layers = _LayerCalls(every, ov, jaxpr, state, masters, spares, guess)

    def read(v):
      if isinstance(v, jc.Literal):
        return v.val
      val = env[v]
      return val.whole() if isinstance(val, streaming.Stacked) else val

    for k in ov.order(len(jaxpr.eqns)):
      eqn = jaxpr.eqns[k]
      if k in skip or k in lookup.skip:
        continue
      if k in lookup.gathers:  # the rows of a pinned_host table, read in place
        ids = read(eqn.invars[1])[..., 0]
        outs = [dha.gather(read(eqn.invars[0]), ids)]
        token = layers.untouched_rows(k, read, ids, outs)
        if token is not None:
          # The forward goes on after the call is issued (on a GPU it only enqueues host work),
          # so that XLA's scheduler cannot sink it to the join, where it would overlap nothing.
          outs = [jax.lax.optimization_barrier((outs[0], token))[0]]
      elif k in lookup.scatters:  # its gradient rows, added into a pinned_host buffer
        s = lookup.scatters[k]
        scratch[s] = dha.scatter_add(scratch[s], read(eqn.invars[1])[..., 0],
                                     read(eqn.invars[2]), zeroed=s in kept_zero)
        outs = [scratch[s]]
        layers.touched_rows(k, read, scratch)
      elif k in stream.scans or k in unrolled:
        # A layer loop over host_stream leaves (unrolled, streamed) or one whose gradients
        # feed per-layer host updates (unrolled, the updates issued as it goes).
        outs = streaming.run_scan(
            eqn, stream.scans.get(k) or streaming.StreamedScan(k, (), ()),
            [v.val if isinstance(v, jc.Literal) else env[v] for v in eqn.invars], scratch,
            on_layer=_isolated(functools.partial(layers.issue, k, read)
                               if k in layered_scans else None, k in guarded_scans),
            on_landed=(functools.partial(layers.landed, k, read) if k in layered_scans
                       else None))
        layers.finish(k)
      else:
        outs = jc.bind_eqn(eqn, [read(v) for v in eqn.invars])
      for v, val in zip(eqn.outvars, outs):
        if not isinstance(v, jc.DropVar):
          env[v] = val
    new_masters = layers.join(env, scratch)
    feeds = [read(v) for v in feed_vars]
    outs = [jax.device_put(read(v), jc.memory_space(MemoryKind.DEVICE))
            if j >= n_state and isinstance(v, jc.Var) and v in host_invars else read(v)
            for j, v in ((j, jaxpr.outvars[j]) for j in compute_outs)]
    return (calling.SpeculativeOut if speculate else calling.ComputeOut)(
        first=outs[:num_first], feeds=feeds, rest=outs[num_first:], scratch=scratch,
        layered_host=[read(jaxpr.outvars[j]) for j in layered_host],
        layered_masters=[new_masters[i] for i in layered_masters],
        guards=[jnp.asarray(read(v), jnp.float32).reshape(()) for v in guard_vars])

  def update(inputs: calling.UpdateIn) -> calling.UpdateOut:
    host_of = dict(zip(updated, inputs.updated_host)) | dict(zip(read_only, inputs.read_host))
    master_of = dict(zip(masters, inputs.masters))
    feed_of = (dict(zip(kept_vars, inputs.feeds))
               | dict(zip(donated_vars, inputs.donated_feeds)))
    scratch = inputs.scratch
    outs: dict[int, Any] = {}
    new_masters: dict[int, Any] = {}
    def value_of(v):  # a gradient sent to a scratch buffer is read there
      return scratch[stream.sent_vars[v]] if v in stream.sent_vars else feed_of[v]

    for cc, cc_calls in zip(compiled, calls):
      operands = [_operand(spec, host_of, master_of, value_of) for spec in cc.operands]
      for r, val in zip(cc.results, _call(cc, cc_calls, operands, shardings)):
        for j in r.outputs:
          outs[j] = val
        if r.master >= 0:
          new_masters[r.master] = val
    return calling.UpdateOut(outs=[outs[j] for j in update_outs],
                             masters=[new_masters[i] for i in masters])

  return SplitStep(compute=compute, update=update, device_leaves=device, host_leaves=host,
                   updated_host=updated, read_host=read_only, compute_outs=compute_outs,
                   update_outs=update_outs, passthrough=passthrough, num_feeds=len(feed_vars),
                   num_first=num_first, stream=stream, donated_feeds=donated_feeds,
                   overlap=ov, layered_host=layered_host, layered_masters=layered_masters,
                   update_masters=masters, lookup=lookup, guards=len(guard_vars),
                   guesses=guesses, speculative=speculate, spare_device=spare_device)


class _LayerCalls:
  """The per-layer host updates of one trace of `compute`: issued as the unrolled scans go
  (`issue`), their gradient slices released a few layers later, then joined (`join`)."""

  def __init__(self, compiled: Sequence[CompiledComponent], ov: overlap_lib.OverlapSchedule,
               jaxpr: Any, state: list[Any], masters: dict[int, Any],
               spares: "Mapping[tuple[str, int], Any] | None" = None,
               guess: "Mapping[Any, float] | None" = None):
    """`spares`: where the calls write each buffer's new value ({('leaf', i) or ('master',
    i): array}; empty: in place). `guess`: the guessed value of each late predicate var that
    guarded calls read (`LayeredUpdate.guards`): their op programs are specialized to it
    (`update_schedule.specialize`: the unchosen case of each select dropped)."""
    self.compiled, self.ov, self.jaxpr = compiled, ov, jaxpr
    self.state, self.masters = state, masters
    self.spares, self.guess = dict(spares or {}), dict(guess or {})
    self.tokens: list[Any] = []
    self.read_values: list[Any] = []  # device values the calls read, alive until the join
    # Per scan: (token, gradient slices) of each iteration whose slices are not released yet.
    self.unreleased: dict[int, list[tuple[list[Any], list[Any]]]] = {}
    self.ids: dict[int, Any] = {}  # component -> the ids of its table's gather
    self.early: dict[int, Any] = {}  # component -> the token of its untouched rows' call

  def _buffer(self, key: tuple[str, int]) -> Any:
    """The buffer the calls write for `key`: its spare when speculating, else itself."""
    if key in self.spares:
      return self.spares[key]
    kind, i = key
    return self.masters[i] if kind == "master" else self.state[i]

  def issue(self, k: int, read: Any, layer: int, outs: list[Any]) -> list[Any]:
    """Issues layer `layer`'s calls of scan `k` whose gradients are this iteration's slices,
    and releases the slices of the iteration `update_schedule.RELEASE_LAG` before (the device
    then holds a few layers' gradients, not all); returns the iteration's
    outputs, the carry ordered after that release (`streaming.run_scan`'s `on_layer`)."""
    tokens, slices = [], []
    for u in self.ov.by_scan(k):
      if not u.sent:
        tokens.append(self._call(u, read, layer, outs, {}, slices))
    lag = update_schedule.RELEASE_LAG
    if lag is None:
      self.read_values.extend(slices)
      return outs
    pending = self.unreleased.setdefault(k, [])
    pending.append((tokens, slices))
    if len(pending) <= lag:
      return outs
    old_tokens, old_slices = pending.pop(0)
    if not old_slices:
      return outs
    # After this iteration's compute (its outputs are order-only operands), before the next
    # one's (the carry waits for the release's token): the slices die here, not at the join.
    token = hu.release(_distinct(old_slices), after=old_tokens + streaming.arrays_of(outs))
    num_carry = self._num_carry(k)
    if not streaming.arrays_of(outs[:num_carry]):
      self.read_values.append(token)
      return outs
    return _through(outs, num_carry,
                    lambda carry: jax.lax.optimization_barrier((carry, token))[0])

  def finish(self, k: int) -> None:
    """Keeps the slices the last iterations of scan `k` did not release alive until the
    join."""
    for _, slices in self.unreleased.pop(k, []):
      self.read_values.extend(slices)

  def _num_carry(self, k: int) -> int:
    return jc.scan_counts(self.jaxpr.eqns[k])[1]

  def landed(self, k: int, read: Any, layer: int, outs: list[Any], scratch: list[Any]
             ) -> list[Any]:
    """Issues layer `layer`'s calls of scan `k` that read its gradients' landed windows in
    the scratch buffers; returns their tokens (`streaming.run_scan`'s `on_landed`)."""
    tokens = []
    for u in self.ov.by_scan(k):
      if u.sent:
        tokens.append(self._call(u, read, layer, outs,
                                 {pos: scratch[s] for pos, s in u.sent.items()}))
    return tokens

  def untouched_rows(self, k: int, read: Any, ids: Any, outs: list[Any]) -> Any:
    """Issues the update of the rows the step's ids do not name (gradient zero) of the tables
    gathered by equation `k`, after the gather (`outs`, its rows) has read the table; returns
    its token (None where equation `k` gathers no such table)."""
    token = None
    for u in self.ov.tables:
      if u.rows.gather == k:
        grad = {u.rows.grad: jnp.zeros((1,), jnp.float32)}
        self.ids[u.component] = ids
        self.read_values.append(ids)
        token = self.early[u.component] = self._table_call(u, read, grad, ids, "others", None,
                                                           streaming.arrays_of(outs))
    return token

  def touched_rows(self, k: int, read: Any, scratch: list[Any]) -> None:
    """Issues the update of the rows the ids name of the table whose gradient equation `k`
    scatter-added into its buffer; the call zeroes those rows of the buffer after use."""
    for u in self.ov.tables:
      if u.rows.scatter == k:
        buffer = scratch[u.rows.scratch]
        self._table_call(u, read, {u.rows.grad: buffer}, self.ids[u.component], "ids",
                         u.rows.grad, [self.early[u.component]])

  def _table_call(self, u: overlap_lib.LayeredUpdate, read: Any, given: dict[int, Any],
                  ids: Any, rows: str, zero: "int | None", after: list[Any]) -> Any:
    program, operands, targets = self._operands(u, given, read)
    token = hu.host_update_rows(program, operands, targets, ids=ids, row_length=u.count,
                                rows=rows, zero=zero, after=after)
    self.tokens.append(token)
    return token

  def _operands(self, u: overlap_lib.LayeredUpdate, given: dict[int, Any],
                value: Callable[[Any], Any], released: "tuple[set[Any], list[Any]] | None" = None
                ) -> tuple[hu.Program, list[Any], tuple[int, ...]]:
    """The program, operands and targets of one call of `u`: `given[pos]` where given (a
    pinned_host buffer read in place, or a gradient stand-in), else the component's operand
    (`value` for a jaxpr var; a guarded update's late predicates as guessed, the scalars they
    leave unread as 1.0), then the extra state leaves its results are written into, then the
    spare buffers results are written to instead of the operands they overwrite. `released`:
    (the vars of this layer's gradient slices, where their values go: they are released a
    few layers later, not kept alive until the join)."""
    cc = self.compiled[u.component]
    targets = set(u.targets)
    guarded = {cc.operands[p].var for p in u.guards}
    unread = {cc.operands[p].var for p in u.unread}

    def late(v):  # what the specialized program no longer reads: its guess, or 1.0
      if v in guarded:
        return jnp.full(v.aval.shape, self.guess[v], jnp.float32)
      if v in unread:
        return jnp.ones(v.aval.shape, v.aval.dtype)
      return value(v)

    operands = []
    for pos, spec in enumerate(cc.operands):
      if pos in given:
        # Not kept for the join: a scratch buffer is written in place after this call, and a
        # stand-in is this call's own.
        operands.append(given[pos])
        continue
      x = _operand(spec, self.state, self.masters, late)
      if pos not in targets and spec.kind == "value" and released and spec.var in released[0]:
        released[1].append(x)  # a gradient slice: alive until its release
      elif pos not in targets and spec.kind in ("value", "const"):
        # The GPU call reads it after XLA's stream has moved on (a scalar, a device leaf it
        # only reads): alive until the join. Not a written buffer: named as another join's
        # operand, XLA would copy it.
        self.read_values.append(x)
      operands.append(x)
    operands += [self._buffer(("leaf", j)) for j in u.extra]
    out_targets = list(u.targets)
    if self.spares:
      for r, (t, key) in enumerate(zip(u.targets, u.buffers)):
        if t < len(cc.operands) and key in self.spares:
          out_targets[r] = len(operands)
          operands.append(self.spares[key])
    program = cc.program
    if u.guards:
      program = update_schedule.specialize(
          program, {p: self.guess[cc.operands[p].var] for p in u.guards})
    return (dataclasses.replace(program, num_operands=len(operands)), operands,
            tuple(out_targets))

  def _call(self, u: overlap_lib.LayeredUpdate, read: Any, layer: int, outs: list[Any],
            scratch: dict[int, Any], released: "list[Any] | None" = None) -> Any:
    """Issues layer `layer`'s call of `u`; returns its token. `released`: where the gradient
    slices it reads go (to be released later); None: kept until the join."""
    cc = self.compiled[u.component]
    # This layer's gradient slices in place of the stacked gradients (in bf16 where that is
    # exact: `LayeredUpdate.narrow`); a pinned_host scratch buffer whose window `layer` has
    # landed is read in place.
    slices = {cc.operands[pos].var: (outs[j].astype(u.narrow[pos]) if pos in u.narrow
                                     else outs[j])
              for pos, j in u.grads.items() if pos not in scratch}
    program, operands, targets = self._operands(
        u, scratch, lambda v: slices[v] if v in slices else read(v),
        None if released is None else (set(slices), released))
    token = hu.host_update_layer(
        program, operands, targets, offset=layer * u.count, count=u.count,
        after=streaming.arrays_of(outs), executor=cc.executor, dha_fraction=cc.dha_fraction,
        dha_grid=cc.dha_grid)
    self.tokens.append(token)
    return token

  def join(self, env: dict[Any, Any], scratch: list[Any]) -> dict[int, Any]:
    """Joins the calls; sets the layered results' outvars in `env` and the zeroed gradient
    buffers in `scratch`; returns the new masters."""
    if not self.ov.updates:
      return {}
    keys = sorted({key for u in self.ov.updates for key in u.buffers})
    # One join per buffer: XLA's host-offload passes follow a pinned_host parameter through
    # every result of a call that aliases it (`streaming.run_scan`'s note), so one join of
    # every buffer would cost them a path per buffer per buffer.
    after = self.tokens + self.read_values
    joined = {key: hu.join([self._buffer(key)], after=after)[0] for key in keys}
    for u in self.ov.tables:
      s = u.rows.scratch
      scratch[s] = hu.join([scratch[s]], after=after)[0]
    new_masters: dict[int, Any] = {}
    for u in self.ov.updates:
      cc = self.compiled[u.component]
      for r, key in zip(cc.results, u.buffers):
        value = joined[key]
        for j in r.outputs:
          env[self.jaxpr.outvars[j]] = value
        if r.master >= 0:
          new_masters[r.master] = value
    return new_masters


def _isolated(on_layer: "Callable[[int, list[Any]], list[Any] | None] | None", isolate: bool
              ) -> "Callable[[int, list[Any]], list[Any] | None] | None":
  """`on_layer` (or nothing), after each iteration's outputs pass through a custom call that
  hands them back in place (`stream.wait`, with no copy to wait for), where `isolate`.

  The guarded scans of a plan that speculates run so in both its lowerings: XLA fuses nothing
  across a custom call, so each iteration compiles to the same fusions whether its outputs
  feed layer calls (the guessed step) or the stacked gradients (the serial programs a missed
  guess reruns), and a GPU rounds the gradients alike."""
  if not isolate:
    return on_layer

  def run(layer: int, outs: list[Any]) -> "list[Any] | None":
    outs = _through(outs, len(outs), lambda arrays: stream.wait(arrays, direction=stream.D2H))
    return (on_layer(layer, outs) or outs) if on_layer is not None else outs
  return run


def _through(outs: list[Any], n: int, fn: Callable[[list[Any]], Sequence[Any]]) -> list[Any]:
  """`outs` with the arrays among its first `n` replaced by `fn` of them (the same values,
  handed back by a call that orders or isolates them), the rest as they are."""
  at = [j for j, x in enumerate(outs[:n]) if streaming.arrays_of([x])]
  if not at:
    return list(outs)
  new = list(outs)
  for j, x in zip(at, fn([outs[j] for j in at])):
    new[j] = x
  return new


def _distinct(values: list[Any]) -> list[Any]:
  """`values` with each array once (by identity), in order."""
  seen: set[int] = set()
  return [v for v in values if not (id(v) in seen or seen.add(id(v)))]


def _operand(spec: op_program_compiler.OperandSpec, host: Any, masters: Any,
             value: Callable[[Any], Any]) -> Any:
  """The array a host-update call takes for operand `spec`: a host leaf (`host[index]`), a
  master (`masters[index]`), a constant, or a value (`value(var)`); in a dtype the op
  program reads (others, as booleans, converted to float32)."""
  if spec.kind == "host":
    x = host[spec.index]
  elif spec.kind == "master":
    x = masters[spec.index]
  elif spec.kind == "const":
    x = jnp.asarray(spec.value)
  else:
    x = value(spec.var)
  if jnp.dtype(x.dtype) not in hu.SUPPORTED_DTYPES:
    x = jnp.asarray(x).astype(jnp.float32)
  return x


def _donations(compiled: Sequence[CompiledComponent],
               calls: list[tuple[op_program_compiler.Call, ...]], feed_vars: list[Any], jaxpr: Any,
               compute_outs: list[int], n_state: int, plan: Plan, update_outs: list[int]
               ) -> tuple[list[tuple[op_program_compiler.Call, ...]], list[Any]]:
  """The calls with the in-place writes over device feeds that are safe, and those feeds in the
  order `update` takes them donated.

  A device result may overwrite a feed that only its own call reads, that the step does not
  also return, and that is not one of the caller's arguments (jit may hand those back
  unchanged). JAX pairs each donated input, in order, with the first remaining output of the
  same shape, dtype and memory kind; the donated feeds are ordered so that this pairing is the
  calls' own, and an in-place write whose feed would be paired with another output is dropped
  (the result then gets a buffer of its own).
  """
  uses: dict[Any, int] = {}
  for cc in compiled:
    for spec in cc.operands:
      if spec.kind == "value":
        uses[spec.var] = uses.get(spec.var, 0) + 1
  returned = {v for v in (jaxpr.outvars[j] for j in compute_outs) if isinstance(v, jc.Var)}
  arg_vars = set(jaxpr.invars[n_state:]) | set(jaxpr.constvars)
  feeds = set(feed_vars)
  device_kind = lambda j: j >= n_state or plan.leaves[j].memory_kind != MemoryKind.PINNED_HOST

  def target(cc, call, k):  # the feed result k of `call` overwrites, or None
    a = call.aliases[k]
    if a < 0:
      return None
    spec = cc.operands[call.operands[a]]
    if spec.kind != "value":
      return None
    v = spec.var
    ok = v in feeds and uses.get(v) == 1 and v not in returned and v not in arg_vars
    return v if ok else None

  dropped: set[Any] = set()
  while True:
    want: dict[int, Any] = {}  # update output position -> the feed its result overwrites
    for cc, cc_calls in zip(compiled, calls):
      for call in cc_calls:
        for k, ri in enumerate(call.results):
          v = target(cc, call, k)
          if v is None or v in dropped:
            continue
          firsts = [update_outs.index(j) for j in cc.results[ri].outputs if j in update_outs]
          if firsts:
            want.setdefault(min(firsts), v)
    order = [want[p] for p in sorted(want)]
    queues: dict[Any, list[Any]] = {}
    for v in order:
      queues.setdefault((tuple(v.aval.shape), np.dtype(v.aval.dtype)), []).append(v)
    bad = None
    for p, j in enumerate(update_outs):
      if not device_kind(j):
        continue
      aval = jaxpr.outvars[j].aval
      queue = queues.get((tuple(aval.shape), np.dtype(aval.dtype)))
      if queue:
        got = queue.pop(0)
        if want.get(p) is not got:
          bad = got
          break
    if bad is None:
      break
    dropped.add(bad)

  def keep(cc, call):
    aliases = tuple(-1 if a >= 0 and cc.operands[call.operands[a]].kind == "value"
                    and (target(cc, call, k) is None or target(cc, call, k) in dropped) else a
                    for k, a in enumerate(call.aliases))
    return dataclasses.replace(call, aliases=aliases)

  return ([tuple(keep(cc, call) for call in cc_calls) for cc, cc_calls in zip(compiled, calls)],
          order)


def _call(cc: CompiledComponent, calls: Sequence[op_program_compiler.Call], operands: list[Any],
          shardings: "Sequence[Any] | None") -> list[Any]:
  """The host_update calls that run `cc` (`op_program_compiler.calls_of`), per shard when its
  seed leaf is sharded over a mesh; returns its results in `cc.results` order."""
  kw = dict(executor=cc.executor, dha_fraction=cc.dha_fraction)
  seed = cc.component.seeds[0]
  sh = shardings[seed] if shardings is not None else None
  shape = tuple(cc.results[0].shape) if cc.results else ()

  def run(ops: Sequence[Any], result_shape: Callable[[Any], tuple[int, ...]]) -> list[Any]:
    results: list[Any] = [None] * len(cc.results)
    previous = None
    for call in calls:
      args = [ops[i] for i in call.operands]
      program = call.program
      if call.ordered and previous is not None:
        # One element of the previous call's result: XLA runs this call after that one.
        args.append(jnp.reshape(previous, (-1,))[:1])
        program = dataclasses.replace(program, num_operands=program.num_operands + 1)
      shapes = [jax.ShapeDtypeStruct(result_shape(cc.results[k]), cc.results[k].dtype)
                for k in call.results]
      got = hu.host_update(program, args, shapes, list(call.aliases), **kw)
      for k, val in zip(call.results, got):
        results[k] = val
      previous = got[0] if got else previous
    return results

  sharded = (sh is not None and sh.mesh.size > 1 and any(a is not None for a in sh.spec)
             and all(tuple(np.shape(x)) in (shape, ()) or np.size(x) == 1 for x in operands))
  if not sharded:
    return run(operands, lambda r: tuple(r.shape))
  spec = sh.spec
  in_specs = tuple(spec if tuple(np.shape(x)) == shape and np.size(x) != 1 else P()
                   for x in operands)
  operands = [x if tuple(np.shape(x)) == shape or np.ndim(x) == 0 else jnp.reshape(x, ())
              for x in operands]

  def per_shard(*ops):
    return tuple(run(ops, lambda r: sh.shard_shape(r.shape)))
  return list(jax.shard_map(per_shard, mesh=sh.mesh, in_specs=in_specs,
                            out_specs=tuple(spec for _ in cc.results), check_vma=False)(*operands))


def master_indices(compiled: Sequence[CompiledComponent]) -> list[int]:
  """State-leaf indices that carry an fp32 master copy, in a fixed order."""
  return sorted({r.master for cc in compiled for r in cc.results if r.master >= 0})




class TailProgram:
  """The step's `MetricTail` jitted: the metrics computed from what the update made.

  `program(values)` takes the values the tail reads (`MetricTail.inputs` of the step part's
  outputs: new leaves in device or pinned_host memory, metrics on the device) and returns the
  tail's metrics on the device. A pinned_host value is copied to the device inside the
  program (XLA's memory-kind transfer), as `compute` reads a `host_xla` leaf: the metric reads
  the new value where the plan put it. One jitted program per pattern of memory kinds.
  """

  def __init__(self, tail: Any):
    self.tail = tail
    self._programs: dict[tuple[bool, ...], Any] = {}

  def __call__(self, values: Sequence[Any]) -> list[Any]:
    on_host = tuple(jc.memory_kind_of(x) == MemoryKind.PINNED_HOST for x in values)
    program = self._programs.get(on_host)
    if program is None:
      closed = self.tail.closed_jaxpr

      def tail(*xs):
        xs = [jax.device_put(x, jc.memory_space(MemoryKind.DEVICE)) if h else x
              for x, h in zip(xs, on_host)]
        return jc.eval_jaxpr(closed.jaxpr, list(closed.consts), xs)
      program = self._programs[on_host] = jax.jit(tail)
    return list(program(*values))
