"""Fixtures of the custom-call tests."""

import jax
import pytest


@pytest.fixture
def cpu_unless_gpu(request):
  """Runs a test on the CPU backend wherever it runs (on a GPU machine too), unless it takes the
  `gpu` fixture: a module whose CPU tests check the CPU handlers uses it for every test."""
  if "gpu" in request.fixturenames:
    yield
  else:
    with jax.default_device(jax.devices("cpu")[0]):
      yield
