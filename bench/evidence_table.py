"""The evidence program's table (bench/evidence.py table): each task x method, paired with CaPT on the same test
rows (capt/stats.py), the decision rule of docs/results.md per task, the ablations and the training time.

Writes RESULTS/table.md and RESULTS/table.json, and copies each finished run's small files (config.json,
metrics.jsonl, test.json, made-at.json; zero-shot's result.json; a search's results.json) under RESULTS/runs/.
A finished run's records get portable paths first (bench/evidence.py make_portable).
"""

from __future__ import annotations

import json
import shutil
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capt.stats import MARGIN, compare_pair, decision, in_words, refutes  # noqa: E402
from capt.tasks import get_task  # noqa: E402
from evidence import (  # noqa: E402
    ABLATIONS,
    GRIDS,
    SEEDS,
    TASKS,
    finished,
    make_portable,
    picks,
    plan,
    read_json,
)

LABELS = {"zero-shot": "zero-shot", "capt": "CaPT", "deep-prompt": "deep prompt tuning (n 1)",
          "prefix": "P-Tuning v2 (n 64)", "prompt": "prompt tuning (n 100)", "linear-head": "linear head"}
KINDS = {"accuracy": "accuracy", "f1": "f1", "f1a": "f1a"}


def seeds_of(out: Path, task: str, method: str, lr: str | None, variant: str | None = None) -> list[dict]:
    folder = out / task / (variant or method) / (f"lr{lr}" if lr else "default")
    return [t for t in (read_json(folder / f"seed{s}" / "test.json") for s in SEEDS) if t is not None]


def failures_of(out: Path, task: str, folder: str) -> list[dict]:
    """The seeds of out/TASK/FOLDER/default that failed (their failed.json), each with the first clause of its
    error: a run that failed has no test.json, so without these it would be missing from the table unsaid."""
    found = []
    for s in SEEDS:
        failed = read_json(out / task / folder / "default" / f"seed{s}" / "failed.json")
        if failed is not None:
            found.append({"seed": s, "error": str(failed.get("error", "")).removeprefix("capt: error: ").split(";")[0]})
    return found


def failed_note(failed: list[dict]) -> str:
    return f"{len(failed)} seed{'s' if len(failed) != 1 else ''} failed" if failed else ""


def ablation_lines(out: Path) -> tuple[list[str], dict]:
    """The ablation table on RTE, each variant against add (CaPT's own runs) on the same rows, and its entries for
    table.json. A variant's failed seeds are counted in its row and named below the table."""
    base = seeds_of(out, "rte", "capt", None)
    amendments = (read_json(out / "program.json") or {}).get("amendments", [])
    amended = {v: a["commit"] for a in amendments for v in a["variants"]}  # variant: the commit that makes it
    variants = {v: (seeds_of(out, "rte", "capt", None, v), failures_of(out, "rte", v)) for v in [*ABLATIONS, *amended]}
    if not base or not any(runs or failed for runs, failed in variants.values()):
        return [], {}
    lines = ["## Ablations on RTE (each against add, CaPT's default, on the same rows)", "",
             "| variant | seeds | test accuracy | variant - add | 95% interval | p | in words |",
             "| --- | --- | --- | --- | --- | --- | --- |",
             f"| add (default) | {len(base)} | {mean_sd([r['metrics']['headline'] for r in base])} | - | - | - | - |"]
    doc = {}
    for v, (runs, failed) in variants.items():
        if not runs and not failed:
            continue
        seeds = f"{len(runs)}" + (f" ({failed_note(failed)})" if failed else "")
        doc[v] = {"seeds": len(runs), "test": [r["metrics"]["headline"] for r in runs], "vs_add": None,
                  "failed": failed}
        if not runs:
            lines.append(f"| {v} | {seeds} | - | - | - | - | no score: its seeds so far failed (below) |")
            continue
        c = doc[v]["vs_add"] = compare_with_capt(runs, base, "accuracy")
        words = {"A ahead": f"{v} ahead", "B ahead": "add ahead"}.get(c["verdict"], "within noise")
        lines.append(f"| {v} | {seeds} | {mean_sd([r['metrics']['headline'] for r in runs])} | "
                     f"{c['difference']:+.2f} | {c['low']:+.2f} to {c['high']:+.2f} | {c['p']:.3g} | {words} |")
    named = [f"- {v} seed {f['seed']} failed: {f['error']}." for v, (_, failed) in variants.items() for f in failed]
    for commit in dict.fromkeys(amended.values()):
        made = [v for v, c in amended.items() if c == commit and v in doc]
        if made:
            named.append(f"- {', '.join(made)}: an amendment's runs, made at commit {commit[:12]} (docs/results.md "
                         "says what it changed); add computes the same bits at both commits (`evidence.py same`).")
    return lines + ([""] + named if named else []) + [""], doc


def mean_sd(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.2f} (one seed)"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def columns(runs: list[dict]) -> tuple[list[list[int]], dict]:
    """The seeds' predictions and the rows they share (uid, label, group)."""
    first = runs[0]["examples"]
    for r in runs:
        if r["examples"]["uid"] != first["uid"]:
            raise SystemExit("runs of one task were tested on different rows")
    return [r["examples"]["prediction"] for r in runs], first


def compare_with_capt(capt_runs, other_runs, metric):
    preds_a, rows = columns(capt_runs)
    preds_b, rows_b = columns(other_runs)
    if rows_b["uid"] != rows["uid"]:
        raise SystemExit("CaPT and a baseline were tested on different rows")
    groups = rows["group"] if any(g is not None for g in rows["group"]) else None
    return compare_pair(preds_a, preds_b, rows["label"], metric, groups=groups)


def cpu_cells(d: Path) -> str:
    """A run's CPU seconds and mean load over its processes (made-at.json; '-' where the driver did not count them):
    a load well above the run's 2 threads says it shared the cores, and its wall time is longer for it."""
    made = read_json(d / "made-at.json") or {}
    if not made.get("cpu_processes"):
        return "- | -"
    part = "" if made["cpu_processes"] == made.get("processes") else (f" ({made['cpu_processes']} of "
                                                                      f"{made['processes']} processes)")
    return f"{made['cpu_s']:.0f}{part} | {made['load'] if made.get('load') is not None else '-'}"


def search_cpu_cells(d: Path, reused: dict | None, out: Path) -> str:
    """A length search's CPU seconds and mean load: its process's, plus the grid run's where that run was reused
    (its wall time is already in the search's train_seconds, which sums every length's runs)."""
    if reused is None:
        return cpu_cells(d)
    mine, grid = read_json(d / "made-at.json") or {}, read_json(out / reused["from"] / "made-at.json") or {}
    if not mine.get("cpu_processes") or not grid.get("cpu_processes"):
        return "- | -"
    both = [m for m in (mine, grid) if m.get("load") is not None and m.get("wall_s")]
    load = round(sum(m["load"] * m["wall_s"] for m in both) / sum(m["wall_s"] for m in both), 2) if both else "-"
    return f"{mine['cpu_s'] + grid['cpu_s']:.0f} (the grid run's included) | {load}"


def steps(runs: list[dict]) -> str:
    """Each seed's kept step and the optimizer steps it ran (the budget it used: early stopping ends runs early)."""
    kept = [f"{r['best']['step']} of {r['steps']}" for r in runs if "best" in r]
    return ", ".join(kept) if kept else "-"


def grid_lines(out: Path, task: str, chosen: dict, capt_runs: list[dict], metric: str) -> tuple[list[str], dict]:
    """Seed 0's rate grids: each point's best validation gold NLL (what picks the rate) and, beside it, its test
    headline, which played no part in the pick. Each rate passed over is also paired with CaPT's seeds on the same
    rows: outside the rule, it shows whether a comparison's reading hangs on the pick. Returns the lines and, per
    method and rate, those numbers (table.json's "grids")."""
    lines = [f"Seed 0's rate grids on {task}: best validation gold NLL (test headline); the pick in bold. Each rate "
             "passed over, outside the rule: CaPT - it (its one seed) with the 95% interval and p, so a reader sees "
             "whether the reading hangs on the pick.", ""]
    grids: dict[str, dict] = {}
    for method, grid in GRIDS.items():
        cells = []
        for lr in grid:
            t = read_json(out / task / method / f"lr{lr}" / "seed0" / "test.json")
            point = grids.setdefault(method, {})[lr] = None if t is None else {
                "validation_loss": t["best"]["loss"], "test": t["metrics"]["headline"], "vs_capt": None}
            if t is None:
                cells.append(f"{lr}: running or to run")
                continue
            cell = f"{lr}: {t['best']['loss']:.3f} ({t['metrics']['headline']:.2f}"
            if lr != chosen[method] and capt_runs:
                c = point["vs_capt"] = compare_with_capt(capt_runs, [t], metric)
                cell += f"; CaPT - it {c['difference']:+.2f}, {c['low']:+.2f} to {c['high']:+.2f}, p {c['p']:.2g}"
            cells.append(f"**{cell})**" if lr == chosen[method] else cell + ")")
        lines.append(f"- {LABELS[method]}: " + "; ".join(cells))
    return lines, grids


def processors(out: Path) -> dict[str, list[str]]:
    """The finished runs by the processor that made them (made-at.json), in the plan's order."""
    found: dict[str, list[str]] = {}
    for run in plan(out):
        made = read_json(run["dir"] / "made-at.json")
        if made is not None and made.get("processor"):
            found.setdefault(made["processor"], []).append(run["name"])
    return found


def task_decision(comparisons: dict[str, dict], done: set[str]) -> str:
    """docs/results.md's rule for one task, from CaPT's comparison with each method; done: the methods whose runs are
    all in (zero-shot, and CaPT or a baseline with every seed). With every run in, the rule as it is. Before that,
    "refuted" can already be settled: one comparison between two complete methods meets it, and no later run changes
    that comparison or can make CaPT ahead of every method. "holds" needs every comparison, so it waits."""
    methods = {"zero-shot", "capt", *GRIDS}
    if done >= methods and comparisons:
        return decision(comparisons)
    final = {m: c for m, c in comparisons.items() if "capt" in done and m in done}
    if final and decision(final) == "refuted":
        names = ", ".join(LABELS[m] for m, c in final.items() if refutes(c))
        return (f"refuted, settled before every run is in: CaPT against {names}, whose runs are all in, meets the "
                "refutation (no later run changes that comparison)")
    return "incomplete: runs are missing"


def chart(doc: dict, path: Path) -> Path | None:
    """RESULTS/table.png: every paired difference of the table with its 95% interval, one panel per task (CaPT - each
    method, with the rule's lines: 0, and the 3-point CaPT lead a refutation must rule out) and one for the ablations
    (each variant - add). None without matplotlib (the table is written all the same) or without a comparison."""
    fig = chart_figure(doc)
    if fig is None:
        return None
    tmp = path.with_name(f".{path.name}.tmp")
    fig.savefig(tmp, format="png")
    tmp.replace(path)
    return path


def p_text(p: float) -> str:
    """A p-value for the chart: two decimals, and below 0.01 its first digit (0.0011 is not "0.00")."""
    return f"{p:.2f}" if p >= 0.01 else f"{p:.1g}"


def chart_figure(doc: dict):
    """The Figure of chart (None without matplotlib or a comparison to draw)."""
    panels = [(f"{task.upper()}: CaPT - each method on the same {t['rows']} test rows ({t['metric']}). Rule: "
               f"{t['decision'].split(':')[0]}",
               [(LABELS[m], v["vs_capt"], t["methods"]["capt"]["complete"] and v["complete"], "")
                for m, v in t["methods"].items() if v["vs_capt"] is not None], MARGIN,
               "CaPT - the method, points (right of 0: CaPT ahead)")
              for task, t in doc["tasks"].items()]
    if doc["ablations"]:
        panels.append(("RTE ablations: each variant - add (CaPT's default) on the same rows",
                       [(v, a["vs_add"], False, failed_note(a.get("failed", [])))
                        for v, a in doc["ablations"].items()], None,
                       "the variant - add, points (right of 0: the variant ahead)"))
    panels = [p for p in panels if p[1]]
    if not panels:
        return None
    try:
        from matplotlib.figure import Figure  # optional, as for capt's own pictures (capt/plots.py)
    except ImportError:
        return None
    heights = [0.9 + 0.42 * len(rows) for _, rows, _, _ in panels]
    fig = Figure(figsize=(9.0, sum(heights) + 1.0), dpi=110, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False, gridspec_kw={"height_ratios": heights})[:, 0]
    for ax, (title, rows, margin, xlabel) in zip(axes, panels):
        ys = list(range(len(rows)))[::-1]  # the table's order, top down
        for y, (label, c, complete, note) in zip(ys, rows):
            if c is None:  # a variant whose seeds so far all failed: no point to draw
                ax.annotate(f"no score: {note}", (1.01, y), xycoords=("axes fraction", "data"), va="center",
                            fontsize=8)
                continue
            color = {"A ahead": "C2", "B ahead": "C3"}.get(c["verdict"], "0.3")
            ax.errorbar(c["difference"], y, xerr=[[c["difference"] - c["low"]], [c["high"] - c["difference"]]],
                        fmt="o", color=color, ecolor=color, capsize=4, markersize=5)
            seeds = " vs ".join(map(str, c.get("seeds") or []))
            refuting = ""
            if margin is not None and refutes(c, margin):  # the rule counts it only once both sides have every seed
                refuting = " - refutes" if complete else " - refutes so far"
            failed = f" - {note}" if note else ""
            ax.annotate(f"{c['difference']:+.2f}  p {p_text(c['p'])}  ({seeds} seeds){refuting}{failed}", (1.01, y),
                        xycoords=("axes fraction", "data"), va="center", fontsize=8)
        ax.axvline(0, color="black", linewidth=0.8)
        if margin is not None:
            ax.axvline(margin, color="0.4", linestyle="--", linewidth=0.8)
            ax.annotate(f"CaPT +{margin:g}", (margin, 1.0), xycoords=("data", "axes fraction"), xytext=(2, -10),
                        textcoords="offset points", fontsize=7, color="0.3")
        ax.set_yticks(ys, [label for label, *_ in rows])
        ax.set_ylim(-0.6, len(rows) - 0.4)
        reach = max([abs(v) for _, c, *_ in rows if c is not None for v in (c["low"], c["high"])] + [(margin or 0) + 1])
        ax.set_xlim(-reach * 1.1, reach * 1.1)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_title(title, fontsize=9, loc="left")
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle("The evidence program: paired differences with 95% bootstrap intervals (green: CaPT ahead, red: "
                 "the other ahead, grey: within noise)", fontsize=9)
    fig.supxlabel("The rule (docs/results.md): holds where every method is left behind (right of 0, p < 0.05); "
                  "refuted where a method at or above CaPT\nhas its interval end left of the dashed line (a CaPT lead "
                  f"of {MARGIN:g} points ruled out; 'so far': seeds still to come); else undecided. Seeds: CaPT's (a "
                  "variant's) vs the other's.",
                  fontsize=8)
    return fig


def write_table(out: Path, results: Path) -> int:
    results.mkdir(parents=True, exist_ok=True)
    for run in plan(out):  # runs finished by a driver before it wrote portable paths
        if finished(run):
            make_portable(run["dir"])
    program = read_json(out / "program.json") or {}
    doc = {"program": program, "tasks": {}, "ablations": {}, "time": None}
    lines = ["# The evidence program: CaPT against its baselines on the same test rows", "",
             f"Made at commit {str(program.get('commit'))[:12]} (every run"
             + (", but the amended variants " + "; ".join(f"{', '.join(a['variants'])}, made at {a['commit'][:12]}"
                                                        for a in program["amendments"])
                if program.get("amendments") else "")
             + "; bench/evidence.py checks it). "
             "Scores in percent on the test set (SuperGLUE's official validation set), mean ± sample std over the "
             "seeds done; each baseline at its rate picked on seed 0's validation gold NLL. CaPT - it: the paired "
             "difference in the headline with its 95% bootstrap interval and p: McNemar's exact test for an accuracy "
             "with one seed on each side, else a paired randomization test of the metric (several seeds; an F1, "
             "MultiRC's F1a; capt/stats.py).", ""]
    doc["processors"] = machines = processors(out)
    if machines:
        lines += ["Processors (each run's made-at.json): " + "; ".join(
            f"{name}: {len(runs)} run{'s' if len(runs) != 1 else ''}" for name, runs in machines.items())
            + (". Their kernels round differently, so a run on one would not repeat to the digit on the other; "
               "across runs this acts like another seed." if len(machines) > 1 else "."), ""]
    for task in TASKS:
        zero = read_json(out / task / "zero-shot" / "result.json")
        capt_runs = seeds_of(out, task, "capt", None)
        if zero is None and not capt_runs:
            continue
        headline = get_task(task).metrics[0]
        metric = KINDS[headline]
        chosen = picks(out, task)
        entries = {
            "zero-shot": [{"examples": zero["examples"], "metrics": zero["metrics"], "loss": zero["loss"]}]
            if zero
            else []
        }
        entries["capt"] = capt_runs
        for method in GRIDS:
            entries[method] = seeds_of(out, task, method, chosen[method]) if chosen[method] else []
        rows_n = len(next(e for runs in entries.values() for e in runs)["examples"]["uid"])
        lines += [f"## {task} ({rows_n} test rows, headline {headline})", "",
                  "| method | rate | seeds | kept step of steps run | test headline | test gold NLL | best validation "
                  "NLL | CaPT - it | 95% interval | p | in words |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        comparisons, task_doc = {}, {"rows": rows_n, "metric": headline, "methods": {}}
        for method, runs in entries.items():
            scores = [r["metrics"]["headline"] for r in runs]
            losses = [r["loss"] for r in runs]
            val = [r["best"]["loss"] for r in runs if "best" in r]
            rate = chosen.get(method) or ("r 0.05 (default)" if method == "capt" else "-")
            c, complete = None, bool(runs) and (method == "zero-shot" or len(runs) == len(SEEDS))
            if method != "capt" and runs and capt_runs:
                c = comparisons[method] = compare_with_capt(capt_runs, runs, metric)  # A = CaPT, B = the baseline
            task_doc["methods"][method] = {
                "rate": chosen.get(method),
                "seeds": len(runs),
                "complete": complete,
                "test": scores,
                "test_loss": losses,
                "validation_loss": val,
                "steps": [[r["best"]["step"], r["steps"]] for r in runs if "best" in r],
                "vs_capt": c,
            }
            words = (
                None
                if c is None
                else {"A ahead": "CaPT ahead", "B ahead": "baseline ahead"}.get(c["verdict"], c["verdict"])
            )
            cells = ("-", "-", "-", "-") if c is None else (f"{c['difference']:+.2f}", f"{c['low']:+.2f} to "
                                                                                       f"{c['high']:+.2f}",
                                                              f"{c['p']:.3g}", words)
            lines.append(f"| {LABELS[method]} | {rate} | {len(runs)} | {steps(runs)} | {mean_sd(scores)} | "
                         f"{mean_sd(losses)} | {mean_sd(val)} | " + " | ".join(cells) + " |")
        done = {m for m, v in task_doc["methods"].items() if v["complete"]}
        verdict = task_decision(comparisons, done)
        task_doc["decision"] = verdict
        doc["tasks"][task] = task_doc
        lines += ["", f"Decision (docs/results.md's rule): **{verdict}**.", ""]
        lines += [f"- {in_words('CaPT', LABELS[m], c)}" for m, c in comparisons.items()]
        grid, task_doc["grids"] = grid_lines(out, task, chosen, capt_runs, metric)
        lines += ["", *grid, ""]
    # ablations on RTE
    ablation_table, doc["ablations"] = ablation_lines(out)
    lines += ablation_table
    # training time: CaPT without a search against the searched methods, RTE seed 0
    capt0 = out / "rte" / "capt" / "default" / "seed0"
    test0 = read_json(capt0 / "test.json")
    if test0 is not None:
        metrics = [json.loads(x) for x in (capt0 / "metrics.jsonl").read_text().splitlines()]
        to_best = next(m["time"] for m in metrics if m["step"] == test0["best"]["step"])
        timing = {"capt": {"train_seconds": test0["train_seconds"], "to_best_seconds": to_best}}
        lines += ["## Training time on RTE (seed 0): CaPT with no search, the others with their length search", "",
                  "| method | lengths searched | wall time, s | relative to CaPT's run | relative to CaPT's time to "
                  "its checkpoint | CPU time, s (the whole process) | mean load |",
                  "| --- | --- | --- | --- | --- | --- | --- |",
                  f"| CaPT | - | {test0['train_seconds']:.0f} (to its chosen checkpoint: {to_best:.0f}) | 1.00x | "
                  f"1.00x | {cpu_cells(capt0)} |"]
        for method in ("prompt", "prefix"):
            searched = read_json(out / "rte" / "search" / method / "results.json")
            if searched is None:
                continue
            seconds = searched["train_seconds"]
            timing[method] = {"train_seconds": seconds, "lengths": searched.get("lengths")}
            reused = read_json(out / "rte" / "search" / method / "reused.json")
            timing[method]["reused"] = reused
            lengths = ", ".join(map(str, searched.get("lengths") or []))
            if reused is not None:  # its run at the grid's length is the grid's run, copied in with its time
                lengths += f" (n {reused['n']}: the grid's run)"
            lines.append(f"| {LABELS[method]} | {lengths} | {seconds:.0f} | "
                         f"{seconds / test0['train_seconds']:.2f}x | {seconds / to_best:.2f}x | "
                         f"{search_cpu_cells(out / 'rte' / 'search' / method, reused, out)} |")
        doc["time"] = timing
        lines.append("")
    drawn = chart(doc, results / "table.png")
    if drawn is not None:
        lines[1:1] = ["", "![Every paired difference with its 95% interval](table.png)"]
    (results / "table.md").write_text("\n".join(lines) + "\n")
    (results / "table.json").write_text(json.dumps(doc, indent=1) + "\n")
    copied = 0
    for run in plan(out) if (results / "runs").resolve() != out.resolve() else []:  # runs kept elsewhere: copy them
        d = run["dir"]
        names = (
            "config.json",
            "metrics.jsonl",
            "test.json",
            "made-at.json",
            "result.json",
            "results.json",
            "failed.json",
            "reused.json",
        )
        for name in names:
            if (d / name).is_file():
                target = results / "runs" / d.relative_to(out) / name
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(d / name, target)
                copied += 1
    picture = f", {drawn}" if drawn is not None else " (no table.png: matplotlib is not installed)"
    print(f"wrote {results / 'table.md'} and {results / 'table.json'}{picture}; {copied} run files copied")
    return 0
