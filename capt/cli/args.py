"""The command line's arguments: every option of `capt train`, `eval`, `predict`, `run`, `compare` and
`attention`, with its type and help (capt/cli/main.py runs the commands).

Types check what argparse can (a positive integer, a finite number, a list of block indices), so a
bad value is a usage error (exit 2) that names the option. Options whose default depends on the run
(a resumed run's, or the method's) default to None here: "not given".
"""

from __future__ import annotations

import argparse
import math

from .. import __version__, distributed
from ..methods import METHODS
from ..tasks import DEFAULT_MAX_LEN, TASKS
from ..trainconfig import TrainConfig

DESCRIPTION = ("Capsule Prompt-Tuning: train one vector per layer on a frozen T5, Llama or Qwen2 for SuperGLUE tasks; "
               "the baselines (prompt, deep-prompt, prefix, linear-head, instance) through the same commands.")
METHOD_HELP = ("capt (default): one capsule vector per block; prompt: n vectors before the input; deep-prompt: n "
               "vectors per block; "
               "prefix: n keys/values per layer (P-Tuning v2); linear-head: a classifier on the prompt's last hidden "
               "state "
               "(Llama / Qwen2); instance: the zero capsule, nothing trained")
DATA_HELP = (
    "SuperGLUE directory with <Task>/train.jsonl and <Task>/val.jsonl (default: env CAPT_DATA, then ./data/superglue); "
    "not read for a task file, which names its own files"
)
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


def path_text(text: str) -> str:
    """A path or a name given on the command line: not empty (an empty one would mean the current directory)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("is empty: give a path (or a name)")
    return text


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
        raise argparse.ArgumentTypeError(
            f"{text!r}: use all, odd, first-half, latter-half or indices such as 0,2,4"
        ) from None


def int_list(text: str) -> list[int]:
    try:
        values = [int(i) for i in text.split(",") if i.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None
    if not values:
        raise argparse.ArgumentTypeError("the list is empty")
    return values


def distinct(values: list[int]) -> list[int]:
    """A list in which each value is given once (a repeat would be run, and counted, twice)."""
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{', '.join(map(str, twice))} listed more than once: give each value once")
    return values


def seed_list(text: str) -> list[int]:
    return distinct([seed(str(v)) for v in int_list(text)])


def length_list(text: str) -> list[int]:
    return distinct(int_list(text))


# Training options and their CLI spelling; None as the argparse default means "not given", so
# that a resumed run can take the run's own settings for the options left out.
TRAINING_OPTIONS = (
    "epochs",
    "batch_size",
    "grad_accum",
    "lr",
    "weight_decay",
    "warmup",
    "max_steps",
    "dtype",
    "max_length",
    "patience",
    "eval_every",
    "eval_batch_size",
    "device",
    "integration",
    "blocks",
    "data",
    "method",
    "n",
    "fsdp",
    "step_scale",
    "answer_cue",
    "any_base",
    "train_rows",
    "validation_rows",
    "select",
    "capsule_length",
    "deterministic",
)
ANY_BASE_HELP = ("use the saved tensors on a base model whose config.json or weights differ from the one they were "
                 "trained on "
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
    g.add_argument("--data", type=path_text, metavar="DIR", help=DATA_HELP)
    g.add_argument("--epochs", type=positive_int, metavar="N", help=f"most epochs (default {d['epochs']})")
    g.add_argument("--batch-size", type=positive_int, metavar="N", help="examples per forward pass (default "
                                                                        f"{d['batch_size']})")
    g.add_argument("--grad-accum", type=positive_int, metavar="N",
                   help=f"forward passes per optimizer step (default {d['grad_accum']}); a step sees batch-size x "
                        "grad-accum examples")
    lrs = ", ".join(f"{k} {m.lr:g}" for k, m in METHODS.items() if m.lr is not None)
    scaled = ", ".join(f"{k} {m.scaled_lr:g}" for k, m in METHODS.items() if m.scaled_lr is not None)
    g.add_argument("--lr", type=positive_float, metavar="X",
                   help=f"AdamW peak learning rate; under the step scale r, the step relative to each block's scale "
                        f"(default: {scaled}; with one rate: {lrs})")
    g.add_argument("--step-scale", choices=["rms", "none"],
                   help="rms (default for capt and deep-prompt): block l's rate is lr x the RMS of its mean-pooled "
                        "input "
                        "(prefix: of the layer's own keys, values), measured before the first step; none (default for "
                        "the "
                        "rest, and the only one for prompt and linear-head): one rate for every tensor, the "
                        "paper-plain form")
    g.add_argument("--answer-cue", action=argparse.BooleanOptionalAction,
                   help="end SuperGLUE inputs with ' answer:' (default: yes for Llama / Qwen2, no for T5)")
    g.add_argument("--weight-decay", type=non_negative_float, metavar="X", help="AdamW weight decay (default "
                                                                                f"{d['weight_decay']:g})")
    g.add_argument("--warmup", type=non_negative_float, metavar="X",
                   help="linear warm-up: a fraction of the planned steps if below 1, else a whole number of steps, at "
                        "most the planned "
                        f"steps (default {d['warmup']:g}); then linear decay to 0")
    g.add_argument("--max-steps", type=non_negative_int, metavar="N",
                   help="train for at most N optimizer steps; the warm-up and decay are planned over them "
                        "(over min(N, epochs x steps per epoch)); a run keeps its value on --resume")
    g.add_argument("--dtype", choices=["fp32", "bf16"], help="backbone weights (default fp32); the trained tensors and "
                                                             "optimizer state are always fp32")
    g.add_argument("--max-length", type=positive_int, metavar="N", help="input token budget; longer inputs lose words "
                                                                        "of their long field (default "
                                                                        f"{DEFAULT_MAX_LEN})")
    g.add_argument("--patience", type=positive_int, metavar="N",
                   help=f"stop after N validation evaluations without improvement (default {d['patience']})")
    g.add_argument("--select", choices=["headline", "loss"],
                   help="which validation evaluation is the best (kept, tested, and what early stopping waits for): "
                        "headline (default: the higher headline, ties to the lower gold NLL) or loss (the lower gold "
                        "NLL)")
    g.add_argument("--train-rows", type=positive_int, metavar="N",
                   help="train on at most N examples of the training split, a sample drawn by --seed (default: all)")
    g.add_argument("--validation-rows", type=positive_int, metavar="N",
                   help="validate on at most N examples of the validation split, a sample drawn by --seed (default: "
                        "all)")
    g.add_argument("--eval-every", type=positive_int, metavar="N", help="also evaluate on validation every N steps "
                                                                        "(default: at epoch ends only)")
    g.add_argument("--eval-batch-size", type=positive_int, metavar="N", help="examples per evaluation batch (default "
                                                                             f"{d['eval_batch_size']})")
    g.add_argument("--device", metavar="D", help=DEVICE_HELP)
    g.add_argument("--deterministic", action=argparse.BooleanOptionalAction,
                   help="CUDA: deterministic kernels only, so that the run repeats bit for bit on the same machine "
                        "and versions (slower; an operation without one stops the run with torch's error); a resumed "
                        "run keeps its setting unless given (default off; the CPU's kernels already repeat)")
    g.add_argument("--integration", choices=["add", "prepend", "extraction", "projection"],
                   help="capsule integration (default add; capt only): add p_l to the instance mean, prepend the two "
                        "as "
                        "two slots, or learn the instance part (extraction: a filter of the rows; projection: a "
                        "low-rank map of their mean)")
    g.add_argument("--capsule-length", type=positive_int, metavar="N",
                   help="capsule slots per block, each its own vector (default 1; add only, at most 2)")
    g.add_argument("--blocks", type=blocks, metavar="SET", help="blocks with a capsule: all, odd, first-half, "
                                                                "latter-half or 0,2,4 (default all; capt only)")
    g.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its state.pt; options left out take the run's values")
    g.add_argument("--any-base", action="store_true", default=None,
                   help="with --resume: continue on weights other than the run's (the same config.json), on purpose")
    add_distributed_options(p)


def add_distributed_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("more than one process (torchrun --nproc_per_node N -m capt ...)")
    g.add_argument("--fsdp", action="store_true", default=None,
                   help="shard the frozen base across the ranks with FSDP (the trained tensors stay whole on every "
                        "rank)")
    g.add_argument("--dist-timeout", type=positive_float, default=distributed.DEFAULT_TIMEOUT, metavar="S",
                   help="seconds a rank waits for the others before it gives up (default "
                        f"{distributed.DEFAULT_TIMEOUT:g})")


def add_evaluated_model_options(p: argparse.ArgumentParser, task_help: str) -> None:
    """eval and predict: the model, the method's tensors and the task."""
    p.add_argument("--model", type=path_text, metavar="DIR", required=True, help=MODEL_HELP)
    p.add_argument("--adapter", "--capsules", dest="adapter", type=path_text, metavar="DIR",
                   help="a saved method: capsules.safetensors + capsules.json (capt) or adapter.safetensors + "
                        "adapter.json "
                        "(the other methods), or a run directory (its best/); --capsules is the same option. With a "
                        "run "
                        "directory or its best/, --task, --max-length and --dtype default to the run's (its "
                        "config.json). "
                        "Several tasks (eval: --task cb,rte; predict: rows with a \"task\" field): "
                        "TASK=DIR,TASK=DIR,... "
                        "one capsule set per task, all on one model")
    p.add_argument("--method", choices=list(METHODS) + ["pooled"], help="instance: the zero capsule (no directory "
                                                                        "needed); "
                   "pooled (capt eval): --n K training-free instance tokens, chunk means of the prompt's embeddings, "
                   "in front "
                   "(with --adapter: of a deep-prompt model's rows); else, with --adapter, the method the directory "
                   "must hold")
    p.add_argument("--n", "--vectors", dest="n", type=positive_int, metavar="N",
                   help="with --adapter: the n the directory must hold (pooled: the number of instance tokens); "
                        f"{VECTORS_NOTE}")
    p.add_argument("--task", type=path_text, metavar="NAME",
                   help=f"{task_help}; may be left out with --adapter RUN_DIR. capt eval: several, "
                   "comma-separated (cb,rte,copa), are evaluated in one pass in batches that mix the tasks")
    p.add_argument("--any-base", action="store_true", help=ANY_BASE_HELP)


def add_scoring_options(p: argparse.ArgumentParser) -> None:
    """eval and predict: batch, length budget, dtype, device, normalization."""
    p.add_argument("--batch-size", type=positive_int, default=32, metavar="N", help="examples per batch (default 32)")
    p.add_argument("--max-length", type=positive_int, metavar="N",
                   help="input token budget (default: the run's with --adapter RUN_DIR or RUN_DIR/best, else "
                        f"{DEFAULT_MAX_LEN})")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="backbone weights (default: the run's with --adapter "
                                                             "RUN_DIR or RUN_DIR/best, else fp32)")
    p.add_argument("--device", metavar="D", help=DEVICE_HELP)
    p.add_argument("--normalize", action="store_true", help="rank by mean log-prob per target token instead of the sum")
    p.add_argument("--answer-cue", action=argparse.BooleanOptionalAction, help=EVAL_CUE_HELP)


def given_options(args) -> dict:
    return {k: getattr(args, k) for k in TRAINING_OPTIONS if getattr(args, k, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="capt", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"capt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{train,eval,predict,run,compare,attention}")
    task_help = TASK_HELP.format(", ".join(TASKS))
    for add in (add_train_command, add_eval_command, add_predict_command, add_run_command, add_compare_command,
                add_attention_command):
        add(sub, task_help)
    return parser


def add_train_command(sub, task_help: str) -> None:
    """capt train: one task, one seed, one run directory."""
    p = sub.add_parser("train", help="train capsules (or another method) for one task and seed", description=(
        "Train capsules (or --method's tensors) on a frozen model for one task, early-stopped on its validation split, "
        "then test the best tensors on its test split. A SuperGLUE task: validation = a seeded 10% of the official "
        "train set, test = the official validation set; a task file (FILE.json): its own validation file (else a "
        "seeded 10% of its train file) and its test file. "
        "The run directory gets config.json, metrics.jsonl, best/, state.pt, test.json and curves.png (with "
        "matplotlib). "
        "--method instance trains nothing: evaluate it with capt eval --method instance."))
    p.add_argument("--model", type=path_text, metavar="DIR", help=f"{MODEL_HELP}; may be left out with --resume")
    p.add_argument("--task", type=path_text, metavar="NAME", help=f"{task_help}; may be left out with --resume")
    p.add_argument("--out", type=path_text, metavar="DIR", required=True, help="run directory")
    p.add_argument("--seed", type=seed, metavar="N", help="seed of the split, the data order and the generators "
                                                          "(default 0)")
    add_method_options(p)
    add_training_options(p)


def add_eval_command(sub, task_help: str) -> None:
    """capt eval: rank-classify a split and print its metrics."""
    p = sub.add_parser("eval", help="rank-classify a split, zero-shot, with capsules or another method", description=(
        "Score every candidate target of each example by its log-likelihood and print the task's metrics "
        "(linear-head: the argmax of its classifier). Without --adapter (or --capsules) the base model is evaluated "
        "zero-shot; --method instance evaluates the zero capsule."))
    add_evaluated_model_options(p, task_help)
    p.add_argument("--data", type=path_text, metavar="DIR", help=DATA_HELP)
    p.add_argument("--split", choices=["test", "validation", "train"], default="test",
                   help="test (default; SuperGLUE: the official val set; a task file: its test file), validation "
                        "(SuperGLUE: the seeded 10%% of the official train set; a task file: its validation file, else "
                        "the seeded 10%% of its train file) or train (the rest)")
    p.add_argument("--seed", type=seed, default=0, metavar="N", help="seed of the train / validation split (default 0)")
    add_scoring_options(p)
    p.add_argument("--json", action="store_true", help="print the result as one JSON object")
    add_distributed_options(p)


def add_predict_command(sub, task_help: str) -> None:
    """capt predict: label a JSONL file's rows."""
    p = sub.add_parser("predict", help="label the rows of a JSONL file, with each label's score", description=(
        "Rank-classify every row of --input (rows in the task's format; labels not needed) zero-shot, with capsules or "
        "another method, exactly as capt eval ranks them, and write one JSON line per row to --out: the predicted "
        "label, "
        "its label word, each label word's summed log-likelihood (scores) and their softmax (probabilities); "
        "gold when the row has a label. A progress bar goes to stderr."))
    add_evaluated_model_options(p, task_help)
    p.add_argument("--input", type=path_text, metavar="FILE", required=True,
                   help="JSONL rows to label, in the task's format (a file, or a pipe: /dev/stdin)")
    p.add_argument("--out", type=path_text, metavar="FILE", default="runs/predictions.jsonl",
                   help="JSONL file to write, replaced atomically (default runs/predictions.jsonl); never the --input")
    add_scoring_options(p)
    add_distributed_options(p)


def add_run_command(sub, task_help: str) -> None:
    """capt run: tasks x seeds (and a length search), then the results table."""
    p = sub.add_parser("run", help="train and test tasks x seeds; write the results table", description=(
        "For each task: zero-shot on the test set, then train and test one run per seed (OUT/<task>/seed<k>) with "
        "--method. "
        "Writes OUT/results.md and OUT/results.json: the method, its trainable parameters, mean and sample std of each "
        "task's headline metric, the zero-shot column, the training time, and the six-task average when all six tasks "
        "ran. "
        "With --tasks all, tasks whose data files are missing are listed as skipped; a named task with missing data is "
        "an error. "
        "--method instance trains nothing: one test evaluation per task with the zero capsule."))
    p.add_argument("--model", type=path_text, metavar="DIR", required=True, help=MODEL_HELP)
    p.add_argument("--tasks", "--task", dest="tasks", metavar="LIST", default="all",
                   help=f"all (default: SuperGLUE's six) or a comma-separated list of: {', '.join(TASKS)}, task files "
                        "FILE.json")
    p.add_argument("--seeds", type=seed_count, default=3, metavar="N", help="run seeds 0 .. N-1 (default 3, at most "
                                                                            f"{MAX_SEEDS:,})")
    p.add_argument("--seed-list", type=seed_list, metavar="A,B,...", help="run exactly these seeds (overrides --seeds)")
    p.add_argument("--out", type=path_text, metavar="DIR", required=True, help="output directory")
    add_method_options(p)
    p.add_argument("--lengths", type=length_list, metavar="A,B,...",
                   help="prompt, deep-prompt, prefix: search these n, every one with every seed "
                        "(OUT/<task>/n<N>/seed<k>); "
                        "the n that did best on validation (mean headline, or mean gold NLL under --select loss) "
                        "is reported, and the search's time counts as "
                        "training time")
    add_training_options(p)


def add_compare_command(sub, task_help: str) -> None:
    """capt compare: several capt run outputs side by side, paired on the same rows."""
    p = sub.add_parser("compare", help="one table from several capt run outputs (one per method)", description=(
        "Put several `capt run` outputs on the same base model side by side: each method's score per task, trainable "
        "parameters, training time and time relative to the CaPT run. Prints Markdown; --out also writes compare.md "
        "and compare.json there, and compare.png, a bar chart of the scores with their standard deviations (with "
        "matplotlib)."))
    p.add_argument("runs", nargs="+", metavar="OUT", help="capt run output directories (or their results.json)")
    p.add_argument("--out", type=path_text, metavar="DIR", help="write compare.md, compare.json and compare.png in DIR")


def add_attention_command(sub, task_help: str) -> None:
    """capt attention: where attention goes, written out and drawn."""
    p = sub.add_parser(
        "attention",
        help="where attention goes: mass on the capsule slot, the first token, the rest",
        description=(
            "Run a split through the explicit attention path (the weights written out; outputs equal SDPA's) and write "
            "OUT/attention.json (per layer x head: the mean mass real tokens put on the capsule slot(s), on other "
            "methods' "
            "front rows, on the first token and on the rest; T5: encoder and cross-attention, and the tokens the slot "
            "attends to) "
            "with heatmap.png and maps.png. --curves A.json B.json ... --out DIR: only draw their per-layer curves "
            "(curves.png)."
        ),
    )
    p.add_argument("--model", type=path_text, metavar="DIR", help=MODEL_HELP)
    p.add_argument("--adapter", "--capsules", dest="adapter", type=path_text, metavar="DIR",
                   help="a saved method or a run directory (its best/)")
    p.add_argument("--method", choices=list(METHODS), help="instance: the zero capsule (no directory needed); with "
                                                           "--adapter, "
                   "the method the directory must hold")
    p.add_argument("--n", "--vectors", dest="n", type=positive_int, metavar="N",
                   help="with --adapter: the n the directory must hold (pooled: the number of instance tokens); "
                        f"{VECTORS_NOTE}")
    p.add_argument("--task", type=path_text, metavar="NAME",
                   help=f"{task_help}; may be left out with --adapter RUN_DIR")
    p.add_argument("--any-base", action="store_true", help=ANY_BASE_HELP)
    p.add_argument("--data", type=path_text, metavar="DIR", help=DATA_HELP)
    p.add_argument(
        "--split",
        choices=["validation", "test"],
        default="validation",
        help="validation (default; SuperGLUE: the seeded 10%% of the official train set; a task file: its "
             "validation file, else the seeded 10%% of its train file) or test (SuperGLUE: the official val set; a "
             "task file: its test file)",
    )
    p.add_argument("--seed", type=seed, default=0, metavar="N", help="seed of the train / validation split (default 0)")
    p.add_argument("--limit", type=positive_int, metavar="N", help="the first N examples of the split only")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="N", help="examples per batch (default 8)")
    p.add_argument("--max-length", type=positive_int, metavar="N",
                   help="input token budget (default: the run's with --adapter RUN_DIR or RUN_DIR/best, else "
                        f"{DEFAULT_MAX_LEN})")
    p.add_argument("--dtype", choices=["fp32", "bf16"], help="backbone weights (default: the run's, else fp32)")
    p.add_argument("--device", metavar="D", help=DEVICE_HELP)
    p.add_argument("--answer-cue", action=argparse.BooleanOptionalAction, help=EVAL_CUE_HELP)
    p.add_argument("--layers", type=int_list, metavar="A,B,...", help="layers of the example maps (default: first, "
                                                                      "middle, last)")
    p.add_argument("--examples", type=int_list, metavar="I,J,...",
                   help="0-based indices (after --limit) of the examples whose maps are kept (default 0; maps.png "
                        "draws up to 4)")
    p.add_argument("--curves", nargs="+", metavar="JSON", help="attention.json files (or their directories) to draw "
                                                               "together")
    p.add_argument("--out", type=path_text, metavar="DIR", required=True, help="output directory")
