"""Diagnoses planning on the installed JAX: roles of a toy AdamW state, masters of a bf16 decoder.

  python benchmarks/diagnostics/diag_roles.py
"""
import dataclasses

import jax
import jax.numpy as jnp
import optax

import jaxtier
from jaxtier._src.analysis import inventory as inv_lib
from jaxtier.examples import llama, train

tx = optax.adamw(1e-3, weight_decay=0.1)
params = {"w": jnp.ones((8, 4)), "b": jnp.ones(4)}
state = {"params": params, "opt": tx.init(params)}


def step(state, x):
  g = jax.grad(lambda p: jnp.mean(jnp.tanh(x @ p["w"] + p["b"])))(state["params"])
  u, o = tx.update(g, state["opt"], state["params"])
  return {"params": optax.apply_updates(state["params"], u), "opt": o}, {}


x = jnp.ones((2, 8))
for leaf in inv_lib.take_inventory(step, state, (x,)).leaves:
  print(leaf.path, leaf.role, leaf.why)

cfg = dataclasses.replace(llama.CONFIGS["tiny"], param_dtype=jnp.bfloat16)
_, state, step = train.make_train_state(cfg, 1e-3)
batch = jnp.zeros((2, 33), jnp.int32)
plan = jaxtier.plan(step, state, batch)
print("bf16 tiny: pinned", plan.pinned_bytes, "device", plan.device_bytes, "masters",
      sum(l.master_nbytes for l in plan.leaves))
inv = inv_lib.take_inventory(step, state, (batch,))
j = inv.closed_jaxpr.jaxpr
idx = next(l.index for l in inv.leaves if l.path.endswith("['head']['kernel'].value"))
v = j.invars[idx]
for k, e in enumerate(j.eqns):
  if any(x is v for x in e.invars):
    print("reads head kernel:", k, e)
out = j.outvars[idx]
for k, e in enumerate(j.eqns):
  if out in e.outvars:
    print("writes new head kernel:", k, e)
    for w in e.invars:
      for k2, e2 in enumerate(j.eqns):
        if w in e2.outvars:
          print("   producer:", k2, e2)
