"""Pictures: a run's training curves (RUN/curves.png) and `capt compare`'s bar chart (compare.png).

matplotlib is optional (`pip install 'capt[plots]'`, installed by `make setup`). Without it each
function returns None and the caller prints MISSING once; nothing else changes. Figures are drawn
on matplotlib's Agg canvas through the Figure object (no pyplot, so no global backend or state is
touched) and written atomically like every other file.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from .checks import read_json
from .errors import CaptError, CaptWarning
from .load import atomic_write
from .methods import capsule_variant
from .rundir import metrics_line, metrics_lines

MISSING = "matplotlib is not installed, so no PNG picture is drawn (pip install 'capt[plots]', or make setup)"
METRIC_NAMES = {"f1": "macro-F1", "accuracy": "accuracy", "f1a": "F1a", "em": "exact match"}


def _figure(width: float, height: float):
    """A new matplotlib Figure, or None without matplotlib."""
    try:
        # optional dependency: imported only when a picture is drawn
        from matplotlib.figure import Figure
    except ImportError:
        return None
    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _save(fig, path: Path) -> Path:
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    return path


def available() -> bool:
    """True when matplotlib can be imported, so the PNGs are drawn."""
    return _figure(1, 1) is not None


def headline_name(validation: dict) -> str:
    """The headline metric's key in a metrics line's validation dict (the first key after "headline")."""
    return next(k for k in validation if k not in ("headline", "loss"))


def run_curves(run: str | Path) -> Path | None:
    """RUN/curves.png from RUN/metrics.jsonl: the losses and the validation scores against optimizer steps.

    Left: the training loss (mean gold NLL of the steps since the previous evaluation) and the
    validation loss; right: the validation headline (and the task's other metrics), the best
    evaluation marked. The base model's zero-shot validation loss and headline (config.json's
    zero_shot_validation, when the run recorded it) are dashed grey lines; a zero-shot loss more than
    twice the curves' highest is named at the panel's top rather than drawn to scale. Returns the
    file, or None without matplotlib.
    """
    run = Path(run)
    file = run / "metrics.jsonl"
    if not file.is_file():
        raise CaptError(f"no metrics.jsonl in {run}: not a run directory, or no evaluation has finished")
    lines = [metrics_line(file, i + 1, text) for i, text in enumerate(metrics_lines(file)) if text.strip()]
    if not lines:
        raise CaptError(f"{file} is empty: no evaluation has finished yet")
    try:
        config = read_json(run / "config.json", "a run's settings")
    except CaptError as e:  # the curves need only the metrics; the settings add the title and zero-shot lines
        warnings.warn(CaptWarning(f"{e}; the curves are drawn without the title and the zero-shot lines"))
        config = {}
    fig = curves_figure(lines, config)
    return None if fig is None else _save(fig, run / "curves.png")


RULES = {"headline": "chosen by the highest validation headline, ties by the lower NLL",
         "loss": "chosen by the lowest validation NLL"}


def curves_figure(lines: list[dict], config: dict):
    """The Figure of run_curves from metrics lines and the run's config.json (None without matplotlib). Every line is
    named as what it is (training or validation, zero-shot on the validation split); the kept evaluation is starred
    on both panels with the rule that chose it; the legends sit below the panels, off the lines."""
    fig = _figure(10, 5.2)
    if fig is None:
        return None
    steps = [m["step"] for m in lines]
    head = headline_name(lines[0]["validation"])
    loss_ax, score_ax = fig.subplots(1, 2)
    rows = (config.get("examples") or {}).get("validation")
    split = f"validation ({rows} rows)" if rows else "validation"

    trained = [(m["step"], m["train_loss"]) for m in lines if m.get("train_loss") is not None]
    if trained:
        loss_ax.plot(*zip(*trained), "o-", color="tab:blue", label="training (mean since the previous evaluation)")
    loss_ax.plot(steps, [m["validation"]["loss"] for m in lines], "s-", color="tab:orange", label=split)
    zero = config.get("zero_shot_validation") or {}
    if zero.get("loss") is not None:
        # an untrained model can put its mass off the answers (tens of nats against the runs' < 1): drawn to
        # scale, that line would flatten the curves, so the panel keeps to them and says where the line is
        top = max([m["validation"]["loss"] for m in lines] + [loss for _, loss in trained])
        above = zero["loss"] > 2 * top
        loss_ax.axhline(zero["loss"], color="0.45", linestyle="--", linewidth=1,
                        label=f"zero-shot, validation ({zero['loss']:.2f}" + (", above the panel)" if above else ")"))
        if above:
            loss_ax.set_ylim(0, 1.15 * top)
            loss_ax.annotate(f"zero-shot {zero['loss']:.2f} \u2191", xy=(0.98, 0.97), xycoords="axes fraction",
                             ha="right", va="top", color="0.45", fontsize="small")
    loss_ax.set(title="Loss: gold answer NLL per example", xlabel="optimizer step",
                ylabel="negative log-likelihood (nats)")
    loss_ax.grid(alpha=0.3)

    for key in lines[0]["validation"]:
        if key in ("headline", "loss"):
            continue
        style = dict(marker="o", linewidth=2) if key == head else dict(marker=".", linestyle="--", linewidth=1)
        label = f"{METRIC_NAMES.get(key, key)}, validation" + (" (headline)" if key == head else "")
        # a line without it: a gap
        score_ax.plot(steps, [m["validation"].get(key, float("nan")) for m in lines], label=label, **style)
    best = [m for m in lines if m.get("best")]
    if best:
        last = best[-1]  # the evaluation whose tensors are in best/
        rule = RULES.get(config.get("select", "headline"), "")
        star = dict(color="gold", markeredgecolor="black", markersize=16, zorder=5)
        loss_ax.plot([last["step"]], [last["validation"]["loss"]], "*", **star,
                     label=f"kept evaluation, step {last['step']}, {rule}")
        score_ax.plot([last["step"]], [last["validation"].get(head, float("nan"))], "*", **star,
                      label=f"kept evaluation, step {last['step']} (its tensors: best/)")
    zero_head = (zero.get("metrics") or {}).get(head)
    if zero_head is not None:
        score_ax.axhline(zero_head, color="0.45", linestyle="--", linewidth=1,
                         label=f"{METRIC_NAMES.get(head, head)}, zero-shot, validation ({zero_head:.1f})")
    highest = max(
        [m["validation"][k] for m in lines for k in m["validation"] if k not in ("headline", "loss")]
        + [zero_head or 0.0]
    )
    score_ax.set_ylim(0, min(100.0, highest + 10) + 2)  # percent: from 0, a little room above the best
    score_ax.set(title=f"Scores on the {split} split", xlabel="optimizer step", ylabel="percent")
    score_ax.grid(alpha=0.3)
    for ax in (loss_ax, score_ax):  # below the panel: a legend never covers a line
        ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=1, frameon=False)

    what = run_name(config)
    fig.suptitle(f"Training curves: {what}" if what else "Training curves")
    return fig


def run_name(config: dict) -> str:
    """A run's title from its config.json: task, method, seed and model, "·"-separated."""
    task = config.get("task_file", {}) or {}
    name = Path(task["path"]).stem if task.get("path") else config.get("task", "")
    method = config.get("method")
    if method == "capt" and capsule_variant(config):  # an ablation is named, not only "capt"
        method = f"capt ({capsule_variant(config)})"
    return " · ".join(
        str(x)
        for x in (
            name,
            method,
            f"seed {config.get('seed')}" if "seed" in config else None,
            Path(str(config.get("model", ""))).name or None,
        )
        if x
    )


def compare_chart(table: dict, out: str | Path) -> Path | None:
    """OUT/compare.png: each method's test headline per task (mean over seeds, sample std as error bars),
    zero-shot first, from report.compare's table. Returns the file, or None without matplotlib."""
    fig = compare_figure(table)
    return None if fig is None else _save(fig, Path(out) / "compare.png")


def compare_figure(table: dict):
    """The Figure of compare_chart (None without matplotlib): one group of bars per task, one bar per row."""
    names, rows = table["tasks"], table["rows"]
    fig = _figure(max(7.0, 1.2 + len(names) * (len(rows) + 1) * 0.55), 4.8)
    if fig is None:
        return None
    ax = fig.subplots()
    bars = [("zero-shot", {n: (table["zero_shot"][n]["value"], None) for n in names})]
    bars += [(row["label"], {n: (row["tasks"][n]["mean"], row["tasks"][n]["std"]) for n in names if n in row["tasks"]})
             for row in rows]
    width = 0.8 / len(bars)
    colors = ["0.6"] + [f"C{i % 10}" for i in range(len(rows))]
    top = 0.0
    for i, (label, values) in enumerate(bars):
        xs = [
            j + (i - (len(bars) - 1) / 2) * width
            for j, n in enumerate(names)
            if n in values and values[n][0] is not None
        ]
        kept = [values[n] for n in names if n in values and values[n][0] is not None]
        if not kept:
            continue
        means = [m for m, _ in kept]
        errors = [s or 0.0 for _, s in kept]
        ax.bar(xs, means, width * 0.92, yerr=errors if any(errors) else None, capsize=3, color=colors[i], label=label,
               hatch="//" if i == 0 else None, edgecolor="black", linewidth=0.5)
        for x, m, e in zip(xs, means, errors):
            ax.text(x, m + e + 0.8, f"{m:.1f}", ha="center", va="bottom", fontsize=7)
        top = max(top, max(m + e for m, e in zip(means, errors)))
    ax.set_xticks(
        range(len(names)),
        [
            f"{n}\n(test {METRIC_NAMES.get(table['zero_shot'][n]['metric'], table['zero_shot'][n]['metric'])})"
            for n in names
        ],
    )
    ax.set_ylim(0, min(100.0, top * 1.15 + 5))
    several = any(len(row.get("seeds") or []) > 1 for row in rows)
    ax.set_ylabel(
        "score (%), mean ± sample std over seeds" if several else "score (%), one seed each (no spread shown)"
    )
    rows_n = table.get("test_rows") or {}
    counted = ", ".join(f"{n} {rows_n[n]}" for n in names if rows_n.get(n))
    budgets = {(b.get("epochs"), b.get("max_steps")) for b in (row.get("budget") or {} for row in rows) if b}
    budget = "; ".join(f"epochs {e}" + (f", max steps {m}" if m else "") for e, m in sorted(budgets, key=str))
    ax.set_title(f"Methods on {Path(str(table.get('model') or '')).name or 'one base model'} (frozen): test headline "
                 f"per task\n{'test rows: ' + counted if counted else ''}{'; ' if counted and budget else ''}"
                 f"{'budget: ' + budget if budget else ''}", fontsize=9)
    ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return fig
