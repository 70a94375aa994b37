#!/usr/bin/env bash
# The methods side by side on CB (SmolLM2-135M-Instruct, the demo's budget: 3 epochs of batch 16,
# inputs cut to 128 tokens, fp32, seeds 0-2), each method's rate to be picked on validation from a grid
# around its default (the picks are made from each variant's validation columns in results.md). CaPT's grid is the step-scale sweep's
# (results/smollm2-135m-cpu-step-scale); deep-prompt runs under the step scale like CaPT, and once
# with one rate (0.3, its former default) to see what the step scale does for it; P-Tuning v2 runs
# with one rate (its default) and under the step scale (its keys' and values' own sizes, r).
set -euo pipefail
W=weights/smollm2-135m-instruct
OUT=${OUT:-runs/methods}
HERE=results/smollm2-135m-cpu-methods
CAPT=".venv/bin/python -m capt"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
run() {  # name, options...
  local name=$1; shift
  if [ ! -f "$OUT/$name/results.json" ]; then
    $CAPT run --model "$W" --tasks cb --seeds 3 --epochs 3 --max-length 128 --device cpu "$@" --out "$OUT/$name" \
      $([ -d "$OUT/$name" ] && echo --resume)
  fi
  mkdir -p "$HERE/$name" && cp "$OUT/$name/results.json" "$OUT/$name/results.md" "$HERE/$name/"
}
for r in ${DEEP-0.025 0.05 0.1}; do run "deep-prompt-r$r" --method deep-prompt --lr "$r"; done
[ -n "${SKIP_DEEP_PLAIN:-}" ] || run deep-prompt-plain-lr0.3 --method deep-prompt --step-scale none --lr 0.3
for lr in ${LINEAR:-3e-4 1e-3 3e-3}; do run "linear-head-lr$lr" --method linear-head --lr "$lr"; done
for lr in ${PREFIX:-3e-3 1e-2 3e-2}; do run "prefix-lr$lr" --method prefix --lr "$lr"; done
for r in ${PREFIX_RMS-1e-2 3e-2 0.1}; do run "prefix-r$r" --method prefix --step-scale rms --lr "$r"; done
for lr in ${PROMPT:-0.1 0.3 1.0}; do run "prompt-lr$lr" --method prompt --lr "$lr"; done
run instance --method instance
