"""capt.packed.PackedLinear: the base models' linear layers on oneDNN's packed weights on the CPU.

The packed path must give F.linear's outputs (to float rounding), pass the gradient to x alone (as
F.linear's backward does, with its own product), follow a weight that changes, and step aside
wherever it does not apply: above all where the weight itself is trained."""

import pytest
import torch
import torch.nn.functional as F

from capt import CapsuleConfig, load_model

from capt import packed
from capt.load import build_model, read_config
from capt.methods import capsule_vectors, method_parameters
from capt.packed import PackedLinear

needs_onednn = pytest.mark.skipif(not packed._ONEDNN, reason="this PyTorch has no oneDNN linear")


def frozen(d_in=48, d_out=80, bias=True, seed=0):
    torch.manual_seed(seed)
    lin = PackedLinear(d_in, d_out, bias=bias)
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
    assert lin in packed._PACKED  # the packed weight served this call
    assert y.shape == shape[:-1] + (80,)
    torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    x = torch.randn(shape[:-1] + (96,))[..., ::2]  # a strided input
    torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
def test_a_graph_through_x_runs_packed_and_its_gradient_is_f_linears(bias):
    """Training a capsule: the gradient flows back through x only, W and b are frozen."""
    lin = frozen(d_in=48, d_out=80, bias=bias)
    x = torch.randn(4, 60, 48, requires_grad=True)
    assert lin.packs(x)
    up = torch.randn(4, 60, 80)
    y = lin(x)
    assert y.grad_fn is not None and lin in packed._PACKED
    with torch.no_grad():
        assert torch.equal(y, lin(x))  # what the step scales measure (no grad) is what training computes
    (y * up).sum().backward()
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = F.linear(x_ref, lin.weight, lin.bias)
    (y_ref * up).sum().backward()
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(x.grad, x_ref.grad)  # the same product: grad @ W
    assert lin.weight.grad is None and (lin.bias is None or lin.bias.grad is None)


@needs_onednn
def test_the_packed_gradient_against_finite_differences():
    """The backward is written by hand, so check it against the function itself (fp32: the packed path's dtype)."""
    lin = frozen(d_in=8, d_out=6)
    x = torch.randn(packed.PACK_MIN_ROWS, 8, requires_grad=True)
    assert lin.packs(x)
    w = torch.randn(packed.PACK_MIN_ROWS, 6)
    loss = lambda: (lin(x) * w).sum()  # noqa: E731
    loss().backward()
    eps = 1e-2
    for i, j in [(0, 0), (5, 3), (127, 7)]:
        with torch.no_grad():
            x[i, j] += eps
            up = loss()
            x[i, j] -= 2 * eps
            down = loss()
            x[i, j] += eps
        assert (up - down).item() / (2 * eps) == pytest.approx(x.grad[i, j].item(), rel=1e-2, abs=1e-3)


@needs_onednn
def test_a_trained_weight_stays_on_f_linear():
    lin = frozen(d_in=48, d_out=80)
    lin.weight.requires_grad_(True)  # the weight itself is trained: F.linear's own backward
    x = torch.randn(4, 60, 48, requires_grad=True)
    assert not lin.packs(x)
    lin(x).sum().backward()
    assert lin.weight.grad is not None and lin not in packed._PACKED
    with torch.no_grad():
        assert lin.packs(x)


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
    trained = PackedLinear(48, 80)  # a weight with a gradient
    assert lin.packs(x)
    assert not trained.packs(x) and not lin.packs(x.double()) and not lin.packs(x[:packed.PACK_MIN_ROWS - 1])
    assert not lin.packs(x[:0])
    assert torch.equal(lin(x[:5]), F.linear(x[:5], lin.weight, lin.bias))
    monkeypatch.setattr(packed, "PACK_ON_CPU", False)  # what CAPT_CPU_PACK=0 sets
    assert not lin.packs(x)
    assert torch.equal(lin(x), F.linear(x, lin.weight, lin.bias))
    assert lin not in packed._PACKED


@needs_onednn
def test_a_model_trains_and_scores_on_packed_weights(tiny_llama_dir, monkeypatch):
    """Training and scoring run packed: the logits and capsule gradients equal F.linear's to rounding."""
    model = load_model(tiny_llama_dir, capsules=CapsuleConfig())
    assert all(isinstance(m, PackedLinear) for name, m in model.named_modules() if name.endswith(("_proj", "lm_head")))
    with torch.no_grad():
        for p in capsule_vectors(model).values():
            p.normal_(0, 0.1)
    # 4 x 41 rows with the slot: packed
    ids = torch.randint(0, 300, (4, 40), generator=torch.Generator().manual_seed(0))
    at = torch.full((4, 2), 30) + torch.arange(2)

    def train_step():
        model.zero_grad(set_to_none=True)
        logits = model(ids, logits_at=at)
        logits.logsumexp(-1).sum().backward()
        return logits.detach(), [p.grad.clone() for p in method_parameters(model).values()]

    on = train_step()
    assert any(m in packed._PACKED for m in model.modules())  # the training step packed the weights
    with torch.no_grad():
        assert torch.equal(model(ids, logits_at=at), on[0])  # scoring and training: the same products
    monkeypatch.setattr(packed, "PACK_ON_CPU", False)
    plain = train_step()
    torch.testing.assert_close(on[0], plain[0], rtol=1e-5, atol=1e-5)
    for g, g_ref in zip(on[1], plain[1]):
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    from helpers import tiny_llama

    return tiny_llama(tmp_path_factory.mktemp("llama"))


def test_the_models_build_plain_linear_layers_and_loading_swaps_them(tiny_llama_dir):
    """The model files know nothing of packing: build_model gives nn.Linear; load_model swaps every one of
    them for a PackedLinear holding the very same parameters, under the same checkpoint keys."""
    built = build_model(read_config(tiny_llama_dir))
    assert {type(m) for m in built.modules() if isinstance(m, torch.nn.Linear)} == {torch.nn.Linear}
    loaded = load_model(tiny_llama_dir)
    linears = {name: m for name, m in loaded.named_modules() if isinstance(m, torch.nn.Linear)}
    assert linears and all(type(m) is PackedLinear for m in linears.values())
    assert set(linears) == {name for name, m in built.named_modules() if isinstance(m, torch.nn.Linear)}
    assert list(loaded.state_dict()) == list(built.state_dict())
    swapped = packed.pack_linears(build_model(read_config(tiny_llama_dir), "cpu"))
    before = {n: p for n, p in built.named_parameters()}
    assert [n for n, _ in swapped.named_parameters()] == list(before)
