"""Command line: `python -m jaxtier <command> [--flags]`.

Commands:
  train   train the example Flax NNX decoder on real text (flags: see `--helpfull`;
          `--offload=auto` places state through `jaxtier.offload`).
  plan    print the plan `jaxtier.offload` would make for an example config, without
          allocating it (`--config`, `--batch_size`, `--seq_len`, `--device_budget`,
          `--host_budget`, `--json`, `--platform`).
  calibrate  measure this machine's host-update rates (the CPU executor today; the GPU
          rates keep MEASURED.md's H200 defaults) and store the profile as JSON in the user's
          cache directory (`--json` prints it).
"""

from __future__ import annotations

import logging
import sys

from absl import app
from absl import flags

import jaxtier  # (imports jax first)
from jaxtier.examples import train as train_lib

COMMANDS = ("train", "plan", "calibrate")
_JSON = flags.DEFINE_bool("json", False, "plan: print the plan as JSON.")
_PLATFORM = flags.DEFINE_enum("platform", None, ["cpu", "gpu"],
                              "plan: plan for this platform's executors (default: this machine's).")


def plan_main() -> None:
  """Prints the plan for the example decoder config of `--config`, allocating nothing."""
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
  config = llama.CONFIGS[flags.FLAGS.config]
  defaults = train_lib.RUN_DEFAULTS.get(flags.FLAGS.config)
  batch = flags.FLAGS.batch_size or (defaults.batch_size if defaults else 8)
  seq_len = flags.FLAGS.seq_len or config.max_seq_len
  _, state, step = train_lib.make_train_state(config, 1e-3, abstract=True)
  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
  platform = _PLATFORM.value or jax.default_backend()
  refused = None
  try:
    plan = jaxtier.plan(step, state, tokens, device_budget=flags.FLAGS.device_budget or None,
                        host_budget=flags.FLAGS.host_budget or None, platform=platform)
  except jaxtier.PlanError as e:
    if e.plan is None:
      raise app.UsageError(str(e)) from e
    plan, refused = e.plan, str(e)
  if _JSON.value:
    print(plan.to_json())
    return
  if platform == "gpu" and jax.default_backend() != "gpu":
    print("note: no GPU here; planning for a GPU with the stored or default hardware profile "
          "(pinnable host memory not checked)")
  print(f"config {flags.FLAGS.config}: {llama.param_count(config):,} params, batch {batch} x "
        f"seq {seq_len}")
  print(plan)
  if refused:
    print(f"REFUSED: {refused.removeprefix('jaxtier: ')}")
    sys.exit(1)


def main(argv: list[str]) -> None:
  # JAX logs at INFO that it found no TPU; the commands' own output is what matters here.
  logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)
  if len(argv) < 2 or argv[1] not in COMMANDS:
    raise app.UsageError(f"usage: python -m jaxtier {{{'|'.join(COMMANDS)}}} [--flags]; got "
                         f"{argv[1:]!r}")
  if len(argv) > 2:
    raise app.UsageError(f"unexpected arguments {argv[2:]!r}")
  if argv[1] == "train":
    train_lib.main(argv[:1])
  elif argv[1] == "plan":
    plan_main()
  else:
    calibrate_main()


def calibrate_main() -> None:
  """Measures and stores a `HardwareProfile`; says which figures are defaults."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top

  from jaxtier._src import profile  # pylint: disable=g-import-not-at-top
  prof = profile.calibrate()
  path = profile.save(prof)
  if _JSON.value:
    print(json.dumps(dataclasses.asdict(prof), indent=1))
    return
  if jax.default_backend() != "gpu":
    print("warning: no GPU here: link, zero-copy and DHA rates are the H200 defaults "
          "(../shared/MEASURED.md); only the host CPU executor was measured")
  for field in dataclasses.fields(prof):
    print(f"{field.name:<28} {getattr(prof, field.name):.4g}")
  print(f"split share of the DHA kernel: {profile.split_fraction(prof):.3f}")
  print(f"saved to {path}")


if __name__ == "__main__":
  sys.exit(app.run(main))
