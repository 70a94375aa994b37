"""capt.ops.Linear: the base models' linear layers on oneDNN's packed weights on the CPU.

The packed path must give F.linear's outputs (to float rounding), follow a weight that changes, and
step aside wherever it does not apply: above all in training, which stays on F.linear bit for bit."""

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


def test_a_call_that_builds_a_graph_stays_on_f_linear():
    lin = frozen(d_in=48, d_out=80)
    x = torch.randn(4, 60, 48, requires_grad=True)  # a capsule's gradient flows back through x
    assert not lin.packs(x)
    up = torch.randn(4, 60, 80)
    y = lin(x)
    (y * up).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = F.linear(x_ref, lin.weight, lin.bias)
    (y_ref * up).sum().backward()
    assert torch.equal(y, y_ref) and torch.equal(x.grad, x_ref.grad)  # bit for bit: training does not depend on packing
    assert lin not in ops._PACKED
    with torch.no_grad():
        assert lin.packs(x) == ops._ONEDNN and lin.packs(torch.randn(200, 48)) == ops._ONEDNN


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
def test_a_model_scores_on_packed_weights_and_trains_on_plain_ones(tiny_llama_dir, monkeypatch):
    """Scoring (no grad) runs packed and equals F.linear's logits to rounding; training runs F.linear."""
    model = load_model(tiny_llama_dir, capsules=CapsuleConfig())
    assert all(isinstance(m, Linear) for name, m in model.named_modules() if name.endswith(("_proj", "lm_head")))
    with torch.no_grad():
        for p in capsule_vectors(model).values():
            p.normal_(0, 0.1)
    ids = torch.randint(0, 300, (4, 40), generator=torch.Generator().manual_seed(0))  # 4 x 41 rows with the slot: packed
    at = torch.full((4, 2), 30) + torch.arange(2)

    def train_step():
        model.zero_grad(set_to_none=True)
        logits = model(ids, logits_at=at)
        logits.logsumexp(-1).sum().backward()
        return logits.detach(), [p.grad.clone() for p in capsule_vectors(model).values()]

    trained = train_step()
    assert not any(m in ops._PACKED for m in model.modules())  # nothing was packed for training
    with torch.no_grad():
        packed = model(ids, logits_at=at)
    assert any(m in ops._PACKED for m in model.modules())
    monkeypatch.setattr(ops, "PACK_ON_CPU", False)
    with torch.no_grad():
        plain = model(ids, logits_at=at)
    torch.testing.assert_close(packed, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(trained[0], plain)  # the training forward is the plain one, bit for bit
    again = train_step()
    assert all(torch.equal(a, b) for a, b in zip(trained[1], again[1]))


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from helpers import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("llama"))
