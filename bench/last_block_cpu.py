"""The last block at the read rows only, against the full last block, on the CPU: one process, one
model (the real SmolLM2-135M-Instruct with capsules), the two paths alternating step by step.

    python bench/last_block_cpu.py [--pairs 10] [--threads 2]

A step is hf_speed.py's: B 8 x T 128 random ids, the last 8 the answer, logits at the 8 positions
that predict them; train = forward and the capsules' gradient, eval = forward under no_grad. The
full path is the model's features at every row, gathered at those positions, then its output matrix
(the last block then runs at every row). Process time per
step; prints each path's median and the median of the per-pair ratios (full / trimmed: > 1, the
trim is faster).
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capt.load import load_model  # noqa: E402
from capt.methods import attach, method_parameters  # noqa: E402
from hf_speed import batch  # noqa: E402  (bench/, this script's folder)
from hf_speed import parse_args as hf_speed_args  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "weights" / "smollm2-135m-instruct")
    p.add_argument("--pairs", type=int, default=10)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        sys.exit(f"no checkpoint in {args.model}: `make weights` builds SmolLM2-135M-Instruct there")
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    attach(model, "capt")
    model.eval()
    vectors = list(method_parameters(model).values())
    b = batch(hf_speed_args([]), model.config.vocab_size)  # hf_speed.py's batch, its default sizes
    at = b["at"].expand(b["ids"].shape[0], -1)

    def step(full: bool, train: bool) -> None:
        with torch.set_grad_enabled(train):
            if full:  # every row through the last block, then the read rows
                h = model.features(b["ids"], prompt_mask=b["prompt_mask"])  # (B, T, d)
                logits = model.lm_logits(h.gather(1, at[..., None].expand(-1, -1, h.shape[-1])))
            else:
                logits = model(b["ids"], prompt_mask=b["prompt_mask"], logits_at=at)
            if train:
                torch.autograd.grad(F.cross_entropy(logits.flatten(0, 1), b["targets"].flatten()), vectors)

    for train in (True, False):
        times = {True: [], False: []}
        step(True, train), step(False, train)  # warm-up
        for i in range(args.pairs):
            for full in ((True, False) if i % 2 else (False, True)):  # alternate the order
                start = time.process_time()
                step(full, train)
                times[full].append(time.process_time() - start)
        ratios = [a / b for a, b in zip(times[True], times[False])]
        print(f"{'train' if train else 'eval'}: full {statistics.median(times[True]):.3f} s, trimmed "
              f"{statistics.median(times[False]):.3f} s (process time), full / trimmed "
              f"{statistics.median(ratios):.3f}x "
              f"({min(ratios):.3f}-{max(ratios):.3f})")


if __name__ == "__main__":
    main()
