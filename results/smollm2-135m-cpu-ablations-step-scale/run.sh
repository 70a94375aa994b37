#!/usr/bin/env bash
# The paper's integration and depth ablations under the defaults (the per-block step scale at r 0.05,
# the answer cue): CaPT on CB and COPA, seeds 0-2, the demo's budget, one `capt run` per variant
# through the step-scale sweep's script; "add, all blocks" is that sweep's r 0.05 (the default).
# Then the table (table.py) and capt compare's charts. From the repository root.
set -euo pipefail
HERE=results/smollm2-135m-cpu-ablations-step-scale
SWEEP=results/smollm2-135m-cpu-step-scale
export OUT=${OUT:-runs/ablations} HERE RATES=0.05 PLAIN=
NAME=prepend- EXTRA="--integration prepend" bash $SWEEP/sweep.sh
for blocks in odd first-half latter-half; do NAME=$blocks- EXTRA="--blocks $blocks" bash $SWEEP/sweep.sh; done
.venv/bin/python $HERE/table.py
.venv/bin/capt compare $SWEEP/rms-r0.05 $HERE/prepend-rms-r0.05 --out $HERE/integration > /dev/null
.venv/bin/capt compare $SWEEP/rms-r0.05 $HERE/odd-rms-r0.05 $HERE/first-half-rms-r0.05 $HERE/latter-half-rms-r0.05 --out $HERE/depth > /dev/null
