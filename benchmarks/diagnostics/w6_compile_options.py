"""W6's compute programs compiled under XLA scheduling options: their temporaries.

For the 1b decoder with a 131,072-token vocabulary (batch 8 x 1024), the table on the device
and read in place (`host_dha`, W6's variants), compiles the step's compute program with each
set of XLA GPU options and prints `memory_analysis()`'s argument, temporary and peak bytes:
whether the 0.57e9 bytes more temporaries of the host_dha program are the scheduler's.

  python3 benchmarks/diagnostics/w6_compile_options.py  # -> $OUT/w6/compile_options_<card>.json
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from absl import app  # pylint: disable=g-import-not-at-top

OPTIONS = {
    "default": {},
    "no_latency_hiding": {"xla_gpu_enable_latency_hiding_scheduler": False},
    "slop_50": {"xla_gpu_memory_limit_slop_factor": 50},
}


def main(argv):
  del argv
  import dataclasses  # pylint: disable=g-import-not-at-top
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top
  import jaxtier  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import llama, train_state  # pylint: disable=g-import-not-at-top
  import w6_dha  # pylint: disable=g-import-not-at-top

  vocab = 131072
  config = dataclasses.replace(llama.CONFIGS["1b"], vocab_size=vocab)
  opt = train_state.OptimizerConfig(learning_rate=1e-4)
  _, _, step = train_state.make_train_state(config, opt, abstract=True)
  init = train_state.state_initializer(config, opt)
  batch = jnp.asarray(w6_dha.zipf_tokens(np.random.default_rng(0), vocab, (8, 1025)))
  out = {}
  for variant in ("device", "host_dha"):
    off = jaxtier.offload(step, policy=w6_dha.embedding_policy(variant, "device"))
    state = off.init(init, example_args=(batch,))
    lowered = off.lower(state, batch)
    for name, options in OPTIONS.items():
      try:
        ma = lowered.compile(compiler_options=options).memory_analysis()
        got = {k: int(getattr(ma, k)) for k in ("argument_size_in_bytes", "temp_size_in_bytes",
                                                "output_size_in_bytes", "alias_size_in_bytes")}
        got["peak"] = got["argument_size_in_bytes"] + got["temp_size_in_bytes"]
      except Exception as e:  # pylint: disable=broad-except
        got = {"error": str(e)[:300]}
      out[f"{variant}:{name}"] = got
      print(variant, name, got, flush=True)
    del state
  import bench_util  # pylint: disable=g-import-not-at-top
  dev = bench_util.device_name()
  record = {"command": " ".join([os.path.basename(sys.executable)] + sys.argv),
            "date": bench_util.utc_now(), "commit": bench_util.git_commit(),
            "card": bench_util.card(dev), "device": dev, **out}
  bench_util.write_json(record, os.environ.get("OUT", "/tmp"),
                        f"w6/compile_options_{record['card']}.json")


if __name__ == "__main__":
  app.run(main)
