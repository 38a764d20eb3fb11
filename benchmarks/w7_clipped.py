r"""W7: gradient clipping with the optimizer state on the host, against unclipped and DeepSpeed.

A global-norm clip reads every gradient before any update may use it, so it is the case that
keeps a host update from running layer by layer inside the backward pass. This measures what
clipping costs the example decoder with its AdamW state in pinned_host
(`--offload=optimizer_state_on_host`), where the clip binds rarely and where it binds on every
step, against the same step unclipped, the serial schedule (`--nooverlap_update`), the step
with everything on the device (`--offload=none`, where the state fits) and DeepSpeed
ZeRO-Offload clipping at 1.0 (`.baselines/deepspeed/run.sh`, where it is carried).

A group is one shape: `1b_b8` (the 1b config at batch 8 x 1024), `1b_b32`, `8b_b16` (8b at
16 x 2048); any `<config>_b<batch>[_s<seq>]` names one (seq default: 1024 for 1b, else the
config's max_seq_len). Each group runs these variants, in this order, each as `python -m
jaxtier train --log_every=1 --json_out=...` in its own process (so that each peak HBM is its
own), with the same seed, data and schedule:

  unclipped      no clipping
  probe          clipped at a max norm no step reaches (1e9): each step's gradient norm, the
                 unclipped run's (the clip never scales them), and the cost of the clip alone
  clip_rare      clipped at a norm chosen from the probe's timed steps to clip under 10% of
                 them: with 20 timed steps, between the largest norm and the next (above their
                 95th percentile, below their max), where the gap is widest (`choose_norms`)
  clip_always    clipped at half the probe's smallest norm: every step is clipped
  deepspeed_clipped  DeepSpeed ZeRO-Offload (ZeRO-2, CPUAdam) with --clip 1.0 (for 1b_b8 by
                 default: --deepspeed_groups)
  clip_rare_retry  only where clip_rare clipped none of its timed steps, or 10% or more: again,
                 at a norm chosen the same way from clip_rare's own norms (a clipped step, the
                 untimed first one too, moves the steps after it off the probe's)
  serial         as clip_always, with --nooverlap_update: every host update after the backward
                 pass (the schedule a clip needs without a guess)
  device_only    unclipped, --offload=none (skipped where 16 B a param is over the GPU's memory)

`--norms=GROUP=RARE:ALWAYS` gives the two norms instead (no probe), e.g. from an earlier run's
JSON (its `norms`). Each clipped run records the share of its timed steps that clipped
(`clipped_fraction`: the trainer's, each step's norm before the clip over the max norm), so
the norms chosen are checked, not assumed.

Per run: the median step time over the timed steps (all but the first), tokens/s from it, MFU
((6 N + 12 L d s) model FLOPs a token x tokens/s over the card's bf16 rate), peak HBM,
pinned_host bytes, the plan's notes on when the host updates run. The ratios: each clipped
run's tokens/s and MFU over unclipped, clip_always's step over serial's and clip_rare's, the
clipped runs' tokens/s over DeepSpeed clipped, and unclipped over device-only.

Runs go in that order within `--budget_secs`: one that cannot start in what is left is
skipped with the reason, one cut short is asked to stop (SIGINT: the trainer writes what it
measured) and recorded as such, and the JSON is written after every run:
`$OUT/w7/w7_clipped_<card>.json` (`w7_clipped_<groups>[_part]_<card>.json` for another
selection), every run's log in `$OUT/w7/w7_logs_<card>.tar.gz` (the device tool brings back
8 files at most). The commit recorded is $BENCH_COMMIT where set, else this checkout's.

  python3 benchmarks/w7_clipped.py --groups=1b_b8 --budget_secs=450 --out=$OUT
  python3 benchmarks/w7_clipped.py --groups=tiny_b4_s64 --steps=tiny=12  # on the CPU: 3 min
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tarfile
import time
from typing import Any

from absl import app, flags
import numpy as np

import bench_util  # (sibling module)
import capacity_bench  # (sibling module: the MFU's peak and the GPU's memory)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_GROUPS = ("1b_b8", "1b_b32", "8b_b16")
VARIANTS = ("unclipped", "probe", "clip_rare", "clip_always", "deepspeed_clipped",
            "clip_rare_retry", "serial", "device_only")
PROBE_NORM = 1e9  # over any step's gradient norm: the probe's clip never scales
RARE_SHARE = 0.10  # clip_rare clips under this share of the timed steps
DEEPSPEED_CLIP = 1.0

_GROUPS = flags.DEFINE_list(
    "groups", list(DEFAULT_GROUPS), "Groups in order, each GROUP or GROUP:VARIANT+VARIANT... "
    f"(variants, in their order of priority: {', '.join(VARIANTS)}).")
_STEPS = flags.DEFINE_list(
    "steps", ["1b=21", "8b=12", "default=21"], "Train steps per config (CONFIG=N); the first "
    "is not timed, and with 20 timed steps one clipped step is 5%.")
_NORMS = flags.DEFINE_list(
    "norms", [], "GROUP=RARE:ALWAYS: the max norms of clip_rare and clip_always, not chosen by "
    "a probe run.")
_ALWAYS_FACTOR = flags.DEFINE_float(
    "always_factor", 0.5, "clip_always's norm: this times the probe's smallest timed norm.")
_DEEPSPEED_GROUPS = flags.DEFINE_list(
    "deepspeed_groups", ["1b_b8"], "Groups that run DeepSpeed clipped (where its script is).")
_DEEPSPEED_SCRIPT = flags.DEFINE_string(
    "deepspeed_script", os.path.join(ROOT, ".baselines", "deepspeed", "run.sh"),
    "DeepSpeed's run.sh (its README: a copy in the ignored .baselines/).")
_DEEPSPEED_STEPS = flags.DEFINE_string("deepspeed_steps", "8:2",
                                       "DeepSpeed's timed and warmup steps, TIMED:WARMUP.")
_BUDGET = flags.DEFINE_integer("budget_secs", 540, "Seconds for the whole script: a run that "
                               "cannot start within them is skipped.")
_OUT = flags.DEFINE_string("out", os.environ.get("OUT", "/tmp/out"), "Where the JSON goes.")
_WORK = flags.DEFINE_string("work_dir", "/tmp/w7_runs", "Where each run's log and JSON go "
                            "(the device tool brings back at most 8 files from $OUT).")
_RESULT = flags.DEFINE_string(
    "result", "", "The JSON's file name under --out ({card} filled in); default "
    "w7/w7_clipped_{card}.json for the default groups, else w7/w7_clipped_<groups>_{card}.json.")

# Seconds: a run's timeout at most, and the least left to start one (process, data, plan,
# compile and the steps: 1b about 45 s on the H200, 8b at batch 16 about 80 s + 4.9 s a step).
CAP_SECS = {"1b": 240, "8b": 420, "deepspeed": 300}
MIN_START_SECS = {"1b": 50, "8b": 150, "deepspeed": 120}
DEFAULT_CAP, DEFAULT_MIN_START = 240, 20


def parse_group(name: str) -> dict:
  """`<config>_b<batch>[_s<seq>]` -> {name, config, batch_size, seq_len}."""
  from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
  m = re.fullmatch(r"(\w+?)_b(\d+)(?:_s(\d+))?", name)
  if not m or m.group(1) not in llama.CONFIGS:
    raise ValueError(f"w7: expected a group <config>_b<batch>[_s<seq>] with a config in "
                     f"{sorted(llama.CONFIGS)}, got {name!r}")
  config = m.group(1)
  seq = int(m.group(3)) if m.group(3) else (1024 if config == "1b"
                                            else llama.CONFIGS[config].max_seq_len)
  return {"name": name, "config": config, "batch_size": int(m.group(2)), "seq_len": seq}


def parse_selection(items: list[str]) -> list[tuple[dict, list[str]]]:
  """--groups' items -> [(group, variants in priority order)]."""
  out = []
  for item in items:
    name, _, picked = item.partition(":")
    variants = picked.split("+") if picked else list(VARIANTS)
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
      raise ValueError(f"w7: unknown variants {bad} in {item!r}; expected {VARIANTS}")
    out.append((parse_group(name), [v for v in VARIANTS if v in variants]))
  return out


def parse_norms(items: list[str]) -> dict[str, tuple[float, float]]:
  norms = {}
  for item in items:
    m = re.fullmatch(r"(\w+)=([0-9.eE+-]+):([0-9.eE+-]+)", item)
    if not m or not (0 < float(m.group(2)) and 0 < float(m.group(3))):
      raise ValueError(f"w7: expected --norms=GROUP=RARE:ALWAYS (> 0), got {item!r}")
    norms[m.group(1)] = (float(m.group(2)), float(m.group(3)))
  return norms


def steps_of(config: str) -> int:
  table = dict(item.split("=") for item in _STEPS.value)
  return int(table.get(config, table.get("default", 21)))


def choose_norms(grad_norms: list[float], factor: float, source: str = "probe") -> dict:
  """The clip_rare and clip_always max norms from a run's per-step gradient norms (its first,
  untimed step left out, as the trainer's figures leave it out).

  clip_rare: of the k largest timed norms, with 1 <= k and k / n under RARE_SHARE (n timed
  steps), the k whose norm stands furthest above the next (the largest ratio), and the
  geometric mean of the two: the k steps over it clip, and a run whose norms move a little
  (its clipped steps change what follows) still clips about as many. With 20 timed steps k is
  1, between the largest norm and the next: above their 95th percentile, below their max.
  clip_always: `factor` times the smallest timed norm.
  """
  timed = np.asarray(grad_norms[1:] or grad_norms, np.float64)
  if timed.size < 2 or not np.all(np.isfinite(timed)) or not np.all(timed > 0):
    raise ValueError(f"w7: the {source} gave too few finite gradient norms: {grad_norms}")
  top = np.sort(timed)[::-1]
  k_max = max(1, int(np.ceil(RARE_SHARE * timed.size)) - 1)
  k = max(range(1, min(k_max, timed.size - 1) + 1), key=lambda k: top[k - 1] / top[k])
  rare = float(np.sqrt(top[k - 1] * top[k]))
  return {"source": source, "timed_norms": timed.tolist(), "p95": float(np.percentile(timed, 95)),
          "min": float(timed.min()), "median": float(np.median(timed)),
          "max": float(timed.max()), "clip_rare": rare, "clip_always": factor * float(timed.min()),
          "steps_over_rare": int(np.sum(timed > rare)), "timed_steps": int(timed.size),
          "rare_margin": float(top[k - 1] / top[k]),
          "first_step_norm": float(grad_norms[0]) if len(grad_norms) > 1 else None,
          "how": f"clip_rare: the geometric mean of the {source}'s timed norm ranked {k} "
                 f"(largest first) and the one ranked {k + 1} ({k} of {timed.size} steps over "
                 f"it: of the ranks under {RARE_SHARE:.0%} of the steps, the widest gap); "
                 f"clip_always: {factor:g} x their min"}


def model_flops_per_token(config_name: str, seq_len: int) -> float:
  """capacity_bench's model FLOPs per token (6 N + 12 L d s) of the config named, at this
  run's sequence length."""
  from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
  return capacity_bench.model_flops_per_token(llama.CONFIGS[config_name], seq_len)


def peak_flops(card: str) -> "float | None":
  """The card's bf16 rate the MFU is over: capacity_bench's (the H200's measured 8192^3 bf16
  GEMM) for the H200 and the H100 SXM (the same GH100 compute); None elsewhere."""
  return capacity_bench.PEAK_FLOPS if card in ("h200", "h100") else None


class Runner:
  """Runs the variants in order within the budget, keeping every record and writing the JSON
  after each."""

  def __init__(self, selection, norms_given, deadline, card, device):
    self.selection, self.norms_given, self.deadline = selection, norms_given, deadline
    self.card, self.device = card, device
    self.runs: dict[str, dict[str, dict]] = {}
    self.norms: dict[str, dict] = {}
    self.logs: list[str] = []
    os.makedirs(_WORK.value, exist_ok=True)

  def left(self) -> float:
    return self.deadline - time.monotonic()

  # ---- one run --------------------------------------------------------------------------

  def _spawn(self, cmd: list[str], log_path: str, timeout: float, env: dict) -> tuple[Any, float]:
    """Runs `cmd` in a process group of its own, output to `log_path`; at `timeout` asks it to
    stop (SIGINT: the trainer writes --json_out), then kills the group. (returncode or
    'timeout', wall seconds)."""
    t0 = time.monotonic()
    with open(log_path, "w") as log:
      log.write(f"# {shlex.join(cmd)}\n")
      log.flush()
      p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT,
                           start_new_session=True)
      try:
        rc = p.wait(timeout=max(1.0, timeout))
      except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGINT)
        try:
          p.wait(timeout=30)
        except subprocess.TimeoutExpired:
          os.killpg(p.pid, signal.SIGKILL)
          p.wait()
        rc = "timeout"
      try:  # what the command left running in its group (none, as a rule): it would hold GPU memory
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
    self.logs.append(log_path)
    return rc, time.monotonic() - t0

  def train(self, group: dict, variant: str, *, offload: str, clip_norm: "float | None",
            overlap: bool = True) -> dict:
    config = group["config"]
    name = f"{group['name']}_{variant}"
    json_out = os.path.join(_WORK.value, f"{name}.result.json")
    log_path = os.path.join(_WORK.value, f"{name}.log")
    if os.path.exists(json_out):
      os.remove(json_out)
    steps = steps_of(config)
    cmd = [sys.executable, "-m", "jaxtier", "train", f"--config={config}",
           f"--offload={offload}", f"--steps={steps}", f"--batch_size={group['batch_size']}",
           f"--seq_len={group['seq_len']}", "--log_every=1", "--plan_details",
           f"--json_out={json_out}"]
    if clip_norm is not None:
      cmd.append(f"--clip_norm={clip_norm:.9g}")
    if not overlap:
      cmd.append("--nooverlap_update")
    # As a user runs it: the CLI sets XLA's allocator fraction and pinned pool where its plan
    # needs them (capacity_bench.XLA_SETTINGS); wide lines keep each plan note on one line.
    env = {k: v for k, v in os.environ.items() if k not in capacity_bench.XLA_SETTINGS}
    env["COLUMNS"] = "200"
    timeout = min(CAP_SECS.get(config, DEFAULT_CAP), self.left() - 5)
    bench_util.log(f"{name}: {shlex.join(cmd[1:])} (timeout {timeout:.0f} s)")
    rc, wall = self._spawn(cmd, log_path, timeout, env)
    with open(log_path, errors="replace") as f:
      text = f.read()
    rec = {"group": group["name"], "variant": variant, "config": config,
           "batch_size": group["batch_size"], "seq_len": group["seq_len"], "steps": steps,
           "offload": offload, "clip_norm": clip_norm, "overlap_update": overlap,
           "command": shlex.join(["python"] + cmd[1:]), "returncode": rc,
           "wall_secs": round(wall, 1), "log": os.path.basename(log_path),
           "reruns": re.findall(r"note: the (?:plan|step) fits with ([^,]+?), which XLA reads",
                                text),
           "schedule_notes": schedule_notes(text)}
    rec["schedule"] = schedule_of(rec["schedule_notes"], offload)
    refused = re.findall(r"^error: (?:AdmissionError|PlanError|OverBudgetError): (.*)$", text,
                         re.M)
    if refused:
      rec["refused"] = refused[-1][:2000]
    res = None
    if os.path.exists(json_out):
      with open(json_out) as f:
        res = json.load(f)
      rec["ended"] = res.get("ended")
      if res.get("error"):
        rec["error"] = res["error"][:2000]
    if res and len(res.get("step_times") or []) >= 2:
      rec.update(self._figures(group, res))
    else:
      tail = [l for l in text.splitlines() if l.strip() and not re.match(r"^[IW]\d{4} ", l)]
      rec["tail"] = tail[-10:]
    if rc != 0:
      rec.setdefault("error", f"exit {rc}" + (" (stopped at its timeout: the figures are of "
                                              "the steps it ran)" if rc == "timeout" else ""))
    bench_util.log(f"{name}: rc {rc} in {wall:.0f} s; " + json.dumps(
        {k: rec.get(k) for k in ("step_secs_median", "tokens_per_sec", "clipped_fraction",
                                 "mfu", "refused")}))
    return rec

  def _figures(self, group: dict, res: dict) -> dict:
    times = res["step_times"]
    timed = times[1:]
    med = float(np.median(timed))
    tokens = group["batch_size"] * group["seq_len"] / med
    flops = model_flops_per_token(group["config"], group["seq_len"])
    peak = peak_flops(self.card)
    mem = res.get("memory") or {}
    return {
        "timed_steps": len(timed), "step_secs_median": med, "step_secs": times,
        "tokens_per_sec": tokens, "mfu": tokens * flops / peak if peak else None,
        "clipped_fraction": res.get("clipped_fraction"), "grad_norm": res.get("grad_norm"),
        "grad_norms": res.get("grad_norms") or [], "losses": res.get("losses"),
        "peak_hbm_bytes": mem.get("peak device (measured)"),
        "compiled_peak_hbm_bytes": mem.get("peak device (compiled)"),
        "pinned_live_bytes": mem.get("pinned_host live (measured)"),
        # The state's pinned bytes and, on a guessed step, its spare buffers' (the plan's).
        "pinned_planned_bytes": (
            None if mem.get("pinned_host (planned)") is None else
            mem["pinned_host (planned)"] + (mem.get("pinned_host spares (planned)") or 0)),
        "plan_bytes": res.get("plan_bytes"), "compile_secs": res.get("compile_secs"),
        # The guessed updates (a clipped step's): steps held and missed, and the planner's mean
        # step at that share of misses against the measured mean of the timed steps.
        "guessed": res.get("guessed"), "step_secs_mean": float(np.mean(timed)),
        "predicted_mean_over_measured": (
            res["guessed"]["predicted_mean_step_secs"] / float(np.mean(timed))
            if (res.get("guessed") or {}).get("predicted_mean_step_secs") else None)}

  def deepspeed(self, group: dict) -> dict:
    script = _DEEPSPEED_SCRIPT.value
    rec = {"group": group["name"], "variant": "deepspeed_clipped", "config": group["config"],
           "batch_size": group["batch_size"], "seq_len": group["seq_len"],
           "clip_norm": DEEPSPEED_CLIP, "mode": "zero2_offload"}
    out = os.path.join(_WORK.value, f"deepspeed_{group['name']}")
    os.makedirs(out, exist_ok=True)
    timed, warmup = _DEEPSPEED_STEPS.value.split(":")
    budget = int(min(CAP_SECS["deepspeed"], self.left() - 5))
    cmd = ["bash", script, group["config"], str(group["batch_size"]), str(group["seq_len"]),
           timed, warmup]
    env = dict(os.environ, OUT=out, MODES="zero2_offload", BUDGET=str(budget),
               CAP_zero2_offload=str(budget), EXTRA_ARGS=f"--clip {DEEPSPEED_CLIP}")
    rec["command"] = (f"OUT={out} MODES=zero2_offload BUDGET={budget} EXTRA_ARGS='--clip "
                      f"{DEEPSPEED_CLIP}' " + shlex.join(cmd))
    bench_util.log(f"{group['name']}_deepspeed_clipped: {rec['command']}")
    log_path = os.path.join(_WORK.value, f"{group['name']}_deepspeed_clipped.log")
    rc, wall = self._spawn(cmd, log_path, budget + 20, env)
    rec.update(returncode=rc, wall_secs=round(wall, 1), log=os.path.basename(log_path))
    path = os.path.join(out, f"zero2_offload_{group['config']}.json")
    if not os.path.exists(path):
      rec["error"] = f"no {os.path.basename(path)} (exit {rc})"
      return rec
    with open(path) as f:
      ds = json.load(f)
    self.logs.extend(os.path.join(out, n) for n in sorted(os.listdir(out)) if n.endswith(".log"))
    rec["result"] = {k: ds.get(k) for k in (
        "median_step_s", "tokens_per_s", "model_tflops_per_s", "peak_hbm_allocated_gib",
        "peak_hbm_reserved_gib", "host_rss_peak_gib", "losses", "step_times_s", "optimizer",
        "zero_optimizer", "param_count", "measured_steps", "error")}
    if ds.get("error"):
      rec["error"] = str(ds["error"])[:2000]
    if ds.get("median_step_s"):
      tokens = group["batch_size"] * group["seq_len"] / ds["median_step_s"]
      peak = peak_flops(self.card)
      flops = model_flops_per_token(group["config"], group["seq_len"])
      rec.update(step_secs_median=ds["median_step_s"], tokens_per_sec=tokens,
                 mfu=tokens * flops / peak if peak else None,
                 peak_hbm_bytes=int((ds.get("peak_hbm_allocated_gib") or 0) * 2**30) or None)
    bench_util.log(f"{group['name']}_deepspeed_clipped: rc {rc} in {wall:.0f} s; " + json.dumps(
        {k: rec.get(k) for k in ("step_secs_median", "tokens_per_sec", "error")}))
    return rec

  # ---- the plan of runs -----------------------------------------------------------------

  def run_all(self) -> None:
    from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
    hbm = capacity_bench.gpu_total_bytes()
    for group, variants in self.selection:
      g = group["name"]
      runs = self.runs.setdefault(g, {})
      given = self.norms_given.get(g)
      if given:
        self.norms[g] = {"clip_rare": given[0], "clip_always": given[1],
                         "how": "given (--norms)"}
      for variant in variants:
        why = self._why_not(group, variant, runs, hbm, llama)
        if why:
          runs[variant] = {"group": g, "variant": variant, "skipped": why}
          bench_util.log(f"{g}_{variant}: skipped: {why}")
        elif variant == "deepspeed_clipped":
          runs[variant] = self.deepspeed(group)
        else:
          offload = "none" if variant == "device_only" else "optimizer_state_on_host"
          if variant == "clip_rare_retry":
            # The norms of the clip_rare run itself: its clipped steps (the first, untimed, one
            # among them) moved the steps after them off the probe's.
            try:
              self.norms[g]["retry"] = choose_norms(runs["clip_rare"]["grad_norms"],
                                                    _ALWAYS_FACTOR.value, "clip_rare run")
            except ValueError as e:
              runs[variant] = {"group": g, "variant": variant, "skipped": str(e)}
              self.write()
              continue
          norms = self.norms.get(g) or {}
          clip = {"unclipped": None, "device_only": None, "probe": PROBE_NORM,
                  "clip_rare": norms.get("clip_rare"), "clip_always": norms.get("clip_always"),
                  "clip_rare_retry": (norms.get("retry") or {}).get("clip_rare"),
                  "serial": norms.get("clip_always")}[variant]
          runs[variant] = self.train(group, variant, offload=offload, clip_norm=clip,
                                     overlap=variant != "serial")
          if variant == "probe" and runs[variant].get("grad_norms") and g not in self.norms:
            try:
              self.norms[g] = choose_norms(runs[variant]["grad_norms"], _ALWAYS_FACTOR.value)
            except ValueError as e:
              runs[variant]["error"] = str(e)
        self.write()

  def _why_not(self, group, variant, runs, hbm, llama) -> "str | None":
    """Why `variant` of `group` is not run, or None."""
    config = group["config"]
    if variant in ("clip_rare", "clip_always", "serial") and not self.norms.get(group["name"]):
      return "no max norms: the probe gave none and --norms names none for this group"
    if variant == "probe" and group["name"] in self.norms_given:
      return "the max norms were given (--norms)"
    if variant == "clip_rare_retry":
      rare = runs.get("clip_rare") or {}
      fraction = rare.get("clipped_fraction")
      if fraction is None or not rare.get("grad_norms"):
        return "clip_rare gave no clipped fraction to check"
      if 0 < fraction < RARE_SHARE:
        return (f"clip_rare clipped {fraction:.3g} of its timed steps: more than none, under "
                f"{RARE_SHARE:.0%}, as asked")
    if variant == "deepspeed_clipped" and group["name"] not in _DEEPSPEED_GROUPS.value:
      return f"DeepSpeed runs only for --deepspeed_groups={','.join(_DEEPSPEED_GROUPS.value)}"
    if variant == "deepspeed_clipped" and not os.path.exists(_DEEPSPEED_SCRIPT.value):
      return (f"no {os.path.relpath(_DEEPSPEED_SCRIPT.value, ROOT)}: DeepSpeed is not carried "
              "(its README: copy it into the ignored .baselines/ and carry that folder)")
    refused = runs.get("unclipped", {}).get("refused")
    if refused and variant != "device_only" and variant != "deepspeed_clipped":
      return f"the unclipped run of these shapes was refused: {refused[:300]}"
    if variant == "device_only" and hbm:
      state = capacity_bench.BYTES_PER_PARAM * llama.param_count(llama.CONFIGS[config])
      if state > hbm:
        return (f"the fp32 AdamW state ({capacity_bench.BYTES_PER_PARAM} B a param, "
                f"{state / 2**30:.1f} GiB) is over the GPU's {hbm / 2**30:.1f} GiB")
    need = MIN_START_SECS.get("deepspeed" if variant == "deepspeed_clipped" else config,
                              DEFAULT_MIN_START)
    if self.left() < need:
      return (f"{max(0, self.left()):.0f} s left of --budget_secs={_BUDGET.value}, under the "
              f"{need} s a run of it needs")
    return None

  # ---- the record -----------------------------------------------------------------------

  def record(self) -> dict:
    figures, baseline, ratio = summarize(self.runs)
    import jax  # pylint: disable=g-import-not-at-top  (no backend started: versions only)
    import jaxtier  # pylint: disable=g-import-not-at-top
    peak = peak_flops(self.card)
    groups = [g["name"] for g, _ in self.selection]
    return bench_util.result_record(
        workload=f"W7: gradient clipping with the optimizer state on the host "
                 f"({', '.join(groups)}): clipped rarely and on every step against unclipped, "
                 "the serial schedule, device-only and DeepSpeed ZeRO-Offload clipped",
        command="python3 benchmarks/w7_clipped.py " + shlex.join(sys.argv[1:]),
        device=self.device, versions=bench_util.versions(jax, jaxtier),
        commit=os.environ.get("BENCH_COMMIT") or None,
        figures=figures, baseline=baseline or {"note": "no unclipped or DeepSpeed run yet"},
        ratio=ratio, card=self.card,
        commit_source="BENCH_COMMIT" if os.environ.get("BENCH_COMMIT") else "git",
        mfu={"formula": "tokens/s x (6 N + 12 L d s) / peak_flops (model FLOPs: no "
                        "recomputation counted; s the run's sequence length)",
             "peak_flops": peak,
             "is": ("capacity_bench.PEAK_FLOPS: the H200's measured bf16 8192^3 GEMM rate; the "
                    "H100 SXM has the same GH100 compute" if peak else
                    "no bf16 rate kept for this card: MFU left out"),
             "model_flops_per_token": {g["name"]: model_flops_per_token(g["config"],
                                                                        g["seq_len"])
                                       for g, _ in self.selection}},
        norms=self.norms, runs=self.runs,
        selection={g["name"]: v for g, v in self.selection},
        budget_secs=_BUDGET.value)

  def write(self) -> str:
    rec = self.record()
    path = bench_util.write_result(rec, _OUT.value, result_name(self.selection, rec))
    logs = os.path.join(_OUT.value, "w7", f"w7_logs_{self.card}.tar.gz")
    with tarfile.open(logs, "w:gz") as tar:
      for log in self.logs:
        if os.path.exists(log):
          tar.add(log, arcname=os.path.basename(log))
    return path


def schedule_notes(text: str) -> list[str]:
  """The plan's notes on when the host updates run (a note and the lines it wraps onto)."""
  notes, cur = [], None
  for line in text.splitlines():
    if line.startswith("note: "):
      cur = [line[6:].strip()]
      notes.append(cur)
    elif cur is not None and line.startswith("  ") and line.strip():
      cur.append(line.strip())
    else:
      cur = None
  joined = [" ".join(n) for n in notes]
  keep = [n for n in joined if re.search(r"backward pass|guess|every gradient", n)]
  return [n[:600] for n in keep[:6]]


def schedule_of(notes: list[str], offload: str) -> str:
  """When the layers' host updates ran, in a word, from the plan's notes."""
  if offload == "none":
    return "jax.jit"
  if any("guess" in n for n in notes):
    return "layered, on a guess that the clip does not bind"
  if any("layer by layer inside the backward pass" in n for n in notes):
    return "layered"
  return "serial"


def summarize(runs: dict) -> tuple[dict, dict, dict]:
  """(figures, baseline, ratio) from the runs so far."""
  keys = ("step_secs_median", "step_secs_mean", "tokens_per_sec", "mfu", "clipped_fraction",
          "clip_norm", "peak_hbm_bytes", "pinned_live_bytes", "pinned_planned_bytes",
          "schedule", "guessed", "predicted_mean_over_measured")
  figures, baseline, ratio = {}, {}, {}
  for g, by_variant in runs.items():
    for v, r in by_variant.items():
      if "skipped" in r:
        figures[f"{g} {v}"] = {"skipped": r["skipped"]}
      elif r.get("tokens_per_sec") is None:
        figures[f"{g} {v}"] = {"error": r.get("refused") or r.get("error") or "no figures"}
      else:
        figures[f"{g} {v}"] = {k: r.get(k) for k in keys}
        if r.get("error"):
          figures[f"{g} {v}"]["error"] = r["error"]
    got = lambda v: by_variant.get(v) if (by_variant.get(v) or {}).get("tokens_per_sec") else None
    un, ds = got("unclipped"), got("deepspeed_clipped")
    if un:
      baseline[f"{g} unclipped"] = {"step_secs_median": un["step_secs_median"],
                                    "tokens_per_sec": un["tokens_per_sec"], "mfu": un["mfu"],
                                    "is": "the same step unclipped, optimizer state on the host"}
    if ds:
      baseline[f"{g} deepspeed_clipped"] = {
          "step_secs_median": ds["step_secs_median"], "tokens_per_sec": ds["tokens_per_sec"],
          "is": f"DeepSpeed ZeRO-Offload (ZeRO-2, CPUAdam) at the same shapes, --clip "
                f"{DEEPSPEED_CLIP:g}"}
    for v in ("probe", "clip_rare", "clip_rare_retry", "clip_always", "serial"):
      r = got(v)
      if r and un:
        ratio[f"{g} {v} tokens/s over unclipped"] = r["tokens_per_sec"] / un["tokens_per_sec"]
        if r.get("mfu") and un.get("mfu"):
          ratio[f"{g} {v} MFU over unclipped"] = r["mfu"] / un["mfu"]
      if r and ds and v in ("clip_rare", "clip_rare_retry", "clip_always"):
        ratio[f"{g} {v} tokens/s over deepspeed_clipped"] = (r["tokens_per_sec"]
                                                             / ds["tokens_per_sec"])
    always, rare, serial, dev = got("clip_always"), got("clip_rare"), got("serial"), got(
        "device_only")
    if always and serial:
      ratio[f"{g} clip_always step over serial step"] = (always["step_secs_median"]
                                                         / serial["step_secs_median"])
    if always and rare:
      ratio[f"{g} clip_always step over clip_rare step"] = (always["step_secs_median"]
                                                            / rare["step_secs_median"])
    if un and dev:
      ratio[f"{g} unclipped tokens/s over device_only"] = (un["tokens_per_sec"]
                                                           / dev["tokens_per_sec"])
  return figures, baseline, ratio


def result_name(selection, rec: dict) -> str:
  if _RESULT.value:
    return bench_util.result_name(_RESULT.value, rec)
  names = [g["name"] for g, _ in selection]
  whole = all(v == list(VARIANTS) for _, v in selection)
  if names == list(DEFAULT_GROUPS) and whole:
    return bench_util.result_name("w7/w7_clipped_{card}.json", rec)
  part = "" if whole else "_part"
  return bench_util.result_name("w7/w7_clipped_{groups}{part}_{card}.json", rec,
                                groups="_".join(names), part=part)


def device_name() -> str:
  """JAX's first device as bench_util names it, asked of a child process (this one starts no
  backend: it would hold GPU memory the runs need)."""
  code = ("import jax; d = jax.devices()[0]; "
          "print('W7DEVICE', d.platform + ':' + getattr(d, 'device_kind', '?'))")
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  try:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env).stdout
  except (OSError, subprocess.SubprocessError):
    out = ""
  m = re.search(r"^W7DEVICE (.+)$", out, re.M)
  return m.group(1).strip() if m else "unknown:unknown"


def print_table(runner: Runner) -> None:
  print(f"\n{'run':<28} {'ms/step':>9} {'tok/s':>9} {'MFU':>6} {'clipped':>8} {'norm':>9} "
        f"{'HBM GiB':>8} {'pinned':>7}")
  for g, by_variant in runner.runs.items():
    for v, r in by_variant.items():
      key = f"{g} {v}"[:28]
      if "skipped" in r or r.get("tokens_per_sec") is None:
        why = r.get("skipped") or r.get("refused") or r.get("error") or "no figures"
        print(f"{key:<28} {'skipped' if 'skipped' in r else 'FAILED'}: {why[:48]}")
        continue
      fmt = lambda x, f: "-" if x is None else format(x, f)
      gib = lambda b: None if not b else b / 2**30
      print(f"{key:<28} {r['step_secs_median'] * 1e3:>9.1f} {r['tokens_per_sec']:>9,.0f} "
            f"{fmt(r.get('mfu'), '.3f'):>6} {fmt(r.get('clipped_fraction'), '.2f'):>8} "
            f"{fmt(r.get('clip_norm'), '.3g'):>9} {fmt(gib(r.get('peak_hbm_bytes')), '.2f'):>8} "
            f"{fmt(gib(r.get('pinned_live_bytes')), '.2f'):>7}")
  _, _, ratio = summarize(runner.runs)
  for k, v in ratio.items():
    print(f"  {k}: {v:.4g}")


def main(argv):
  del argv
  t0 = time.monotonic()
  selection = parse_selection(_GROUPS.value)
  norms_given = parse_norms(_NORMS.value)
  device = device_name()
  card = bench_util.card(device)
  bench_util.log(f"device {device} (card {card}); groups "
                 + "; ".join(f"{g['name']}: {'+'.join(v)}" for g, v in selection))
  runner = Runner(selection, norms_given, t0 + _BUDGET.value, card, device)
  runner.run_all()
  path = runner.write()
  print_table(runner)
  print(f"wrote {path}")


if __name__ == "__main__":
  app.run(main)
