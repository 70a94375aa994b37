"""capt.ops.Linear: the base models' linear layers on oneDNN's packed weights on the CPU.

The packed path must give F.linear's outputs and input gradients (to float rounding), follow a
weight that changes, and step aside wherever it does not apply."""

import pytest
import torch
import torch.nn.functional as F

from capt import CapsuleConfig, load_model, ops
from capt.methods import capsule_vectors
from capt.ops import Linear

needs_onednn = pytest.mark.skipif(not ops._ONEDNN, reason="this PyTorch has no oneDNN linear")


def frozen(d_in=48, d_out=80, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = Linear(d_in, d_out, bias=bias)
    lin.requires_grad_(False)
    return lin


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(128, 48), (300, 48), (3, 50, 48), (2, 129, 48)])
def test_packed_outputs_equal_f_linear(shape, bias):
    lin = frozen(bias=bias)
    x = torch.randn(shape)
    assert lin.packs(x)
    y = lin(x)
    assert lin in ops._PACKED  # the packed weight served this call
    assert y.shape == shape[:-1] + (80,)
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(shape[:-1] + (96,))[..., ::2]  # a strided input
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_input_gradient_equals_f_linear():
    lin = frozen(d_in=48, d_out=80)  # not square: a transposed weight in the backward would not fit
    x = torch.randn(4, 60, 48, requires_grad=True)
    up = torch.randn(4, 60, 80)
    (lin(x) * up).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    (F.linear(x_ref, lin.weight, lin.bias) * up).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-5, atol=1e-5)
    assert lin.weight.grad is None and lin.bias.grad is None


@needs_onednn
def test_the_packed_weight_follows_the_weight():
    lin = frozen()
    x = torch.randn(200, 48)
    first = lin(x)
    with torch.no_grad():
        lin.weight.mul_(2.0)  # in place: the version counter moves
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(lin(x), first)
    lin.load_state_dict({"weight": torch.randn(80, 48), "bias": torch.zeros(80)})
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    lin.to(torch.bfloat16).to(torch.float32)  # replaced storage, rounded values
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_f_linear_serves_where_packing_does_not_apply(monkeypatch):
    lin = frozen()
    x = torch.randn(200, 48)
    trained = Linear(48, 80)  # a weight with a gradient
    assert lin.packs(x)
    assert not trained.packs(x) and not lin.packs(x.double()) and not lin.packs(x[:ops.PACK_MIN_ROWS - 1])
    assert not lin.packs(x[:0])
    assert torch.equal(lin(x[:5]), F.linear(x[:5], lin.weight, lin.bias))
    monkeypatch.setattr(ops, "PACK_ON_CPU", False)  # what CAPT_CPU_PACK=0 sets
    assert not lin.packs(x)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert lin not in ops._PACKED


@needs_onednn
def test_a_model_trains_the_same_with_and_without_packing(tiny_llama_dir, monkeypatch):
    """Logits and every block's capsule gradient, packed against F.linear, on a whole model."""
    model = load_model(tiny_llama_dir, capsules=CapsuleConfig())
    assert all(isinstance(m, Linear) for name, m in model.named_modules() if name.endswith(("_proj", "lm_head")))
    with torch.no_grad():
        for p in capsule_vectors(model).values():
            p.normal_(0, 0.1)
    ids = torch.randint(0, 300, (4, 40), generator=torch.Generator().manual_seed(0))  # 4 x 41 rows with the slot: packed
    at = torch.full((4, 2), 30) + torch.arange(2)

    def run():
        model.zero_grad(set_to_none=True)
        logits = model(ids, logits_at=at)
        logits.logsumexp(-1).sum().backward()
        return logits.detach(), [p.grad.clone() for p in capsule_vectors(model).values()]

    packed = run()
    assert any(m in ops._PACKED for m in model.modules())
    monkeypatch.setattr(ops, "PACK_ON_CPU", False)
    plain = run()
    torch.testing.assert_close(packed[0], plain[0], rtol=1e-5, atol=1e-5)
    for a, b in zip(packed[1], plain[1]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from helpers import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("llama"))
