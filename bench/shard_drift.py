"""How far the capsules of an N-rank run drift from a 1-process run by the order of float additions.

In one process, two copies of the model train side by side on the same batches (the first
steps of `capt train` with the same settings: batch order, AdamW, warm-up and decay over
--steps): one sums each batch's loss at once, as one process does; the other sums it in the
parts N ranks would take (distributed.shard_of), as a torchrun run does. The gradients differ
only in the order of the float additions; the script prints, after every step, the largest
capsule value and the largest difference between the two copies.

--compare ONE TWO: also compare each copy with the best capsules of two run directories made
by `capt train --max-steps STEPS` (one evaluation, so best = last) with the same settings, in
one process and under torchrun with N processes.

    python bench/shard_drift.py --model weights/smollm2-135m-instruct --task cb --steps 10 \\
        --compare runs/one runs/two
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from capt.distributed import World, shard_of  # noqa: E402
from capt.evaluate import encode_examples  # noqa: E402
from capt.load import load_model  # noqa: E402
from capt.methods import attach, method_tensors  # noqa: E402
from capt.tasks import load_task, resolve_data_dir  # noqa: E402
from capt.tokenizer import load_tokenizer  # noqa: E402
from capt.trainer import TrainConfig, batch_nll, bucketed_batches, lr_factor  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", default="cb")
    parser.add_argument("--data", default=None)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--lr", type=float, default=0.3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--compare", nargs=2, metavar=("ONE", "TWO"), help="run directories: 1 process, --ranks "
                                                                           "processes")
    args = parser.parse_args()

    config = TrainConfig(model=args.model, task=args.task, out="-", lr=args.lr, max_steps=args.steps, seed=args.seed)
    warmup = min(round(config.warmup * args.steps), args.steps)  # as the trainer plans it (warmup < 1)
    tokenizer = load_tokenizer(args.model)
    examples = load_task(args.task, resolve_data_dir(args.data), "train", args.seed)
    copies = {"whole": load_model(args.model, "fp32"), "parts": load_model(args.model, "fp32")}
    data = encode_examples(examples, tokenizer, copies["whole"].seq2seq, args.max_length)
    lengths = [len(p) + len(t[ex.label]) for p, t, ex in zip(data.prompts, data.targets, data.examples)]
    batches = [b for epoch in range(args.steps) for b in bucketed_batches(lengths, args.batch_size, args.seed, epoch)][
        : args.steps
    ]
    optimizers, schedules = {}, {}
    for name, model in copies.items():
        attach(model, "capt")
        optimizers[name] = torch.optim.AdamW(list(method_tensors(model).values()), lr=args.lr, weight_decay=0.0)
        schedules[name] = torch.optim.lr_scheduler.LambdaLR(
            optimizers[name], lambda s: lr_factor(s, warmup, args.steps)
        )
    for step, idx in enumerate(batches):
        for name, model in copies.items():
            parts = [idx] if name == "whole" else [shard_of(idx, World(r, args.ranks)) for r in range(args.ranks)]
            for part in parts:
                if part:
                    (batch_nll(model, data, part).sum() / len(idx)).backward()
            optimizers[name].step()
            schedules[name].step()
            optimizers[name].zero_grad(set_to_none=True)
        whole, split = (
            torch.cat([p.detach().reshape(-1) for p in method_tensors(m).values()]) for m in copies.values()
        )
        print(f"step {step + 1}: largest capsule value {whole.abs().max().item():.4f}, "
              f"largest difference {(whole - split).abs().max().item():.2e}", flush=True)
    if args.compare:
        for (name, model), run in zip(copies.items(), args.compare):
            saved = load_file(Path(run) / "best" / "capsules.safetensors")
            values = method_tensors(model)
            gap = max((values[k].detach() - saved[k]).abs().max().item() for k in saved)
            print(f"{name} batches vs {run}: largest difference {gap:.2e}")


if __name__ == "__main__":
    main()
