#!/usr/bin/env bash
# One call on a lent machine of several GPUs: the package as users get it (`pip install .`, the
# default preset, compile on demand for the rest), then the multi-GPU tests (context parallel,
# FSDP2) and the context-parallel benchmark under torchrun, on 2 GPUs and then on every GPU of
# the machine where it has more.
#
#   FMHA_WHEELHOUSE=.whl bash scripts/distributed_check.sh [GPU COUNTS]   (default: 2 and all)
#
# FMHA_WHEELHOUSE as for scripts/wheel_check.sh (a machine without network). Logs and the
# benchmark's JSON go to $OUT (default /tmp/fmha-out): pip.log, tests-<N>gpu.log,
# bench-<N>gpu.json. NCCL's NVLink multicast stays off (the lent machines set
# NCCL_NVLS_ENABLE=0; it is set here too where a machine does not).
set -uo pipefail
out=${OUT:-/tmp/fmha-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=index,name --format=csv,noheader
gpus=$(nvidia-smi --list-gpus | wc -l)
counts=${*:-2 $gpus}

if [[ -n ${FMHA_WHEELHOUSE:-} ]]; then
  python3 -m pip install --quiet --no-index --no-deps "$FMHA_WHEELHOUSE"/*.whl || exit 1
  install=(python3 -m pip install -v --no-index --no-build-isolation .)
else
  install=(python3 -m pip install -v .)
fi
start=$SECONDS
"${install[@]}" > "$out/pip.log" 2>&1 || { tail -n 30 "$out/pip.log"; exit 1; }
echo "pip install: $((SECONDS - start)) s"

status=0
for n in $(printf '%s\n' $counts | sort -un); do
  (( n >= 2 && n <= gpus )) || continue
  start=$SECONDS
  timeout 360 torchrun --nproc-per-node="$n" -m pytest -q -p no:cacheprovider -rs \
    tests/test_context_parallel_gpu.py tests/test_fsdp_gpu.py > "$out/tests-${n}gpu.log" 2>&1
  rc=$?
  echo "tests on $n GPUs: exit $rc after $((SECONDS - start)) s"
  grep -E "passed|failed|error|FSDP2|step |^ +[0-9]+ " "$out/tests-${n}gpu.log" | head -n 60
  (( rc == 0 )) || status=1
  # Steps of 0.1-1 s at 128k tokens: a median of 5 is steady, and the call's time is short.
  timeout 180 torchrun --nproc-per-node="$n" -m bench.distributed --seqlens 131072 \
    --steps 5 --warmup 2 --json "$out/bench-${n}gpu.json" 2>&1 | grep -v "^\[rank" | tail -n 12
done
exit "$status"
