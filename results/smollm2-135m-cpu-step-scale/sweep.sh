#!/usr/bin/env bash
# The step-scale sweep: CaPT on CB and COPA, seeds 0-2, the demo's budget (3 epochs, batch 16,
# inputs cut to 128 tokens, fp32), r in {0.025, 0.05, 0.1, 0.2} under the per-block step scale and
# lr in {0.1, 0.3} with one rate (step scale none, the paper-plain form; 0.3 was the default).
# One `capt run` at a time (two torch threads; one or two give the same numbers), from the
# repository root; runs go to $OUT (runs/step-scale), and each variant's results.json and
# results.md are copied to $HERE (this directory; table.py reads them). RATES / PLAIN choose the
# variants, EXTRA adds options to every run and NAME prefixes the variants' names (the
# answer-cue comparison runs this script with EXTRA=--no-answer-cue).
set -euo pipefail
W=weights/smollm2-135m-instruct
OUT=${OUT:-runs/step-scale}
HERE=${HERE:-results/smollm2-135m-cpu-step-scale}
CAPT=".venv/bin/python -m capt"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
common=(--model "$W" --tasks cb,copa --seeds 3 --epochs 3 --max-length 128 --device cpu ${EXTRA:-})
run() {  # name, options...: a finished variant is kept, an interrupted one resumed
  local name=${NAME:-}$1; shift
  if [ ! -f "$OUT/$name/results.json" ]; then
    $CAPT run "${common[@]}" "$@" --out "$OUT/$name" $([ -d "$OUT/$name" ] && echo --resume)
  fi
  mkdir -p "$HERE/$name" && cp "$OUT/$name/results.json" "$OUT/$name/results.md" "$HERE/$name/"
}
for r in ${RATES-0.05 0.1 0.025 0.2}; do run "rms-r$r" --lr "$r"; done
for lr in ${PLAIN-0.3 0.1}; do run "plain-lr$lr" --step-scale none --lr "$lr"; done
