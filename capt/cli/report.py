"""Reports: the results table of one `capt run` (results.md) and `capt compare`, several runs side by side.

The paper's claims are comparisons on one backbone: CaPT against prompt tuning, deep prompts,
P-Tuning v2, a linear head and the training-free instance token, in score, trainable parameters
and training time (CaPT = 1.00x, a length search charged to the methods that need one). Each
`capt run --method M` writes OUT/results.json; `capt compare OUT_1 OUT_2 ...` puts them side by
side. The runs must share the base model (its config hash); tasks one run lacks show "-".
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ..checks import is_finite, is_whole, read_json
from ..errors import CaptError
from ..methods import METHODS, capsule_variant
from ..stats import compare_pair
from ..tasks import DEFAULT_MAX_LEN, TASKS, get_task

LABELS = {name: m.label for name, m in METHODS.items()}  # how tables name each method
# methods whose prompt length `capt run` can search
SEARCHABLE = tuple(name for name, m in METHODS.items() if m.default_n is not None)


def mean_std(values: list[float]) -> tuple[float | None, float | None]:
    """The mean and the sample standard deviation; one value has no sample std (None, shown as the mean alone)."""
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def mean_pm(mean: float | None, std: float | None) -> str:
    """"mean ± std", or the mean alone when there is no spread (one evaluation), "-" without a mean."""
    if mean is None:
        return "-"
    return fmt(mean) if std is None else f"{fmt(mean)} ± {fmt(std)}"


def size_line(results: dict) -> str:
    """The trainable count and its share of the base parameters, for the header."""
    base = results["base_parameters"]
    if results["trainable_parameters"] is not None:
        share = f"{results['trainable_percent']:.4f}% of {base:,} base params"
        return f"trainable params {results['trainable_parameters']:,} ({share})"
    per_task = ", ".join(f"{name} {t['trainable_parameters']:,} ({t['trainable_percent']:.4f}%)"
                         for name, t in results["tasks"].items() if "trainable_parameters" in t)
    return f"trainable params per task: {per_task} (of {base:,} base params)"


def task_file_note(results: dict) -> str:
    """How the test set of the task files among a run's tasks is named ("" when there are none)."""
    return " (a task file's task: its test file)" if any("task_file" in t for t in results["tasks"].values()) else ""


def lr_words(settings: dict) -> str:
    """The learning rate as the settings give it: "lr X" (one rate) or "step scale rms, r X"."""
    if settings.get("step_scale") == "rms":
        return f"step scale rms, r {settings.get('lr')}"
    return f"lr {settings.get('lr')}"


def results_markdown(results: dict) -> str:
    """The paper-style table of results.json as Markdown."""
    method = results["method"]
    label = LABELS[method]
    if results["lengths"]:
        length = f", n searched over {', '.join(map(str, results['lengths']))}"
    else:
        length = f", n {results['n']}" if results["n"] is not None else ""
    spread = "one evaluation" if method == "instance" else "the mean ± sample std over seeds"
    searched = method in SEARCHABLE
    lines = [
        "# Capsule Prompt-Tuning results",
        "",
        f"Method: {label} (`{method}`{length}), {size_line(results)}.",
        "",
        f"Model `{results['model']}` ({results['model_type']}, config sha256 {results['model_config_sha256'][:12]}), "
        f"capt {results['capt_version']}. {settings_sentence(results)}",
        "",
        f"Test = the official validation set{task_file_note(results)}. Scores in percent; {label} is {spread}.",
        "",
        f"| task | metric | zero-shot | {label} | per seed | other metrics |{' n |' if searched else ''} train s | "
        "note |",
        f"| --- | --- | --- | --- | --- | --- |{' --- |' if searched else ''} --- | --- |",
    ]
    lines += task_rows(results, searched)
    a = results["average"]
    if a is not None:
        lines.append(f"| **average (6 tasks)** | headline | {fmt(a['zero_shot'])} | {mean_pm(a['mean'], a['std'])} | "
                     f"{', '.join(map(fmt, a['per_seed'])) or '-'} | - |{' - |' if searched else ''} - | plain mean of "
                     "the six headlines |")
    else:
        lines += ["", "No six-task average: it needs all six tasks."]
    lines += time_lines(results)
    lines += made_by(results.get("environment"))
    return "\n".join(lines) + "\n"


def settings_sentence(results: dict) -> str:
    """What was trained, and how: the seeds, the capsules' placement, the rate, batch and budget."""
    s, method = results["settings"], results["method"]
    if method == "instance":
        return "Nothing is trained: one evaluation per task with the capsule vectors at zero."
    capsules = f"Capsules: {s.get('integration', 'add')}, blocks {s.get('blocks', 'all')}. " if method == "capt" else ""
    cue = "" if s.get("answer_cue") is None else f", answer cue {'yes' if s['answer_cue'] else 'no'}"
    return (f"Seeds {', '.join(map(str, results['seeds']))}. {capsules}{lr_words(s)}, batch {s.get('batch_size', 16)} "
            f"x {s.get('grad_accum', 1)}, epochs {s.get('epochs', 50)}, patience {s.get('patience', 5)}, max steps "
            f"{s.get('max_steps')}, dtype {s.get('dtype', 'fp32')}{cue}.")


def task_rows(results: dict, searched: bool) -> list[str]:
    """One table row per task: zero-shot, the mean ± std, each seed, the other metrics, time and notes."""
    method, lines = results["method"], []
    for name, t in results["tasks"].items():
        if "skipped" in t:
            lines.append(f"| {name} | {get_task(name).metrics[0]} | - | - | - | - |{' - |' if searched else ''} - | "
                         f"skipped: {t['skipped']} |")
            continue
        per_seed = (
            ", ".join(fmt(r["test"][t["metric"]]) if "test" in r else "failed" for r in t["runs"])
            if method != "instance"
            else "-"
        )
        others = (
            "; ".join(
                f"{k} {mean_pm(v['mean'], v['std'])} (zero-shot {fmt(t['zero_shot'][k])})"
                for k, v in t["metrics"].items()
                if k != t["metric"]
            )
            or "-"
        )
        failed = [r for r in t["runs"] if "failed" in r]
        note = f"{len(failed)} run(s) diverged: {failed[0]['failed']}" if failed else ""
        score = mean_pm(t["mean"], t["std"])
        n = f" {t['n']} |" if searched else ""
        lines.append(f"| {name} | {t['metric']} | {fmt(t['zero_shot'][t['metric']])} | {score} | {per_seed} | {others} "
                     f"|{n} "
                     f"{t['train_seconds']:.1f} | {note} |")
    return lines


def time_lines(results: dict) -> list[str]:
    """The training time in all, and the length search's validation per n where one ran."""
    method, lines = results["method"], []
    runs = sum(sum(len(e["runs"]) for e in t["search"]["lengths"]) if "search" in t else len(t.get("runs", []))
               for t in results["tasks"].values())
    search = ""
    searches = [t["search"] for t in results["tasks"].values() if "search" in t]
    loss = bool(searches) and searches[0].get("select") == "loss"  # results from before select was recorded: headline
    by = "lowest mean validation gold NLL" if loss else "best mean validation headline"
    if results["lengths"]:
        search = (f", the prompt length search included ({len(results['lengths'])} lengths x {len(results['seeds'])} "
                  f"seed(s) per task, the length with the {by} over its seeds kept)")
    if method == "instance":
        lines += ["", "Training time: none (nothing is trained)."]
    else:
        lines += ["", f"Training time: {results['train_seconds']:.1f} s in all over {runs} run(s){search}; "
                      "wall time of training and validation, per task in the table."]
    if results["lengths"]:
        lines += ["", "Length search, mean validation headline and gold NLL per n (the chosen n in bold):", ""]
        for name, t in results["tasks"].items():
            if "search" in t:
                chosen = t["search"]["chosen"]
                cells = ", ".join(
                    (f"**{length_cell(e)}**" if e["n"] == chosen else length_cell(e)) + f" ({e['train_seconds']:.1f} s)"
                    for e in t["search"]["lengths"]
                )
                lines.append(f"- {name}: {cells}")
    return lines


def length_cell(entry: dict) -> str:
    """One searched length: n, its mean validation headline and, where recorded, its mean validation gold NLL."""
    loss = entry.get("validation_loss")
    return f"{entry['n']}: {fmt(entry['validation'])}" + ("" if loss is None else f", NLL {loss:.3f}")


def made_by(env: dict | None) -> list[str]:
    """The command, commit, device and versions that made the results, when recorded."""
    if not env:
        return []
    ranks = f" x {env['world_size']} processes ({env['backend']})" if env.get("world_size", 1) > 1 else ""
    return ["", f"Made by `{env['command']}` at commit {env['commit'] or 'unknown'} on {env['device']}{ranks} "
                f"({env['processor'] + ', ' if env.get('processor') else ''}torch {env['torch']}, Python "
                f"{env['python']}), {env['date']}, {env['wall_seconds']:.0f} s in all."]


# ---------------------------------------------------------------------------------------------
# capt compare


def read_results(path: str | Path) -> dict:
    """A `capt run` output directory (or its results.json) -> the results dict, checked enough to tabulate."""
    path = Path(path)
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise CaptError(f"{path}: no results.json (a `capt run` output directory or its results.json is expected)")
    results = read_json(file, "a `capt run` results file")
    keys = ("method", "model_config_sha256", "base_parameters", "tasks", "train_seconds")
    missing = [k for k in keys if k not in results]
    if missing:
        raise CaptError(f"{file} is not a `capt run` results file (missing {', '.join(missing)})")
    check_results(results, file)
    results["source"] = str(file)
    return results


# What compare reads from results.json, and what each entry must hold (a file edited by hand is refused in one line,
# never tabulated with values that are not in it).
RESULTS_KEYS = {
    "method": lambda v: v in METHODS,
    "model_config_sha256": lambda v: isinstance(v, str),
    "base_parameters": lambda v: is_finite(v) and v > 0,
    "train_seconds": is_finite,
    "tasks": lambda v: isinstance(v, dict) and all(isinstance(t, dict) for t in v.values()),
    "settings": lambda v: isinstance(v, dict),
    "seeds": lambda v: isinstance(v, list),
    "lengths": lambda v: v is None or isinstance(v, list),
    "environment": lambda v: v is None or isinstance(v, dict),
}
TASK_KEYS = {
    "metric": lambda v: isinstance(v, str),
    "mean": lambda v: v is None or is_finite(v),
    "std": lambda v: v is None or is_finite(v),
    "n": lambda v: v is None or isinstance(v, int),
    "trainable_parameters": lambda v: isinstance(v, int) and v >= 0,
    "train_seconds": is_finite,
    "zero_shot": lambda v: isinstance(v, dict),
}


def check_results(results: dict, file: Path) -> None:
    """The entries of a results.json that the tables read hold what `capt run` writes there."""
    for key, fits in RESULTS_KEYS.items():
        if key not in results and key in ("lengths", "environment"):  # absent: none
            continue
        if key not in results or not fits(results[key]):
            shown = "missing" if key not in results else f"{results[key]!r}"[:60]
            raise CaptError(
                f"{file}: {key} is {shown}, not what `capt run` writes there; not a `capt run` results file"
            )
    for name, task in results["tasks"].items():
        if "skipped" in task:
            continue
        bad = next((k for k, fits in TASK_KEYS.items() if k not in task or not fits(task[k])), None)
        if bad is None and not is_finite(task["zero_shot"].get(task["metric"])):
            bad = f"zero_shot.{task['metric']}"
        if bad is not None:
            raise CaptError(f"{file}: tasks.{name} has no valid {bad!r} (a task ran by `capt run` has "
                            f"{', '.join(TASK_KEYS)}; a skipped one \"skipped\")")


def label(results: dict) -> str:
    """The row's name: the method, with its prompt length where it has one (searched: the chosen n per task),
    and a capt run's integration, depth and capsule length where they are not the default."""
    name = LABELS.get(results["method"], results["method"])
    variant = capsule_variant(results.get("settings") or {}) if results["method"] == "capt" else ""
    if variant:
        return f"{name} ({variant})"
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
        # files made before it was recorded lack it
        weights = [r.get("model_weights_sha256"), base.get("model_weights_sha256")]
        if None not in weights and weights[0] != weights[1]:
            raise CaptError(f"{r['source']} was made on other weights than {base['source']} (weights sha256 "
                            f"{str(weights[0])[:12]} != {str(weights[1])[:12]}, the same config.json)")
    ran = [n for r in runs for n, t in r["tasks"].items() if "mean" in t]
    # SuperGLUE's first, then task files
    names = [n for n in TASKS if n in ran] + list(dict.fromkeys(n for n in ran if n not in TASKS))
    zero_shot = {}
    for n in names:
        t = next(r["tasks"][n] for r in runs if "mean" in r["tasks"].get(n, {}))
        zero_shot[n] = {"metric": t["metric"], "value": t["zero_shot"][t["metric"]]}
    capsules = [r for r in runs if r["method"] == "capt"]  # time is relative to CaPT, the default variant where one ran
    default = [r for r in capsules if not capsule_variant(r.get("settings") or {})]
    reference = (default or capsules or [None])[0]
    rows = []
    for r in runs:
        tasks = {
            n: {k: r["tasks"][n][k] for k in ("metric", "mean", "std", "n", "trainable_parameters", "train_seconds")}
            for n in names
            if "mean" in r["tasks"].get(n, {})
        }
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
    rows_n = {n: test_rows(runs, n) for n in names}
    for row, r in zip(rows, runs):
        row["budget"] = budget(r, names)
    return {
        "model": base.get("model"),
        "model_type": base.get("model_type"),
        "model_config_sha256": base["model_config_sha256"],
        "base_parameters": base["base_parameters"],
        "tasks": names,
        "test_rows": rows_n,
        "zero_shot": zero_shot,
        "rows": rows,
        "paired": {n: paired(runs, [row["label"] for row in rows], n) for n in names},
    }


HEADLINE_KINDS = {"accuracy": "accuracy", "f1": "f1", "f1a": "f1a"}  # a task's headline -> stats.compare_pair's metric


def _examples(task: dict, source: str) -> list[dict]:
    """The per-example records of a task's runs that have them (evaluate.per_example), one per seed, each checked
    to hold what evaluate writes (source: the results file, for the message)."""
    records = [r["examples"] for r in task.get("runs", []) if isinstance(r.get("examples"), dict)]
    for ex in records:
        columns = [ex.get(k) for k in ("uid", "group", "label", "prediction")]
        if not (all(isinstance(c, list) for c in columns) and len({len(c) for c in columns}) == 1
                and all(is_whole(v) for v in ex["label"] + ex["prediction"])):
            raise CaptError(f"{source}: a run's per-example records (\"examples\") are not what capt writes: uid, "
                            "group, label and prediction lists of one length, whole-number labels and predictions")
    return records


def test_rows(runs: list[dict], name: str) -> int | None:
    """The number of test rows the task was scored on (from its per-example records), None when unrecorded."""
    for r in runs:
        t = r["tasks"].get(name, {})
        zero = [t["zero_shot_examples"]] if isinstance(t.get("zero_shot_examples"), dict) else []
        for ex in _examples(t, r.get("source", "results.json")) + zero:
            return len(ex["uid"])
    return None


def budget(results: dict, names: list[str]) -> dict:
    """What one row's runs were allowed and used: the epochs and max_steps settings, and the optimizer steps
    each run took (over the tasks and seeds)."""
    s = results.get("settings") or {}
    steps = [
        r["steps"] for n in names for r in results["tasks"].get(n, {}).get("runs", []) if r.get("steps") is not None
    ]
    return {"epochs": s.get("epochs", 50), "max_steps": s.get("max_steps"), "patience": s.get("patience", 5),
            "steps": [min(steps), max(steps)] if steps else None}


def paired(runs: list[dict], labels: list[str], name: str) -> list[dict]:
    """Every pair of rows (zero-shot first) scored on the same test rows of task `name`: stats.compare_pair,
    over each row's seeds; pairs without per-example records (older results) are left out."""
    entries = []
    zero = next((r["tasks"][name]["zero_shot_examples"] for r in runs
                 if isinstance(r["tasks"].get(name, {}).get("zero_shot_examples"), dict)), None)
    if zero is not None:
        entries.append(("zero-shot", [zero]))
    for label_, r in zip(labels, runs):
        seeds = _examples(r["tasks"].get(name, {}), r.get("source", "results.json"))
        if seeds:
            entries.append((label_, seeds))
    if not entries:
        return []
    metric = HEADLINE_KINDS.get(next(r["tasks"][name]["metric"] for r in runs if name in r["tasks"]))
    reference = entries[0][1][0]
    out = []
    for i, (label_a, a) in enumerate(entries):
        for label_b, b in entries[i + 1:]:
            if any(e["uid"] != reference["uid"] for e in a + b):
                raise CaptError(f"{name}: {label_a} and {label_b} were scored on different test rows; paired "
                                "comparisons need the same rows")
            c = compare_pair([e["prediction"] for e in a], [e["prediction"] for e in b], reference["label"], metric,
                             groups=reference["group"] if any(g is not None for g in reference["group"]) else None)
            out.append({"a": label_a, "b": label_b, **c})
    return out


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
        f"{table['base_parameters']:,} parameters, frozen). Test = SuperGLUE's official validation set (a task "
        "file's task: its test file); scores in percent, the mean ± sample std over seeds (one seed: no spread; "
        "instance: one evaluation).",
        "",
        f"| method | trainable params | {head} | train s | time vs CaPT |",
        "| --- | --- | " + "--- | " * len(names) + "--- | --- |",
        "| zero-shot | 0 | " + " | ".join(f"{table['zero_shot'][n]['value']:.2f}" for n in names) + " | - | - |",
    ]
    for row in table["rows"]:
        cells = " | ".join(
            mean_pm(row["tasks"][n]["mean"], row["tasks"][n]["std"]) if n in row["tasks"] else "-" for n in names
        )
        seconds = "-" if row["method"] == "instance" else f"{row['train_seconds']:.1f}"
        relative = "-" if row["time_vs_capt"] is None else f"{row['time_vs_capt']:.2f}x"
        lines.append(f"| {row['label']} | {_count(row)} | {cells} | {seconds} | {relative} |")
    rows_line = ", ".join(f"{n} {table['test_rows'][n]}" for n in names if table.get("test_rows", {}).get(n))
    lines += ["", "Train s: wall time of training and validation over all seeds and tasks, a prompt-length search "
                  "included; time vs CaPT compares the tasks both rows ran."
                  + (f" Test rows: {rows_line}." if rows_line else ""), "", "Runs:", ""]
    for row in table["rows"]:
        s, env = row["settings"] or {}, row["environment"] or {}
        what = ("nothing trained" if row["method"] == "instance" else
                f"seeds {', '.join(map(str, row['seeds'] or []))}, {lr_words(s)}, epochs {s.get('epochs', 50)}, "
                f"batch {s.get('batch_size', 16)} x {s.get('grad_accum', 1)}, max length "
                f"{s.get('max_length', DEFAULT_MAX_LEN)}, "
                f"dtype {s.get('dtype', 'fp32')}")
        made = (
            f"; `{env['command']}` at commit {env.get('commit') or 'unknown'} on {env.get('device')}"
            if env.get("command")
            else ""
        )
        b = row.get("budget") or {}
        used = ""
        if b.get("steps") and row["method"] != "instance":
            low, high = b["steps"]
            limit = f", max steps {b['max_steps']}" if b.get("max_steps") else ""
            used = (
                f", {low if low == high else f'{low}-{high}'} optimizer steps a run (patience {b['patience']}{limit})"
            )
        lines.append(f"- {row['label']}: {what}{used}{made} ({row['source']})")
    lines += paired_markdown(table)
    return "\n".join(lines) + "\n"


def paired_markdown(table: dict) -> list[str]:
    """The paired comparisons (report.paired) as a table, each difference in words."""
    pairs = [(n, c) for n in table["tasks"] for c in table.get("paired", {}).get(n, [])]
    if not pairs:
        return []
    lines = ["", "## Paired differences", "",
             f"Each pair on the same test rows: A - B in the headline (each the mean over its seeds), its 95% paired "
             f"bootstrap interval ({pairs[0][1]['resamples']:,} resamples of the rows; MultiRC: of whole questions) "
             "and p: with one seed each on an accuracy McNemar's exact test, otherwise (several seeds, or an F1) "
             "a paired randomization test of the metric itself (capt/stats.py). Within noise unless p < 0.05 and "
             "the interval excludes 0.", "",
             "| task | A | B | rows | seeds A, B | A | B | A - B | 95% interval | p | in words |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for n, c in pairs:
        words = (
            "within noise"
            if c["verdict"] == "within noise"
            else f"{c['a'] if c['verdict'] == 'A ahead' else c['b']} ahead"
        )
        lines.append(f"| {n} | {c['a']} | {c['b']} | {c['rows']} | {c['seeds'][0]}, {c['seeds'][1]} | "
                     f"{c['a_score']:.2f} | "
                     f"{c['b_score']:.2f} | {c['difference']:+.2f} | {c['low']:+.2f} to {c['high']:+.2f} | "
                     f"{c['p']:.3g} | {words} |")
    return lines
