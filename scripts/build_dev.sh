#!/usr/bin/env bash
# Builds a development tree for a lent GPU machine: libfmha + the example with this machine's
# nvcc, and fmha._C for Python 3.12 (the device machines' Python), into BUILD_DIR.
#
#   bash scripts/build_dev.sh [BUILD_DIR] [cmake -D options...]
#   bash scripts/build_dev.sh build/dev -DFMHA_FILTER=bf16,hdim128
set -euo pipefail
build=${1:-build/dev}
shift || true
python=${FMHA_DEV_PYTHON:-python3.12}
cmake -S . -B "$build" -G Ninja -DFMHA_ARCHS="80;90a" \
  -DPython3_EXECUTABLE="$(command -v "$python")" \
  -Dpybind11_DIR="$("$python" -m pybind11 --cmakedir)" "$@"
cmake --build "$build"
