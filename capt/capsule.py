"""The capsule: one trainable vector per block, mixed with the mean of the block's own input.

The models call two functions from their forward:

    open_slots(h0, mask, p0, integration)      before block 0: put the slot(s) at index 0
    refresh_slots(h, mask, p, integration)     entering a later block l in S: re-form them

Everything else here is bookkeeping: which blocks carry a capsule (CapsuleConfig), attaching
fresh vectors to a model, and the mean-pool-plus-add itself, as a readable reference and as a
fused pass for the GPU (`pool_add`, which picks between them).

Shapes: h (B, N, d) hidden states with the slot(s) at the front; mask (B, N) is 1 where a
position may be summarised (the slot(s) and the real prompt tokens), 0 elsewhere; p (d,) fp32.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from dataclasses import dataclass

import torch
import torch.nn as nn

from .errors import CaptError

INTEGRATIONS = ("add", "prepend")
BLOCK_SETS = ("all", "odd", "first-half", "latter-half")
INITS = ("zeros",)


@dataclass
class CapsuleConfig:
    """Where the capsules go and how they enter the sequence (docs: method.md).

    integration: "add" (one slot: p_l + instance mean) or "prepend" (two slots: the instance
        mean, then p_l).
    blocks: "all", "odd" (0-based 0, 2, 4, ...), "first-half", "latter-half", or a list of
        0-based block indices.
    init: "zeros", the paper-faithful default.
    """

    integration: str = "add"
    blocks: str | list[int] = "all"
    init: str = "zeros"

    def __post_init__(self):
        if self.integration not in INTEGRATIONS:
            raise CaptError(f"capsule integration {self.integration!r} is not one of {', '.join(INTEGRATIONS)}")
        if isinstance(self.blocks, str):
            if self.blocks not in BLOCK_SETS:
                raise CaptError(f"capsule blocks {self.blocks!r} is not one of {', '.join(BLOCK_SETS)} or a list of indices")
        else:
            if not isinstance(self.blocks, (list, tuple)):
                raise CaptError(f"capsule blocks {self.blocks!r} is not one of {', '.join(BLOCK_SETS)} or a list of indices")
            indices = [self._block_index(i) for i in self.blocks]
            bad = [i for i, j in zip(self.blocks, indices) if j is None]
            if bad:
                raise CaptError(f"capsule blocks {bad!r}: block indices are whole numbers from 0")
            self.blocks = sorted(set(indices))
            if not self.blocks:
                raise CaptError("capsule blocks: an explicit list must name at least one block")
        if self.init not in INITS:
            raise CaptError(f"capsule init {self.init!r} is not one of {', '.join(INITS)}")

    @staticmethod
    def _block_index(value) -> int | None:
        """value as a 0-based block index (an int, or a float with no fraction), or None if it is not one."""
        if isinstance(value, bool):  # True is an int to Python, not a block
            return None
        if isinstance(value, numbers.Integral) or (isinstance(value, float) and value.is_integer()):
            return int(value) if value >= 0 else None
        return None

    @property
    def n_slots(self) -> int:
        return 1 if self.integration == "add" else 2

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
            raise CaptError(f"capsule blocks {bad} are outside the model's {n_layers} blocks (0..{n_layers - 1})")
        return list(self.blocks)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "CapsuleConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})

    def __str__(self) -> str:
        return json.dumps(self.to_dict())


# ---------------------------------------------------------------------------------------------
# The mean-pool-plus-add


def pool_add_reference(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """p + mean over {t : mask_t = 1} of h_t, per sequence, accumulated in fp32. Returns (B, d) fp32."""
    m = mask.to(torch.float32)  # (B, N)
    total = torch.einsum("bn,bnd->bd", m, h.float())  # (B, d)
    mean = total / m.sum(1, keepdim=True).clamp_min(1.0)
    return mean if p is None else mean + p.float()


def pool_add(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """The same as pool_add_reference; one fused pass over h on CUDA when Triton is present."""
    if h.is_cuda and _fused_kernel() is not None:
        return _fused_kernel()(h, mask, p)
    return pool_add_reference(h, mask, p)


_FUSED = []


def _fused_kernel():
    """capt.fused.pool_add_fused, imported on first use (Triton is only needed on a GPU)."""
    if not _FUSED:
        try:
            from .fused import pool_add_fused
        except ImportError:  # no Triton: the reference serves
            pool_add_fused = None
        _FUSED.append(pool_add_fused)
    return _FUSED[0]


# ---------------------------------------------------------------------------------------------
# What the models call


def open_slots(h0: torch.Tensor, mask: torch.Tensor, p0: torch.Tensor | None, integration: str) -> torch.Tensor:
    """Before block 0: the slot(s) in front of the token embeddings h0 (B, T, d).

    add:     [mean of the real tokens' embeddings + p_0]
    prepend: [mean of the real tokens' embeddings, p_0]
    p0 is None when block 0 carries no capsule (then p_0 counts as zeros).
    """
    if integration == "add":
        slots = pool_add(h0, mask, p0)[:, None]  # (B, 1, d)
    else:
        mean = pool_add(h0, mask, None)
        task = torch.zeros_like(mean) if p0 is None else p0.float().expand_as(mean)
        slots = torch.stack([mean, task], dim=1)  # (B, 2, d)
    return torch.cat([slots.to(h0.dtype), h0], dim=1)  # (B, S + T, d)


def refresh_slots(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor, integration: str) -> torch.Tensor:
    """Entering a block l > 0 that carries p_l: replace the slot(s) at the front of h (B, N, d).

    add:     slot = p_l + mean(previous slot, real tokens)
    prepend: slot 0 = mean(both slots, real tokens); slot 1 = p_l
    mask (B, N) marks the slot(s) and the real tokens.
    """
    if integration == "add":
        slots = pool_add(h, mask, p)[:, None]
    else:
        mean = pool_add(h, mask, None)
        slots = torch.stack([mean, p.float().expand_as(mean)], dim=1)
    return torch.cat([slots.to(h.dtype), h[:, slots.shape[1]:]], dim=1)


def slot_mask(mask: torch.Tensor, n_slots: int) -> torch.Tensor:
    """(B, T) -> (B, n_slots + T): the slots are always visible and always pooled."""
    ones = mask.new_ones(mask.shape[0], n_slots)
    return torch.cat([ones, mask], dim=1)


# ---------------------------------------------------------------------------------------------
# Attaching capsules to a model


def attach_capsules(model: nn.Module, config: CapsuleConfig) -> None:
    """Give each block in the set a fresh fp32 capsule vector and freeze everything else.

    The model provides `capsule_blocks()` (the blocks of the stack that carries capsules) and
    `capsule_width` (d). Each block has a `capsule` attribute: a Parameter or None.
    """
    from .methods import detach  # (imported here: methods builds on this module)

    blocks = model.capsule_blocks()
    chosen = set(config.layer_indices(len(blocks)))
    detach(model)  # capsules replace whatever method was attached; they never stack on one
    for p in model.parameters():
        p.requires_grad_(False)
    device = next(model.parameters()).device
    for i, block in enumerate(blocks):
        block.capsule = nn.Parameter(torch.zeros(model.capsule_width, dtype=torch.float32, device=device)) if i in chosen else None
    model.capsule_config = config


def capsule_vectors(model: nn.Module) -> dict[int, nn.Parameter]:
    """{block index: capsule vector} for the blocks that carry one."""
    return {i: b.capsule for i, b in enumerate(model.capsule_blocks()) if b.capsule is not None}
