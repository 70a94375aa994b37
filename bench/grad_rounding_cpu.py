"""How far rounding alone moves the bench's validity figures: the first loss and the first capsule
gradient's norm of a capt train step (bench.py's build_capt and capt_fn, its random weights), in fp64,
in fp32, and in fp32 with every linear product's inputs rounded to TF32's 10-bit mantissa (what a GPU's
TF32 matmul reads; the attention products stay fp32), on the CPU.

    python bench/grad_rounding_cpu.py WORKLOAD [--layers N] [--batch 2] [--length 64]

bench.py marks a compiled row INVALID when these figures differ from its eager row's by more than
1e-3 (fp32) or 2e-2 (bf16). A workload whose figures move that much under rounding alone cannot pass
that check however right the compiled graph is: the first H200 run's compiled T5 rows.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("CAPT_CPU_PACK", "0")  # every product through F.linear, which this script rounds
sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (bench/, this script's folder)


def tf32_inputs(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest 10-bit mantissa in the forward, its gradient passed through unchanged."""
    bits = x.detach().float().view(torch.int32)
    rounded = ((bits + 0x1000) & ~0x1FFF).view(torch.float32)
    return x + (rounded - x).detach()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workload", choices=sorted(bench.WORKLOADS))
    parser.add_argument("--layers", type=int, help="fewer layers than the workload's (each stack)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--length", type=int, default=64)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    family = bench.WORKLOADS[args.workload]["config"]["model_type"]
    config = dict(bench.WORKLOADS[args.workload]["config"])
    if args.layers:
        config.update(dict(num_layers=args.layers, num_decoder_layers=args.layers) if family == "t5"
                      else dict(num_hidden_layers=args.layers))
    batch = bench.make_batch(family, args.batch, args.length, 8, config["vocab_size"], "cpu", seed=0)
    linear = torch.nn.functional.linear
    figures = {}
    for name, dtype, rounded in (("fp64", torch.float64, False), ("fp32", torch.float32, False),
                                 ("fp32, TF32 inputs", torch.float32, True)):
        if rounded:
            torch.nn.functional.linear = lambda x, w, b=None: linear(tf32_inputs(x), tf32_inputs(w), b)
        try:
            model, params = bench.build_capt(config, dtype, torch.device("cpu"), seed=0)
            loss = bench.capt_fn(model, family, "train", args.batch)(batch)
            loss.backward()
        finally:
            torch.nn.functional.linear = linear
        figures[name] = (loss.item(), float(params[0].grad.norm()))
        del model, params
    base_loss, base_grad = figures["fp64"]
    print(f"{args.workload}, {args.layers or 'all'} layers, batch {args.batch} x {args.length}, CPU")
    print("| arithmetic | first loss | first capsule-gradient norm | loss vs fp64 | gradient norm vs fp64 |")
    print("| --- | --- | --- | --- | --- |")
    for name, (loss, grad) in figures.items():
        print(f"| {name} | {loss:.6f} | {grad:.6f} | {abs(loss - base_loss) / abs(base_loss):.1e} "
              f"| {abs(grad - base_grad) / base_grad:.1e} |")


if __name__ == "__main__":
    main()
