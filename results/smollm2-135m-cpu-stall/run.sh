#!/usr/bin/env bash
# What to try when a run does not learn (docs/your-data.md#when-a-run-does-not-learn): CB cut to 90
# training rows, read through two task files, the demo's (examples/cb-yes-no.json, an answer cue and
# the words yes / no / maybe) and one without a cue whose label words are CB's own (cb-bare.json here),
# each trained with CaPT's defaults, at 3 times the default rate, for 30 epochs (the cue-less one), and
# with the linear head. One process at a time, one torch thread. Run from the repository root after `make weights`;
# writes runs/stall/NAME and, from each run, summary.json here.
set -euo pipefail
HERE=results/smollm2-135m-cpu-stall
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
unset CAPT_DATA
common=(--model weights/smollm2-135m-instruct --train-rows 90 --max-length 128 --device cpu)
run() {
  local name=$1 task=$2; shift 2
  [ -f "runs/stall/$name/test.json" ] || .venv/bin/capt train "${common[@]}" --task "$task" --out "runs/stall/$name" "$@"
}
for t in yes-no bare; do
  task=$([ $t = yes-no ] && echo examples/cb-yes-no.json || echo $HERE/cb-bare.json)
  run "$t-capt" "$task" --epochs 10
  run "$t-capt-lr3x" "$task" --epochs 10 --lr 0.15
  [ $t = yes-no ] || run "$t-capt-e30" "$task" --epochs 30  # the run that starts furthest from the format
  run "$t-linear-head" "$task" --epochs 10 --method linear-head
done
.venv/bin/python $HERE/summarize.py runs/stall > $HERE/summary.json
