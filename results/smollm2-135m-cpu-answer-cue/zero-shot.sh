#!/usr/bin/env bash
# Zero-shot with and without the answer cue on the six SuperGLUE tasks (test = the official validation
# set, inputs cut to 128 tokens), and the zero capsule (the slot, nothing trained) on CB and COPA.
# CAPT_DATA must point at the six tasks' files (CB and COPA ship in data/superglue).
set -euo pipefail
HERE=results/smollm2-135m-cpu-answer-cue
CAPT=".venv/bin/python -m capt"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
for task in ${TASKS:-cb copa rte wic boolq multirc}; do
  for cue in answer-cue no-answer-cue; do
    f=$HERE/zero-shot/$task-$cue.json
    [ -f "$f" ] || { mkdir -p "$HERE/zero-shot"; $CAPT eval --model weights/smollm2-135m-instruct --task "$task" --max-length 128 --$cue --json > "$f.tmp" && mv "$f.tmp" "$f"; }
  done
done
for task in cb copa; do
  for cue in answer-cue no-answer-cue; do
    f=$HERE/zero-shot/$task-instance-$cue.json
    [ -f "$f" ] || { $CAPT eval --model weights/smollm2-135m-instruct --task "$task" --method instance --max-length 128 --$cue --json > "$f.tmp" && mv "$f.tmp" "$f"; }
  done
done
