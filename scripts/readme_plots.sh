#!/usr/bin/env bash
# The README's performance plots, redrawn from the raw runs in docs/results (no GPU, no torch;
# needs matplotlib: pip install '.[plot]'). Each figure's title names its GPU, date and the
# bench command; these runs predate bench recording them in the JSON, so they are given here.
#
#   bash scripts/readme_plots.sh [OUT_DIR]   (default docs/plots)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-docs/plots}
results=docs/results
mkdir -p "$out"

# Forward: the last full grid (S 512-16k, d64/128/256), the fa3 build of commit 030b133.
python3 -m bench.plot "$results/h100-2026-11-21-fwd-fa3/bench.json" --dtype bf16 \
  --date 2026-11-21 --command "python -m bench --dtypes bf16,fp16 --hdims 64,128,256" \
  --out "$out/h100-2026-11-21-fwd-bf16.png"

# Backward alone (2.5x the forward's FLOPs) and forward + backward (3.5x), kernel-only.
for table in bwd fwd_bwd; do
  python3 -m bench.plot "$results/h100-2026-11-27-bwd-training-loop/bwd-bf16.json" \
    --table "${table}_rows" --date 2026-11-27 --command "python -m bench --bwd --dtypes bf16" \
    --out "$out/h100-2026-11-27-${table//_/-}-bf16.png"
done

# A decode step, GB/s against the device-to-device copy, 64 query heads on 8 K/V heads.
python3 -m bench.plot "$results/h100-2026-11-27-decode/bench-decode-gqa8.json" \
  --date 2026-11-27 --command "python -m bench --decode --dtypes bf16 --hdims 128 --gqa 8 --rounds 2" \
  --out "$out/h100-2026-11-27-decode-bf16-d128.png"
