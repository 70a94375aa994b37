"""The base models' linear layers on the CPU: F.linear against capt.models.ops.Linear on oneDNN's packed
weight, at SmolLM2-135M's shapes (576 -> 576, 576 -> 192, 576 -> 1536, 1536 -> 576), fp32, for
1 row (a decoding step), 8, 64, 256, 1032 (a batch of 8 x 129 positions) and 4096 rows, no grad. The
fastest of 5 alternating rounds, in ms per call; capt.models.ops.Linear packs from these figures (docs/speed.md).

    python bench/packed_linear_cpu.py [--threads 2]
"""

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from capt.models import ops  # noqa: E402
from capt.models.ops import Linear  # noqa: E402
from sdpa_gqa_cpu import fastest_of_two  # noqa: E402  (bench/, this script's folder)

SHAPES = ((576, 576), (576, 192), (576, 1536), (1536, 576))
ROWS = (1, 8, 64, 256, 1032, 4096)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    ops.PACK_MIN_ROWS = 1  # every row count packed: these timings are what the threshold is chosen from
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, fp32; ms per call (F.linear / packed = "
          "speed-up)")
    print("| rows | " + " | ".join(f"{i} -> {o}" for i, o in SHAPES) + " |")
    print("| --- |" + " --- |" * len(SHAPES))
    g = torch.Generator().manual_seed(0)
    layers = []
    for d_in, d_out in SHAPES:
        lin = Linear(d_in, d_out, bias=False).requires_grad_(False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(d_out, d_in, generator=g) * d_in ** -0.5)
        layers.append(lin)
    with torch.no_grad():
        for rows in ROWS:
            cells = []
            for lin in layers:
                x = torch.randn(rows, lin.in_features, generator=g)
                if not lin.packs(x):
                    sys.exit("capt.models.ops.Linear does not pack here (no oneDNN, or CAPT_CPU_PACK=0)")
                torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-4, atol=1e-4)
                plain, packed = fastest_of_two(
                    lambda: F.linear(x, lin.weight), lambda: lin(x), calls=max(3, 8000 // rows), rounds=5
                )
                cells.append(f"{plain:.3f} / {packed:.3f} = {plain / packed:.2f}x")
            print(f"| {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
