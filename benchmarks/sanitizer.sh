#!/usr/bin/env bash
# compute-sanitizer over each CUDA handler family of jaxtier (issue 16, item 10): memcheck and
# racecheck of every family (dha, stream, host_update), synccheck of dha (the one kernel with
# barriers and shared memory), initcheck of each, and a memcheck of `offload` (a tiny training
# step end to end, informational), each on its program in benchmarks/sanitizer_programs.py,
# which checks its results against numpy (so a run also shows the calls computed the right
# thing). The GPU is shared by SANITIZER_JOBS runs at a time.
#
# Usage (device tool, from the repo root, with jaxtier built and installed there; the workload
# does both: `bash benchmarks/run_gpu.sh sanitizer`):
#   bash benchmarks/sanitizer.sh
# Result: $OUT/sanitizer.txt (kept as benchmarks/results/sanitizer/<card>.txt): per run the command,
# wall seconds, the sanitizer's summary line, its errors (those naming jaxtier counted apart) and
# the program's own pass/fail and coverage; per family and overall a verdict. Every run's logs:
# $OUT/sanitizer_logs.tar.gz.
#
# Order: (1) each program alone, no sanitizer (its time, and the allocator fallback below),
# beside the build of a planted-bug control; (2) the controls: a kernel named jaxtier_... with an
# out-of-bounds write under memcheck and one with a shared-memory race under racecheck, which
# must be reported (the tool works on this machine, the kernel filter matches our names, the
# report parses them); (3) the sanitized runs, the required ones first.
#
# Only jaxtier's kernels are instrumented (`--kernel-name kns=jaxtier`: every kernel of
# xla_ffi/src/*.cu is in namespace jaxtier), XLA's run unchecked; the API checks (a copy or
# memset outside an allocation, a CUDA call that fails) cover every call. initcheck runs
# unfiltered: a filtered-out kernel's writes are not tracked, so the data XLA's kernels produce
# would read as uninitialized. The programs use XLA's platform allocator (one cudaMalloc per
# buffer, not one pool; if a program fails with it and passes without, that family falls back,
# as the report says) and memcheck pads each allocation (--padding), so that an overrun is an
# access outside every allocation. pinned_host buffers still come from XLA's host pool: an
# overrun of one is seen only past the end of its pool region.
#
# Environment:
#   SANITIZER_RUNS     the sanitized runs, "family:tool ..." (default below); tools: memcheck,
#                      racecheck, synccheck, initcheck
#   SANITIZER_JOBS     runs at once (default 6)
#   SANITIZER_TIMEOUT  seconds per run (default 160)
#   SANITIZER_BUDGET   seconds for the whole script (default 400): a run is started only with
#                      30 s left, and its timeout is cut to what is left
#   SANITIZER_LEAK_CHECK  memcheck's --leak-check (default no: jaxtier's CUDA code allocates no
#                      device memory, so every leak reported would be XLA's, which does not free
#                      its buffers at exit; full to see them)
#   COMPUTE_SANITIZER  the binary (default: PATH, /usr/local/cuda/bin, the newest
#                      /usr/local/cuda-*/bin)
set -uo pipefail
_here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 JAXTIER_REQUIRE_GPU=${JAXTIER_REQUIRE_GPU:-1}
export JAXTIER_CPU_THREADS=${JAXTIER_CPU_THREADS:-4}
JOBS=${SANITIZER_JOBS:-6}
RUN_SECS=${SANITIZER_TIMEOUT:-160}
BUDGET=${SANITIZER_BUDGET:-400}
T0=$(date +%s)
# (No "jaxtier" in this path: a report naming jaxtier is one about our code.)
WORK=$(mktemp -d /tmp/sanitizer_runs.XXXXXX)
FAMILIES=(dha stream host_update offload)
DEFAULT_RUNS="host_update:memcheck dha:memcheck stream:memcheck host_update:racecheck \
dha:racecheck stream:racecheck offload:memcheck dha:synccheck host_update:initcheck \
dha:initcheck stream:initcheck"
read -r -a RUNS <<< "${SANITIZER_RUNS:-$DEFAULT_RUNS}"

say() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }

# ---- the sanitizer and its options -------------------------------------------------------------
CS=${COMPUTE_SANITIZER:-}
if [[ -z $CS ]]; then
  CS=$(command -v compute-sanitizer || true)
  for c in /usr/local/cuda/bin/compute-sanitizer $(ls -d /usr/local/cuda-*/bin/compute-sanitizer \
      2>/dev/null | sort -V -r); do
    [[ -z $CS && -x $c ]] && CS=$c
  done
fi
{
  echo "compute-sanitizer: ${CS:-not found}"
  [[ -n $CS ]] && "$CS" --version 2>&1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1
  python3 -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__)' 2>&1
  python3 -c 'import sys; print("python", sys.version.split()[0])'
  echo "commit: $(git -C "$_here/.." rev-parse --short HEAD 2>/dev/null || echo unknown)"
} > "$WORK/env.txt" 2>&1
if [[ -n $CS ]]; then "$CS" --help > "$WORK/help.txt" 2>&1; else : > "$WORK/help.txt"; fi

DROPPED=()
has_opt() { grep -q -- "$1" "$WORK/help.txt"; }
# opt NAME VALUE: prints NAME and VALUE (two lines) if this compute-sanitizer knows NAME.
opt() {
  if has_opt "$1"; then printf '%s\n%s\n' "$1" "$2"; fi
}
mapfile -t COMMON < <(opt --print-limit 100; opt --error-exitcode 86;
                      opt --target-processes application-only; opt --report-api-errors explicit)
mapfile -t FILTER < <(opt --kernel-name kns=jaxtier)
mapfile -t MEMCHECK < <(opt --check-api-memory-access yes;
                        opt --leak-check "${SANITIZER_LEAK_CHECK:-no}"; opt --padding 256)
# What `opt` left out (it ran in subshells).
for pair in "--print-limit 100" "--error-exitcode 86" "--target-processes application-only" \
    "--report-api-errors explicit" "--kernel-name kns=jaxtier" "--check-api-memory-access yes" \
    "--leak-check ${SANITIZER_LEAK_CHECK:-no}" "--padding 256"; do
  has_opt "${pair%% *}" || DROPPED+=("$pair")
done

# ---- one run ---------------------------------------------------------------------------------
declare -A ALLOC=()  # family -> XLA_PYTHON_CLIENT_ALLOCATOR for its runs, when not the platform one

# run_one FAMILY TOOL: writes $WORK/FAMILY.TOOL.{cmd,prog.log,san.log,rc}; rc holds
# "exit wall_seconds timeout_seconds" or "skipped".
run_one() {
  local fam=$1 tool=$2 id="$1.$2" left limit rc start
  left=$(( BUDGET - ($(date +%s) - T0) ))
  if (( left < 30 )); then
    echo "skipped" > "$WORK/$id.rc"
    return 0
  fi
  limit=$(( RUN_SECS < left - 5 ? RUN_SECS : left - 5 ))
  local -a cmd=()
  if [[ $tool != none ]]; then
    cmd=("$CS" --tool "$tool" --log-file "$WORK/$id.san.log" "${COMMON[@]}")
    case $tool in
      memcheck) cmd+=("${MEMCHECK[@]}" "${FILTER[@]}") ;;
      racecheck|synccheck) cmd+=("${FILTER[@]}") ;;
      initcheck) ;;
    esac
  fi
  if [[ $fam == control ]]; then
    cmd+=("$WORK/control" "$([[ $tool == racecheck ]] && echo race || echo oob)")
  else
    cmd+=(python3 "${_here#"$PWD"/}/sanitizer_programs.py" "--family=$fam")
  fi
  local -a envs=()
  [[ -n ${ALLOC[$fam]+set} ]] && envs=("XLA_PYTHON_CLIENT_ALLOCATOR=${ALLOC[$fam]}")
  { (( ${#envs[@]} )) && printf '%s ' "${envs[@]}"; printf '%q ' "${cmd[@]}"; echo; } \
      > "$WORK/$id.cmd"
  start=$(date +%s.%N)
  timeout -k 10 "$limit" env "${envs[@]}" "${cmd[@]}" > "$WORK/$id.prog.log" 2>&1 &
  echo $! > "$WORK/$id.pid"  # for `finish`, should this script be stopped
  wait $!
  rc=$?
  echo "$rc $(python3 -c "import sys; print(f'{float(sys.argv[2]) - float(sys.argv[1]):.1f}')" \
      "$start" "$(date +%s.%N)") $limit" > "$WORK/$id.rc"
}

# launch FAMILY TOOL: run_one in the background, at most JOBS at a time.
launch() {
  while (( $(jobs -rp | wc -l) >= JOBS )); do wait -n; done
  echo "$1 $2" >> "$WORK/runs.txt"
  run_one "$1" "$2" &
}

native_ok() { grep -q "result=PASS" "$WORK/$1.none.prog.log" 2>/dev/null; }

# ---- the report ------------------------------------------------------------------------------
report() {
  local dropped
  dropped=$(printf '%s; ' "${DROPPED[@]+"${DROPPED[@]}"}")
  local allocs=""
  for f in "${!ALLOC[@]}"; do allocs+="$f: '${ALLOC[$f]}' (XLA's default pool); "; done
  WORK=$WORK OUT=$OUT T0=$T0 DROPPED="$dropped" ALLOCS="$allocs" \
  COMMON_OPTS="${COMMON[*]}" FILTER_OPTS="${FILTER[*]}" MEMCHECK_OPTS="${MEMCHECK[*]}" \
  JOBS=$JOBS RUN_SECS=$RUN_SECS BUDGET=$BUDGET python3 - <<'PY'
import datetime, os, re, time

W = os.environ["WORK"]
HANDLER_FAMILIES = ("dha", "stream", "host_update")
REQUIRED = ("memcheck", "racecheck")


def read(path, default=""):
  try:
    with open(path, errors="replace") as f:
      return f.read()
  except OSError:
    return default


def blocks(log):
  """The sanitizer's messages: its '=========' lines split at the empty ones, without its
  banner and summary lines (the banner runs straight into the first message)."""
  out, cur = [], []
  for line in log.splitlines():
    if not line.startswith("========="):
      continue
    body = line[len("========="):].strip()
    if body.startswith("COMPUTE-SANITIZER") or "SUMMARY:" in body:
      body = ""
    if not body:
      if cur:
        out.append(cur)
      cur = []
    else:
      cur.append(line)
  if cur:
    out.append(cur)
  return out


def analyse(fam, tool):
  rid = f"{fam}.{tool}"
  r = {"fam": fam, "tool": tool, "cmd": read(f"{W}/{rid}.cmd").strip().replace(W, "$LOGS")}
  rc = read(f"{W}/{rid}.rc").split()
  prog = read(f"{W}/{rid}.prog.log")
  # Its own log; else (no --log-file) its lines in the program's output.
  san = read(f"{W}/{rid}.san.log") or "\n".join(
      l for l in prog.splitlines() if l.startswith("========="))
  r["prog_log"], r["san_log"] = prog, san
  if not rc:
    r.update(verdict="NOT RUN", exit="-", secs="-")
    return r
  if rc[0] == "skipped":
    r.update(verdict="SKIPPED (no time left)", exit="-", secs="-")
    return r
  r["exit"], r["secs"], r["limit"] = int(rc[0]), rc[1], rc[2]
  stopped = rc[2] == "stopped" or r["exit"] == 143  # this script was stopped meanwhile
  m = [l for l in prog.splitlines() if l.startswith("SANITIZER_PROGRAM")]
  r["program"] = m[-1] if m else ""
  r["prog_pass"] = bool(m) and "result=PASS" in m[-1]
  cov = [l for l in prog.splitlines() if l.startswith("COVERAGE")]
  r["coverage"] = cov[-1] if cov else ""
  checks = [l for l in prog.splitlines() if l.startswith("CHECK ")]
  r["checks_ok"] = sum(1 for l in checks if ": ok" in l)
  r["checks_failed"] = sum(1 for l in checks if ": FAILED" in l)
  summary = [l.strip("= ").strip() for l in san.splitlines() if "SUMMARY" in l]
  r["summary"] = summary
  errs = [int(x) for x in re.findall(r"ERROR SUMMARY: (\d+) errors?", san)]
  hz = re.findall(r"RACECHECK SUMMARY: (\d+) hazards? displayed", san)
  # racecheck may print only its own summary; its hazards count as errors either way.
  r["errors"] = (None if not errs and not hz else
                 max(errs[-1] if errs else 0, int(hz[-1]) if hz else 0))
  msgs = blocks(san)
  r["messages"] = msgs
  r["jaxtier_msgs"] = [b for b in msgs if any("jaxtier" in l for l in b)]
  timed_out = r["exit"] in (124, 137) and not stopped
  if fam == "control":
    found = r["errors"] or 0
    r["verdict"] = ("DETECTED (as planted)" if found and r["jaxtier_msgs"] else
                    "STOPPED" if stopped else "TIMEOUT" if timed_out else "NOT DETECTED")
    return r
  if tool == "none":
    r["verdict"] = ("PASS" if r["prog_pass"] else "STOPPED" if stopped else
                    "TIMEOUT" if timed_out else "FAIL")
    return r
  if stopped:
    r["verdict"] = "STOPPED (the script was stopped)"
  elif timed_out:
    r["verdict"] = f"TIMEOUT ({r['limit']} s)"
  elif r["errors"] is None:
    r["verdict"] = "INCOMPLETE (no ERROR SUMMARY)"
  elif r["errors"] == 0 and r["prog_pass"]:
    r["verdict"] = "PASS"
  elif not r["prog_pass"]:
    r["verdict"] = "FAIL (program)"
  elif r["jaxtier_msgs"]:
    r["verdict"] = f"FAIL ({len(r['jaxtier_msgs'])} reports in jaxtier)"
  else:
    r["verdict"] = f"TRIAGE ({r['errors']} errors, none naming jaxtier)"
  return r


runs = []
for line in read(f"{W}/runs.txt").splitlines():
  fam, tool = line.split()
  if (fam, tool) not in [(r["fam"], r["tool"]) for r in runs]:
    runs.append(analyse(fam, tool))

out = []
p = out.append
p("jaxtier: compute-sanitizer over the CUDA handler families (issue 16, item 10)")
p(f"date: {datetime.datetime.now(datetime.timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}; "
  f"script wall: {time.time() - float(os.environ['T0']):.0f} s (budget {os.environ['BUDGET']} s, "
  f"{os.environ['JOBS']} runs at a time, {os.environ['RUN_SECS']} s per run at most)")
p(f"card: {os.environ.get('BENCH_CARD', '?')}; commit: {os.environ.get('BENCH_COMMIT', '?')}")
p(f"launched by: {os.environ.get('BENCH_LAUNCHED_BY', 'bash benchmarks/sanitizer.sh')}")
p(read(f"{W}/env.txt").strip())
p(f"options, every run: --log-file $LOGS/<family>.<tool>.san.log {os.environ['COMMON_OPTS']} "
  "($LOGS: sanitizer_logs.tar.gz)")
p(f"  memcheck: {os.environ['MEMCHECK_OPTS']} {os.environ['FILTER_OPTS']}; racecheck, "
  f"synccheck: {os.environ['FILTER_OPTS']}; initcheck: unfiltered")
if os.environ["DROPPED"]:
  p(f"  not known to this compute-sanitizer, left out: {os.environ['DROPPED']}")
p("programs: python3 benchmarks/sanitizer_programs.py --family=F (XLA_FLAGS "
  "--xla_gpu_autotune_level=0, XLA_PYTHON_CLIENT_ALLOCATOR=platform, "
  "XLA_PYTHON_CLIENT_PREALLOCATE=false, JAXTIER_HOST_CPU_CHUNK_BYTES=1 MiB, "
  "JAXTIER_DHA_SCATTER_CHUNK_BYTES=8 KiB, JAXTIER_CPU_THREADS=4, JAXTIER_TIME_SCANS=0)")
if os.environ["ALLOCS"]:
  p("  allocator fallback (the program failed with the platform allocator): "
    + os.environ["ALLOCS"])
p("")
p(f"{'family':12} {'tool':10} {'verdict':44} {'errors':>6} {'jaxtier':>7} {'program':8} "
  f"{'secs':>6}")
for r in runs:
  errors = "-" if r.get("errors") is None else str(r["errors"])
  jt = str(len(r.get("jaxtier_msgs", []))) if r.get("errors") is not None else "-"
  prog = ("-" if r["fam"] == "control" or "prog_pass" not in r else
          "PASS" if r["prog_pass"] else "FAIL")
  p(f"{r['fam']:12} {r['tool']:10} {r['verdict']:44} {errors:>6} {jt:>7} {prog:8} "
    f"{r['secs']:>6}")
p("(errors: the ERROR SUMMARY count, or racecheck's hazards; jaxtier: the reports among them "
  "that name jaxtier: its kernels, or a host frame in _jaxtier_ffi)")
p("")

by = {(r["fam"], r["tool"]): r for r in runs}
controls = [r for r in runs if r["fam"] == "control"]
controls_ok = bool(controls) and all(r["verdict"].startswith("DETECTED") for r in controls)
overall = True
for fam in HANDLER_FAMILIES:
  mine = [r for r in runs if r["fam"] == fam and r["tool"] != "none"]
  # memcheck and racecheck must pass; another tool must not fail, but may not have run.
  missing = [t for t in REQUIRED if (fam, t) not in by or by[(fam, t)]["verdict"] != "PASS"]
  bad = [r for r in mine if r["verdict"].startswith(("FAIL", "TRIAGE", "INCOMPLETE"))]
  ok = not missing and not bad
  overall &= ok
  tools = ", ".join(f"{r['tool']} {r['verdict']}" for r in mine) or "no sanitized run"
  p(f"family {fam}: {'PASS' if ok else 'NOT PASSED'} ({tools})")
for r in runs:
  if r["fam"] == "offload" and r["tool"] != "none":
    p(f"offload (end to end, informational): {r['tool']} {r['verdict']}")
p(f"controls (planted bugs must be found): {'OK' if controls_ok else 'NOT OK'} ("
  + ", ".join(f"{r['tool']} {r['verdict']}" for r in controls) + ")")
passed = overall and controls_ok
p(f"OVERALL: {'PASS' if passed else 'NOT PASSED'}: "
  + ("0 errors in memcheck and racecheck (and in each other tool that ran) of every handler "
     "family, every program's checks passed, and the planted bugs were found" if passed
     else "see the runs above and their details below"))
p("")
for r in runs:
  p(f"=== {r['fam']} / {r['tool']}: {r['verdict']}")
  p(f"command: {r['cmd'] or '-'}")
  p(f"wall: {r['secs']} s, exit {r['exit']}")
  for s in r.get("summary", []):
    p(f"sanitizer: {s}")
  if r.get("program"):
    p(f"program: {r['program']}")
  if r.get("coverage"):
    p(f"coverage: {r['coverage']}")
  if "checks_failed" in r and r["fam"] != "control":
    p(f"checks: {r['checks_ok']} ok, {r['checks_failed']} failed")
  msgs = r.get("messages", [])
  if msgs and (r["verdict"] != "PASS"):
    shown = (r.get("jaxtier_msgs") or msgs)[:6]
    p(f"first reports ({len(msgs)} in all, {len(r.get('jaxtier_msgs', []))} naming jaxtier):")
    for b in shown:
      for l in b[:25]:
        p("  " + l)
      p("  ---")
  if r["verdict"] not in ("PASS",) and not r["verdict"].startswith("DETECTED"):
    tail = [l for l in r.get("prog_log", "").splitlines()
            if not re.match(r"^(\[[^]]*\] )?[IW][0-9]{4} ", l)][-30:]
    if tail:
      p("program output (last lines):")
      p("\n".join("  " + l for l in tail))
  p("")
with open(os.path.join(os.environ["OUT"], "sanitizer.txt"), "w") as f:
  f.write("\n".join(out) + "\n")
# The short form, for the call's output.
print("\n".join(l for l in out if l.startswith(("family", "offload (", "controls", "OVERALL")) or
                re.match(r"^\S+\s+\S+\s+(PASS|FAIL|TIMEOUT|TRIAGE|SKIPPED|INCOMPLETE|NOT|DETECTED)",
                         l)))
PY
  tar -czf "$OUT/sanitizer_logs.tar.gz" --exclude=./control -C "$WORK" . 2>/dev/null || true
}

_finished=0
finish() {
  (( _finished )) && return
  _finished=1
  # Stop the runs still going (each `timeout` we started, by its pid: it passes the signal on
  # to its run), then report what is there.
  local f id stopped=0
  for f in "$WORK"/*.pid; do
    [[ -e $f ]] || continue
    id=$(basename "$f" .pid)
    if [[ ! -e $WORK/$id.rc ]]; then
      kill -TERM "$(cat "$f")" 2>/dev/null && stopped=1
      echo "124 - stopped" > "$WORK/$id.rc"
    fi
  done
  (( stopped )) && sleep 3
  report
  say "report: $OUT/sanitizer.txt"
}
trap 'finish; exit 1' TERM INT

if [[ -z $CS ]]; then
  say "compute-sanitizer not found (PATH, /usr/local/cuda*/bin; or set COMPUTE_SANITIZER)"
  : > "$WORK/runs.txt"
  finish
  exit 1
fi
say "$(head -2 "$WORK/env.txt" | tr '\n' ' ')"

# ---- (1) the programs alone, and the control's build ---------------------------------------------
: > "$WORK/runs.txt"
cat > "$WORK/control.cu" <<'CU'
// Planted bugs in kernels whose names contain "jaxtier" (the kernel filter's substring).
#include <cstdio>
#include <cstring>
#include <cuda_runtime.h>
extern "C" __global__ void jaxtier_sanitizer_control_oob(int* a, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i <= n) a[i] = i;  // one element past the end
}
extern "C" __global__ void jaxtier_sanitizer_control_race(int* out) {
  __shared__ int s[64];
  s[threadIdx.x] = threadIdx.x;
  out[threadIdx.x] = s[(threadIdx.x + 32) % 64];  // another warp's write, no __syncthreads
}
int main(int argc, char** argv) {
  const bool race = argc > 1 && strcmp(argv[1], "race") == 0;
  int* a = nullptr;
  const int n = 1000;
  cudaMalloc(&a, n * sizeof(int));
  if (race) jaxtier_sanitizer_control_race<<<1, 64>>>(a);
  else jaxtier_sanitizer_control_oob<<<(n + 256) / 256, 256>>>(a, n);
  cudaError_t e = cudaDeviceSynchronize();
  cudaFree(a);
  printf("control %s: %s\n", race ? "race" : "oob", cudaGetErrorString(e));
  return 0;
}
CU
( cd "$WORK" && { nvcc -O1 -lineinfo -arch=native -o control control.cu > control.build.log 2>&1 ||
                  nvcc -O1 -lineinfo -o control control.cu >> control.build.log 2>&1; } ) &
for fam in "${FAMILIES[@]}"; do launch "$fam" none; done
wait
for fam in "${FAMILIES[@]}"; do
  if ! native_ok "$fam"; then
    say "$fam failed alone with XLA's platform allocator; again with XLA's default allocator"
    ALLOC[$fam]=""
    mv "$WORK/$fam.none.prog.log" "$WORK/$fam.none.platform_allocator.prog.log"
    run_one "$fam" none
    native_ok "$fam" || unset "ALLOC[$fam]"
  fi
done
say "alone: $(for f in "${FAMILIES[@]}"; do printf '%s %s (%s s); ' "$f" \
    "$(native_ok "$f" && echo PASS || echo FAIL)" "$(cut -d' ' -f2 "$WORK/$f.none.rc")"; done)"

# ---- (2) the controls, (3) the sanitized runs ------------------------------------------------
if [[ -x $WORK/control ]]; then
  launch control memcheck
  launch control racecheck
else
  say "control not built (nvcc): $(tail -3 "$WORK/control.build.log" | tr '\n' ' ')"
fi
for r in "${RUNS[@]}"; do
  fam=${r%%:*} tool=${r#*:}
  launch "$fam" "$tool"
done
wait
finish
grep -q "^OVERALL: PASS" "$OUT/sanitizer.txt"
