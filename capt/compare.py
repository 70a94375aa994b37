"""One table from several `capt run` outputs: each method's accuracy, size and training time.

The paper's claims are comparisons on one backbone: CaPT against prompt tuning, deep prompts,
P-Tuning v2, a linear head and the training-free instance token, in score, trainable parameters
and training time (CaPT = 1.00x, a length search charged to the methods that need one). Each
`capt run --method M` writes OUT/results.json; `capt compare OUT_1 OUT_2 ...` puts them side by
side. The runs must share the base model (its config hash); tasks one run lacks show "-".
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import CaptError
from .tasks import DEFAULT_MAX_LEN, TASKS
from .train import LABELS, _mean_pm


def read_results(path: str | Path) -> dict:
    """A `capt run` output directory (or its results.json) -> the results dict, checked enough to tabulate."""
    path = Path(path)
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise CaptError(f"{path}: no results.json (a `capt run` output directory or its results.json is expected)")
    try:
        results = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CaptError(f"{file} is not valid JSON ({e})") from None
    keys = ("method", "model_config_sha256", "base_parameters", "tasks", "train_seconds")
    missing = [k for k in keys if k not in results] if isinstance(results, dict) else list(keys)
    if missing:
        raise CaptError(f"{file} is not a `capt run` results file (missing {', '.join(missing)})")
    results["source"] = str(file)
    return results


def label(results: dict) -> str:
    """The row's name: the method, with its prompt length where it has one (searched: the chosen n per task)."""
    name = LABELS.get(results["method"], results["method"])
    if results.get("lengths"):
        return f"{name} (n searched: {', '.join(map(str, results['lengths']))})"
    return f"{name} (n {results['n']})" if results.get("n") is not None else name


def compare(runs: list[dict]) -> dict:
    """The comparison as a dict (written as compare.json): one row per run, tasks in the paper's order."""
    if not runs:
        raise CaptError("nothing to compare: give one or more `capt run` output directories")
    base = runs[0]
    for r in runs[1:]:
        if r["model_config_sha256"] != base["model_config_sha256"]:
            raise CaptError(f"{r['source']} was made on another base model than {base['source']} "
                            f"(config sha256 {r['model_config_sha256'][:12]} != {base['model_config_sha256'][:12]})")
    names = [n for n in TASKS if any("mean" in r["tasks"].get(n, {}) for r in runs)]
    zero_shot = {}
    for n in names:
        t = next(r["tasks"][n] for r in runs if "mean" in r["tasks"].get(n, {}))
        zero_shot[n] = {"metric": t["metric"], "value": t["zero_shot"][t["metric"]]}
    reference = next((r for r in runs if r["method"] == "capt"), None)
    rows = []
    for r in runs:
        tasks = {n: {k: r["tasks"][n][k] for k in ("metric", "mean", "std", "n", "trainable_parameters", "train_seconds")}
                 for n in names if "mean" in r["tasks"].get(n, {})}
        counts = sorted({t["trainable_parameters"] for t in tasks.values()})
        relative = None
        if reference is not None and r["method"] != "instance":
            shared = [n for n in tasks if "mean" in reference["tasks"].get(n, {})]
            mine = sum(tasks[n]["train_seconds"] for n in shared)
            theirs = sum(reference["tasks"][n]["train_seconds"] for n in shared)
            relative = mine / theirs if shared and theirs > 0 else None
        rows.append({
            "label": label(r),
            "method": r["method"],
            "source": r["source"],
            "trainable_parameters": counts,  # one value, or one per task when they differ (linear-head: one class each)
            "trainable_percent": [100 * c / r["base_parameters"] for c in counts],
            "tasks": tasks,
            "train_seconds": round(sum(t["train_seconds"] for t in tasks.values()), 3),
            "time_vs_capt": relative,  # training time over the tasks both ran, search included
            "seeds": r.get("seeds"),
            "settings": r.get("settings"),
            "lengths": r.get("lengths"),
            "environment": r.get("environment"),
        })
    return {"model": base.get("model"), "model_type": base.get("model_type"), "model_config_sha256": base["model_config_sha256"],
            "base_parameters": base["base_parameters"], "tasks": names, "zero_shot": zero_shot, "rows": rows}


def _count(row: dict) -> str:
    c, p = row["trainable_parameters"], row["trainable_percent"]
    if not c:
        return "-"
    if len(c) == 1:
        return f"{c[0]:,} ({p[0]:.4f}%)"
    return f"{c[0]:,}-{c[-1]:,} ({p[0]:.4f}-{p[-1]:.4f}%)"


def compare_markdown(table: dict) -> str:
    names = table["tasks"]
    head = " | ".join(f"{n} {table['zero_shot'][n]['metric']}" for n in names)
    lines = [
        "# Methods compared",
        "",
        f"Base model `{table['model']}` ({table['model_type']}, config sha256 {table['model_config_sha256'][:12]}, "
        f"{table['base_parameters']:,} parameters, frozen). Test = the official validation set; scores in percent, "
        "the mean ± sample std over seeds (instance: one evaluation).",
        "",
        f"| method | trainable params | {head} | train s | time vs CaPT |",
        "| --- | --- | " + "--- | " * len(names) + "--- | --- |",
        "| zero-shot | 0 | " + " | ".join(f"{table['zero_shot'][n]['value']:.2f}" for n in names) + " | - | - |",
    ]
    for row in table["rows"]:
        cells = " | ".join(_mean_pm(row["tasks"][n]["mean"], row["tasks"][n]["std"]) if n in row["tasks"] else "-" for n in names)
        seconds = "-" if row["method"] == "instance" else f"{row['train_seconds']:.1f}"
        relative = "-" if row["time_vs_capt"] is None else f"{row['time_vs_capt']:.2f}x"
        lines.append(f"| {row['label']} | {_count(row)} | {cells} | {seconds} | {relative} |")
    lines += ["", "Train s: wall time of training and validation over all seeds and tasks, a prompt-length search "
                  "included; time vs CaPT compares the tasks both rows ran.", "", "Runs:", ""]
    for row in table["rows"]:
        s, env = row["settings"] or {}, row["environment"] or {}
        what = ("nothing trained" if row["method"] == "instance" else
                f"seeds {', '.join(map(str, row['seeds'] or []))}, lr {s.get('lr')}, epochs {s.get('epochs', 50)}, "
                f"batch {s.get('batch_size', 16)} x {s.get('grad_accum', 1)}, max length {s.get('max_length', DEFAULT_MAX_LEN)}, "
                f"dtype {s.get('dtype', 'fp32')}")
        made = f"; `{env['command']}` at commit {env.get('commit') or 'unknown'} on {env.get('device')}" if env.get("command") else ""
        lines.append(f"- {row['label']}: {what}{made} ({row['source']})")
    return "\n".join(lines) + "\n"
