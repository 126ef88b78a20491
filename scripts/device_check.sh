#!/usr/bin/env bash
# One call on a lent GPU machine: check and time a build tree made elsewhere.
#
#   bash scripts/device_check.sh [BUILD_DIR] [all|test|bench|bwd]
#   bash scripts/device_check.sh [BUILD_DIR] kvcache
#   bash scripts/device_check.sh [BUILD_DIR] reliability
#   bash scripts/device_check.sh [BUILD_DIR] sanitize [all|memcheck|racecheck]
#
# BUILD_DIR (default build/dev) holds libfmha, fmha._C, fmha_fwd and fmha_bwd, built on a
# machine with nvcc (scripts/build_dev.sh; `-DFMHA_PRESET=coverage` holds an instance of every
# trait). `test` runs both examples with validation for every feature and the GPU tests, forward
# and backward; `bench` the forward's benchmark; `bwd` the backward's examples and tests alone
# and the backward's benchmark (`python -m bench --bwd --deterministic`); `all` is test, bench
# and the backward's benchmark; `kvcache` the KV-cache tests (every compiled kvcache instance),
# the integrations' GPU tests, `python -m bench --decode` and `--prefill` (bf16, d128). Logs,
# bench.json, bench-bwd.json, bench-decode.json, bench-prefill.json and the property-test
# report go to $OUT (default /tmp/fmha-out); the benchmark tables print last. FMHA_BENCH_ARGS
# adds arguments to every `python -m bench` run. `reliability` runs
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
if [[ $mode == all || $mode == test || $mode == bwd ]]; then
  # The backward through the C++ API: fmha::fwd, then fmha::bwd checked against a float64 CPU
  # reference of dQ, dK, dV (and dBias), for every trait of the backward in the coverage build.
  for args in "-prec=fp16 -d=128 -s=1000 -mask=0" \
              "-prec=bf16 -d=128 -s=1000 -s_k=777 -mask=b" \
              "-prec=bf16 -d=64 -s=777 -s_k=1000 -mask=t" \
              "-prec=bf16 -d=64 -s=1024 -h=8 -h_k=2 -mask=t:100,20" \
              "-prec=fp16 -d=64 -s=500 -mask=b:-1,30" \
              "-prec=fp16 -d=80 -s=555 -mask=1" \
              "-prec=bf16 -d=64 -mode=1 -b=3 -s=100,300,0 -s_k=200,0,300 -mask=b" \
              "-prec=fp16 -d=64 -mode=1 -b=2 -s=200,300 -s_qpad=256,320 -s_kpad=256,320 -mask=t" \
              "-prec=bf16 -d=128 -s=512 -q_eff_lens=300,512 -kv_eff_lens=200,400" \
              "-prec=fp16 -d=128 -s=700 -bias=e:2 -dbias=1" \
              "-prec=bf16 -d=64 -s=700 -s_k=500 -bias=e -dbias=1" \
              "-prec=fp16 -d=64 -mode=1 -b=3 -s=100,200,0 -bias=e:1 -dbias=1" \
              "-prec=bf16 -d=128 -s=700 -bias=e:1" \
              "-prec=bf16 -d=128 -s=700 -bias=a:1 -mask=b" \
              "-prec=bf16 -d=64 -s=700 -p_drop=0.2 -drop_seed=7 -drop_offset=3" \
              "-prec=fp16 -d=64 -mode=1 -b=3 -s=300 -p_drop=0.5 -drop_seed=11 -mask=t:64,0" \
              "-prec=fp16 -d=128 -s=700 -softcap=30 -mask=t" \
              "-prec=bf16 -d=96 -mode=1 -b=3 -s=200,0,150 -mask=b -bias=e:2 -dbias=1 -p_drop=0.3 -softcap=20" \
              "-prec=bf16 -d=192 -d_v=128 -s=500 -mask=1" \
              "-prec=fp16 -d=256 -s=400 -s_k=600 -mask=b" \
              "-prec=bf16 -d=128 -s=1000 -h=8 -h_k=2 -mask=b -deterministic=1" \
              "-prec=fp16 -d=64 -mode=1 -b=3 -s=100,300,0 -mask=t -deterministic=1"; do
    "$build/fmha_bwd" -b=2 -h=4 $args -v=1 -kname=1 2>&1 | tee -a "$out/example_bwd.log" || status=1
  done
  python3 -m pytest tests/test_bwd_gpu.py -q -p no:cacheprovider \
    2>&1 | tee "$out/pytest_bwd_gpu.log" | tail -n 25
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
fi
if [[ $mode == kvcache ]]; then
  python3 -m pytest tests/test_kvcache_gpu.py tests/test_kvcache_api.py tests/test_integrations_gpu.py \
    -q -p no:cacheprovider 2>&1 | tee "$out/pytest_kvcache.log" | tail -n 30
  [[ ${PIPESTATUS[0]} -eq 0 ]] || status=1
  python3 -m bench --decode --dtypes bf16 --hdims 128 --json "$out/bench-decode.json" \
    ${FMHA_BENCH_ARGS:-} 2>"$out/bench_decode_rows.log" | tee "$out/bench-decode.txt" || status=1
  python3 -m bench --prefill --dtypes bf16 --hdims 128 --pages 16,32,64,256 \
    --json "$out/bench-prefill.json" ${FMHA_BENCH_ARGS:-} 2>"$out/bench_prefill_rows.log" \
    | tee "$out/bench-prefill.txt" || status=1
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
if [[ $mode == all || $mode == bwd ]]; then
  python3 -m bench --bwd --deterministic --json "$out/bench-bwd.json" ${FMHA_BENCH_ARGS:-} \
    2>"$out/bench_bwd_rows.log" | tee "$out/bench-bwd.txt" || status=1
fi
exit $status
