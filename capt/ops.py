"""The tensor functions the models call inline: the capsule's slots and the baselines' rows.

    open_slots(h0, mask, p0, integration)      before block 0: put the capsule slot(s) at index 0
    refresh_slots(h, mask, p, integration)     entering a later block l in S: re-form them
    pool_add(h, mask, p)                       p + masked mean of h; one fused pass on CUDA
    task_index(tasks, names, batch, device)    each row's capsule set, when a model holds several
    first_capsules(table, active, task_ids)    each row's p_0 from block 0's table
    slot_mask(mask, n)                         n always-visible columns in front of a mask
    prepend / replace_front / prepend_heads    the baselines' trained rows and key/value columns
    pooled_rows(h, mask, k)                    training-free instance tokens: k contiguous chunk means
    attention_with_weights(q, k, v, mask, ...)  SDPA written out, its weights kept (capt attention)
    Linear                                     nn.Linear for the frozen base weights; oneDNN's packed
                                               weights on the CPU

Shapes: h (B, N, d) hidden states with the slot(s) at the front; mask (B, N) is 1 where a
position may be summarised (the slot(s) and the real prompt tokens), 0 elsewhere; p fp32, either
(d,), one vector for every row, or (B, d), each row's own (a model holding several capsule sets
gathers each row's task from its (K, d) table: `table[task_ids]`).
This module knows nothing of models, methods or files (docs/method.md states the method).
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .errors import CaptError

INTEGRATIONS = {"add": 1, "prepend": 2}  # integration -> capsule slots at the front


# ---------------------------------------------------------------------------------------------
# The mean-pool-plus-add


def pool_add_reference(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """p + mean over {t : mask_t = 1} of h_t, per sequence, accumulated in fp32. Returns (B, d) fp32.

    p: (d,) added to every row, (B, d) one vector per row, or None."""
    m = mask.to(torch.float32)  # (B, N)
    total = torch.einsum("bn,bnd->bd", m, h.float())  # (B, d)
    mean = total / m.sum(1, keepdim=True).clamp_min(1.0)
    return mean if p is None else mean + p.float()


def pool_add(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """The same as pool_add_reference; one fused pass over h on CUDA when Triton is present."""
    if h.is_cuda and fused_kernel() is not None:
        return fused_kernel()(h, mask, p)
    return pool_add_reference(h, mask, p)


_FUSED = []


def fused_kernel():
    """capt.fused.pool_add_fused, or None without Triton. Imported on first use on a GPU: importing
    Triton costs about a second, which a CPU run never needs to pay."""
    if not _FUSED:
        try:
            from .fused import pool_add_fused
        except ImportError:  # no Triton: the reference serves
            pool_add_fused = None
        _FUSED.append(pool_add_fused)
    return _FUSED[0]


# ---------------------------------------------------------------------------------------------
# The capsule's slots


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


def refresh_slots(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor, integration: str,
                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """Entering a block l > 0 that carries p_l: replace the slot(s) at the front of h (B, N, d).

    add:     slot = p_l + mean(previous slot, real tokens)
    prepend: slot 0 = mean(both slots, real tokens); slot 1 = p_l
    mask (B, N) marks the slot(s) and the real tokens. p (d,) or (B, d).
    rows (B,) bool, with several capsule sets: the rows whose set holds this block. The others keep
    their slot(s) unchanged, as their own single-set model passes them through a block outside its S.
    """
    if integration == "add":
        slots = pool_add(h, mask, p)[:, None]
    else:
        mean = pool_add(h, mask, None)
        slots = torch.stack([mean, p.float().expand_as(mean)], dim=1)
    slots = slots.to(h.dtype)  # (B, S, d)
    if rows is not None:
        slots = torch.where(rows[:, None, None], slots, h[:, :slots.shape[1]])
    return torch.cat([slots, h[:, slots.shape[1]:]], dim=1)


def first_capsules(table: torch.Tensor, active: torch.Tensor | None, task_ids: torch.Tensor) -> torch.Tensor:
    """p_0 per row from block 0's (K, d) table: (B, d), row task_ids[b]. A set without block 0 (active
    (K,) False) gets zeros that no gradient reaches: its own model has no p_0 at all."""
    p = table[task_ids]
    return p if active is None else torch.where(active[task_ids, None], p, torch.zeros((), dtype=p.dtype, device=p.device))


def task_index(tasks, names: list[str] | None, batch: int, device) -> torch.Tensor | None:
    """Each row's capsule set as a (B,) long tensor of indices into names (the model's sets, in order).

    tasks: a list of names, one per row; one name for every row; or a (B,) integer tensor of
    indices. names None: the model holds one capsule set or none, and tasks must be None too.
    """
    if names is None:
        if tasks is None:
            return None
        raise CaptError("tasks= picks each row's capsule set, but this model holds a single set or none: "
                        "load it with capsules={name: directory, ...}")
    if tasks is None:
        raise CaptError(f"this model holds the capsule sets {', '.join(names)}: pass tasks=, one name per row "
                        "(or a tensor of indices into model.tasks)")
    if isinstance(tasks, torch.Tensor):
        if tasks.dtype == torch.bool or tasks.is_floating_point() or tasks.is_complex():
            raise CaptError(f"tasks as a tensor holds integer indices into model.tasks, got dtype {tasks.dtype}")
        if tuple(tasks.shape) != (batch,):
            raise CaptError(f"tasks has shape {tuple(tasks.shape)}; the batch needs ({batch},): one index per row")
        if bool(((tasks < 0) | (tasks >= len(names))).any()):  # one read back from the device
            raise CaptError(f"tasks holds indices outside 0..{len(names) - 1} (this model holds {', '.join(names)})")
        return tasks.to(device=device, dtype=torch.long)
    if isinstance(tasks, str):
        tasks = [tasks] * batch  # one name serves every row
    tasks = list(tasks)
    if len(tasks) != batch:
        raise CaptError(f"tasks has {len(tasks)} entries for a batch of {batch} rows: give one capsule set per row")
    unknown = [t for t in tasks if t not in names]
    if unknown:
        raise CaptError(f"capsule set {unknown[0]!r} is not loaded: this model holds {', '.join(names)}")
    return torch.tensor([names.index(t) for t in tasks], dtype=torch.long, device=device)


def slot_mask(mask: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T) -> (B, n + T): the n front positions are always visible and always pooled."""
    return torch.cat([mask.new_ones(mask.shape[0], n), mask], dim=1)


# ---------------------------------------------------------------------------------------------
# The baselines' rows and columns


def prepend(vectors: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(n, d) trained vectors in front of every sequence of x (B, T, d) -> (B, n + T, d)."""
    return torch.cat([vectors.to(x.dtype).expand(x.shape[0], -1, -1), x], dim=1)


def replace_front(vectors: torch.Tensor, x: torch.Tensor, at: int = 0) -> torch.Tensor:
    """The n rows of x (B, at + n + T, d) from index `at` replaced by (n, d) trained vectors (the rows before stay)."""
    rows = vectors.to(x.dtype).expand(x.shape[0], -1, -1)
    return torch.cat([x[:, :at], rows, x[:, at + vectors.shape[0]:]], dim=1)


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


def prepend_heads(prefix: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """(H, n, Dh) trained keys or values in front of k (B, H, T, Dh) -> (B, H, n + T, Dh)."""
    return torch.cat([prefix.to(k.dtype).expand(k.shape[0], -1, -1, -1), k], dim=2)


def last_token(mask: torch.Tensor) -> torch.Tensor:
    """(B, T) padding mask -> (B,) index of each row's last real token (left or right padding)."""
    index = torch.arange(mask.shape[1], device=mask.device)
    return (index * mask.bool()).argmax(-1)


def attention_with_weights(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                           is_causal: bool = False, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """softmax(q k^T * scale + mask) v written out, as SDPA computes it, returning the weights too.

    q (B, H, T, Dh), k and v (B, H, S, Dh) with q's heads (grouped heads already repeated);
    attn_mask None, boolean (True: may attend) or additive, broadcast to (B, H, T, S); is_causal as
    SDPA's (top-left: query i sees keys 0..i). Returns (B, H, T, Dh) and the weights (B, H, T, S).
    Only the analysis (capt attention) takes this path; training and evaluation keep SDPA.
    """
    scores = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5 if scale is None else scale)  # (B, H, T, S)
    if is_causal:
        attn_mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()  # (T, S)
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask
    weights = scores.float().softmax(-1).to(q.dtype)  # (B, H, T, S): each row sums to one
    return weights @ v, weights


# ---------------------------------------------------------------------------------------------
# The base model's linear layers


# CAPT_CPU_PACK=0 (or setting this to False) keeps every product on F.linear.
PACK_ON_CPU = os.environ.get("CAPT_CPU_PACK", "1") != "0"
# Fewer rows than this (a decoding step, a small batch) stay on F.linear: there the packed call's
# fixed cost was as large as the product (bench/packed_linear_cpu.py).
PACK_MIN_ROWS = 128
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # Linear -> (weight it was packed from, version, packed)


class _PackedFrozen(torch.autograd.Function):
    """x W^T + b on the packed weight, for a frozen W and b: the gradient reaches x only, as grad @ W,
    the product F.linear's own backward runs for x. Nothing of x is kept for the backward."""

    @staticmethod
    def forward(ctx, x, weight, bias, packed):
        ctx.save_for_backward(weight)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        return grad.matmul(weight), None, None, None


class Linear(nn.Linear):
    """nn.Linear (the same parameters and checkpoint keys) that runs on oneDNN's packed weights on the CPU.

    The base model is frozen, so its weights can be reordered once into oneDNN's blocked layout, which
    PyTorch's CPU build carries. On SmolLM2's shapes a product of 1032 rows ran 1.09-1.48x as fast as
    F.linear, and capt's eval and train steps went ahead of transformers' (docs/speed.md). The packed
    copy is made on first use and kept beside the plain weight (state_dict reads the plain one), so on
    the CPU the linear weights take twice their memory. Outputs equal F.linear's up to float rounding
    (the sums run in another order), so a training run's steps differ from an unpacked run's by that
    rounding: CAPT_CPU_PACK=0 gives F.linear everywhere.

    The packed path serves a frozen weight and bias (in training the gradient flows through x alone,
    as grad @ W, with F.linear's product), fp32 on the CPU, inputs of PACK_MIN_ROWS rows or more,
    outside torch.compile (which packs by itself) and outside torch.distributed (FSDP refills the
    weights on every step); everything else is F.linear. A weight changed in place (copy_,
    load_state_dict) or replaced (.to) is packed again; a change made through `.data` is not seen:
    turn packing off around it.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.packs(x):
            return F.linear(x, self.weight, self.bias)
        if torch.is_grad_enabled() and x.requires_grad:
            return _PackedFrozen.apply(x, self.weight, self.bias, self.packed_weight())
        return torch.ops.mkldnn._linear_pointwise(x, self.packed_weight(), self.bias, "none", [], "")

    def packs(self, x: torch.Tensor) -> bool:
        """Whether this call runs on the packed weight."""
        w, b = self.weight, self.bias
        trains_weight = torch.is_grad_enabled() and (w.requires_grad or (b is not None and b.requires_grad))
        return (PACK_ON_CPU and _ONEDNN and not trains_weight and x.device.type == "cpu" and x.dtype == w.dtype == torch.float32
                and x.dim() > 0 and x.numel() >= PACK_MIN_ROWS * max(x.shape[-1], 1)
                and not torch.compiler.is_compiling() and not (dist.is_available() and dist.is_initialized()))

    def packed_weight(self) -> torch.Tensor:
        w = self.weight
        held = _PACKED.get(self)
        # the entry holds the weight it was packed from, so its memory cannot be reused by another tensor
        if held is None or held[0].data_ptr() != w.data_ptr() or held[0].shape != w.shape or held[1] != w._version:
            held = (w.detach(), w._version, torch.ops.mkldnn._reorder_linear_weight(w.detach()))
            _PACKED[self] = held
        return held[2]
