"""The tensor functions both model families call inline: the capsule's slots and attention's core.

    open_slots(h0, mask, p0, integration)       before block 0: put the capsule slot(s) at index 0
    refresh_slots(h, mask, p, integration)      entering a later block l in S: re-form them
    pool_add(h, mask, p)                        p + masked mean of h; one fused pass on CUDA
    Extraction, Projection                      the two integrations whose instance part is learned
    capsule_rows(table, rows, active)           each sequence's p_l from a block's (K, d) table
    task_index(tasks, names, batch, device)     each sequence's capsule set, when a model holds several
    slot_mask(mask, n)                          n always-visible columns in front of a mask
    Attend                                      SDPA (grouped-query heads included) as a module

Shapes: h (B, N, d) hidden states with the slot(s) at the front; mask (B, N) is 1 where a
position may be summarised (the slot(s) and the real prompt tokens), 0 elsewhere. A block's
capsules are a (K, d) fp32 table, one row per capsule set (K = 1 for a model trained on one task),
and p is what one forward adds: (1, d), the one set's row for every sequence, or (B, d), each
sequence's own. A capsule of length n > 1 (n slots, each its own vector) is a (K, n, d) table and p
(1 or B, n, d). This module knows nothing of models, methods or files (docs/method.md states the method).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import CaptError

# integration -> capsule slots (add: per length)
INTEGRATIONS = {"add": 1, "prepend": 2, "extraction": 1, "projection": 1}
EXTRACTION_KERNEL = 7  # (choice) the extraction integration's filter length: T5-Base's 0.03% of the paper
PROJECTION_RANK = 8  # (choice) the projection integration's rank: T5-Base's 0.07% of the paper


# ---------------------------------------------------------------------------------------------
# The mean-pool-plus-add


def pool_add_reference(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """p + mean over {t : mask_t = 1} of h_t, per sequence, accumulated in fp32. Returns (B, d) fp32.

    p: (d,) or (1, d) added to every row, (B, d) one vector per row, or None."""
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
    """capt.models.fused.pool_add_fused, or None without Triton. Imported on first use on a GPU: importing
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


@dataclass
class Slots:
    """What the blocks of one forward need of the capsule: its integration, the positions the slot
    summarises (mask (B, N): the slot(s) and the prompt's real tokens) and each sequence's capsule
    set (rows (B,), indices into the blocks' tables; None when the model holds one set)."""

    integration: str
    mask: torch.Tensor
    rows: torch.Tensor | None


def capsule_rows(table: torch.Tensor, rows: torch.Tensor | None,
                 active: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(p, keep): what a block's (K, d) capsule table adds to each sequence, and which sequences it re-forms.

    rows None (one set): p is the table itself, (1, d), broadcast over the batch, so that its gradient
    is the batch's sum (the arithmetic of one (d,) vector; a gather's backward adds in another order).
    rows (B,): p (B, d), row rows[b] for sequence b. active (K,) bool: the sets that hold this block,
    when not all; a sequence whose set lacks it gets zeros that no gradient reaches, and keep (B,)
    says which sequences are re-formed (None: all)."""
    if rows is None:
        return table, None
    p = table[rows]  # (B, d) (length n: (B, n, d))
    if active is None:
        return p, None
    keep = active[rows]  # (B,)
    zero = torch.zeros((), dtype=p.dtype, device=p.device)
    return torch.where(keep.view(-1, *[1] * (p.dim() - 1)), p, zero), keep


def capsule_slots(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor | None, integration: str, n: int = 1,
                  instance: nn.Module | None = None) -> torch.Tensor:
    """The slot(s) (B, S, d) fp32 formed from h (B, N, d) over the positions of mask, and p (None: zeros).

    add:         [p + mean], or with n slots (p (1 or B, n, d)) [p_j + mean for each j]
    prepend:     [mean, p]
    extraction:  [p + instance(h, mask)], the mean of a learned filter of the rows (Extraction)
    projection:  [p + instance(h, mask)], the mean through a learned low-rank map (Projection)
    """
    if instance is not None:
        part = instance(h, mask)  # (B, d)
        return (part if p is None else part + p.float())[:, None]
    if integration == "add" and (n > 1 or (p is not None and p.dim() == 3)):
        mean = pool_add(h, mask, None)[:, None]  # (B, 1, d)
        return mean.expand(-1, n, -1) if p is None else mean + p.float()  # (B, n, d)
    if integration == "add":
        return pool_add(h, mask, p)[:, None]  # (B, 1, d): one fused pass with p
    mean = pool_add(h, mask, None)
    task = torch.zeros_like(mean) if p is None else p.float().expand_as(mean)
    return torch.stack([mean, task], dim=1)  # (B, 2, d)


def open_slots(h0: torch.Tensor, mask: torch.Tensor, p0: torch.Tensor | None, integration: str, n: int = 1,
               instance: nn.Module | None = None) -> torch.Tensor:
    """Before block 0: the n slot(s) in front of the token embeddings h0 (B, T, d), from the real tokens'
    embeddings (capsule_slots). p0 (1, d) or (B, d) (length n: (1 or B, n, d)), or None when block 0 carries no
    capsule (then p_0 counts as zeros)."""
    return torch.cat([capsule_slots(h0, mask, p0, integration, n, instance).to(h0.dtype), h0], dim=1)  # (B, S + T, d)


def refresh_slots(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor, integration: str,
                  keep: torch.Tensor | None = None, instance: nn.Module | None = None) -> torch.Tensor:
    """Entering a block l > 0 that carries p_l: replace the slot(s) at the front of h (B, N, d).

    add:     slot = p_l + mean(previous slot(s), real tokens)
    prepend: slot 0 = mean(both slots, real tokens); slot 1 = p_l
    mask (B, N) marks the slot(s) and the real tokens; p (1, d) or (B, d) (length n: (1 or B, n, d)).
    keep (B,) bool, with several capsule sets: the sequences whose set holds this block. The others keep
    their slot(s) unchanged, as their own single-set model passes them through a block outside its S.
    """
    # (B, S, d)
    slots = capsule_slots(h, mask, p, integration, p.shape[-2] if p.dim() == 3 else 1, instance).to(h.dtype)
    if keep is not None:
        slots = torch.where(keep[:, None, None], slots, h[:, :slots.shape[1]])
    return torch.cat([slots, h[:, slots.shape[1]:]], dim=1)


class Extraction(nn.Module):
    """The extraction integration's instance part (choice: the paper names 1D convolutional filters): the
    pooled rows in order (padding left out), one filter of EXTRACTION_KERNEL taps per channel across them
    (depthwise, zeros beyond the ends), then their mean: (B, N, d), mask (B, N) -> (B, d) fp32. The filter
    starts as the identity, so the capsule starts as add's."""

    def __init__(self, width: int, kernel: int = EXTRACTION_KERNEL):
        super().__init__()
        start = torch.zeros(width, kernel)
        start[:, kernel // 2] = 1.0
        self.weight = nn.Parameter(start)  # (d, k)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32  # fp32 (fp64 only for gradcheck)
        order = torch.argsort((~mask.bool()).to(torch.int8), dim=1, stable=True)  # the pooled rows first, in order
        m = mask.to(acc).gather(1, order)  # (B, N)
        rows = h.to(acc).gather(1, order[..., None].expand(-1, -1, h.shape[-1])) * m[..., None]  # (B, N, d)
        k = self.weight.shape[1]
        filtered = F.conv1d(rows.transpose(1, 2), self.weight.to(acc)[:, None], padding=k // 2, groups=h.shape[-1])
        return (filtered * m[:, None]).sum(-1) / m.sum(1, keepdim=True).clamp_min(1.0)  # (B, d)


class Projection(nn.Module):
    """The projection integration's instance part (choice: the paper names low-rank linear layers): the mean of
    the pooled rows through a low-rank residual map, m + up(down(m)), rank PROJECTION_RANK: (B, N, d), mask
    (B, N) -> (B, d) fp32. `up` starts at zero, so the capsule starts as add's."""

    def __init__(self, width: int, rank: int = PROJECTION_RANK, generator: torch.Generator | None = None):
        super().__init__()
        self.down = nn.Parameter(torch.randn(rank, width, generator=generator) / width**0.5)  # (r, d)
        self.up = nn.Parameter(torch.zeros(width, rank))  # (d, r)

    def forward(self, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.map(pool_add(h, mask, None))  # (B, d)

    def map(self, mean: torch.Tensor) -> torch.Tensor:
        """m + up(down(m)) for means (B, d), in their dtype."""
        return mean + (mean @ self.down.to(mean.dtype).T) @ self.up.to(mean.dtype).T


def task_index(tasks, names: list[str] | None, batch: int, device) -> torch.Tensor | None:
    """Each sequence's capsule set as a (B,) long tensor of indices into names (the model's sets, in order).

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
# Attention's core


def native_gqa(q: torch.Tensor, attn_mask: torch.Tensor | None) -> bool:
    """Whether SDPA should group the query heads itself (enable_gqa, no copies of k and v).

    On CUDA only the flash kernel groups heads, and flash takes fp16 / bf16 without a mask; any
    other call would fall back to the math kernel, so there k and v are copied to whole heads and
    the memory-efficient kernel serves (fp32 training included). On the CPU SDPA's own grouping
    was as fast or faster than copying, with a mask or without (docs/speed.md).
    """
    return not q.is_cuda or (attn_mask is None and q.dtype in (torch.float16, torch.bfloat16))


class Attend(nn.Module):
    """softmax(q k^T * scale + mask) v by F.scaled_dot_product_attention: q (B, H, T, Dh), k and v
    (B, Hkv, S, Dh), query head h reading key/value head h // (H / Hkv). A module of its own, with no
    weights, so that the attention analysis (capt/cli/analysis.py) can swap in one that keeps the weights."""

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale  # None: 1 / sqrt(Dh)

    def forward(self, q, k, v, attn_mask: torch.Tensor | None, is_causal: bool) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        native = groups > 1 and native_gqa(q, attn_mask)
        if groups > 1 and not native:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # (B, H, S, Dh)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=self.scale,
                                              enable_gqa=native)  # (B, H, T, Dh)
