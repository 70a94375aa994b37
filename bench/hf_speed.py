"""capt against capt.hf (the same capsules on transformers' LlamaForCausalLM) on the CPU, one process per row.

    python bench/hf_speed.py                       # every row, each in its own process, in turns; prints the ratios
    python bench/hf_speed.py --row capt-eval       # one row in this process (what the driver runs)

The real SmolLM2-135M-Instruct (`make weights`), fp32, B 8 x T 128 random token ids with the last
8 as the answer, capsules on all 30 blocks (the slot summarises the 120 prompt tokens):

    train  forward + backward + AdamW step on the capsules, cross-entropy of the answer tokens
    eval   forward under no_grad, the answer tokens' summed log-probability (rank classification)

capt: its forward with prompt_mask and logits_at (logits only where the answer is predicted).
hf: transformers' forward with capt.hf's capsules, prompt_mask and logits_to_keep (the same
positions), as a careful user writes it. Both models hold the same weights and capsules; the
first step's value is printed so that the rows can be seen to compute the same thing.

Timing: torch threads as given (default 2, the machine's cores), --warmup steps left out, then
the median of --steps steps. Each row runs in a fresh process (two large models in one process
slow each other down), and the driver alternates the rows --rounds times, so that a busy
machine slows both sides alike; the ratio per round is hf / capt (> 1: capt is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capt.cli.experiment import processor_name  # noqa: E402
from capt.load import load_model  # noqa: E402
from capt.methods import attach, capsule_vectors, method_parameters  # noqa: E402

ROWS = ("capt-train", "hf-train", "capt-eval", "hf-eval")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--row", choices=ROWS, help="time one row in this process (default: all, each in its own process)")
    p.add_argument("--model", type=Path, default=ROOT / "weights" / "smollm2-135m-instruct")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--answer", type=int, default=8, help="answer tokens at the end of each row")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--rounds", type=int, default=3, help="driver: times every row is run, in turns")
    p.add_argument("--out", type=Path, help="driver: write the rows and ratios as JSON here")
    p.add_argument("--row-timeout", type=float, default=900, help="driver: seconds one row's process may take")
    return p.parse_args(argv)


def batch(args, vocab: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(2, vocab, (args.batch, args.length), generator=g)
    prompt = args.length - args.answer
    prompt_mask = torch.zeros_like(ids)
    prompt_mask[:, :prompt] = 1  # the answer is not pooled into the capsule
    at = torch.arange(prompt - 1, args.length - 1)  # the positions that predict the answer tokens
    return dict(ids=ids, prompt_mask=prompt_mask, at=at, targets=ids[:, prompt:])


def step_fn(args, impl: str, mode: str):
    """The model, its capsule tensors and a function of one step returning the step's value."""
    model = load_model(args.model)
    attach(model, "capt")
    vectors = capsule_vectors(model)
    with torch.no_grad():
        for p in vectors.values():
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.02)
    b = batch(args, model.config.vocab_size)
    if impl == "hf":
        from transformers import AutoModelForCausalLM

        from capt.hf import attach_capsules

        capsules = {i: p.detach().clone().requires_grad_(mode == "train") for i, p in vectors.items()}
        del model
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32).eval().requires_grad_(False)
        attach_capsules(model, capsules)
        params = list(capsules.values())

        def logits():
            return model(b["ids"], prompt_mask=b["prompt_mask"], logits_to_keep=b["at"]).logits  # (B, Ta, V)
    else:
        model.eval()
        params = list(method_parameters(model).values())
        at = b["at"].expand(args.batch, -1)

        def logits():
            return model(b["ids"], prompt_mask=b["prompt_mask"], logits_at=at)  # (B, Ta, V)

    if mode == "eval":
        def step():
            with torch.no_grad():
                return logits().float().log_softmax(-1).gather(-1, b["targets"][..., None]).sum().item()
        return step
    optimizer = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.0)

    def step():
        loss = F.cross_entropy(logits().float().flatten(0, 1), b["targets"].flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()
    return step


def time_row(args) -> dict:
    torch.set_num_threads(args.threads)
    impl, mode = args.row.split("-")
    step = step_fn(args, impl, mode)
    value = None
    for i in range(args.warmup):
        v = step()
        value = v if i == 0 else value
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "row": args.row,
        "value": value,
        "median_s": statistics.median(times),
        "times": times,
        "threads": args.threads,
    }


def timed_row(cmd: list[str], row: str, timeout: float) -> dict:
    """One row's timing from its own process: its last stdout line; a failure or a hang is one line."""
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        sys.exit(f"row {row} ran past --row-timeout {timeout:g} s and was stopped")
    if done.returncode != 0 or not done.stdout.strip():
        said = (done.stderr.strip().splitlines() or ["no message"])[-1]
        sys.exit(f"row {row} exited {done.returncode}: {said}")
    return json.loads(done.stdout.splitlines()[-1])


def drive(args) -> dict:
    rounds = []
    for r in range(args.rounds):
        got = {}
        for row in (ROWS if r % 2 == 0 else ROWS[::-1]):  # alternate the order
            cmd = [
                sys.executable,
                __file__,
                "--row",
                row,
                "--model",
                str(args.model),
                "--batch",
                str(args.batch),
                "--length",
                str(args.length),
                "--answer",
                str(args.answer),
                "--threads",
                str(args.threads),
                "--warmup",
                str(args.warmup),
                "--steps",
                str(args.steps),
            ]
            got[row] = timed_row(cmd, row, args.row_timeout)
            print(
                f"round {r + 1} {row:<10} {got[row]['median_s']:.3f} s  (first value {got[row]['value']:.4f})",
                flush=True,
            )
        rounds.append(got)
    ratios = {
        mode: [g[f"hf-{mode}"]["median_s"] / g[f"capt-{mode}"]["median_s"] for g in rounds]
        for mode in ("train", "eval")
    }
    for mode, values in ratios.items():
        capt = [g[f"capt-{mode}"]["median_s"] for g in rounds]
        hf = [g[f"hf-{mode}"]["median_s"] for g in rounds]
        print(f"{mode}: capt {min(capt):.3f}-{max(capt):.3f} s, capt.hf {min(hf):.3f}-{max(hf):.3f} s, "
              f"hf / capt {min(values):.2f}-{max(values):.2f}x (median {statistics.median(values):.2f}x)")
    import transformers

    environment = {"torch": torch.__version__, "transformers": transformers.__version__, "processor": processor_name()}
    return {
        "settings": {k: str(v) for k, v in vars(args).items()},
        "environment": environment,
        "rounds": rounds,
        "ratios": ratios,
    }


def main(argv=None):
    args = parse_args(argv)
    if not (args.model / "config.json").is_file():
        sys.exit(f"no checkpoint in {args.model}: `make weights` builds SmolLM2-135M-Instruct there")
    if args.row:
        print(json.dumps(time_row(args)))
        return
    result = drive(args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
