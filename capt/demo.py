"""`make demo`: Capsule Prompt-Tuning on a real pretrained model, zero-shot and trained, side by side.

    python -m capt.demo [--model weights/smollm2-135m-instruct] [--task cb] [--data DIR]

Loads the checkpoint once, scores the task's test set zero-shot (rank classification, no
capsules), trains capsules with early stopping on the validation split, scores the best
capsules on the same test set, and prints both with the place the capsules were saved and the
picture of the training curves (RUN/curves.png, with matplotlib).
The defaults are sized for about three minutes on two idle CPU cores (CB, inputs cut to 128
tokens, 3 epochs); on a GPU the same command uses the GPU and can afford more (--epochs, --max-length).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from .checks import read_json
from .errors import CaptError
from .evaluate import evaluate
from .load import load_model, trainable_summary
from .methods import attach, detach
from .plots import MISSING
from .tasks import TASKS, load_task, resolve_data_dir
from .tokenizer import load_tokenizer
from .trainer import TrainConfig, default_device, train


LEARNED_NLL = 3.0  # nats: a validation gold NLL at most this says the answer format is learned (zero-shot: 13-17 on CB)


def is_run_directory(path: Path) -> bool:
    """True for a directory written by capt's trainer (its config.json names the run), never a checkpoint."""
    try:
        config = read_json(path / "config.json", "a run's settings")
    except CaptError:
        return False
    return "capt_version" in config and "planned_steps" in config and not (path / "model.safetensors").exists()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m capt.demo", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("weights/smollm2-135m-instruct"), help="checkpoint directory (default: the one `make weights` writes)")
    p.add_argument("--task", default="cb", choices=sorted(TASKS), help="SuperGLUE task (default cb)")
    p.add_argument("--data", default=None, help="SuperGLUE directory (default: env CAPT_DATA, then ./data/superglue)")
    p.add_argument("--out", type=Path, default=Path("runs/demo"), help="run directory; replaced if it holds an earlier demo (default runs/demo)")
    p.add_argument("--epochs", type=int, default=3, help="most epochs (default 3)")
    p.add_argument("--max-length", type=int, default=128, help="input token budget (default 128)")
    p.add_argument("--batch-size", type=int, default=16, help="examples per step (default 16)")
    p.add_argument("--lr", type=float, default=None, help="r, the step relative to each block's scale (default: capt train's)")
    p.add_argument("--seed", type=int, default=0, help="seed (default 0)")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    return p


def run(args) -> int:
    started = time.time()
    if not (args.model / "config.json").is_file():
        raise CaptError(f"no checkpoint in {args.model}: `make weights` builds SmolLM2-135M-Instruct there")
    data = resolve_data_dir(args.data)
    device = args.device or default_device()
    test = load_task(args.task, data, "test")  # fail on missing data before loading the model

    print(f"capt demo: {args.task} with {args.model} on {device}")
    model = load_model(args.model, device=device)
    tokenizer = load_tokenizer(args.model)
    zero = evaluate(model, tokenizer, test, max_length=args.max_length, progress=f"{args.task} test, zero-shot")
    attach(model, "instance")  # the capsule slot with its vectors at zero: the method before any training
    slot = evaluate(model, tokenizer, test, max_length=args.max_length, progress=f"{args.task} test, zero capsule")
    detach(model)

    if args.out.exists() and any(args.out.iterdir()):
        if not is_run_directory(args.out):
            raise CaptError(f"--out {args.out} holds something other than a capt run; choose another directory")
        shutil.rmtree(args.out)  # an earlier demo's run: start afresh
    config = TrainConfig(model=str(args.model), task=args.task, out=str(args.out), data=str(data), epochs=args.epochs,
                         batch_size=args.batch_size, lr=args.lr, seed=args.seed, max_length=args.max_length, device=device)
    trained = train(config, model=model, tokenizer=tokenizer)
    report(args, zero, slot, trained)
    print(trainable_summary(model))
    curves = args.out / "curves.png"  # drawn by train() (capt/plots.py)
    print(f"training curves: {curves}" if curves.is_file() else f"training curves: none ({MISSING})")
    print(f"wall time {time.time() - started:.0f} s")
    print(f"next: the capt command is {command_path()} (or `source .venv/bin/activate`, then `capt`); "
          "docs/usage.md, docs/your-data.md and docs/results.md are the guides")
    return 0


def report(args, zero: dict, slot: dict, trained: dict) -> None:
    """The three columns side by side, then what they say, read off the numbers."""
    names = [n for n in zero["metrics"] if n != "headline"]
    width = max(len(n) for n in names + ["gold NLL"])
    print(f"\n{args.task} test set ({zero['n']} examples, seed {args.seed}), scores in percent, gold NLL in nats")
    print(f"{'':<{width}}  {'zero-shot':>9}  {'zero capsule':>12}  {'CaPT':>9}")
    for name in names:
        print(f"{name:<{width}}  {zero['metrics'][name]:9.2f}  {slot['metrics'][name]:12.2f}  {trained['metrics'][name]:9.2f}")
    # the gold answer's negative log-likelihood, mean over examples: how far the capsules moved the model
    print(f"{'gold NLL':<{width}}  {zero['loss']:9.3f}  {slot['loss']:12.3f}  {trained['loss']:9.3f}")
    best = trained["best"]
    print(f"best capsules: step {best['step']} of {trained['steps']}, validation gold NLL {best['loss']:.3f}: {args.out / 'best'}")
    head = names[0]
    learned = "learned" if best["loss"] <= LEARNED_NLL else "did not learn"
    versus = ("at or above" if trained["metrics"][head] >= zero["metrics"][head] else "below")
    print(f"How to read it: zero-shot is the frozen model alone; zero capsule puts the capsule slot in front with its "
          f"vectors at zero (the method before training); CaPT is the trained capsules. In {trained['steps']} steps they "
          f"{learned} the answer format (validation gold NLL {best['loss']:.2f}; {LEARNED_NLL:g} nats or less counts as learned) "
          f"and moved {head} from {slot['metrics'][head]:.2f} to {trained['metrics'][head]:.2f}, {versus} zero-shot's "
          f"{zero['metrics'][head]:.2f}. A 135M model and {zero['n']} test examples cannot show the paper's gains (1B-1.5B "
          "models, up to 50 epochs); docs/results.md has the spread over seeds, longer runs and the baselines.")


def command_path() -> str:
    """This Python's `capt` script, relative to the working directory when it lies below it (.venv/bin/capt)."""
    script = Path(sys.executable).parent / "capt"
    try:
        return str(script.relative_to(Path.cwd()))
    except ValueError:
        return str(script)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except CaptError as e:
        print(f"capt: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
