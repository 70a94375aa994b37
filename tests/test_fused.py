"""The fused pool-plus-add (Triton) against the PyTorch reference: values and gradients.

On a GPU the kernels run there; without one, conftest.py sets TRITON_INTERPRET=1 and they run
on the CPU through Triton's interpreter.
"""

import pytest
import torch

from capt.models.ops import pool_add, pool_add_reference

fused = pytest.importorskip("capt.models.fused", reason="Triton is not installed")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and (refused := fused.interpreter_refusal()) is not None:
    pytest.skip(refused, allow_module_level=True)


def random_case(B, N, D, dtype, seed=0, per_row=False):
    """h (B, N, D), a 0/1 mask (B, N) and p: (D,), or (B, D) with per_row (each sequence's own capsule)."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, N, D, generator=g, dtype=dtype)
    mask = (torch.rand(B, N, generator=g) > 0.3).float()
    mask[:, 0] = 1  # the slot is always pooled
    mask[-1, 1:] = 0  # a sequence whose only pooled position is the slot
    p = torch.randn(
        *((B,) if per_row else ()), D, generator=g, dtype=torch.float64 if dtype == torch.float64 else torch.float32
    )
    return h.to(DEVICE), mask.to(DEVICE), p.to(DEVICE)


def run(fn, h, mask, p, grad_seed=3):
    """Output and gradients of fn for a fixed upstream gradient."""
    hh = h.clone().requires_grad_(True)
    pp = None if p is None else p.clone().requires_grad_(True)
    out = fn(hh, mask, pp)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed)).to(out))
    return out.detach(), hh.grad.float(), None if pp is None else pp.grad


@pytest.mark.parametrize("per_row", [False, True])
def test_gradcheck_float64(per_row):
    h, mask, p = random_case(2, 5, 6, torch.float64, per_row=per_row)
    h.requires_grad_(True)
    p.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda h, p: fused.pool_add_fused(h, mask, p), (h, p))
    assert torch.autograd.gradcheck(lambda h: fused.pool_add_fused(h, mask, None), (h,))


def test_gradcheck_through_a_task_table():
    """Several capsule sets: each sequence's p gathered from a (K, D) table, as the models do."""
    h, mask, _ = random_case(4, 5, 6, torch.float64, seed=4)
    table = torch.randn(3, 6, dtype=torch.float64, device=DEVICE, requires_grad=True)
    tasks = torch.tensor([2, 0, 2, 1], device=DEVICE)
    assert torch.autograd.gradcheck(
        lambda h, t: fused.pool_add_fused(h, mask, t[tasks]), (h.requires_grad_(True), table)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_p", [True, False, "per-row"])
def test_equals_reference(dtype, with_p):
    # Values: both read h and accumulate in fp32, so they agree to fp32 rounding (1e-5) in either
    # dtype. Gradients for h come back in h's dtype: in bf16 they may differ by one bf16 rounding
    # (one bf16 ulp: relative 2**-7), since the reference rounds an fp32 product and the kernel its own.
    h, mask, p = random_case(3, 70, 200, dtype, seed=1, per_row=with_p == "per-row")
    p = p if with_p else None
    (out, dh, dp), (ref, ref_dh, ref_dp) = run(fused.pool_add_fused, h, mask, p), run(pool_add_reference, h, mask, p)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(dh, ref_dh, rtol=0 if dtype == torch.float32 else 2**-7, atol=1e-5)
    if with_p:
        torch.testing.assert_close(dp, ref_dp, rtol=0, atol=1e-5)


def test_layouts_and_mask_types():
    """Non-contiguous h (a slice, as a block's input can be), bool and integer masks."""
    big, mask, p = random_case(2, 40, 300, torch.float32, seed=2)
    h = big[:, 3:, 7:263]  # strides of the parent tensor, last dim still contiguous
    m = mask[:, 3:]
    m[:, 0] = 1
    want = run(pool_add_reference, h, m, p[7:263])
    for mk in (m, m.bool(), m.long()):
        got = run(fused.pool_add_fused, h, mk, p[7:263])
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    transposed = big.transpose(1, 2).contiguous().transpose(1, 2)  # last dim not contiguous
    got, want = run(fused.pool_add_fused, transposed, mask, p), run(pool_add_reference, transposed, mask, p)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused path is chosen on CUDA only")
def test_pool_add_uses_the_kernel_on_cuda():
    h, mask, p = random_case(2, 9, 64, torch.bfloat16)
    out = pool_add(h, mask, p)
    assert out.grad_fn is None or "capt_pool_add" in type(out.grad_fn).__name__
    h.requires_grad_(True)
    # the op's own backward (torch names it after the operator: GeneratedBackwardFor_capt_pool_add_default...)
    assert "capt_pool_add" in type(pool_add(h, mask, p).grad_fn).__name__


def test_registered_as_operators_that_compilation_can_trace():
    """capt::pool_add and capt::pool_add_backward are torch.library operators: their schema, autograd
    registration and fake (shape-only) implementations pass torch's own checks, and dynamo traces a
    function that calls the kernel in one graph, with the eager values and gradients."""
    h, mask, p = random_case(3, 9, 64, torch.float32, seed=5)
    h.requires_grad_(True)
    p.requires_grad_(True)
    checks = torch.library.opcheck(torch.ops.capt.pool_add.default, (h, mask, p),
                                   test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    assert set(checks.values()) == {"SUCCESS"}, checks
    torch._dynamo.reset()
    graphs = []

    def count(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def loss(h, mask, p):
        return (fused.pool_add_fused(h, mask, p) ** 2).sum()

    compiled = torch.compile(loss, backend=count, fullgraph=True)
    want = run(lambda h, mask, p: loss(h, mask, p)[None], h.detach(), mask, p.detach())
    got = run(lambda h, mask, p: compiled(h, mask, p)[None], h.detach(), mask, p.detach())
    assert len(graphs) == 1 and any("capt.pool_add" in str(n.target) for n in graphs[0].graph.nodes)
    for g, w in zip(got, want):  # value, dL/dh, dL/dp
        torch.testing.assert_close(g, w, rtol=0, atol=0)
