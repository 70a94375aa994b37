"""The methods the paper compares, on the same backbones, trainer and evaluation.

    capt          one vector per block, mixed with the mean of the instance (capsule.py)
    prompt        n trained vectors in front of the input embeddings (prompt tuning)
    deep-prompt   n trained vectors per block at the front of the sequence, replaced at every
                  block's input (with n = 1: the capsule without the instance mean)
    prefix        n trained keys and values per attention layer in front of its own (P-Tuning v2)
    linear-head   a trained linear classifier over the final hidden state of the last prompt
                  token, the model frozen (decoder-only models)
    instance      the capsule slot with its vectors held at zero: nothing is trained

The backbone is frozen and the trained tensors (fp32) live on the model, where its forward uses
them inline, a few named lines per method:

    model.prompt                        (n, d)          put in front of the embeddings
    block.deep_prompt                   (n, d)          block 0: put in front; later blocks: replace the n front rows
    attention.prefix_k / .prefix_v      (Hkv, n, Dh)    put in front of that layer's keys / values
    model.linear_head                   Linear(d, C)    over model(..., hidden_at=...), see classify()

T5 carries them in the encoder (prefixes in its self-attention), as it carries the capsule.
Prompt and deep-prompt vectors are sequence rows like the capsule slot: at index 0..n-1, always
visible, positions 0..n-1, the tokens after them, never in the outputs. Prefix keys are not
rotated and the tokens' positions start at n, as when peft hands a prefilled key/value cache
to transformers; T5's prefix keys likewise sit at relative positions 0..n-1, tokens from n.

Files: capsules keep capsules.safetensors + capsules.json (capt.load); the other methods write
adapter.safetensors (the tensors by the names of method_tensors) + adapter.json (the
MethodConfig and the base model they were made for).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn
from safetensors.torch import save_file

from .capsule import CapsuleConfig, attach_capsules, capsule_vectors
from .errors import CaptError

METHODS = ("capt", "prompt", "deep-prompt", "prefix", "linear-head", "instance")
# Vectors per place when n is not given (choices): prompt tuning's usual 100 tokens; one deep-prompt
# vector per block (the capsule without the instance mean); 64 prefix vectors per layer, which on
# T5-Base's encoder gives the paper's 0.53% for P-Tuning v2.
DEFAULT_N = {"prompt": 100, "deep-prompt": 1, "prefix": 64}


@dataclass
class MethodConfig:
    """What is trained and where. n: vectors per place (prompt, deep-prompt, prefix); num_classes:
    linear-head's classes; capsule: capt's CapsuleConfig."""

    method: str = "capt"
    n: int | None = None
    num_classes: int | None = None
    capsule: CapsuleConfig | None = None

    def __post_init__(self):
        if self.method not in METHODS:
            raise CaptError(f"method {self.method!r} is not one of {', '.join(METHODS)}")
        if self.method in DEFAULT_N:
            self.n = DEFAULT_N[self.method] if self.n is None else int(self.n)
            if self.n < 1:
                raise CaptError(f"{self.method} needs n >= 1 vectors, got {self.n}")
        else:
            self.n = None
        if self.method == "linear-head":
            if self.num_classes is None or int(self.num_classes) < 2:
                raise CaptError(f"linear-head needs num_classes >= 2, got {self.num_classes}")
            self.num_classes = int(self.num_classes)
        else:
            self.num_classes = None
        if self.method == "capt":
            self.capsule = CapsuleConfig() if self.capsule is None else self.capsule
            if isinstance(self.capsule, dict):
                self.capsule = CapsuleConfig.from_dict(self.capsule)
        else:
            self.capsule = None

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d["capsule"] = None if self.capsule is None else self.capsule.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "MethodConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def __str__(self) -> str:
        return json.dumps(self.to_dict())


# ---------------------------------------------------------------------------------------------
# What the models call in their forward


def prepend(vectors: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(n, d) trained vectors in front of every sequence of x (B, T, d) -> (B, n + T, d)."""
    return torch.cat([vectors.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)


def replace_front(vectors: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The n front rows of x (B, n + T, d) replaced by (n, d) trained vectors."""
    return torch.cat([vectors.to(x.dtype).expand(x.shape[0], -1, -1), x[:, vectors.shape[0]:]], dim=1)


def prepend_heads(prefix: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(H, n, Dh) trained keys or values in front of k (B, H, T, Dh) -> (B, H, n + T, Dh)."""
    return torch.cat([prefix.to(k.dtype).expand(k.shape[0], -1, -1, -1), k], dim=2)


# ---------------------------------------------------------------------------------------------
# Attaching a method to a model


def detach(model: nn.Module) -> None:
    """Remove whatever method is attached: the model is its plain backbone again."""
    model.capsule_config = None
    for block in model.capsule_blocks():
        block.capsule = None
        block.deep_prompt = None
    for attention in model.prefix_attentions():
        attention.prefix_k = attention.prefix_v = None
    model.prompt = None
    if hasattr(model, "linear_head"):
        model.linear_head = None
    model.method_config = None


def attach(model: nn.Module, method: str | MethodConfig = "capt", n: int | None = None, num_classes: int | None = None,
           capsules: CapsuleConfig | None = None, generator: torch.Generator | None = None) -> MethodConfig:
    """Freeze the backbone and give it the method's fresh fp32 tensors; returns the MethodConfig.

    Initialisation (choices): capsules, deep prompts and the linear head start at zero; prompt
    vectors are copies of the embeddings of n random vocabulary tokens (prompt tuning's sampled
    vocabulary start, so they have the embeddings' scale); prefix keys and values are N(0, 1),
    as P-Tuning v2's and peft's embedding tables start. generator: for the random ones (None:
    torch's global generator).
    """
    config = method if isinstance(method, MethodConfig) else MethodConfig(method, n, num_classes, capsules)
    detach(model)
    for p in model.parameters():
        p.requires_grad_(False)
    device = next(model.parameters()).device
    d, blocks = model.capsule_width, model.capsule_blocks()

    def trained(t: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.to(device=device, dtype=torch.float32))

    if config.method == "capt":
        attach_capsules(model, config.capsule)
    elif config.method == "instance":  # the capsule model with its vectors held at zero, nothing trained
        attach_capsules(model, CapsuleConfig(integration="add", blocks="all"))
        for p in capsule_vectors(model).values():
            p.requires_grad_(False)
    elif config.method == "prompt":
        embedding = model.input_embedding()
        tokens = torch.randint(0, embedding.num_embeddings, (config.n,), generator=generator)
        model.prompt = trained(embedding.weight.detach()[tokens.to(device)].float().clone())
    elif config.method == "deep-prompt":
        for block in blocks:
            block.deep_prompt = trained(torch.zeros(config.n, d))
    elif config.method == "prefix":
        heads, head_dim = model.prefix_shape()
        for attention in model.prefix_attentions():
            attention.prefix_k = trained(torch.randn(heads, config.n, head_dim, generator=generator))
            attention.prefix_v = trained(torch.randn(heads, config.n, head_dim, generator=generator))
    elif config.method == "linear-head":
        if not hasattr(model, "linear_head"):
            raise CaptError("linear-head is for decoder-only models (Llama, Qwen2): T5 scores targets with its decoder")
        head = nn.Linear(d, config.num_classes, device=device, dtype=torch.float32)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        model.linear_head = head
    model.method_config = config
    return config


def method_config(model: nn.Module) -> MethodConfig | None:
    """The attached method; a model given capsules by capt.load.load_model counts as capt."""
    config = getattr(model, "method_config", None)
    if config is None and getattr(model, "capsule_config", None) is not None:
        config = MethodConfig("capt", capsule=model.capsule_config)
    return config


def method_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The attached method's tensors by their file names (capt: `layers.{l}`, as capsules.safetensors)."""
    config = method_config(model)
    if config is None:
        return {}
    if config.method == "capt":
        return {f"layers.{i}": p for i, p in capsule_vectors(model).items()}
    if config.method == "prompt":
        return {"prompt": model.prompt}
    if config.method == "deep-prompt":
        return {f"layers.{i}.deep_prompt": b.deep_prompt for i, b in enumerate(model.capsule_blocks())}
    if config.method == "prefix":
        tensors = {}
        for i, attention in enumerate(model.prefix_attentions()):
            tensors[f"layers.{i}.prefix_k"], tensors[f"layers.{i}.prefix_v"] = attention.prefix_k, attention.prefix_v
        return tensors
    if config.method == "linear-head":
        return {"linear_head.weight": model.linear_head.weight, "linear_head.bias": model.linear_head.bias}
    return {}  # instance: its vectors are zeros by definition


def trainable_count(config: dict, method: str | MethodConfig = "capt", n: int | None = None, num_classes: int | None = None,
                    capsules: CapsuleConfig | None = None) -> int:
    """Trained parameters of a method on the model of a config.json dict, without any weights."""
    from .load import build_model  # imported here: capt.load may come to import this module

    model = build_model(config, "meta")
    attach(model, method, n, num_classes, capsules)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


# ---------------------------------------------------------------------------------------------
# The linear head


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) padding mask -> (B,) index of each row's last real token (left or right padding)."""
    index = torch.arange(mask.shape[1], device=mask.device)
    return (index * mask.bool()).argmax(-1)


def classify(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             at: torch.Tensor | None = None) -> torch.Tensor:
    """linear-head: class logits (B, C) from the final hidden state at `at` (B,), by default each
    row's last real token (the prompt's last token when input_ids hold the prompt only)."""
    if getattr(model, "linear_head", None) is None:
        raise CaptError("this model has no linear head: attach(model, 'linear-head', num_classes=...) first")
    if at is None:
        at = torch.full_like(input_ids[:, 0], input_ids.shape[1] - 1) if attention_mask is None else last_token(attention_mask)
    hidden = model(input_ids, attention_mask=attention_mask, hidden_at=at[:, None])[:, 0]  # (B, d)
    return model.linear_head(hidden.float())  # (B, C)


# ---------------------------------------------------------------------------------------------
# Files


def save_method(model: nn.Module, directory) -> Path:
    """Save the attached method beside the base checkpoint: capsules as capsules.*, the rest as adapter.*."""
    from .load import _base_description, atomic_write, save_capsules

    config = method_config(model)
    if config is None:
        raise CaptError("this model has no method attached: capt.methods.attach(model, method) first")
    if config.method == "capt":
        return save_capsules(model, directory)
    directory = Path(directory)
    tensors = {k: t.detach().float().cpu().contiguous() for k, t in method_tensors(model).items()}
    meta = {"method_config": config.to_dict(), "base_model": _base_description(model)}
    atomic_write(directory / "adapter.safetensors", lambda tmp: save_file(tensors, tmp))
    atomic_write(directory / "adapter.json", lambda tmp: Path(tmp).write_text(json.dumps(meta, indent=2) + "\n"))
    return directory


def load_method(model: nn.Module, directory) -> MethodConfig:
    """Attach the method saved in directory (adapter.* or capsules.*), after checking its base model."""
    from .load import check_base, fill, load_capsules, read_tensors

    directory = Path(directory)
    if not (directory / "adapter.json").is_file():
        if (directory / "capsules.json").is_file():
            detach(model)
            load_capsules(model, directory)
            model.method_config = MethodConfig("capt", capsule=model.capsule_config)
            return model.method_config
        raise CaptError(f"no adapter.json or capsules.json in {directory}: not a saved method")
    file = directory / "adapter.json"
    try:
        meta = json.loads(file.read_text())
        config = MethodConfig.from_dict(meta["method_config"])
        base = meta["base_model"]
        base["config_sha256"]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as e:
        raise CaptError(f"{file} is not a valid method description ({e!r})") from None
    check_base(base, model, f"the {config.method} tensors", directory)
    tensor_file = directory / "adapter.safetensors"
    saved = read_tensors(tensor_file)
    attach(model, config)
    try:
        fill(method_tensors(model), saved, tensor_file)
    except CaptError:
        detach(model)  # a failed load leaves the plain backbone, not half a method
        raise
    return config
