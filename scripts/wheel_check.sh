#!/usr/bin/env bash
# One call on a lent GPU machine: the package as users get it. `pip install .` of this checkout
# (the default preset, FMHA_ARCHS=auto: the GPU's own target), built here with this machine's
# toolchain, then the GPU tests against the installed package, not a build tree: the calls
# outside the build (tests/test_misses_gpu.py, each in a process of its own), every compiled
# instance of each operation, the plans, training through the transformers integration, and
# the fuzz test over the public surface. scripts/device_check.sh checks dev builds made
# elsewhere; this is the build that once crashed on every miss, which those never saw.
#
#   bash scripts/wheel_check.sh [TESTS...]       (default: the list below)
#
# A machine without network (the lent ones) gets the build's own requirements from
# FMHA_WHEELHOUSE, a folder of wheels (the nvidia-cutlass wheel the fa3 TUs' headers come
# from): they are installed first and pip builds without isolation, with the build tools
# installed here. FMHA_PRESET, FMHA_FILTER and FMHA_ARCHS pass through as for any install.
# Logs go to $OUT (default /tmp/fmha-out): pip.log, pytest.log, and the fuzz report.
set -uo pipefail
out=${OUT:-/tmp/fmha-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
g++ --version | head -n 1

install=(python3 -m pip install -v .)
if [[ -n ${FMHA_WHEELHOUSE:-} ]]; then
  python3 -m pip install --quiet --no-index --no-deps "$FMHA_WHEELHOUSE"/*.whl || exit 1
  install=(python3 -m pip install -v --no-index --no-build-isolation .)
fi
start=$SECONDS
"${install[@]}" > "$out/pip.log" 2>&1
rc=$?
tus=$(grep -c 'Building CUDA object' "$out/pip.log")
echo "pip install: exit $rc after $((SECONDS - start)) s, $tus CUDA TUs"
[[ $rc -eq 0 ]] || { tail -n 30 "$out/pip.log"; exit 1; }

# `import fmha` finds the installed package: the checkout's runtime/python is on no path.
python3 - <<'EOF' || exit 1
import os
import fmha
counts = (len(fmha.instances()), len(fmha.bwd_instances()), len(fmha.kvcache_instances()))
print("installed", os.path.dirname(fmha.__file__), fmha.compiled_targets(),
      "%d forward, %d backward, %d KV-cache instances" % counts)
EOF
tests=("$@")
if [[ ${#tests[@]} -eq 0 ]]; then
  tests=(tests/test_misses_gpu.py tests/test_package.py tests/test_dispatch_parity.py
         tests/test_integrations_gpu.py tests/test_plans_gpu.py tests/test_fwd_gpu.py
         tests/test_bwd_gpu.py tests/test_kvcache_gpu.py tests/test_api_checks.py
         tests/test_fuzz_surface.py)
fi
FMHA_FUZZ_REPORT="$out/fuzz-report.txt" python3 -m pytest -q -p no:cacheprovider -rs \
  "${tests[@]}" 2>&1 | tee "$out/pytest.log" | tail -n 40
exit "${PIPESTATUS[0]}"
