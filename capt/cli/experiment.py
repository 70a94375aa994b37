"""`capt run` (run_tasks): one method on tasks x seeds with an optional prompt-length search;
results.json with how it was made (command, commit, device, data hashes) and results.md.

Tasks are SuperGLUE names or task files (FILE.json, capt/taskfile.py); a task file's runs go to
OUT/<its name>/, and its results carry the task file's path and sha256. The SuperGLUE directory
is looked for only when a SuperGLUE task is asked for."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .. import __version__, distributed
from ..errors import CaptError
from ..evaluate import encode_examples, evaluate, is_seq2seq
from ..load import atomic_write, default_device, load_model, read_config, trainable_count
from ..methods import attach, detach
from .report import SEARCHABLE, mean_std, results_markdown
from ..rundir import check_out, data_hashes, lock_run, logged_seconds, make_directory, run_inputs, write_json
from ..tasks import TASKS, Task, get_task, load_task, paper_average, resolve_data_dir, task_dir, task_file_record
from ..tokenizer import load_tokenizer
from ..trainconfig import TrainConfig, default_lr
from ..trainer import Interrupted, TrainingDiverged, train


def missing_data(task: str | Task, data_dir) -> str | None:
    """Why a file the task needs is absent (SuperGLUE: train.jsonl or val.jsonl in data_dir), or None when all are
    there."""
    task = task if isinstance(task, Task) else get_task(task)
    if task.file is not None:
        spec = task.file
        if spec.test is None:
            return f"{spec.path} names no test file (add \"test\": \"FILE.jsonl\")"
        absent = [
            file for file in (spec.train, spec.validation, spec.test) if file is not None and not Path(file).is_file()
        ]
        return f"its data file {absent[0]} is missing (named by {spec.path})" if absent else None
    try:
        folder = task_dir(task, Path(data_dir))
    except CaptError as e:
        return str(e)
    for name in ("train.jsonl", "val.jsonl"):
        if not (folder / name).is_file():
            return f"no official {name} in {folder}"
    return None


def parse_tasks(tasks: str | list[str]) -> tuple[list[Task], bool]:
    """(the Tasks asked for, in order and without repeats; whether they were "all" of SuperGLUE's)."""
    every = isinstance(tasks, str) and tasks.strip().lower() == "all"
    if isinstance(tasks, str):
        tasks = list(TASKS) if every else [t for t in tasks.split(",") if t.strip()]
    chosen = list({task.spec: task for task in (get_task(t.strip()) for t in tasks)}.values())
    if not chosen:
        raise CaptError("no task given: use --tasks all, a comma-separated list such as cb,copa, or task files "
                        "FILE.json")
    names = [t.name for t in chosen]
    double = next((n for i, n in enumerate(names) if n in names[:i]), None)
    if double is not None:
        files = ", ".join(t.spec for t in chosen if t.name == double)
        raise CaptError(f"two tasks are named {double} ({files}); give the task files different \"name\"s")
    return chosen, every


def resolve_tasks(tasks: list[Task], every: bool, data_dir) -> tuple[list[Task], dict[str, str]]:
    """(tasks to run, {skipped task: reason}). "all" skips tasks whose files are missing; named tasks must exist."""
    skipped = {}
    for task in tasks:
        reason = missing_data(task, data_dir)
        if reason is not None:
            if not every:
                raise CaptError(f"task {task.name}: {reason}")
            skipped[task.name] = reason
    return [t for t in tasks if t.name not in skipped], skipped


def run_tasks(
    model_path: str,
    tasks: str | list[str],
    seeds: list[int],
    out: str,
    *,
    lengths: list[int] | None = None,
    resume: bool = False,
    progress: bool = True,
    **options,
) -> dict:
    """Zero-shot, then train and test the method on each task for each seed; write OUT/results.json and OUT/results.md.

    options: TrainConfig fields (data, epochs, lr, method, n, ...). Runs go to OUT/<task>/seed<k>.
    lengths: for prompt, deep-prompt and prefix, the prompt lengths to search: every length is
    trained with every seed (OUT/<task>/n<L>/seed<k>), the length that did best on validation is
    kept (choose_length: by the select rule the runs kept their checkpoints by) and its test results
    are reported; every run's time counts in the task's train_seconds. Method instance trains
    nothing: each task's test set is evaluated once with the zero capsule (OUT/<task>/instance.json),
    a zero-shot-like column.
    With resume, finished runs are reused and interrupted ones continued.
    """
    if not seeds:
        raise CaptError("no seeds to run")
    for what, values in (("seed", seeds), ("length", lengths or [])):
        if len(set(values)) != len(values):  # run twice, a run would also be counted twice
            raise CaptError(f"each {what} must be given once, got {list(values)}")
    started, commit = time.time(), code_version()  # the code that runs is the code of the start
    out = Path(out)
    given = options.get("data") or ("$CAPT_DATA" if os.environ.get("CAPT_DATA") else None)
    chosen, skipped, data_dir = tasks_with_data(tasks, options.get("data"))
    names = [t.name for t in chosen]
    spec = {t.name: t.spec for t in chosen}  # what TrainConfig and load_task take: the name or the task file
    options = dict(options, data=None if data_dir is None else str(data_dir))
    probe = TrainConfig(model=model_path, task=spec[names[0]], out=str(out), **options)  # checks the options once
    method = probe.method
    lengths = checked_lengths(lengths, method, options)
    model_config = read_config(model_path)
    if method == "linear-head" and model_config["model_type"] == "t5":
        raise CaptError("linear-head is for decoder-only models (Llama, Qwen2); T5 scores targets with its decoder")
    seeds = [] if method == "instance" else seeds  # instance trains nothing, so no seed changes anything
    device = distributed.rank_device(probe.device or default_device())
    lead = distributed.current().lead  # under torchrun: every rank runs every run, rank 0 writes the files
    if lead:
        for task in chosen:  # never inside the checkpoint or the data
            check_out(out, run_inputs(model_path, task, data_dir))
        make_directory(out)  # before the model is loaded
    # one `capt run` per output directory (rank 0 holds the lock); each run below locks its own too
    with lock_run(out) if lead else contextlib.nullcontext():
        model = frozen_base(model_path, probe, device)
        base_parameters = sum(p.numel() for p in model.parameters())
        tokenizer = load_tokenizer(model_path)
        zero = {name: zero_shot(model, tokenizer, spec[name], name, data_dir, probe, out, lead, progress)
                for name in names}  # before any method is attached
        done = {  # instance: the zero capsule on the test set, once
            name: zero_capsule(model, tokenizer, name, zero[name]["data"], probe, out, lead, progress)
            if method == "instance"
            else train_task(name, spec[name], seeds, lengths, out, dict(options, device=device), probe.n,
                            model_path=model_path, resume=resume, model=model, tokenizer=tokenizer, progress=progress)
            for name in names
        }
        trainable = {n: trainable_count(model_config, replace_task(probe, spec[n], done[n]["n"]).method_config)
                     for n in names}
        info = {"method": method, "lengths": lengths, "base_parameters": base_parameters, "trainable": trainable,
                "tasks": {t.name: t for t in chosen}}
        data = given or (None if data_dir is None else str(data_dir))  # as given, not this machine's path
        cue = not is_seq2seq(model) if probe.answer_cue is None else probe.answer_cue
        settings = dict(options, lr=options.get("lr") or default_lr(method, probe.step_scale),
                        step_scale=probe.step_scale, answer_cue=cue, data=data)
        results = summarize(model, model_path, names, skipped, seeds, {n: zero[n]["metrics"] for n in names}, done,
                            settings, info)
        for name in names:  # zero-shot's test gold NLL beside the runs' test_loss, and its rows for `capt compare`
            results["tasks"][name].update(zero_shot_loss=zero[name]["loss"], zero_shot_examples=zero[name]["examples"])
        results["data_files"] = data_files(data_dir, chosen)  # what it was, to the byte
        results["environment"] = environment(device, started, commit)
        if lead:
            write_json(out / "results.json", results)
            atomic_write(out / "results.md", lambda tmp: Path(tmp).write_text(results_markdown(results)))
        return results


def frozen_base(model_path: str, probe: TrainConfig, device):
    """The base model, with no method, every run of `capt run` attaches its own to. Under --fsdp it is sharded once
    for every run, each rank keeping its shard on the device."""
    model = load_model(model_path, probe.dtype, "cpu" if probe.fsdp else device)
    detach(model)
    if probe.fsdp:
        distributed.shard_model(model, device=device)
    return model


def tasks_with_data(tasks: str | list[str], data: str | None) -> tuple[list, dict, Path | None]:
    """The tasks to run, those skipped for want of data files (--tasks all) and the SuperGLUE directory (None when
    every task is a task file, which names its own data); no task to run is an error."""
    chosen, every = parse_tasks(tasks)
    data_dir = resolve_data_dir(data) if any(t.file is None for t in chosen) else None
    chosen, skipped = resolve_tasks(chosen, every, data_dir)
    if not chosen:
        raise CaptError(f"no task has its train and val files in {data_dir}: {'; '.join(skipped.values())}")
    return chosen, skipped, data_dir


def train_task(name: str, spec: str, seeds: list[int], lengths: list[int] | None, out: Path, options: dict,
               n: int | None, *, model_path: str, resume: bool, model, tokenizer, progress: bool) -> dict:
    """One task's runs, OUT/<task>/seed<k> (with lengths: every length with every seed, OUT/<task>/n<L>/seed<k>, and
    the length chosen on validation): {"runs", "n", "search"}. options: TrainConfig fields, the device included."""
    searched = {}
    for length in lengths or [n]:
        searched[length] = []
        for seed in seeds:
            run_dir = out / name / (f"n{length}" if lengths else "") / f"seed{seed}"
            config = TrainConfig(model=model_path, task=spec, out=str(run_dir), seed=seed, **dict(options, n=length))
            where = f"{name} n {length} seed {seed}" if lengths else f"{name} seed {seed}"
            searched[length].append(trained(config, resume, where, out, model=model, tokenizer=tokenizer,
                                            progress=progress))
    if not lengths:
        return {"runs": searched[n], "n": n, "search": None}
    return choose_length(searched, config.select)  # by the rule each run kept its checkpoint by


def checked_lengths(lengths: list[int] | None, method: str, options: dict) -> list[int] | None:
    """The prompt lengths to search, sorted, or None for no search; refused in one line where they cannot be."""
    if lengths is None:
        return None
    if method not in SEARCHABLE:
        raise CaptError(f"lengths are searched for {', '.join(SEARCHABLE)}, not for {method}")
    if options.get("n") is not None:
        raise CaptError("give the prompt length either as n or as lengths to search, not both")
    if not lengths or min(lengths) < 1:
        raise CaptError(f"lengths must be a non-empty list of lengths of at least 1, got {lengths}")
    return sorted(set(int(n) for n in lengths))


def zero_shot(model, tokenizer, spec: str, name: str, data_dir, probe: TrainConfig, out: Path, lead: bool,
              progress: bool) -> dict:
    """The frozen model (no method attached) on a task's test set; OUT/<task>/zero_shot.json (rank 0).
    Returns its metrics, loss and per-example records, and the encoded test set ("data") for the zero capsule."""
    examples = load_task(spec, data_dir, "test")
    data = encode_examples(examples, tokenizer, is_seq2seq(model), probe.max_length, probe.answer_cue)
    result = evaluate(model, tokenizer, data=data, batch_size=probe.eval_batch_size,
                      progress=progress and f"{name} test, zero-shot")
    record = {"task": name, "split": "test", "n": len(examples), "metrics": result["metrics"], "loss": result["loss"],
              "examples": result["examples"]}
    if lead:
        write_json(out / name / "zero_shot.json", record)
    return dict(record, data=data)


def zero_capsule(model, tokenizer, name: str, data, probe: TrainConfig, out: Path, lead: bool, progress: bool) -> dict:
    """Method instance: the capsule slot with its vectors at zero on a task's test set, once
    (OUT/<task>/instance.json, rank 0); the task's entry of run_tasks' results, one run without a seed."""
    attach(model, "instance")
    result = evaluate(model, tokenizer, data=data, batch_size=probe.eval_batch_size,
                      progress=progress and f"{name} test, zero capsule")
    detach(model)
    file = out / name / "instance.json"
    if lead:
        write_json(file, {"task": name, "split": "test", "n": result["n"], "method": "instance",
                          "metrics": result["metrics"], "loss": result["loss"], "trainable_parameters": 0,
                          "train_seconds": 0.0, "examples": result["examples"]})
    run = {"seed": None, "run": str(file), "test": result["metrics"], "test_loss": result["loss"], "steps": 0,
           "train_seconds": 0.0, "examples": result["examples"]}
    return {"runs": [run], "n": None, "search": None}


def trained(config: TrainConfig, resume: bool, where: str, out: Path, **loaded) -> dict:
    """One run of run_tasks (resumed where rank 0's directory holds a training state), as results.json records it;
    a diverged run is recorded as failed, an interrupted one stops run_tasks with how to continue."""
    run_dir = Path(config.out)
    again = resume and distributed.from_lead((run_dir / "state.pt").is_file)  # rank 0's directory decides
    try:
        result = train(config, resume=again, **loaded)
    except TrainingDiverged as e:
        return {"seed": config.seed, "run": str(run_dir), "failed": str(e), "train_seconds": logged_seconds(run_dir)}
    except Interrupted:
        raise Interrupted(f"interrupted during {where}; finished runs and the training state are kept in {out}; "
                          "continue with the same capt run command plus --resume") from None
    return {
        "seed": config.seed,
        "run": str(run_dir),
        "test": result["metrics"],
        "test_loss": result["loss"],
        "steps": result["steps"],
        "best_step": result["best"]["step"],
        "validation": result["best"]["validation"],
        "validation_loss": result["best"].get("loss"),
        "train_seconds": result.get("train_seconds"),
        "examples": result.get("examples"),  # each test row (a run finished before: None)
    }


def data_files(data_dir: Path | None, tasks: list[Task]) -> dict:
    """sha256 of each file a table was made from: SuperGLUE's train.jsonl and val.jsonl, a task file and its data
    files."""
    return {task.name: data_hashes(task, data_dir) for task in tasks}


def replace_task(config: TrainConfig, task: str, n: int | None) -> TrainConfig:
    """The same settings for another task and n (checked again)."""
    return TrainConfig(**dict(config.to_dict(), task=task, n=n))


def validation_mean(runs: list[dict]) -> float | None:
    heads = [r["validation"]["headline"] for r in runs if "validation" in r]
    return statistics.fmean(heads) if heads else None


def validation_loss_mean(runs: list[dict]) -> float | None:
    losses = [r["validation_loss"] for r in runs if r.get("validation_loss") is not None]
    return statistics.fmean(losses) if losses else None


def choose_length(searched: dict[int, list[dict]], select: str = "headline") -> dict:
    """The searched length that did best on validation over its seeds, by the rule its runs kept their checkpoints
    by (TrainConfig.select): "headline", the best mean validation headline (equal ones: the lower mean gold NLL);
    "loss", the lowest mean validation gold NLL. Ties after that go to the shorter length."""
    headline = {n: validation_mean(runs) for n, runs in searched.items()}
    loss = {n: validation_loss_mean(runs) for n, runs in searched.items()}
    if select == "loss":
        ranked = {n: (loss[n],) for n in searched if loss[n] is not None}
    else:  # a length without a recorded loss (runs from before capt kept it) still competes on its headline
        ranked = {n: (-headline[n], math.inf if loss[n] is None else loss[n]) for n in searched
                  if headline[n] is not None}
    chosen = min(sorted(ranked), key=ranked.get) if ranked else min(searched)  # min keeps the first (shorter) of equals
    search = {
        "by": "lowest mean validation gold NLL" if select == "loss" else "best mean validation headline",
        "select": select,
        "chosen": chosen,
        "lengths": [
            {"n": n, "validation": headline[n], "validation_loss": loss[n], "train_seconds": total_seconds(runs),
             "runs": runs}
            for n, runs in sorted(searched.items())
        ],
    }
    return {"runs": searched[chosen], "n": chosen, "search": search}


def total_seconds(runs: list[dict]) -> float:
    return round(sum(r.get("train_seconds") or 0.0 for r in runs), 3)


def code_version(here: Path = Path(__file__).resolve().parents[1]) -> str | None:
    """The git commit of the code in `here` (this package) with "+dirty" when files there have
    local changes (an edited README elsewhere does not count), or None outside a git checkout."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "."], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        return (commit + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):  # no git
        return None


def processor_name() -> str | None:
    """The CPU's model name (Linux /proc/cpuinfo, else platform.processor()): runs at a high learning rate can
    end differently on another processor's kernels, so a table records which one made it."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def environment(device, started: float, commit: str | None) -> dict:
    """How a table was made: the command, the code (commit read when the run started), the machine, the time."""
    device = torch.device(device)
    name = (
        torch.cuda.get_device_name(device)
        if device.type == "cuda"
        else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    )
    return {
        "command": " ".join(["capt"] + sys.argv[1:])
        if Path(sys.argv[0]).name in ("capt", "__main__.py")
        else " ".join(sys.argv),
        "commit": commit,
        "device": name,
        "processor": processor_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "world_size": distributed.current().size,  # processes under torchrun (1: a plain run)
        "backend": distributed.current().backend,
        "wall_seconds": round(time.time() - started, 1),
    }


def summarize(model, model_path, names, skipped, seeds, zero_shot, done, options, info) -> dict:
    """The results.json structure: the method and its size, per task zero-shot, per-seed tests, mean and
    sample std, training time (a length search's runs included) and the search itself."""
    tasks = {}
    base = info["base_parameters"]
    order = [n for n in TASKS if n in skipped or n in names] + [n for n in names if n not in TASKS]  # SuperGLUE's first
    for name in order:
        if name in skipped:
            tasks[name] = {"skipped": skipped[name]}
            continue
        task, runs = info["tasks"][name], done[name]["runs"]
        ok = [r for r in runs if "test" in r]
        metrics = {}
        for key in task.metrics:
            mean, std = mean_std([r["test"][key] for r in ok])
            metrics[key] = {"mean": mean, "std": std}
        if info["method"] == "instance":
            metrics = {k: dict(v, std=None) for k, v in metrics.items()}  # one evaluation, no spread
        search = done[name]["search"]
        every = [r for entry in search["lengths"] for r in entry["runs"]] if search else runs
        tasks[name] = {
            "metric": task.metrics[0],
            "zero_shot": zero_shot[name],
            "mean": metrics[task.metrics[0]]["mean"],
            "std": metrics[task.metrics[0]]["std"],
            "metrics": metrics,
            "n": done[name]["n"],
            "trainable_parameters": info["trainable"][name],
            "trainable_percent": 100 * info["trainable"][name] / base,
            "train_seconds": total_seconds(every),
            "runs": runs,
        }
        if task.file is not None:
            tasks[name]["task_file"] = task_file_record(task)
        if search:
            tasks[name]["search"] = search
    average = None
    if all(name in tasks and tasks[name].get("mean") is not None for name in TASKS):
        per_seed = []
        for seed in seeds:
            row = {
                name: next((r["test"] for r in tasks[name]["runs"] if r["seed"] == seed and "test" in r), None)
                for name in TASKS
            }
            if all(v is not None for v in row.values()):
                per_seed.append(paper_average(row))
        mean, std = mean_std(per_seed)
        average = {
            "zero_shot": paper_average({n: zero_shot[n] for n in TASKS}),
            "mean": paper_average({n: tasks[n]["mean"] for n in TASKS}),
            "std": std,
            "per_seed": per_seed,
        }
    counts, ns = set(info["trainable"].values()), {done[name]["n"] for name in names}
    count = counts.pop() if len(counts) == 1 else None
    settings = {k: v for k, v in options.items() if k not in ("device",)}
    return {
        "capt_version": __version__,
        "model": str(model_path),  # as given (a directory or a hub id); the config hash identifies it
        "model_type": model.source["model_type"],
        "model_config_sha256": model.source["config_sha256"],
        "model_weights_sha256": model.source.get("weights_sha256"),  # load.weights_fingerprint
        "method": info["method"],
        "n": ns.pop() if len(ns) == 1 else None,  # per task in tasks[...]["n"] when a search chose differently
        "lengths": info["lengths"],
        # None when tasks differ (linear-head: one class per candidate); per task in tasks
        "trainable_parameters": count,
        "trainable_percent": None if count is None else 100 * count / base,
        "base_parameters": base,
        "train_seconds": round(sum(t["train_seconds"] for t in tasks.values() if "train_seconds" in t), 3),
        "seeds": list(seeds),
        "settings": settings,
        "split": "test = the official SuperGLUE validation set (a task file: its test file); std = sample standard "
                 "deviation over seeds",
        "tasks": tasks,
        "average": average,
    }
