"""The paper's other integrations and capsule length: extraction (a learned filter of the pooled rows),
projection (a learned low-rank map of their mean), two capsule slots a block. Their instance parts
against loops written out here, their gradients by gradcheck, their parameter shares on T5-Base
against the paper's, their start equal to add's, padding invariance, files, and what refuses them."""

import pytest
import torch

from capt import CaptError, CapsuleConfig, load_model, save_capsules
from capt.load import load_method, trainable_count
from capt.methods import MethodConfig, attach, capsule_vectors, method_parameters, method_tensors
from capt.models.ops import EXTRACTION_KERNEL, Extraction, Projection

T5_BASE = {"model_type": "t5", "vocab_size": 32128, "d_model": 768, "d_kv": 64, "d_ff": 3072, "num_layers": 12,
           "num_heads": 12, "feed_forward_proj": "relu", "tie_word_embeddings": True}
T5_BASE_PARAMETERS = 222_903_552


def test_the_shares_on_t5_base_are_the_papers():
    """The paper's table: addition 4e-3%, extraction 0.03%, projection 0.07% of T5-Base."""
    add = trainable_count(T5_BASE, "capt")
    extraction = trainable_count(T5_BASE, "capt", capsules=CapsuleConfig(integration="extraction"))
    projection = trainable_count(T5_BASE, "capt", capsules=CapsuleConfig(integration="projection"))
    assert add == 12 * 768 and f"{100 * add / T5_BASE_PARAMETERS:.3f}" == "0.004"
    assert extraction == add + 12 * 768 * EXTRACTION_KERNEL and f"{100 * extraction / T5_BASE_PARAMETERS:.2f}" == "0.03"
    assert projection == add + 12 * 2 * 768 * 8 and f"{100 * projection / T5_BASE_PARAMETERS:.2f}" == "0.07"
    assert trainable_count(T5_BASE, "capt", capsules=CapsuleConfig(length=2)) == 2 * add


def padded(B=3, N=11, d=5, seed=0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(B, N, d, generator=g)
    mask = torch.ones(B, N, dtype=torch.bool)
    mask[1, 7:] = False  # right padding
    mask[B - 1, 1:5] = False  # a slot at 0, left padding after it, then tokens
    return h, mask


def extraction_by_loops(h, mask, weight):
    """For each sequence: its pooled rows in order, each channel filtered over them (zeros beyond the ends), then the
    mean."""
    out = torch.zeros(h.shape[0], h.shape[2], dtype=torch.float64)
    k = weight.shape[1]
    for b in range(h.shape[0]):
        rows = [h[b, t].double() for t in range(h.shape[1]) if mask[b, t]]
        for t in range(len(rows)):
            for j in range(k):
                s = t + j - k // 2
                if 0 <= s < len(rows):
                    out[b] += weight[:, j].double() * rows[s] / len(rows)
    return out


def test_extraction_equals_loops_and_starts_as_the_mean():
    h, mask = padded()
    part = Extraction(5)
    mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    torch.testing.assert_close(part(h, mask), mean, atol=1e-6, rtol=0)  # the identity filter
    with torch.no_grad():
        part.weight.copy_(torch.randn(5, EXTRACTION_KERNEL, generator=torch.Generator().manual_seed(1)))
    torch.testing.assert_close(part(h, mask).double(), extraction_by_loops(h, mask, part.weight), atol=1e-5, rtol=0)
    # the pooled rows count, not their columns: row 2's gap changes nothing
    alone = part(h[2:, [0, 5, 6, 7, 8, 9, 10]], mask[2:, [0, 5, 6, 7, 8, 9, 10]])
    torch.testing.assert_close(part(h, mask)[2:], alone, atol=1e-6, rtol=0)


def test_projection_is_the_mean_through_a_low_rank_map():
    h, mask = padded()
    part = Projection(5, rank=2, generator=torch.Generator().manual_seed(2))
    mean = (h * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    torch.testing.assert_close(part(h, mask), mean, atol=1e-6, rtol=0)  # up starts at zero
    with torch.no_grad():
        part.up.normal_()
    torch.testing.assert_close(part(h, mask), mean + mean @ part.down.T @ part.up.T, atol=1e-5, rtol=0)


class MapOnly(torch.nn.Module):
    """Projection.map as a module's forward, so that its parameters can be swapped for gradcheck's inputs."""

    def __init__(self, projection):
        super().__init__()
        self.projection = projection

    def forward(self, mean):
        return self.projection.map(mean)


def test_the_learned_parts_pass_gradcheck():
    h, mask = padded(B=2, N=6, d=3)
    part = Extraction(3, kernel=3).double()
    h = h.double().requires_grad_()
    w = torch.randn(3, 3, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: torch.func.functional_call(part, {"weight": w}, (x, mask)), (h, w))
    wrapped = MapOnly(Projection(3, rank=2).double())
    m = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    down = torch.randn(2, 3, dtype=torch.float64, requires_grad=True)
    up = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    # noqa: E731
    call = lambda x, a, b: torch.func.functional_call(wrapped, {"projection.down": a, "projection.up": b}, (x,))
    assert torch.autograd.gradcheck(call, (m, down, up))
    torch.testing.assert_close(call(m, down, up), m + m @ down.T @ up.T)


@pytest.fixture(scope="module")
def tiny(ckpts):
    return ckpts


def logits(model, ids, mask):
    if model.seq2seq:
        return model(ids, attention_mask=mask, decoder_input_ids=ids[:, :3])
    return model(ids, attention_mask=mask)


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("integration", ["extraction", "projection"])
def test_a_learned_integration_starts_as_add(tiny, family, integration):
    ids = torch.randint(3, 200, (3, 9), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    add = load_model(tiny[family], capsules=CapsuleConfig())
    learned = load_model(tiny[family], capsules=CapsuleConfig(integration=integration))
    with torch.no_grad():
        for (i, p), (j, q) in zip(capsule_vectors(add).items(), capsule_vectors(learned).items()):
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(i)))
            q.copy_(p)
        torch.testing.assert_close(logits(learned, ids, mask), logits(add, ids, mask), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("caps", [CapsuleConfig(integration="extraction"), CapsuleConfig(integration="projection"),
                                  CapsuleConfig(length=2), CapsuleConfig(length=2, blocks=[1])])
def test_variants_train_save_load_and_ignore_padding(tiny, tmp_path, family, caps):
    model = load_model(tiny[family], capsules=caps)
    with torch.no_grad():
        for t in method_tensors(model).values():
            t.add_(torch.randn(t.shape, generator=torch.Generator().manual_seed(t.numel())) * 0.3)
    ids = torch.randint(3, 200, (2, 9), generator=torch.Generator().manual_seed(4))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0
    both = logits(model, ids, mask)
    alone = logits(model, ids[1:, :5], mask[1:, :5])
    rows = slice(0, 5) if not model.seq2seq else slice(None)
    torch.testing.assert_close(both[1, rows], alone[0, rows], atol=1e-5, rtol=1e-5)
    both.logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in method_parameters(model).values())
    saved = save_capsules(model, tmp_path / "caps")
    again = load_model(tiny[family])
    load_method(again, saved)
    assert again.method.capsule == caps and sorted(method_tensors(again)) == sorted(method_tensors(model))
    with torch.no_grad():
        assert torch.equal(logits(again, ids, mask), both.detach())


def test_what_the_variants_refuse(tiny):
    with pytest.raises(CaptError, match="a capsule length of 2 is for the add integration, not prepend"):
        CapsuleConfig(integration="prepend", length=2)
    with pytest.raises(CaptError, match=r"capsule length 3: a whole number of slots from 1 to 2"):
        CapsuleConfig(length=3)
    with pytest.raises(CaptError, match="several sets on one model serve add or prepend capsules of one slot"):
        MethodConfig(
            "capt",
            task_capsules={"a": CapsuleConfig(integration="projection"), "b": CapsuleConfig(integration="projection")},
        )
    from transformers import AutoModelForCausalLM

    from capt.hf import attach_capsules

    model = load_model(tiny["llama"], capsules=CapsuleConfig(length=2))
    with pytest.raises(CaptError, match="capt.hf serves one capsule slot a block, not 2"):
        attach_capsules(AutoModelForCausalLM.from_pretrained(tiny["llama"]), model)
    assert attach(model, "capt").capsule == CapsuleConfig()  # and the plain capsule again


def test_the_command_line_names_the_variants(tmp_path):
    from capt.cli.args import build_parser, given_options
    from capt.trainer import TrainConfig

    args = build_parser().parse_args(
        [
            "train",
            "--model",
            "m",
            "--task",
            "rte",
            "--out",
            str(tmp_path),
            "--integration",
            "extraction",
            "--select",
            "loss",
            "--train-rows",
            "2000",
            "--validation-rows",
            "200",
        ]
    )
    options = given_options(args)
    assert options["integration"] == "extraction" and options["select"] == "loss" and options["train_rows"] == 2000
    assert TrainConfig(model="m", task="rte", out=str(tmp_path), capsule_length=2).capsules == CapsuleConfig(length=2)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--out", str(tmp_path), "--integration", "concat"])
