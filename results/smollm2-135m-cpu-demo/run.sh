#!/usr/bin/env bash
# The demo on seeds 0, 1 and 2 (`make demo` is seed 0): what it prints, its curves and evaluations,
# the wall time, the commit and the processor. Run from the repository root after `make weights`;
# the CB files that ship in data/superglue are used (CAPT_DATA unset), two torch threads.
set -euo pipefail
HERE=results/smollm2-135m-cpu-demo
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
unset CAPT_DATA
for k in ${SEEDS:-0 1 2}; do
  mkdir -p "$HERE/seed$k"
  SECONDS=0
  .venv/bin/python -m capt.cli.demo --seed "$k" --out "runs/demo-seed$k" > "$HERE/seed$k/demo.txt"  # stdout only: no progress bars
  echo "$SECONDS" > "$HERE/seed$k/wall_s"  # whole seconds
  cp "runs/demo-seed$k/curves.png" "runs/demo-seed$k/metrics.jsonl" "$HERE/seed$k/"
done
{ echo "commit $(git rev-parse HEAD)$(git diff --quiet HEAD -- capt || echo +dirty)"
  echo "processor $(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)"
  echo "torch $(.venv/bin/python -c 'import torch; print(torch.__version__)')"; } > "$HERE/made-at.txt"
