"""Shared test setup: CPU tests run everywhere; GPU tests skip unless a GPU is present.

`JAXTIER_REQUIRE_GPU=1` (set by the H200 benchmark scripts) turns a GPU skip into a failure.
The planner's hardware profile cache (`jaxtier calibrate` writes it under XDG_CACHE_HOME) is a
fresh empty directory for the test session, so that a profile calibrated on this machine does
not change what the tests plan: every test sees the defaults unless it writes its own.
"""

import os
import tempfile

os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="jaxtier-tests-cache-")

import jax
import optax
import pytest

jax.config.update("jax_default_matmul_precision", "highest")


def has_gpu() -> bool:
  try:
    return bool(jax.devices("gpu"))
  except RuntimeError:
    return False


@pytest.fixture
def gpu():
  if not has_gpu():
    if os.environ.get("JAXTIER_REQUIRE_GPU") == "1":
      pytest.fail("JAXTIER_REQUIRE_GPU=1 but JAX sees no GPU")
    pytest.skip("needs a GPU")
  return jax.devices("gpu")[0]


def optax_train_step(tx, loss_fn):
  """`train_step(state, (x, y)) -> (state, {"loss": ...})` over `{"params", "opt"}` with `tx`."""
  def train_step(state, batch):
    x, y = batch
    loss, g = jax.value_and_grad(loss_fn)(state["params"], x, y)
    u, o = tx.update(g, state["opt"], state["params"])
    return {"params": optax.apply_updates(state["params"], u), "opt": o}, {"loss": loss}
  return train_step


def pytest_terminal_summary(terminalreporter):
  """One line per reason the skipped tests give, with a count (most: they need a GPU)."""
  skipped = terminalreporter.stats.get("skipped", [])
  reasons: dict[str, int] = {}
  for report in skipped:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    reason = reason.removeprefix("Skipped: ")
    reasons[reason] = reasons.get(reason, 0) + 1
  if reasons:
    terminalreporter.write_line(f"skipped: {len(skipped)} tests: " + "; ".join(
        f"{n} {reason}" for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])))
