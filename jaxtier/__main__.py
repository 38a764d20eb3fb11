"""Command line: `python -m jaxtier <command> [--flags]`.

Commands:
  train      train the example Flax NNX decoder on real text, its state placed by jaxtier
  plan       print the plan jaxtier.offload would make for an example config, allocating none
  calibrate  measure this machine's links, memory and executors; store the profile
  run        run an unmodified script with its train step offloaded

`python -m jaxtier <command> --help` says what the command does and lists its flags (e.g.
`python -m jaxtier train --help`); `--helpfull` lists every flag, absl's own too.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # Ctrl-C while the command starts: one line, exit 130
  from jaxtier._src import early_interrupt  # pylint: disable=g-import-not-at-top
  early_interrupt.install(early_interrupt.said_for("jaxtier", sys.argv))

from absl import app, flags

import jaxtier  # (imports jax first)
# `train` runs itself again with the XLA settings that fit its plan (at most MAX_RERUNS times).
from jaxtier._src import command_help as command_help_lib
from jaxtier._src import logs
from jaxtier._src.rerun import MAX_RERUNS, rerun_with as _rerun_with

if __name__ == "__main__" and sys.argv[1:2] == ["run"]:
  # `run` hands this process to a script whose absl flags are its own: the trainer's flags
  # (defined below) must not be, as the example trainer run as a script defines them again.
  from jaxtier._src import launcher as _launcher  # pylint: disable=g-import-not-at-top
  sys.exit(_launcher.main(sys.argv[2:], exit_on_interrupt=True))

try:  # the example trainer defines the flags of train and plan (its model's configs)
  from jaxtier.examples import train as train_lib
except ImportError:  # flax / optax / tqdm: the `examples` extra; calibrate runs without it
  train_lib = None

COMMANDS = ("train", "plan", "calibrate", "run")  # (run is dispatched above, before absl)
_JSON = flags.DEFINE_bool("json", False, "Print JSON (for tools): plan's, the plan with 'fits' "
                          "and 'refused'; calibrate's, the profile.")
# What --json prints, said in each command's help.
_JSON_HELP = {
    "plan": "Print the plan as JSON (for tools), with 'fits' (within its budgets) and "
            "'refused' (null, or why the plan was refused); the exit status is 1 when the plan "
            "does not fit, as with the text form.",
    "calibrate": "Print the profile as JSON (for tools).",
}
_PLATFORM = flags.DEFINE_enum("platform", None, ["cpu", "gpu"],
                              "Plan for this platform's executors (default: this machine's).")
_DEVICE_KIND = flags.DEFINE_string(
    "device_kind", "", "With --platform=gpu on a machine without a GPU: the GPU planned for, "
    "H100, H200 or A100 (its built-in profile: the H200's measured rates scaled by the card's "
    "datasheet, not calibrated); default the H200's.")
_PLOT = flags.DEFINE_string("plot", "", "Also draw device and pinned host bytes per leaf "
                            "group into this image file (e.g. plan.png).")
_DETAILS = flags.DEFINE_bool("details", False, "Print every leaf (its placement, bytes "
                             "and why) and every note, at the terminal's width, not the "
                             "summary.")
_VERBOSE = flags.DEFINE_bool("verbose", False, "As --details.")
_STREAM = flags.DEFINE_bool("stream", True, "Let the planner stream parameters from "
                            "pinned_host (host_stream) where it pays, as `train` and "
                            "jaxtier.offload do; --nostream: never.")


def plan_main() -> None:
  """Prints the plan for the example decoder config of `--config`, allocating nothing."""
  import dataclasses  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top
  import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

  from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
  if _PLOT.value:
    problem = _unwritable(_PLOT.value)
    if problem:  # say so before planning, not in a traceback after the plan is printed
      command_help_lib.bad_command_line("plan", f"--plot={_PLOT.value}: {problem}")
  from jaxtier.examples import tokenizer  # pylint: disable=g-import-not-at-top
  # As `train` sizes it (the vocabulary asked for, whatever the corpus gives: tokenizer.py).
  config = tokenizer.model_config(llama.CONFIGS[flags.FLAGS.config], flags.FLAGS.tokenizer,
                                  flags.FLAGS.vocab_size)
  if flags.FLAGS.remat_policy:
    config = dataclasses.replace(config, remat_policy=None if flags.FLAGS.remat_policy == "none"
                                 else flags.FLAGS.remat_policy)
  defaults = train_lib.RUN_DEFAULTS.get(flags.FLAGS.config)
  batch = flags.FLAGS.batch_size or (defaults.batch_size if defaults else 8)
  seq_len = flags.FLAGS.seq_len or config.max_seq_len
  train_lib.check_seq_len(config, flags.FLAGS.config, seq_len)
  optimizer = train_lib.OptimizerConfig(
      learning_rate=1e-3, clip_norm=train_lib.clip_norm_of(flags.FLAGS.clip,
                                                           flags.FLAGS.clip_norm))
  _, state, step = train_lib.make_train_state(config, optimizer, abstract=True)
  tokens = jax.ShapeDtypeStruct((batch, seq_len + 1), jnp.int32)
  platform = _PLATFORM.value or jax.default_backend()
  if _DEVICE_KIND.value:
    from jaxtier._src.hardware import profile  # pylint: disable=g-import-not-at-top
    # Said in a line, before planning (not after absl's usage text).
    why = None
    if profile.card_of(_DEVICE_KIND.value) is not None and platform != "gpu":
      why = f"names the GPU planned for, and this plan is for {platform}: add --platform=gpu"
    else:
      try:
        profile.check_device_kind(_DEVICE_KIND.value, platform)
      except jaxtier.OptionError as e:
        why = str(e).removeprefix("jaxtier: ")
    if why is not None:
      command_help_lib.bad_command_line("plan", f"--device_kind={_DEVICE_KIND.value}: {why}")
  # As `train` runs it: 'stream' places the layers' params host_stream (the rest auto).
  policy = {"stream": train_lib.stream_layers_policy}.get(flags.FLAGS.offload,
                                                          flags.FLAGS.offload)
  if not _STREAM.value and flags.FLAGS.offload == "stream":
    raise app.UsageError("--nostream contradicts --offload=stream, which streams the layers' "
                         "params from pinned_host: drop one of them")
  # As `train` plans (None: every parameter the lowering can stream), unless --nostream.
  streamable = None if _STREAM.value else frozenset()
  # The activation policies the planner may choose from (`llama.activation_model`; None where
  # the model's policy is not one of them: the step as traced). With --remat_policy, only that
  # one, as `train` runs it; without, the planner may choose another, said in a note below.
  activations = llama.activation_model(config, batch, seq_len)
  if activations is not None and flags.FLAGS.remat_policy:
    activations = dataclasses.replace(
        activations, options={activations.traced: activations.options[activations.traced]})
  refused = error = None
  try:
    with train_lib.verdicts_printed():  # printed below, in the plan's notes
      plan = jaxtier.plan(step, state, tokens, device_budget=flags.FLAGS.device_budget or None,
                          host_budget=flags.FLAGS.host_budget or None, platform=platform,
                          device_kind=_DEVICE_KIND.value or None,
                          policy=policy, streamable=streamable,
                          activations=activations,
                          overlap_update=flags.FLAGS.overlap_update)
  except jaxtier.PlanError as e:
    if e.plan is None:
      raise app.UsageError(str(e)) from e
    plan, refused, error = e.plan, str(e), e
  if _PLOT.value:
    path = jaxtier.plot_plan(plan, _PLOT.value, title=f"jaxtier plan: {flags.FLAGS.config} on "
                     f"{platform}, batch {batch} x seq {seq_len}")
  # Within its budgets: not refused, and no budget the plan misses.
  fits = refused is None and plan.fits
  if _JSON.value:
    import json  # pylint: disable=g-import-not-at-top
    out = json.loads(plan.to_json())
    out["fits"] = fits  # the plan's own verdict, and not refused
    out["refused"] = None if refused is None else refused.removeprefix("jaxtier: ")
    print(json.dumps(out, indent=1))
    sys.exit(0 if fits else 1)  # as the text form: 1 for a refused or over-budget plan
  from jaxtier._src.planning import plan_text  # pylint: disable=g-import-not-at-top
  width = plan_text.terminal_width()
  say = lambda text: print("\n".join(plan_text.fit_lines(text, width)))
  vocab = (f" (bpe, vocab {config.vocab_size:,})" if flags.FLAGS.tokenizer == "bpe" else "")
  # The model's activation policy as --remat_policy names it ('none': no layer rematerialised),
  # with the name the plan's "activations:" line gives it, and whether it is the config's own.
  said = ([f"activations: {activations.traced}"] if activations is not None else
          ["every activation kept"] if config.remat_policy is None else [])
  if not flags.FLAGS.remat_policy:
    said.append("the config's default")
  remat = (config.remat_policy or "none") + (f" ({'; '.join(said)})" if said else "")
  say(f"config {flags.FLAGS.config}: {llama.param_count(config):,} params{vocab}, batch "
      f"{batch} x seq {seq_len}, remat_policy {remat}")
  if _DETAILS.value or _VERBOSE.value:
    print(plan.table(width, reasons=True))
  else:
    print(plan.summary(width, more="python -m jaxtier plan --details"))
  # `train --offload=auto` on the CPU backend sets a device budget of its own where none is
  # given, so that the example offloads (`cpu_device_budget`): say which, as this plan has none.
  if (flags.FLAGS.offload == "auto" and platform == "cpu" == jax.default_backend()
      and not flags.FLAGS.device_budget and refused is None and not plan.pinned_bytes):
    # As train computes it: from the all-device plan of the step as the model runs it (its
    # own activation policy), which this plan's solver may have chosen otherwise.
    figures = train_lib.cpu_device_budget(step, state, tokens,
                                          overlap_update=flags.FLAGS.overlap_update)
    if figures is not None and figures[0] > 0:
      demo = figures[0]
      ran = (f"--remat_policy={flags.FLAGS.remat_policy}" if flags.FLAGS.remat_policy
             else "the model's activation policy")
      say(f"note: with no --device_budget, `train` on the CPU plans against a device "
          f"budget of {jaxtier.format_bytes(demo)} ({demo} bytes: its all-device step's peak "
          "less half the state, so that the example offloads), and runs "
          f"{ran}; this plan has no device budget")
  # The planner may pick another activation policy than the model's (to fit, or for speed):
  # `train` runs the model's unless told (its fit is checked against the step it compiles).
  other = plan.assumed_checkpoint_policy
  if other and refused is None and plan.fits:
    say(f"note: this plan assumes the activation policy {other}, not the model's: "
        f"train with --remat_policy={other} to run it as planned (its predicted peak and "
        "step time are that policy's)")
  if _PLOT.value:
    say(f"plot: {path}")
  if refused:
    say(f"REFUSED: {refused.removeprefix('jaxtier: ')}")
  if not fits:
    # The library's fixes name Python policies; these are the command line's: only those that
    # change what was missed, and none already taken.
    missed = {v.limit for v in plan.violations} | {getattr(error, "limit", "")}
    device_missed = bool(missed & {"device_budget", "device_memory"})
    # The pinned bytes over the host's limit, or the CPU backend's RAM over what it has.
    host_missed = bool(missed & {"host_limit", "host_memory"})
    # Over --host_budget itself (then XLA's pool is not what refused it).
    host_budget_missed = (plan.host_budget is not None
                          and plan.pinned_bytes > plan.host_budget)
    # The device state alone over the budget: activations and the batch are not the trouble.
    given = plan.device_budget.given
    state_over = device_missed and given is not None and (
        plan.bytes_by_memory_kind().get("device", 0) > given)
    offload = flags.FLAGS.offload
    hints = []
    if not _STREAM.value and offload == "auto" and device_missed:
      # Under auto alone the planner picks what streams (stream places the layers' params
      # itself; none and optimizer_state_on_host stream nothing).
      hints.append("without --nostream (the planner may stream the layers' params from "
                   "pinned_host)")
    if device_missed and offload == "optimizer_state_on_host" and _STREAM.value:
      hints.append("--offload=stream (the layers' params streamed from pinned_host too)")
    if "device_memory" not in missed and flags.FLAGS.device_budget:
      # (Without one the budget is the device's own memory, and a larger one is no fix.)
      hints.append("a larger --device_budget" + (
          " (or --host_budget, where it is the limit)" if host_missed else ""))
    elif host_missed:
      hints.append("a larger --host_budget, where it is the limit")
    if host_budget_missed and offload == "optimizer_state_on_host":
      hints.append("--offload=auto (keeps on the device what fits there)")
    if config.remat_policy != "nothing_saveable" and device_missed and not state_over:
      hints.append("--remat_policy=nothing_saveable (the layers' activations recomputed in "
                   "the backward pass, not kept)")
    settings = (_xla_settings_hint(plan, host_missed and not host_budget_missed)
                if platform == "gpu" else None)
    if settings:
      hints.append(settings)
    # The batch sets the activations, not the state's bytes; the smallest config has no smaller.
    smaller = [] if state_over or not device_missed else ["--batch_size"]
    if not _is_smallest_config():
      smaller.append("--config")
    if smaller:
      hints.append(f"a smaller {' or '.join(smaller)}")
    say("from the command line: " + "; ".join(hints))
    sys.exit(1)  # the plan is printed (and its notes say why), but it is over a budget


def _xla_settings_hint(plan, host_missed: bool) -> "str | None":
  """The XLA settings under which `plan` (for a GPU) would get the pinned pool and the allocator
  fraction it needs, as `train` sets them itself where the machine has the memory; None where
  it needs neither and the host's limit is not one it misses (`host_missed`)."""
  import math  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top

  from jaxtier._src.hardware import host  # pylint: disable=g-import-not-at-top
  from jaxtier._src.planning import admission  # pylint: disable=g-import-not-at-top
  settings = {}
  need = plan.pinned_need_bytes
  if plan.pinnable_bytes is not None and need > plan.pinnable_bytes:
    settings.update(admission.pool_settings(math.ceil(need / 2**30)))
  peak = plan.compiler_peak_hbm_bytes or plan.predicted_peak_hbm_bytes
  limit, _ = admission.allocator_bytes(jaxtier.load_profile(
      platform="gpu", device_kind=_DEVICE_KIND.value or None, warn=False))
  fraction = host.fraction_that_holds(peak, admission.DEVICE_MARGIN, limit) if peak else None
  if fraction is not None:
    settings[admission.FRACTION_SETTING] = fraction
  settings = {k: v for k, v in settings.items() if k not in os.environ}
  if not settings:
    return None if not host_missed else (
        f"{admission.POOL_SETTING}=<GiB> to raise XLA's pinned pool (64 GiB by default) "
        "where the host has the memory")
  said = " ".join(f"{k}={v}" for k, v in settings.items())
  return (f"{said} before this command, as `python -m jaxtier train` sets them itself where the "
          "machine has the memory (XLA reads them when JAX starts; this plan was made without "
          "them)")


def _unwritable(path: str) -> "str | None":
  """Why the image file `path` cannot be written (no such directory, not writable, a format
  matplotlib does not write), else None."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  import os  # pylint: disable=g-import-not-at-top
  from jaxtier._src import paths  # pylint: disable=g-import-not-at-top
  if importlib.util.find_spec("matplotlib") is None:
    return ("drawing the plan needs matplotlib: pip install 'jaxtier[plot]' (from a checkout: "
            "pip install '.[plot]')")
  if os.path.isdir(path):
    return "expected an image file name (e.g. plan.png), got a directory"
  ext = os.path.splitext(path)[1].lstrip(".").lower()
  if ext:
    from matplotlib.backends.backend_agg import FigureCanvasAgg  # pylint: disable=g-import-not-at-top
    formats = FigureCanvasAgg.get_supported_filetypes()
    if ext not in formats:
      return f"cannot draw a .{ext} image; use one of {', '.join(sorted(formats))}"
  return paths.why_unwritable(path, example="plan.png")


# The flags of one command that another does not read (every command reads absl's own).
_PLAN_ONLY = ("platform", "device_kind", "plot", "verbose", "details", "stream")
_NOT_READ = {
    "train": ("json",) + _PLAN_ONLY,
    "plan": ("steps", "data", "seed", "learning_rate", "warmup_steps", "log_every",
             "allow_over_budget", "json_out", "plan_details", "checkpoint_dir",
             "checkpoint_every", "keep_checkpoints"),
}


# What each command does, for `python -m jaxtier <command> --help` (run's is the launcher's).
_ABOUT = {
    "train": "Trains the example Flax NNX decoder on real text, its state placed by "
             "`jaxtier.offload` (`--offload=auto`: the planner's solver). A plan that misses the "
             "--device_budget / --host_budget given is an error (exit 1) before the first step, "
             "unless --allow_over_budget.",
    "plan": "Prints the plan `jaxtier.offload` would make for an example config, without "
            "allocating it: a summary of at most 20 lines (the state's bytes per placement and "
            "role, the predicted step time and peak, the verdict); --details: every leaf, its "
            "placement and why, and every note. The vocabulary flags set the model's "
            "vocab_size (no tokenizer is trained). Exit status 1 when the plan is refused or "
            "over a budget (with --json too: its fields 'fits' and 'refused' say which).",
    "calibrate": "Measures this machine (on a GPU: the link each way and duplex, zero-copy, "
                 "the executors, matmul, HBM; everywhere: host DRAM, the CPU executor, "
                 "pinnable memory) and stores the profile as JSON in the user's cache "
                 "directory (--json prints it).",
}


def _command_flags(command: str) -> list[str]:
  """The names of the flags `command` reads (absl's own aside)."""
  train_flags = ([f.name for f in flags.FLAGS.get_flags_for_module(train_lib)]
                 if train_lib is not None else [])
  if command == "train":
    return [n for n in train_flags if n not in _NOT_READ["train"]]
  if command == "plan":
    return [n for n in train_flags if n not in _NOT_READ["plan"]] + ["json", *_PLAN_ONLY]
  return ["json"]  # calibrate


# Flags whose help (the trainer's, or shared) says more than applies to a command: what that
# command's help says instead.
_HELP_IN = {
    "plan": {
        "json": _JSON_HELP["plan"],
        "tokenizer": "byte: each byte is a token (vocab 256); bpe: a byte-level BPE "
                     "vocabulary of --vocab_size ids, as `train --tokenizer=bpe` trains; the "
                     "model's vocab_size follows.",
    },
    "calibrate": {"json": _JSON_HELP["calibrate"]},
}


def command_help(command: str) -> str:
  """`python -m jaxtier <command> --help`: what `command` does and its flags, as absl writes
  them (`FlagValues.get_help`), each flag's help as it applies to `command` (`_HELP_IN`)."""
  return command_help_lib.render(
      f"usage: python -m jaxtier {command} [--flags]", _ABOUT[command],
      command_help_lib.by_name(flags.FLAGS, _command_flags(command), _HELP_IN.get(command)),
      "flags (python -m jaxtier --helpfull lists absl's own too):")


def _unused_flags(command: str) -> list[str]:
  """The flags given on the command line that `command` does not read (`_NOT_READ`; calibrate
  reads only --json)."""
  if command == "calibrate":  # it reads --json alone
    train_flags = ([f.name for f in flags.FLAGS.get_flags_for_module(train_lib)]
                   if train_lib is not None else [])
    names = list(_PLAN_ONLY) + train_flags
  else:
    names = [n for n in _NOT_READ.get(command, ()) if n in flags.FLAGS]
  return [n for n in names if flags.FLAGS[n].present]


def _command_in(argv: "list[str]") -> "str | None":
  """The command `argv` names (its first argument that is one), or None."""
  return next((a for a in argv[1:] if a in COMMANDS), None)


def main(argv: list[str]) -> None:
  # The commands' own output is what matters here: the libraries' INFO lines only with
  # --verbosity.
  logs.quiet_library_logs()
  if len(argv) < 2:
    got = "no command given"
  elif argv[1] not in COMMANDS:
    got = f"unknown command {argv[1]!r}"
  elif len(argv) > 2:
    got = (f"unexpected arguments {argv[2:]!r} after {argv[1]!r}; flags take --name=value, "
           "and one command is given")
  else:
    got = None
  if got:
    # A short answer, not absl's UsageError: that prints every flag's help before its line.
    expected = "" if len(argv) > 2 else f"; expected one of {', '.join(COMMANDS)}"
    print(f"python -m jaxtier: {got}{expected}.\n"
          f"usage: python -m jaxtier {{{'|'.join(COMMANDS)}}} [--flags] "
          f"(python -m jaxtier <command> --help lists its flags)", file=sys.stderr)
    sys.exit(2)
  unused = _unused_flags(argv[1])
  if unused and "JAXTIER_RERUN" not in os.environ:  # said once, not again by a re-run
    # As typed: a boolean flag set false reads --noNAME.
    typed = [f"--no{n}" if flags.FLAGS[n].value is False else f"--{n}" for n in unused]
    print(f"warning: python -m jaxtier {argv[1]} does not use {', '.join(typed)}; ignored",
          file=sys.stderr)
  try:
    _run_command(argv)
  except app.UsageError as e:  # flags that contradict each other, a setting the plan refuses
    command_help_lib.bad_command_line(argv[1], e)


def _run_command(argv: list[str]) -> None:
  """Runs the command `argv[1]` (train, plan or calibrate), its flags parsed."""
  command = argv[1]
  if command == "train":
    try:
      train_lib.main(argv[:1])
    except KeyboardInterrupt as e:
      # Ctrl-C ends the command (--json_out is written). With --checkpoint_dir the run was
      # saved at its step's end.
      train_lib.exit_interrupted(e)
    except train_lib.OverBudgetError as e:
      command_help_lib.say(f"error: {e}")  # names the figures, the budget and the fixes
      sys.exit(1)
    except train_lib.NonFiniteLossError as e:
      command_help_lib.say(f"error: {e}")  # the step, the loss and the fix
      sys.exit(1)
    except BrokenPipeError:
      raise  # stdout's reader is gone (`train | head`): ended quietly below, not an error
    except (jaxtier.PlanError, OSError, ValueError, train_lib.tokenizer_lib.TokenizersMissingError
            ) as e:
      if isinstance(e, jaxtier.AdmissionError):
        _rerun_with(e.settings)  # nothing is allocated yet; returns where it may not
      # A refused plan, a missing data file, bad data, a bad setting or --tokenizer=bpe without
      # its package: the message says what and how to fix it; a traceback through the trainer
      # would only hide it.
      command_help_lib.say(f"error: {type(e).__name__}: {str(e).removeprefix('jaxtier: ')}")
      if isinstance(e, jaxtier.AdmissionError):
        offload = flags.FLAGS["offload"].value if "offload" in flags.FLAGS else None
        fixes = _admission_fixes(e, offload, smallest=_is_smallest_config())
        command_help_lib.say("from the command line: " + ", or ".join(
            filter(None, (", ".join(fixes[:-1]), fixes[-1]))))
      elif isinstance(e, jaxtier.PlanError):
        # What has not been tried yet: under auto or optimizer_state_on_host the planner has
        # already moved the optimizer state; streaming moves the layers' params too.
        offload = flags.FLAGS["offload"].value if "offload" in flags.FLAGS else None
        more = ("" if offload == "stream" else
                "--offload=stream moves the layers' params to pinned_host too; or ")
        command_help_lib.say(
            f"from the command line: {more}raise --device_budget (the step's activations "
            "come on top of the state: `python -m jaxtier plan` with the same flags shows "
            "the peak), or a smaller --config, --batch_size or --seq_len")
        if "allow_over_budget" in flags.FLAGS and flags.FLAGS.allow_over_budget:
          command_help_lib.say(
              "note: --allow_over_budget runs a plan whose step may peak over the budget; it "
              "cannot run one whose state alone is over it (the state is placed before the "
              "first step)")
      sys.exit(1)
  elif command == "plan":
    try:
      plan_main()
    except ValueError as e:  # a flag out of range: the message names the limit and the fix
      if _JSON.value:  # the JSON form says so in its fields too
        import json  # pylint: disable=g-import-not-at-top
        print(json.dumps({"fits": False, "refused": f"{type(e).__name__}: {e}"}, indent=1))
      command_help_lib.say(f"error: {type(e).__name__}: {e}")
      sys.exit(1)
  else:
    calibrate_main()


def _is_smallest_config() -> bool:
  """Whether --config is the example config with the fewest params."""
  from jaxtier.examples import llama  # pylint: disable=g-import-not-at-top
  return flags.FLAGS["config"].value == min(
      llama.CONFIGS, key=lambda n: llama.param_count(llama.CONFIGS[n]))


def _admission_fixes(error: "jaxtier.AdmissionError", offload: "str | None",
                     smallest: bool = False) -> list[str]:
  """The command line's fixes for `train`'s refused plan (`error`, under --offload=`offload`),
  for the limit that refused it; `smallest`: the config is the smallest, so none smaller is
  named."""
  config = [] if smallest else ["--config"]
  if error.limit == "host_memory":
    # The step's activations share this RAM with the state: the batch decides it.
    return ["a smaller --batch_size", "--seq_len"] + config
  if error.limit == "device_memory":
    # Over what JAX's device allocator holds: the host is not the limit. Under auto, the plans
    # it tried with more state on the host once its own was over (`Plan.escalation`).
    escalated = getattr(error.plan, "escalation", None)
    if offload == "none":
      fixes = ["--offload=auto (jaxtier places in pinned_host what the device cannot hold)"]
    elif offload == "stream" or (escalated is not None
                                 and any(a.name == "stream" for a in escalated.tried)):
      fixes = []
    else:
      fixes = ["--offload=stream (the layers' params streamed from pinned_host)"]
    return fixes + ["--remat_policy=nothing_saveable (fewer activations kept for the backward "
                    "pass)", "a smaller --batch_size" + (" or --seq_len" if smallest else
                                                          ", --seq_len or --config")]
  # Over the host's (or --host_budget's) pinned memory, where moving more state to the host
  # makes it worse; the pinned bytes are the state's, which the batch does not change.
  fixes = ["raise --host_budget (where the host has the memory)"]
  if offload != "auto":
    fixes.append("--offload=auto (keeps on the device what fits there)")
  if not smallest:
    fixes.append("a smaller --config")
  return fixes


def calibrate_main() -> None:
  """Measures and stores a `HardwareProfile`; says which figures are defaults."""
  import dataclasses  # pylint: disable=g-import-not-at-top
  import json  # pylint: disable=g-import-not-at-top

  import jax  # pylint: disable=g-import-not-at-top


  gpu = jax.default_backend() == "gpu"
  # Without a GPU the warning below is the one said (not also calibrate()'s log line).
  prof = jaxtier.calibrate(save=False, warn=False)
  path = jaxtier.save_profile(prof)
  if _JSON.value:
    print(json.dumps(dataclasses.asdict(prof), indent=1))
    return
  if not gpu:
    print("warning: no GPU here: the link, zero-copy and GPU executor figures are the H200 "
          "defaults (docs/design.md); the host side was measured, and matmul_tflops / hbm_gbps "
          "are this CPU's (the CPU backend's compute device)")
  # (On a GPU what is not measured is its card's built-in figure.)
  from jaxtier._src.hardware import profile  # pylint: disable=g-import-not-at-top
  default = profile.builtin_profile(prof.device_kind).rates()
  for name, value in prof.rates().items():
    mark = "" if value != default[name] else "  (default)"
    if name.endswith("_bytes"):
      shown = f"{value:,} ({jaxtier.format_bytes(value)})"
    elif isinstance(value, int):
      shown = str(value)
    else:
      shown = jaxtier.format_rate(value)
    print(f"{name:<28} {shown}{mark}")
  print(f"{'device_kind':<28} {prof.device_kind}")
  print(f"{'versions':<28} {prof.versions}")
  if gpu:  # the split executor exists on a GPU only
    print(f"split share of the DHA kernel: {jaxtier.split_fraction(prof):.3f}")
  print(f"saved to {path}")


def _missing_examples_extra(argv: list[str]) -> "str | None":
  """Why `train` / `plan` cannot run here (the `examples` extra is missing), else None."""
  import importlib.util  # pylint: disable=g-import-not-at-top
  if train_lib is not None or len(argv) < 2 or argv[1] not in ("train", "plan"):
    return None
  missing = [m for m in ("flax", "optax", "tqdm") if importlib.util.find_spec(m) is None]
  return (f"python -m jaxtier {argv[1]}: the example trainer needs {', '.join(missing) or 'its'} "
          "packages: install jaxtier with its examples extra, pip install 'jaxtier[examples]' "
          "(from a checkout: pip install '.[examples]')")


if __name__ == "__main__":
  _why = _missing_examples_extra(sys.argv)
  if _why:
    sys.exit(_why)
  # absl's --help prints the usage and exits 1; asking for help is no error.
  if "--helpfull" in sys.argv[1:]:
    import contextlib  # pylint: disable=g-import-not-at-top
    import io  # pylint: disable=g-import-not-at-top
    # absl writes this text, then every flag; printed as every help is (`print_help`).
    with contextlib.redirect_stdout(io.StringIO()) as _full:
      app.usage(writeto_stdout=True)
    sys.exit(command_help_lib.print_help(_full.getvalue().removesuffix("\n")))
  if any(a in ("-h", "--help", "-?", "--helpshort") for a in sys.argv[1:]):
    _command = _command_in(sys.argv)
    if _command == "run":
      from jaxtier._src import launcher as _launcher  # pylint: disable=g-import-not-at-top
      sys.exit(_launcher.main(["--help"]))
    sys.exit(command_help_lib.print_help(command_help(_command) if _command
                                         else command_help_lib.fit(__doc__)))
  # A reader gone (`plan --details | head`): status 1 and no traceback, as `print_help`. The
  # output is flushed here, where that can be caught (app.run ends in sys.exit).
  try:
    try:
      app.run(main, flags_parser=lambda argv: command_help_lib.parse_flags(
          argv, _command_in(argv)))
    finally:
      sys.stdout.flush()
  except BrokenPipeError:
    command_help_lib.stdout_gone()
    sys.exit(1)
