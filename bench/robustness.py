"""Does CaPT's default recipe learn on any seed? The robustness benchmark of the step scale.

    python bench/robustness.py --out runs/robustness              # runs what is missing, then the table
    python bench/robustness.py --out runs/robustness --table-only # only the table, from finished runs
    python bench/robustness.py --out runs/robustness --tasks examples/cb-yes-no.json  # a task file (the demo's)

At the demo's budget (SmolLM2-135M-Instruct, 3 epochs of batch 16, inputs cut to 128 tokens, fp32),
CaPT is trained on each task with seeds 0-4 at r = default / 2, default and 2 x default (the
per-block step scale, capt/stepscale.py), one `capt run` per task and r (OUT/<task>/r<R>/). The table counts, per
task and r:

    learned   runs whose lowest validation gold NLL (over the run's evaluations, metrics.jsonl) is at
              most 3 nats: the answer format is learned (zero-shot it is 13-18 nats on CB). The best
              checkpoint is chosen by the headline metric, so its own NLL can be higher; both are shown
    reached   runs whose test headline is at least the zero-shot test headline of the same template

The target (the robustness issue): on CB every run learns the format and at least 13 of 15 reach
zero-shot. --reuse DIR copies finished runs of the same settings (e.g. the step-scale sweep's
DIR/rms-r<R>/<task>/seed<k>) before running, so they are not trained twice; a copied run is
resumed, that is, read back, by `capt run --resume`.

Writes OUT/robustness.md and OUT/robustness.json. A benchmark, not a test: it takes hours on two CPU
cores (about 4-5 minutes a run).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from capt.methods import METHODS  # noqa: E402
from capt.tasks import get_task  # noqa: E402

LEARNED_NLL = 3.0  # nats: a lowest validation gold NLL at most this means the answer format is learned


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(ROOT / "weights" / "smollm2-135m-instruct"))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tasks", default="cb,copa")
    p.add_argument("--seeds", type=int, default=5)
    default = METHODS["capt"].scaled_lr
    p.add_argument("--rates", default=f"{default / 2:g},{default:g},{2 * default:g}", help="r values (default: d/2, d, "
                                                                                           "2d)")
    p.add_argument("--reuse", type=Path, help="a sweep directory holding rms-r<R>/<task>/seed<k> runs of the same "
                                              "settings")
    p.add_argument("--table-only", action="store_true", help="write the table from finished runs; train nothing")
    p.add_argument("--python", default=sys.executable)
    p.add_argument("--run-timeout", type=float, default=6 * 3600, help="seconds one task and rate may run (all its "
                                                                        "seeds) before it is stopped (default 6 h)")
    return p.parse_args(argv)


def task_name(task: str) -> str:
    """The name a task's runs are filed under: a SuperGLUE task's own, or a task file's "name"
    (examples/cb-yes-no.json: cb-yes-no)."""
    return get_task(task).name if task.lower().endswith(".json") else task


def rate_dir(out: Path, task: str, r: str) -> Path:
    task = task_name(task)
    return out / task / f"r{r}"  # one `capt run` per task and r, so tasks can be run (and added) one at a time


def reuse(args, task: str, r: str) -> None:
    """Copy the finished runs of the sweep at this r (same settings) into OUT/<task>/r<R>/<task>/seed<k>."""
    for seed in range(args.seeds):
        source = args.reuse / f"rms-r{r}" / task_name(task) / f"seed{seed}"
        target = rate_dir(args.out, task, r) / task_name(task) / f"seed{seed}"
        if (source / "test.json").is_file() and not target.exists():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns(".lock"))
    made = args.reuse / f"rms-r{r}" / "results.json"  # where the copied runs were made: commit and processor
    if made.is_file():
        environment = json.loads(made.read_text()).get("environment", {})
        rate_dir(args.out, task, r).mkdir(parents=True, exist_ok=True)
        (rate_dir(args.out, task, r) / "reused_from.json").write_text(
            json.dumps(
                {
                    "from": str(made.parent),
                    "commit": environment.get("commit"),
                    "processor": environment.get("processor"),
                }
            )
            + "\n"
        )


def run(args, task: str, r: str) -> None:
    out = rate_dir(args.out, task, r)
    if (out / "results.json").is_file():
        return
    cmd = [args.python, "-m", "capt", "run", "--model", args.model, "--tasks", task, "--seeds", str(args.seeds),
           "--epochs", "3", "--max-length", "128", "--lr", r, "--device", "cpu", "--out", str(out)]
    if out.exists():
        cmd.append("--resume")  # finished (or copied) runs are read back, an interrupted one continued
    print(" ".join(cmd), flush=True)
    child = subprocess.Popen(cmd, cwd=ROOT)
    try:
        code = child.wait(timeout=args.run_timeout)
    except subprocess.TimeoutExpired:  # capt saves its state on SIGINT: the same command continues it
        child.send_signal(signal.SIGINT)
        try:
            child.wait(timeout=300)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        sys.exit(f"{task} r {r} ran past --run-timeout {args.run_timeout:g} s and was stopped; the same command "
                 "continues it from its last saved state")
    if code != 0:
        sys.exit(f"{task} r {r}: capt run exited {code} (its lines above say why); the same command continues it")


def lowest_validation_loss(run: Path, fallback):
    """The lowest validation gold NLL among a run's evaluations (metrics.jsonl); without the file, the
    best checkpoint's (results.json), which is at least as high."""
    try:
        lines = (run / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return fallback
    losses = [json.loads(line).get("validation", {}).get("loss") for line in lines if line.strip()]
    losses = [v for v in losses if v is not None]
    return min(losses) if losses else fallback


def table(args, rates: list[str]) -> dict:
    out = {"rates": rates, "seeds": args.seeds, "learned_nll": LEARNED_NLL, "tasks": {}}
    for task in args.tasks.split(","):
        rows = []
        for r in rates:
            results = json.loads((rate_dir(args.out, task, r) / "results.json").read_text())
            entry = results["tasks"][task_name(task)]
            zero = entry["zero_shot"]["headline"]
            runs = sorted(entry["runs"], key=lambda x: x["seed"])
            lowest = [
                lowest_validation_loss(
                    rate_dir(args.out, task, r) / task_name(task) / f"seed{x['seed']}", x.get("validation_loss")
                )
                for x in runs
            ]
            reused = rate_dir(args.out, task, r) / "reused_from.json"
            made = [results["environment"]] + ([json.loads(reused.read_text())] if reused.is_file() else [])
            rows.append({
                "r": float(r), "zero_shot": zero, "zero_shot_loss": entry.get("zero_shot_loss"),
                "test": [x["test"]["headline"] for x in runs], "test_loss": [x.get("test_loss") for x in runs],
                "validation_loss": [x.get("validation_loss") for x in runs],
                "lowest_validation_loss": lowest,
                "learned": sum(v is not None and v <= LEARNED_NLL for v in lowest),
                "reached": sum(x["test"]["headline"] >= zero for x in runs), "n": len(runs),
                "commits": sorted({m.get("commit") for m in made} - {None}),
                "processors": sorted({m.get("processor") for m in made} - {None}),
            })
        out["tasks"][task_name(task)] = {"metric": entry["metric"], "rows": rows}
    return out


def markdown(result: dict) -> str:
    lines = ["# Robustness of the default recipe", "",
             f"CaPT on SmolLM2-135M-Instruct at the demo's budget, seeds 0-{result['seeds'] - 1} at each r. Learned: "
             f"validation gold NLL <= {result['learned_nll']:g} nats (the lowest over the run's evaluations; the best "
             "checkpoint, chosen by the headline metric, can sit higher). Reached: test headline >= zero-shot's (same "
             "template).", ""]
    for task, t in result["tasks"].items():
        lines += [f"## {task} (test {t['metric']})", "",
                  "| r | zero-shot | test per seed | mean | lowest validation NLL per seed | best checkpoint's "
                  "validation NLL "
                  "| learned | reached zero-shot |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for row in t["rows"]:
            per = ", ".join(f"{v:.2f}" for v in row["test"])
            nll = ", ".join("-" if v is None else f"{v:.2f}" for v in row["validation_loss"])
            low = ", ".join("-" if v is None else f"{v:.2f}" for v in row["lowest_validation_loss"])
            mean = sum(row["test"]) / len(row["test"])
            lines.append(f"| {row['r']:g} | {row['zero_shot']:.2f} | {per} | {mean:.2f} | {low} | {nll} | "
                         f"{row['learned']} of {row['n']} "
                         f"| {row['reached']} of {row['n']} |")
        total = sum(r["n"] for r in t["rows"])
        lines += ["", f"All rates: learned {sum(r['learned'] for r in t['rows'])} of {total}, reached zero-shot "
                      f"{sum(r['reached'] for r in t['rows'])} of {total}.", ""]
    commits = sorted({c for t in result["tasks"].values() for r in t["rows"] for c in r["commits"]})
    processors = sorted({c for t in result["tasks"].values() for r in t["rows"] for c in r["processors"]})
    lines.append(f"Made at commits {', '.join(commits) or 'unknown'} on "
                 f"{', '.join(processors) or 'an unrecorded processor'}.")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    args = parse_args(argv)
    rates = [r.strip() for r in args.rates.split(",") if r.strip()]
    if not args.table_only:
        for task in args.tasks.split(","):
            for r in rates:
                if args.reuse:
                    reuse(args, task, r)
                run(args, task, r)
    result = table(args, rates)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "robustness.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "robustness.md").write_text(markdown(result))
    print(markdown(result), end="")


if __name__ == "__main__":
    main()
