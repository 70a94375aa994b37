"""The per-block step scale: each block's trained tensor moves in proportion to what it joins.

Adam moves every coordinate of a tensor by about the learning rate per step, whatever the size
of its gradient. A capsule p_l is added to the mean of block l's input, and that input grows
with depth by orders of magnitude (docs/method.md gives SmolLM2-135M's). With one rate for all
blocks, block 0's capsule swamps the instance mean within a step or two while the deep blocks'
capsules barely move, and whether a short run learns at all turns on the last digits of the rate
(docs/results.md: the step scale).

With the step scale, block l's rate is r x c_l, where c_l is the RMS (over examples and
coordinates) of the masked mean of block l's input over the prompt's real tokens, measured on the
plain model (no method attached) once, before the first step, on the first SCALE_BATCHES batches
of the seed's first epoch. For Adam this is training q_l with p_l = c_l q_l (up to Adam's eps):
r is a step relative to the block's own scale, and q_l starts where the plain form's tensor
starts, so p_l starts at c_l times that (zero stays zero). The saved tensors are still p_l, so
files, models and the fused op do not change; the scales are recorded in the run's config.json,
and a resumed run reads them back from there.

It applies to the methods whose tensors sit beside something of their block's: capt (p_l, also
the task slot of the prepend integration) and deep-prompt (block l's rows) join the residual
stream, and their c_l is as above; prefix tuning's keys and values stand beside the layer's own
keys and values, so a prefix has two scales per layer, the RMS of that layer's keys (before
rotation, which keeps the RMS) and of its values over the real tokens. Prefix vectors start at
N(0, 1) in the plain form: with the step scale, N(0, c^2), the size of the layer's own. Prompt
tuning has one tensor at the input and a linear head reads the output: they keep one rate for every
tensor. The extraction filter and the projection's maps multiply the block's mean, so they have no
size to follow: each starts where the plain form's does and trains at r over its fan-in (rate_of).
The paper names no optimiser; step scale "none" is that plain form (one rate), kept one option away.
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn as nn

from .errors import CaptError
from .evaluate import pad
from .models.ops import pool_add_reference

STEP_SCALES = ("rms", "none")
SCALE_BATCHES = 4  # batches of the seed's first epoch that the scales are measured on


class _Recorder(nn.Module):
    """A block's entry seam that keeps what enters the block (B, T, d) and passes it on unchanged."""

    def __init__(self, inputs: list[torch.Tensor]):
        super().__init__()
        self.inputs = inputs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return x


def _block_inputs(model, prompts: list[list[int]]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """The input of every block of model.capsule_blocks() (B, T, d) for prompts, right-padded, and
    the mask of real tokens (B, T), read at the blocks' entry seams; the model must be plain, so
    that its blocks see the prompts alone."""
    if model.method is not None or model.front is not None:
        raise CaptError("the step scales are measured on the plain model: detach the method first")
    ids, mask = pad(prompts, device=next(model.parameters()).device)  # (B, T) right-padded, (B, T)
    hidden: list[torch.Tensor] = []
    blocks = model.capsule_blocks()
    for block in blocks:
        block.entry = _Recorder(hidden)
    try:
        if model.seq2seq:
            model.encode(ids, mask)
        else:  # one logit column: the output matrix is not what is measured
            model(ids, attention_mask=mask, logits_at=torch.zeros(len(prompts), 1, dtype=torch.long, device=ids.device))
    finally:
        for block in blocks:
            block.entry = None
    return hidden, mask


def _checked(scales: list[float], names: list[str]) -> list[float]:
    bad = [i for i, c in enumerate(scales) if not (math.isfinite(c) and c > 0)]
    if bad:
        raise CaptError(f"the step scale of {names[bad[0]]} is {scales[bad[0]]}: the model's hidden states there are "
                        "zero, NaN or infinite; train with --step-scale none")
    return scales


@torch.no_grad()
def block_input_rms(model, batches: list[list[list[int]]]) -> list[float]:
    """c_l for every block of model.capsule_blocks(): the RMS of the masked mean of block l's input
    over each prompt's tokens, over all the prompts of `batches` (lists of token-id lists)."""
    squares = torch.zeros(len(model.capsule_blocks()), dtype=torch.float64)
    count = 0
    for prompts in batches:
        hidden, mask = _block_inputs(model, prompts)
        for block, h in enumerate(hidden):
            squares[block] += pool_add_reference(h, mask, None).double().pow(2).sum().cpu()  # (B, d) means, squared
        count += len(prompts) * model.capsule_width
    return _checked((squares / count).sqrt().tolist(), [f"block {i}" for i in range(len(squares))])


@torch.no_grad()
def key_value_rms(model, batches: list[list[list[int]]]) -> list[list[float]]:
    """[key scale, value scale] for every layer of model.prefix_attentions(): the RMS of the layer's
    own keys (before rotation) and values over the real tokens of all the prompts of `batches`."""
    squares = torch.zeros(len(model.prefix_attentions()), 2, dtype=torch.float64)
    heads, head_dim = model.prefix_shape()
    count = 0
    for prompts in batches:
        hidden, mask = _block_inputs(model, prompts)
        real = mask[:, None, :, None].double()  # (B, 1, T, 1)
        for layer, h in enumerate(hidden):
            for j, t in enumerate(model.prefix_key_values(layer, h)):  # (B, Hkv, T, Dh)
                squares[layer, j] += (t.double().pow(2) * real).sum().cpu()
        count += int(mask.sum()) * heads * head_dim
    flat = _checked(
        (squares / count).sqrt().flatten().tolist(),
        [f"layer {i}'s {kv}" for i in range(len(squares)) for kv in ("keys", "values")],
    )
    return [flat[i:i + 2] for i in range(0, len(flat), 2)]


def fits(scales, method: str, blocks: int) -> bool:
    """Whether scales (as read from a config.json) are the method's: `blocks` positive numbers, or
    for prefix `blocks` pairs of them."""
    pairs = method == "prefix"
    def number(c):
        return isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c > 0
    return isinstance(scales, list) and len(scales) == blocks and all(
        (isinstance(c, list) and len(c) == 2 and all(map(number, c))) if pairs else number(c) for c in scales)


def block_of(name: str) -> int:
    """The block index of a per-block method tensor's file name ("layers.3", "layers.3.deep_prompt")."""
    found = re.match(r"layers\.(\d+)(\.|$)", name)
    if found is None:
        raise CaptError(f"{name} is not a per-block tensor: the step scale needs one tensor per block")
    return int(found.group(1))


MAPS = (".weight", ".down", ".up")  # the extraction filter, the projection's maps: they multiply the mean


def scale_of(name: str, scales: list) -> float:
    """The scale of one method tensor, where it starts: its block's, or for a prefix its layer's key or value
    scale; 1 for the tensors that multiply the block's own mean (extraction's filter, projection's maps): they have
    no size of their own, and start where the plain form's do."""
    if name.endswith(MAPS):
        return 1.0
    c = scales[block_of(name)]
    return c[0 if name.endswith(".prefix_k") else 1] if isinstance(c, list) else c


def rate_of(name: str, tensor: torch.Tensor, scales: list) -> float:
    """What multiplies r for one method tensor: its scale; for a map (MAPS), 1 / its fan-in (the last dim: the
    filter's taps, down's width d, up's rank). Adam moves every entry of a map by about its rate a step, and an
    output sums fan-in of them, so at r the map's gain could move by fan-in x r a step (projection's down: 576 x
    0.05); at r / fan-in it moves by about r, the relative step the capsule takes against its block's mean (the
    rule of muP for Adam's hidden weights). docs/results.md: projection's maps at r diverged on RTE."""
    return 1.0 / tensor.shape[-1] if name.endswith(MAPS) else scale_of(name, scales)


@torch.no_grad()
def scale_start(tensors: dict[str, torch.Tensor], scales: list) -> None:
    """p = c q at the start: the fresh tensors (q, where the plain form starts) times their scales."""
    for name, t in tensors.items():
        t.mul_(scale_of(name, scales))


def param_groups(tensors: dict[str, torch.Tensor], lr: float, scales: list | None) -> list[dict]:
    """AdamW's parameter groups: with scales, one group per tensor at lr x its rate_of; without, every tensor
    at lr."""
    if scales is None:
        return [{"params": list(tensors.values()), "lr": lr}]
    return [{"params": [t], "lr": lr * rate_of(name, t, scales)} for name, t in tensors.items()]
