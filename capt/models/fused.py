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
from torch.library import triton_op, wrap_triton


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


# The kernels as operators of the torch.library namespace `capt`: torch.compile sees into a
# triton_op (it knows which tensors the kernel writes, which a raw kernel launch with runtime
# integer arguments may hide from it) and keeps the kernel in the compiled graph. The mask arrives
# already in the accumulation dtype and p already fp32 (fp64 for gradcheck), from pool_add_fused.


@triton_op("capt::pool_add", mutates_args={})
def _pool_add(h: torch.Tensor, m: torch.Tensor, p: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (B, d), count (B,)): p + the masked mean of h, and how many rows each mean counted."""
    B, N, D = h.shape
    out = torch.empty(B, D, device=h.device, dtype=m.dtype)
    count = torch.empty(B, device=h.device, dtype=m.dtype)
    per_row = p is not None and p.dim() == 2  # (B, d): each sequence's own p
    wrap_triton(_pool_add_fwd)[(B, triton.cdiv(D, BLOCK_D))](
        h,
        m,
        p if p is not None else out,
        out,
        count,
        N,
        D,
        h.stride(0),
        h.stride(1),
        m.stride(0),
        D if per_row else 0,
        HAS_P=p is not None,
        ACC=tl.float64 if m.dtype == torch.float64 else tl.float32,
        BLOCK_N=BLOCK_N,
        BLOCK_D=BLOCK_D,
    )
    return out, count


@triton_op("capt::pool_add_backward", mutates_args={})
def _pool_add_backward(
    g: torch.Tensor, m: torch.Tensor, count: torch.Tensor, shape: list[int], dtype: torch.dtype
) -> torch.Tensor:
    """dL/dh of h's shape (B, N, d) and dtype."""
    B, N, D = shape
    dh = torch.empty(B, N, D, device=g.device, dtype=dtype)
    wrap_triton(_pool_add_bwd)[(B, triton.cdiv(N, BLOCK_N), triton.cdiv(D, BLOCK_D))](
        g, m, count, dh, N, D, m.stride(0), BLOCK_N=BLOCK_N, BLOCK_D=BLOCK_D)
    return dh


def _setup_context(ctx, inputs, output):
    h, m, p = inputs
    ctx.save_for_backward(m, output[1])
    ctx.h_meta = (list(h.shape), h.dtype)
    ctx.has_p, ctx.per_row = p is not None, p is not None and p.dim() == 2


def _backward(ctx, g, _count_grad):
    m, count = ctx.saved_tensors
    dh = _pool_add_backward(g.to(m.dtype).contiguous(), m, count, *ctx.h_meta) if ctx.needs_input_grad[0] else None
    dp = None
    if ctx.has_p and ctx.needs_input_grad[2]:
        dp = g if ctx.per_row else g.sum(0)  # (B, d) per sequence, or (d,) summed over the sequences
    return dh, None, dp


@_pool_add.register_fake
def _(h, m, p):  # shapes only: what tracing needs where the kernel cannot be traced into (the CPU's interpreter)
    return h.new_empty(h.shape[0], h.shape[2], dtype=m.dtype), h.new_empty(h.shape[0], dtype=m.dtype)


@_pool_add_backward.register_fake
def _(g, m, count, shape, dtype):
    return g.new_empty(shape, dtype=dtype)


_pool_add.register_autograd(_backward, setup_context=_setup_context)


def pool_add_fused(h: torch.Tensor, mask: torch.Tensor, p: torch.Tensor | None) -> torch.Tensor:
    """p + mean over {t : mask_t = 1} of h_t, (B, d) fp32, in one pass over h (B, N, d).

    p: (d,) or (1, d) for every sequence, (B, d) one row per sequence, or None."""
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    if p is not None and p.dim() == 2 and p.shape[0] == 1:
        p = p[0]  # one row for every sequence: the kernel's shared p, its gradient the batch sum
    if p is not None:
        p = p.to(acc).contiguous()  # the kernel reads row b at b * D
    h = h if h.stride(-1) == 1 else h.contiguous()
    if not h.is_cuda or torch.compiler.is_compiling():  # the interpreter; a compiled graph sets its devices itself
        return _pool_add(h, mask.to(acc).contiguous(), p)[0]
    with torch.cuda.device(h.device):  # Triton launches on the current device: make it h's (cuda:1 in one process)
        return _pool_add(h, mask.to(acc).contiguous(), p)[0]


def interpreter_refusal() -> str | None:
    """Why the kernel cannot run on the CPU through Triton's interpreter (TRITON_INTERPRET=1), or None when it can:
    torch 2.11's wrap_triton takes only compiled kernels (torch 2.13 takes interpreted ones too). On a GPU the
    interpreter is not used, so this says nothing about it."""
    try:
        pool_add_fused(torch.ones(1, 2, 4), torch.ones(1, 2), None)
    except RuntimeError as e:
        if "wrap_triton" not in str(e):
            raise
        return (
            f"this torch ({torch.__version__}) refuses the Triton interpreter's kernels in wrap_triton; the kernel is "
            "checked on a GPU, or on the CPU with torch 2.13"
        )
    return None
