"""The ablations under the defaults: every run of every variant, from the results.json files.

    .venv/bin/python results/smollm2-135m-cpu-ablations-step-scale/table.py

Reads this directory's variants (run.sh) and "add, all blocks" from the step-scale sweep's r 0.05
(../smollm2-135m-cpu-step-scale/rms-r0.05). Writes table.md here: per variant and task, the test
headline per seed with its mean ± std, the test gold NLL and the best checkpoint's validation gold
NLL per seed, and how many runs learned the answer format (that validation NLL at most 3 nats).
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
VARIANTS = [("add, all blocks (the default)", HERE.parent / "smollm2-135m-cpu-step-scale" / "rms-r0.05"),
            ("prepend, all blocks", HERE / "prepend-rms-r0.05"),
            ("add, odd blocks (0, 2, ..., 28)", HERE / "odd-rms-r0.05"),
            ("add, first half (0-14)", HERE / "first-half-rms-r0.05"),
            ("add, latter half (15-29)", HERE / "latter-half-rms-r0.05")]


def mean_std(xs: list[float]) -> str:
    return f"{statistics.mean(xs):.2f} ± {statistics.stdev(xs) if len(xs) > 1 else 0.0:.2f}"


def main():
    lines = ["# Integration and depth under the defaults: CaPT on SmolLM2-135M-Instruct, CB and COPA", "",
             "The per-block step scale at r 0.05 and the answer cue; 3 epochs of batch 16, inputs cut to 128 tokens, "
             "fp32, seeds 0, 1, 2; test = the official validation set. NLLs are the gold answer's, in nats; "
             "\"learned\": the best checkpoint's validation NLL is at most 3. Made by run.sh and this table.py.", "",
             "| variant | task | zero-shot | test per seed | mean ± std | test gold NLL per seed | validation NLL per seed | learned |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    made = []
    for label, directory in VARIANTS:
        file = directory / "results.json"
        if not file.is_file():
            lines.append(f"| {label} | not run | | | | | | |")
            continue
        results = json.loads(file.read_text())
        made.append(results["environment"])
        for name, task in results["tasks"].items():
            runs = sorted(task["runs"], key=lambda r: r["seed"])
            test = [r["test"]["headline"] for r in runs]
            val = [r["validation_loss"] for r in runs]
            nll = [r["test_loss"] for r in runs]
            lines.append(f"| {label} | {name} {task['metric']} | {task['zero_shot']['headline']:.2f} | "
                         f"{', '.join(f'{x:.2f}' for x in test)} | {mean_std(test)} | "
                         f"{', '.join(f'{x:.2f}' for x in nll)} | {', '.join(f'{x:.2f}' for x in val)} | "
                         f"{sum(x <= 3 for x in val)} of {len(val)} |")
    commits = sorted({e["commit"][:7] for e in made if e.get("commit")})
    processors = sorted({e.get("processor") or "?" for e in made})
    lines += ["", f"Made at commits {', '.join(commits)} on {', '.join(processors)}."]
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
