"""Policies under the solver: the named rule, leaves placed by a pattern (kept as placed, with
the executor named), and a host_stream pattern that also matches optimizer state."""

import dataclasses

import jax
import jax.numpy as jnp
from planning._toy import HOST_EXEC, STEP, mlp_state, toy_batch

import jaxtier
from jaxtier._src.planning import policy as policy_lib


def test_named_rule_and_user_policy_under_the_solver():
  rule = jaxtier.plan(STEP, mlp_state(), toy_batch(), policy="optimizer_state_on_host")
  assert {l.placement for l in rule.leaves if l.role == "optimizer_state"} == {HOST_EXEC}
  # A user-placed leaf stays put, with the executor the user named; the solver places the
  # rest (here: everything fits).
  plan = jaxtier.plan(STEP, mlp_state(), toy_batch(), policy={r"\.nu\['w2'\]": "host_cpu"})
  p = {l.path: l for l in plan.leaves}
  assert p["['opt'][0].nu['w2']"].placement == "host_cpu"
  assert p["['opt'][0].nu['w2']"].reason.startswith(policy_lib.USER_PLACED)
  assert p["['opt'][0].mu['w1']"].placement == "device"


def test_host_stream_pattern_matching_optimizer_state_puts_it_on_the_host():
  # The README's example pattern r"\['layers'\]" matches the layers' params and also their
  # optimizer state (its paths mirror the params'): the params are streamed; the state, which
  # no scan reads layer by layer, is not refused but placed on the host with the platform's
  # executor.
  from jaxtier.examples import llama, train
  config = dataclasses.replace(llama.CONFIGS["tiny"], num_layers=2)
  _, abstract, step_fn = train.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((2, config.max_seq_len + 1), jnp.int32)
  plan = jaxtier.plan(step_fn, abstract, tokens, policy={r"\['layers'\]": "host_stream"})
  layers = [l for l in plan.leaves if "['layers']" in l.path]
  assert {l.placement for l in layers if l.role == "param"} == {"host_stream"}
  states = [l for l in layers if l.role == "optimizer_state"]
  # (On a GPU the planner picks the executor of these layered updates: host_cpu or the split.)
  want = {HOST_EXEC} if jax.default_backend() != "gpu" else {"host_cpu", "host_split"}
  assert states and len({l.placement for l in states}) == 1
  assert {l.placement for l in states} <= want, [(l.path, l.placement) for l in states]
  assert all("optimizer state is not streamed" in l.reason for l in states)
  assert {l.placement for l in plan.leaves if "['layers']" not in l.path
          and l.role == "param"} == {"device"}
