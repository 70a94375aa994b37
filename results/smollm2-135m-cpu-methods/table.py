"""The methods side by side on CB, each at the rate its own validation split picks from a small grid.

    .venv/bin/python results/smollm2-135m-cpu-methods/table.py

Reads the results.json of every variant run.sh made (this directory) and CaPT's grid from the
step-scale sweep (../smollm2-135m-cpu-step-scale/rms-r*/results.json). The pick, for every method
alike: the grid rate with the highest validation headline (the best checkpoint's, on the 10%
validation split), averaged over the seeds; on a tie, the method's default. The test columns are
read only after the pick. Writes table.md here; a grid rate not run yet shows as "not run".
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWEEP = HERE.parent / "smollm2-135m-cpu-step-scale"
TASK = "cb"
# method label, its default, then (rate, results directory) for every grid point
GRIDS = [
    ("CaPT (step scale, r)", 0.05, [(r, SWEEP / f"rms-r{r}") for r in (0.025, 0.05, 0.1)]),
    ("deep prompt tuning, n 1 (step scale, r)", 0.05, [(r, HERE / f"deep-prompt-r{r}") for r in (0.025, 0.05, 0.1)]),
    ("prompt tuning, n 100 (lr)", 0.3, [(lr, HERE / f"prompt-lr{lr}") for lr in ("0.1", "0.3", "1.0")]),
    ("P-Tuning v2, n 64 (lr)", 1e-2, [(lr, HERE / f"prefix-lr{lr}") for lr in ("3e-3", "1e-2", "3e-2")]),
    ("P-Tuning v2, n 64 (step scale, r)", 1e-2, [(r, HERE / f"prefix-r{r}") for r in ("1e-2", "3e-2", "0.1")]),
    ("linear head (lr)", 1e-3, [(lr, HERE / f"linear-head-lr{lr}") for lr in ("3e-4", "1e-3", "3e-3")]),
]
EXTRA = [("deep prompt tuning, one rate (the paper-plain form)", HERE / "deep-prompt-plain-lr0.3", "lr 0.3")]


def read(directory: Path) -> dict | None:
    file = directory / "results.json"
    return json.loads(file.read_text()) if file.is_file() else None


def summary(results: dict) -> dict:
    task = results["tasks"][TASK]
    runs = sorted(task["runs"], key=lambda r: r["seed"])
    return {"runs": runs, "zero_shot": task["zero_shot"], "zero_shot_loss": task.get("zero_shot_loss"),
            "validation": statistics.mean(r["validation"]["headline"] for r in runs),
            "validation_loss": statistics.mean(r["validation_loss"] for r in runs),
            "trainable": results["trainable_parameters"], "seconds": task["train_seconds"],
            "commit": results["environment"].get("commit"), "processor": results["environment"].get("processor")}


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.2f}"


def test_cells(s: dict) -> list[str]:
    f1 = [r["test"]["f1"] for r in s["runs"]]
    acc = [r["test"]["accuracy"] for r in s["runs"]]
    nll = [r["test_loss"] for r in s["runs"]]
    return [", ".join(f"{x:.2f}" for x in f1), mean_std(f1), mean_std(acc), ", ".join(f"{x:.2f}" for x in nll)]


def main():
    lines = ["# The methods on CB, SmolLM2-135M-Instruct, each at its validation pick", "",
             "3 epochs of batch 16 (45 steps), inputs cut to 128 tokens, fp32, seeds 0, 1, 2, the answer cue; test = "
             "the official validation set (56 rows). Each method's rate is picked from its grid by the mean validation "
             "macro-F1 of the best checkpoints (25 rows; the validation gold NLL beside it); the test columns are "
             "read after the pick. Made by run.sh and this table.py.", "",
             "## The grids", "",
             "| method | rate | validation F1 (mean of 3) | validation gold NLL (mean) | test F1 per seed | test F1 mean ± std |",
             "| --- | --- | --- | --- | --- | --- |"]
    picks, made = [], []
    zero = None
    for label, default, grid in GRIDS:
        found = {}
        for rate, directory in grid:
            results = read(directory)
            if results is None:
                lines.append(f"| {label} | {rate} | not run | | | |")
                continue
            s = found[rate] = summary(results)
            zero = zero or s
            made.append(s)
            cells = test_cells(s)
            lines.append(f"| {label} | {rate} | {s['validation']:.2f} | {s['validation_loss']:.2f} | {cells[0]} | {cells[1]} |")
        if found:
            best = max(found.values(), key=lambda s: s["validation"])
            tied = [rate for rate, s in found.items() if s["validation"] == best["validation"]]
            rate = next((r for r in tied if float(r) == float(default)), tied[0])
            complete = len(found) == len(grid)
            picks.append((label, rate, found[rate], complete))
    lines += ["", "## At the picks", "",
              "| method | trainable numbers | pick | test F1 per seed | F1 mean ± std | accuracy mean ± std | test gold NLL per seed | train s (3 seeds) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    if zero:
        z = zero["zero_shot"]
        loss = zero["zero_shot_loss"]
        lines.append(f"| zero-shot (the frozen model) | 0 | - | {z['f1']:.2f} | - | {z['accuracy']:.2f} | "
                     f"{'-' if loss is None else f'{loss:.2f}'} | - |")
    instance = read(HERE / "instance")
    if instance:
        run = instance["tasks"][TASK]["runs"][0]
        lines.append(f"| zero capsule (the slot, nothing trained) | 0 | - | {run['test']['f1']:.2f} | - | "
                     f"{run['test']['accuracy']:.2f} | {run['test_loss']:.2f} | - |")
    for label, rate, s, complete in picks:
        cells = test_cells(s)
        pick = f"{rate}" + ("" if complete else " (grid not complete)")
        lines.append(f"| {label} | {s['trainable']:,} | {pick} | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {s['seconds']:.0f} |")
    for label, directory, rate in EXTRA:
        results = read(directory)
        if results:
            s = summary(results)
            made.append(s)
            cells = test_cells(s)
            lines.append(f"| {label} | {s['trainable']:,} | {rate} (not a pick) | {cells[0]} | {cells[1]} | {cells[2]} | {cells[3]} | {s['seconds']:.0f} |")
    commits = sorted({s["commit"][:7] + ("+dirty" if s["commit"].endswith("+dirty") else "") for s in made if s["commit"]})
    processors = sorted({s["processor"] or "?" for s in made})
    lines += ["", f"Made at commits {', '.join(commits)} on {', '.join(processors)}; between them no change touched "
              "training or evaluation, but for adding the step scale to prefix tuning (its runs are the latest). Train s: the wall time of training with its validation passes, all three seeds, on two "
              "cores that other jobs sometimes shared: a rough cost, not a speed comparison (docs/speed.md has those)."]
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
