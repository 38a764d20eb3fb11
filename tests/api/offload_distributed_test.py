"""Offloaded training under `jax.distributed`: two processes on localhost, 2 CPU devices each.

Each test spawns two Python processes that join one JAX cluster (gloo collectives on CPU, the
default of `jax_cpu_collectives_implementation` on jax 0.10 and 0.11, set explicitly here) and
train the model below with `jaxtier.offload`, AdamW moments forced to `pinned_host`. The parent
(one CPU device) computes the reference with a plain `jax.jit` step and compares what each
process wrote: its losses and its addressable shards.
"""

import json
import os
import socket
import subprocess
import sys
import textwrap
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

STEPS = 5
TX = optax.adamw(1e-2, weight_decay=0.1)
POLICY = {r"\.(mu|nu)\[": "host_cpu"}  # AdamW's moments to pinned_host, whatever 'auto' says.
HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_SECS = 50


def loss_fn(p, x, y):
  return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def train_step(state, batch):
  x, y = batch
  loss, g = jax.value_and_grad(loss_fn)(state["params"], x, y)
  u, o = TX.update(g, state["opt"], state["params"])
  return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": loss}


def host_data(seed=0):
  """(params, x, y) as numpy float32: w1 [64, 32], w2 [32, 8], x [16, 64], y [16, 8]."""
  rng = np.random.default_rng(seed)
  params = {"w1": (rng.normal(size=(64, 32)) * 0.1).astype(np.float32),
            "w2": (rng.normal(size=(32, 8)) * 0.1).astype(np.float32)}
  x = rng.normal(size=(16, 64)).astype(np.float32)
  return params, x, np.sin(x[:, :8])


def reference(seed=0, steps=STEPS):
  """Losses and final state (numpy pytree) of the same training on one device with jax.jit."""
  params, x, y = host_data(seed)
  state = {"params": jax.tree.map(jnp.asarray, params), "opt": TX.init(params)}
  step = jax.jit(train_step, donate_argnums=0)
  losses = []
  for _ in range(steps):
    state, m = step(state, (jnp.asarray(x), jnp.asarray(y)))
    losses.append(float(m["loss"]))
  return np.asarray(losses), jax.tree.map(np.asarray, state)


WORKER = textwrap.dedent("""
    import json, sys
    pid, port, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=pid, initialization_timeout=40)
    import jax.numpy as jnp, numpy as np
    from jax.experimental import multihost_utils
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    import jaxtier
    import offload_distributed_test as T

    assert jax.process_count() == 2 and jax.device_count() == 4, jax.devices()
    mesh = Mesh(np.array(jax.devices()), ("d",))
    params, x, y = T.host_data()
    fsdp = lambda a: P("d") if np.ndim(a) else P()
    put = lambda a: jax.make_array_from_callback(
        np.shape(a), NamedSharding(mesh, fsdp(a)), lambda idx: np.asarray(a)[idx])
    params = jax.tree.map(put, params)
    opt_shape = jax.eval_shape(T.TX.init, params)
    opt = jax.jit(T.TX.init, out_shardings=jax.tree.map(
        lambda s: NamedSharding(mesh, fsdp(s)), opt_shape))(params)
    batch = (put(x), put(y))
    step = jaxtier.offload(T.train_step, policy=T.POLICY)
    state = step.place({"params": params, "opt": opt}, batch)
    losses = []
    for _ in range(T.STEPS):
      state, m = step(state, batch)
      losses.append(float(m["loss"]))

    mine = sorted(d.id for d in mesh.devices.flat if d.process_index == pid)
    leaves, shards = {}, {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(state)[0]:
      name = jax.tree_util.keystr(path)
      info = leaves[name] = dict(kinds=[], devices=[], slices=[],
                                 fully_addressable=leaf.is_fully_addressable,
                                 global_devices=sorted(d.id for d in leaf.sharding.device_set))
      for s in leaf.addressable_shards:
        info["kinds"].append(s.data.sharding.memory_kind)
        info["devices"].append(s.device.id)
        info["slices"].append([[sl.start or 0, sl.stop if sl.stop is not None else n]
                               for sl, n in zip(s.index, leaf.shape)])
        shards[f"{name}@{s.device.id}"] = np.asarray(s.data)
    gathered = multihost_utils.process_allgather(state["params"], tiled=True)
    for k, v in gathered.items():
      shards[f"gathered:{k}"] = np.asarray(v)
    hlo = step.lower_update(state, batch).compile().as_text()

    # Admission counts both local devices' shards against this host's free memory.
    from jaxtier._src.hardware import host as host_lib
    host_bytes = step.plan.pinned_bytes  # per device
    admitted, real = {}, host_lib.available_bytes
    for avail in (2 * host_bytes - 1, 2 * host_bytes):
      host_lib.available_bytes = lambda: avail
      try:
        jaxtier.plan(T.train_step, state, batch, policy=T.POLICY)
        admitted[avail] = True
      except jaxtier.AdmissionError as e:
        admitted[avail] = str(e)
    host_lib.available_bytes = real

    # A state of numpy leaves, different in each process: each trains its own copy on its own
    # first device (nothing global).
    local_run = dict(error=None)
    try:
      lp, lx, ly = T.host_data(seed=1 + pid)
      local = jaxtier.offload(T.train_step, policy="optimizer_state_on_host")
      ls = local.place({"params": lp, "opt": jax.tree.map(np.asarray, T.TX.init(lp))}, (lx, ly))
      local_run["losses"] = []
      for _ in range(3):
        ls, m = local(ls, (lx, ly))
        local_run["losses"].append(float(m["loss"]))
      local_run["devices"] = sorted({d.id for a in jax.tree.leaves(ls)
                                     for d in a.sharding.device_set})
      local_run["kind"] = ls["opt"][0].mu["w1"].sharding.memory_kind
    except Exception as e:  # reported by its own test; the other results still count.
      local_run["error"] = f"{type(e).__name__}: {e}"[:2000]

    np.savez(f"{out}/shards{pid}.npz", **shards)
    with open(f"{out}/result{pid}.json", "w") as f:
      json.dump(dict(
          losses=losses, mine=mine, leaves=leaves, placements=step.plan.placements(),
          plan_nbytes={l.path: l.nbytes for l in step.plan.leaves},
          host_update_calls=hlo.count('custom_call_target="jaxtier_host_update_ffi"'),
          local_run=local_run, pinned_bytes=host_bytes,
          admitted=[[k, v] for k, v in admitted.items()]), f)
    print("DONE", pid, flush=True)
""")


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("localhost", 0))
    return s.getsockname()[1]


def _run_cluster(out_dir) -> list[dict]:
  """Runs WORKER as processes 0 and 1; returns their result dicts (shards under 'npz')."""
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             XLA_FLAGS="--xla_force_host_platform_device_count=2",
             PYTHONPATH=os.pathsep.join([HERE, os.environ.get("PYTHONPATH", "")]))
  # Not the session's compilation cache (conftest.py): the two workers run at once, and one
  # could read an entry the other is still writing.
  env.pop("JAX_COMPILATION_CACHE_DIR", None)
  port = _free_port()
  procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(i), str(port), str(out_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd=out_dir) for i in range(2)]
  logs = []
  deadline = time.monotonic() + TIMEOUT_SECS
  try:
    for p in procs:
      logs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic())))
  except subprocess.TimeoutExpired:
    for p in procs:
      p.kill()
    logs = [p.communicate() for p in procs]
    pytest.fail("jax.distributed workers timed out after %d s:\n%s" % (
        TIMEOUT_SECS, "\n".join(f"--- process {i} stderr:\n{e[-3000:]}"
                                for i, (_, e) in enumerate(logs))))
  for i, (p, (o, e)) in enumerate(zip(procs, logs)):
    assert p.returncode == 0 and f"DONE {i}" in o, f"process {i} failed:\n{o[-1000:]}\n{e[-4000:]}"
  results = []
  for i in range(2):
    with open(out_dir / f"result{i}.json") as f:
      r = json.load(f)
    r["npz"] = dict(np.load(out_dir / f"shards{i}.npz"))
    results.append(r)
  return results


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
  return _run_cluster(tmp_path_factory.mktemp("cluster"))


def _named(state):
  return {jax.tree_util.keystr(p): np.asarray(v)
          for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


HOST_LEAVES = [f"['opt'][0].{m}['{w}']" for m in ("mu", "nu") for w in ("w1", "w2")]


def test_host_leaves_live_in_each_process_pinned_host_as_its_own_shards(cluster):
  for pid, r in enumerate(cluster):
    assert r["mine"] == ([0, 1] if pid == 0 else [2048, 2049]), r["mine"]
    for name in HOST_LEAVES:
      leaf = r["leaves"][name]
      assert r["placements"][name] == "host_cpu", (pid, name)
      assert leaf["kinds"] == ["pinned_host", "pinned_host"], (pid, name, leaf["kinds"])
      # Only this process's devices, the leaf spread over all four, rows split four ways.
      assert sorted(leaf["devices"]) == r["mine"] and not leaf["fully_addressable"], (pid, name)
      assert leaf["global_devices"] == [0, 1, 2048, 2049], (pid, name)
      rows = leaf["slices"][0][0]
      n = rows[1] - rows[0]
      assert n * 4 == (64 if "w1" in name else 32), (pid, name, leaf["slices"])
      assert r["plan_nbytes"][name] == n * (32 if "w1" in name else 8) * 4, (pid, name)
    for name in ("['params']['w1']", "['params']['w2']"):
      assert r["leaves"][name]["kinds"] == ["device", "device"], (pid, name)
    # Two calls per param, as on one process: its new value on the device, then its mu and
    # nu together in place in pinned_host.
    assert r["host_update_calls"] == 4, r["host_update_calls"]


def test_losses_and_shards_equal_a_one_device_reference(cluster):
  ref_losses, ref_state = reference()
  ref = _named(ref_state)
  for pid, r in enumerate(cluster):
    np.testing.assert_allclose(r["losses"], ref_losses, rtol=1e-5, err_msg=f"process {pid}")
    checked = 0
    for name, leaf in r["leaves"].items():
      for dev, sl in zip(leaf["devices"], leaf["slices"]):
        got = r["npz"][f"{name}@{dev}"]
        want = ref[name][tuple(slice(a, b) for a, b in sl)]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7,
                                   err_msg=f"process {pid}, {name} on device {dev}")
        checked += 1
    assert checked >= 2 * len(HOST_LEAVES)
    for w in ("w1", "w2"):
      np.testing.assert_allclose(r["npz"][f"gathered:{w}"], ref[f"['params']['{w}']"],
                                 rtol=1e-5, atol=1e-7, err_msg=f"process {pid}, allgathered {w}")


def test_process_local_numpy_state_stays_on_its_own_device(cluster):
  # A state of numpy leaves has no mesh: each process must train its own copy on its own first
  # device (not process 0's, where process 1's state would be lost).
  for pid, r in enumerate(cluster):
    run = r["local_run"]
    assert run["error"] is None, (pid, run["error"])
    assert run["devices"] == [0 if pid == 0 else 2048], (pid, run["devices"])
    assert run["kind"] == "pinned_host"
    ref_losses, _ = reference(seed=1 + pid, steps=3)
    np.testing.assert_allclose(run["losses"], ref_losses, rtol=1e-5, err_msg=f"process {pid}")


def test_admission_counts_every_local_device_against_the_host(cluster):
  # Per device, each process pins its shards of w1's and w2's moments (fp32, a quarter each);
  # its 2 devices together need twice that from the host.
  per_device = 2 * (64 * 32 + 32 * 8) * 4 // 4
  for pid, r in enumerate(cluster):
    assert r["pinned_bytes"] == per_device, (pid, r["pinned_bytes"])
    (short, refused), (enough, admitted) = r["admitted"]
    assert short == 2 * per_device - 1 and enough == 2 * per_device
    assert admitted is True, (pid, admitted)
    assert refused is not True and "each local device's share" in refused, (pid, refused)
    assert f"({per_device - 1} bytes)" in refused, (pid, refused)
