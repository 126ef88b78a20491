#!/usr/bin/env bash
# compute-sanitizer over the compiled kernel instances of every operation (the forward, the
# backward, KV-cache attention): memcheck on every instance (scripts/sanitize.py: a few tiny
# problems each, checked against the float64 reference: the forward's two, the backward's two
# in the default and the deterministic mode, KV-cache decode with key splits on contiguous
# caches and on pages of every size class, appends with rotary, and chunked prefill), racecheck
# on a subset that still covers every trait value of each operation (`all` is these two;
# synccheck and initcheck run on racecheck's subset when named).
#
#   bash scripts/sanitize.sh [BUILD_DIR] [all|memcheck|racecheck|synccheck|initcheck]
#
# BUILD_DIR (default build/dev) holds fmha's python/ directory (scripts/build_dev.sh). Logs go
# to $OUT (default /tmp/fmha-out) as sanitize-memcheck.log and sanitize-racecheck.log; the
# summary lines print last. Torch's own kernels (input set-up) are checked too: they should be
# clean. Settings:
#   FMHA_SANITIZE_OPS             the operations, sanitize.py's --ops (default
#                                 fwd,bwd,kvcache). The operations take turns instance by
#                                 instance, so a run that the time budget cuts short still
#                                 covers each; where it does (a large build), one operation
#                                 a call, e.g. FMHA_SANITIZE_OPS=kvcache, reaches them all
#   FMHA_SANITIZE_MEMCHECK_ARGS   sanitize.py arguments of the memcheck run
#                                 (default: --time-budget 300, every instance, every case)
#   FMHA_SANITIZE_RACECHECK_ARGS  of the racecheck (synccheck, initcheck) run
#                                 (default: --limit 16 --cases 1 --time-budget 120: 16
#                                 instances of each operation, their first case)
#   FMHA_SANITIZE_TIMEOUT_MEMCHECK, FMHA_SANITIZE_TIMEOUT_RACECHECK
#                                 hard limits in seconds (default 400 and 170, the latter for
#                                 every subset tool: memcheck and racecheck fit one 10-minute
#                                 device call; run them separately for more)
#   FMHA_SANITIZE_GPUS            GPU indices, e.g. 0,1,2,3: each tool runs one process per GPU,
#                                 each on its shard of the instances (sanitize.py --shard K/N),
#                                 for builds of hundreds of instances (the coverage preset)
#   FMHA_SANITIZER_FLAGS          extra compute-sanitizer flags, e.g. --report-api-errors no
#   COMPUTE_SANITIZER, PYTHON     the programs to use
# Exit status: 0 when every run was clean and complete, 1 on sanitizer errors or failed cases,
# 2 when compute-sanitizer is missing or refuses the device, 3 when a run was cut short.
set -uo pipefail
build=${1:-build/dev}
tools=${2:-all}
case $tools in
  all) tools="memcheck racecheck" ;;
  memcheck|racecheck|synccheck|initcheck) ;;
  *) echo "sanitize.sh: unknown tool '$tools'; use all, memcheck, racecheck, synccheck or initcheck" >&2
     exit 2 ;;
esac
out=${OUT:-/tmp/fmha-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/$build/python:$PWD" PYTHONUNBUFFERED=1
export CUDA_MODULE_LOADING=${CUDA_MODULE_LOADING:-LAZY}  # instrument only the kernels that run
# The float64 references are tiny; torch's default of a thread per core, times one process per
# GPU, starves the sanitizer: on 4 H200s and 64 cores, 4 memcheck shards ran 74-82 cases each
# in 380 s with the default, and all of their 616-619 in 19 s with 4 threads.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
python=${PYTHON:-python3}

sanitizer=${COMPUTE_SANITIZER:-}
if [[ -z $sanitizer ]]; then
  sanitizer=$(command -v compute-sanitizer || true)
  for c in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda-*/bin/compute-sanitizer \
           /opt/nvidia/*/compute-sanitizer/compute-sanitizer; do
    [[ -z $sanitizer && -x $c ]] && sanitizer=$c
  done
fi
if [[ -z $sanitizer ]]; then
  echo "sanitize.sh: compute-sanitizer not found (PATH, /usr/local/cuda*/bin); set COMPUTE_SANITIZER" >&2
  exit 2
fi
"$sanitizer" --version | tail -n 1
"$python" - <<'EOF' || exit 2
import fmha, torch
# An fmha that predates an operation lists none of it.
counts = [len(getattr(fmha, listing, list)())
          for listing in ("instances", "bwd_instances", "kvcache_instances")]
print("fmha %d forward, %d backward and %d KV-cache instances, targets" % tuple(counts),
      fmha.compiled_targets(), "; torch", torch.__version__)
EOF

ops=${FMHA_SANITIZE_OPS:-fwd,bwd,kvcache}
# shellcheck disable=SC2206  # word splitting of the argument strings is intended
memcheck_args=(--ops "$ops" ${FMHA_SANITIZE_MEMCHECK_ARGS:---time-budget 300})
racecheck_args=(--ops "$ops"
                ${FMHA_SANITIZE_RACECHECK_ARGS:---limit 16 --cases 1 --time-budget 120})
extra=(${FMHA_SANITIZER_FLAGS:-})

status=0
summary=()
# One sanitizer process per GPU of FMHA_SANITIZE_GPUS, each on its shard of the instances.
gpus=()
IFS=, read -r -a gpus <<<"${FMHA_SANITIZE_GPUS:-}"

judge_log() {  # judge_log TOOL LIMIT LOG RC SECONDS: the run's verdict and lines, into summary
  local tool=$1 limit=$2 log=$3 rc=$4 took=$5
  # What the run says, last: sanitize.py's summary and the sanitizer's own summary lines.
  local lines
  lines=$(grep -E '^sanitize\.py (summary|: the CUDA|: time budget|: shard)|========= [A-Z ]*SUMMARY' "$log")
  local kinds
  kinds=$(grep -E '^========= +(Invalid|Program hit|Leaked|Out-of-range|Misaligned|Malformed|Race|Potential|Error|Warning|Barrier|Hardware|Uninitialized)' "$log" \
          | sed -E 's/ at 0x[0-9a-f]+.*//; s/ of size [0-9]+.*//' | sort | uniq -c | sort -rn | head -n 8)
  local in_fmha
  in_fmha=$(grep -cE '^=========.*(fmha::|fwd_kernel|bwd_|kvcache_|dropout_mask_kernel)' "$log")
  local verdict="clean"
  if grep -qiE 'device not supported|not supported on this (device|platform)|unable to (create|attach)' "$log"; then
    verdict="REFUSED: compute-sanitizer cannot run on this machine (a gVisor runtime refuses it; Firecracker machines ran it)"
    [[ $status -eq 0 ]] && status=2
  elif [[ $rc -eq 124 || $rc -eq 137 || $rc -eq 130 ]]; then
    verdict="CUT at the ${limit} s limit (rc $rc): raise FMHA_SANITIZE_TIMEOUT_${tool^^} or shrink the run"
    [[ $status -eq 0 ]] && status=3
  elif [[ $rc -eq 3 ]]; then
    verdict="INCOMPLETE: sanitize.py's time budget ran out (cases not run)"
    [[ $status -eq 0 ]] && status=3
  elif [[ $rc -ne 0 ]]; then
    verdict="FAILED (rc $rc)"
    status=1
  fi
  summary+=("-- $tool ($log): $verdict, ${took} s")
  [[ -n $lines ]] && summary+=("$lines")
  if [[ -n $kinds ]]; then
    summary+=("   reports by kind:" "$kinds" "   report lines naming fmha kernels: $in_fmha")
  fi
}

run_tool() {  # run_tool TOOL TIMEOUT [sanitizer flags...] -- [sanitize.py args...]
  local tool=$1 limit=$2
  shift 2
  local flags=()
  while [[ $# -gt 0 && $1 != -- ]]; do flags+=("$1"); shift; done
  shift
  local cmd=("$sanitizer" --tool "$tool" --error-exitcode 1 --target-processes all
             ${flags[@]+"${flags[@]}"} ${extra[@]+"${extra[@]}"} "$python" scripts/sanitize.py "$@")
  local t0=$SECONDS
  if [[ ${#gpus[@]} -le 1 ]]; then
    local log="$out/sanitize-$tool.log"
    echo "== $tool (log: $log): ${cmd[*]}"
    timeout --signal=INT --kill-after=30 "$limit" "${cmd[@]}" >"$log" 2>&1
    judge_log "$tool" "$limit" "$log" $? $((SECONDS - t0))
    return
  fi
  local n=${#gpus[@]} pids=() k
  echo "== $tool on GPUs ${gpus[*]}, a shard each (logs: $out/sanitize-$tool-K-of-$n.log): ${cmd[*]} --shard K/$n"
  for ((k = 1; k <= n; k++)); do
    CUDA_VISIBLE_DEVICES=${gpus[k - 1]} timeout --signal=INT --kill-after=30 "$limit" \
      "${cmd[@]}" --shard "$k/$n" >"$out/sanitize-$tool-$k-of-$n.log" 2>&1 &
    pids+=($!)
  done
  for ((k = 1; k <= n; k++)); do
    wait "${pids[k - 1]}"
    judge_log "$tool" "$limit" "$out/sanitize-$tool-$k-of-$n.log" $? $((SECONDS - t0))
  done
}

for tool in $tools; do
  if [[ $tool == memcheck ]]; then
    # No --leak-check by default: libfmha allocates no device memory, while torch's caching
    # allocator keeps its 2 MB blocks to process exit, which leak checking reports as leaks
    # (150 of them on the coverage build). FMHA_SANITIZER_FLAGS="--leak-check full" turns it on.
    run_tool memcheck "${FMHA_SANITIZE_TIMEOUT_MEMCHECK:-400}" -- \
      --device-reset ${memcheck_args[@]+"${memcheck_args[@]}"}
  else
    flags=()
    [[ $tool == racecheck ]] && flags=(--racecheck-report all)
    run_tool "$tool" "${FMHA_SANITIZE_TIMEOUT_RACECHECK:-170}" ${flags[@]+"${flags[@]}"} -- \
      ${racecheck_args[@]+"${racecheck_args[@]}"}
  fi
done
echo "== sanitize.sh summary"
printf '%s\n' "${summary[@]}"
exit $status
