"""How much the frozen model's zero-shot answer depends on what sits at index 0.

    .venv/bin/python results/smollm2-135m-cpu-front-token/front.py [--tasks cb copa] [--out DIR]
    .venv/bin/python results/smollm2-135m-cpu-front-token/front.py --tasks examples/cb-yes-no.json --out results/smollm2-135m-cpu-front-token/cb-yes-no

SmolLM2's tokenizer adds no BOS, so the first word of the prompt is the first token the model reads.
This scores the test set (rank classification; SuperGLUE's templates with the answer cue, a task file
with its own template; inputs cut to 128 tokens) with:
the prompt as capt writes it; the same prompt behind one special token of SmolLM2's own vocabulary
(`<|im_start|>`, its chat turns' opening token and tokenizer_config's bos_token, or `<|endoftext|>`);
and the capsule slot with every vector at zero (nothing trained) in the geometries the method allows:
add on every block (the default), on block 0 only, on the odd / first-half / latter-half blocks, and
the prepend integration. Writes table.md and table.json beside this file, or in --out.
"""

import argparse
import json
import os
import subprocess
from pathlib import Path

import torch

from capt.evaluate import evaluate
from capt.cli.experiment import processor_name
from capt.load import load_model
from capt.methods import CapsuleConfig, MethodConfig, attach, detach
from capt.tasks import load_task, resolve_data_dir
from capt.tokenizer import load_tokenizer

HERE = Path(__file__).resolve().parent
MODEL = "weights/smollm2-135m-instruct"
ROWS = [  # (label, token put before the prompt or None, capsule geometry (integration, blocks) or None)
    ("the prompt as capt writes it (zero-shot)", None, None),
    ("`<|im_start|>` before the prompt", "<|im_start|>", None),
    ("`<|endoftext|>` before the prompt", "<|endoftext|>", None),
    ("zero capsule: add, all blocks (the method)", None, ("add", "all")),
    ("zero capsule: add, block 0 only (the slot passes the other blocks like a token)", None, ("add", [0])),
    ("zero capsule: add, odd blocks", None, ("add", "odd")),
    ("zero capsule: add, first half", None, ("add", "first-half")),
    ("zero capsule: add, latter half", None, ("add", "latter-half")),
    ("zero capsule: prepend, all blocks (two slots)", None, ("prepend", "all")),
]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", nargs="+", default=["cb", "copa"])
    p.add_argument("--out", type=Path, default=HERE, help="where table.md and table.json go (default: beside this file)")
    p.add_argument("--table-only", action="store_true", help="rewrite table.md from table.json, scoring nothing")
    args = p.parse_args()
    if args.table_only:
        write_table(json.loads((args.out / "table.json").read_text()), args.out)
        return
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "2")))
    model, tokenizer = load_model(MODEL), load_tokenizer(MODEL)
    data = resolve_data_dir(None)
    results = {"commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
               "processor": processor_name(), "torch": torch.__version__, "tasks": {}}
    for task in args.tasks:
        test = load_task(task, data, "test")
        rows = []
        for label, front, geometry in ROWS:
            # the tokenizer's own switch for a leading special token (tokenizer_config's add_bos_token)
            tokenizer.add_bos, tokenizer.bos_token_id = (front is not None), (tokenizer.tok.token_to_id(front) if front else None)
            if geometry:
                attach(model, MethodConfig("capt", capsule=CapsuleConfig(*geometry)))
            r = evaluate(model, tokenizer, test, max_length=128)
            detach(model)
            rows.append({"label": label, "metrics": {k: v for k, v in r["metrics"].items() if k != "headline"}, "loss": r["loss"]})
            print(task, label, rows[-1]["metrics"], f"{r['loss']:.2f}", flush=True)
        results["tasks"][task] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "table.json").write_text(json.dumps(results, indent=1) + "\n")
    write_table(results, args.out)


def write_table(results: dict, out: Path) -> None:
    lines = ["# What sits at index 0, SmolLM2-135M-Instruct", "",
             f"Made by front.py at commit {results['commit']} ({results['processor']}, torch {results['torch']}). "
             "Test = the official validation set (CB 56 rows, COPA 100); SuperGLUE's templates with the answer cue, a task "
             "file (FILE.json) with its own template; inputs cut to 128 tokens. "
             "Cells: the metrics in percent (CB: macro-F1, accuracy; COPA: accuracy) and, in brackets, the gold "
             "answer's mean NLL in nats. Nothing is trained.", ""]
    tasks = list(results["tasks"])
    lines += ["| input | " + " | ".join(tasks) + " |", "| --- |" + " --- |" * len(tasks)]
    for i, (label, _, _) in enumerate(ROWS):
        cells = []
        for task in tasks:
            row = results["tasks"][task][i]
            cells.append(", ".join(f"{v:.2f}" for v in row["metrics"].values()) + f" ({row['loss']:.2f})")
        lines.append(f"| {label.replace('|', chr(92) + '|')} | " + " | ".join(cells) + " |")  # a table cell's | escaped
    (out / "table.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
