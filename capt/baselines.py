"""The methods CaPT is compared with, put on a model through its three seams (capt/models/protocol.py).

A model file writes the capsule inline and leaves three places where another method may act, each
None until a method fills it with a module of this file:

    model.front        rows in front of the input embeddings,      FrontRows: prompt tuning's n vectors;
                       before block 0                              deep prompt tuning's block-0 vectors;
                                                                   pooled instance tokens (chunk means)
    block.entry        the input of a block                        EntryRows: deep prompt tuning's rows,
                                                                   replaced at every later block
    attention.prefix   key/value columns in front of an            PrefixColumns: prefix tuning (P-Tuning v2)
                       attention's own

The linear head reads the model's final hidden states (model.features) and needs no seam. Every
seam acts on the call that begins a sequence; a key/value cache keeps what they put there. The
trained tensors are fp32 parameters of these modules; their file names (methods.METHODS) are those
capt has always written, so saved adapters load as they are.

Initialisation (choices): deep prompts and the linear head start at zero; prompt vectors are copies
of the embeddings of n random vocabulary tokens (prompt tuning's sampled vocabulary start, so they
have the embeddings' scale); prefix keys and values are N(0, 1), as P-Tuning v2's and peft's
embedding tables start. `generator` draws the random ones.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from .errors import CaptError

MAX_POOLED = 4096  # pooled instance tokens at most: each is a chunk of the prompt, and no prompt here is longer


def trained(model, t: torch.Tensor) -> nn.Parameter:
    """A method's tensor: fp32, on the model's device, trained."""
    return nn.Parameter(t.to(device=next(model.parameters()).device, dtype=torch.float32))


# ---------------------------------------------------------------------------------------------
# The seams' modules


def chunk_index(mask: torch.Tensor, k: int) -> torch.Tensor:
    """(B, T) mask of real tokens -> (B, T) the chunk 0..k-1 of each real token (-1 for the others).

    A row's n real tokens, in order, are split into k contiguous chunks of n // k tokens, the
    first n % k chunks one token longer (10 tokens in 4 chunks: 3, 3, 2, 2). With n < k the last
    k - n chunks are empty."""
    rank = mask.long().cumsum(-1) - 1  # (B, T) index of each real token among its row's
    n = mask.long().sum(-1, keepdim=True)  # (B, 1)
    size, extra = n // k, n % k  # chunk sizes: size + 1 for the first `extra` chunks, size for the rest
    long_part = extra * (size + 1)  # tokens in the longer chunks
    chunk = torch.where(rank < long_part, rank // (size + 1), extra + (rank - long_part) // size.clamp_min(1))
    return torch.where(mask.bool(), chunk, torch.full_like(chunk, -1))


def pooled_rows(h: torch.Tensor, mask: torch.Tensor, k: int) -> torch.Tensor:
    """Training-free instance tokens: (B, T, d) embeddings, (B, T) mask -> (B, k, d) the means of the
    real tokens' embeddings over k contiguous chunks (chunk_index); an empty chunk gives zeros."""
    chunks = chunk_index(mask, k)  # (B, T)
    member = (chunks[..., None] == torch.arange(k, device=h.device)).to(h.dtype)  # (B, T, k)
    sums = member.transpose(1, 2) @ h  # (B, k, d)
    return sums / member.sum(1)[..., None].clamp_min(1)


class FrontRows(nn.Module):
    """model.front: `pooled` chunk means of the prompt's embeddings (nothing trained), then the trained
    vectors (n, d) if any, in front of every sequence: (B, T, d) embeddings -> (B, pooled + n, d)."""

    def __init__(self, vectors: nn.Parameter | None, pooled: int = 0):
        super().__init__()
        self.vectors = vectors
        self.pooled = pooled

    @property
    def length(self) -> int:
        return self.pooled + (0 if self.vectors is None else self.vectors.shape[0])

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        rows = [pooled_rows(x, mask, self.pooled)] if self.pooled else []  # (B, k, d) from the tokens alone
        if self.vectors is not None:
            rows.append(self.vectors.to(x.dtype).expand(x.shape[0], -1, -1))  # (B, n, d)
        return torch.cat(rows, dim=1)


class EntryRows(nn.Module):
    """block.entry for deep prompt tuning: the n rows of the block's input from index `at` (after the
    pooled rows, if any) replaced by this block's trained vectors (n, d); the rows before stay."""

    def __init__(self, vectors: nn.Parameter, at: int = 0):
        super().__init__()
        self.vectors = vectors
        self.at = at

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self.vectors.to(x.dtype).expand(x.shape[0], -1, -1)  # (B, n, d)
        return torch.cat([x[:, :self.at], rows, x[:, self.at + self.vectors.shape[0]:]], dim=1)


class PrefixColumns(nn.Module):
    """attention.prefix for prefix tuning: trained keys and values (Hkv, n, Dh) in front of the layer's
    own, k, v (B, Hkv, T, Dh) -> (B, Hkv, n + T, Dh) each; the keys are not rotated."""

    def __init__(self, keys: nn.Parameter, values: nn.Parameter):
        super().__init__()
        self.keys, self.values = keys, values

    @property
    def length(self) -> int:
        return self.keys.shape[1]

    def forward(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B = k.shape[0]
        return (torch.cat([self.keys.to(k.dtype).expand(B, -1, -1, -1), k], dim=2),
                torch.cat([self.values.to(v.dtype).expand(B, -1, -1, -1), v], dim=2))


# ---------------------------------------------------------------------------------------------
# Attaching each baseline (methods.METHODS names them), and its tensors by their file names


def attach_prompt(model, config, generator) -> None:
    embedding = model.input_embedding()
    tokens = torch.randint(0, embedding.num_embeddings, (config.n,), generator=generator)
    model.front = FrontRows(
        trained(model, embedding.weight.detach()[tokens.to(embedding.weight.device)].float().clone())
    )


def prompt_tensors(model) -> dict[str, torch.Tensor]:
    return {"prompt": model.front.vectors}


def attach_deep_prompt(model, config, generator) -> None:
    """Block 0's vectors are rows in front (the front seam); every later block replaces them with its own (entry)."""
    blocks = model.capsule_blocks()
    model.front = FrontRows(trained(model, torch.zeros(config.n, model.capsule_width)))
    for block in list(blocks)[1:]:
        block.entry = EntryRows(trained(model, torch.zeros(config.n, model.capsule_width)))


def deep_prompt_tensors(model) -> dict[str, torch.Tensor]:
    rows = [model.front.vectors] + [block.entry.vectors for block in list(model.capsule_blocks())[1:]]
    return {f"layers.{i}.deep_prompt": t for i, t in enumerate(rows)}


def attach_prefix(model, config, generator) -> None:
    heads, head_dim = model.prefix_shape()
    for attention in model.prefix_attentions():
        attention.prefix = PrefixColumns(trained(model, torch.randn(heads, config.n, head_dim, generator=generator)),
                                         trained(model, torch.randn(heads, config.n, head_dim, generator=generator)))


def prefix_tensors(model) -> dict[str, torch.Tensor]:
    tensors = {}
    for i, attention in enumerate(model.prefix_attentions()):
        tensors[f"layers.{i}.prefix_k"], tensors[f"layers.{i}.prefix_v"] = (
            attention.prefix.keys,
            attention.prefix.values,
        )
    return tensors


def attach_linear_head(model, config, generator) -> None:
    if model.seq2seq:
        raise CaptError("linear-head is for decoder-only models (Llama, Qwen2): T5 scores targets with its decoder")
    head = nn.Linear(
        model.capsule_width, config.num_classes, device=next(model.parameters()).device, dtype=torch.float32
    )
    nn.init.zeros_(head.weight)
    nn.init.zeros_(head.bias)
    model.linear_head = head


def linear_head_tensors(model) -> dict[str, torch.Tensor]:
    return {"linear_head.weight": model.linear_head.weight, "linear_head.bias": model.linear_head.bias}


def detach_seams(model) -> None:
    """Empty the three seams and the linear head: the plain backbone again."""
    model.front = model.linear_head = None
    for block in model.capsule_blocks():
        block.entry = None
    for attention in model.prefix_attentions():
        attention.prefix = None


def set_pooled(model, k: int) -> None:
    """Training-free instance tokens (the paper's pre-study): k rows in front of the sequence, the means of
    the prompt's token embeddings over k contiguous chunks (pooled_rows), nothing trained; on the plain
    model, or in front of a deep-prompt model's rows (which its blocks then replace after the pooled rows).
    The rows enter before block 0 and pass through the blocks like the tokens. k = 0 removes them."""
    method = None if model.method is None else model.method.method
    if k and method not in (None, "deep-prompt"):
        raise CaptError(f"pooled instance tokens go on the plain model or a deep-prompt model, not on {method}")
    # they take positions 0..k-1 where there are positions
    limit = getattr(model.config, "max_position_embeddings", MAX_POOLED)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= min(limit, MAX_POOLED):
        raise CaptError(f"pooled instance tokens: k is {k!r}, but it must be a whole number from 0 to "
                        f"{min(limit, MAX_POOLED):,} "
                        "(chunk means of the prompt's tokens: beyond its length they are empty)")
    if model.front is None:
        model.front = FrontRows(None, k) if k else None
        return
    model.front.pooled = k
    if model.front.length == 0:
        model.front = None
    for block in model.capsule_blocks():
        if block.entry is not None:
            block.entry.at = k


def pooled_count(model) -> int:
    """The pooled instance tokens in front of the model's rows (set_pooled), 0 for none."""
    return 0 if model.front is None else model.front.pooled


# ---------------------------------------------------------------------------------------------
# The linear head's scores


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) padding mask -> (B,) index of each row's last real token (left or right padding)."""
    index = torch.arange(mask.shape[1], device=mask.device)
    return (index * mask.bool()).argmax(-1)


def classify(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
             at: torch.Tensor | None = None) -> torch.Tensor:
    """linear-head: class logits (B, C) from the final hidden state at `at` (B,), by default each
    row's last real token (the prompt's last token when input_ids hold the prompt only)."""
    if model.linear_head is None:
        raise CaptError("this model has no linear head: attach(model, 'linear-head', num_classes=...) first")
    if at is None:
        at = (
            torch.full_like(input_ids[:, 0], input_ids.shape[1] - 1)
            if attention_mask is None
            else last_token(attention_mask)
        )
    hidden = model.features(input_ids, attention_mask=attention_mask, hidden_at=at[:, None])[:, 0]  # (B, d)
    return model.linear_head(hidden.float())  # (B, C)
