"""Training a method on a frozen model: the loop, early stopping, the run directory, resume.

Every method of capt.methods goes through this trainer: capt (the capsules, the default),
prompt, deep-prompt, prefix and linear-head; `instance` trains nothing (capt eval --method
instance evaluates it). Only the method's tensors train (fp32, AdamW, optimizer state fp32
whatever the model's dtype); every backbone tensor stays as loaded. The loss is the
cross-entropy of the gold target's tokens, summed over the target (its negative
log-likelihood, the quantity rank classification compares) and averaged over the examples of
an optimizer step:

- T5: the encoder reads the input, the decoder is teacher-forced on the gold target (EOS included).
- Llama / Qwen2: prompt + gold answer tokens in one sequence; prompt_mask covers the prompt only
  (the capsule never sees the answer) and logits are computed only at the positions that
  predict answer tokens (logits_at).
- linear-head (Llama / Qwen2): the prompt alone; the cross-entropy of the classifier's logits
  at the prompt's last token over the task's candidates (COPA: choice1 / choice2).

A run directory holds:

    config.json     the resolved settings: model path and config sha256, task, method, every hyperparameter, seed, capt version
    metrics.jsonl   one line per validation evaluation: epoch, step, train loss, validation metrics, time
    best/           the method's tensors at the best validation evaluation (capt: capsules.safetensors +
                    capsules.json; the others: adapter.safetensors + adapter.json, see capt.methods)
    state.pt        everything needed to continue: the method's tensors, optimizer, scheduler, RNG states, position, early-stopping state
    test.json       the best tensors' test metrics and the run's training wall time (train_seconds), written at the end

Every file is written to a temporary name and renamed, so a crash never leaves half a file.
A run exists once its first state.pt is written (config.json comes just before it: a directory
with config.json and no state.pt is started afresh). state.pt is the point a resumed run
continues from: on resume, metrics.jsonl lines and best/ written after it are redone, and
test.json too unless the run had finished (a finished run's test is reused), so an
interrupted and resumed run ends exactly like an uninterrupted one (bit-identical on the CPU).

Choices:
- Validation after every epoch (and every `eval_every` steps if set). Early stopping on the
  task's headline metric: an evaluation is better when its headline is higher, or equal with a
  lower validation loss (tiny validation sets often tie). Training stops after `patience`
  evaluations without a better one, or after `epochs`.
- Learning rate: linear warm-up over `warmup` (a fraction of the planned steps if below 1,
  else a whole number of steps, at most the planned steps: a longer warm-up ends at the last
  planned step), then linear decay to zero at the last planned step. The planned
  steps are epochs x steps-per-epoch, or `max_steps` when that is fewer: `max_steps` is the
  run's training budget, so a short run warms up and decays within it. Like every setting
  that changes the result, a run's `max_steps` cannot change when it is resumed (nor its method or n).
- Default learning rate: 0.3 for capt, prompt and deep-prompt in every family; 1e-2 for prefix
  and 1e-3 for linear-head. For T5, 0.3 is soft-prompt practice. The rest comes from sweeps on
  SmolLM2-135M-Instruct, CB, seed 0, inputs cut to 128 tokens, batch 16, 2 epochs (validation
  macro-F1 / loss, best of the 2 epochs; the validation split is 25 examples, so the loss breaks
  near-ties). capt: 1e-2 gave 23.9 / 19.1 (gold NLL, 3 epochs planned), 5e-2 35.6 / 10.3,
  0.3 59.9 / 1.53. prefix (n 64): 3e-3 22.9 / 10.3, 1e-2 59.9 / 0.94, 5e-2 47.7 / 1.13, 0.3 43.9 / 2.28.
  linear-head (cross-entropy over the classes): 1e-3 67.9 / 0.65, 1e-2 71.8 / 0.97 at epoch 1 and
  67.9 / 0.79 at epoch 2, 0.3 61.8 / 41.3 (diverging); 1e-3 for its lower loss at equal F1. Weight decay 0 (the capsules start at zero).
- Batches: shuffled per epoch, then sorted by length within chunks of 16 batches, then the
  batches shuffled; all from `seed` and the epoch number. `seed` also picks the train /
  validation split, seeds Python's and torch's generators and draws the random initial
  values of prompt and prefix tensors.
- A run stopped by `max_steps` is evaluated once more on validation (unless it just was), so it
  always has best tensors; that evaluation is the run's last and does not count for early stopping.
- train_seconds: wall time of training and its validation evaluations (resumed runs add up
  their parts); loading and the test evaluation are not counted.

run_tasks runs tasks x seeds for one method; for prompt, deep-prompt and prefix it can search
the prompt length (`lengths`): every length is trained with every seed, the length with the best
mean validation headline is kept, its test results are reported, and the search's runs count in
the method's training time.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import random
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from . import __version__
from .capsule import CapsuleConfig
from .errors import CaptError
from .evaluate import Encoded, decoder_inputs, encode_examples, evaluate, has_linear_head, is_seq2seq, pad
from .load import DTYPES, atomic_write, config_hash, load_model, read_config, trainable_summary
from .methods import (DEFAULT_N, METHODS, MethodConfig, attach, classify, detach, last_token, method_tensors, save_method,
                      trainable_count)
from .tasks import DEFAULT_MAX_LEN, TASKS, get_task, load_task, paper_average, resolve_data_dir
from .tokenizer import load_tokenizer

DEFAULT_LR = {"t5": 0.3, "llama": 0.3, "qwen2": 0.3}  # by family: capt, prompt, deep-prompt
METHOD_LR = {"prefix": 1e-2, "linear-head": 1e-3}  # methods whose tensors want another step size (see Choices)


def default_lr(family: str, method: str = "capt") -> float:
    return METHOD_LR.get(method, DEFAULT_LR[family])

CHUNK_BATCHES = 16  # length bucketing: batches are formed from chunks of this many batches
STATE_VERSION = 2  # 1: capsules only, as {block index: vector}
STATE_KEYS = ("version", "task", "tensors", "optimizer", "scheduler", "rng", "train")  # what a state.pt holds
# Settings a resumed run may change: where things are and how fast, not what is computed.
RESUMABLE_CHANGES = ("model", "data", "out", "device", "eval_batch_size")


class TrainingDiverged(CaptError):
    """The loss became NaN or infinite; the best tensors so far are kept."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or stop_after) during training, after the state was saved; str() says how to continue."""


@dataclass
class TrainConfig:
    """Everything a training run depends on (written to RUN/config.json)."""

    model: str  # checkpoint directory
    task: str
    out: str  # run directory
    data: str | None = None  # SuperGLUE directory (None: CAPT_DATA, then data/superglue)
    epochs: int = 50
    batch_size: int = 16  # examples per forward pass
    grad_accum: int = 1  # forward passes per optimizer step
    lr: float | None = None  # None: default_lr(family, method)
    weight_decay: float = 0.0
    warmup: float = 0.06  # < 1: fraction of the planned steps; >= 1: whole steps (at most the planned steps)
    seed: int = 0
    max_steps: int | None = None  # train for at most this many optimizer steps; the warm-up and decay are planned over them
    dtype: str = "fp32"  # backbone weights: fp32 | bf16 (the method's tensors and optimizer state are fp32)
    max_length: int = DEFAULT_MAX_LEN  # input tokens; longer inputs are shortened in their long field
    patience: int = 5  # evaluations without improvement before stopping
    eval_every: int | None = None  # also evaluate every N steps (None: at epoch ends only)
    eval_batch_size: int = 32
    device: str | None = None  # None: cuda if available, else cpu
    integration: str = "add"  # capsule integration: add | prepend
    blocks: str | list[int] = "all"  # blocks carrying capsules: all | odd | first-half | latter-half | list
    method: str = "capt"  # capt | prompt | deep-prompt | prefix | linear-head (capt.methods; instance trains nothing)
    n: int | None = None  # vectors per place for prompt, deep-prompt, prefix (None: methods.DEFAULT_N)

    def __post_init__(self):
        self.task = get_task(self.task).name
        if self.method not in METHODS:
            raise CaptError(f"method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method in DEFAULT_N:
            self.n = DEFAULT_N[self.method] if self.n is None else int(self.n)
            if self.n < 1:
                raise CaptError(f"n must be at least 1, got {self.n}")
        elif self.n is not None:
            raise CaptError(f"n (vectors per place) is for {', '.join(DEFAULT_N)}, not {self.method}")
        if self.method != "capt" and (self.integration, self.blocks) != ("add", "all"):
            raise CaptError(f"integration and blocks are capt's options, not {self.method}'s")
        for name in ("epochs", "batch_size", "grad_accum", "patience", "eval_batch_size", "max_length"):
            if int(getattr(self, name)) < 1:
                raise CaptError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 0:
            raise CaptError(f"max_steps must be 0 or more, got {self.max_steps}")
        if self.eval_every is not None and self.eval_every < 1:
            raise CaptError(f"eval_every must be at least 1, got {self.eval_every}")
        if self.lr is not None and not self.lr > 0:
            raise CaptError(f"the learning rate must be positive, got {self.lr}")
        if self.warmup < 0 or self.weight_decay < 0:
            raise CaptError("warmup and weight_decay must not be negative")
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            raise CaptError(f"warmup {self.warmup:g} is neither a fraction of the planned steps (below 1) nor a whole number of steps")
        if self.dtype not in ("fp32", "bf16"):
            raise CaptError(f"dtype {self.dtype!r} is not one of fp32, bf16")
        if self.device is not None:
            check_device(self.device)
        CapsuleConfig(self.integration, self.blocks)  # checks both

    @property
    def capsules(self) -> CapsuleConfig:
        return CapsuleConfig(self.integration, self.blocks)

    @property
    def method_config(self) -> MethodConfig:
        """What the run trains; linear-head has one class per candidate of the task."""
        classes = len(get_task(self.task).candidates) if self.method == "linear-head" else None
        return MethodConfig(self.method, self.n, classes, self.capsules if self.method == "capt" else None)

    def to_dict(self) -> dict:
        return asdict(self)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_device(device: str | None) -> str:
    """`device` (None: default_device()), refused in one line when torch cannot run on it here."""
    if device is None:
        return default_device()
    try:
        parsed = torch.device(device)
    except (RuntimeError, TypeError):
        raise CaptError(f"device {device!r} is not a torch device (use cpu, cuda or cuda:N)") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise CaptError(f"device {device} requested but no CUDA GPU is available")
        count = torch.cuda.device_count()
        if parsed.index is not None and parsed.index >= count:
            raise CaptError(f"device {device} requested but this machine has {count} CUDA GPU(s): cuda:0 .. cuda:{count - 1}")
    return device


# ---------------------------------------------------------------------------------------------
# Loss and batches


def batch_nll(model, data: Encoded, idx: list[int]) -> torch.Tensor:
    """(b,) fp32 negative log-likelihood of each example's gold target, summed over its tokens
    (linear-head: of its gold class)."""
    device = next(model.parameters()).device
    prompts = [data.prompts[i] for i in idx]
    # Decoder-only batches are right-padded: padding follows every real token, so causal attention
    # needs no mask (which keeps SDPA's causal path); the mask only locates tokens.
    if has_linear_head(model):  # the classifier reads the prompt's last token; the answer is a class index
        ids, mask = pad(prompts, device=device)  # (b, T), right-padded
        labels = torch.tensor([data.examples[i].label for i in idx], device=device)
        return F.cross_entropy(classify(model, ids, at=last_token(mask)).float(), labels, reduction="none")  # (b,)
    golds = [data.targets[i][data.examples[i].label] for i in idx]
    if data.seq2seq:  # T5: encoder input, decoder teacher-forced on the gold target
        ids, mask = pad(prompts, device=device)  # (b, T)
        dec_in = decoder_inputs(model, golds, device)  # (b, Td)
        target, target_mask = pad(golds, device=device)  # (b, Td)
        logits = model(ids, attention_mask=mask, decoder_input_ids=dec_in)  # (b, Td, V)
    else:  # decoder-only: prompt + answer; the capsule reads the prompt, logits only where answers are predicted
        ids, _ = pad([p + g for p, g in zip(prompts, golds)], device=device)  # (b, L), right-padded
        lengths = torch.tensor([len(p) for p in prompts], device=device)
        prompt_mask = torch.arange(ids.shape[1], device=device)[None] < lengths[:, None]  # (b, L): the prompt, no padding
        target, target_mask = pad(golds, device=device)  # (b, K)
        at = (lengths[:, None] - 1 + torch.arange(target.shape[1], device=device)[None]) * target_mask  # (b, K)
        logits = model(ids, prompt_mask=prompt_mask, logits_at=at)  # (b, K, V)
    nll = F.cross_entropy(logits.float().transpose(1, 2), target, reduction="none")  # (b, K)
    return (nll * target_mask).sum(1)


def bucketed_batches(lengths: list[int], batch_size: int, seed: int, epoch: int) -> list[list[int]]:
    """One epoch's batches of example indices: shuffle, sort by length within chunks, shuffle batches."""
    rng = random.Random(f"capt-batches:{seed}:{epoch}")
    order = list(range(len(lengths)))
    rng.shuffle(order)
    chunk = batch_size * CHUNK_BATCHES
    batches = []
    for start in range(0, len(order), chunk):
        part = sorted(order[start:start + chunk], key=lambda i: lengths[i])
        batches += [part[j:j + batch_size] for j in range(0, len(part), batch_size)]
    rng.shuffle(batches)
    return batches


def lr_factor(step: int, warmup: int, total: int) -> float:
    """Linear warm-up to 1 over `warmup` steps, then linear decay to 0 at `total`."""
    if step < warmup:
        return (step + 1) / warmup
    return max(0.0, (total - step) / max(1, total - warmup))


@contextmanager
def _hold_interrupt():
    """Delay Ctrl-C until the block ends, so an optimizer step and its bookkeeping are never split."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield
        return
    caught = []
    previous = signal.signal(signal.SIGINT, lambda *_: caught.append(True))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if caught:
        raise KeyboardInterrupt


# ---------------------------------------------------------------------------------------------
# The run directory


def make_directory(path) -> None:
    """Create the output directory `path` (and its parents), or say in one line why it cannot be."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise CaptError(f"--out {path} is a file, not a directory; choose another --out")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CaptError(f"cannot create the output directory {path}: {e.strerror or e}") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise CaptError(f"cannot write in the output directory {path}: permission denied")


def read_run_config(run) -> dict:
    """RUN/config.json of an existing run, with a clear error when there is none."""
    file = Path(run) / "config.json"
    if not file.is_file():
        raise CaptError(f"nothing to resume in {run}: it has no config.json (start a run there without --resume)")
    try:
        saved = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise CaptError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(saved, dict):
        raise CaptError(f"{file} does not hold a run's settings (a JSON object), but a {type(saved).__name__}")
    return saved


def _metrics_line(file: Path, number: int, text: str) -> dict:
    """Line `number` (from 1) of a metrics.jsonl, refused in one line when it is not a metrics record."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as e:
        raise CaptError(f"{file} line {number}: not valid JSON ({e})") from None
    if not isinstance(line, dict) or not isinstance(line.get("time"), (int, float)):
        raise CaptError(f"{file} line {number}: not a metrics record (a JSON object with a time)")
    return line


def check_resume(saved: dict, config: TrainConfig, run: Path) -> None:
    """Refuse to resume a run from another model or task, or with other result-changing settings."""
    sha = config_hash(config.model)
    if saved.get("model_config_sha256") != sha:
        raise CaptError(
            f"{run} was trained on a different model ({saved.get('model')}, config sha256 "
            f"{str(saved.get('model_config_sha256'))[:12]}), not {config.model} ({sha[:12]}); use a new --out"
        )
    if saved.get("task") != config.task:
        raise CaptError(f"{run} is a {saved.get('task')} run, not {config.task}; use a new --out")
    mine = config.to_dict()
    differ = [k for k in mine if k not in RESUMABLE_CHANGES and k in saved and saved[k] != mine[k]]
    if differ:
        detail = ", ".join(f"{k} {saved[k]!r} (given {mine[k]!r})" for k in differ)
        why = " (max_steps is the length of the learning-rate schedule)" if "max_steps" in differ else ""
        raise CaptError(f"{run} was trained with other settings: {detail}{why}; resume with the run's settings or use a new --out")


def _write_json(path: Path, obj) -> None:
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(obj, indent=2) + "\n"))


def _method_values(model) -> dict[str, torch.Tensor]:
    """A copy of the attached method's tensors on the CPU, by their file names (methods.method_tensors)."""
    return {k: p.detach().cpu().clone() for k, p in method_tensors(model).items()}


def _rng_states() -> dict:
    """The generators' states; CUDA's only once CUDA is in use (asking would start it on a CPU run)."""
    return {
        "python": random.getstate(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
    }


def _restore_cuda_rng(states: list) -> None:
    """Restore saved CUDA generator states on the GPUs this machine has (it may have fewer than the saver).

    Training draws nothing from them (dropout is absent, random initial values come from a CPU
    generator), so a state left out changes no result."""
    if not states or not torch.cuda.is_available():
        return
    for index in range(min(len(states), torch.cuda.device_count())):
        torch.cuda.set_rng_state(states[index], index)


def _set_method(model, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for k, p in method_tensors(model).items():
            p.copy_(values[k])


def _upgrade_state(state: dict) -> dict:
    """A version-1 state.pt (capsules as {block index: vector}) in the version-2 form (tensors by file name)."""
    if state.get("version") == 1 and "capsules" in state:
        state["tensors"] = {f"layers.{i}": v for i, v in state.pop("capsules").items()}
        best = state["train"].get("best")
        if best is not None:
            best["tensors"] = {f"layers.{i}": v for i, v in best.pop("capsules").items()}
        state["version"] = STATE_VERSION
    return state


# ---------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    """One run: set up (fresh or resumed) in __init__, then fit() and test()."""

    def __init__(self, config: TrainConfig, resume: bool = False, model=None, tokenizer=None, progress: bool = True):
        self.config, self.progress = config, progress
        self.run = run = Path(config.out)
        if config.method == "instance":
            raise CaptError("instance trains nothing (its capsule vectors are held at zero): "
                            "evaluate it with capt eval --method instance (capt run --method instance reports it per task)")
        config.device = config.device or default_device()
        family = read_config(config.model)["model_type"]
        if config.method == "linear-head" and family == "t5":
            raise CaptError("linear-head is for decoder-only models (Llama, Qwen2); T5 scores targets with its decoder")
        if resume:
            saved = read_run_config(run)
            if config.lr is None:
                config.lr = saved.get("lr")
            check_resume(saved, config, run)
            if not (run / "state.pt").is_file():  # its start was cut short before the first state
                raise CaptError(f"nothing to resume in {run}: it has no state.pt (start the run again without --resume)")
        elif (run / "state.pt").exists():  # state.pt, written last at the start, is what makes a run
            raise CaptError(f"{run} already holds a run; pass --resume to continue it or choose another --out")
        else:
            make_directory(run)  # before anything is loaded
        if config.lr is None:
            config.lr = default_lr(family, config.method)

        # Data first (cheap, and the likeliest to be wrong), then the model.
        data_dir = resolve_data_dir(config.data)
        self.examples = {split: load_task(config.task, data_dir, split, config.seed) for split in ("train", "validation", "test")}
        self.data_dir = data_dir
        if model is not None:
            detach(model)  # a method attached by an earlier run goes (its fp32 tensors would come first below)
            weights = next(model.parameters())
            if weights.dtype != DTYPES[config.dtype]:
                raise CaptError(f"the model passed in holds {weights.dtype} weights, but dtype is {config.dtype}")
            config.device = str(weights.device)
        self.model = model if model is not None else load_model(config.model, config.dtype, config.device)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        # the method's fresh tensors (random ones drawn from the seed), backbone frozen
        self.method = attach(self.model, config.method_config, generator=torch.Generator().manual_seed(config.seed))
        seq2seq = is_seq2seq(self.model)
        self.train_data = encode_examples(self.examples["train"], self.tokenizer, seq2seq, config.max_length)
        self.val_data = encode_examples(self.examples["validation"], self.tokenizer, seq2seq, config.max_length)
        self.lengths = [len(p) + len(t[ex.label]) for p, t, ex in zip(self.train_data.prompts, self.train_data.targets, self.train_data.examples)]

        batches_per_epoch = math.ceil(len(self.train_data) / config.batch_size)
        self.steps_per_epoch = math.ceil(batches_per_epoch / config.grad_accum)
        self.total_steps = config.epochs * self.steps_per_epoch  # the planned steps: the schedule spans them
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        if resume and saved.get("planned_steps", self.total_steps) != self.total_steps:
            raise CaptError(
                f"{run} planned its learning-rate schedule over {saved['planned_steps']} steps, but these settings and data "
                f"give {self.total_steps}; resume with the run's settings and data or use a new --out"
            )
        warmup = round(config.warmup * self.total_steps) if config.warmup < 1 else int(config.warmup)
        warmup = min(warmup, self.total_steps)  # a longer warm-up ends at the last planned step
        self.params = [p for p in self.model.parameters() if p.requires_grad]  # the method's tensors, fp32
        self.trainable = sum(p.numel() for p in self.params)
        self.base_parameters = sum(p.numel() for p in self.model.parameters()) - self.trainable
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        total = self.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, warmup, total))
        self.state = {
            "epoch": 0, "pos": 0, "step": 0,  # position: epoch, optimizer steps done in it, steps done in all
            "best": None, "bad": 0, "n_evals": 0, "last_eval_step": -1,
            "loss_sum": 0.0, "loss_n": 0,  # training loss since the last evaluation
            "elapsed": 0.0, "finished": False, "stopped": None,
        }
        self.metrics: list[dict] = []
        self._plans: dict[int, list] = {}
        self.started = time.time()

        n = f" (n {config.n})" if config.n is not None else ""
        self._log(f"{config.method}{n} on {config.task}: {trainable_summary(self.model)}")
        if resume:
            self._load_state()
        else:
            random.seed(config.seed)
            torch.manual_seed(config.seed)
            _write_json(run / "config.json", self._describe(family))
            self._save_state()  # from here on the directory holds a run

    @property
    def _what(self) -> str:
        """What the run trains, in messages: "capsules" or "<method> tensors"."""
        return "capsules" if self.config.method == "capt" else f"{self.config.method} tensors"

    # -- files ------------------------------------------------------------------------------

    def _describe(self, family: str) -> dict:
        c = self.config
        return {
            "capt_version": __version__,
            **c.to_dict(),
            "model": str(Path(c.model).absolute()),
            "data": str(Path(self.data_dir).absolute()),
            "model_config_sha256": self.model.source["config_sha256"] if hasattr(self.model, "source") else config_hash(c.model),
            "model_type": family,
            "capsules": c.capsules.to_dict() if c.method == "capt" else None,
            "method_config": self.method.to_dict(),
            "trainable_parameters": self.trainable,
            "base_parameters": self.base_parameters,
            "examples": {split: len(ex) for split, ex in self.examples.items()},
            "steps_per_epoch": self.steps_per_epoch,
            "planned_steps": self.total_steps,
        }

    def _save_state(self) -> None:
        now = time.time()  # the run's clock: time since the last save goes into elapsed
        self.state["elapsed"] += now - self.started
        self.started = now
        st = dict(self.state)
        state = {
            "version": STATE_VERSION,
            "task": self.config.task,
            "tensors": _method_values(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": _rng_states(),
            "train": st,
        }
        atomic_write(self.run / "state.pt", lambda tmp: torch.save(state, tmp))

    def _load_state(self) -> None:
        file = self.run / "state.pt"
        try:
            state = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for a damaged file
            raise CaptError(f"{file} cannot be read ({type(e).__name__}: {e})".replace("\n", " ")) from None
        if not isinstance(state, dict):
            raise CaptError(f"{file} is not a training state: it holds a {type(state).__name__}, not a dict")
        try:
            state = _upgrade_state(state)
        except (KeyError, TypeError, AttributeError) as e:
            raise CaptError(f"{file} is a damaged version-1 training state ({type(e).__name__}: {e})") from None
        missing = [k for k in STATE_KEYS if k not in state]
        if not missing:
            train = state["train"] if isinstance(state["train"], dict) else {}
            missing = [f"train.{k}" for k in self.state if k not in train]
        if missing:
            raise CaptError(f"{file} is not a complete training state: it lacks {', '.join(missing)}")
        if state["version"] != STATE_VERSION or state["task"] != self.config.task:
            raise CaptError(f"{file} is not a training state for this run")
        if not isinstance(state["tensors"], dict) or set(state["tensors"]) != set(method_tensors(self.model)):
            raise CaptError(f"{file} holds other tensors than this run's {self.config.method} has")
        try:
            _set_method(self.model, state["tensors"])
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])
            random.setstate(state["rng"]["python"])
            torch.set_rng_state(state["rng"]["torch"])
            _restore_cuda_rng(state["rng"]["cuda"])
        except (KeyError, IndexError, TypeError, ValueError, RuntimeError) as e:
            raise CaptError(f"{file} is a damaged training state ({type(e).__name__}: {e})".replace("\n", " ")) from None
        self.state = state["train"]
        # what was written after the state was saved is redone: extra metric lines, best/, and
        # test.json unless the run had finished (then its test stands and is reused)
        log = self.run / "metrics.jsonl"
        lines = log.read_text().splitlines() if log.is_file() else []
        if len(lines) < self.state["n_evals"]:
            raise CaptError(f"{log} has {len(lines)} lines, but {file} counts {self.state['n_evals']} evaluations")
        self.metrics = [_metrics_line(log, i + 1, line) for i, line in enumerate(lines[: self.state["n_evals"]])]
        self._write_metrics()
        self._write_best()
        if not self.state["finished"]:
            (self.run / "test.json").unlink(missing_ok=True)
        self.started = time.time()  # the clock goes on from the saved elapsed

    def _write_metrics(self) -> None:
        text = "".join(json.dumps(m) + "\n" for m in self.metrics)
        atomic_write(self.run / "metrics.jsonl", lambda tmp: Path(tmp).write_text(text))

    def _write_best(self) -> None:
        """RUN/best/ from the best tensors in the state (removed when there are none yet)."""
        best = self.state["best"]
        if best is None:
            shutil.rmtree(self.run / "best", ignore_errors=True)
            return
        current = _method_values(self.model)
        _set_method(self.model, best["tensors"])
        save_method(self.model, self.run / "best")
        _set_method(self.model, current)

    # -- training ---------------------------------------------------------------------------

    def _log(self, message: str) -> None:
        if self.progress:
            tqdm.write(message, file=sys.stderr)

    def _plan(self, epoch: int) -> list[list[list[int]]]:
        """The epoch's optimizer steps, each a list of batches (lists of example indices)."""
        if epoch not in self._plans:
            c = self.config
            batches = bucketed_batches(self.lengths, c.batch_size, c.seed, epoch)
            self._plans = {epoch: [batches[i:i + c.grad_accum] for i in range(0, len(batches), c.grad_accum)]}
        return self._plans[epoch]

    def _step(self, group: list[list[int]]) -> float:
        """One optimizer step over the batches of `group`; returns the mean example loss."""
        n = sum(len(idx) for idx in group)
        losses = []
        for idx in group:
            loss = batch_nll(self.model, self.train_data, idx).sum() / n
            loss.backward()
            losses.append(loss.detach())
        total = torch.stack(losses).sum().item()  # one device sync per step
        if not math.isfinite(total):
            self._diverged(total)
        st = self.state
        with _hold_interrupt():
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            st["step"] += 1
            st["pos"] += 1
            st["loss_sum"] += total * n
            st["loss_n"] += n
        return total

    def _diverged(self, loss: float) -> None:
        st, run = self.state, self.run
        best = st["best"]
        if best is None:
            kept = f"no validation evaluation had finished, so there are no best {self._what}"
        else:
            kept = f"the best {self._what} so far are kept in {run / 'best'} (validation {best['headline']:.2f} at step {best['step']})"
        raise TrainingDiverged(
            f"the training loss became {loss} at step {st['step'] + 1} (epoch {st['epoch'] + 1}), so training stopped; "
            f"{kept}; a lower learning rate than {self.config.lr:g} (or --dtype fp32) may help"
        )

    def _eval_due(self, plan_len: int) -> bool:
        st, every = self.state, self.config.eval_every
        if st["step"] == 0 or st["last_eval_step"] == st["step"]:
            return False
        return st["pos"] == plan_len or (every is not None and st["step"] % every == 0)

    def _evaluate(self, final: bool = False) -> None:
        """Validation, early-stopping bookkeeping (unless final: the run's last), a metrics line, best/ and state.pt."""
        c, st = self.config, self.state
        result = evaluate(self.model, self.tokenizer, data=self.val_data, batch_size=c.eval_batch_size, progress=self.progress)
        metrics, loss = result["metrics"], result["loss"]
        best = st["best"]
        better = best is None or metrics["headline"] > best["headline"] or (metrics["headline"] == best["headline"] and loss < best["loss"])
        with _hold_interrupt():
            epoch = st["epoch"] + st["pos"] / len(self._plan(st["epoch"]))
            line = {
                "epoch": round(epoch, 4),
                "step": st["step"],
                "train_loss": st["loss_sum"] / st["loss_n"] if st["loss_n"] else None,
                "validation": {**metrics, "loss": loss},
                "best": better,
                "lr": self.optimizer.param_groups[0]["lr"],
                "time": round(st["elapsed"] + time.time() - self.started, 2),
            }
            if better:
                st["best"] = {"headline": metrics["headline"], "loss": loss, "step": st["step"], "epoch": line["epoch"],
                              "validation": metrics, "tensors": _method_values(self.model)}
                st["bad"] = 0
                save_method(self.model, self.run / "best")
            else:
                st["bad"] += 1
            st["n_evals"] += 1
            st["last_eval_step"] = st["step"]
            st["loss_sum"], st["loss_n"] = 0.0, 0
            if st["bad"] >= c.patience and not final:
                st["finished"], st["stopped"] = True, "early_stopping"
            self.metrics.append(line)
            self._write_metrics()
            self._save_state()
        extra = ", ".join(f"{k} {v:.2f}" for k, v in metrics.items() if k != "headline")
        train = f"train loss {line['train_loss']:.4f}, " if line["train_loss"] is not None else ""
        self._log(f"epoch {line['epoch']:g} step {st['step']}: {train}validation {extra} (loss {loss:.4f}){' best' if better else ''}")

    def fit(self, *, stop_after: int | None = None) -> None:
        """Train until early stopping, the last epoch or max_steps; Ctrl-C saves the state first.

        stop_after: stop (as if interrupted) once the run has done this many optimizer steps in all,
        after the evaluations due by then, saving the state and raising Interrupted; for tests and
        time-boxed jobs. Unlike max_steps it changes nothing in the run: resuming it continues exactly.
        train() checks it (0 or more) before anything is written.
        """
        c, st = self.config, self.state
        if st["finished"]:
            return
        planned = self.total_steps
        bar = tqdm(total=planned, initial=min(st["step"], planned), unit="step", desc=f"{c.task} seed {c.seed}",
                   disable=not self.progress, dynamic_ncols=True, file=sys.stderr)
        seen, clock = 0, time.time()
        try:
            while True:
                if st["epoch"] >= c.epochs:
                    st["finished"], st["stopped"] = True, "epochs"
                    break
                plan = self._plan(st["epoch"])
                if self._eval_due(len(plan)):
                    self._evaluate()
                    if st["finished"]:
                        break
                    continue
                if st["pos"] == len(plan):  # the epoch is done and evaluated
                    with _hold_interrupt():
                        st["epoch"], st["pos"] = st["epoch"] + 1, 0
                        self._save_state()
                    continue
                if c.max_steps is not None and st["step"] >= c.max_steps:
                    if st["last_eval_step"] != st["step"]:  # stopped between evaluations: one more, the last
                        self._evaluate(final=True)
                    st["finished"], st["stopped"] = True, "max_steps"
                    break
                if stop_after is not None and st["step"] >= stop_after:
                    raise KeyboardInterrupt
                group = plan[st["pos"]]
                loss = self._step(group)
                seen += sum(len(idx) for idx in group)
                bar.update(1)
                bar.set_postfix(loss=f"{loss:.4f}", ex_s=f"{seen / max(time.time() - clock, 1e-9):.1f}", refresh=False)
            bar.close()
            self._save_state()
        except KeyboardInterrupt:
            bar.close()
            self._save_state()
            raise Interrupted(
                f"interrupted at step {st['step']}; the training state is saved in {self.run / 'state.pt'}; "
                f"continue with: capt train --out {self.run} --resume"
            ) from None

    def test(self) -> dict:
        """The best tensors on the test set; writes RUN/test.json and returns its contents."""
        st, c = self.state, self.config
        train_seconds = st["elapsed"]  # training and validation, up to fit()'s last save: the test is not counted
        best = st["best"]  # fit() always ends with an evaluation of the last step
        _set_method(self.model, best["tensors"])
        result = evaluate(self.model, self.tokenizer, self.examples["test"], batch_size=c.eval_batch_size, max_length=c.max_length, progress=self.progress)
        out = {
            "task": c.task,
            "split": "test",
            "n": result["n"],
            "metrics": result["metrics"],
            "loss": result["loss"],
            "best": {k: best[k] for k in ("epoch", "step", "validation")},
            "steps": st["step"],
            "stopped": st["stopped"],
            "method": c.method,
            "method_config": self.method.to_dict(),  # its "n": vectors per place (prompt, deep-prompt, prefix)
            "trainable_parameters": self.trainable,
            "train_seconds": round(train_seconds, 3),
        }
        _write_json(self.run / "test.json", out)
        return out


def train(config: TrainConfig, *, resume: bool = False, model=None, tokenizer=None, progress: bool = True,
          stop_after: int | None = None) -> dict:
    """Train the config's method for one task and seed; return the test results (also in RUN/test.json).

    model / tokenizer: an already loaded base model (with or without a method attached: it is
    replaced) and its tokenizer, to save loading them again; otherwise they are loaded from
    config.model. On return the model carries the best tensors of the method.
    stop_after: stop (as if interrupted) after this many optimizer steps of the run in all, saving
    the state; for tests and time-boxed jobs. The schedule is unchanged (config.max_steps sets it),
    so resuming continues exactly as if the run had not stopped.
    Raises TrainingDiverged (a CaptError) on a NaN / infinite loss and Interrupted on Ctrl-C or stop_after;
    CaptError for method instance (nothing to train) and for linear-head on T5.
    """
    if stop_after is not None and stop_after < 0:
        raise CaptError(f"stop_after must be 0 or more, got {stop_after}")
    trainer = Trainer(config, resume=resume, model=model, tokenizer=tokenizer, progress=progress)
    if trainer.state["finished"] and (trainer.run / "test.json").is_file():
        best = trainer.state["best"]
        _set_method(trainer.model, best["tensors"])
        return json.loads((trainer.run / "test.json").read_text())
    trainer.fit(stop_after=stop_after)
    return trainer.test()


# ---------------------------------------------------------------------------------------------
# Several tasks and seeds: the paper-style table


def missing_data(task: str, data_dir) -> str | None:
    """Why the task's official train or val file is absent from data_dir, or None when both are there."""
    from .tasks import _task_dir

    try:
        folder = _task_dir(get_task(task), Path(data_dir))
    except CaptError as e:
        return str(e)
    for name in ("train.jsonl", "val.jsonl"):
        if not (folder / name).is_file():
            return f"no official {name} in {folder}"
    return None


def resolve_tasks(tasks: str | list[str], data_dir) -> tuple[list[str], dict[str, str]]:
    """(tasks to run, {skipped task: reason}). "all" skips tasks whose files are missing; named tasks must exist."""
    every = isinstance(tasks, str) and tasks.strip().lower() == "all"
    if isinstance(tasks, str):
        tasks = list(TASKS) if every else [t for t in tasks.split(",") if t.strip()]
    names = list(dict.fromkeys(get_task(t.strip()).name for t in tasks))
    if not names:
        raise CaptError("no task given: use --tasks all or a comma-separated list such as cb,copa")
    skipped = {}
    for name in names:
        reason = missing_data(name, data_dir)
        if reason is not None:
            if not every:
                raise CaptError(f"task {name}: {reason}")
            skipped[name] = reason
    return [n for n in names if n not in skipped], skipped


SEARCHABLE = ("prompt", "deep-prompt", "prefix")  # the methods whose prompt length run_tasks can search
LABELS = {"capt": "CaPT", "prompt": "prompt tuning", "deep-prompt": "deep prompt tuning", "prefix": "P-Tuning v2",
          "linear-head": "linear head", "instance": "instance"}


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
    trained with every seed (OUT/<task>/n<L>/seed<k>), the length with the best mean validation
    headline is kept (ties: the shorter) and its test results are reported; every run's time
    counts in the task's train_seconds. Method instance trains nothing: each task's test set is
    evaluated once with the zero capsule (OUT/<task>/instance.json), a zero-shot-like column.
    With resume, finished runs are reused and interrupted ones continued.
    """
    if not seeds:
        raise CaptError("no seeds to run")
    started, commit = time.time(), code_version()  # the code that runs is the code of the start
    out = Path(out)
    given = options.get("data") or ("$CAPT_DATA" if os.environ.get("CAPT_DATA") else None)
    data_dir = resolve_data_dir(options.get("data"))
    names, skipped = resolve_tasks(tasks, data_dir)
    if not names:
        raise CaptError(f"no task has its train and val files in {data_dir}: {'; '.join(skipped.values())}")
    options = dict(options, data=str(data_dir))
    probe = TrainConfig(model=model_path, task=names[0], out=str(out), **options)  # checks the options once
    method = probe.method
    if lengths is not None:
        if method not in SEARCHABLE:
            raise CaptError(f"lengths are searched for {', '.join(SEARCHABLE)}, not for {method}")
        if options.get("n") is not None:
            raise CaptError("give the prompt length either as n or as lengths to search, not both")
        if not lengths or min(lengths) < 1:
            raise CaptError(f"lengths must be a non-empty list of lengths of at least 1, got {lengths}")
        lengths = sorted(set(int(n) for n in lengths))
    model_config = read_config(model_path)
    if method == "linear-head" and model_config["model_type"] == "t5":
        raise CaptError("linear-head is for decoder-only models (Llama, Qwen2); T5 scores targets with its decoder")
    if method == "instance":
        seeds = []  # nothing is trained, so no seed changes anything
    device = probe.device or default_device()
    make_directory(out)  # before the model is loaded
    model = load_model(model_path, probe.dtype, device)
    detach(model)
    base_parameters = sum(p.numel() for p in model.parameters())
    tokenizer = load_tokenizer(model_path)
    seq2seq = is_seq2seq(model)

    zero_shot, test_data = {}, {}
    for name in names:  # before any method is attached
        examples = load_task(name, data_dir, "test")
        test_data[name] = encode_examples(examples, tokenizer, seq2seq, probe.max_length)
        zero_shot[name] = evaluate(model, tokenizer, data=test_data[name], batch_size=probe.eval_batch_size, progress=progress)["metrics"]
        _write_json(out / name / "zero_shot.json", {"task": name, "split": "test", "n": len(examples), "metrics": zero_shot[name]})

    done: dict[str, dict] = {}
    for name in names:
        if method == "instance":  # the zero capsule on the test set, once
            attach(model, "instance")
            result = evaluate(model, tokenizer, data=test_data[name], batch_size=probe.eval_batch_size, progress=progress)
            detach(model)
            file = out / name / "instance.json"
            _write_json(file, {"task": name, "split": "test", "n": result["n"], "method": "instance", "metrics": result["metrics"],
                               "loss": result["loss"], "trainable_parameters": 0, "train_seconds": 0.0})
            done[name] = {"runs": [{"seed": None, "run": str(file), "test": result["metrics"], "steps": 0, "train_seconds": 0.0}],
                          "n": None, "search": None}
            continue
        searched = {}
        for n in lengths or [probe.n]:
            searched[n] = []
            for seed in seeds:
                run_dir = out / name / (f"n{n}" if lengths else "") / f"seed{seed}"
                config = TrainConfig(model=model_path, task=name, out=str(run_dir), seed=seed, **dict(options, device=device, n=n))
                again = resume and (run_dir / "state.pt").is_file()
                try:
                    result = train(config, resume=again, model=model, tokenizer=tokenizer, progress=progress)
                    searched[n].append({"seed": seed, "run": str(run_dir), "test": result["metrics"], "steps": result["steps"],
                                        "best_step": result["best"]["step"], "validation": result["best"]["validation"],
                                        "train_seconds": result.get("train_seconds")})
                except TrainingDiverged as e:
                    searched[n].append({"seed": seed, "run": str(run_dir), "failed": str(e), "train_seconds": _logged_seconds(run_dir)})
                except Interrupted:
                    where = f"{name} n {n} seed {seed}" if lengths else f"{name} seed {seed}"
                    raise Interrupted(
                        f"interrupted during {where}; finished runs and the training state are kept in {out}; "
                        "continue with the same capt run command plus --resume"
                    ) from None
        done[name] = choose_length(searched) if lengths else {"runs": searched[probe.n], "n": probe.n, "search": None}

    trainable = {name: trainable_count(model_config, replace_task(probe, name, done[name]["n"]).method_config) for name in names}
    info = {"method": method, "lengths": lengths, "base_parameters": base_parameters, "trainable": trainable}
    settings = dict(options, lr=config_lr(model, options), data=given or str(data_dir))  # data as given, not this machine's path
    results = summarize(model, model_path, names, skipped, seeds, zero_shot, done, settings, info)
    results["data_files"] = data_files(data_dir, names)  # what it was, to the byte
    results["environment"] = environment(device, started, commit)
    _write_json(out / "results.json", results)
    atomic_write(out / "results.md", lambda tmp: Path(tmp).write_text(results_markdown(results)))
    return results


def data_files(data_dir: Path, names: list[str]) -> dict:
    """sha256 of each task's train.jsonl and val.jsonl, the files a table was made from."""
    return {name: {split: hashlib.sha256((data_dir / get_task(name).dirname / split).read_bytes()).hexdigest()
                   for split in ("train.jsonl", "val.jsonl")} for name in names}


def replace_task(config: TrainConfig, task: str, n: int | None) -> TrainConfig:
    """The same settings for another task and n (checked again)."""
    return TrainConfig(**dict(config.to_dict(), task=task, n=n))


def _logged_seconds(run: Path) -> float | None:
    """Training time of a run that did not finish, from its last metrics line (None without one)."""
    file = run / "metrics.jsonl"
    lines = file.read_text().splitlines() if file.is_file() else []
    return _metrics_line(file, len(lines), lines[-1])["time"] if lines else None


def _validation_mean(runs: list[dict]) -> float | None:
    heads = [r["validation"]["headline"] for r in runs if "validation" in r]
    return statistics.fmean(heads) if heads else None


def choose_length(searched: dict[int, list[dict]]) -> dict:
    """The searched length with the best mean validation headline over its seeds (ties: the shorter)."""
    scored = {n: _validation_mean(runs) for n, runs in searched.items()}
    ranked = [n for n in sorted(searched) if scored[n] is not None]
    chosen = max(ranked, key=lambda n: scored[n]) if ranked else min(searched)  # max keeps the first of equals
    search = {
        "by": "mean validation headline over the seeds",
        "chosen": chosen,
        "lengths": [{"n": n, "validation": scored[n], "train_seconds": _seconds(runs), "runs": runs} for n, runs in sorted(searched.items())],
    }
    return {"runs": searched[chosen], "n": chosen, "search": search}


def _seconds(runs: list[dict]) -> float:
    return round(sum(r.get("train_seconds") or 0.0 for r in runs), 3)


def config_lr(model, options: dict) -> float:
    return options.get("lr") or default_lr(model.source["model_type"], options.get("method", "capt"))


def _mean_std(values: list[float]) -> tuple[float | None, float | None]:
    if not values:
        return None, None
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def code_version(here: Path = Path(__file__).resolve().parent) -> str | None:
    """The git commit of the code in `here` (this package) with "+dirty" when files there have
    local changes (an edited README elsewhere does not count), or None outside a git checkout."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here, capture_output=True, text=True, timeout=10).stdout.strip()
        return (commit + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):  # no git
        return None


def environment(device, started: float, commit: str | None) -> dict:
    """How a table was made: the command, the code (commit read when the run started), the machine, the time."""
    device = torch.device(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{platform.machine()} CPU, {torch.get_num_threads()} threads"
    return {
        "command": " ".join(["capt"] + sys.argv[1:]) if Path(sys.argv[0]).name in ("capt", "__main__.py") else " ".join(sys.argv),
        "commit": commit,
        "device": name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)),
        "wall_seconds": round(time.time() - started, 1),
    }


def summarize(model, model_path, names, skipped, seeds, zero_shot, done, options, info) -> dict:
    """The results.json structure: the method and its size, per task zero-shot, per-seed tests, mean and
    sample std, training time (a length search's runs included) and the search itself."""
    tasks = {}
    base = info["base_parameters"]
    for name in TASKS:
        if name in skipped:
            tasks[name] = {"skipped": skipped[name]}
            continue
        if name not in names:
            continue
        task, runs = get_task(name), done[name]["runs"]
        ok = [r for r in runs if "test" in r]
        metrics = {}
        for key in task.metrics:
            mean, std = _mean_std([r["test"][key] for r in ok])
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
            "train_seconds": _seconds(every),
            "runs": runs,
        }
        if search:
            tasks[name]["search"] = search
    average = None
    if all(name in tasks and tasks[name].get("mean") is not None for name in TASKS):
        per_seed = []
        for seed in seeds:
            row = {name: next((r["test"] for r in tasks[name]["runs"] if r["seed"] == seed and "test" in r), None) for name in TASKS}
            if all(v is not None for v in row.values()):
                per_seed.append(paper_average(row))
        mean, std = _mean_std(per_seed)
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
        "model": str(model_path),  # as given; the config hash identifies it
        "model_type": model.source["model_type"],
        "model_config_sha256": model.source["config_sha256"],
        "method": info["method"],
        "n": ns.pop() if len(ns) == 1 else None,  # per task in tasks[...]["n"] when a search chose differently
        "lengths": info["lengths"],
        "trainable_parameters": count,  # None when tasks differ (linear-head: one class per candidate); per task in tasks
        "trainable_percent": None if count is None else 100 * count / base,
        "base_parameters": base,
        "train_seconds": round(sum(t["train_seconds"] for t in tasks.values() if "train_seconds" in t), 3),
        "seeds": list(seeds),
        "settings": settings,
        "split": "test = the official SuperGLUE validation set; std = sample standard deviation over seeds",
        "tasks": tasks,
        "average": average,
    }


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _mean_pm(mean: float | None, std: float | None) -> str:
    """"mean ± std", or the mean alone when there is no spread (one evaluation), "-" without a mean."""
    if mean is None:
        return "-"
    return _fmt(mean) if std is None else f"{_fmt(mean)} ± {_fmt(std)}"


def _size(results: dict) -> str:
    """The trainable count and its share of the base parameters, for the header."""
    base = results["base_parameters"]
    if results["trainable_parameters"] is not None:
        return f"trainable params {results['trainable_parameters']:,} ({results['trainable_percent']:.4f}% of {base:,} base params)"
    per_task = ", ".join(f"{name} {t['trainable_parameters']:,} ({t['trainable_percent']:.4f}%)"
                         for name, t in results["tasks"].items() if "trainable_parameters" in t)
    return f"trainable params per task: {per_task} (of {base:,} base params)"


def results_markdown(results: dict) -> str:
    """The paper-style table of results.json as Markdown."""
    s, method = results["settings"], results["method"]
    label = LABELS[method]
    if results["lengths"]:
        length = f", n searched over {', '.join(map(str, results['lengths']))}"
    else:
        length = f", n {results['n']}" if results["n"] is not None else ""
    trained = "Nothing is trained: one evaluation per task with the capsule vectors at zero." if method == "instance" else (
        f"Seeds {', '.join(map(str, results['seeds']))}. "
        + (f"Capsules: {s.get('integration', 'add')}, blocks {s.get('blocks', 'all')}. " if method == "capt" else "")
        + f"lr {s.get('lr')}, batch {s.get('batch_size', 16)} x {s.get('grad_accum', 1)}, epochs {s.get('epochs', 50)}, "
        f"patience {s.get('patience', 5)}, max steps {s.get('max_steps')}, dtype {s.get('dtype', 'fp32')}.")
    spread = "one evaluation" if method == "instance" else "the mean ± sample std over seeds"
    searched = method in SEARCHABLE
    lines = [
        "# Capsule Prompt-Tuning results",
        "",
        f"Method: {label} (`{method}`{length}), {_size(results)}.",
        "",
        f"Model `{results['model']}` ({results['model_type']}, config sha256 {results['model_config_sha256'][:12]}), "
        f"capt {results['capt_version']}. {trained}",
        "",
        f"Test = the official validation set. Scores in percent; {label} is {spread}.",
        "",
        f"| task | metric | zero-shot | {label} | per seed | other metrics |{' n |' if searched else ''} train s | note |",
        f"| --- | --- | --- | --- | --- | --- |{' --- |' if searched else ''} --- | --- |",
    ]
    for name, t in results["tasks"].items():
        if "skipped" in t:
            lines.append(f"| {name} | {get_task(name).metrics[0]} | - | - | - | - |{' - |' if searched else ''} - | skipped: {t['skipped']} |")
            continue
        per_seed = ", ".join(_fmt(r["test"][t["metric"]]) if "test" in r else "failed" for r in t["runs"]) if method != "instance" else "-"
        others = "; ".join(
            f"{k} {_mean_pm(v['mean'], v['std'])} (zero-shot {_fmt(t['zero_shot'][k])})" for k, v in t["metrics"].items() if k != t["metric"]
        ) or "-"
        failed = [r for r in t["runs"] if "failed" in r]
        note = f"{len(failed)} run(s) diverged: {failed[0]['failed']}" if failed else ""
        score = _mean_pm(t["mean"], t["std"])
        n = f" {t['n']} |" if searched else ""
        lines.append(f"| {name} | {t['metric']} | {_fmt(t['zero_shot'][t['metric']])} | {score} | {per_seed} | {others} |{n} "
                     f"{t['train_seconds']:.1f} | {note} |")
    a = results["average"]
    if a is not None:
        lines.append(f"| **average (6 tasks)** | headline | {_fmt(a['zero_shot'])} | {_mean_pm(a['mean'], a['std'])} | "
                     f"{', '.join(map(_fmt, a['per_seed'])) or '-'} | - |{' - |' if searched else ''} - | plain mean of the six headlines |")
    else:
        lines += ["", "No six-task average: it needs all six tasks."]
    runs = sum(sum(len(e["runs"]) for e in t["search"]["lengths"]) if "search" in t else len(t.get("runs", []))
               for t in results["tasks"].values())
    search = ""
    if results["lengths"]:
        search = (f", the prompt length search included ({len(results['lengths'])} lengths x {len(results['seeds'])} seed(s) per task, "
                  "the length with the best mean validation headline kept)")
    if method == "instance":
        lines += ["", "Training time: none (nothing is trained)."]
    else:
        lines += ["", f"Training time: {results['train_seconds']:.1f} s in all over {runs} run(s){search}; "
                      "wall time of training and validation, per task in the table."]
    if results["lengths"]:
        lines += ["", "Length search, mean validation headline per n (the chosen n in bold):", ""]
        for name, t in results["tasks"].items():
            if "search" in t:
                chosen = t["search"]["chosen"]
                cells = ", ".join((f"**{e['n']}: {_fmt(e['validation'])}**" if e["n"] == chosen else f"{e['n']}: {_fmt(e['validation'])}")
                                  + f" ({e['train_seconds']:.1f} s)" for e in t["search"]["lengths"])
                lines.append(f"- {name}: {cells}")
    env = results.get("environment")
    if env:
        lines += ["", f"Made by `{env['command']}` at commit {env['commit'] or 'unknown'} on {env['device']} "
                      f"(torch {env['torch']}, Python {env['python']}), {env['date']}, {env['wall_seconds']:.0f} s in all."]
    return "\n".join(lines) + "\n"
