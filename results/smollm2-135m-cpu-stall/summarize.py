"""The figures docs/your-data.md quotes, from run.sh's run directories: per run its settings, the zero-shot
validation scores, every evaluation (step, validation scores and gold NLL) and the test scores of the kept
tensors. Paths are left out: the runs are named by their directories."""

import json
import sys
from pathlib import Path


def summary(run: Path) -> dict:
    config = json.loads((run / "config.json").read_text())
    test = json.loads((run / "test.json").read_text())
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {
        "task": config["task_name"] if "task_name" in config else test["task"],
        "method": config["method"],
        "lr": config["lr"],
        "epochs": config["epochs"],
        "train_rows": config["train_rows"],
        "zero_shot_validation": config["zero_shot_validation"],
        "evaluations": [{"step": m["step"], "epoch": m["epoch"], "validation": m["validation"]} for m in lines],
        "best": {k: test["best"][k] for k in ("step", "loss")},
        "steps": test["steps"],
        "stopped": test["stopped"],
        "test": {"n": test["n"], "metrics": test["metrics"], "loss": test["loss"]},
        "train_seconds": test["train_seconds"],
    }


if __name__ == "__main__":
    root = Path(sys.argv[1])
    runs = sorted(p.parent for p in root.glob("*/test.json"))
    print(json.dumps({run.name: summary(run) for run in runs}, indent=1))
