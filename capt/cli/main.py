"""The command line: `capt train`, `eval`, `predict`, `run`, `compare` and `attention` (also `python -m capt`);
the options are defined in capt/cli/args.py.

Every CaptError (and any OSError: a file that cannot be read or written) is printed as one
line, `capt: error: ...`, with exit status 1; usage errors exit with 2 (argparse's convention)
and Ctrl-C with 130 after saying how to continue.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

from .. import distributed
from .analysis import attention_report, curves, write_report
from .args import TRAINING_OPTIONS, build_parser, given_options
from ..checks import check_values
from ..errors import CaptError, CaptWarning
from ..evaluate import evaluate, evaluate_tasks, input_format
from .experiment import run_tasks
from ..hub import resolve_model
from ..load import atomic_write, check_device, load_method, load_model, read_method_meta
from ..baselines import set_pooled
from ..methods import attach, method_parameters, method_tensors
from ..plots import MISSING, compare_chart
from ..predict import labelled_metrics, predict, predict_tasks, write_predictions
from .report import compare, compare_markdown, read_results
from ..rundir import check_out, read_run_config, task_inputs
from ..tasks import DEFAULT_MAX_LEN, get_task, load_task, read_examples, read_mixed_examples
from ..tokenizer import load_tokenizer
from ..trainconfig import TrainConfig
from ..trainer import train

# ---------------------------------------------------------------------------------------------
# Commands


def start_ranks(args) -> distributed.World:
    """Join torchrun's process group when torchrun started this process (else one process). A
    command that succeeds leaves it with distributed.stop(together=True); a lost rank ends the process at
    once (distributed.abandon, in main); after any other error it is left at exit."""
    world = distributed.start(check_device(args.device), args.dist_timeout)
    if world.backend is not None:
        atexit.register(distributed.stop)
    return world


def cmd_train(args) -> int:
    world = start_ranks(args)
    options = given_options(args)
    model, task, seed = args.model, args.task, args.seed
    if args.resume:
        saved = distributed.from_lead(read_run_config, args.out)  # rank 0 reads the run directory
        # edited by hand: one line naming it
        check_values(saved, TrainConfig, Path(args.out) / "config.json", unbounded=("seed",))
        for key in TRAINING_OPTIONS:  # options left out take the run's values (except where and how to run)
            if key not in options and key not in ("device", "fsdp", "any_base") and saved.get(key) is not None:
                options[key] = saved[key]
        model = model or saved.get("model")
        task = task or saved.get("task")
        seed = saved.get("seed") if seed is None else seed
    if model is None or task is None:
        missing = " and ".join(n for n, v in (("--model", model), ("--task", task)) if v is None)
        raise CaptError(f"capt train needs {missing} (unless --resume finds them in the run directory)")
    if options.get("method") == "instance":  # before anything is read: there is nothing to train
        raise CaptError("instance trains nothing (its capsule vectors are held at zero): evaluate it with "
                        "capt eval --method instance --model DIR --task NAME")
    config = TrainConfig(model=model, task=task, out=args.out, seed=0 if seed is None else seed, **options)
    result = train(config, resume=args.resume)
    task = get_task(config.task)
    metrics = "  ".join(f"{k} {v:.2f}" for k, v in result["metrics"].items() if k != "headline")
    what = "capsules" if config.method == "capt" else f"{config.method} tensors"
    if world.lead:
        print(f"{task.name} test ({result['n']} examples), best {what} from step {result['best']['step']}: {metrics}")
        print(f"run directory: {args.out} (headline {task.metrics[0]} {result['metrics']['headline']:.2f})")
    distributed.stop(together=True)
    return 0


def method_directory(path: str) -> Path:
    """A saved method's directory: path itself, or a run directory's best/."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("capsules.json", "adapter.json")):
        if any((path / "best" / f).is_file() for f in ("capsules.json", "adapter.json")):
            return path / "best"  # a run directory: its best tensors
    return path


def is_run_directory(path: Path) -> bool:
    """A directory a training run made (its config.json names the run's settings), whatever it holds yet."""
    try:
        return "planned_steps" in read_run_config(path)
    except CaptError:
        return False


def run_settings(adapter: Path) -> dict:
    """The config.json of the run whose best/ is `adapter`, or {} when it is not a run's (read_run_config's checks)."""
    run = adapter.parent
    if adapter.name != "best" or not (run / "config.json").is_file():
        return {}
    saved = read_run_config(run)
    return saved if "model_config_sha256" in saved else {}  # a run's settings, not a checkpoint's config.json


def evaluation_settings(args) -> dict:
    """eval and predict: the checked method options, and the task, max_length and dtype (a run's by default)."""
    if args.adapter is None and args.method not in (None, "instance"):
        raise CaptError(f"capt {args.command} --method {args.method} needs --adapter DIR (the trained tensors: a run "
                        "directory or "
                        "its best/); only instance needs none")
    if args.adapter is not None and args.method == "instance":
        raise CaptError("--method instance has no tensors to load: leave out --adapter")
    device = distributed.rank_device(check_device(args.device))
    adapter = None if args.adapter is None else method_directory(args.adapter)
    saved = {} if adapter is None else run_settings(adapter)  # a run's tensors: used as the run tested them
    if adapter is not None and not saved and is_run_directory(adapter):
        raise CaptError(f"{adapter} is a run directory with no best/ yet: no validation evaluation has finished there; "
                        "wait for its first evaluation (or resume it), then pass it again")
    task = args.task or saved.get("task")
    if task is None:
        raise CaptError(f"capt {args.command} needs --task NAME or FILE.json (or --adapter RUN_DIR, whose task it "
                        "takes)")
    return {"device": device, "adapter": adapter, "task": get_task(task).spec,
            # None: as the tensors were trained (evaluate.input_format)
            "max_length": args.max_length or saved.get("max_length"),
            "dtype": args.dtype or saved.get("dtype") or "fp32"}


def evaluated_model(args, settings: dict):
    """(model, tokenizer, what it is in words, method or None): the base model with --adapter's tensors, the zero
    capsule (--method instance) or nothing (zero-shot)."""
    adapter = settings["adapter"]
    fsdp = getattr(args, "fsdp", False)
    # FSDP: each rank keeps its shard
    model = load_model(args.model, settings["dtype"], "cpu" if fsdp else settings["device"])
    if adapter is not None:
        config = load_method(model, adapter, any_base=args.any_base)
        for key, wanted in (("method", args.method), ("n", args.n)):
            if wanted is not None and getattr(config, key) != wanted:
                raise CaptError(f"{adapter} holds {config.method} with n {config.n}, not the {key} {wanted} asked for")
        what = f"capsules {adapter}" if config.method == "capt" else f"{config.method} {adapter}"
        method = config.method
    elif args.method == "instance":
        attach(model, "instance")
        what, method = "instance (the zero capsule, nothing trained)", "instance"
    else:
        what, method = "zero-shot (no capsules)", None
    if fsdp:  # after the method is attached: its tensors stay whole on every rank
        distributed.shard_model(model, keep=method_parameters(model).values(), device=settings["device"])
    return model, load_tokenizer(args.model), what, method


def same_on_every_rank(args, examples, model) -> None:
    """eval and predict under torchrun: every rank must score the same rows with the same options and tensors
    (each scores its share of the batches, and the rows are summed across the ranks)."""
    if distributed.current().size == 1:
        return
    paths = ("device", "dist_timeout", "model", "adapter", "data", "input", "out")  # a rank's own places
    rows = json.dumps([[ex.uid, ex.fields, ex.candidates, ex.label] for ex in examples])
    tensors = hashlib.sha256()
    for name, tensor in method_tensors(model).items():
        tensors.update(name.encode() + tensor.detach().float().cpu().numpy().tobytes())
    distributed.agree("settings or files", {
        **{k: v for k, v in vars(args).items() if k not in paths},
        "rows": hashlib.sha256(rows.encode()).hexdigest(),
        "tensors": tensors.hexdigest(),
        **{k: model.source.get(k) for k in ("config_sha256", "weights_sha256")},
    })


PREDICTION_KEYS = {"row", "label", "word", "scores", "probabilities"}  # every record capt predict writes


def check_predictions_out(out: str) -> None:
    """predict replaces --out: only an empty file or one capt predict wrote (its first line a prediction record),
    never a directory, another run's config.json or the user's own file."""
    path = Path(out)
    if path.is_dir():
        raise CaptError(f"--out {out} is a directory; give the file to write, e.g. {path / 'predictions.jsonl'}")
    if not path.is_file() or path.stat().st_size == 0:
        return
    try:
        with open(path, "rb") as f:
            first = json.loads(f.readline())
    except (OSError, ValueError):
        first = None
    if not (isinstance(first, dict) and PREDICTION_KEYS <= set(first)):
        raise CaptError(f"--out {out} exists and is not a predictions file capt predict wrote; it would be replaced: "
                        "give another path (or remove the file)")


def cut_rows(records: list[dict], max_length: int) -> str:
    """The line predict prints about rows shortened to the length budget ("" when none was)."""
    cut = sum("cut" in r for r in records)
    if not cut:
        return ""
    return (f"{cut} of {len(records)} rows did not fit max length {max_length} and lost words of "
            'one field (their "cut" says which and how many); raise --max-length to keep them whole\n')


def one_process(what: str) -> None:
    """Refuse a command that does not share its work among ranks when torchrun started several."""
    if distributed.launched_by_torchrun() and os.environ.get("WORLD_SIZE", "1") != "1":
        raise CaptError(f"{what} runs in one process; start it without torchrun (train, run, and eval or predict "
                        "of one task share their work among the ranks)")


def pooled_option(args) -> int:
    """--method pooled --n K: K (the adapter, if any, is then loaded as whatever it holds), else 0."""
    if args.method != "pooled":
        return 0
    if args.command != "eval" or args.n is None or (args.task and "," in args.task):
        raise CaptError("--method pooled is for capt eval of one task, with --n K (the number of pooled instance "
                        "tokens)")
    k, args.method, args.n = args.n, None, None
    return k


def cmd_eval(args) -> int:
    pooled = pooled_option(args)
    if (args.task and "," in args.task) or capsule_sets(args.adapter) is not None:  # several tasks, one pass
        return cmd_eval_tasks(args)
    world = start_ranks(args)
    settings = evaluation_settings(args)
    examples = load_task(settings["task"], args.data, args.split, args.seed)  # the likeliest mistake, before loading
    model, tokenizer, what, method = evaluated_model(args, settings)
    same_on_every_rank(args, examples, model)
    if pooled:  # training-free instance tokens in front of the (plain or deep-prompt) model's rows
        set_pooled(model, pooled)
        what, method = f"{pooled} pooled instance tokens, {what}", ("pooled" if method is None else f"pooled+{method}")
    adapter = settings["adapter"]
    result = evaluate(model, tokenizer, examples, batch_size=args.batch_size, max_length=settings["max_length"],
                      answer_cue=args.answer_cue, normalize=args.normalize,
                      progress=sys.stderr.isatty() and world.lead and f"{get_task(settings['task']).name} "
                                                                      f"{args.split}, {what}")
    distributed.stop(together=True)
    if not world.lead:  # every rank holds the result; rank 0 prints it
        return 0
    if args.json:
        print(
            json.dumps(
                {
                    "task": result["task"],
                    "split": args.split,
                    "n": result["n"],
                    "method": method,
                    "pooled": pooled,
                    "adapter": None if adapter is None else str(adapter),
                    "metrics": result["metrics"],
                    "loss": result["loss"],
                    "examples": result["examples"],
                }
            )
        )
    else:
        print(score_line(result, args.split, what))
    return 0


def score_line(result: dict, split: str, what: str) -> str:
    """capt eval's line: the task, split and rows, what was scored, every metric and the gold NLL."""
    metrics = "  ".join(f"{k} {v:.2f}" for k, v in result["metrics"].items() if k != "headline")
    return f"{result['task']} {split} ({result['n']} examples), {what}: {metrics}  gold NLL {result['loss']:.3f}"


def cmd_predict(args) -> int:
    sets = capsule_sets(args.adapter)
    if sets is not None:  # several capsule sets: each input row names its own in a "task" field
        return cmd_predict_tasks(args, sets)
    world = start_ranks(args)  # under torchrun the ranks share the batches; rank 0 writes
    settings = evaluation_settings(args)
    examples = read_examples(settings["task"], args.input)  # checked before the model is loaded
    check_out(args.out, read_inputs(args, settings["task"], [settings["adapter"]]))
    check_predictions_out(args.out)
    model, tokenizer, what, _ = evaluated_model(args, settings)
    same_on_every_rank(args, examples, model)
    records = predict(model, tokenizer, examples, batch_size=args.batch_size, max_length=settings["max_length"],
                      answer_cue=args.answer_cue, normalize=args.normalize,
                      progress=world.lead and f"{Path(args.input).name}, {what}")
    distributed.stop(together=True)
    if not world.lead:
        return 0
    write_predictions(args.out, records)
    task = get_task(settings["task"])
    counts = {word: sum(r["word"] == word for r in records) for word in task.candidates}
    print(f"{task.name}: {len(records)} predictions, {what}: " + ", ".join(f"{w} {c}" for w, c in counts.items()))
    print(cut_rows(records, input_format(model, settings["max_length"])[0]), end="")
    metrics = labelled_metrics(examples, records)
    if metrics is not None:
        print("every row has a label: " + "  ".join(f"{k} {v:.2f}" for k, v in metrics.items() if k != "headline"))
    print(f"written: {args.out}")
    return 0


def cmd_predict_tasks(args, sets: dict[str, str]) -> int:
    """capt predict --capsules cb=DIR,rte=DIR: rows of several tasks in one file, each with a "task" field."""
    one_process("capt predict with several capsule sets")
    if args.task is not None and set(t.strip() for t in args.task.split(",")) != set(sets):
        raise CaptError(f"--task {args.task} and --capsules {', '.join(sets)} name different tasks; --task may be left "
                        "out")
    if args.method not in (None, "capt") or args.n is not None:
        raise CaptError("several capsule sets take --capsules TASK=DIR,... alone (no --method other than capt, no --n)")
    device = check_device(args.device)
    directories = {name: method_directory(d) for name, d in sets.items()}
    runs = {name: run_settings(d) for name, d in directories.items()}
    dtypes = {run["dtype"] for run in runs.values() if run.get("dtype")}
    if args.dtype is None and len(dtypes) > 1:
        raise CaptError("the runs used different dtypes: choose one with --dtype")
    examples = read_mixed_examples(args.input, list(sets))  # checked before the model is loaded
    check_out(args.out, read_inputs(args, None, list(directories.values())))
    check_predictions_out(args.out)
    model = load_model(
        args.model, args.dtype or next(iter(dtypes), "fp32"), device, capsules=directories, any_base=args.any_base
    )
    max_length = args.max_length or max(saved_inputs(d).get("max_length") or run.get("max_length") or DEFAULT_MAX_LEN
                                        for d, run in zip(directories.values(), runs.values()))
    records = predict_tasks(
        model,
        load_tokenizer(args.model),
        examples,
        batch_size=args.batch_size,
        max_length=max_length,
        answer_cue=answer_cues(args, directories),
        normalize=args.normalize,
        progress=True,
    )
    write_predictions(args.out, records)
    counts = ", ".join(f"{name} {sum(r['task'] == name for r in records)}" for name in sets)
    print(f"{len(records)} predictions, each row with its task's capsules ({counts})")
    print(cut_rows(records, max_length), end="")
    print(f"written: {args.out}")
    return 0


def read_inputs(args, task: str | None, adapters: list) -> list[tuple[str, object]]:
    """What predict and attention read, for rundir.check_out: the model, the adapters, --input, and the task's
    files (a task file and its data; attention also a SuperGLUE task's data directory, which it reads)."""
    inputs = [("the model directory", resolve_model(args.model)), ("the --input file", getattr(args, "input", None))]
    inputs += [("the adapter directory", directory) for directory in adapters]
    # its config.json is read
    inputs += [("the run directory", d.parent) for d in adapters if d is not None and run_settings(d)]
    if task is not None and (get_task(task).file is not None or args.command == "attention"):
        inputs += task_inputs(get_task(task), getattr(args, "data", None))
    return inputs


def saved_inputs(directory) -> dict:
    """The input format a saved method was trained with (capsules.json's "inputs"; {} without a directory)."""
    return {} if directory is None else read_method_meta(directory)[0].inputs or {}


def answer_cues(args, directories: dict) -> bool | dict[str, bool] | None:
    """Several capsule sets: --answer-cue, else each set's own (None: the family's default, zero-shot)."""
    if args.answer_cue is not None or not directories:
        return args.answer_cue
    return {name: saved_inputs(d).get("answer_cue") for name, d in directories.items()}


def capsule_sets(text: str | None) -> dict[str, str] | None:
    """--capsules TASK=DIR,TASK=DIR -> {task: DIR}; None for a single directory (or none)."""
    if text is None or "=" not in text or Path(text).is_dir():
        return None
    sets = {}
    for part in text.split(","):
        name, _, directory = part.partition("=")
        name = name.strip()
        if not name or not directory:
            raise CaptError(f"--capsules {text!r}: write one TASK=DIR per task, separated by commas "
                            "(cb=runs/cb,rte=runs/rte)")
        if name in sets:
            raise CaptError(f"--capsules names {name} twice")
        sets[name] = directory
    return sets


def cmd_eval_tasks(args) -> int:
    """capt eval --task cb,rte,copa [--capsules cb=DIR,rte=DIR,copa=DIR]: every task in one pass, batches
    mixed across tasks, each row served by its task's capsule set; one line (or JSON object) per task,
    as separate `capt eval` runs print them."""
    one_process("capt eval of several tasks")
    names = [t.strip() for t in args.task.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise CaptError(f"--task {args.task!r}: name each task once, separated by commas")
    sets = capsule_sets(args.adapter)
    if args.adapter is not None and sets is None:
        raise CaptError(f"several tasks take one capsule set each: --capsules {','.join(f'{t}=DIR' for t in names)}")
    if sets is not None and set(sets) != set(names):
        raise CaptError(f"--capsules names {', '.join(sets)} but --task names {', '.join(names)}: give one capsule set "
                        "per task")
    if (
        args.method not in (None, "capt", "instance")
        or (args.method == "instance" and sets is not None)
        or args.n is not None
    ):
        raise CaptError("several tasks in one pass take capsules (--capsules TASK=DIR,...), --method instance or "
                        "nothing (zero-shot)")
    if args.method == "capt" and sets is None:
        raise CaptError("capt eval --method capt needs --capsules TASK=DIR,... (the trained capsules of each task)")
    device = check_device(args.device)
    directories = {} if sets is None else {name: method_directory(sets[name]) for name in names}
    runs = {name: run_settings(directory) for name, directory in directories.items()}
    max_length = {
        name: args.max_length
        or saved_inputs(directories.get(name)).get("max_length")
        or runs.get(name, {}).get("max_length")
        or DEFAULT_MAX_LEN
        for name in names
    }
    dtypes = {name: run["dtype"] for name, run in runs.items() if run.get("dtype")}
    if args.dtype is None and len(set(dtypes.values())) > 1:
        raise CaptError(f"the runs used different dtypes ({', '.join(f'{n} {d}' for n, d in dtypes.items())}): choose "
                        "one with --dtype")
    dtype = args.dtype or next(iter(dtypes.values()), "fp32")
    examples = {name: load_task(name, args.data, args.split, args.seed) for name in names}
    model = load_model(
        args.model,
        dtype,
        device,
        capsules={name: directories[name] for name in names} if sets else None,
        any_base=args.any_base,
    )
    if args.method == "instance":
        attach(model, "instance")
    results = evaluate_tasks(
        model,
        load_tokenizer(args.model),
        examples,
        batch_size=args.batch_size,
        max_length=max_length,
        answer_cue=answer_cues(args, directories),
        normalize=args.normalize,
        progress=sys.stderr.isatty(),
    )
    for name in names:
        result = results[name]
        if sets is not None:
            what, method, adapter = f"capsules {directories[name]}", "capt", str(directories[name])
        elif args.method == "instance":
            what, method, adapter = "instance (the zero capsule, nothing trained)", "instance", None
        else:
            what, method, adapter = "zero-shot (no capsules)", None, None
        if args.json:
            print(json.dumps({"task": result["task"], "split": args.split, "n": result["n"], "method": method,
                              "adapter": adapter, "metrics": result["metrics"], "loss": result["loss"]}))
        else:
            print(score_line(result, args.split, what))
    return 0


def cmd_run(args) -> int:
    world = start_ranks(args)
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    run_tasks(
        args.model,
        args.tasks,
        seeds,
        args.out,
        lengths=args.lengths,
        resume=args.resume,
        progress=world.lead,
        **given_options(args),
    )
    distributed.stop(together=True)
    if not world.lead:
        return 0
    print((Path(args.out) / "results.md").read_text(), end="")
    print(f"written: {Path(args.out) / 'results.md'} and results.json")
    return 0


def cmd_compare(args) -> int:
    one_process("capt compare")
    table = compare([read_results(path) for path in args.runs])
    text = compare_markdown(table)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write(out / "compare.json", lambda tmp: Path(tmp).write_text(json.dumps(table, indent=2) + "\n"))
        atomic_write(out / "compare.md", lambda tmp: Path(tmp).write_text(text))
        chart = compare_chart(table, out)
        print(f"written: {out / 'compare.md'}, compare.json" + (" and compare.png" if chart else ""))
        if chart is None:
            print(f"compare.png skipped: {MISSING}", file=sys.stderr)
    return 0


def cmd_attention(args) -> int:
    one_process("capt attention")
    out = Path(args.out)
    if args.curves:
        chart = curves(args.curves, out)
        print(f"written: {out / 'curves.png'}" if chart else f"curves.png skipped: {MISSING}")
        return 0
    if args.model is None:
        raise CaptError("capt attention needs --model DIR (or --curves A.json B.json ... to draw saved results)")
    settings = evaluation_settings(args)
    examples = load_task(settings["task"], args.data, args.split, args.seed)[:args.limit]
    check_out(out, read_inputs(args, settings["task"], [settings["adapter"]]))
    model, tokenizer, what, method = evaluated_model(args, settings)
    report = attention_report(
        model,
        tokenizer,
        examples,
        settings["task"],
        args.split,
        args.data,
        settings["max_length"],
        what,
        method,
        args.batch_size,
        args.layers,
        args.examples,
        args.answer_cue,
    )
    written = write_report(report, out)
    print(f"{report['task']} {args.split} ({report['n']} examples), {what}: {report['seconds']} s; written: "
          + ", ".join(str(p) for p in written))
    if len(written) == 1:
        print(f"PNGs skipped: {MISSING}", file=sys.stderr)
    return 0


def show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A CaptWarning as one line, `capt: warning: ...`; other warnings as Python shows them."""
    if issubclass(category, CaptWarning):
        print(f"capt: warning: {message}".replace("\n", " "), file=sys.stderr)
    else:
        sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    command = {"train": cmd_train, "eval": cmd_eval, "predict": cmd_predict, "run": cmd_run, "compare": cmd_compare,
               "attention": cmd_attention}[args.command]
    try:
        with warnings.catch_warnings():  # restores the way warnings are shown when the command ends
            warnings.simplefilter("always", CaptWarning)
            warnings.showwarning = show_warning
            return command(args)
    # After an error under torchrun the process ends at once with its status (distributed.abandon): tearing down a
    # gloo group whose peers are gone, or going, can abort it (SIGABRT) and turn the status into -6.
    except (CaptError, OSError) as e:
        print(f"capt: error: {e}".replace("\n", " "), file=sys.stderr)
        distributed.abandon(1)
        return 1
    except KeyboardInterrupt as e:
        print(f"capt: {e}" if str(e) else "capt: interrupted", file=sys.stderr)
        distributed.abandon(130)
        return 130
    except Exception as e:  # the last resort: no known bad input comes here (each has its own message)
        if os.environ.get("CAPT_DEBUG"):
            raise
        print(f"capt: internal error: {type(e).__name__}: {e}".replace("\n", " ")[:400]
              + " (set CAPT_DEBUG=1 to see the traceback)", file=sys.stderr)
        distributed.abandon(1)
        return 1
