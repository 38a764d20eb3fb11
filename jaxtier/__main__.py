"""Command line: `python -m jaxtier <command> [--flags]`.

Commands:
  train   train the example Flax NNX decoder on real text (flags: see `--helpfull`;
          `--offload=auto` places state through `jaxtier.offload`).
  plan    print the plan `jaxtier.offload` would make for an example config, without
          allocating it (`--config`, `--batch_size`, `--seq_len`, `--device_budget`,
          `--host_budget`, `--json`).
"""

from __future__ import annotations

import sys

from absl import app

import jaxtier  # noqa: F401  (imports jax first)
from jaxtier.examples import train as train_lib

COMMANDS = ("train", "plan")


def main(argv: list[str]) -> None:
  if len(argv) < 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f"usage: python -m jaxtier {{{'|'.join(COMMANDS)}}} [--flags]; got "
                         f"{argv[1:]!r}")
  if len(argv) > 2:
    raise app.UsageError(f"unexpected arguments {argv[2:]!r}")
  if argv[1] == "train":
    train_lib.main(argv[:1])
  else:
    train_lib.plan_main(argv[:1])


if __name__ == "__main__":
  sys.exit(app.run(main))
