#!/usr/bin/env bash
# One call on a lent GPU machine: check and time a build tree made elsewhere.
#
#   bash scripts/device_check.sh [BUILD_DIR] [all|test|bench]
#   bash scripts/device_check.sh [BUILD_DIR] reliability
#   bash scripts/device_check.sh [BUILD_DIR] sanitize [all|memcheck|racecheck]
#
# BUILD_DIR (default build/dev) holds libfmha, fmha._C and fmha_fwd, built on a machine with
# nvcc (scripts/build_dev.sh; `-DFMHA_PRESET=coverage` holds an instance of every trait). Logs,
# bench.json and the property-test report go to $OUT (default /tmp/fmha-out); the benchmark
# table prints last. FMHA_BENCH_ARGS adds arguments to `python -m bench`. `reliability` runs
# tests/test_reliability_gpu.py (big tensors, streams, CUDA graphs, NaN/Inf; about a minute);
# `sanitize` runs scripts/sanitize.sh (compute-sanitizer memcheck over every instance and
# racecheck over a covering subset; its summary prints last). Neither is part of `all`.
set -uo pipefail
build=${1:-build/dev}
mode=${2:-all}
out=${OUT:-/tmp/fmha-out}
mkdir -p "$out"
export PYTHONPATH="$PWD/$build/python:$PWD" PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,temperature.gpu --format=csv
python3 -c "import fmha, torch; print('fmha targets', fmha.compiled_targets(), len(fmha.instances()), 'instances; torch', torch.__version__)" || exit 1

status=0
if [[ $mode == all || $mode == test ]]; then
  # The C++ path: dispatcher + example program, validated against a float64 CPU reference.
  for args in "-prec=fp16 -d=128 -s=1000 -mask=0" \
              "-prec=bf16 -d=128 -s=1000 -s_k=777 -mask=b -lse=1" \
              "-prec=bf16 -d=64 -s=1024 -h=8 -h_k=2 -mask=t:100,20" \
              "-prec=fp16 -d=80 -s=555 -mask=1" \
              "-prec=bf16 -d=64 -mode=1 -b=3 -s=100,300,0 -mask=b -lse=1" \
              "-prec=fp16 -d=64 -mode=1 -b=2 -s=200,300 -s_qpad=256,320 -s_kpad=256,320 -mask=t" \
              "-prec=bf16 -d=128 -s=512 -q_eff_lens=300,512 -kv_eff_lens=200,400 -b=2" \
              "-prec=fp16 -d=128 -s=700 -bias=e:2 -mask=t" \
              "-prec=bf16 -d=128 -s=700 -bias=a:1 -mask=b" \
              "-prec=fp16 -d=64 -s=700 -vlayout=c -mask=t" \
              "-prec=bf16 -d=64 -s=700 -p_drop=0.2 -drop_seed=7 -drop_offset=3" \
              "-prec=fp16 -d=128 -s=700 -softcap=30 -mask=t"; do
    "$build/fmha_fwd" -b=2 -h=4 $args -v=1 -kname=1 2>&1 | tee -a "$out/example.log" || status=1
  done
  FMHA_PROPERTY_REPORT="$out/properties.txt" python3 -m pytest tests/test_fwd_gpu.py tests/test_dispatch_parity_gpu.py tests/test_plans_gpu.py \
    tests/test_fwd_properties_gpu.py tests/test_api_checks.py -q -p no:cacheprovider \
    2>&1 | tee "$out/pytest_gpu.log" | tail -n 25
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $mode == reliability ]]; then
  python3 -m pytest tests/test_reliability_gpu.py -q -p no:cacheprovider -rs \
    2>&1 | tee "$out/pytest_reliability.log" | tail -n 40
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $mode == sanitize ]]; then
  bash scripts/sanitize.sh "$build" "${3:-all}"
  rc=$?
  [[ $rc -eq 0 ]] || status=$rc
fi
if [[ $mode == all || $mode == bench ]]; then
  python3 -m bench --json "$out/bench.json" ${FMHA_BENCH_ARGS:-} 2>"$out/bench_rows.log" \
    | tee "$out/bench.txt" || status=1
fi
exit $status
