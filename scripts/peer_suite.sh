#!/usr/bin/env bash
# FlashAttention-2's own test suite against fmha's compatibility layer on a lent machine, as
# fast as the machine allows: `pip install .` of the flash_attn preset for this GPU (every
# instance FlashAttention-2's API can call, compiled on all the host's cores at once rather
# than one at a time on demand), then the suite's cases that `-k` selects spread over every GPU
# by pytest-xdist (one worker a GPU, scripts/peer_slice.py), cut at a time limit, and the tally
# per test function (scripts/peer_tally.py).
#
#   FMHA_WHEELHOUSE=.whl PEER_SECONDS=300 bash scripts/peer_suite.sh "EXPRESSION" [PEER_PARAMS]
#
# EXPRESSION is pytest's -k (e.g. "test_flash_attn_bwd_overflow or test_flash_attn_causal"),
# PEER_PARAMS scripts/peer_slice.py's (e.g. d=128). The tests stop after PEER_SECONDS (default
# 300), or earlier where CALL_SECONDS says how long the whole script may take (a lent machine's
# limit a call), keeping 15 s for the tally.
#
# The suite is read from ../shared/peer-tests, or from PEER_TESTS (a copy carried to the lent
# machine, which gets the checkout alone). FMHA_SKIP_INSTALL=1 reuses what an earlier call
# installed on a machine still held. Logs go to $OUT (default /tmp/fmha-out): pip.log,
# peer.log (pytest -v, complete up to the limit) and tally.md.
set -uo pipefail
out=${OUT:-/tmp/fmha-out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
expression=${1:?"usage: peer_suite.sh EXPRESSION [PEER_PARAMS]"}
export PEER_PARAMS=${2:-}
suite=${PEER_TESTS:-../shared/peer-tests}
[[ -d $suite/flash_attn ]] || { echo "no suite at $suite (set PEER_TESTS)" >&2; exit 1; }
gpus=$(nvidia-smi --list-gpus | wc -l)
echo "$gpus GPUs, $(nproc) cores"

if [[ -z ${FMHA_SKIP_INSTALL:-} ]]; then
  install=(python3 -m pip install -v .)
  if [[ -n ${FMHA_WHEELHOUSE:-} ]]; then
    python3 -m pip install --quiet --no-index --no-deps "$FMHA_WHEELHOUSE"/*.whl || exit 1
    install=(python3 -m pip install -v --no-index --no-build-isolation .)
  fi
  start=$SECONDS
  FMHA_PRESET=flash_attn "${install[@]}" > "$out/pip.log" 2>&1 || { tail -n 30 "$out/pip.log"; exit 1; }
  echo "pip install (flash_attn preset): $((SECONDS - start)) s," \
       "$(grep -c 'Building CUDA object' "$out/pip.log") CUDA TUs"
fi

limit=${PEER_SECONDS:-300}
if [[ -n ${CALL_SECONDS:-} ]] && (( CALL_SECONDS - SECONDS - 15 < limit )); then
  limit=$((CALL_SECONDS - SECONDS - 15))
fi
start=$SECONDS
PEER_GPUS=$gpus PYTHONPATH=scripts timeout "$limit" python3 -m pytest -v -rf \
  -p no:cacheprovider -p peer_slice -n "$gpus" "$suite/flash_attn" -k "$expression" \
  > "$out/peer.log" 2>&1
echo "pytest: exit $? after $((SECONDS - start)) s (124: stopped at the time limit)"
python3 scripts/peer_tally.py "$out/peer.log" | tee "$out/tally.md"
