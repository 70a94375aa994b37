"""The answer cue measured: zero-shot with and without it on the SuperGLUE tasks, the zero capsule (the
capsule slot before training) on CB and COPA, and CaPT trained with either template (r 0.05, seeds 0-2).

    .venv/bin/python results/smollm2-135m-cpu-answer-cue/table.py

Reads zero-shot/*.json (zero-shot.sh), plain-template-rms-r0.05/results.json (this directory, the sweep
script run with EXTRA=--no-answer-cue) and ../smollm2-135m-cpu-step-scale/rms-r0.05/results.json (the
cue); writes table.md.
"""

import json
import statistics
from pathlib import Path

HERE = Path(__file__).resolve().parent
TASKS = ("boolq", "cb", "copa", "multirc", "rte", "wic")
CUES = (("answer-cue", "with ` answer:`"), ("no-answer-cue", "without (T5's form)"))


def read(name: str) -> dict | None:
    file = HERE / "zero-shot" / f"{name}.json"
    return json.loads(file.read_text()) if file.is_file() else None


def cell(result: dict | None) -> str:
    if result is None:
        return "-"
    metrics = ", ".join(f"{v:.2f}" for k, v in result["metrics"].items() if k != "headline")
    return f"{metrics} ({result['loss']:.2f})"


def main():
    lines = ["# The answer cue, SmolLM2-135M-Instruct", "",
             "Test = the official validation set, inputs cut to 128 tokens. Cells: the task's metrics in percent "
             "(CB: macro-F1, accuracy; MultiRC: F1a, exact match; the others accuracy) and, in brackets, the gold "
             "answer's mean negative log-likelihood in nats.", "",
             "## Zero-shot", "", "| task | " + " | ".join(label for _, label in CUES) + " |", "| --- | --- | --- |"]
    for task in TASKS:
        row = [read(f"{task}-{cue}") for cue, _ in CUES]
        if any(row):
            lines.append(f"| {task} | " + " | ".join(cell(r) for r in row) + " |")
    lines += ["", "## The zero capsule: the capsule slot in front, its vectors at zero (nothing trained)", "",
              "| task | " + " | ".join(label for _, label in CUES) + " |", "| --- | --- | --- |"]
    for task in ("cb", "copa"):
        lines.append(f"| {task} | " + " | ".join(cell(read(f"{task}-instance-{cue}")) for cue, _ in CUES) + " |")
    trained = {"answer-cue": HERE.parent / "smollm2-135m-cpu-step-scale" / "rms-r0.05" / "results.json",
               "no-answer-cue": HERE / "plain-template-rms-r0.05" / "results.json"}
    lines += ["", "## CaPT trained with each template (step scale, r 0.05, 3 epochs, seeds 0-2)", "",
              "| task | template | test per seed | mean | test gold NLL per seed | zero-shot, same template |",
              "| --- | --- | --- | --- | --- | --- |"]
    for task in ("cb", "copa"):
        for cue, label in CUES:
            if not trained[cue].is_file():
                continue
            entry = json.loads(trained[cue].read_text())["tasks"][task]
            runs = sorted(entry["runs"], key=lambda r: r["seed"])
            scores = [r["test"]["headline"] for r in runs]
            losses = ", ".join(f"{r['test_loss']:.2f}" for r in runs)
            lines.append(f"| {task} | {label} | {', '.join(f'{s:.2f}' for s in scores)} | {statistics.mean(scores):.2f} | "
                         f"{losses} | {entry['zero_shot']['headline']:.2f} |")
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
