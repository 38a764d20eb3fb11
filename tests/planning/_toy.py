"""Shared by the planning tests: a hardware profile of round numbers and a toy MLP train step.

`P` has round rates, so that the costs the formula and solver tests expect are computed by
hand. `STEP` trains a two-layer MLP (`mlp_state()`, 256 wide) with AdamW on `toy_batch()`:
small enough to plan, compile and run in about a second on the CPU.
"""

from conftest import optax_train_step
import jax
import jax.numpy as jnp
import optax

from jaxtier._src.hardware import profile

# The executor of host-resident updates: the DHA kernel on a GPU, host CPU threads on the CPU.
HOST_EXEC = "host_dha" if jax.default_backend() == "gpu" else "host_cpu"
# Round numbers, so that every expected value in the tests is computed by hand.
P = profile.HardwareProfile(
    link_h2d_gbps=50.0, link_d2h_gbps=40.0, link_duplex_gbps=60.0, dha_read_gbps=100.0,
    dha_write_gbps=50.0, dha_rw_gbps=80.0, host_dram_gbps=100.0, cpu_adamw_params_per_sec=1e9,
    dha_adamw_params_per_sec=3e9, matmul_tflops=100.0, hbm_gbps=1000.0)
GB = 1e9

TX = optax.adamw(1e-2, weight_decay=0.1)


def mlp_state(seed=0, width=256):
  """`{"params": {"w1", "w2"}, "opt": TX.init(params)}`, normal(0, 0.05) weights."""
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  params = {"w1": jax.random.normal(k1, (width, width)) * 0.05,
            "w2": jax.random.normal(k2, (width, 8)) * 0.05}
  return {"params": params, "opt": TX.init(params)}


def _loss(p, x, y):
  return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2)


def toy_batch(width=256, seed=0):
  """`(x, y)`: 8 rows of normal `x` and `y = sin(x[:, :8])`."""
  k = jax.random.PRNGKey(10 + seed)
  x = jax.random.normal(k, (8, width))
  return x, jnp.sin(x[:, :8])


STEP = optax_train_step(TX, _loss)
