"""Tabulate and draw the pooled-token scores in this directory (the `capt eval --json` lines, one file each).

    python results/smollm2-135m-cpu-pooled/table.py   # writes table.md and pooled.png here
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
TASKS = ("rte", "copa")
KS = (1, 2, 3, 4, 10)


def score(name: str) -> tuple[float, float]:
    r = json.loads((HERE / f"{name}.json").read_text())
    return r["metrics"]["accuracy"], r["loss"]


def main() -> None:
    rows = [("zero-shot (nothing in front)", "{t}-zero-shot")]
    rows += [(f"{k} pooled token{'s' if k > 1 else ''}", f"{{t}}-pooled-{k}") for k in KS]
    rows += [("deep prompt tuning (trained, n 1)", "{t}-deep-prompt")]
    rows += [(f"{k} pooled token{'s' if k > 1 else ''} + deep prompt", f"{{t}}-deep-prompt-pooled-{k}") for k in KS]
    head = " | ".join(f"{t.upper()} accuracy | {t.upper()} gold NLL" for t in TASKS)
    lines = [f"| in front of the input | {head} |", "|" + " --- |" * (1 + 2 * len(TASKS))]
    for label, pattern in rows:
        cells = " | ".join(f"{a:.2f} | {n:.3f}" for a, n in (score(pattern.format(t=t)) for t in TASKS))
        lines.append(f"| {label} | {cells} |")
    (HERE / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(TASKS), figsize=(9, 4.0), sharey=True)
    for ax, t in zip(axes, TASKS):
        xs = range(len(KS))
        ax.plot(xs, [score(f"{t}-pooled-{k}")[0] for k in KS], "o-", color="tab:blue", label="pooled tokens, plain model")
        ax.plot(xs, [score(f"{t}-deep-prompt-pooled-{k}")[0] for k in KS], "s-", color="tab:orange",
                label="pooled tokens + trained deep prompt")
        ax.axhline(score(f"{t}-zero-shot")[0], color="tab:blue", ls=":", label="zero-shot")
        ax.axhline(score(f"{t}-deep-prompt")[0], color="tab:orange", ls="--", label="deep prompt alone")
        ax.set(title=f"{t.upper()} test", xticks=list(xs), xticklabels=[str(k) for k in KS], xlabel="pooled instance tokens K")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("accuracy (%)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8, frameon=False)
    fig.suptitle("Training-free pooled instance tokens, SmolLM2-135M-Instruct (zero-shot and deep prompt alone: flat lines;"
                 " on COPA both are 56.00)", fontsize=9)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.savefig(HERE / "pooled.png", dpi=110)


if __name__ == "__main__":
    main()
