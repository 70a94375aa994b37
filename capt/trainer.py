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

The run directory: capt/rundir.py. A resumed run continues from state.pt and redoes what was
written after it, so it ends exactly like an uninterrupted one (bit-identical on the CPU).

Under torchrun (capt/distributed.py) every rank runs this same loop on its part of each batch
and the gradients are summed; evaluations are shared by the ranks; rank 0 decides early stopping,
reads the run directory and writes it.

Choices:
- Validation after every epoch (and every `eval_every` steps if set). Early stopping on the
  task's headline metric (select "headline"): an evaluation is better when its headline is higher,
  or equal with a lower validation loss (tiny validation sets often tie); select "loss": when its
  validation gold NLL is lower. Training stops after `patience` evaluations without a better one,
  or after `epochs`. train_rows / validation_rows cap the splits to a seeded sample.
- Learning rate: linear warm-up over `warmup` (a fraction of the planned steps if below 1, else
  whole steps, at most the planned steps), then linear decay to zero at the last planned step:
  epochs x steps-per-epoch, or `max_steps` when fewer (the run's budget; like every setting that
  changes the result, it cannot change on resume).
- The per-block step scale (capt/stepscale.py), the default for capt and deep-prompt, an option
  for prefix: block l's rate is lr x c_l, c_l the size of block l's mean-pooled input (prefix: of
  the layer's own keys and values), measured before the first step; lr is then the step relative
  to that size, r (default methods.METHODS scaled_lr: the sweep in
  results/smollm2-135m-cpu-step-scale). step_scale "none": one rate for every tensor.
- Default learning rate with one rate (methods.METHODS lr): 0.3 for capt, prompt and deep-prompt in every family;
  1e-2 for prefix and 1e-3 for linear-head. For T5, 0.3 is soft-prompt practice; the rest comes from sweeps on
  SmolLM2-135M-Instruct and CB (docs/method.md, "Training", has the table). Weight decay 0 (the
  capsules start at zero).
- Inputs: SuperGLUE inputs end in the answer cue for decoder-only models (answer_cue, tasks.render).
- Batches: shuffled per epoch, then sorted by length within chunks of 16 batches, then the
  batches shuffled; all from `seed` and the epoch number. The last chunk's remainder is spread
  over its batches (their sizes differ by at most one), so no optimizer step rests on a handful
  of examples (CB's 225 rows: 15 batches of 15, not 14 of 16 and one of 1). `seed` also picks the train /
  validation split, seeds Python's and torch's generators and draws the random initial
  values of prompt and prefix tensors.
- A run stopped by `max_steps` is evaluated once more on validation (unless it just was), so it
  always has best tensors; that evaluation is the run's last and does not count for early stopping.
- train_seconds: wall time of training and validation (resumed runs add up their parts).
- Host syncs: batches are built on the CPU and copied once; step losses are read back every
  LOSS_READ_EVERY steps and before every evaluation and save, so a NaN stops the run (named by its
  step) at most 7 steps late and never reaches an evaluation or state.pt.
"""

from __future__ import annotations

import math
import random
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

from . import __version__, distributed
from .checks import check_count
from .errors import CaptError
from .batches import batch_nll, bucketed_batches, lr_factor
from .evaluate import NonFiniteScores, check_reachable, check_vocab, encode_examples, evaluate, is_seq2seq
from .load import DTYPES, default_device, load_model, read_config, save_method, trainable_summary
from .methods import attach, detach, method_parameters, method_tensors
from .stepscale import (
    SCALE_BATCHES,
    block_input_rms,
    fits,
    key_value_rms,
    param_groups,
    rate_of,
    scale_start,
)
from .rundir import (
    STATE_VERSION,
    check_data,
    check_out,
    check_task_file,
    data_hashes,
    finished_test,
    load_optimizer,
    lock_run,
    make_directory,
    method_values,
    open_run,
    read_metrics,
    read_run_config,
    read_state,
    restore_cuda_rng,
    rng_states,
    run_inputs,
    set_method,
    write_best,
    write_json,
    write_metrics,
    write_state,
)
from .tasks import get_task, load_task, resolve_data_dir, task_file_record
from .tokenizer import load_tokenizer
from .hub import model_reference
from .plots import MISSING, run_curves
from .runtime import deterministic_kernels, hold_interrupt, terminate_as_interrupt
from .trainconfig import MAX_RATE, TrainConfig, default_lr

LOSS_READ_EVERY = 8  # optimizer steps whose losses are read back from the device at once (Trainer._read_losses)


def improves(select: str, headline: float, loss: float, best: dict) -> bool:
    """Whether an evaluation beats the best so far: select "headline", a higher headline, or an equal one with a
    lower validation gold NLL (tiny validation sets often tie); "loss", a lower gold NLL."""
    if select == "loss":
        return loss < best["loss"]
    return headline > best["headline"] or (headline == best["headline"] and loss < best["loss"])


def sample_rows(examples: list, cap: int | None, seed: int, split: str) -> list:
    """At most `cap` of the examples, a sample drawn by `seed` (the same for every method), in their order."""
    if cap is None or len(examples) <= cap:
        return examples
    keep = sorted(random.Random(f"capt-rows:{seed}:{split}").sample(range(len(examples)), cap))
    return [examples[i] for i in keep]


class TrainingDiverged(CaptError):
    """The loss became NaN or infinite; the best tensors so far are kept."""


class Interrupted(KeyboardInterrupt):
    """Ctrl-C (or stop_after) during training, after the state was saved; str() says how to continue."""


# ---------------------------------------------------------------------------------------------
# The trainer


class Trainer:
    """One run: set up (fresh or resumed) in __init__, then fit() and test()."""

    def __init__(self, config: TrainConfig, resume: bool = False, model=None, tokenizer=None, progress: bool = True):
        self.world = distributed.current()  # one process, or this rank's place under torchrun
        self.config, self.progress = config, progress and self.world.lead  # rank 0 alone logs
        self.run = run = Path(config.out)
        if config.method == "instance":
            raise CaptError("instance trains nothing (its capsule vectors are held at zero): "
                            "evaluate it with capt eval --method instance (capt run --method instance reports it per "
                            "task)")
        config.device = distributed.rank_device(config.device or default_device())
        family = read_config(config.model)["model_type"]
        if config.method == "linear-head" and family == "t5":
            raise CaptError("linear-head is for decoder-only models (Llama, Qwen2); T5 scores targets with its decoder")
        self.lock = None
        if self.world.lead:  # rank 0, the one writer, holds the run's lock before it reads or writes anything there
            # never inside the checkpoint or the data
            check_out(run, run_inputs(config.model, get_task(config.task), config.data))
            read_run_config(run) if resume else make_directory(run)  # (a clear line when there is nothing to resume)
            self.lock = lock_run(run)
        try:
            # rank 0 checks the directory, the others follow
            saved = distributed.from_lead(open_run, config, run, resume)
            if resume and config.lr is None:
                config.lr = saved.get("lr")
            self._setup(config, resume, model, tokenizer, family, saved)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        """Release the run directory's lock."""
        if self.lock is not None and not self.lock.closed:
            self.lock.close()

    def _setup(self, config: TrainConfig, resume: bool, model, tokenizer, family: str, saved: dict | None) -> None:
        """Data first (cheap, and the likeliest to be wrong), then the model, the method's fresh tensors and the
        optimizer; then a new run's first state.pt, or the saved one of a resumed run."""
        if config.lr is None:
            config.lr = default_lr(config.method, config.step_scale)
        self._read_data(config, resume, saved)
        self._load_model(config, model, tokenizer)
        distributed.agree("settings or files", {  # where a rank finds its files may differ, not what they hold
            **{k: v for k, v in config.to_dict().items() if k not in ("device", "model", "data", "out")},
            "data_files": self.data_files,
            **{k: self.model.source.get(k) for k in ("config_sha256", "weights_sha256")},
        })
        self._attach_method(config, resume, saved)
        self._make_optimizer(config, resume, saved)
        self.state = {
            "epoch": 0, "pos": 0, "step": 0,  # position: epoch, optimizer steps done in it, steps done in all
            "best": None, "bad": 0, "n_evals": 0, "last_eval_step": -1,
            "loss_sum": 0.0, "loss_n": 0,  # training loss since the last evaluation
            "elapsed": 0.0, "finished": False, "stopped": None,
        }
        self.metrics: list[dict] = []
        self._pending: list[tuple] = []  # (loss on the device, examples, step, epoch) of the steps not read yet
        self.last_loss: float | None = None  # the last step loss read back, for the progress bar
        self.started = time.time()

        n = f" (n {config.n})" if config.n is not None else ""
        self._log(f"{config.method}{n} on {self.task.name}: {trainable_summary(self.model)}")
        if resume:
            self._load_state()
            self._record_world(saved)
        else:
            random.seed(config.seed)
            torch.manual_seed(config.seed)
            if self.world.lead:
                write_json(self.run / "config.json", self._describe(family))
            self._save_state()  # from here on the directory holds a run

    def _read_data(self, config: TrainConfig, resume: bool, saved: dict | None) -> None:
        """The task's three splits; a resumed run must find the task file and the data it started with."""
        run = self.run
        task = get_task(config.task)
        if resume:  # a task file must be as it was when the run started
            check_task_file(saved, task_file_record(task), run)
        data_dir = resolve_data_dir(config.data) if task.file is None else None  # a task file names its own data
        self.task = task
        self.examples = {
            split: load_task(config.task, data_dir, split, config.seed) for split in ("train", "validation", "test")
        }
        for split, cap in (("train", config.train_rows), ("validation", config.validation_rows)):
            self.examples[split] = sample_rows(self.examples[split], cap, config.seed, split)
        self.data_files = data_hashes(task, data_dir)  # the rows as read: a resumed run must find the same
        if resume:
            check_data(saved, self.data_files, task, data_dir, run)
        self.data_dir = data_dir

    def _load_model(self, config: TrainConfig, model, tokenizer) -> None:
        """The plain base model (loaded, or the one passed in) and its tokenizer, and every split encoded."""
        if model is not None:
            detach(model)  # a method attached by an earlier run goes (its fp32 tensors would come first below)
            weights = next(model.parameters())
            if weights.dtype != DTYPES[config.dtype]:
                raise CaptError(f"the model passed in holds {weights.dtype} weights, but dtype is {config.dtype}")
            config.device = str(weights.device)
        # under FSDP the weights are read into host memory and each rank keeps its shard on the device
        if model is None:
            model = load_model(config.model, config.dtype, "cpu" if config.fsdp else config.device)
        if config.fsdp:
            distributed.shard_model(model, device=config.device)
        config.fsdp = distributed.is_sharded(model)
        self.model = model
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(config.model)
        seq2seq = is_seq2seq(self.model)
        if config.answer_cue is None:
            config.answer_cue = not seq2seq
        encoded = [encode_examples(self.examples[split], self.tokenizer, seq2seq, config.max_length, config.answer_cue)
                   for split in ("train", "validation", "test")]  # every row fits, before step 1
        self.train_data, self.val_data, self.test_data = encoded
        for data in encoded:  # every id a row of the embedding, every label word reachable, before step 1
            check_vocab(self.model, data)
        if config.method != "linear-head":  # (its head is not attached yet) the validation ranks by summed scores
            check_reachable(self.model, self.test_data)
        self.lengths = [
            len(p) + len(t[ex.label])
            for p, t, ex in zip(self.train_data.prompts, self.train_data.targets, self.train_data.examples)
        ]
        self._plans: dict[int, list] = {}

    def _attach_method(self, config: TrainConfig, resume: bool, saved: dict | None) -> None:
        """On the plain model: its zero-shot validation scores and the step scales (a new run's; a resumed run
        reads both from its config.json); then the method's fresh tensors (random ones drawn from the seed)."""
        self.scales = saved.get("step_scales") if resume else None
        # the base model's own validation scores, drawn in curves.png beside the run's (the model is still plain here)
        self.zero_shot = saved.get("zero_shot_validation") if resume else self._zero_shot(self.task.name)
        if config.step_scale == "rms" and not resume:  # measured on the plain model, before the method is attached
            with distributed.collective("measuring the step scales", inside_model=True):
                firsts = [idx for group in self._plan(0) for idx in group][:SCALE_BATCHES]
                prompts = [[self.train_data.prompts[i] for i in idx] for idx in firsts]
                scales = (
                    key_value_rms(self.model, prompts)
                    if config.method == "prefix"
                    else block_input_rms(self.model, prompts)
                )
            self.scales = distributed.from_lead(lambda: scales)  # every rank trains with rank 0's numbers
        blocks = len(self.model.capsule_blocks())
        if config.step_scale == "rms" and not fits(self.scales, config.method, blocks):
            raise CaptError(f"{self.run / 'config.json'} has no step_scales for the model's {blocks} blocks; use a new "
                            "--out")
        # the same tensors on every rank
        with distributed.whole(self.model):  # prompt tuning reads the input embedding
            self.method = attach(self.model, config.method_config, generator=torch.Generator().manual_seed(config.seed))
            if self.scales is not None:  # p = c q: they start at c times the plain form's start (zeros stay zeros)
                scale_start(method_tensors(self.model), self.scales)
        # saved with the tensors
        self.method.inputs = {"max_length": config.max_length, "answer_cue": config.answer_cue}

    def _make_optimizer(self, config: TrainConfig, resume: bool, saved: dict | None) -> None:
        """The planned steps, AdamW over the method's parameters (one group per tensor under the step scale)
        and the warm-up / decay schedule."""
        batches_per_epoch = math.ceil(len(self.train_data) / config.batch_size)
        self.steps_per_epoch = math.ceil(batches_per_epoch / config.grad_accum)
        self.total_steps = config.epochs * self.steps_per_epoch  # the planned steps: the schedule spans them
        if config.max_steps is not None:
            self.total_steps = min(self.total_steps, config.max_steps)
        if resume and saved.get("planned_steps", self.total_steps) != self.total_steps:
            raise CaptError(
                f"{self.run} planned its learning-rate schedule over {saved['planned_steps']} steps, but these "
                "settings and data "
                f"give {self.total_steps}; resume with the run's settings and data or use a new --out"
            )
        warmup = round(config.warmup * self.total_steps) if config.warmup < 1 else int(config.warmup)
        warmup = min(warmup, self.total_steps)  # a longer warm-up ends at the last planned step
        self.params = list(method_parameters(self.model).values())  # the method's tensors, fp32, in the files' order
        self.trainable = sum(p.numel() for p in self.params)
        self.base_parameters = sum(p.numel() for p in self.model.parameters()) - self.trainable
        largest = (
            None
            if self.scales is None
            else max(rate_of(name, t, self.scales) for name, t in method_tensors(self.model).items())
        )
        if largest is not None and not config.lr * largest < MAX_RATE:
            raise CaptError(f"the learning rate {config.lr:g} times the largest step scale {largest:.3g} "
                            f"is above {MAX_RATE:.3g}, more than the optimizer's fp32 arithmetic holds; choose a "
                            "smaller --lr")
        groups = (
            [{"params": self.params}]
            if self.scales is None
            else param_groups(method_parameters(self.model), config.lr, self.scales)
        )
        self.optimizer = torch.optim.AdamW(groups, lr=config.lr, weight_decay=config.weight_decay)
        total = self.total_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: lr_factor(s, warmup, total))

    @property
    def _what(self) -> str:
        """What the run trains, in messages: "capsules" or "<method> tensors"."""
        return "capsules" if self.config.method == "capt" else f"{self.config.method} tensors"

    # -- files ------------------------------------------------------------------------------

    def _zero_shot(self, name: str) -> dict:
        zero = evaluate(self.model, self.tokenizer, data=self.val_data, batch_size=self.config.eval_batch_size,
                        progress=self.progress and f"{name} validation, zero-shot")
        scores = ", ".join(f"{k} {v:.2f}" for k, v in zero["metrics"].items() if k != "headline")
        self._log(f"zero-shot validation {scores} (loss {zero['loss']:.4f})")  # the base model, where training starts
        return {"metrics": zero["metrics"], "loss": zero["loss"]}

    def _record_world(self, saved: dict) -> None:
        """A run resumed by another number of processes: config.json's world_size and backend say how the run
        goes on, and world_sizes how each part of it ran ({"from_step", "world_size", "backend"} per part)."""
        now = {"world_size": self.world.size, "backend": self.world.backend}
        before = {"world_size": saved.get("world_size", 1), "backend": saved.get("backend")}
        if not self.world.lead or now == before:
            return
        parts = saved.get("world_sizes") or [{"from_step": 0, **before}]
        write_json(self.run / "config.json",
                   {**saved, **now, "world_sizes": [*parts, {"from_step": self.state["step"], **now}]})

    def _describe(self, family: str) -> dict:
        c = self.config
        return {
            "capt_version": __version__,
            **c.to_dict(),
            "model": model_reference(c.model),
            "data": None if self.data_dir is None else str(Path(self.data_dir).absolute()),
            "task_file": task_file_record(self.task),
            "data_files": self.data_files,
            "model_config_sha256": self.model.source["config_sha256"],
            # load.weights_fingerprint: resume checks both
            "model_weights_sha256": self.model.source.get("weights_sha256"),
            "model_type": family,
            "capsules": c.capsules.to_dict() if c.method == "capt" else None,
            "zero_shot_validation": self.zero_shot,  # the plain base model on the validation split
            "step_scales": self.scales,  # c_l per block: block l's rate is lr x c_l (capt/stepscale.py), None: one rate
            "method_config": self.method.to_dict(),
            "trainable_parameters": self.trainable,
            "base_parameters": self.base_parameters,
            "examples": {split: len(ex) for split, ex in self.examples.items()},
            "steps_per_epoch": self.steps_per_epoch,
            "planned_steps": self.total_steps,
            "world_size": self.world.size,  # processes under torchrun (1: a plain run)
            "backend": self.world.backend,  # gloo / nccl, None without a process group
        }

    def _save_state(self) -> None:
        self._read_losses()  # the saved sums hold every step done, and no NaN is saved unnoticed
        now = time.time()  # the run's clock: time since the last save goes into elapsed
        self.state["elapsed"] += now - self.started
        self.started = now
        if not self.world.lead:  # every rank holds the same state; rank 0 writes it
            return
        write_state(self.run, {
            "version": STATE_VERSION,
            "task": self.config.task,
            "tensors": method_values(self.model),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "rng": rng_states(),
            "train": dict(self.state),
        })

    def _load_state(self) -> None:
        state = distributed.from_lead(read_state, self.run, self.config.task, method_tensors(self.model), self.state,
                                      (self.total_steps, self.config.epochs, self.steps_per_epoch))
        try:
            set_method(self.model, state["tensors"])
            load_optimizer(self.optimizer, self.scheduler, state, self.run / "state.pt")  # checked against this run's
            random.setstate(state["rng"]["python"])
            torch.set_rng_state(state["rng"]["torch"])
            restore_cuda_rng(state["rng"]["cuda"])
        except (KeyError, IndexError, TypeError, ValueError, OverflowError, RuntimeError) as e:
            raise CaptError(
                f"{self.run / 'state.pt'} is a damaged training state ({type(e).__name__}: {e})".replace("\n", " ")
            ) from None
        self.state = state["train"]
        self.metrics = distributed.from_lead(self._redo_files)
        self.started = time.time()  # the clock goes on from the saved elapsed

    def _redo_files(self) -> list[dict]:
        """What was written after the state was saved is redone: extra metric lines, best/, and
        test.json unless the run had finished (then its test stands and is reused). Returns the metric lines kept."""
        metrics = read_metrics(self.run, self.state["n_evals"])
        write_metrics(self.run, metrics)
        write_best(self.run, self.model, self.state["best"])
        if not self.state["finished"]:
            (self.run / "test.json").unlink(missing_ok=True)
        return metrics

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

    def _step(self, group: list[list[int]]) -> None:
        """One optimizer step over the batches of `group`. Its mean example loss stays on the device
        (no sync) until _read_losses.

        Under torchrun each rank takes its part of every batch, divides by the step's global
        example count n and the ranks' gradients are summed: the one-process gradient, up to the
        order of the float additions."""
        n = sum(len(idx) for idx in group)  # over every rank
        losses = []
        for idx in group:
            mine = distributed.shard_of(idx, self.world)
            if mine:
                loss = batch_nll(self.model, self.train_data, mine).sum() / n
            elif self.config.fsdp:  # FSDP: every rank runs the same passes; an empty part runs one example at weight 0
                loss = batch_nll(self.model, self.train_data, idx[:1]).sum() * 0.0
            else:
                continue
            loss.backward()
            losses.append(loss.detach())
        share = torch.stack(losses).sum() if losses else torch.zeros(())  # this rank's share of the step's mean loss
        # the step's mean loss, on the device (one all-reduce under torchrun)
        total = distributed.sum_gradients(self.params, share)
        st = self.state
        with hold_interrupt():
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            st["step"] += 1
            st["pos"] += 1
            self._pending.append((total, n, st["step"], st["epoch"]))

    def _read_losses(self) -> None:
        """The losses of the steps since the last read, read back in one device sync: checked, then
        added to the running sums in step order (as if read one by one). Called every
        LOSS_READ_EVERY steps and before every evaluation and every save of the state, so a NaN or
        infinite loss stops the run at most LOSS_READ_EVERY - 1 steps after the step that made it,
        and never reaches a saved state or an evaluation. The last loss read is kept for the progress bar."""
        if not self._pending:
            return
        values = torch.stack([loss for loss, *_ in self._pending]).tolist()
        for value, (_, _, step, epoch) in zip(values, self._pending):
            if not math.isfinite(value):
                self._diverged(value, step, epoch)
        st = self.state
        with hold_interrupt():
            for value, (_, n, _, _) in zip(values, self._pending):
                st["loss_sum"] += value * n
                st["loss_n"] += n
            self._pending = []
        self.last_loss = values[-1]

    def _diverged(
        self, loss, step: int | None = None, epoch: int | None = None, what: str = "the training loss"
    ) -> None:
        """Stop the run: the loss of optimizer step `step` (1-based; default: the next) in epoch `epoch` (0-based) was
        not finite."""
        st, run = self.state, self.run
        step = st["step"] + 1 if step is None else step
        epoch = st["epoch"] if epoch is None else epoch
        best = st["best"]
        if best is None:
            kept = f"no validation evaluation had finished, so there are no best {self._what}"
        else:
            kept = (f"the best {self._what} so far are kept in {run / 'best'} (validation {best['headline']:.2f} "
                    f"at step {best['step']})")
        raise TrainingDiverged(
            f"{what} became {loss} at step {step} (epoch {epoch + 1}), so training stopped; "
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
        self._read_losses()  # the metrics line counts every step so far; a diverged run is never evaluated
        try:
            result = evaluate(self.model, self.tokenizer, data=self.val_data, batch_size=c.eval_batch_size,
                              progress=self.progress and f"{self.task.name} validation, step {st['step']}")
        except NonFiniteScores:  # never a best evaluation: training has diverged
            self._diverged("NaN or infinite", st["step"], what="the validation scores")
        metrics, loss = result["metrics"], result["loss"]
        best = st["best"]
        # every rank holds the same scores; rank 0's decision is the one all follow
        better = distributed.from_lead(lambda: best is None or improves(c.select, metrics["headline"], loss, best))
        with hold_interrupt():
            epoch = st["epoch"] + st["pos"] / len(self._plan(st["epoch"]))
            line = {
                "epoch": round(epoch, 4),
                "step": st["step"],
                "train_loss": st["loss_sum"] / st["loss_n"] if st["loss_n"] else None,
                "validation": {**metrics, "loss": loss},
                "best": better,
                "lr": c.lr * self.scheduler.get_last_lr()[0] / self.scheduler.base_lrs[0],  # r under the step scale
                "time": round(st["elapsed"] + time.time() - self.started, 2),
            }
            if better:
                st["best"] = {"headline": metrics["headline"], "loss": loss, "step": st["step"], "epoch": line["epoch"],
                              "validation": metrics, "tensors": method_values(self.model)}
                st["bad"] = 0
                if self.world.lead:
                    save_method(self.model, self.run / "best")
            else:
                st["bad"] += 1
            st["n_evals"] += 1
            st["last_eval_step"] = st["step"]
            st["loss_sum"], st["loss_n"] = 0.0, 0
            if st["bad"] >= c.patience and not final:
                st["finished"], st["stopped"] = True, "early_stopping"
            self.metrics.append(line)
            if self.world.lead:
                write_metrics(self.run, self.metrics)
            self._save_state()
        extra = ", ".join(f"{k} {v:.2f}" for k, v in metrics.items() if k != "headline")
        train = f"train loss {line['train_loss']:.4f}, " if line["train_loss"] is not None else ""
        self._log(f"epoch {line['epoch']:g} step {st['step']}: {train}validation {extra} (loss "
                  f"{loss:.4f}){' best' if better else ''}")

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
        bar = tqdm(total=planned, initial=min(st["step"], planned), unit="step", desc=f"{self.task.name} seed {c.seed}",
                   disable=not self.progress, dynamic_ncols=True, file=sys.stderr)
        try:
            with terminate_as_interrupt():
                self._loop(bar, stop_after)
        except KeyboardInterrupt:
            bar.close()
            self._save_state()
            raise Interrupted(
                f"interrupted at step {st['step']}; the training state is saved in {self.run / 'state.pt'}; "
                f"continue with: capt train --out {self.run} --resume"
            ) from None
        finally:
            bar.close()  # before any message: the bar's line is ended first
        self._save_state()

    def _loop(self, bar, stop_after: int | None) -> None:
        """Steps and evaluations until the run is finished (early stopping, the last epoch, max_steps)."""
        c, st = self.config, self.state
        seen, clock = 0, time.time()
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
                with hold_interrupt():
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
            with distributed.collective("a training step", inside_model=True):  # FSDP's passes hold collectives
                self._step(group)
            if len(self._pending) >= LOSS_READ_EVERY:  # the one device sync of these steps
                self._read_losses()
            seen += sum(len(idx) for idx in group)
            bar.update(1)
            shown = {} if self.last_loss is None else {"loss": f"{self.last_loss:.4f}"}
            bar.set_postfix(**shown, ex_s=f"{seen / max(time.time() - clock, 1e-9):.1f}", refresh=False)

    def test(self) -> dict:
        """The best tensors on the test set; writes RUN/test.json and returns its contents."""
        st, c = self.state, self.config
        train_seconds = st["elapsed"]  # training and validation, up to fit()'s last save: the test is not counted
        best = st["best"]  # fit() always ends with an evaluation of the last step
        set_method(self.model, best["tensors"])
        result = evaluate(self.model, self.tokenizer, data=self.test_data, batch_size=c.eval_batch_size,
                          progress=self.progress and f"{self.task.name} test, best {self._what}")
        out = {
            "task": self.task.name,
            "task_file": task_file_record(self.task),
            "split": "test",
            "n": result["n"],
            "metrics": result["metrics"],
            "loss": result["loss"],
            "best": {k: best[k] for k in ("epoch", "step", "validation", "loss")},  # loss: its validation gold NLL
            "steps": st["step"],
            "stopped": st["stopped"],
            "method": c.method,
            "method_config": self.method.to_dict(),  # its "n": vectors per place (prompt, deep-prompt, prefix)
            "trainable_parameters": self.trainable,
            "train_seconds": round(train_seconds, 3),
            # each test row's prediction and gold log-probability (evaluate.per_example)
            "examples": result["examples"],
        }
        if self.world.lead:
            write_json(self.run / "test.json", out)
        words = len(self.val_data.examples[0].candidates)
        if did_not_learn(best["loss"], words):
            self._log(f"note: the best validation gold NLL, {best['loss']:.3f}, is not below ln {words} = "
                      f"{math.log(words):.3f} by {STALL_NATS} nats: the model spreads its answer over the {words} "
                      f"label words about evenly, so the {self._what} have not learnt to tell the answers apart; "
                      "docs/your-data.md#when-a-run-does-not-learn says what to try")
        return out


STALL_NATS = 0.1  # a best validation gold NLL above ln(label words) less this: the answers are not told apart


def did_not_learn(loss: float, words: int) -> bool:
    """Whether a best validation gold NLL (nats, mean over rows) says that the run has not learnt the task: no
    lower than ln(words) - STALL_NATS, where the probability of the right word is no more than about 1/words,
    what spreading the answer evenly over the label words gives."""
    return words > 1 and loss > math.log(words) - STALL_NATS


def train(config: TrainConfig, *, resume: bool = False, model=None, tokenizer=None, progress: bool = True,
          stop_after: int | None = None) -> dict:
    """Train the config's method for one task and seed; return the test results (also in RUN/test.json),
    and draw RUN/curves.png (capt/plots.py; skipped in one line without matplotlib).

    model / tokenizer: an already loaded base model (with or without a method attached: it is
    replaced) and its tokenizer, to save loading them again; otherwise they are loaded from
    config.model. On return the model carries the best tensors of the method.
    stop_after: stop (as if interrupted) after this many optimizer steps of the run in all, saving
    the state; for tests and time-boxed jobs. The schedule is unchanged (config.max_steps sets it),
    so resuming continues exactly as if the run had not stopped.
    Raises TrainingDiverged (a CaptError) on a NaN / infinite loss and Interrupted on Ctrl-C or stop_after;
    CaptError for method instance (nothing to train) and for linear-head on T5.
    """
    if stop_after is not None:
        check_count(stop_after, "stop_after")
    with deterministic_kernels(config.deterministic):
        trainer = Trainer(config, resume=resume, model=model, tokenizer=tokenizer, progress=progress)
        try:
            return _train(trainer, stop_after)
        finally:
            trainer.close()


def _train(trainer: Trainer, stop_after: int | None) -> dict:
    done = distributed.from_lead(finished_test, trainer.run) if trainer.state["finished"] else None
    if done is not None:
        set_method(trainer.model, trainer.state["best"]["tensors"])
        return done
    trainer.fit(stop_after=stop_after)
    result = trainer.test()
    if trainer.world.lead and run_curves(trainer.run) is None:  # RUN/curves.png, unless matplotlib is missing
        trainer._log(f"curves.png skipped: {MISSING}")
    return result
