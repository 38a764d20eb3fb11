"""Fast tests of the example model, data pipeline and trainer (CPU, < 1 minute)."""

import math

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtier._src.hardware import host as host_lib
from jaxtier.examples import data, llama, train

MICRO = llama.LlamaConfig(d_model=32, num_layers=2, num_heads=2, d_ff=64,
                          max_seq_len=32)


@pytest.fixture(scope="module")
def corpus():
  files = data.default_corpus_files()
  return data.load_tokens(files[:40], max_bytes=200_000)


def test_model_output_shape_and_param_count():
  model = llama.init_model(MICRO, seed=0)
  logits = model(jnp.zeros((3, 10), jnp.int32))
  assert logits.shape == (3, 10, MICRO.vocab_size)
  assert logits.dtype == jnp.float32
  params = nnx.state(model, nnx.Param)
  assert sum(x.size for x in jax.tree.leaves(params)) == llama.param_count(MICRO)
  # Layer weights are stacked: one leaf per weight with a leading num_layers axis.
  assert params["layers"]["attn"]["wq"][...].shape == (2, 32, 2, 16)
  assert params["layers"]["mlp"]["w_down"][...].shape == (2, 64, 32)


@pytest.mark.parametrize("name", list(llama.CONFIGS))
def test_param_count_of_named_configs(name):
  count = llama.param_count(llama.CONFIGS[name])
  expected = {"tiny": (3e5, 1e6), "small": (1.5e7, 2.5e7), "1b": (0.95e9, 1.1e9),
              "8b": (7e9, 9e9), "13b": (12e9, 14e9)}[name]
  assert expected[0] <= count <= expected[1]


def test_init_is_deterministic_and_causal():
  a, b = llama.init_model(MICRO, 7), llama.init_model(MICRO, 7)
  for x, y in zip(jax.tree.leaves(nnx.state(a)), jax.tree.leaves(nnx.state(b))):
    np.testing.assert_array_equal(x, y)
  tokens = jnp.arange(12, dtype=jnp.int32)[None]
  changed = tokens.at[0, 8].set(200)
  np.testing.assert_allclose(a(tokens)[0, :8], a(changed)[0, :8], atol=1e-5)


def test_initial_loss_near_uniform(corpus):
  model = llama.init_model(MICRO, seed=0)
  batch = jnp.asarray(next(data.batches(corpus, 4, 32, seed=0)))
  loss = llama.loss_fn(model, batch)
  assert loss.dtype == jnp.float32
  assert abs(float(loss) - math.log(256)) < 0.3


def test_bf16_compute():
  config = llama.LlamaConfig(d_model=32, num_layers=1, num_heads=2, d_ff=64,
                             max_seq_len=16, dtype=jnp.bfloat16,
                             remat_policy="nothing_saveable")
  model = llama.init_model(config, seed=0)
  batch = jnp.ones((2, 9), jnp.int32)
  loss, grads = nnx.value_and_grad(llama.loss_fn)(model, batch)
  assert loss.dtype == jnp.float32 and math.isfinite(float(loss))
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads))


def test_config_errors():
  with pytest.raises(ValueError, match="num_heads"):
    llama.LlamaConfig(d_model=30, num_layers=1, num_heads=4, d_ff=8, max_seq_len=8)
  with pytest.raises(ValueError, match="remat_policy"):
    llama.LlamaConfig(d_model=32, num_layers=1, num_heads=2, d_ff=8,
                      max_seq_len=8, remat_policy="nope")


def test_default_corpus_files_sorted_stdlib():
  files = data.default_corpus_files()
  assert len(files) > 100
  assert all(f.suffix == ".py" for f in files)
  assert not any("site-packages" in f.parts for f in files)
  assert files == data.default_corpus_files()


def test_load_text_and_token_files(tmp_path):
  text = tmp_path / "a.txt"
  text.write_text("héllo", encoding="utf-8")
  tokens = data.load_tokens([text])
  assert tokens.dtype == np.uint16
  assert bytes(tokens.astype(np.uint8)) == "héllo".encode("utf-8")
  token_file = tmp_path / "t.u16"
  np.array([1, 2, 300], "<u2").tofile(token_file)
  np.testing.assert_array_equal(data.load_tokens([token_file], vocab_size=512),
                                [1, 2, 300])
  assert data.load_tokens([text, text], max_bytes=8).size == 8


def test_load_errors(tmp_path):
  empty = tmp_path / "empty.txt"
  empty.write_bytes(b"")
  with pytest.raises(ValueError, match="empty.txt"):
    data.load_tokens([empty])
  with pytest.raises(ValueError, match="at least one path"):
    data.load_tokens([])
  odd = tmp_path / "odd.bin"
  odd.write_bytes(b"abc")
  with pytest.raises(ValueError, match=r"odd\.bin.*3 bytes"):
    data.load_tokens([odd])
  big = tmp_path / "big.u16"
  np.array([5, 256], "<u2").tofile(big)
  with pytest.raises(ValueError, match=r"big\.u16.*256"):
    data.load_tokens([big], vocab_size=256)
  with pytest.raises(FileNotFoundError):
    data.load_tokens([tmp_path / "missing.txt"])


def test_batches(corpus):
  with pytest.raises(ValueError, match="at least seq_len \\+ 1 = 11"):
    data.batches(np.arange(10, dtype=np.uint16), 2, 10, seed=0)
  it_a = data.batches(corpus, 3, 16, seed=5)
  it_b = data.batches(corpus, 3, 16, seed=5)
  for _ in range(3):
    a, b = next(it_a), next(it_b)
    assert a.shape == (3, 17) and a.dtype == np.int32
    np.testing.assert_array_equal(a, b)
  tokens = np.arange(20, dtype=np.uint16)
  batch = next(data.batches(tokens, 4, 19, seed=0))
  np.testing.assert_array_equal(batch, np.tile(np.arange(20), (4, 1)))


def test_train_step_keeps_state_structure():
  _, state, train_step = train.make_train_state(MICRO, 1e-3, seed=0)
  batch = jax.ShapeDtypeStruct((2, 9), jnp.int32)
  new_state, metrics = jax.eval_shape(train_step, state, batch)
  assert jax.tree.structure(new_state) == jax.tree.structure(state)
  for new, old in zip(jax.tree.leaves(new_state), jax.tree.leaves(state)):
    assert (new.shape, new.dtype) == (old.shape, old.dtype)
  assert metrics["loss"].shape == () and metrics["loss"].dtype == jnp.float32


def _run(corpus, **kwargs):
  kwargs = dict(config_name="tiny", config=MICRO, steps=20, batch_size=8,
                seq_len=32, data=corpus, seed=0, learning_rate=1e-2,
                log_every=10, progress=False) | kwargs
  return train.run(**kwargs)


def test_run_loss_falls(corpus):
  result = _run(corpus)
  losses = result["losses"]
  assert len(losses) == 20 and len(result["step_times"]) == 20
  assert all(math.isfinite(x) for x in losses)
  assert np.mean(losses[-5:]) < np.mean(losses[:5]) - 0.5
  assert result["tokens_per_sec"] > 0


def test_run_is_deterministic(corpus):
  a = _run(corpus, steps=5, clip=True, log_every=2)
  b = _run(corpus, steps=5, clip=True, log_every=5)
  assert a["losses"] == b["losses"]
  c = _run(corpus, steps=5, clip=True, seed=1)
  assert c["losses"] != a["losses"]


def test_decoder_offloaded_equals_device_50_steps(corpus):
  # The bar: same seed, 50 steps, fp32: loss traces equal within 1e-5 relative.
  ref = _run(corpus, steps=50, offload="none", log_every=50)
  got = _run(corpus, steps=50, offload="optimizer_state_on_host", log_every=50)
  np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
  assert np.mean(ref["losses"][-5:]) < np.mean(ref["losses"][:5]) - 0.5
  # Every AdamW moment lives in pinned_host and is updated there; params stay on device.
  executor = "host_dha" if jax.default_backend() == "gpu" else "host_cpu"
  assert executor in got["plan"] and "optimizer_state" in got["plan"]


def test_decoder_streamed_params_equal_device(corpus):
  # The layer stack's params placed host_stream (fetched layer by layer in the forward and the
  # backward scans, gradients sent to pinned_host): the loss trace equals the device run's.
  ref = _run(corpus, steps=20, offload="none", log_every=20)
  got = _run(corpus, steps=20, offload="stream", log_every=20, clip=False)
  np.testing.assert_allclose(got["losses"], ref["losses"], rtol=1e-5)
  assert "host_stream" in got["plan"] and "['layers']" in got["plan"]


def test_run_offload_auto_passes_budgets(corpus):
  import jaxtier
  with pytest.raises(jaxtier.AdmissionError, match=r"over the host budget of 1000 B"):
    _run(corpus, steps=1, offload="optimizer_state_on_host", host_budget="1000")


def test_run_over_budget_raises_before_training_unless_allowed(corpus, capsys):
  with pytest.raises(train.OverBudgetError, match=r"the plan does not fit: peak device memory "
                     r".* over the --device_budget of 1.00 MiB\. Fix: a larger --device_budget"):
    _run(corpus, steps=1, offload="optimizer_state_on_host", device_budget="1MiB",
         allow_over_budget=False)
  out = capsys.readouterr().out
  assert "jaxtier plan" in out and "done: loss" not in out  # planned, printed, no step ran
  assert not any(line.startswith("step ") for line in out.splitlines())
  # Without a budget given nothing is checked; with allow_over_budget (run's default) it trains.
  assert len(_run(corpus, steps=1, offload="optimizer_state_on_host",
                  allow_over_budget=False)["losses"]) == 1
  assert len(_run(corpus, steps=1, offload="optimizer_state_on_host",
                  device_budget="1MiB")["losses"]) == 1


def test_run_offload_none_says_budgets_are_not_used(corpus, capsys):
  _run(corpus, steps=1, offload="none", device_budget="1MiB")
  out = capsys.readouterr().out
  assert ("warning: --device_budget=1MiB not used: --offload=none runs jax.jit with all state "
          "on the device") in out
  _run(corpus, steps=1, offload="none")
  assert "warning" not in capsys.readouterr().out


def test_run_rejects_bad_arguments(corpus):
  with pytest.raises(ValueError, match="offload"):
    _run(corpus, offload="sometimes")
  with pytest.raises(ValueError, match="config"):
    train.run(config_name="nope", data=corpus, progress=False)


def test_bf16_params_get_masters_under_remat_and_scan():
  # nnx.scan with a remat policy hands the stacked params back out of the scan; the optimizer
  # update reads that pass-through, which must still count as reading the param (fp32 master).
  import dataclasses

  import jaxtier
  cfg = dataclasses.replace(MICRO, param_dtype=jnp.bfloat16,
                            remat_policy="dots_with_no_batch_dims_saveable")
  _, state, step = train.make_train_state(cfg, 1e-3, abstract=True)
  plan = jaxtier.plan(step, state, jax.ShapeDtypeStruct((2, 9), jnp.int32),
                      policy="optimizer_state_on_host")
  params = [l for l in plan.leaves if l.path.startswith("[0]")]
  assert params and all(l.master_nbytes == l.nbytes * 2 for l in params), [
      (l.path, l.master_nbytes) for l in params if l.master_nbytes != l.nbytes * 2]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="checks the CPU backend's host memory")
def test_run_refuses_a_state_larger_than_host_memory_before_allocating(corpus, monkeypatch):
  # On the CPU backend the state is built in host memory: a config whose state exceeds what
  # the host has available is refused with the sizes before anything is allocated (it used to
  # end in an allocator abort). `small` needs ~0.2 GiB; the host is made to have 64 MiB.

  monkeypatch.setattr(host_lib, "available_bytes", lambda: 64 << 20)
  built = []
  monkeypatch.setattr(train, "make_train_state",
                      lambda *a, **k: built.append(k.get("abstract")) or
                      _real_make_train_state(*a, **k))
  with pytest.raises(ValueError, match=r"the small state .* needs [0-9.]+ GiB of host memory "
                     r"to build here, and this host has 0\.06 GiB available; use a smaller"):
    train.run(config_name="small", steps=1, data=corpus, progress=False)
  assert built == [True]  # only the abstract (eval_shape) state was made


_real_make_train_state = train.make_train_state
