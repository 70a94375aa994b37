"""The command line: `capt train`, `capt eval`, `capt run`, `capt compare` (also `python -m capt`).

Every CaptError (and any OSError: a file that cannot be read or written) is printed as one
line, `capt: error: ...`, with exit status 1; usage errors exit with 2 (argparse's convention)
and Ctrl-C with 130 after saying how to continue.
"""

from __future__ import annotations

import argparse
import atexit
import json
import sys
from pathlib import Path

from . import __version__, distributed
from .errors import CaptError
from .evaluate import evaluate
from .experiment import run_tasks
from .load import atomic_write, load_method, load_model
from .methods import METHODS, attach, method_tensors
from .report import compare, compare_markdown, read_results
from .rundir import read_run_config
from .tasks import DEFAULT_MAX_LEN, TASKS, get_task, load_task
from .tokenizer import load_tokenizer
from .trainer import TrainConfig, check_device, train

DESCRIPTION = ("Capsule Prompt-Tuning: train one vector per layer on a frozen T5, Llama or Qwen2 for SuperGLUE tasks; "
               "the baselines (prompt, deep-prompt, prefix, linear-head, instance) through the same commands.")
METHOD_HELP = ("capt (default): one capsule vector per block; prompt: n vectors before the input; deep-prompt: n vectors per block; "
               "prefix: n keys/values per layer (P-Tuning v2); linear-head: a classifier on the prompt's last hidden state "
               "(Llama / Qwen2); instance: the zero capsule, nothing trained")
DATA_HELP = "SuperGLUE directory with <Task>/train.jsonl and <Task>/val.jsonl (default: env CAPT_DATA, then ./data/superglue)"
DEVICE_HELP = "torch device, e.g. cuda, cuda:1, cpu (default: cuda if available, else cpu)"
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
        if not (value >= minimum if inclusive else value > minimum):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return value

    return parse


positive_int = _number(int, 1, inclusive=True)
non_negative_int = _number(int, 0, inclusive=True)
positive_float = _number(float, 0, inclusive=False)
non_negative_float = _number(float, 0, inclusive=True)


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


# Training options and their CLI spelling; None as the argparse default means "not given", so
# that a resumed run can take the run's own settings for the options left out.
TRAINING_OPTIONS = ("epochs", "batch_size", "grad_accum", "lr", "weight_decay", "warmup", "max_steps", "dtype",
                    "max_length", "patience", "eval_every", "eval_batch_size", "device", "integration", "blocks", "data",
                    "method", "n", "fsdp")


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
    g.add_argument("--lr", type=positive_float, metavar="X", help=f"AdamW peak learning rate (default by method: {lrs})")
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
    add_distributed_options(p)


def add_distributed_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("more than one process (torchrun --nproc_per_node N -m capt ...)")
    g.add_argument("--fsdp", action="store_true", default=None,
                   help="shard the frozen base across the ranks with FSDP (the trained tensors stay whole on every rank)")
    g.add_argument("--dist-timeout", type=positive_float, default=distributed.DEFAULT_TIMEOUT, metavar="S",
                   help=f"seconds a rank waits for the others before it gives up (default {distributed.DEFAULT_TIMEOUT:g})")


def given_options(args) -> dict:
    return {k: getattr(args, k) for k in TRAINING_OPTIONS if getattr(args, k, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capt", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"capt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{train,eval,run,compare}")
    tasks = ", ".join(TASKS)

    p = sub.add_parser("train", help="train capsules (or another method) for one task and seed", description=(
        "Train capsules (or --method's tensors) on a frozen model for one SuperGLUE task, early-stopped on the validation split "
        "(10% of the official train set), then test the best tensors on the official validation set. "
        "The run directory gets config.json, metrics.jsonl, best/, state.pt and test.json. "
        "--method instance trains nothing: evaluate it with capt eval --method instance."))
    p.add_argument("--model", metavar="DIR", help="checkpoint directory (config.json, safetensors, tokenizer); may be left out with --resume")
    p.add_argument("--task", metavar="NAME", help=f"one of {tasks}; may be left out with --resume")
    p.add_argument("--out", metavar="DIR", required=True, help="run directory")
    p.add_argument("--seed", type=int, metavar="N", help="seed of the split, the data order and the generators (default 0)")
    add_method_options(p)
    add_training_options(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="rank-classify a split, zero-shot, with capsules or another method", description=(
        "Score every candidate target of each example by its log-likelihood and print the task's metrics "
        "(linear-head: the argmax of its classifier). Without --adapter (or --capsules) the base model is evaluated "
        "zero-shot; --method instance evaluates the zero capsule."))
    p.add_argument("--model", metavar="DIR", required=True, help="checkpoint directory")
    p.add_argument("--adapter", "--capsules", dest="adapter", metavar="DIR",
                   help="a saved method: capsules.safetensors + capsules.json (capt) or adapter.safetensors + adapter.json "
                        "(the other methods), or a run directory (its best/); --capsules is the same option. With a run "
                        "directory or its best/, --max-length and --dtype default to the run's (its config.json)")
    p.add_argument("--method", choices=list(METHODS), help="instance: the zero capsule (no directory needed); "
                   "with --adapter, the method the directory must hold")
    p.add_argument("--n", "--vectors", dest="n", type=positive_int, metavar="N",
                   help=f"with --adapter: the n the directory must hold; {VECTORS_NOTE}")
    p.add_argument("--task", metavar="NAME", required=True, help=f"one of {tasks}")
    p.add_argument("--data", metavar="DIR", help=DATA_HELP)
    p.add_argument("--split", choices=["test", "validation", "train"], default="test",
                   help="test = official val set (default); validation / train = the seeded 10%% / 90%% of the official train set")
    p.add_argument("--seed", type=int, default=0, metavar="N", help="seed of the train / validation split (default 0)")
    p.add_argument("--batch-size", type=positive_int, default=32, metavar="N", help="examples per batch (default 32)")
    p.add_argument("--max-length", type=positive_int, metavar="N",
                   help=f"input token budget (default: the run's with --adapter RUN_DIR or RUN_DIR/best, else {DEFAULT_MAX_LEN})")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="backbone weights (default: the run's with --adapter RUN_DIR or RUN_DIR/best, else fp32)")
    p.add_argument("--device", metavar="D", help=DEVICE_HELP)
    p.add_argument("--normalize", action="store_true", help="rank by mean log-prob per target token instead of the sum")
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_distributed_options(p)
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("run", help="train and test tasks x seeds; write the results table", description=(
        "For each task: zero-shot on the test set, then train and test one run per seed (OUT/<task>/seed<k>) with --method. "
        "Writes OUT/results.md and OUT/results.json: the method, its trainable parameters, mean and sample std of each "
        "task's headline metric, the zero-shot column, the training time, and the six-task average when all six tasks ran. "
        "With --tasks all, tasks whose data files are missing are listed as skipped; a named task with missing data is an error. "
        "--method instance trains nothing: one test evaluation per task with the zero capsule."))
    p.add_argument("--model", metavar="DIR", required=True, help="checkpoint directory")
    p.add_argument("--tasks", metavar="LIST", default="all", help=f"all (default) or a comma-separated list of: {tasks}")
    p.add_argument("--seeds", type=positive_int, default=3, metavar="N", help="run seeds 0 .. N-1 (default 3)")
    p.add_argument("--seed-list", type=int_list, metavar="A,B,...", help="run exactly these seeds (overrides --seeds)")
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
        "and compare.json there."))
    p.add_argument("runs", nargs="+", metavar="OUT", help="capt run output directories (or their results.json)")
    p.add_argument("--out", metavar="DIR", help="write compare.md and compare.json in DIR")
    p.set_defaults(func=cmd_compare)
    return parser


# ---------------------------------------------------------------------------------------------
# Commands


def start_ranks(args) -> distributed.World:
    """Join torchrun's process group when torchrun started this process (else one process). A
    command that succeeds leaves it with distributed.stop(together=True); after an error it is left at exit."""
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
        for key in TRAINING_OPTIONS:  # options left out take the run's values (except where and how to run)
            if key not in options and key not in ("device", "fsdp") and saved.get(key) is not None:
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
    head = get_task(config.task).metrics[0]
    metrics = "  ".join(f"{k} {v:.2f}" for k, v in result["metrics"].items() if k != "headline")
    what = "capsules" if config.method == "capt" else f"{config.method} tensors"
    if world.lead:
        print(f"{config.task} test ({result['n']} examples), best {what} from step {result['best']['step']}: {metrics}")
        print(f"run directory: {args.out} (headline {head} {result['metrics']['headline']:.2f})")
    distributed.stop(together=True)
    return 0


def method_directory(path: str) -> Path:
    """A saved method's directory: path itself, or a run directory's best/."""
    path = Path(path)
    if not any((path / f).is_file() for f in ("capsules.json", "adapter.json")):
        if any((path / "best" / f).is_file() for f in ("capsules.json", "adapter.json")):
            return path / "best"  # a run directory: its best tensors
    return path


def run_settings(adapter: Path) -> dict:
    """The config.json of the run whose best/ is `adapter`, or {} when it is not a run's (read_run_config's checks)."""
    run = adapter.parent
    if adapter.name != "best" or not (run / "config.json").is_file():
        return {}
    saved = read_run_config(run)
    return saved if "model_config_sha256" in saved else {}  # a run's settings, not a checkpoint's config.json


def cmd_eval(args) -> int:
    if args.adapter is None and args.method not in (None, "instance"):
        raise CaptError(f"capt eval --method {args.method} needs --adapter DIR (the trained tensors: a run directory or its best/); "
                        "only instance needs none")
    if args.adapter is not None and args.method == "instance":
        raise CaptError("--method instance has no tensors to load: leave out --adapter")
    world = start_ranks(args)
    device = distributed.rank_device(check_device(args.device))
    adapter = None if args.adapter is None else method_directory(args.adapter)
    max_length, dtype = args.max_length, args.dtype
    if adapter is not None and (max_length is None or dtype is None):  # a run's tensors: evaluated as the run tested them
        saved = run_settings(adapter)
        max_length = saved.get("max_length") if max_length is None else max_length
        dtype = saved.get("dtype") if dtype is None else dtype
    max_length = DEFAULT_MAX_LEN if max_length is None else max_length
    dtype = "fp32" if dtype is None else dtype
    examples = load_task(args.task, args.data, args.split, args.seed)
    model = load_model(args.model, dtype, "cpu" if args.fsdp else device)  # FSDP: each rank keeps its shard on the device
    if adapter is not None:
        config = load_method(model, adapter)
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
    if args.fsdp:  # after the method is attached: its tensors stay whole on every rank
        distributed.shard_model(model, keep=method_tensors(model).values(), device=device)
    tokenizer = load_tokenizer(args.model)
    result = evaluate(model, tokenizer, examples, batch_size=args.batch_size, max_length=max_length,
                      normalize=args.normalize, progress=sys.stderr.isatty() and world.lead)
    distributed.stop(together=True)
    if not world.lead:  # every rank holds the result; rank 0 prints it
        return 0
    if args.json:
        print(json.dumps({"task": result["task"], "split": args.split, "n": result["n"], "method": method,
                          "adapter": None if adapter is None else str(adapter), "metrics": result["metrics"], "loss": result["loss"]}))
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
        print(f"written: {out / 'compare.md'} and compare.json")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    try:
        return args.func(args)
    except (CaptError, OSError) as e:
        print(f"capt: error: {e}".replace("\n", " "), file=sys.stderr)
        return 1
    except KeyboardInterrupt as e:
        print(f"capt: {e}" if str(e) else "capt: interrupted", file=sys.stderr)
        return 130
