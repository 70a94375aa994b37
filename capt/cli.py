"""The command line: `capt train`, `capt eval`, `capt predict`, `capt run`, `capt compare`, `capt attention` (also `python -m capt`).

Every CaptError (and any OSError: a file that cannot be read or written) is printed as one
line, `capt: error: ...`, with exit status 1; usage errors exit with 2 (argparse's convention)
and Ctrl-C with 130 after saying how to continue.
"""

from __future__ import annotations

import argparse
import atexit
import json
import math
import os
import sys
import warnings
from pathlib import Path

from . import __version__, distributed
from .analysis import attention_report, curves, write_report
from .checks import check_values
from .errors import CaptError, CaptWarning
from .evaluate import evaluate, evaluate_tasks
from .experiment import run_tasks
from .hub import resolve_model
from .load import atomic_write, load_method, load_model, read_method_meta
from .methods import METHODS, attach, method_tensors, set_pooled
from .plots import MISSING, compare_chart
from .predict import labelled_metrics, predict, predict_tasks, write_predictions
from .report import compare, compare_markdown, read_results
from .rundir import check_out, read_run_config, task_inputs
from .tasks import DEFAULT_MAX_LEN, TASKS, get_task, load_task, read_examples, read_mixed_examples
from .tokenizer import load_tokenizer
from .trainer import TrainConfig, check_device, train

DESCRIPTION = ("Capsule Prompt-Tuning: train one vector per layer on a frozen T5, Llama or Qwen2 for SuperGLUE tasks; "
               "the baselines (prompt, deep-prompt, prefix, linear-head, instance) through the same commands.")
METHOD_HELP = ("capt (default): one capsule vector per block; prompt: n vectors before the input; deep-prompt: n vectors per block; "
               "prefix: n keys/values per layer (P-Tuning v2); linear-head: a classifier on the prompt's last hidden state "
               "(Llama / Qwen2); instance: the zero capsule, nothing trained")
DATA_HELP = "SuperGLUE directory with <Task>/train.jsonl and <Task>/val.jsonl (default: env CAPT_DATA, then ./data/superglue)"
DEVICE_HELP = "torch device, e.g. cuda, cuda:1, cpu (default: cuda if available, else cpu)"
MODEL_HELP = ("checkpoint directory (config.json, safetensors, tokenizer), or a Hugging Face hub id ORG/NAME "
              "(from the hub's local cache, downloaded when missing; needs pip install 'capt[hub]')")
TASK_HELP = "a SuperGLUE task ({}) or a task file FILE.json describing your own JSONL data (docs/your-data.md)"
EVAL_CUE_HELP = ("end SuperGLUE inputs with ' answer:' (default: as the --adapter's tensors were trained, else yes for "
                 "Llama / Qwen2 and no for T5)")
# torchrun's own parser reads --n as an abbreviation of its options, even after the script's name
VECTORS_NOTE = "under torchrun write --vectors N"


def _number(kind, minimum, inclusive: bool):
    """An argparse type: `kind` (int or float) at least `minimum` (or above it when not inclusive)."""
    noun = "an integer" if kind is int else "a number"
    bound = f"at least {minimum}" if inclusive else f"above {minimum}"

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {noun}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


positive_int = _number(int, 1, inclusive=True)
non_negative_int = _number(int, 0, inclusive=True)
positive_float = _number(float, 0, inclusive=False)


def seed(text: str) -> int:
    value = non_negative_int(text)
    if value >= 2**63:
        raise argparse.ArgumentTypeError(f"must be below 2**63, got {value}")
    return value
non_negative_float = _number(float, 0, inclusive=True)


MAX_SEEDS = 10_000  # capt run --seeds: every seed is a training run


def seed_count(text: str) -> int:
    value = positive_int(text)
    if value > MAX_SEEDS:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_SEEDS:,} (each seed is a training run), got {value}")
    return value


def blocks(text: str):
    if text in ("all", "odd", "first-half", "latter-half"):
        return text
    try:
        return [int(i) for i in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: use all, odd, first-half, latter-half or indices such as 0,2,4") from None


def int_list(text: str) -> list[int]:
    try:
        values = [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("the list is empty")
    return values


def seed_list(text: str) -> list[int]:
    return [seed(str(v)) for v in int_list(text)]


# Training options and their CLI spelling; None as the argparse default means "not given", so
# that a resumed run can take the run's own settings for the options left out.
TRAINING_OPTIONS = ("epochs", "batch_size", "grad_accum", "lr", "weight_decay", "warmup", "max_steps", "dtype",
                    "max_length", "patience", "eval_every", "eval_batch_size", "device", "integration", "blocks", "data",
                    "method", "n", "fsdp", "step_scale", "answer_cue", "any_base")
ANY_BASE_HELP = ("use the saved tensors on a base model whose config.json or weights differ from the one they were trained on "
                 "(the sizes must match): on purpose, with a warning naming the difference (default: refused)")


def add_method_options(p: argparse.ArgumentParser, default_help: str = "capt") -> None:
    g = p.add_argument_group("method")
    g.add_argument("--method", choices=list(METHODS), help=f"{METHOD_HELP} (default {default_help})")
    defaults = ", ".join(f"{k} {m.default_n}" for k, m in METHODS.items() if m.default_n is not None)
    g.add_argument("--n", "--vectors", dest="n", type=positive_int, metavar="N",
                   help=f"vectors per place for prompt, deep-prompt, prefix (default: {defaults}); {VECTORS_NOTE}")


def add_training_options(p: argparse.ArgumentParser) -> None:
    d = {f: getattr(TrainConfig, f, None) for f in TRAINING_OPTIONS}
    g = p.add_argument_group("training")
    g.add_argument("--data", metavar="DIR", help=DATA_HELP)
    g.add_argument("--epochs", type=positive_int, metavar="N", help=f"most epochs (default {d['epochs']})")
    g.add_argument("--batch-size", type=positive_int, metavar="N", help=f"examples per forward pass (default {d['batch_size']})")
    g.add_argument("--grad-accum", type=positive_int, metavar="N",
                   help=f"forward passes per optimizer step (default {d['grad_accum']}); a step sees batch-size x grad-accum examples")
    lrs = ", ".join(f"{k} {m.lr:g}" for k, m in METHODS.items() if m.lr is not None)
    scaled = ", ".join(f"{k} {m.scaled_lr:g}" for k, m in METHODS.items() if m.scaled_lr is not None)
    g.add_argument("--lr", type=positive_float, metavar="X",
                   help=f"AdamW peak learning rate; under the step scale r, the step relative to each block's scale "
                        f"(default: {scaled}; with one rate: {lrs})")
    g.add_argument("--step-scale", choices=["rms", "none"],
                   help="rms (default for capt and deep-prompt): block l's rate is lr x the RMS of its mean-pooled input "
                        "(prefix: of the layer's own keys, values), measured before the first step; none (default for the "
                        "rest, and the only one for prompt and linear-head): one rate for every tensor, the paper-plain form")
    g.add_argument("--answer-cue", action=argparse.BooleanOptionalAction,
                   help="end SuperGLUE inputs with ' answer:' (default: yes for Llama / Qwen2, no for T5)")
    g.add_argument("--weight-decay", type=non_negative_float, metavar="X", help=f"AdamW weight decay (default {d['weight_decay']:g})")
    g.add_argument("--warmup", type=non_negative_float, metavar="X",
                   help=f"linear warm-up: a fraction of the planned steps if below 1, else a whole number of steps, at most the planned "
                        f"steps (default {d['warmup']:g}); then linear decay to 0")
    g.add_argument("--max-steps", type=non_negative_int, metavar="N",
                   help="train for at most N optimizer steps; the warm-up and decay are planned over them "
                        "(over min(N, epochs x steps per epoch)); a run keeps its value on --resume")
    g.add_argument("--dtype", choices=["fp32", "bf16"], help="backbone weights (default fp32); the trained tensors and optimizer state are always fp32")
    g.add_argument("--max-length", type=positive_int, metavar="N", help=f"input token budget; longer inputs lose words of their long field (default {DEFAULT_MAX_LEN})")
    g.add_argument("--patience", type=positive_int, metavar="N",
                   help=f"stop after N validation evaluations without improvement (default {d['patience']})")
    g.add_argument("--eval-every", type=positive_int, metavar="N", help="also evaluate on validation every N steps (default: at epoch ends only)")
    g.add_argument("--eval-batch-size", type=positive_int, metavar="N", help=f"examples per evaluation batch (default {d['eval_batch_size']})")
    g.add_argument("--device", metavar="D", help=DEVICE_HELP)
    g.add_argument("--integration", choices=["add", "prepend"], help="capsule integration (default add; capt only)")
    g.add_argument("--blocks", type=blocks, metavar="SET", help="blocks with a capsule: all, odd, first-half, latter-half or 0,2,4 (default all; capt only)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its state.pt; options left out take the run's values")
    g.add_argument("--any-base", action="store_true", default=None,
                   help="with --resume: continue on weights other than the run's (the same config.json), on purpose")
    add_distributed_options(p)


def add_distributed_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("more than one process (torchrun --nproc_per_node N -m capt ...)")
    g.add_argument("--fsdp", action="store_true", default=None,
                   help="shard the frozen base across the ranks with FSDP (the trained tensors stay whole on every rank)")
    g.add_argument("--dist-timeout", type=positive_float, default=distributed.DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds a rank waits for the others before it gives up (default {distributed.DEFAULT_TIMEOUT:g})")


def add_evaluated_model_options(p: argparse.ArgumentParser, task_help: str) -> None:
    """eval and predict: the model, the method's tensors and the task."""
    p.add_argument("--model", metavar="DIR", required=True, help=MODEL_HELP)
    p.add_argument("--adapter", "--capsules", dest="adapter", metavar="DIR",
                   help="a saved method: capsules.safetensors + capsules.json (capt) or adapter.safetensors + adapter.json "
                        "(the other methods), or a run directory (its best/); --capsules is the same option. With a run "
                        "directory or its best/, --task, --max-length and --dtype default to the run's (its config.json). "
                        "Several tasks (eval: --task cb,rte; predict: rows with a \"task\" field): TASK=DIR,TASK=DIR,... "
                        "one capsule set per task, all on one model")
    p.add_argument("--method", choices=list(METHODS) + ["pooled"], help="instance: the zero capsule (no directory needed); "
                   "pooled (capt eval): --n K training-free instance tokens, chunk means of the prompt's embeddings, in front "
                   "(with --adapter: of a deep-prompt model's rows); else, with --adapter, the method the directory must hold")
    p.add_argument("--n", "--vectors", dest="n", type=positive_int, metavar="N",
                   help=f"with --adapter: the n the directory must hold (pooled: the number of instance tokens); {VECTORS_NOTE}")
    p.add_argument("--task", metavar="NAME", help=f"{task_help}; may be left out with --adapter RUN_DIR. capt eval: several, "
                   "comma-separated (cb,rte,copa), are evaluated in one pass in batches that mix the tasks")
    p.add_argument("--any-base", action="store_true", help=ANY_BASE_HELP)


def add_scoring_options(p: argparse.ArgumentParser) -> None:
    """eval and predict: batch, length budget, dtype, device, normalization."""
    p.add_argument("--batch-size", type=positive_int, default=32, metavar="N", help="examples per batch (default 32)")
    p.add_argument("--max-length", type=positive_int, metavar="N",
                   help=f"input token budget (default: the run's with --adapter RUN_DIR or RUN_DIR/best, else {DEFAULT_MAX_LEN})")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="backbone weights (default: the run's with --adapter RUN_DIR or RUN_DIR/best, else fp32)")
    p.add_argument("--device", metavar="D", help=DEVICE_HELP)
    p.add_argument("--normalize", action="store_true", help="rank by mean log-prob per target token instead of the sum")
    p.add_argument("--answer-cue", action=argparse.BooleanOptionalAction, help=EVAL_CUE_HELP)


def given_options(args) -> dict:
    return {k: getattr(args, k) for k in TRAINING_OPTIONS if getattr(args, k, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capt", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"capt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{train,eval,predict,run,compare,attention}")
    tasks = ", ".join(TASKS)
    task_help = TASK_HELP.format(tasks)

    p = sub.add_parser("train", help="train capsules (or another method) for one task and seed", description=(
        "Train capsules (or --method's tensors) on a frozen model for one SuperGLUE task, early-stopped on the validation split "
        "(10% of the official train set), then test the best tensors on the official validation set. "
        "The run directory gets config.json, metrics.jsonl, best/, state.pt, test.json and curves.png (with matplotlib). "
        "--method instance trains nothing: evaluate it with capt eval --method instance."))
    p.add_argument("--model", metavar="DIR", help=f"{MODEL_HELP}; may be left out with --resume")
    p.add_argument("--task", metavar="NAME", help=f"{task_help}; may be left out with --resume")
    p.add_argument("--out", metavar="DIR", required=True, help="run directory")
    p.add_argument("--seed", type=seed, metavar="N", help="seed of the split, the data order and the generators (default 0)")
    add_method_options(p)
    add_training_options(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="rank-classify a split, zero-shot, with capsules or another method", description=(
        "Score every candidate target of each example by its log-likelihood and print the task's metrics "
        "(linear-head: the argmax of its classifier). Without --adapter (or --capsules) the base model is evaluated "
        "zero-shot; --method instance evaluates the zero capsule."))
    add_evaluated_model_options(p, task_help)
    p.add_argument("--data", metavar="DIR", help=DATA_HELP)
    p.add_argument("--split", choices=["test", "validation", "train"], default="test",
                   help="test = official val set (default); validation / train = the seeded 10%% / 90%% of the official train set")
    p.add_argument("--seed", type=seed, default=0, metavar="N", help="seed of the train / validation split (default 0)")
    add_scoring_options(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_distributed_options(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("predict", help="label the rows of a JSONL file, with each label's score", description=(
        "Rank-classify every row of --input (rows in the task's format; labels not needed) zero-shot, with capsules or "
        "another method, exactly as capt eval ranks them, and write one JSON line per row to --out: the predicted label, "
        "its label word, each label word's summed log-likelihood (scores) and their softmax (probabilities); "
        "gold when the row has a label. A progress bar goes to stderr."))
    add_evaluated_model_options(p, task_help)
    p.add_argument("--input", metavar="FILE", required=True, help="JSONL rows to label, in the task's format")
    p.add_argument("--out", metavar="FILE", default="runs/predictions.jsonl",
                   help="JSONL file to write, replaced atomically (default runs/predictions.jsonl); never the --input")
    add_scoring_options(p)
    p.set_defaults(func=cmd_predict)

    p = sub.add_parser("run", help="train and test tasks x seeds; write the results table", description=(
        "For each task: zero-shot on the test set, then train and test one run per seed (OUT/<task>/seed<k>) with --method. "
        "Writes OUT/results.md and OUT/results.json: the method, its trainable parameters, mean and sample std of each "
        "task's headline metric, the zero-shot column, the training time, and the six-task average when all six tasks ran. "
        "With --tasks all, tasks whose data files are missing are listed as skipped; a named task with missing data is an error. "
        "--method instance trains nothing: one test evaluation per task with the zero capsule."))
    p.add_argument("--model", metavar="DIR", required=True, help=MODEL_HELP)
    p.add_argument("--tasks", "--task", dest="tasks", metavar="LIST", default="all",
                   help=f"all (default: SuperGLUE's six) or a comma-separated list of: {tasks}, task files FILE.json")
    p.add_argument("--seeds", type=seed_count, default=3, metavar="N", help=f"run seeds 0 .. N-1 (default 3, at most {MAX_SEEDS:,})")
    p.add_argument("--seed-list", type=seed_list, metavar="A,B,...", help="run exactly these seeds (overrides --seeds)")
    p.add_argument("--out", metavar="DIR", required=True, help="output directory")
    add_method_options(p)
    p.add_argument("--lengths", type=int_list, metavar="A,B,...",
                   help="prompt, deep-prompt, prefix: search these n, every one with every seed (OUT/<task>/n<N>/seed<k>); "
                        "the n with the best mean validation headline is reported, and the search's time counts as training time")
    add_training_options(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser("compare", help="one table from several capt run outputs (one per method)", description=(
        "Put several `capt run` outputs on the same base model side by side: each method's score per task, trainable "
        "parameters, training time and time relative to the CaPT run. Prints Markdown; --out also writes compare.md "
        "and compare.json there, and compare.png, a bar chart of the scores with their standard deviations (with matplotlib)."))
    p.add_argument("runs", nargs="+", metavar="OUT", help="capt run output directories (or their results.json)")
    p.add_argument("--out", metavar="DIR", help="write compare.md, compare.json and compare.png in DIR")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("attention", help="where attention goes: mass on the capsule slot, the first token, the rest", description=(
        "Run a split through the explicit attention path (the weights written out; outputs equal SDPA's) and write "
        "OUT/attention.json (per layer x head: the mean mass real tokens put on the capsule slot(s), on other methods' "
        "front rows, on the first token and on the rest; T5: encoder and cross-attention, and the tokens the slot attends to) "
        "with heatmap.png and maps.png. --curves A.json B.json ... --out DIR: only draw their per-layer curves (curves.png)."))
    p.add_argument("--model", metavar="DIR", help=MODEL_HELP)
    p.add_argument("--adapter", "--capsules", dest="adapter", metavar="DIR", help="a saved method or a run directory (its best/)")
    p.add_argument("--method", choices=list(METHODS), help="instance: the zero capsule (no directory needed); with --adapter, "
                   "the method the directory must hold")
    p.add_argument("--n", "--vectors", dest="n", type=positive_int, metavar="N",
                   help=f"with --adapter: the n the directory must hold (pooled: the number of instance tokens); {VECTORS_NOTE}")
    p.add_argument("--task", metavar="NAME", help=f"{task_help}; may be left out with --adapter RUN_DIR")
    p.add_argument("--any-base", action="store_true", help=ANY_BASE_HELP)
    p.add_argument("--data", metavar="DIR", help=DATA_HELP)
    p.add_argument("--split", choices=["validation", "test"], default="validation",
                   help="validation (default: the seeded 10%% of the official train set) or test (the official val set)")
    p.add_argument("--seed", type=seed, default=0, metavar="N", help="seed of the train / validation split (default 0)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="the first N examples of the split only")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="examples per batch (default 8)")
    p.add_argument("--max-length", type=positive_int, metavar="N",
                   help=f"input token budget (default: the run's with --adapter RUN_DIR or RUN_DIR/best, else {DEFAULT_MAX_LEN})")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="backbone weights (default: the run's, else fp32)")
    p.add_argument("--device", metavar="D", help=DEVICE_HELP)
    p.add_argument("--answer-cue", action=argparse.BooleanOptionalAction, help=EVAL_CUE_HELP)
    p.add_argument("--layers", type=int_list, metavar="A,B,...", help="layers of the example maps (default: first, middle, last)")
    p.add_argument("--examples", type=int_list, metavar="I,J,...",
                   help="0-based indices (after --limit) of the examples whose maps are kept (default 0; maps.png draws up to 4)")
    p.add_argument("--curves", nargs="+", metavar="JSON", help="attention.json files (or their directories) to draw together")
    p.add_argument("--out", metavar="DIR", required=True, help="output directory")
    p.set_defaults(func=cmd_attention)
    return parser


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
        check_values(saved, TrainConfig, Path(args.out) / "config.json", unbounded=("seed",))  # edited by hand: one line naming it
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
        raise CaptError(f"capt {args.command} --method {args.method} needs --adapter DIR (the trained tensors: a run directory or "
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
        raise CaptError(f"capt {args.command} needs --task NAME or FILE.json (or --adapter RUN_DIR, whose task it takes)")
    return {"device": device, "adapter": adapter, "task": get_task(task).spec,
            "max_length": args.max_length or saved.get("max_length"),  # None: as the tensors were trained (evaluate.input_format)
            "dtype": args.dtype or saved.get("dtype") or "fp32"}


def evaluated_model(args, settings: dict):
    """(model, tokenizer, what it is in words, method or None): the base model with --adapter's tensors, the zero
    capsule (--method instance) or nothing (zero-shot)."""
    adapter = settings["adapter"]
    fsdp = getattr(args, "fsdp", False)
    model = load_model(args.model, settings["dtype"], "cpu" if fsdp else settings["device"])  # FSDP: each rank keeps its shard
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
        distributed.shard_model(model, keep=method_tensors(model).values(), device=settings["device"])
    return model, load_tokenizer(args.model), what, method


def pooled_option(args) -> int:
    """--method pooled --n K: K (the adapter, if any, is then loaded as whatever it holds), else 0."""
    if args.method != "pooled":
        return 0
    if args.command != "eval" or args.n is None or (args.task and "," in args.task):
        raise CaptError("--method pooled is for capt eval of one task, with --n K (the number of pooled instance tokens)")
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
    if pooled:  # training-free instance tokens in front of the (plain or deep-prompt) model's rows
        set_pooled(model, pooled)
        what, method = f"{pooled} pooled instance tokens, {what}", ("pooled" if method is None else f"pooled+{method}")
    adapter = settings["adapter"]
    result = evaluate(model, tokenizer, examples, batch_size=args.batch_size, max_length=settings["max_length"],
                      answer_cue=args.answer_cue, normalize=args.normalize,
                      progress=sys.stderr.isatty() and world.lead and f"{get_task(settings['task']).name} {args.split}, {what}")
    distributed.stop(together=True)
    if not world.lead:  # every rank holds the result; rank 0 prints it
        return 0
    if args.json:
        print(json.dumps({"task": result["task"], "split": args.split, "n": result["n"], "method": method, "pooled": pooled,
                          "adapter": None if adapter is None else str(adapter), "metrics": result["metrics"], "loss": result["loss"]}))
    else:
        metrics = "  ".join(f"{k} {v:.2f}" for k, v in result["metrics"].items() if k != "headline")
        print(f"{result['task']} {args.split} ({result['n']} examples), {what}: {metrics}")
    return 0


def cmd_predict(args) -> int:
    sets = capsule_sets(args.adapter)
    if sets is not None:  # several capsule sets: each input row names its own in a "task" field
        return cmd_predict_tasks(args, sets)
    settings = evaluation_settings(args)
    examples = read_examples(settings["task"], args.input)  # checked before the model is loaded
    if Path(args.out).is_dir():
        raise CaptError(f"--out {args.out} is a directory; give the file to write, e.g. {Path(args.out) / 'predictions.jsonl'}")
    check_out(args.out, read_inputs(args, settings["task"], [settings["adapter"]]))
    model, tokenizer, what, _ = evaluated_model(args, settings)
    records = predict(model, tokenizer, examples, batch_size=args.batch_size, max_length=settings["max_length"],
                      answer_cue=args.answer_cue, normalize=args.normalize, progress=f"{Path(args.input).name}, {what}")
    write_predictions(args.out, records)
    task = get_task(settings["task"])
    counts = {word: sum(r["word"] == word for r in records) for word in task.candidates}
    print(f"{task.name}: {len(records)} predictions, {what}: " + ", ".join(f"{w} {c}" for w, c in counts.items()))
    metrics = labelled_metrics(examples, records)
    if metrics is not None:
        print("every row has a label: " + "  ".join(f"{k} {v:.2f}" for k, v in metrics.items() if k != "headline"))
    print(f"written: {args.out}")
    return 0


def cmd_predict_tasks(args, sets: dict[str, str]) -> int:
    """capt predict --capsules cb=DIR,rte=DIR: rows of several tasks in one file, each with a "task" field."""
    if args.task is not None and set(t.strip() for t in args.task.split(",")) != set(sets):
        raise CaptError(f"--task {args.task} and --capsules {', '.join(sets)} name different tasks; --task may be left out")
    if args.method not in (None, "capt") or args.n is not None:
        raise CaptError("several capsule sets take --capsules TASK=DIR,... alone (no --method other than capt, no --n)")
    device = check_device(args.device)
    directories = {name: method_directory(d) for name, d in sets.items()}
    runs = {name: run_settings(d) for name, d in directories.items()}
    dtypes = {run["dtype"] for run in runs.values() if run.get("dtype")}
    if args.dtype is None and len(dtypes) > 1:
        raise CaptError("the runs used different dtypes: choose one with --dtype")
    examples = read_mixed_examples(args.input, list(sets))  # checked before the model is loaded
    if Path(args.out).is_dir():
        raise CaptError(f"--out {args.out} is a directory; give the file to write, e.g. {Path(args.out) / 'predictions.jsonl'}")
    check_out(args.out, read_inputs(args, None, list(directories.values())))
    model = load_model(args.model, args.dtype or next(iter(dtypes), "fp32"), device, capsules=directories, any_base=args.any_base)
    max_length = args.max_length or max(saved_inputs(d).get("max_length") or run.get("max_length") or DEFAULT_MAX_LEN
                                        for d, run in zip(directories.values(), runs.values()))
    records = predict_tasks(model, load_tokenizer(args.model), examples, batch_size=args.batch_size, max_length=max_length,
                            answer_cue=answer_cues(args, directories), normalize=args.normalize, progress=True)
    write_predictions(args.out, records)
    counts = ", ".join(f"{name} {sum(r['task'] == name for r in records)}" for name in sets)
    print(f"{len(records)} predictions, each row with its task's capsules ({counts})")
    print(f"written: {args.out}")
    return 0


def read_inputs(args, task: str | None, adapters: list) -> list[tuple[str, object]]:
    """What predict and attention read, for rundir.check_out: the model, the adapters, --input, and the task's
    files (a task file and its data; attention also a SuperGLUE task's data directory, which it reads)."""
    inputs = [("the model directory", resolve_model(args.model)), ("the --input file", getattr(args, "input", None))]
    inputs += [("the adapter directory", directory) for directory in adapters]
    inputs += [("the run directory", d.parent) for d in adapters if d is not None and run_settings(d)]  # its config.json is read
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
            raise CaptError(f"--capsules {text!r}: write one TASK=DIR per task, separated by commas (cb=runs/cb,rte=runs/rte)")
        if name in sets:
            raise CaptError(f"--capsules names {name} twice")
        sets[name] = directory
    return sets


def cmd_eval_tasks(args) -> int:
    """capt eval --task cb,rte,copa [--capsules cb=DIR,rte=DIR,copa=DIR]: every task in one pass, batches
    mixed across tasks, each row served by its task's capsule set; one line (or JSON object) per task,
    as separate `capt eval` runs print them."""
    names = [t.strip() for t in args.task.split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise CaptError(f"--task {args.task!r}: name each task once, separated by commas")
    sets = capsule_sets(args.adapter)
    if args.adapter is not None and sets is None:
        raise CaptError(f"several tasks take one capsule set each: --capsules {','.join(f'{t}=DIR' for t in names)}")
    if sets is not None and set(sets) != set(names):
        raise CaptError(f"--capsules names {', '.join(sets)} but --task names {', '.join(names)}: give one capsule set per task")
    if args.method not in (None, "capt", "instance") or (args.method == "instance" and sets is not None) or args.n is not None:
        raise CaptError("several tasks in one pass take capsules (--capsules TASK=DIR,...), --method instance or nothing (zero-shot)")
    if args.method == "capt" and sets is None:
        raise CaptError("capt eval --method capt needs --capsules TASK=DIR,... (the trained capsules of each task)")
    device = check_device(args.device)
    directories = {} if sets is None else {name: method_directory(sets[name]) for name in names}
    runs = {name: run_settings(directory) for name, directory in directories.items()}
    max_length = {name: args.max_length or saved_inputs(directories.get(name)).get("max_length") or runs.get(name, {}).get("max_length")
                  or DEFAULT_MAX_LEN for name in names}
    dtypes = {name: run["dtype"] for name, run in runs.items() if run.get("dtype")}
    if args.dtype is None and len(set(dtypes.values())) > 1:
        raise CaptError(f"the runs used different dtypes ({', '.join(f'{n} {d}' for n, d in dtypes.items())}): choose one with --dtype")
    dtype = args.dtype or next(iter(dtypes.values()), "fp32")
    examples = {name: load_task(name, args.data, args.split, args.seed) for name in names}
    model = load_model(args.model, dtype, device, capsules={name: directories[name] for name in names} if sets else None,
                       any_base=args.any_base)
    if args.method == "instance":
        attach(model, "instance")
    results = evaluate_tasks(model, load_tokenizer(args.model), examples, batch_size=args.batch_size, max_length=max_length,
                             answer_cue=answer_cues(args, directories), normalize=args.normalize, progress=sys.stderr.isatty())
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
            metrics = "  ".join(f"{k} {v:.2f}" for k, v in result["metrics"].items() if k != "headline")
            print(f"{result['task']} {args.split} ({result['n']} examples), {what}: {metrics}")
    return 0


def cmd_run(args) -> int:
    world = start_ranks(args)
    seeds = args.seed_list if args.seed_list is not None else list(range(args.seeds))
    run_tasks(args.model, args.tasks, seeds, args.out, lengths=args.lengths, resume=args.resume, progress=world.lead, **given_options(args))
    distributed.stop(together=True)
    if not world.lead:
        return 0
    print((Path(args.out) / "results.md").read_text(), end="")
    print(f"written: {Path(args.out) / 'results.md'} and results.json")
    return 0


def cmd_compare(args) -> int:
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
    report = attention_report(model, tokenizer, examples, settings["task"], args.split, args.data, settings["max_length"],
                              what, method, args.batch_size, args.layers, args.examples, args.answer_cue)
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
    try:
        with warnings.catch_warnings():  # restores the way warnings are shown when the command ends
            warnings.simplefilter("always", CaptWarning)
            warnings.showwarning = show_warning
            return args.func(args)
    except (CaptError, OSError) as e:
        print(f"capt: error: {e}".replace("\n", " "), file=sys.stderr)
        if isinstance(e, distributed.RankLost):
            distributed.abandon(1)  # under torchrun: exit 1 without tearing down a group whose peers are gone
        return 1
    except KeyboardInterrupt as e:
        print(f"capt: {e}" if str(e) else "capt: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the last resort: no known bad input comes here (each has its own message)
        if os.environ.get("CAPT_DEBUG"):
            raise
        print(f"capt: internal error: {type(e).__name__}: {e}".replace("\n", " ")[:400]
              + " (set CAPT_DEBUG=1 to see the traceback)", file=sys.stderr)
        return 1
