"""Trains the example Flax NNX decoder; the same as `python -m jaxtier train` (see README.md)."""

from absl import app

import jaxtier  # noqa: F401  (imports jax before jaxtier's extension)
from jaxtier.examples import train

if __name__ == "__main__":
  app.run(train.main)
