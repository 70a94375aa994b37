"""capt.models.t5 against transformers' T5 on tiny random checkpoints (CPU, fp32).

Each configuration is built with transformers, saved as safetensors (one file or shards) and
loaded back with capt. Logits, greedy generation, the bucket function and the capsule are
compared; the capsule reference runs transformers' own encoder blocks one by one and builds
the slot by hand between them, as docs/method.md describes.
"""

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from capt.methods import CapsuleConfig, attach, capsule_vectors, detach, method_parameters
from capt.errors import CaptError
from capt.load import load_model
from capt.models import t5 as t5_module
from capt.models.t5 import Config, Model, relative_position_bucket

transformers = pytest.importorskip("transformers")
from transformers import T5Config as HFConfig  # noqa: E402
from transformers import T5ForConditionalGeneration  # noqa: E402
from transformers.models.t5.modeling_t5 import T5Attention  # noqa: E402

TOL = 1e-4

BASE = dict(vocab_size=160, d_ff=64, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
CONFIGS = {
    # T5 v1.0: ReLU feed-forward, output tied to `shared` and scaled by d_model**-0.5
    "v1.0": dict(BASE, d_model=32, d_kv=8, num_heads=4, num_layers=2, feed_forward_proj="relu"),
    # T5 v1.1 / Flan-T5: gated GELU, lm_head of its own, no output scale, 3 decoder blocks vs 2
    # encoder blocks, num_heads * d_kv (36) != d_model (32), few buckets so the log-spaced ones are used
    "v1.1": dict(
        BASE,
        tie_word_embeddings=False,
        d_model=32,
        d_kv=12,
        num_heads=3,
        num_layers=2,
        num_decoder_layers=3,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=16,
        relative_attention_max_distance=20,
        untied=True,
        shards="4KB",
    ),
    # what transformers 5 itself writes for a v1.1 config: tie_word_embeddings true (no lm_head.weight)
    # and scale_decoder_outputs false, i.e. a tied, unscaled output
    "v1.1-tied": dict(
        BASE, tie_word_embeddings=False, d_model=24, d_kv=8, num_heads=2, num_layers=3, feed_forward_proj="gated-gelu"
    ),
}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Matrices this small only lose from threading (badly so on a busy two-core machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def make_checkpoint(name: str, directory: Path):
    """A random transformers T5 saved under directory; returns the transformers model (the yardstick)."""
    spec = dict(CONFIGS[name])
    untied, shards = spec.pop("untied", False), spec.pop("shards", None)
    torch.manual_seed(0)
    hf = T5ForConditionalGeneration(HFConfig(**spec, attn_implementation="eager")).eval()
    if untied:  # transformers 5 always ties T5's output matrix: give it one of its own
        hf.lm_head.weight = torch.nn.Parameter(torch.randn_like(hf.shared.weight))
    kwargs = {"max_shard_size": shards} if shards else {}
    hf.save_pretrained(directory, safe_serialization=True, **kwargs)
    if untied:  # the config a real v1.1 / Flan-T5 checkpoint carries
        file = directory / "config.json"
        config = json.loads(file.read_text())
        config["tie_word_embeddings"] = False
        config.pop("scale_decoder_outputs", None)
        file.write_text(json.dumps(config))
    return hf


def saved_tensors(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            state.update({k: f.get_tensor(k) for k in f.keys()})
    return state


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    directory = tmp_path_factory.mktemp(request.param)
    hf = make_checkpoint(request.param, directory)
    return request.param, hf, load_model(directory), directory


def padded_batch(vocab: int, lengths, dec_lengths, seed=1):
    """Right-padded encoder inputs and decoder inputs (starting with the start token 0)."""
    g = torch.Generator().manual_seed(seed)
    T, Td = max(lengths), max(dec_lengths)
    ids = torch.randint(2, vocab, (len(lengths), T), generator=g)
    mask = (torch.arange(T)[None] < torch.tensor(lengths)[:, None]).long()
    dec = torch.randint(2, vocab, (len(lengths), Td), generator=g)
    dec[:, 0] = 0
    dec_mask = (torch.arange(Td)[None] < torch.tensor(dec_lengths)[:, None]).long()
    return ids * mask, mask, dec * dec_mask, dec_mask


# ---------------------------------------------------------------------------------------------
# Checkpoint, logits, generation


def test_checkpoint_layout(pair):
    name, hf, model, directory = pair
    saved = saved_tensors(directory)
    if name == "v1.1":
        assert len(list(directory.glob("*.safetensors"))) > 1  # really sharded
        assert not model.config.tie_word_embeddings and not model.config.scale_decoder_outputs
        assert not torch.equal(saved["lm_head.weight"], saved["shared.weight"])  # really untied
    else:
        assert "lm_head.weight" not in saved and model.config.tie_word_embeddings
        assert model.config.scale_decoder_outputs == (name == "v1.0")
    aliases = model.checkpoint_aliases()
    assert set(model.state_dict()) == {k for k in saved if k not in aliases}
    assert "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight" not in model.state_dict()


def test_logits_match_transformers(pair, record_property):
    name, hf, model, _ = pair
    ids, mask, dec, dec_mask = padded_batch(hf.config.vocab_size, [27, 13, 4], [9, 9, 5])
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask).logits
        got = model(ids, mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    diff = (got - want).abs().max().item()
    record_property("max_abs_diff", diff)
    print(f"\n{name}: max |logits - transformers| = {diff:.3g}")
    assert got.shape == want.shape
    assert diff <= TOL


def test_logits_at_and_shared_encoder(pair):
    _, hf, model, _ = pair
    ids, mask, dec, _ = padded_batch(hf.config.vocab_size, [11, 6], [5, 5])
    with torch.no_grad():
        full = model(ids, mask, decoder_input_ids=dec)
        at = torch.tensor([[0, 4, 2], [3, 3, 1]])
        picked = model(ids, mask, decoder_input_ids=dec, logits_at=at)
        torch.testing.assert_close(
            picked, full.gather(1, at[..., None].expand(-1, -1, full.shape[-1])), rtol=0, atol=1e-5
        )
        # one encoder pass serving three different decoder rows per input, with and without a cache,
        # equals each row decoded against its own copy of the encoder output
        states, enc_mask = model.encode(ids, mask)
        cands = torch.randint(0, hf.config.vocab_size, (6, 5), generator=torch.Generator().manual_seed(3))
        copies = model.decode(cands, states.repeat_interleave(3, dim=0), enc_mask.repeat_interleave(3, dim=0))
        shared = model.decode(cands, states, enc_mask)
        torch.testing.assert_close(shared, copies, rtol=0, atol=1e-5)
        cache = model.new_cache()
        steps = torch.cat(
            [
                model.decode(cands[:, :2], states, enc_mask, cache=cache),
                model.decode(cands[:, 2:], states, enc_mask, cache=cache),
            ],
            1,
        )
        torch.testing.assert_close(steps, copies, rtol=0, atol=1e-5)
        torch.testing.assert_close(
            model.decode(dec.repeat_interleave(3, dim=0), states, enc_mask),
            full.repeat_interleave(3, dim=0),
            rtol=0,
            atol=1e-5,
        )


def test_greedy_generation_matches_transformers(pair):
    # transformers' own cache breaks when num_decoder_layers != num_layers (5.17), so its
    # uncached greedy search is the yardstick for our cached one
    _, hf, model, _ = pair
    ids, mask, _, _ = padded_batch(hf.config.vocab_size, [10, 7, 3], [1, 1, 1], seed=2)
    with torch.no_grad():
        want = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=16,
            do_sample=False,
            use_cache=False,
            generation_config=_no_eos(hf),
        )
    got = free = model.generate(ids, mask, max_new_tokens=16, eos_token_id=[])
    assert want.shape == (3, 17)
    assert torch.equal(got, want)
    # cached decoding agrees with one uncached pass over the generated ids
    with torch.no_grad():
        assert torch.equal(model(ids, mask, decoder_input_ids=got[:, :-1]).argmax(-1), got[:, 1:])
    # stopping: make a token that row 0 emits at step 5 the EOS; the rows stop and are padded like transformers'
    eos = int(want[0, 5])
    with torch.no_grad():
        want = hf.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=16, do_sample=False, use_cache=False, eos_token_id=eos
        )
    got = model.generate(ids, mask, max_new_tokens=16, eos_token_id=eos)
    assert torch.equal(got, want)
    # each row follows the free run up to its first EOS and is padded after it; the batch ends with the last row
    firsts = [int((row[1:] == eos).nonzero()[0, 0]) + 1 if (row[1:] == eos).any() else 16 for row in free]
    assert firsts[0] <= 5 and got.shape == (3, 1 + max(firsts))
    for row, first in enumerate(firsts):
        assert torch.equal(got[row, :first + 1], free[row, :first + 1])
        assert (got[row, first + 1:] == model.config.pad_token_id).all()


def _no_eos(hf):
    config = hf.generation_config.__class__(**hf.generation_config.to_dict())
    config.eos_token_id = None
    return config


def test_sampling(pair):
    _, hf, model, _ = pair
    ids, mask, _, _ = padded_batch(hf.config.vocab_size, [8, 5], [1, 1], seed=3)
    greedy = model.generate(ids, mask, max_new_tokens=6, eos_token_id=[])
    assert torch.equal(model.generate(ids, mask, max_new_tokens=6, do_sample=True, top_k=1, eos_token_id=[]), greedy)
    runs = [
        model.generate(
            ids,
            mask,
            max_new_tokens=6,
            do_sample=True,
            temperature=0.8,
            top_p=0.9,
            generator=torch.Generator().manual_seed(7),
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])
    # the sampler shared with Llama: a vanishing top_p keeps the most likely token; bad arguments fail up front
    narrow = model.generate(ids, mask, max_new_tokens=6, do_sample=True, top_p=1e-9, eos_token_id=[],
                            generator=torch.Generator().manual_seed(0))
    assert torch.equal(narrow, greedy)
    for bad, message in ((dict(top_p=0.0), "top_p"), (dict(top_k=0), "top_k"), (dict(temperature=-1.0), "temperature")):
        with pytest.raises(CaptError, match=f"^{message} must be"):
            model.generate(ids, mask, max_new_tokens=2, do_sample=True, **bad)
    with pytest.raises(CaptError, match="^generate needs at least one input token$"):
        model.generate(ids[:, :0], mask[:, :0], max_new_tokens=2)


@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 20), (64, 300)])
@pytest.mark.parametrize("bidirectional", [True, False])
def test_relative_position_bucket(bidirectional, num_buckets, max_distance):
    relative = torch.arange(-300, 301)[None, :] - torch.arange(0, 3)[:, None]
    want = T5Attention._relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    got = relative_position_bucket(relative, bidirectional, num_buckets, max_distance)
    assert torch.equal(got, want)
    assert got.min() >= 0 and got.max() < num_buckets


def test_config_defaults():
    config = Config.from_dict(
        {"d_model": 16, "num_layers": 3, "feed_forward_proj": "gated-gelu", "is_gated_act": True, "unknown": 1}
    )
    assert config.num_decoder_layers == 3 and config.is_gated_act and config.decoder_start_token_id == 0
    with torch.device("meta"):
        model = Model(
            Config.from_dict(
                {"d_model": 16, "d_kv": 4, "num_heads": 2, "d_ff": 8, "vocab_size": 10, "tie_word_embeddings": False}
            )
        )
    assert "lm_head.weight" in model.state_dict() and not model.config.scale_decoder_outputs
    assert all(b.capsule is None for b in model.capsule_blocks()) and model.method is None


# ---------------------------------------------------------------------------------------------
# Capsule


def reference_capsule_logits(hf, capsules: dict[int, torch.Tensor], integration, ids, mask, dec):
    """The capsule built step by step around transformers' own encoder blocks (docs/method.md)."""
    encoder = hf.encoder
    n_slots = 1 if integration == "add" else 2
    B, d = ids.shape[0], hf.config.d_model
    h0 = hf.shared(ids)  # (B, T, d)
    m = mask.float()
    mean0 = (h0 * m[..., None]).sum(1) / m.sum(1, keepdim=True)
    p0 = capsules.get(0, torch.zeros(d))
    slots = [mean0 + p0] if integration == "add" else [mean0, p0.expand(B, d)]
    h = torch.cat([torch.stack(slots, 1), h0], 1)  # (B, S + T, d)
    full_mask = torch.cat([torch.ones(B, n_slots), m], 1)  # the slots: always visible, always pooled
    N = h.shape[1]
    bias = encoder.block[0].layer[0].SelfAttention.compute_bias(N, N)  # slot(s) at 0.., tokens after
    attn_mask = (1.0 - full_mask)[:, None, None, :] * torch.finfo(torch.float32).min
    for l, block in enumerate(encoder.block):
        if l > 0 and l in capsules:
            pooled = (h * full_mask[..., None]).sum(1) / full_mask.sum(1, keepdim=True)
            if integration == "add":
                h = torch.cat([(capsules[l] + pooled)[:, None], h[:, 1:]], 1)
            else:
                h = torch.cat([pooled[:, None], capsules[l].expand(B, d)[:, None], h[:, 2:]], 1)
        h = block(h, attention_mask=attn_mask, position_bias=bias)[0]
    h = encoder.final_layer_norm(h)
    return hf(encoder_outputs=(h,), attention_mask=full_mask.long(), decoder_input_ids=dec).logits


def with_capsules(model, integration, blocks, seed=5):
    attach(model, "capt", capsules=CapsuleConfig(integration=integration, blocks=blocks))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in capsule_vectors(model).values():
            p.copy_(torch.randn(p.shape, generator=g))
    return {i: p.detach().clone() for i, p in capsule_vectors(model).items()}


@pytest.fixture
def capsule_model(pair):
    name, hf, model, directory = pair
    yield name, hf, model
    detach(model)


@pytest.mark.parametrize("integration", ["add", "prepend"])
@pytest.mark.parametrize("blocks", ["all", "odd"])
def test_capsule_matches_reference(capsule_model, integration, blocks, record_property):
    name, hf, model = capsule_model
    capsules = with_capsules(model, integration, blocks)
    expected_blocks = list(range(len(model.capsule_blocks())))[:: 1 if blocks == "all" else 2]
    assert sorted(capsules) == expected_blocks
    ids, mask, dec, _ = padded_batch(hf.config.vocab_size, [12, 7, 3], [6, 6, 6], seed=4)
    with torch.no_grad():
        want = reference_capsule_logits(hf, capsules, integration, ids, mask, dec)
        got = model(ids, mask, decoder_input_ids=dec)
        plain = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        states, enc_mask = model.encode(ids, mask)
    diff = (got - want).abs().max().item()
    record_property("max_abs_diff", diff)
    print(f"\n{name} capsule {integration}/{blocks}: max |logits - reference| = {diff:.3g}")
    assert diff <= TOL
    assert (got - plain).abs().max() > 1e-2  # the capsule does change the output
    n = 1 if integration == "add" else 2
    assert states.shape[1] == n + ids.shape[1] and torch.equal(enc_mask[:, :n], torch.ones(3, n, dtype=enc_mask.dtype))


@pytest.mark.parametrize("integration", ["add", "prepend"])
def test_capsule_padding_invariance(capsule_model, integration):
    _, hf, model = capsule_model
    with_capsules(model, integration, "all")
    ids, mask, dec, _ = padded_batch(hf.config.vocab_size, [5, 14, 9], [4, 4, 4], seed=6)
    with torch.no_grad():
        batch = model(ids, mask, decoder_input_ids=dec)
        alone = model(ids[:1, :5], mask[:1, :5], decoder_input_ids=dec[:1])
        generated = model.generate(ids, mask, max_new_tokens=5, eos_token_id=[])
        generated_alone = model.generate(ids[:1, :5], mask[:1, :5], max_new_tokens=5, eos_token_id=[])
    # another batch, another summation order in the products: float32's rounding of logits of size ~10 (rtol 2e-6)
    torch.testing.assert_close(batch[:1], alone, rtol=2e-6, atol=1e-5)
    assert torch.equal(generated[:1], generated_alone)


def test_capsule_gradients(capsule_model):
    _, hf, model = capsule_model
    with_capsules(model, "add", "odd")
    ids, mask, dec, _ = padded_batch(hf.config.vocab_size, [6, 4], [3, 3], seed=8)
    logits = model(ids, mask, decoder_input_ids=dec)
    logits.logsumexp(-1).sum().backward()
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(".capsule" in n for n in trainable) and trainable
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in method_parameters(model).values())


def test_no_mask_equals_all_ones_mask(pair):
    """Without an attention mask the encoder shares one (1, H, N, N) bias: same logits as an all-ones mask."""
    _, hf, model, _ = pair
    ids, _, dec, _ = padded_batch(hf.config.vocab_size, [9, 9], [4, 4])
    with torch.no_grad():
        torch.testing.assert_close(
            model(ids, decoder_input_ids=dec),
            model(ids, torch.ones_like(ids), decoder_input_ids=dec),
            rtol=0,
            atol=1e-6,
        )
        want = hf(input_ids=ids, decoder_input_ids=dec).logits
        assert (model(ids, decoder_input_ids=dec) - want).abs().max() <= 1e-4


def test_masks_reach_sdpa_with_aligned_rows(capsule_model, monkeypatch):
    """Every mask SDPA gets has row strides that are multiples of 8 (its CUDA kernels would
    otherwise pad a copy per call), and the outputs equal those with the masks as computed (1e-6)."""
    _, hf, model = capsule_model
    with_capsules(model, "add", "all")
    ids, mask, dec, dec_mask = padded_batch(hf.config.vocab_size, [12, 7, 3], [6, 6, 4], seed=9)  # 1 + 12 key columns
    strides, real_sdpa = [], torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, **kwargs):
        strides.append((attn_mask.shape[-1], attn_mask.stride()[:-1], attn_mask.stride(-1)))
        return real_sdpa(q, k, v, attn_mask=attn_mask, **kwargs)

    with torch.no_grad():
        for given in (mask, None):  # padded, then the shared (1, H, N, N) bias
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
            got = model(ids, given, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
            monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", real_sdpa)
            monkeypatch.setattr(t5_module, "aligned", lambda m: m)  # the masks as computed, unaligned
            want = model(ids, given, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
            monkeypatch.undo()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    widths = {w for w, _, _ in strides}
    assert 13 in widths  # the encoder's 1 + 12 columns: not a multiple of 8 ...
    # ... yet aligned rows
    assert all(last == 1 and all(s % 8 == 0 for s in rows) for _, rows, last in strides), strides


def test_aligned_keeps_values_and_shape():
    x = torch.randn(2, 3, 5, 13)
    y = t5_module.aligned(x)
    assert torch.equal(x, y) and y.stride() == (3 * 5 * 16, 5 * 16, 16, 1)
    z = torch.randn(4, 16)
    assert t5_module.aligned(z) is z  # already aligned: no copy
