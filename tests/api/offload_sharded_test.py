"""Sharded state on 8 forced CPU devices: data-parallel and FSDP meshes.

Runs in a subprocess: the device count must be set before JAX initialises its backend.
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

# Both subprocess scripts start alike: 8 CPU devices, an MLP trained with AdamW.
PRELUDE = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np, optax, jaxtier
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    tx = optax.adamw(1e-2, weight_decay=0.1)
    def loss(p, x, y):
      return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)
    def step(state, batch):
      x, y = batch
      l, g = jax.value_and_grad(loss)(state["params"], x, y)
      u, o = tx.update(g, state["opt"], state["params"])
      return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": l}
""")

SCRIPT = PRELUDE + textwrap.dedent("""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    out = {}
    for name, spec in [("dp", P()), ("fsdp", P("d"))]:
      k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
      params = {"w1": jax.random.normal(k1, (64, 32)) * .1, "w2": jax.random.normal(k2, (32, 8)) * .1}
      params = jax.device_put(params, NamedSharding(mesh, spec))
      make = lambda: {"params": jax.tree.map(jnp.copy, params), "opt": tx.init(params)}
      xb = jax.device_put(jax.random.normal(k3, (16, 64)), NamedSharding(mesh, P("d")))
      yb = jax.device_put(jnp.sin(xb[:, :8]), NamedSharding(mesh, P("d")))
      ref = jax.jit(step, donate_argnums=0)
      s1, l1 = make(), []
      for _ in range(10):
        s1, m = ref(s1, (xb, yb)); l1.append(float(m["loss"]))
      off = jaxtier.offload(step, policy="optimizer_state_on_host")
      s2, l2 = off.place(make(), (xb, yb)), []
      for _ in range(10):
        s2, m = off(s2, (xb, yb)); l2.append(float(m["loss"]))
      mu = s2["opt"][0].mu["w1"]
      hlo = (off.lower(s2, (xb, yb)).compile().as_text()
             + off.lower_update(s2, (xb, yb)).compile().as_text())
      out[name] = dict(
          ref=l1, got=l2, mu_kind=mu.sharding.memory_kind, mu_spec=str(mu.sharding.spec),
          mu_plan_bytes={l.path: l.nbytes for l in off.plan.leaves}["['opt'][0].mu['w1']"],
          placement=off.plan.placements()["['opt'][0].mu['w1']"],
          gathers=hlo.count("all-gather-start") + hlo.count("all-gather("),
          ref_gathers=(lambda t: t.count("all-gather-start") + t.count("all-gather("))(
              ref.lower(make(), (xb, yb)).compile().as_text()),
          calls=hlo.count('custom_call_target="jaxtier_host_update_ffi"'),
          params_equal=bool(np.allclose(np.asarray(s1["params"]["w1"]),
                                        np.asarray(s2["params"]["w1"]), rtol=1e-5, atol=1e-7)))
    print("RESULT" + json.dumps(out))
""")


def _run(script: str, tmp_path) -> dict:
  """Runs `script` in a fresh interpreter (its own 8-device XLA_FLAGS); returns its RESULT.

  On the CPU backend (JAX_PLATFORMS=cpu): the 8 forced host devices are CPU devices, also on a
  machine with a GPU (where the default backend would be the one GPU).
  """
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                     cwd=tmp_path, timeout=600)
  line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
  assert p.returncode == 0 and line, p.stderr[-3000:]
  return json.loads(line[0][len("RESULT"):])


@pytest.mark.slow
def test_data_parallel_and_fsdp_meshes(tmp_path):
  out = _run(SCRIPT, tmp_path)
  for name, r in out.items():
    assert max(abs(a - b) / abs(b) for a, b in zip(r["got"], r["ref"])) < 1e-5, name
    assert r["params_equal"], name
    assert r["mu_kind"] == "pinned_host" and r["placement"] == "host_cpu", name
    # Per param: its new value on the device, then mu and nu in place (two calls).
    assert r["calls"] == 4, name
    # Per shard: no all-gather beyond what the device-only step has (FSDP's forward gathers).
    assert r["gathers"] == r["ref_gathers"], (name, r["gathers"], r["ref_gathers"])
  assert out["dp"]["mu_spec"] in ("P()", "PartitionSpec()") and out["dp"]["mu_plan_bytes"] == 64 * 32 * 4
  # FSDP: each device holds 1/8 of the moment in its pinned host memory; budgets count that.
  assert out["fsdp"]["mu_spec"] in ("P('d',)", "PartitionSpec('d',)")
  assert out["fsdp"]["mu_plan_bytes"] == 64 * 32 * 4 // 8


PLAN_SCRIPT = PRELUDE + textwrap.dedent("""
    devices = np.array(jax.devices())
    meshes = {
        "dp": (Mesh(devices, ("d",)), P(), P(), P("d")),
        "fsdp": (Mesh(devices, ("d",)), P("d"), P("d"), P("d")),
        # tensor parallel: w1 column-split, w2 row-split over 'model'; batch over 'data'.
        "tp": (Mesh(devices.reshape(2, 4), ("data", "model")), P(None, "model"),
               P("model", None), P("data")),
    }
    out = {}
    for name, (mesh, s1, s2, sb) in meshes.items():
      k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
      params = {"w1": jax.device_put(jax.random.normal(k1, (256, 512)) * .05, NamedSharding(mesh, s1)),
                "w2": jax.device_put(jax.random.normal(k2, (512, 8)) * .05, NamedSharding(mesh, s2))}
      make = lambda: {"params": jax.tree.map(jnp.copy, params), "opt": tx.init(params)}
      xb = jax.device_put(jax.random.normal(k3, (16, 256)), NamedSharding(mesh, sb))
      yb = jax.device_put(jnp.sin(xb[:, :8]), NamedSharding(mesh, sb))
      full = jaxtier.plan(step, make(), (xb, yb))
      nbytes = {l.path: l.nbytes for l in full.leaves}
      moments_w1 = nbytes["['opt'][0].mu['w1']"] + nbytes["['opt'][0].nu['w1']"]
      # Moving them frees moments_w1 but adds a buffer for the new w1 (moments_w1 / 4).
      budget = int(full.predicted_peak_hbm_bytes - 0.5 * moments_w1)
      # Under FSDP the compiled step peaks a little over this budget (about 2%, after two
      # re-plans) though its prediction fits: run as planned, what this test compares being
      # the per-device placements and the training.
      off = jaxtier.offload(step, device_budget=budget, allow_over_budget=True)
      s2_, l2 = off.place(make(), (xb, yb)), []
      ref, s1_, l1 = jax.jit(step, donate_argnums=0), make(), []
      for _ in range(5):
        s1_, m = ref(s1_, (xb, yb)); l1.append(float(m["loss"]))
        s2_, m = off(s2_, (xb, yb)); l2.append(float(m["loss"]))
      mu = s2_["opt"][0].mu["w1"]
      out[name] = dict(
          nbytes=nbytes, full_device=sorted({l.placement for l in full.leaves}),
          full_peak=full.predicted_peak_hbm_bytes, budget=budget,
          peak=off.plan.predicted_peak_hbm_bytes, compiler_peak=off.plan.compiler_peak_hbm_bytes,
          placements=off.plan.placements(), mu_kind=mu.sharding.memory_kind,
          mu_spec=str(mu.sharding.spec), w1_spec=str(s2_["params"]["w1"].sharding.spec),
          ref=l1, got=l2)
    print("RESULT" + json.dumps(out))
""")


@pytest.mark.slow
def test_planner_budgets_per_device_on_dp_fsdp_tp_meshes(tmp_path):
  # Bytes per device are per shard; a per-device budget below the all-device peak moves the
  # biggest moments (per shard) to pinned_host, keeping their sharding spec; training matches.
  out = _run(PLAN_SCRIPT, tmp_path)
  w1 = 256 * 512 * 4
  expect = {"dp": (w1, "P()", "PartitionSpec()"),
            "fsdp": (w1 // 8, "P('d',)", "PartitionSpec('d',)"),
            "tp": (w1 // 4, "P(None, 'model')", "PartitionSpec(None, 'model')")}
  for name, r in out.items():
    per_device, *specs = expect[name]
    assert r["nbytes"]["['params']['w1']"] == per_device, name
    assert r["nbytes"]["['opt'][0].mu['w1']"] == per_device, name
    assert r["full_device"] == ["device"], name  # no budget on CPU: everything on the device
    assert r["peak"] <= r["budget"] < r["full_peak"], (name, r["peak"], r["budget"])
    assert r["placements"]["['opt'][0].mu['w1']"] == "host_cpu", name
    assert r["placements"]["['opt'][0].nu['w1']"] == "host_cpu", name
    assert r["placements"]["['params']['w1']"] == "device", name
    assert r["mu_kind"] == "pinned_host" and r["mu_spec"] in specs, (name, r["mu_spec"])
    assert r["w1_spec"] in specs, (name, r["w1_spec"])
    assert r["compiler_peak"] is not None, name
    assert max(abs(a - b) / abs(b) for a, b in zip(r["got"], r["ref"])) < 1e-5, name
  # The per-device peak shrinks with the shards: FSDP and TP hold less than DP.
  assert out["fsdp"]["full_peak"] < out["dp"]["full_peak"]
  assert out["tp"]["full_peak"] < out["dp"]["full_peak"]


EXPLICIT_SCRIPT = PRELUDE + textwrap.dedent("""
    # A mesh with Explicit axes (sharding in types; jax.make_mesh's default in recent jax).
    mesh = jax.make_mesh((8,), ("d",), axis_types=(jax.sharding.AxisType.Explicit,))
    k1, k2, k3 = jax.random.split(jax.random.PRNGKey(0), 3)
    params = {"w1": jax.random.normal(k1, (64, 32)) * .1, "w2": jax.random.normal(k2, (32, 8)) * .1}
    params = jax.device_put(params, NamedSharding(mesh, P()))
    state = {"params": params, "opt": tx.init(params)}
    xb = jax.device_put(jax.random.normal(k3, (16, 64)), NamedSharding(mesh, P("d")))
    yb = jax.device_put(jnp.sin(xb[:, :8]), NamedSharding(mesh, P("d")))
    try:
      jaxtier.offload(step, policy="optimizer_state_on_host").place(state, (xb, yb))
      error = ""
    except ValueError as e:
      error = str(e)
    # Nothing was placed or donated: the state still trains under jax.jit.
    _, m = jax.jit(step)(state, (xb, yb))
    print("RESULT" + json.dumps({"error": error, "loss": float(m["loss"])}))
""")


def test_explicit_mesh_axes_are_refused_up_front_naming_the_fix(tmp_path):
  # jaxtier traces the step on shapes and lowers it with the leaves' shardings: with Explicit
  # axes the re-bound matmuls asked for an out_sharding deep inside the lowering
  # (ShardingTypeError). It says so before tracing, naming the leaf and the fix.
  out = _run(EXPLICIT_SCRIPT, tmp_path)
  assert ("jaxtier.offload: state leaf ['opt'][0].mu['w1'] is sharded over a mesh with "
          "Explicit axes ('d',)") in out["error"], out["error"]
  assert "axis_types=(jax.sharding.AxisType.Auto,)" in out["error"], out["error"]
  assert out["loss"] > 0


STREAM_SCRIPT = PRELUDE + textwrap.dedent("""
    mesh = Mesh(np.array(jax.devices()), ("d",))
    def scan_loss(p, x, y):
      h, _ = jax.lax.scan(lambda h, w: (jnp.tanh(h @ w), None), x, p["layers"])
      return jnp.mean((h - y) ** 2)
    def scan_step(state, batch):
      l, g = jax.value_and_grad(scan_loss)(state["params"], *batch)
      u, o = tx.update(g, state["opt"], state["params"])
      return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": l}
    params = {"layers": jax.device_put(jax.random.normal(jax.random.PRNGKey(0), (3, 16, 16)) * .1,
                                       NamedSharding(mesh, P()))}
    state = {"params": params, "opt": tx.init(params)}
    xb = jax.device_put(jax.random.normal(jax.random.PRNGKey(1), (16, 16)), NamedSharding(mesh, P("d")))
    batch = (xb, jnp.sin(xb))
    try:
      jaxtier.offload(scan_step, policy={r"\\['params'\\]\\['layers'\\]": "host_stream"}).place(
          state, batch)
      error = ""
    except jaxtier.PlanError as e:
      error = str(e)
    _, m = jax.jit(scan_step)(state, batch)  # nothing placed or donated
    print("RESULT" + json.dumps({"error": error, "loss": float(m["loss"])}))
""")


@pytest.mark.slow
def test_host_stream_on_a_multi_device_mesh_is_refused_naming_why(tmp_path):
  # The streaming custom calls run on one device; XLA's SPMD partitioner refused them at the
  # first step ("Side-effect HLO must have sharding"). Planning says so first.
  out = _run(STREAM_SCRIPT, tmp_path)
  assert ("leaf ['params']['layers'] (float32[3, 16, 16]) cannot be placed 'host_stream': the "
          "state is sharded over a mesh of 8 devices") in out["error"], out["error"]
  assert out["loss"] > 0
