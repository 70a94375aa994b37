"""The step-scale sweep's table and chart, from the results.json of each variant in this directory.

    .venv/bin/python results/smollm2-135m-cpu-step-scale/table.py

Writes table.md and sweep.png here: per task, the test headline and the best validation gold NLL of
every seed against the rate (r under the per-block step scale, lr with one rate), the zero-shot
test headline as a line.
"""

import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT))

from capt.plots import _figure, _save  # noqa: E402

NAME = re.compile(r"(rms-r|plain-lr)([0-9.e-]+)$")


def variants() -> list[dict]:
    """One entry per variant directory: its kind (rms / plain), rate, and the per-task runs."""
    out = []
    for d in sorted(HERE.iterdir()):
        m = NAME.match(d.name)
        if not (m and (d / "results.json").is_file()):
            continue
        results = json.loads((d / "results.json").read_text())
        out.append({"name": d.name, "kind": "rms" if m.group(1) == "rms-r" else "plain", "rate": float(m.group(2)),
                    "tasks": results["tasks"], "environment": results["environment"]})
    return sorted(out, key=lambda v: (v["kind"], v["rate"]))


def mean_std(xs):
    return statistics.mean(xs), (statistics.stdev(xs) if len(xs) > 1 else 0.0)


def table(vs: list[dict]) -> str:
    lines = ["# The step-scale sweep: CaPT on SmolLM2-135M-Instruct, CB and COPA", "",
             "3 epochs of batch 16, inputs cut to 128 tokens, fp32, seeds 0, 1, 2, the answer cue; test = the official "
             "validation set. `rms` trains block l at r x c_l (the per-block step scale), `plain` at one rate lr. "
             "Validation NLL: the best evaluation's gold NLL (nats) on the 10% validation split; the format is learned "
             "when it is at most 3.", ""]
    for task in ("cb", "copa"):
        t0 = next(v["tasks"][task] for v in vs if task in v["tasks"])
        metric = t0["metric"]
        lines += [f"## {task} (test {metric}; zero-shot {t0['zero_shot']['headline']:.2f}, gold NLL "
                  f"{t0.get('zero_shot_loss', float('nan')):.2f})", "",
                  "| rate | test per seed | mean ± std | best validation NLL per seed | test gold NLL per seed | learned | reached zero-shot |",
                  "| --- | --- | --- | --- | --- | --- | --- |"]
        for v in vs:
            runs = sorted(v["tasks"][task]["runs"], key=lambda r: r["seed"])
            test = [r["test"]["headline"] for r in runs]
            m, s = mean_std(test)
            val = [r.get("validation_loss") for r in runs]
            tl = [r.get("test_loss") for r in runs]
            learned = sum(x is not None and x <= 3 for x in val)
            reached = sum(x >= v["tasks"][task]["zero_shot"]["headline"] for x in test)
            rate = f"r {v['rate']:g}" if v["kind"] == "rms" else f"one rate, lr {v['rate']:g}"
            lines.append(f"| {rate} | {', '.join(f'{x:.2f}' for x in test)} | {m:.2f} ± {s:.2f} | "
                         f"{', '.join('-' if x is None else f'{x:.2f}' for x in val)} | "
                         f"{', '.join('-' if x is None else f'{x:.2f}' for x in tl)} | {learned} of {len(runs)} | {reached} of {len(runs)} |")
        lines.append("")
    commits = sorted({v["environment"].get("commit") for v in vs} - {None})
    lines.append(f"Made at commits {', '.join(commits)} on {', '.join(sorted({v['environment'].get('processor') or '?' for v in vs}))}; "
                 "between them only code that does not touch training or evaluation changed.")
    return "\n".join(lines) + "\n"


def chart(vs: list[dict]):
    fig = _figure(11, 7.5)
    if fig is None:
        return None
    axes = fig.subplots(2, 2)
    for col, task in enumerate(("cb", "copa")):
        score_ax, nll_ax = axes[0][col], axes[1][col]
        for kind, color, label in (("rms", "tab:blue", "step scale (x: r)"), ("plain", "tab:red", "one rate (x: lr)")):
            sel = [v for v in vs if v["kind"] == kind and task in v["tasks"]]
            if not sel:
                continue
            for v in sel:
                runs = v["tasks"][task]["runs"]
                xs = [v["rate"]] * len(runs)
                score_ax.scatter(xs, [r["test"]["headline"] for r in runs], color=color, alpha=0.55, s=22)
                nll_ax.scatter(xs, [r.get("validation_loss") for r in runs], color=color, alpha=0.55, s=22)
            rates = [v["rate"] for v in sel]
            score_ax.plot(rates, [statistics.mean(r["test"]["headline"] for r in v["tasks"][task]["runs"]) for v in sel], "-o",
                          color=color, label=f"{label}, mean of 3 seeds")
            nll_ax.plot(rates, [statistics.mean(r.get("validation_loss") for r in v["tasks"][task]["runs"]) for v in sel], "-o",
                        color=color, label=label)
        t0 = next(v["tasks"][task] for v in vs if task in v["tasks"])
        score_ax.axhline(t0["zero_shot"]["headline"], color="0.4", linestyle="--", label="zero-shot")
        nll_ax.axhline(3.0, color="0.4", linestyle=":", label="3 nats: the format is learned below")
        metric = {"f1": "macro-F1", "accuracy": "accuracy"}[t0["metric"]]
        score_ax.set(xscale="log", title=f"{task.upper()}: test {metric} (each dot a seed)", ylabel="percent")
        nll_ax.set(xscale="log", title=f"{task.upper()}: best validation gold NLL", xlabel="rate (log scale)", ylabel="nats")
        nll_ax.set_ylim(bottom=0)
        low, high = score_ax.get_ylim()
        score_ax.set_ylim(low, high + 0.3 * (high - low))  # room above the dots for the legend
        ticks = sorted({v["rate"] for v in vs})
        for ax in (score_ax, nll_ax):
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])  # the rates tried, written out
            ax.minorticks_off()
            ax.grid(alpha=0.3)
            ax.legend(fontsize="small", loc="upper right" if ax is score_ax else "best")
    fig.suptitle("SmolLM2-135M-Instruct, 45 (CB) / 69 (COPA) steps: the per-block step scale against one rate")
    return _save(fig, HERE / "sweep.png")


def main():
    vs = variants()
    (HERE / "table.md").write_text(table(vs))
    print(table(vs), end="")
    chart(vs)


if __name__ == "__main__":
    main()
