"""Shared test setup: CPU tests run everywhere; GPU tests skip unless a GPU is present.

`JAXTIER_REQUIRE_GPU=1` (set by the H200 benchmark scripts) turns a GPU skip into a failure.
"""

import os

import jax
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
