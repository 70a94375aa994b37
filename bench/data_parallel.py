"""Data parallel gradient exchange: one all-reduce of the trained tensors (capt's way) against DDP.

Run under torchrun; every rank takes its half of the same global batches of a task's training
split, as capt train does (capt/distributed.py), and times optimizer steps two ways, in turn
(each way goes first every other step):

  allreduce  capt's step: each rank's loss over the global example count, backward, then
             distributed.sum_gradients: the trained tensors' gradients and the loss flattened
             into one buffer, one all-reduce (SUM)
  ddp        the model wrapped in torch.nn.parallel.DistributedDataParallel (its gradient
             buckets and hooks; forward_sync_buffers=False, since the frozen model's buffers never
             change); DDP averages, so each rank's loss is scaled by the number of ranks

Each way has its own copy of the model (DDP's hooks stay on its copy). Both start from zero
capsules and apply AdamW to the same batches, so their gradients must agree; the script checks
that at every step (fp32, within 1e-4 of the largest gradient: the steps drift apart by float
rounding) before it reports the median milliseconds per step of each, after --warmup steps, and the median time of the
allreduce way's exchange alone (sum_gradients: its one all-reduce and the copies around it).

    torchrun --nproc_per_node 2 bench/data_parallel.py --model weights/smollm2-135m-instruct --task cb
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from capt import distributed  # noqa: E402
from capt.evaluate import encode_examples  # noqa: E402
from capt.load import load_model  # noqa: E402
from capt.methods import attach, method_tensors  # noqa: E402
from capt.tasks import load_task, resolve_data_dir  # noqa: E402
from capt.tokenizer import load_tokenizer  # noqa: E402
from capt.trainer import batch_nll, bucketed_batches  # noqa: E402


class Through:
    """The DDP wrapper where batch_nll calls the model, the wrapped model for everything else it reads."""

    def __init__(self, ddp: DistributedDataParallel):
        self.ddp = ddp

    def __call__(self, *args, **kwargs):
        return self.ddp(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.ddp.module, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--task", default="cb")
    parser.add_argument("--data", default=None)
    parser.add_argument("--batch-size", type=int, default=16, help="global batch (default 16)")
    parser.add_argument("--max-length", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per way (default 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=None, help="also write the figures to this JSON file (rank 0)")
    args = parser.parse_args()

    world = distributed.start("cpu")
    if world.backend is None:
        raise SystemExit("run this under torchrun, e.g. torchrun --nproc_per_node 2 bench/data_parallel.py --model DIR")
    torch.manual_seed(0)
    models = {way: load_model(args.model, "fp32") for way in ("allreduce", "ddp")}  # DDP's hooks stay on its own copy
    tokenizer = load_tokenizer(args.model)
    examples = load_task(args.task, resolve_data_dir(args.data), "train")
    data = encode_examples(examples, tokenizer, models["ddp"].seq2seq, args.max_length)
    lengths = [len(p) + len(t[ex.label]) for p, t, ex in zip(data.prompts, data.targets, data.examples)]
    batches = [b for b in bucketed_batches(lengths, args.batch_size, 0, 0) if len(b) == args.batch_size]
    total = args.warmup + args.steps
    batches = (batches * (total // max(len(batches), 1) + 1))[:total]

    params = {}
    for way, model in models.items():
        attach(model, "capt")  # zero capsules on both copies
        params[way] = list(method_tensors(model).values())
    runs = {
        "allreduce": models["allreduce"],
        "ddp": Through(DistributedDataParallel(models["ddp"], forward_sync_buffers=False)),
    }
    optimizers = {way: torch.optim.AdamW(params[way], lr=1e-3) for way in runs}
    times: dict[str, list[float]] = {way: [] for way in runs}
    exchange: list[float] = []  # the all-reduce of the allreduce way alone
    gap = 0.0
    for i, idx in enumerate(batches):
        n, mine = len(idx), distributed.shard_of(idx, world)
        # each goes first every other step
        for way, model in (list(runs.items()) if i % 2 == 0 else list(runs.items())[::-1]):
            dist.barrier()
            clock = time.perf_counter()
            if way == "allreduce":
                (batch_nll(model, data, mine).sum() / n).backward()
                sent = time.perf_counter()
                distributed.sum_gradients(params[way], torch.zeros(()))
                if i >= args.warmup:
                    exchange.append(time.perf_counter() - sent)
            else:
                (batch_nll(model, data, mine).sum() * world.size / n).backward()  # DDP averages over the ranks
            optimizers[way].step()
            elapsed = time.perf_counter() - clock
            if i >= args.warmup:
                times[way].append(elapsed)
        # the same batches from the same capsules: the same gradients (up to float order), hence the same steps
        a, b = ([p.grad for p in params[way]] for way in runs)
        scale = max(g.abs().max().item() for g in a)
        gap = max(gap, max((x - y).abs().max().item() for x, y in zip(a, b)) / max(scale, 1e-30))
        for optimizer in optimizers.values():
            optimizer.zero_grad(set_to_none=True)
    if gap > 1e-4:
        raise SystemExit(f"the two ways' gradients differ by {gap:.2e} of the largest: they do not compute the same "
                         "step")
    result = {
        "model": args.model, "task": args.task, "world_size": world.size, "backend": world.backend,
        "global_batch": args.batch_size, "max_length": args.max_length, "steps": args.steps,
        "threads_per_rank": torch.get_num_threads(),
        "ms_per_step": {way: round(1000 * statistics.median(t), 1) for way, t in times.items()},
        "allreduce_exchange_ms": round(1000 * statistics.median(exchange), 3),  # of the allreduce way's step
        "trained_values": sum(p.numel() for p in params["allreduce"]),
        "max_gradient_gap_relative": gap,
    }
    if world.lead:
        print(json.dumps(result))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    del runs, model  # DDP goes before the process group (destroying it after hangs)
    distributed.stop(together=True)


if __name__ == "__main__":
    main()
