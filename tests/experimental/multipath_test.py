"""Multi-path fetch of a replicated pinned_host leaf (jaxtier/experimental/multipath.py).

The 8-device checks run in a subprocess (the forced device count must be set before JAX starts
its backend); the GPU test runs on every GPU the machine has.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from jaxtier.experimental import multipath

SCRIPT = textwrap.dedent("""
    import json, os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from jaxtier.experimental import multipath as mp

    out = {}
    mesh = Mesh(np.array(jax.devices()), ("d",))
    host = lambda a, m=mesh: jax.device_put(a, NamedSharding(m, P(), memory_kind="pinned_host"))
    rng = np.random.default_rng(0)
    for dtype in ("float32", "bfloat16"):
      w = jnp.asarray(rng.normal(size=(3, 64, 16)), dtype)
      wh = host(w)
      ws = jax.device_put(w, NamedSharding(mesh, mp.sharded_host_spec("d", 0, indexed=True),
                                           memory_kind="pinned_host"))
      for name, fetch, x in (
          ("multi", lambda x, i: mp.fetch_replicated(x, mesh, "d", index=i), wh),
          ("single", lambda x, i: mp.fetch_single_path(x, mesh, index=i), wh),
          ("sharded", lambda x, i: mp.fetch_sharded(x, mesh, "d", index=i), ws)):
        f = jax.jit(fetch)
        got = f(x, 2)
        hlo = f.lower(x, 2).compile().as_text()
        out[f"{name}_{dtype}"] = dict(
            equal=bool(np.array_equal(np.asarray(got, np.float32), np.asarray(w[2], np.float32))),
            kind=got.sharding.memory_kind, spec=str(got.sharding.spec), dtype=str(got.dtype),
            shape=list(got.shape), gathers=mp.count_all_gathers(hlo),
            reads=[[op, list(shape)] for _, op, shape, _ in mp.host_read_shapes(hlo)],
            host_param="S(5)" in hlo.split("ENTRY")[0])
    # Eager, whole leaf, split along axis 1; and inside lax.scan with the loop index.
    w = jnp.asarray(rng.normal(size=(2, 24, 64)), jnp.float32)
    wh = host(w)
    out["eager_split1"] = bool(np.array_equal(
        np.asarray(mp.fetch_replicated(wh, mesh, "d", split_axis=1)), np.asarray(w)))
    out["eager_single"] = bool(np.array_equal(np.asarray(mp.fetch_single_path(wh, mesh)),
                                              np.asarray(w)))
    ws = jax.device_put(w, NamedSharding(mesh, mp.sharded_host_spec("d", 1),
                                         memory_kind="pinned_host"))
    out["eager_sharded"] = bool(np.array_equal(
        np.asarray(mp.fetch_sharded(ws, mesh, "d", split_axis=1)), np.asarray(w)))
    x = jnp.asarray(rng.normal(size=(5, 24)), jnp.float32)
    def layers(fetch):
      def body(h, i):
        return jnp.tanh(h @ fetch(i)[:, :24]), None
      return jax.jit(lambda x: jax.lax.scan(body, x, jnp.arange(2))[0])
    want = layers(lambda i: w[i])(x)
    ws = jax.device_put(w, NamedSharding(mesh, mp.sharded_host_spec("d", 0, indexed=True),
                                         memory_kind="pinned_host"))
    for name, fetch in (("multi", lambda i: mp.fetch_replicated(wh, mesh, "d", index=i)),
                        ("single", lambda i: mp.fetch_single_path(wh, mesh, index=i)),
                        ("sharded", lambda i: mp.fetch_sharded(ws, mesh, "d", index=i))):
      out[f"scan_{name}"] = float(np.max(np.abs(np.asarray(layers(fetch)(x)) - np.asarray(want))))
    # A 4 x 2 mesh: the read is split over axis 'a' only (1/4 each), the gather runs over 'a'.
    mesh2 = Mesh(np.array(jax.devices()).reshape(4, 2), ("a", "b"))
    w = jnp.asarray(rng.normal(size=(64, 16)), jnp.float32)
    f = jax.jit(lambda x: mp.fetch_replicated(x, mesh2, "a"))
    wh = host(w, mesh2)
    hlo = f.lower(wh).compile().as_text()
    out["mesh2"] = dict(equal=bool(np.array_equal(np.asarray(f(wh)), np.asarray(w))),
                        reads=[list(s) for _, _, s, _ in mp.host_read_shapes(hlo)],
                        gathers=mp.count_all_gathers(hlo),
                        groups=mp.all_gather_groups(hlo),
                        groups_text=[l.split("replica_groups=")[1][:80]
                                     for l in hlo.splitlines() if "all-gather" in l])
    # Errors.
    errors = {}
    for name, call in (
        ("indivisible", lambda: mp.fetch_replicated(host(jnp.zeros((12, 4))), mesh, "d")),
        ("axis", lambda: mp.fetch_replicated(host(jnp.zeros((16, 4))), mesh, "x")),
        ("kind", lambda: mp.fetch_replicated(jax.device_put(jnp.zeros((16, 4)), NamedSharding(
            mesh, P())), mesh, "d")),
        ("index", lambda: mp.fetch_single_path(host(jnp.zeros((2, 8))), mesh, index=2)),
        ("spec", lambda: mp.fetch_sharded(host(jnp.zeros((16, 4))), mesh, "d"))):
      try:
        call()
        errors[name] = None
      except ValueError as e:
        errors[name] = str(e)
    out["errors"] = errors
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def eight(tmp_path_factory):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  env.pop("XLA_FLAGS", None)
  p = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env,
                     cwd=tmp_path_factory.mktemp("multipath"), timeout=300)
  line = [l for l in p.stdout.splitlines() if l.startswith("RESULT")]
  assert p.returncode == 0 and line, p.stderr[-4000:]
  return json.loads(line[0][len("RESULT"):])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_multi_path_equals_the_leaf_with_one_all_gather_and_an_eighth_read(eight, dtype):
  r = eight[f"multi_{dtype}"]
  assert r["equal"] and r["kind"] == "device" and r["dtype"] == dtype and r["shape"] == [64, 16]
  assert r["spec"] in ("P()", "PartitionSpec()")
  assert r["host_param"]  # the leaf enters the program in host memory (S(5)).
  assert r["gathers"] == 1
  # Each device reads one [64/8, 16] window of layer 2 out of the host leaf, nothing else.
  assert [shape for _, shape in r["reads"]] == [[8, 16]], r["reads"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_single_path_reads_the_whole_slice_without_collectives(eight, dtype):
  r = eight[f"single_{dtype}"]
  assert r["equal"] and r["kind"] == "device" and r["dtype"] == dtype
  assert r["gathers"] == 0
  assert [shape for _, shape in r["reads"]] == [[64, 16]], r["reads"]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sharded_storage_copies_the_local_eighth_and_gathers_once(eight, dtype):
  r = eight[f"sharded_{dtype}"]
  assert r["equal"] and r["kind"] == "device" and r["dtype"] == dtype and r["shape"] == [64, 16]
  assert r["host_param"] and r["gathers"] == 1
  assert [shape for _, shape in r["reads"]] == [[8, 16]], r["reads"]


def test_eager_split_axis_and_scan_index(eight):
  assert eight["eager_split1"] and eight["eager_single"] and eight["eager_sharded"]
  assert max(eight[f"scan_{k}"] for k in ("multi", "single", "sharded")) < 1e-6, eight


def test_two_axis_mesh_splits_over_the_named_axis_only(eight):
  r = eight["mesh2"]
  assert r["equal"] and r["gathers"] == 1 and r["reads"] == [[16, 16]], r
  # Gather groups: the 4 devices of one 'b' column each ({0,2,4,6} and {1,3,5,7}), in mesh
  # order along 'a' (the gather's concatenation order). XLA prints them in one of three forms
  # (jax 0.11: `mesh['a'=4,'b'=2] {'a'}`); all_gather_groups expands any of them.
  assert len(r["groups"]) == 1, r
  assert sorted(r["groups"][0]) == [[0, 2, 4, 6], [1, 3, 5, 7]], (r["groups"], r["groups_text"])


@pytest.mark.parametrize("text, want", [
    ("{{0,2,4,6},{1,3,5,7}}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("[2,4]<=[4,2]T(1,0)", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("[2,4]<=[8]", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    ("mesh['a'=4,'b'=2] {'a'}", [[0, 2, 4, 6], [1, 3, 5, 7]]),
    ("mesh['a'=4,'b'=2] {'b'}", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("mesh[a=4,b=2] {b,a}", [[0, 2, 4, 6, 1, 3, 5, 7]]),
    ("mesh['a'=4,'b'=2] {'a':(2)2}", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    ("mesh['a'=2,'b'=2], device_ids=(3,2,1,0) {'a'}", [[3, 1], [2, 0]]),
    ("{}", []),
])
def test_all_gather_groups_reads_every_replica_groups_form(text, want):
  line = (f"  %ag = f32[64,16]{{1,0}} all-gather(f32[16,16]{{1,0}} %p), channel_id=1, "
          f"replica_groups={text}, dimensions={{0}}, use_global_device_ids=true")
  assert multipath.all_gather_groups(line) == [want]
  assert multipath.all_gather_groups(line.replace("all-gather(", "all-gather-start(")) == [want]


def test_all_gather_groups_rejects_an_unknown_form():
  with pytest.raises(ValueError, match="unknown replica_groups form"):
    multipath.all_gather_groups("  %ag = f32[8] all-gather(f32[1] %p), replica_groups=<<0,1>>")


def test_errors_name_the_problem(eight):
  e = eight["errors"]
  assert "dimension 0 of the slice [12, 4] to divide by the 8 devices" in e["indivisible"]
  assert "axis_name to be one of the mesh axes ('d',), got 'x'" in e["axis"]
  assert "memory kind 'pinned_host', got 'device'" in e["kind"]
  assert "expected 0 <= index < 2" in e["index"]
  assert "expected the leaf sharded as P('d',), got P()" in e["spec"] or (
      "expected the leaf sharded as PartitionSpec('d',)" in e["spec"]), e["spec"]


def test_on_every_gpu(gpu):
  devices = jax.devices("gpu")
  mesh = Mesh(np.array(devices), ("d",))
  n = len(devices)
  w = jnp.asarray(np.random.default_rng(0).normal(size=(3, 64 * n, 128)), jnp.bfloat16)
  wh = jax.device_put(w, NamedSharding(mesh, P(), memory_kind="pinned_host"))
  ws = jax.device_put(w, NamedSharding(mesh, multipath.sharded_host_spec("d", 0, indexed=True),
                                       memory_kind="pinned_host"))
  for fetch, x in ((lambda x, i: multipath.fetch_replicated(x, mesh, "d", index=i), wh),
                   (lambda x, i: multipath.fetch_single_path(x, mesh, index=i), wh),
                   (lambda x, i: multipath.fetch_sharded(x, mesh, "d", index=i), ws)):
    f = jax.jit(fetch)
    got = f(x, 1)
    assert got.sharding.memory_kind == "device"
    for s in got.addressable_shards:
      np.testing.assert_array_equal(np.asarray(s.data, np.float32), np.asarray(w[1], np.float32))
  if n > 1:  # with one GPU the gather over a 1-device axis may be folded away.
    hlo = jax.jit(lambda x: multipath.fetch_replicated(x, mesh, "d", index=1)).lower(wh).compile()
    assert multipath.count_all_gathers(hlo.as_text()) == 1
