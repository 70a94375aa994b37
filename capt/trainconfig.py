"""A training run's settings: TrainConfig, everything a run depends on, checked when it is made and
written to RUN/config.json (capt/rundir.py reads it back on resume); the default learning rates.

What each setting does in training: capt/trainer.py's docstring ("Choices").
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

import torch

from .checks import check_fields
from .errors import CaptError
from .load import check_device
from .methods import METHODS, CapsuleConfig, MethodConfig
from .stepscale import STEP_SCALES
from .tasks import DEFAULT_MAX_LEN, get_task

MAX_RATE = float(torch.finfo(torch.float32).max) / 10  # Adam's first step divides the rate by 1 - beta1 (0.1), in fp32


def default_lr(method: str = "capt", step_scale: str = "none") -> float:
    """The method's default peak learning rate, or r under the per-block step scale (capt/trainer.py, "Choices")."""
    return METHODS[method].scaled_lr if step_scale == "rms" else METHODS[method].lr


SELECTIONS = ("headline", "loss")


@dataclass
class TrainConfig:
    """Everything a training run depends on (written to RUN/config.json)."""

    model: str  # checkpoint directory or hub id ORG/NAME
    task: str  # a SuperGLUE task's name, or a task file's path (made absolute)
    out: str  # run directory
    data: str | None = None  # SuperGLUE directory (None: CAPT_DATA, then data/superglue)
    epochs: int = 50
    batch_size: int = 16  # examples per forward pass
    grad_accum: int = 1  # forward passes per optimizer step
    lr: float | None = None  # None: default_lr(method)
    weight_decay: float = 0.0
    warmup: float = 0.06  # < 1: fraction of the planned steps; >= 1: whole steps (at most the planned steps)
    seed: int = 0
    # train for at most this many optimizer steps; the warm-up and decay are planned over them
    max_steps: int | None = None
    dtype: str = "fp32"  # backbone weights: fp32 | bf16 (the method's tensors and optimizer state are fp32)
    max_length: int = DEFAULT_MAX_LEN  # input tokens; longer inputs are shortened in their long field
    patience: int = 5  # evaluations without improvement before stopping
    eval_every: int | None = None  # also evaluate every N steps (None: at epoch ends only)
    eval_batch_size: int = 32
    device: str | None = None  # None: cuda if available, else cpu
    integration: str = "add"  # capsule integration: add | prepend | extraction | projection
    capsule_length: int = 1  # capsule slots per block (add only)
    blocks: str | list[int] = "all"  # blocks carrying capsules: all | odd | first-half | latter-half | list
    method: str = "capt"  # capt | prompt | deep-prompt | prefix | linear-head (capt.methods; instance trains nothing)
    n: int | None = None  # vectors per place for prompt, deep-prompt, prefix (None: methods.DEFAULT_N)
    fsdp: bool = False  # under torchrun: shard the frozen base across the ranks (capt/distributed.py)
    # rms: block l's rate is lr x its input's size (capt/stepscale.py); none: one rate; None: rms where it applies
    step_scale: str | None = None
    # end SuperGLUE inputs with " answer:" (None: yes for decoder-only models, no for T5)
    answer_cue: bool | None = None
    any_base: bool = False  # resume on weights other than the run's (same config.json) on purpose
    train_rows: int | None = None  # at most this many training examples, a seeded sample (None: all)
    validation_rows: int | None = None  # at most this many validation examples, a seeded sample (None: all)
    select: str = "headline"  # the best evaluation: headline (then the lower loss) or loss (the lowest gold NLL)
    # CUDA: deterministic kernels only, so that a run repeats bit for bit (slower; the CPU's already are)
    deterministic: bool = False

    def __post_init__(self):
        for name in ("model", "task", "out", "data", "blocks"):  # paths as text, block indices as a list
            value = getattr(self, name)
            setattr(
                self,
                name,
                str(value) if isinstance(value, os.PathLike) else list(value) if isinstance(value, tuple) else value,
            )
        # each field of its type (a resumed run's: checked in open_run)
        check_fields(self, "training settings", unbounded=("seed",))
        self.task = get_task(self.task).spec
        for name in ("epochs", "batch_size", "grad_accum", "patience", "eval_batch_size", "max_length"):
            if int(getattr(self, name)) < 1:
                raise CaptError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps < 0:
            raise CaptError(f"max_steps must be 0 or more, got {self.max_steps}")
        if self.eval_every is not None and self.eval_every < 1:
            raise CaptError(f"eval_every must be at least 1, got {self.eval_every}")
        for name in ("train_rows", "validation_rows"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise CaptError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.select not in SELECTIONS:
            raise CaptError(f"select {self.select!r} is not one of {', '.join(SELECTIONS)}")
        if self.lr is not None and not 0 < self.lr < MAX_RATE:  # the optimizer works in fp32
            raise CaptError(f"the learning rate must be a positive number below {MAX_RATE:.3g}, got {self.lr}")
        if not (0 <= self.warmup < math.inf and 0 <= self.weight_decay < math.inf):
            raise CaptError(f"warmup and weight_decay must be finite and not negative, got {self.warmup} and "
                            f"{self.weight_decay}")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise CaptError(f"seed must be a whole number from 0 to 2**63 - 1, got {self.seed!r}")
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            raise CaptError(f"warmup {self.warmup:g} is neither a fraction of the planned steps (below 1) nor a whole "
                            "number of steps")
        if self.dtype not in ("fp32", "bf16"):
            raise CaptError(f"dtype {self.dtype!r} is not one of fp32, bf16")
        if self.device is not None:
            check_device(self.device)
        self.n = self.method_config.n  # checks the method's options; n resolved to its default
        if self.step_scale is None:
            self.step_scale = METHODS[self.method].step_scale
        if self.step_scale not in STEP_SCALES:
            raise CaptError(f"step_scale {self.step_scale!r} is not one of {', '.join(STEP_SCALES)}")
        if self.step_scale == "rms" and METHODS[self.method].scaled_lr is None:
            raise CaptError(f"the per-block step scale is for capt, deep-prompt and prefix, not {self.method}: use "
                            "step_scale none")

    @property
    def capsules(self) -> CapsuleConfig:
        return CapsuleConfig(self.integration, self.blocks, length=self.capsule_length)

    @property
    def method_config(self) -> MethodConfig:
        """What the run trains; linear-head has one class per candidate of the task."""
        classes = len(get_task(self.task).candidates) if self.method == "linear-head" else None
        return MethodConfig(self.method, self.n, classes, self.capsules)

    def to_dict(self) -> dict:
        return asdict(self)
