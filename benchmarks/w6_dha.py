"""W6: an embedding table read in place (host_dha) against the table on the device and streamed.

Trains the example decoder (`--configs`, each with every vocabulary of `--vocabs`) for `--steps`
steps through `jaxtier.offload`, one process per variant so that each peak HBM is its own. The
variants differ only in where the embedding table and its AdamW moments live:

  device      table, moments and gradient in HBM (the table's update on the device)
  state_host  table in HBM, its moments in pinned_host (updated there by host_cpu)
  host_xla    table in pinned_host, copied whole to the device for the step (XLA's transfers:
              the table streamed), moments on the host
  host_dha    table in pinned_host, its rows gathered in place by the DHA kernel and its
              gradient rows scatter-added into a pinned_host buffer; moments on the host

Everything else is placed by `--rest`: `device`, or `host` (every other optimizer-state leaf in
pinned_host, updated by host_cpu, layer by layer inside the backward pass). The tokens are
synthetic: Zipf-distributed ids (exponent 1.1) over the vocabulary, so that the ids repeat
within a batch as a real text's do; step time does not depend on what the text says.

Each variant also times, alone, the gather of that batch's ids from the pinned_host table
against copying the whole table to the device (`gather_secs`, `stream_secs`): the ratio the
issue's must-show compares against. Writes `$OUT/w6/<configs>_<vocabs>_<card>.json`
(bench_util's schema) and prints a table.

  python benchmarks/w6_dha.py --configs=1b --vocabs=32768,131072 --steps=8
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from typing import Any

from absl import app, flags

import bench_util  # (sibling module)

_CONFIGS = flags.DEFINE_list("configs", ["1b"], "Example decoder configs (llama.CONFIGS).")
_VOCABS = flags.DEFINE_list("vocabs", ["32768", "131072"], "Vocabulary sizes.")
_VARIANTS = flags.DEFINE_list("variants", ["device", "state_host", "host_xla", "host_dha"],
                              "Where the embedding table lives (see the module docstring).")
_REST = flags.DEFINE_enum("rest", "device", ["device", "host"], "Where the other leaves live.")
_STEPS = flags.DEFINE_integer("steps", 8, "Steps per variant (the first is not timed).")
_BATCH = flags.DEFINE_integer("batch_size", 8, "Sequences per step.")
_SEQ = flags.DEFINE_integer("seq_len", 1024, "Tokens per sequence.")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "/tmp"), "Where the JSON goes.")
_RESULT = flags.DEFINE_string(
    "result", "w6/{configs}_{vocabs}_{card}.json",
    "The JSON's file name under --out; {configs}, {vocabs} (in k tokens) and {card} are "
    "filled in.")
_CHILD = flags.DEFINE_string("child", "", "Internal: run one 'config:vocab:variant'.")
_TIMEOUT = flags.DEFINE_integer("timeout", 400, "Seconds per variant before it is stopped.")
_HLO_DIR = flags.DEFINE_string("hlo_dir", "", "Where each variant writes its compiled step's "
                               "HLO text and buffer sizes (for reading its peak); '' for none.")

EMBED = "['embed']"


def embedding_policy(variant: str, rest: str):
  """The `jaxtier.offload` policy (a callable) of one variant."""
  table = {"device": "device", "state_host": "device", "host_xla": "host_xla",
           "host_dha": "host_dha"}[variant]

  def policy(path: str, leaf) -> "str | None":
    if EMBED in path:
      if leaf.role == "param":
        return table
      if leaf.role == "optimizer_state":
        return "device" if variant == "device" else "host_cpu"
    if leaf.role == "optimizer_state":
      return "host_cpu" if rest == "host" else "device"
    return "device" if leaf.role == "param" else None
  return policy


def zipf_tokens(rng: Any, vocab: int, shape: Any) -> Any:
  """Ids in [0, vocab) with a Zipf(1.1) rank distribution (rank r -> id r - 1)."""
  import numpy as np  # pylint: disable=g-import-not-at-top
  ids = rng.zipf(1.1, size=shape) - 1
  return np.where(ids < vocab, ids, rng.integers(0, vocab, size=shape)).astype(np.int32)


def _peak_rss_bytes() -> int:
  with open("/proc/self/status") as f:
    for line in f:
      if line.startswith("VmHWM:"):
        return int(line.split()[1]) * 1024
  return -1


def child(spec: str) -> None:
  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top
  import numpy as np  # pylint: disable=g-import-not-at-top

  import jaxtier  # pylint: disable=g-import-not-at-top
  from jaxtier._src.primitives import dha  # pylint: disable=g-import-not-at-top
  from jaxtier.examples import llama, train_state  # pylint: disable=g-import-not-at-top

  config_name, vocab, variant = spec.split(":")
  vocab = int(vocab)
  config = dataclasses.replace(llama.CONFIGS[config_name], vocab_size=vocab)
  opt = train_state.OptimizerConfig(learning_rate=1e-4)
  _, _, step = train_state.make_train_state(config, opt, abstract=True)
  init = train_state.state_initializer(config, opt)
  rng = np.random.default_rng(0)
  batches = [jnp.asarray(zipf_tokens(rng, vocab, (_BATCH.value, _SEQ.value + 1)))
             for _ in range(_STEPS.value)]
  off = jaxtier.offload(step, policy=embedding_policy(variant, _REST.value))
  state = off.init(init, example_args=(batches[0],))
  plan = off.plan
  leaves = {l.path: l for l in plan.leaves}
  table = next(l for p, l in leaves.items() if EMBED in p and l.role == "param")
  print(f"table {table.path}: {table.placement}; plan pinned {plan.pinned_bytes / 2**30:.2f} GiB,"
        f" predicted peak {(plan.predicted_peak_hbm_bytes or 0) / 2**30:.2f} GiB", flush=True)
  if _HLO_DIR.value:
    os.makedirs(_HLO_DIR.value, exist_ok=True)
    compiled = off.lower(state, batches[0]).compile()
    with open(os.path.join(_HLO_DIR.value, f"{spec.replace(':', '_')}.hlo.txt"), "w") as f:
      f.write(compiled.as_text())
    ma = compiled.memory_analysis()
    fields = [k for k in dir(ma) if k.endswith("_in_bytes")]
    with open(os.path.join(_HLO_DIR.value, f"{spec.replace(':', '_')}.memory.json"), "w") as f:
      json.dump({k: int(getattr(ma, k)) for k in fields}, f, indent=1)
  times, losses = [], []
  for k, batch in enumerate(batches):
    t0 = time.perf_counter()
    state, metrics = off(state, batch)
    loss = float(jax.block_until_ready(metrics["loss"]))
    times.append(time.perf_counter() - t0)
    losses.append(loss)
    print(f"step {k}: {times[-1] * 1e3:.1f} ms, loss {loss:.4f}", flush=True)
  stats = jax.devices()[0].memory_stats() or {}
  med = float(np.median(times[1:]))
  ids = batches[0][:, :-1]
  n_ids = int(ids.size)
  itemsize = jnp.dtype(table.dtype).itemsize
  rows_bytes = n_ids * config.d_model * itemsize
  # The gather of this batch's ids from a pinned_host table of the same shape, alone, against
  # copying the table to the device (what streaming it costs per step, one direction).
  host = jax.device_put(jnp.zeros((vocab, config.d_model), table.dtype),
                        jax.sharding.SingleDeviceSharding(jax.devices()[0],
                                                          memory_kind="pinned_host"))
  gather = jax.jit(lambda t, i: dha.gather(t, i))
  copy_in = jax.jit(lambda t: jax.device_put(t, jax.sharding.SingleDeviceSharding(
      jax.devices()[0], memory_kind="device")))
  gather_secs, _ = bench_util.median_secs(lambda: jax.block_until_ready(gather(host, ids)), 10)
  stream_secs, _ = bench_util.median_secs(lambda: jax.block_until_ready(copy_in(host)), 5)
  lookup = off._programs.split.lookup  # pylint: disable=protected-access
  link = {"device": 0, "state_host": 0, "host_dha": 2 * rows_bytes,
          "host_xla": 2 * table.nbytes}[variant]
  out = dict(spec=spec, variant=variant, config=config_name, vocab=vocab, rest=_REST.value,
             table_placement=table.placement, table_bytes=table.nbytes, num_ids=n_ids,
             rows_bytes=rows_bytes, losses=losses, step_secs=times,
             step_secs_median=med, tokens_per_sec=_BATCH.value * _SEQ.value / med,
             peak_hbm_bytes=int(stats.get("peak_bytes_in_use", -1)),
             pinned_bytes=plan.pinned_bytes, device_state_bytes=plan.device_bytes,
             predicted_step_secs=plan.predicted_step_secs,
             predicted_peak_hbm_bytes=plan.predicted_peak_hbm_bytes,
             compiled_peak_hbm_bytes=plan.compiler_peak_hbm_bytes,
             table_link_bytes_per_step=link, host_rss_peak_bytes=_peak_rss_bytes(),
             distinct_ids=int(np.unique(np.asarray(ids)).size),
             # The table's update row by row inside the step (lowering/overlap.py).
             rows_update=any("runs row by row" in n for n in plan.notes),
             gather_secs=gather_secs, stream_secs=stream_secs,
             gather_stream_ratio=stream_secs / gather_secs,
             # Whether the table's gradient rows were scatter-added into pinned_host (else the
             # lowering summed them on the device, and says why in its notes).
             gradient_rows_on_host=bool(lookup.scatters), lookup_notes=list(lookup.notes))
  print("RESULT " + json.dumps(out), flush=True)


def summarize(runs: dict) -> tuple[dict, dict, dict]:
  figures, baseline, ratio = {}, {}, {}
  for key, r in runs.items():
    if "error" in r:
      figures[key] = {"error": f"the run failed: runs['{key}']['error']"}
      continue
    figures[key] = {k: r[k] for k in (
        "step_secs_median", "tokens_per_sec", "peak_hbm_bytes", "compiled_peak_hbm_bytes",
        "pinned_bytes",
        "table_link_bytes_per_step", "host_rss_peak_bytes", "gather_secs", "stream_secs",
        "gather_stream_ratio", "table_placement")}
  for key, r in runs.items():
    config, vocab, variant = key.split(":")
    if variant != "device" or "error" in r:
      continue
    baseline[key] = {"step_secs_median": r["step_secs_median"],
                     "peak_hbm_bytes": r["peak_hbm_bytes"],
                     "is": "the embedding table, its moments and gradient in HBM"}
  for key, f in figures.items():
    config, vocab, variant = key.split(":")
    if "error" in f:
      continue
    for base in ("device", "state_host", "host_xla"):
      b = figures.get(f"{config}:{vocab}:{base}")
      if base == variant or b is None or "error" in b:
        continue
      ratio[f"{key} / {base} step time"] = f["step_secs_median"] / b["step_secs_median"]
      if f["peak_hbm_bytes"] > 0 and b["peak_hbm_bytes"] > 0:
        ratio[f"{key} / {base} peak HBM saved bytes"] = b["peak_hbm_bytes"] - f["peak_hbm_bytes"]
      if f.get("compiled_peak_hbm_bytes") and b.get("compiled_peak_hbm_bytes"):
        ratio[f"{key} / {base} compiled peak HBM saved bytes"] = (
            b["compiled_peak_hbm_bytes"] - f["compiled_peak_hbm_bytes"])
  return figures, baseline, ratio


def main(argv):
  del argv
  if _CHILD.value:
    child(_CHILD.value)
    return
  import jax  # pylint: disable=g-import-not-at-top
  import jaxtier  # pylint: disable=g-import-not-at-top
  runs = {}
  for config in _CONFIGS.value:
    for vocab in _VOCABS.value:
      for variant in _VARIANTS.value:
        key = f"{config}:{vocab}:{variant}"
        cmd = [sys.executable, __file__, f"--child={key}", f"--steps={_STEPS.value}",
               f"--batch_size={_BATCH.value}", f"--seq_len={_SEQ.value}", f"--rest={_REST.value}",
               f"--hlo_dir={_HLO_DIR.value}"]
        lines = []
        try:
          p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
          deadline = time.monotonic() + _TIMEOUT.value
          for raw in p.stdout:
            lines.append(raw.rstrip("\n"))
            if not raw.startswith(("I1", "W1", "RESULT ")) or "jaxtier" in raw:
              print(f"[{time.strftime('%H:%M:%S')} {key}] {lines[-1]}", flush=True)
            if time.monotonic() > deadline:
              p.kill()
              lines.append(f"stopped after {_TIMEOUT.value} s")
              break
          p.wait()
        except OSError as e:
          lines.append(repr(e))
          p = None
        got = [l for l in lines if l.startswith("RESULT ")]
        if p is None or p.returncode or not got:
          runs[key] = dict(error="\n".join(lines)[-2000:])
          continue
        runs[key] = json.loads(got[-1][len("RESULT "):])
  figures, baseline, ratio = summarize(runs)
  # The loss traces against the device-resident table's (bf16 compute: 1e-2 relative).
  checks = {}
  for key, r in runs.items():
    ref = runs.get(key.rsplit(":", 1)[0] + ":device", {})
    if "losses" in r and "losses" in ref and not key.endswith(":device"):
      rel = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(r["losses"], ref["losses"]))
      checks[f"{key} loss vs device"] = {"max_rel": rel, "ok": rel <= 1e-2}
  command = "python benchmarks/w6_dha.py " + " ".join(sys.argv[1:])
  rec = bench_util.result_record(
      workload=f"W6: embedding table on the device, streamed (host_xla) and read in place "
               f"(host_dha); batch {_BATCH.value} x {_SEQ.value}, rest {_REST.value}",
      command=command, device=bench_util.device_name(),
      versions=bench_util.versions(jax, jaxtier), figures=figures, baseline=baseline,
      ratio=ratio, runs=runs, checks=checks)
  path = bench_util.write_result(rec, _OUT.value, bench_util.result_name(
      _RESULT.value, rec, configs="_".join(_CONFIGS.value),
      vocabs="_".join(f"{int(v) // 1024}k" for v in _VOCABS.value)))
  print(f"wrote {path}")
  print(f"\n{'run':<28} {'ms/step':>9} {'tok/s':>9} {'peak HBM GiB':>13} {'pinned GiB':>11} "
        f"{'link MB':>9} {'gather ms':>10} {'stream ms':>10}")
  for key, f in figures.items():
    if "error" in f:
      print(f"{key:<28} ERROR")
      continue
    print(f"{key:<28} {f['step_secs_median'] * 1e3:>9.1f} {f['tokens_per_sec']:>9,.0f} "
          f"{f['peak_hbm_bytes'] / 2**30:>13.2f} {f['pinned_bytes'] / 2**30:>11.2f} "
          f"{f['table_link_bytes_per_step'] / 1e6:>9.1f} {f['gather_secs'] * 1e3:>10.3f} "
          f"{f['stream_secs'] * 1e3:>10.2f}")
  for k, v in ratio.items():
    print(f"  {k}: {v:.4g}")
  for k, v in checks.items():
    print(f"  {k}: max relative difference {v['max_rel']:.2e} ({'ok' if v['ok'] else 'OFF'})")


if __name__ == "__main__":
  app.run(main)
