"""Sizing a bench run to a time budget (bench.py --budget, --dry-run, --merge).

A run is a list of parts in priority order: the device rates, the pool+add microbenchmark (one
part per workload), then groups of rows, one per (workload, mode, dtype), each holding every
implementation (capt, capt+compile, hf-plain, hf-best) so that a workload's ratios always come
from one run. Group order: bf16 train, bf16 eval, fp32 train, fp32 eval; within each, the
workloads in the order llama-3.2-1b, t5-base, qwen2.5-1.5b, t5-large.

With a budget, a part is started only when its estimate fits in the time left; a part that does
not fit is recorded as skipped and the next (cheaper) one is tried. Each estimate comes from the
table below and is corrected by what the run has measured so far: the ratio measured / estimated
of the finished rows of the same kind (compiled rows, eager rows, micro parts) scales the rest.

Where the estimates come from (an H100 / H200; a figure marked "assumed" was never measured):
  measured  docs/bench.md's reference figures for the HF anchors on an H200, torch 2.11,
            transformers 5.17: hf-plain bf16 train ms/step, eval samples/s, t5-base fp32;
            hf-best bf16 train ms/step and warm-up for llama-3.2-1b (52.2 s) and t5-base (62.3 s);
            hf-plain warm-up (3 steps) 2.1 s (llama-3.2-1b) and 2.6 s (t5-base)
  assumed   hf-best warm-up for t5-large = 2 x t5-base's (twice the blocks to compile) and for
            qwen2.5-1.5b = 28/16 x llama-3.2-1b's (layers); an eval compile = 0.5 x the train
            compile (forward graph only); capt+compile compiled per block = 20 s train, 10 s eval
            (two block graphs, four for T5), whole step = hf-best's; eager warm-up 3 s; fp32 ms =
            1.5 x bf16 where not measured; hf-best ms for t5-large / qwen2.5-1.5b and every eval =
            hf-plain's x the best / plain ratio of the same family (train) or x 0.6 (eval);
            capt rows = their anchor's ms (conservative: the targets ask for faster); building a
            row = 2 s + 2 s per 10^9 parameters, plus 1 s to free it; start-up (imports, CUDA
            context) 20 s; device rates 5 s; micro 15 s per workload
On the CPU (--cpu, tiny models) every row is assumed to take 2 s and every other part 1 s.
"""

from __future__ import annotations

WORKLOAD_ORDER = ("llama-3.2-1b", "t5-base", "qwen2.5-1.5b", "t5-large")
GROUP_ORDER = (("bf16", "train"), ("bf16", "eval"), ("fp32", "train"), ("fp32", "eval"))
COMPILED = ("capt+compile", "hf-best")

# -- measured: docs/bench.md, H200 ----------------------------------------------------------------
PLAIN_TRAIN_MS = {("t5-base", "bf16"): 92.6, ("t5-large", "bf16"): 188.1, ("llama-3.2-1b", "bf16"): 69.8,
                  ("qwen2.5-1.5b", "bf16"): 103.7, ("t5-base", "fp32"): 97.6}
PLAIN_EVAL_SAMPLES_S = {("t5-base", "bf16"): 839, ("t5-large", "bf16"): 361, ("llama-3.2-1b", "bf16"): 533,
                        ("qwen2.5-1.5b", "bf16"): 350, ("t5-base", "fp32"): 715}
BEST_TRAIN_MS = {"llama-3.2-1b": 32.9, "t5-base": 29.3}
BEST_OVER_PLAIN = {"llama": 32.9 / 69.0, "t5": 29.3 / 104.6}  # same-machine pairs of docs/bench.md's second table
BEST_TRAIN_WARMUP_S = {"llama-3.2-1b": 52.2, "t5-base": 62.3}
# -- assumed (see the docstring) -----------------------------------------------------------------
BEST_TRAIN_WARMUP_S.update({"t5-large": 2 * 62.3, "qwen2.5-1.5b": 28 / 16 * 52.2})
EVAL_COMPILE_SHARE = 0.5
BLOCK_COMPILE_S = {"train": 20.0, "eval": 10.0}
EAGER_WARMUP_S = 3.0
FP32_OVER_BF16 = 1.5
BEST_EVAL_OVER_PLAIN = 0.6
BUILD_S, BUILD_S_PER_BILLION, FREE_S = 2.0, 2.0, 1.0
PARAMETERS_BILLION = {"t5-base": 0.223, "t5-large": 0.738, "llama-3.2-1b": 1.236, "qwen2.5-1.5b": 1.544}
STARTUP_S, RATES_S, MICRO_S = 20.0, 5.0, 15.0
CPU_ROW_S, CPU_PART_S = 2.0, 1.0
SAFETY = 1.1  # a part starts only when 1.1 x its estimate fits


def family(workload: str) -> str:
    return "t5" if workload.startswith("t5") else "llama"


def plain_ms(workload: str, mode: str, dtype: str, batch: int) -> float:
    if mode == "train":
        ms = PLAIN_TRAIN_MS.get((workload, dtype))
        return ms if ms is not None else PLAIN_TRAIN_MS[(workload, "bf16")] * FP32_OVER_BF16
    rate = PLAIN_EVAL_SAMPLES_S.get((workload, dtype))
    return (
        1e3 * batch / rate
        if rate is not None
        else 1e3 * batch / PLAIN_EVAL_SAMPLES_S[(workload, "bf16")] * FP32_OVER_BF16
    )


def step_ms(workload: str, mode: str, dtype: str, impl: str, batch: int) -> float:
    """Estimated median step time; capt rows are given their anchor's."""
    plain = plain_ms(workload, mode, dtype, batch)
    if impl in ("capt", "hf-plain"):
        return plain
    if mode == "train" and dtype == "bf16" and workload in BEST_TRAIN_MS:
        return BEST_TRAIN_MS[workload]
    return plain * (BEST_OVER_PLAIN[family(workload)] if mode == "train" else BEST_EVAL_OVER_PLAIN)


def warmup_s(workload: str, mode: str, impl: str, scope: str) -> float:
    """Estimated warm-up (the first steps, compilation included)."""
    if impl not in COMPILED:
        return EAGER_WARMUP_S
    if impl == "capt+compile" and scope == "block":
        return BLOCK_COMPILE_S[mode]
    train = BEST_TRAIN_WARMUP_S[workload]
    return train if mode == "train" else train * EVAL_COMPILE_SHARE


def row_estimate(
    workload: str, mode: str, dtype: str, impl: str, batch: int, steps: int, scope: str, cpu: bool
) -> float:
    """Seconds one row is expected to take, building and freeing its model included."""
    if cpu:
        return CPU_ROW_S
    build = BUILD_S + BUILD_S_PER_BILLION * PARAMETERS_BILLION[workload] + FREE_S
    return build + warmup_s(workload, mode, impl, scope) + steps * step_ms(workload, mode, dtype, impl, batch) / 1e3


def kind(part: dict, impl: str | None = None) -> str:
    """What a measured duration corrects: compiled rows, eager rows, or the other parts."""
    if part["part"] != "group":
        return part["part"]  # startup, rates, micro, mixed
    return "compiled" if impl in COMPILED else "eager"


# ---------------------------------------------------------------------------------------------
# The plan


def build_plan(args, specs: dict, done_groups: set, done_micro: set, done_mixed: set = frozenset()) -> list[dict]:
    """Every part of the run in priority order, each with its estimate; parts already measured in
    the --merge file (done_groups: (workload, mode, dtype); done_micro: workloads; done_mixed: (workload,
    dtype)) are left out."""
    workloads = [w for w in WORKLOAD_ORDER if w in specs]
    cpu = args.cpu
    parts = [
        dict(part="startup", estimate=0.0 if cpu else STARTUP_S),
        dict(part="rates", estimate=CPU_PART_S if cpu else RATES_S),
    ]
    if not args.no_micro:
        parts += [
            dict(part="micro", workload=w, estimate=CPU_PART_S if cpu else MICRO_S)
            for w in workloads
            if w not in done_micro
        ]
    if args.micro_only:
        return parts
    for dtype, mode in GROUP_ORDER:
        if dtype not in args.dtypes or mode not in args.modes:
            continue
        for w in workloads:
            if (w, mode, dtype) in done_groups:
                continue
            rows = {
                impl: row_estimate(w, mode, dtype, impl, specs[w]["batch"], args.steps, args.compile_scope, cpu)
                for impl in args.impls
            }
            parts.append(dict(part="group", workload=w, mode=mode, dtype=dtype, rows=rows, estimate=sum(rows.values())))
    if getattr(args, "mixed_tasks", 0) > 0:  # the mixed-batch rows, planned like the rest
        for dtype in args.dtypes:
            for w in (w for w in workloads if (w, dtype) not in done_mixed):
                parts.append(
                    dict(
                        part="mixed",
                        workload=w,
                        dtype=dtype,
                        estimate=mixed_estimate(w, dtype, specs[w]["batch"], args.mixed_tasks, args.steps, cpu),
                    )
                )
    return parts


def mixed_estimate(workload: str, dtype: str, batch: int, sets: int, steps: int, cpu: bool) -> float:
    """Seconds a mixed-batch row is expected to take (bench.py mixed_row): two models built (one set, K sets), then
    the single-task, mixed and task-by-task steps (one eval step per set in the batch), each warmed up and timed
    (assumed, from the eval rows' figures)."""
    if cpu:
        return 3 * CPU_ROW_S
    build = 2 * (BUILD_S + BUILD_S_PER_BILLION * PARAMETERS_BILLION[workload] + FREE_S)
    step = plain_ms(workload, "eval", dtype, batch) / 1e3
    return build + 3 * EAGER_WARMUP_S + (steps + 2) * step * (2 + min(sets, batch))


class Budget:
    """The time left and the corrected estimates, for a run that must end by `deadline` (a clock value)."""

    def __init__(self, deadline: float | None):
        self.deadline = deadline
        self.measured = {}  # kind -> [measured seconds, estimated seconds]

    def factor(self, what: str) -> float:
        measured, estimated = self.measured.get(what, (0.0, 0.0))
        return min(max(measured / estimated, 0.25), 4.0) if estimated > 0 else 1.0

    def record(self, what: str, seconds: float, estimate: float) -> None:
        m = self.measured.setdefault(what, [0.0, 0.0])
        m[0] += seconds
        m[1] += estimate

    def part_estimate(self, part: dict) -> float:
        if part["part"] == "group":
            return sum(s * self.factor(kind(part, impl)) for impl, s in part["rows"].items())
        return part["estimate"] * self.factor(kind(part))

    def fits(self, seconds: float, now: float) -> bool:
        return self.deadline is None or now + SAFETY * seconds <= self.deadline

    def why_not(self, seconds: float, now: float) -> str:
        return f"skipped: --budget (needs ~{seconds:.0f} s, {max(self.deadline - now, 0.0):.0f} s left)"


def part_name(part: dict) -> str:
    if part["part"] == "group":
        return f"{part['dtype']} {part['mode']} {part['workload']}"
    if part["part"] == "mixed":
        return f"mixed {part['dtype']} {part['workload']}"
    return f"micro {part['workload']}" if part["part"] == "micro" else {"startup": "start-up (imports, CUDA context)",
                                                                          "rates": "device rates"}[part["part"]]


def schedule(parts: list[dict], budget: float | None) -> list[tuple[dict, bool, float]]:
    """(part, planned, running total) for each part, by the uncorrected estimates: what a run of
    this budget is expected to do (the run itself decides again before each part, with corrections)."""
    out, total = [], 0.0
    for part in parts:
        fits = budget is None or part["part"] == "startup" or total + SAFETY * part["estimate"] <= budget
        total += part["estimate"] if fits else 0.0
        out.append((part, fits, total))
    return out


def plan_lines(planned: list[tuple[dict, bool, float]]) -> list[str]:
    """The schedule as a table: each part, its estimate, the running total or SKIPPED."""
    lines = [f"{'part':<34} {'estimate s':>10} {'total s':>8}  rows (estimate s)"]
    for part, fits, total in planned:
        rows = ", ".join(f"{impl} {s:.0f}" for impl, s in part.get("rows", {}).items())
        where = f"{total:>8.0f}" if fits else f"{'SKIPPED':>8}"
        lines.append(f"{part_name(part):<34} {part['estimate']:>10.0f} {where}  {rows}")
    return lines


# ---------------------------------------------------------------------------------------------
# --merge: a later run's workloads added to an earlier JSON


def runs_of(result: dict) -> list[dict]:
    """The runs a result file holds (a file written before --merge existed is one run)."""
    if "runs" in result:
        return result["runs"]
    return [{k: result.get(k) for k in ("environment", "options", "rates", "peaks", "total_s")}]


def complete_groups(result: dict, impls: list[str]) -> set:
    """(workload, mode, dtype) of the earlier file whose rows hold every implementation of `impls`, none failed or
    skipped."""
    groups = {}
    for r in result.get("rows", []):
        groups.setdefault((r["workload"], r["mode"], r["dtype"]), {})[r["impl"]] = r
    return {key for key, rows in groups.items() if all(i in rows and not rows[i].get("error") for i in impls)}


def measured_micro(result: dict) -> set:
    """Workloads whose microbenchmark rows in the earlier file all ran."""
    by = {}
    for m in result.get("micro", []):
        by.setdefault(m["workload"], []).append(m)
    return {
        w
        for w, rows in by.items()
        if all(not m.get("error") or str(m["error"]).startswith("skipped: the Triton") for m in rows)
    }


def measured_mixed(result: dict) -> set:
    """(workload, dtype) of the earlier file's mixed-batch rows that ran."""
    return {(m["workload"], m["dtype"]) for m in result.get("mixed", []) if not m.get("error")}


def skipped(row: dict) -> bool:
    return str(row.get("error") or "").startswith("skipped")


def merge(earlier: dict, result: dict) -> dict:
    """earlier's rows, micro rows and mixed rows plus this run's: a group (workload, mode, dtype), a
    workload's micro rows or a mixed row (workload, dtype) that this run measured replace the earlier ones
    whole, so a group's rows always come from one run; every row says which run it came from ("run", an
    index into "runs")."""
    runs = runs_of(earlier)
    this = len(runs)

    def groups(rows, key, run):
        out = {}
        for r in rows:
            out.setdefault(key(r), []).append(dict(r, run=r.get("run", run)))
        return out

    def join(old, new):
        taken = {}
        for k, rows in old.items():
            taken[k] = rows
        for k, rows in new.items():
            if k not in taken or not all(skipped(r) for r in rows):
                taken[k] = rows
        return [r for rows in taken.values() for r in rows]

    group_key = lambda r: (r["workload"], r["mode"], r["dtype"])  # noqa: E731
    micro_key = lambda r: r["workload"]  # noqa: E731
    rows = join(groups(earlier.get("rows", []), group_key, 0), groups(result["rows"], group_key, this))
    micro = join(groups(earlier.get("micro", []), micro_key, 0), groups(result["micro"], micro_key, this))
    mixed_key = lambda r: (r["workload"], r["dtype"])  # noqa: E731
    mixed = join(groups(earlier.get("mixed", []), mixed_key, 0), groups(result.get("mixed", []), mixed_key, this))
    own = {k: result.get(k) for k in ("environment", "options", "rates", "peaks", "total_s")}
    workloads = dict(earlier.get("workloads", {}), **result.get("workloads", {}))
    return dict(result, runs=runs + [own], rows=rows, micro=micro, mixed=mixed, workloads=workloads)
