"""The methods the paper compares, above the models: one record on the model, one table.

    capt          one vector per block, mixed with the mean of the instance (docs/method.md)
    prompt        n trained vectors in front of the input embeddings (prompt tuning)
    deep-prompt   n trained vectors per block at the front of the sequence, replaced at every
                  block's input (with n = 1: the capsule without the instance mean)
    prefix        n trained keys and values per attention layer in front of its own (P-Tuning v2)
    linear-head   a trained linear classifier over the final hidden state of the last prompt
                  token, the model frozen (decoder-only models)
    instance      the capsule slot with its vectors held at zero: nothing is trained

The backbone is frozen and the trained tensors are fp32. The capsules are the models' own: a
(K, d) table on each capsule block, which their forward reads inline (K = 1, or one row per capsule
set when a model serves several per row). The baselines are modules put into the models' seams
(capt/baselines.py). A model carries one record, `model.method` (a MethodConfig); METHODS gives each
method's attach, its tensors (by their file names), its default n and its default learning rate,
for the trainer, the CLI and capt.load.count_trainable alike. Files: capt.load.save_method /
load_method. Where each method's rows and columns sit in the sequence: the model files' docstrings
and docs/method.md.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from .baselines import (
    attach_deep_prompt,
    attach_linear_head,
    attach_prefix,
    attach_prompt,
    deep_prompt_tensors,
    detach_seams,
    linear_head_tensors,
    prefix_tensors,
    prompt_tensors,
    trained,
)
from .checks import check_count, shown
from .errors import CaptError
from .models.ops import EXTRACTION_KERNEL, INTEGRATIONS, PROJECTION_RANK, Extraction, Projection
from .models.protocol import CaptModel

BLOCK_SETS = ("all", "odd", "first-half", "latter-half")
MAX_LENGTH = 2  # capsule slots per block (the rope tables have room for MAX_SLOTS in front)
INITS = ("zeros",)


@dataclass
class CapsuleConfig:
    """Where the capsules go and how they enter the sequence (docs: method.md).

    integration: "add" (one slot: p_l + instance mean), "prepend" (two slots: the instance
        mean, then p_l), "extraction" (p_l + the mean of a learned per-channel filter of the rows) or
        "projection" (p_l + the mean through a learned low-rank map) (capt/models/ops.py).
    blocks: "all", "odd" (0-based 0, 2, 4, ...), "first-half", "latter-half", or a list of
        0-based block indices.
    init: "zeros", the paper-faithful default.
    length: capsule slots per block (add only): each slot p_{l,j} + the same instance mean.
    """

    integration: str = "add"
    blocks: str | list[int] = "all"
    init: str = "zeros"
    length: int = 1

    def __post_init__(self):
        if self.integration not in INTEGRATIONS:
            raise CaptError(f"capsule integration {shown(self.integration)} is not one of {', '.join(INTEGRATIONS)}")
        if isinstance(self.length, bool) or not isinstance(self.length, int) or not 1 <= self.length <= MAX_LENGTH:
            raise CaptError(f"capsule length {shown(self.length)}: a whole number of slots from 1 to {MAX_LENGTH}")
        if self.length > 1 and self.integration != "add":
            raise CaptError(f"a capsule length of {self.length} is for the add integration, not {self.integration}")
        if isinstance(self.blocks, str):
            if self.blocks not in BLOCK_SETS:
                raise CaptError(f"capsule blocks {shown(self.blocks)} is not one of {', '.join(BLOCK_SETS)} or a "
                                "list of indices")
        else:
            if not isinstance(self.blocks, (list, tuple)):
                raise CaptError(f"capsule blocks {shown(self.blocks)} is not one of {', '.join(BLOCK_SETS)} or a "
                                "list of indices")
            indices = [self._block_index(i) for i in self.blocks]
            bad = [i for i, j in zip(self.blocks, indices) if j is None]
            if bad:
                raise CaptError(f"capsule blocks {shown(bad)}: block indices are whole numbers from 0")
            self.blocks = sorted(set(indices))
            if not self.blocks:
                raise CaptError("capsule blocks: an explicit list must name at least one block")
        if self.init not in INITS:
            raise CaptError(f"capsule init {shown(self.init)} is not one of {', '.join(INITS)}")

    @staticmethod
    def _block_index(value) -> int | None:
        """value as a 0-based block index (an int, or a float with no fraction), or None if it is not one."""
        if isinstance(value, bool):  # True is an int to Python, not a block
            return None
        if isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer()):
            return int(value) if value >= 0 else None
        return None

    def layer_indices(self, n_layers: int) -> list[int]:
        """The 0-based blocks of an n_layers stack that carry a capsule."""
        if self.blocks == "all":
            return list(range(n_layers))
        if self.blocks == "odd":  # the 1st, 3rd, 5th, ... block
            return list(range(0, n_layers, 2))
        if self.blocks == "first-half":
            return list(range(n_layers // 2))
        if self.blocks == "latter-half":
            return list(range(n_layers // 2, n_layers))
        bad = [i for i in self.blocks if not 0 <= i < n_layers]
        if bad:
            raise CaptError(f"capsule blocks {shown(bad)} are outside the model's {n_layers} blocks "
                            f"(0..{n_layers - 1})")
        return list(self.blocks)

    @property
    def slots(self) -> int:
        """The capsule slots in front of every sequence."""
        return self.length if self.integration == "add" else INTEGRATIONS[self.integration]

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        if self.length == 1:  # as capsules.json has always been written
            del d["length"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "CapsuleConfig":
        return cls(**known_keys(cls, d, "capsule setting"))

    def __str__(self) -> str:
        return json.dumps(self.to_dict())


def capsule_variant(settings: dict) -> str:
    """A capt run's capsule settings where they are not the default (add, all blocks, one slot), named for titles
    and tables: "prepend, blocks odd", "2 capsules", or "" for the default. settings: a run's config.json or its
    results' settings (capsule_length is the command line's name for CapsuleConfig.length); read as written."""
    integration, blocks = settings.get("integration") or "add", settings.get("blocks") or "all"
    length = settings.get("capsule_length") or 1
    if isinstance(blocks, list):
        blocks = ",".join(map(str, blocks))
    return ", ".join(([integration] if integration != "add" else []) + ([f"blocks {blocks}"] if blocks != "all" else [])
                     + ([f"{length} capsules"] if length != 1 else []))


def known_keys(cls, d: dict, what: str) -> dict:
    """d, refused when it holds a key cls does not have: a misspelt setting in a hand-edited capsules.json or
    adapter.json would otherwise load as the default and change the results without a word."""
    if not isinstance(d, dict):
        raise CaptError(f"the {what}s are {shown(d)}, not a JSON object")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise CaptError(f"unknown {what} {unknown[0]!r} (known: {', '.join(sorted(known))})")
    return d


@dataclass
class MethodConfig:
    """The record a model carries: what is trained and where.

    n: vectors per place (prompt, deep-prompt, prefix; None takes the method's default);
    num_classes: linear-head's classes; capsule: the CapsuleConfig of capt (instance: always
    add on every block, its vectors held at zero).
    task_capsules: capt only, several capsule sets on one model, {name: CapsuleConfig} in table
    order: each capsule block then holds a (K, d) table, one row per set, and the forward takes
    each row's set (`tasks`). The sets share one integration (then `capsule` is that integration
    on every block) and may differ in depth; a set without block l has a zero row there.
    inputs: the input format the tensors were trained with, {"max_length": int, "answer_cue":
    bool} (None: not recorded); saved with them, and what evaluation uses unless told otherwise.
    Files written before the answer cue existed read as {"answer_cue": false}: they were trained without.
    """

    method: str = "capt"
    n: int | None = None
    num_classes: int | None = None
    capsule: CapsuleConfig | None = None
    task_capsules: dict[str, CapsuleConfig] | None = None
    inputs: dict | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise CaptError(f"method {shown(self.method)} is not one of {', '.join(METHODS)}")
        spec = METHODS[self.method]
        if spec.default_n is not None:
            self.n = (
                spec.default_n if self.n is None else check_count(self.n, f"{self.method}'s n (vectors per place)", 1)
            )
        elif self.n is not None:
            raise CaptError(f"n (vectors per place) is for {', '.join(k for k, m in METHODS.items() if m.default_n)}, "
                            f"not {self.method}")
        if self.method == "linear-head":
            self.num_classes = check_count(self.num_classes, "linear-head's num_classes", 2)
        else:
            self.num_classes = None
        if self.capsule is not None and not isinstance(self.capsule, (CapsuleConfig, dict)):
            raise CaptError(f"capsule must be a CapsuleConfig (or its dict), not {type(self.capsule).__name__}")
        capsule = (
            CapsuleConfig.from_dict(self.capsule) if isinstance(self.capsule, dict) else self.capsule or CapsuleConfig()
        )
        if self.method != "capt" and capsule != CapsuleConfig():
            raise CaptError(f"integration and blocks are capt's options, not {self.method}'s")
        self.capsule = capsule if self.method in ("capt", "instance") else None  # instance: add on every block
        if self.task_capsules is not None:
            self._check_task_capsules()
        if self.inputs is not None:
            self.inputs = check_inputs(self.inputs)

    def _check_task_capsules(self) -> None:
        """Several named capsule sets: capt only, at least one, one shared integration."""
        if self.method != "capt":
            raise CaptError(f"several capsule sets are for capt, not {self.method}")
        if not isinstance(self.task_capsules, dict) or not self.task_capsules:
            raise CaptError("task_capsules: give at least one capsule set, {name: CapsuleConfig}")
        sets = {}
        for name, config in self.task_capsules.items():
            if not isinstance(name, str) or not name:
                raise CaptError(f"capsule set names are non-empty strings, got {shown(name)}")
            sets[name] = CapsuleConfig.from_dict(config) if isinstance(config, dict) else config
            if not isinstance(sets[name], CapsuleConfig):
                raise CaptError(f"capsule set {shown(name)}: expected a CapsuleConfig, got {type(config).__name__}")
        integrations = {config.integration for config in sets.values()}
        if len(integrations) > 1:
            listed = ", ".join(f"{name} {config.integration}" for name, config in sets.items())
            raise CaptError(f"capsule sets served together must share one integration (add or prepend), got {listed}")
        plain = [
            name
            for name, config in sets.items()
            if config.integration in ("extraction", "projection") or config.length > 1
        ]
        if plain:
            raise CaptError(f"capsule set {plain[0]!r}: several sets on one model serve add or prepend capsules of one "
                            "slot")
        self.task_capsules = sets
        self.capsule = CapsuleConfig(integration=integrations.pop())

    @property
    def integration(self) -> str | None:
        """What the model's forward reads: the capsule's integration when capsule slots go in front, else None."""
        return None if self.capsule is None else self.capsule.integration

    @property
    def slots(self) -> int:
        """The capsule slots in front of every sequence (0 without a capsule): what the forward makes room for."""
        return 0 if self.capsule is None else self.capsule.slots

    @property
    def tasks(self) -> list[str] | None:
        """The capsule sets' names in table order (model.tasks), or None for a single set."""
        return None if self.task_capsules is None else list(self.task_capsules)

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["capsule"] = None if self.capsule is None else self.capsule.to_dict()
        if self.task_capsules is not None:
            d["task_capsules"] = {name: config.to_dict() for name, config in self.task_capsules.items()}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MethodConfig":
        return cls(**known_keys(cls, d, "method setting"))

    def __str__(self) -> str:
        return json.dumps(self.to_dict())


def check_inputs(inputs) -> dict:
    """An input-format record, checked: {"max_length": int >= 1, "answer_cue": bool}, either key may be absent."""
    if not isinstance(inputs, dict) or set(inputs) - {"max_length", "answer_cue"}:
        raise CaptError(f"inputs: expected {{'max_length': N, 'answer_cue': true or false}}, got {shown(inputs)}")
    length, cue = inputs.get("max_length", 1), inputs.get("answer_cue", False)
    if isinstance(length, bool) or not isinstance(length, int) or length < 1:
        raise CaptError(f"inputs: max_length must be a whole number from 1, got {shown(length)}")
    if not isinstance(cue, bool):
        raise CaptError(f"inputs: answer_cue must be true or false, got {shown(cue)}")
    return dict(inputs)


# ---------------------------------------------------------------------------------------------
# The capsules: fresh tensors (zeros, the paper-faithful start)


def _attach_capsules(model: CaptModel, config: MethodConfig, generator) -> None:
    """One set: a (1, d) table on each block of the set's S ((1, n, d) for a capsule of length n), and for
    extraction / projection the block's instance module. Several sets: a (K, d) table on each block that
    some set holds, row k for set k (zeros where set k lacks the block); where only some sets hold it,
    capsule_active (K,) says which: the other rows' slots pass that block unchanged, as in their own
    single-set model."""
    blocks = model.capsule_blocks()
    sets = [config.capsule] if config.task_capsules is None else list(config.task_capsules.values())
    held = [set(c.layer_indices(len(blocks))) for c in sets]
    length, integration = config.capsule.length, config.capsule.integration
    shape = (len(held), model.capsule_width) if length == 1 else (len(held), length, model.capsule_width)
    for i, block in enumerate(blocks):
        active = [i in layers for layers in held]
        block.capsule = trained(model, torch.zeros(shape)) if any(active) else None
        block.capsule_instance = None
        if any(active) and integration in INSTANCE_PARTS:
            part = INSTANCE_PARTS[integration](model.capsule_width, generator)
            block.capsule_instance = part.to(device=block.capsule.device, dtype=torch.float32)
        block.capsule_active = (
            None if all(active) or not any(active) else torch.tensor(active, device=block.capsule.device)
        )
    if config.method == "instance":  # the capsule model with its vectors held at zero: nothing trains
        for block in blocks:
            block.capsule.requires_grad_(False)


# the integrations whose instance part is learned: their modules (capt/models/ops.py), one per block of S
INSTANCE_PARTS = {
    "extraction": lambda d, generator: Extraction(d),
    "projection": lambda d, generator: Projection(d, generator=generator),
}
INSTANCE_TENSORS = {"extraction": ("weight",), "projection": ("down", "up")}  # their file names: layers.{l}.<name>


def _capsule_tensors(model: CaptModel, form: str) -> dict[str, torch.Tensor]:
    """capt's tensors by file name: `layers.{l}` each block's capsules (form "file": the (d,) vector, or (n, d),
    of a single set; "parameter": the table itself), then each block's instance module (layers.{l}.weight for
    extraction, layers.{l}.down / .up for projection)."""
    single = model.method is None or model.method.task_capsules is None
    tensors = {}
    for i, block in enumerate(model.capsule_blocks()):
        if block.capsule is not None:
            tensors[f"layers.{i}"] = block.capsule[0] if single and form == "file" else block.capsule
    for i, block in enumerate(model.capsule_blocks()):
        if block.capsule_instance is not None:
            for name, t in block.capsule_instance.named_parameters():
                tensors[f"layers.{i}.{name}"] = t
    return tensors


def capsule_vectors(model: CaptModel) -> dict[int, torch.Tensor]:
    """{block index: its capsules} for the blocks that carry them: with one set the (d,) vector p_l (a view
    of the block's (1, d) table), with several the (K, d) table."""
    single = model.method is None or model.method.task_capsules is None
    return {
        i: b.capsule[0] if single else b.capsule for i, b in enumerate(model.capsule_blocks()) if b.capsule is not None
    }


@dataclass(frozen=True)
class Method:
    """One row of the table: how a method is named, attached, saved and trained by default.

    default_n: vectors per place when n is not given (None: the method has no n). Choices: prompt
    tuning's usual 100 tokens; one deep-prompt vector per block (the capsule without the instance
    mean); 64 prefix vectors per layer, which on T5-Base's encoder gives the paper's 0.53% for
    P-Tuning v2. lr: the default peak learning rate with one rate for every tensor, from the sweeps
    recorded in capt/trainer.py. scaled_lr: for the methods with a tensor per block (capt,
    deep-prompt, prefix), the default r of the per-block step scale (capt/stepscale.py: block l's
    rate is r times the size of what its tensor joins); None: the step scale does not apply.
    step_scale: the default, "rms" where the step scale was measured to help (capt; deep-prompt, where
    it does as well as one rate), "none" otherwise. files: the stem of its two files ("capsules":
    capsules.safetensors + capsules.json). tensors: the tensors by their file names, in the form the files
    hold (a capsule is one (d,) vector); parameters: the same names, the model's trained parameters.
    """

    label: str
    attach: Callable[[CaptModel, MethodConfig, torch.Generator | None], None]
    tensors: Callable[[CaptModel], dict[str, torch.Tensor]]
    default_n: int | None = None
    lr: float | None = None  # None: nothing to train
    scaled_lr: float | None = None
    step_scale: str = "none"
    files: str = "adapter"
    parameters: Callable[[CaptModel], dict[str, nn.Parameter]] | None = None  # None: the tensors are the parameters


METHODS: dict[str, Method] = {
    "capt": Method("CaPT", _attach_capsules, lambda m: _capsule_tensors(m, "file"), lr=0.3, scaled_lr=0.05,
                   step_scale="rms", files="capsules", parameters=lambda m: _capsule_tensors(m, "parameter")),
    "prompt": Method("prompt tuning", attach_prompt, prompt_tensors, default_n=100, lr=0.3),
    "deep-prompt": Method(
        "deep prompt tuning",
        attach_deep_prompt,
        deep_prompt_tensors,
        default_n=1,
        lr=0.3,
        scaled_lr=0.05,
        step_scale="rms",
    ),
    "prefix": Method("P-Tuning v2", attach_prefix, prefix_tensors, default_n=64, lr=1e-2, scaled_lr=0.1),
    "linear-head": Method("linear head", attach_linear_head, linear_head_tensors, lr=1e-3),
    "instance": Method("instance", _attach_capsules, lambda m: {}),  # its vectors are zeros by definition
}


# ---------------------------------------------------------------------------------------------
# Attaching a method to a model


def detach(model: CaptModel) -> None:
    """Remove whatever method is attached: the model is its plain backbone again."""
    for block in model.capsule_blocks():
        block.capsule = block.capsule_active = block.capsule_instance = None
    detach_seams(model)
    model.method = None


BYTES_PER_VALUE = 16  # a trained fp32 value, its gradient and AdamW's two moments


def method_values_count(model: CaptModel, config: MethodConfig) -> int:
    """How many values the method's tensors hold on this model (computed, nothing allocated)."""
    blocks, d = len(model.capsule_blocks()), model.capsule_width
    if config.method in ("capt", "instance"):
        c = config.capsule
        per_block = d * c.length + {"extraction": d * EXTRACTION_KERNEL, "projection": 2 * d * PROJECTION_RANK}.get(
            c.integration, 0
        )
        return blocks * per_block * (1 if config.task_capsules is None else len(config.task_capsules))
    if config.method == "prompt":
        return config.n * model.input_embedding().embedding_dim
    if config.method == "deep-prompt":
        return blocks * config.n * d
    if config.method == "prefix":
        heads, head_dim = model.prefix_shape()
        return 2 * len(model.prefix_attentions()) * heads * config.n * head_dim
    return (d + 1) * config.num_classes  # linear-head


def free_memory(device: torch.device) -> int | None:
    """Bytes free for new tensors on device (the CPU: MemAvailable of /proc/meminfo), None when not known."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def check_room(model: CaptModel, config: MethodConfig) -> None:
    """Refuse, before anything is allocated, a method whose tensors could not be trained in the memory free
    on the model's device (BYTES_PER_VALUE each), or whose front rows take more positions than a model with
    a position limit has (Llama / Qwen2's rope table: prompt, deep-prompt and prefix rows come first)."""
    device = next(model.parameters()).device
    limit = getattr(model.config, "max_position_embeddings", None)
    if config.n is not None and limit is not None and config.n >= limit:
        raise CaptError(f"{config.method} with n {config.n:,}: its rows take positions 0..{config.n - 1:,} in front of "
                        "every input, "
                        f"but the model has max_position_embeddings {limit:,}; choose a smaller n")
    if device.type == "meta":  # counting only (load.trainable_count)
        return
    needed, free = method_values_count(model, config) * BYTES_PER_VALUE, free_memory(device)
    if free is not None and needed > free:
        what = f"{config.method} with n {config.n:,}" if config.n is not None else config.method
        raise CaptError(f"{what} trains {needed // BYTES_PER_VALUE:,} values, {needed / 2**30:,.1f} GiB with their "
                        "gradients and "
                        f"AdamW's moments, more than the {free / 2**30:,.1f} GiB free on {device}; choose a smaller n")


def attach(model: CaptModel, method: str | MethodConfig = "capt", n: int | None = None, num_classes: int | None = None,
           capsules: CapsuleConfig | None = None, generator: torch.Generator | None = None) -> MethodConfig:
    """Freeze the backbone and give it the method's fresh fp32 tensors (replacing any method
    attached before); returns the record now on the model. generator: for the random initial
    values (None: torch's global generator). A method too large for the device's free memory, or
    with more front rows than the model has positions, is refused first (check_room)."""
    config = method if isinstance(method, MethodConfig) else MethodConfig(method, n, num_classes, capsules)
    check_room(model, config)
    detach(model)
    for p in model.parameters():
        p.requires_grad_(False)
    METHODS[config.method].attach(model, config, generator)
    model.method = config
    return config


def method_tensors(model: CaptModel) -> dict[str, torch.Tensor]:
    """The attached method's tensors by their file names, in the files' form (capt: `layers.{l}`, each a (d,)
    view of block l's table, as capsules.safetensors holds it): what is saved, loaded and restored."""
    return {} if model.method is None else METHODS[model.method.method].tensors(model)


def method_parameters(model: CaptModel) -> dict[str, nn.Parameter]:
    """The attached method's trained parameters by the same names (capt: each block's (1, d) table): what
    the optimizer steps. The order is the files' (block by block), whatever order the model lists them in."""
    if model.method is None:
        return {}
    spec = METHODS[model.method.method]
    return (spec.parameters or spec.tensors)(model)
