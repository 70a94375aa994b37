"""The capsule's mean-pool-plus-add as one Triton pass, with its backward.

Forward, one program per (sequence, column block): walk the sequence once, read only the rows
that the mask keeps, accumulate in fp32, divide by the count, add p: one vector (d,) shared by
every sequence, or (B, d), sequence b's own (several capsule sets served in one batch). Backward
(method.md):
    dL/dp   = sum_b g_b             (per-sequence p: dL/dp_b = g_b)
    dL/dh_t = m_t * g_b / n_b       for every position t of sequence b
written in one pass in h's dtype. On a machine without a GPU the same kernels run under the
Triton interpreter (TRITON_INTERPRET=1), which is how the tests check them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _pool_add_fwd(h_ptr, m_ptr, p_ptr, out_ptr, count_ptr, N, D, stride_hb, stride_hn, stride_mb, stride_pb,
                  HAS_P: tl.constexpr, ACC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)  # 64-bit offsets: B * N * D may pass 2**31
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_D], dtype=ACC)  # fp32 (fp64 only for gradcheck)
    count = tl.zeros([BLOCK_N], dtype=ACC)
    for n0 in range(0, N, BLOCK_N):
        rows = n0 + tl.arange(0, BLOCK_N)
        m = tl.load(m_ptr + b * stride_mb + rows, mask=rows < N, other=0.0)
        keep = (rows < N) & (m != 0.0)  # masked-out rows are never read
        x = tl.load(h_ptr + b * stride_hb + rows[:, None] * stride_hn + cols[None, :],
                    mask=keep[:, None] & col_ok[None, :], other=0.0)
        acc += tl.sum(x.to(ACC) * m[:, None], axis=0)
        count += m
    n = tl.maximum(tl.sum(count, axis=0), 1.0)
    out = acc / n
    if HAS_P:  # stride_pb: 0 when one p serves every sequence, D when sequence b has its own row
        out += tl.load(p_ptr + b * stride_pb + cols, mask=col_ok, other=0.0).to(ACC)
    tl.store(out_ptr + b * D + cols, out, mask=col_ok)
    if tl.program_id(1) == 0:
        tl.store(count_ptr + b, n)


@triton.jit
def _pool_add_bwd(g_ptr, m_ptr, count_ptr, dh_ptr, N, D, stride_mb,
                  BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    row_ok, col_ok = rows < N, cols < D
    m = tl.load(m_ptr + b * stride_mb + rows, mask=row_ok, other=0.0)
    n = tl.load(count_ptr + b)
    g = tl.load(g_ptr + b * D + cols, mask=col_ok, other=0.0)
    dh = (m / n)[:, None] * g[None, :]
    tl.store(dh_ptr + b * N * D + rows[:, None] * D + cols[None, :], dh.to(dh_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


BLOCK_N, BLOCK_D = 32, 128


class PoolAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, mask, p):
        B, N, D = h.shape
        h = h if h.stride(-1) == 1 else h.contiguous()
        acc = torch.float64 if h.dtype == torch.float64 else torch.float32
        m = mask.to(acc).contiguous()
        out = torch.empty(B, D, device=h.device, dtype=acc)
        count = torch.empty(B, device=h.device, dtype=acc)
        per_row = p is not None and p.dim() == 2  # (B, d): each sequence's own p
        grid = (B, triton.cdiv(D, BLOCK_D))
        _pool_add_fwd[grid](h, m, p if p is not None else out, out, count, N, D, h.stride(0), h.stride(1),
                            m.stride(0), D if per_row else 0, HAS_P=p is not None,
                            ACC=tl.float64 if acc == torch.float64 else tl.float32, BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
        ctx.save_for_backward(m, count)
        ctx.h_meta = (h.shape, h.dtype)
        ctx.has_p, ctx.per_row = p is not None, per_row
        return out

    @staticmethod
    def backward(ctx, g):
        m, count = ctx.saved_tensors
        (B, N, D), dtype = ctx.h_meta
        g = g.to(m.dtype).contiguous()
        dh = None
        if ctx.needs_input_grad[0]:
            dh = torch.empty(B, N, D, device=g.device, dtype=dtype)
            grid = (B, triton.cdiv(N, BLOCK_N), triton.cdiv(D, BLOCK_D))
            _pool_add_bwd[grid](g, m, count, dh, N, D, m.stride(0), BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
        dp = None
        if ctx.has_p and ctx.needs_input_grad[2]:
            dp = g if ctx.per_row else g.sum(0)  # (B, d) per sequence, or (d,) summed over the sequences
        return dh, None, dp


def pool_add_fused(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """p + mean over {t : mask_t = 1} of h_t, (B, d) fp32, in one pass over h (B, N, d).

    p: (d,) for every sequence, (B, d) one row per sequence, or None."""
    if p is not None and p.dtype != h.dtype and h.dtype == torch.float64:
        p = p.double()
    elif p is not None and p.dtype != torch.float64:
        p = p.float()
    if p is not None and p.dim() == 2:
        p = p.contiguous()  # the kernel reads row b at b * D
    return PoolAdd.apply(h, mask, p)
