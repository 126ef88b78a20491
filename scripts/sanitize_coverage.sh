#!/usr/bin/env bash
# compute-sanitizer over every instance of the coverage preset's sm90a half and a sample of its
# sm80 half, on a lent machine of several GPUs (nvidia-h100-x4: 64 cores compile the ~750 sm90a
# TUs in minutes, and each GPU checks a shard of the instances). Three steps, each one device call
# of at most 10 minutes, on the same warm machine (the build trees stay between calls):
#
#   bash scripts/sanitize_coverage.sh build      # build/cov90 (sm90a, every coverage instance)
#                                                # and build/cov80 (sm80, its fp16 half)
#   bash scripts/sanitize_coverage.sh memcheck   # every case of every instance; the sm80 sample
#   bash scripts/sanitize_coverage.sh racecheck  # the first case of each; the sm80 sample
#
# sm80 instances carry compute_80 PTX, which the driver compiles for the Hopper GPU: the same
# kernels an sm80 GPU runs, built for it by the JIT (no sm80 GPU is lent). The sample is the
# fp16 half, from which sanitize.py takes the instances that cover every trait value first.
# FMHA_WHEELHOUSE (default .whl) holds the nvidia-cutlass wheel the fa3 TUs' headers come from.
# Logs go to $OUT (default /tmp/fmha-out); sanitize.sh's summaries print last.
set -uo pipefail
step=${1:-}
out=${OUT:-/tmp/fmha-out}
mkdir -p "$out"
gpus=$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)

case $step in
  build)
    cutlass=/tmp/fmha-cutlass
    python3 -m pip install -q --no-deps --no-index --target "$cutlass" \
      "${FMHA_WHEELHOUSE:-.whl}"/nvidia_cutlass-*.whl || exit 1
    common=(-G Ninja -DFMHA_PRESET=coverage -DFMHA_BUILD_EXAMPLES=OFF
            -DFMHA_CUTLASS_INCLUDE_DIR="$cutlass/cutlass_library/source/include"
            -DPython3_EXECUTABLE="$(command -v python3)"
            -Dpybind11_DIR="$(python3 -m pybind11 --cmakedir)")
    cmake -S . -B build/cov80 "${common[@]}" -DFMHA_ARCHS=80 -DFMHA_FILTER=fp16 \
      >"$out/cmake.log" 2>&1 || { tail -n 20 "$out/cmake.log"; exit 1; }
    cmake -S . -B build/cov90 "${common[@]}" -DFMHA_ARCHS=90a \
      >>"$out/cmake.log" 2>&1 || { tail -n 20 "$out/cmake.log"; exit 1; }
    for tree in cov80 cov90; do
      start=$SECONDS
      cmake --build "build/$tree" -j "$(nproc)" >"$out/build-$tree.log" 2>&1
      rc=$?
      echo "build/$tree: exit $rc after $((SECONDS - start)) s," \
           "$(grep -c 'Building CUDA object' "$out/build-$tree.log") CUDA TUs compiled"
      [[ $rc -eq 0 ]] || { grep -m 5 -B 2 -A 10 'error' "$out/build-$tree.log"; exit 1; }
    done
    ;;
  memcheck|racecheck)
    # Every sm90a instance: memcheck on all of each one's cases, racecheck on its first; then
    # the sm80 sample, the instances that cover every trait value of each operation first.
    # The budgets keep a step inside one 10-minute device call.
    tool=${step^^}
    case $step in
      memcheck) cov90_args="--time-budget 380" cov80_args="--limit 48 --time-budget 90" ;;
      racecheck) cov90_args="--cases 1 --time-budget 380" cov80_args="--limit 24 --cases 1 --time-budget 90" ;;
    esac
    status=0
    env OUT="$out/cov90" FMHA_SANITIZE_GPUS="$gpus" "FMHA_SANITIZE_${tool}_ARGS=$cov90_args" \
      "FMHA_SANITIZE_TIMEOUT_${tool}=420" bash scripts/sanitize.sh build/cov90 "$step" || status=1
    env OUT="$out/cov80" FMHA_SANITIZE_GPUS="$gpus" "FMHA_SANITIZE_${tool}_ARGS=$cov80_args" \
      "FMHA_SANITIZE_TIMEOUT_${tool}=120" bash scripts/sanitize.sh build/cov80 "$step" || status=1
    exit $status
    ;;
  *)
    echo "sanitize_coverage.sh: say build, memcheck or racecheck" >&2
    exit 2
    ;;
esac
