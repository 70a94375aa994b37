"""Llama / Qwen2 against transformers on tiny random checkpoints (CPU, fp32).

Logits on padded batches, greedy generation, rope tables, and the capsule: an inline capsule
against a slot built step by step outside the model, no leakage of teacher-forced answers,
padding invariance, cached generation against recomputation.
"""

import glob
import os
from types import SimpleNamespace as Q

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from capt.models import llama, ops, sampling, t5
from capt.methods import CapsuleConfig, attach, capsule_vectors, method_parameters
from capt.errors import CaptError
from capt.models.llama import Config, Model
from capt.load import load_model

VOCAB = 199
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, max_position_embeddings=96,
              rms_norm_eps=1e-5, pad_token_id=0, attn_implementation="eager")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}
CASES = {
    # Llama 3.x: grouped-query attention, llama3 rope scaling, head_dim != hidden / heads, tied output
    "llama3": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=24,
            rope_theta=500000.0,
            rope_scaling=dict(LLAMA3_ROPE),
            tie_word_embeddings=True,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    # Llama 2: multi-head attention, untied output, no scaling
    "llama2": (
        LlamaConfig,
        LlamaForCausalLM,
        dict(
            num_attention_heads=4,
            num_key_value_heads=4,
            rope_theta=10000.0,
            tie_word_embeddings=False,
            bos_token_id=1,
            eos_token_id=2,
        ),
    ),
    "qwen2-tied": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(num_attention_heads=4, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=True, eos_token_id=3),
    ),
    "qwen2-untied": (
        Qwen2Config,
        Qwen2ForCausalLM,
        dict(num_attention_heads=8, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=False, eos_token_id=3),
    ),
}
PARITY = {}  # (case, padding) -> max abs logit difference, printed at the end of the module


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """case -> (transformers model, directory, sharded directory), all weights random and non-trivial."""
    made = {}
    for name, (config_cls, model_cls, extra) in CASES.items():
        torch.manual_seed(len(made))
        hf = model_cls(config_cls(**COMMON, **extra)).eval()
        with torch.no_grad():
            for key, p in hf.named_parameters():
                p.normal_(1.0, 0.1) if key.endswith("norm.weight") else p.normal_(0.0, 0.1)
        root = tmp_path_factory.mktemp(name)
        hf.save_pretrained(root / "single")
        hf.save_pretrained(root / "sharded", max_shard_size="40KB")
        made[name] = (hf, root / "single", root / "sharded")
    yield made
    print("\nmax |logits - transformers| per config:", {k: f"{v:.2e}" for k, v in sorted(PARITY.items())})


def saved_tensors(path) -> dict:
    out = {}
    for file in glob.glob(os.path.join(path, "*.safetensors")):
        with safe_open(file, "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


def batch(seed=0, B=3, T=12, lengths=(12, 9, 5), left=False):
    """Random ids (B, T) and a padding mask with the given real lengths, padding right or left."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    for b, n in enumerate(lengths):
        if left:
            mask[b, T - n:] = 1
        else:
            mask[b, :n] = 1
    return ids.masked_fill(mask == 0, 0), mask


def positions_from(mask):
    return (mask.cumsum(-1) - 1).clamp_min(0)


# ---------------------------------------------------------------------------------------------
# Checkpoints and logits


@pytest.mark.parametrize("case", CASES)
def test_tied_or_untied_as_saved(checkpoints, case):
    hf, single, sharded = checkpoints[case]
    tied = CASES[case][2]["tie_word_embeddings"]
    saved = saved_tensors(single)
    assert ("lm_head.weight" in saved) != tied
    if not tied:
        assert not torch.equal(saved["lm_head.weight"], saved["model.embed_tokens.weight"])
    assert len(glob.glob(os.path.join(sharded, "*.safetensors"))) > 1
    model = load_model(single)
    assert hasattr(model, "lm_head") != tied
    assert set(model.state_dict()) == set(saved) - set(model.checkpoint_aliases())
    if case.startswith("qwen2"):  # q/k/v biases, no o_proj bias
        attn = model.model.layers[0].self_attn
        assert attn.q_proj.bias is not None and attn.k_proj.bias is not None and attn.v_proj.bias is not None
        assert attn.o_proj.bias is None


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("padding", ["right", "left"])
def test_logits_match_transformers(checkpoints, case, padding):
    hf, single, sharded = checkpoints[case]
    ids, mask = batch(left=padding == "left")
    with torch.no_grad():
        kwargs = {"position_ids": positions_from(mask)} if padding == "left" else {}
        expected = hf(input_ids=ids, attention_mask=mask, **kwargs).logits
        worst = 0.0
        for path in (single, sharded):
            got = load_model(path)(ids, attention_mask=mask)
            assert got.shape == expected.shape
            real = mask.bool()
            worst = max(worst, (got[real] - expected[real]).abs().max().item())
    PARITY[f"{case}/{padding}"] = worst
    assert worst <= 1e-4


def test_logits_at_and_no_padding(checkpoints):
    hf, single, _ = checkpoints["llama3"]
    model = load_model(single)
    ids, _ = batch(lengths=(12, 12, 12))
    full = model(ids)
    with torch.no_grad():
        assert (full - hf(input_ids=ids).logits).abs().max() <= 1e-4
    at = torch.tensor([[0, 5], [11, 3], [7, 7]])
    picked = model(ids, logits_at=at)
    assert picked.shape == (3, 2, VOCAB)
    torch.testing.assert_close(picked, full.gather(1, at[..., None].expand(-1, -1, VOCAB)), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", ["llama3", "qwen2-tied"])
def test_rope_tables_match_transformers(checkpoints, case):
    hf, single, _ = checkpoints[case]
    model = load_model(single)
    P = model.config.max_position_embeddings
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), torch.arange(P)[None])
    torch.testing.assert_close(model.rope_cos[:P], cos[0], atol=1e-6, rtol=0)
    torch.testing.assert_close(model.rope_sin[:P], sin[0], atol=1e-6, rtol=0)
    if case == "llama3":  # the scaling really changes the table
        plain = Model(Config.from_dict({**CASES[case][2], **COMMON, "rope_scaling": None})).rope_cos
        assert (plain[:P] - model.rope_cos[:P]).abs().max() > 1e-2


def test_rope_tables_stay_fp32(checkpoints):
    model = load_model(checkpoints["llama3"][1])
    cos, sin = model.rope_cos.clone(), model.rope_sin.clone()
    model.to(torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.rope_cos.dtype == model.rope_sin.dtype == torch.float32
    assert torch.equal(model.rope_cos, cos) and torch.equal(model.rope_sin, sin)  # recomputed, not cast back
    assert load_model(checkpoints["llama3"][1], dtype="bf16").rope_cos.dtype == torch.float32


def test_too_many_columns_for_the_rope_table(checkpoints):
    model = load_model(checkpoints["llama2"][1])  # max_position_embeddings 96: a table of 98 positions
    ids = torch.randint(4, VOCAB, (1, 99), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[:, :10] = 0  # left padding counts: the check is on key/value columns, not positions
    with pytest.raises(
        CaptError,
        match=r"^99 key/value columns \(padding, capsule slots, prompt and prefix vectors included\) "
        r"exceed the rope table's 98 positions \(max_position_embeddings 96 \+ 2 for capsule slots\)$",
    ):
        model(ids, attention_mask=mask)


def test_config_rope_spellings():
    v4 = Config.from_dict(
        {"model_type": "llama", "rope_theta": 5e5, "rope_scaling": {**LLAMA3_ROPE, "type": "llama3"}, "foo": 1}
    )
    v5 = Config.from_dict({"model_type": "llama", "rope_parameters": {**LLAMA3_ROPE, "rope_theta": 5e5}})
    assert v4.rope_theta == v5.rope_theta == 5e5 and v4.rope_scaling == v5.rope_scaling == LLAMA3_ROPE
    qwen = Config.from_dict({"model_type": "qwen2"})
    assert qwen.vocab_size == 151936 and qwen.num_key_value_heads == 32 and qwen.rope_scaling is None
    with pytest.raises(CaptError, match="rope type"):
        Config.from_dict({"model_type": "llama", "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(CaptError, match="model_type"):
        Config.from_dict({"model_type": "mistral"})
    with torch.device("meta"):
        model = Model(Config.from_dict({**COMMON, "model_type": "qwen2"}))
    assert model.rope_cos.is_meta and "rope_cos" not in model.state_dict()


# ---------------------------------------------------------------------------------------------
# Generation


@pytest.mark.parametrize("case", CASES)
def test_greedy_generate_matches_transformers(checkpoints, case):
    hf, single, _ = checkpoints[case]
    model = load_model(single)
    for ids, mask in [batch(B=1, T=7, lengths=(7,)), batch(seed=1, T=9, lengths=(9, 4, 6), left=True)]:
        expected = hf.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False
        )
        got = model.generate(ids, attention_mask=mask, max_new_tokens=16, eos_token_id=[])
        assert torch.equal(got, expected)


def test_generate_stops_and_pads_like_transformers(checkpoints):
    hf, single, _ = checkpoints["llama3"]
    model = load_model(single)
    ids, mask = batch(seed=1, T=9, lengths=(9, 4, 6), left=True)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[])
    eos = int(free[0, 9 + 2])  # row 0's third new token becomes the end token
    expected = hf.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=10, do_sample=False, eos_token_id=eos, pad_token_id=0
    )
    got = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=eos)
    assert torch.equal(got, expected)
    assert (got[0, 12:] == 0).all()
    with pytest.raises(CaptError, match="left-padded"):
        model.generate(*batch(lengths=(12, 5, 3)))


def test_sampling_is_reproducible(checkpoints):
    model = load_model(checkpoints["qwen2-tied"][1])
    ids, mask = batch(seed=2, T=6, lengths=(6, 3, 5), left=True)
    runs = [
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=8,
            do_sample=True,
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            generator=torch.Generator().manual_seed(7),
            eos_token_id=[],
        )
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1]) and runs[0].shape == (3, 14)
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[])
    assert torch.equal(
        model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=True, top_k=1, eos_token_id=[]), greedy
    )


def test_one_sampler_checks_its_arguments(checkpoints):
    assert llama.next_token is t5.next_token is sampling.next_token
    model = load_model(checkpoints["qwen2-tied"][1])
    ids, mask = batch(seed=2, T=6, lengths=(6, 3, 5), left=True)
    for bad, message in ((dict(top_p=0.0), "top_p"), (dict(top_p=-0.5), "top_p"), (dict(top_p=1.5), "top_p"),
                         (dict(top_k=0), "top_k"), (dict(top_k=2.5), "top_k"), (dict(temperature=0.0), "temperature")):
        with pytest.raises(CaptError, match=f"^{message} must be"):
            model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=True, **bad)
    # the most likely token always survives: a vanishing top_p or temperature is greedy, never an empty draw
    greedy = model.generate(ids, attention_mask=mask, max_new_tokens=6, eos_token_id=[])
    for narrow in (dict(top_p=1e-9), dict(temperature=1e-38), dict(top_k=1, top_p=1e-9)):
        got = model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=True, eos_token_id=[],
                             generator=torch.Generator().manual_seed(0), **narrow)
        assert torch.equal(got, greedy), narrow
    logits = torch.tensor([[0.0, 3.0, 2.9, -1.0]])
    assert sampling.next_token(logits, do_sample=True, top_p=1e-6).item() == 1


def test_generate_needs_a_prompt_token(checkpoints):
    model = load_model(checkpoints["llama2"][1])
    with pytest.raises(CaptError, match="^generate needs at least one prompt token$"):
        model.generate(torch.zeros(2, 0, dtype=torch.long), max_new_tokens=3)


def test_unpadded_calls_never_read_the_mask(checkpoints, monkeypatch):
    """Without an attention_mask there is no padding: SDPA's mask is made without reading one back."""
    model = load_model(checkpoints["llama3"][1])
    ids, _ = batch(seed=13, lengths=(12, 12, 12))
    with torch.no_grad():
        full = model(ids)
        seen = []
        real_sdpa_mask = llama.sdpa_mask
        monkeypatch.setattr(
            llama, "sdpa_mask", lambda key_mask, *args: seen.append(key_mask) or real_sdpa_mask(key_mask, *args)
        )
        cache = model.new_cache(3, 12)
        parts = [model(ids[:, a:b], cache=cache) for a, b in [(0, 5), (5, 11), (11, 12)]]
        assert seen == [None, None, None]
        torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=0)
        model(ids[:, :4], attention_mask=torch.ones(3, 4, dtype=torch.long))  # a given mask is read
    assert seen[-1] is not None


def test_cache_in_chunks_equals_one_pass(checkpoints):
    model = load_model(checkpoints["llama2"][1])
    ids, mask = batch(seed=11, lengths=(12, 7, 10), left=True)
    with torch.no_grad():
        full = model(ids, attention_mask=mask)
        cache = model.new_cache(3, 12)
        parts = [model(ids[:, a:b], attention_mask=mask[:, a:b], cache=cache) for a, b in [(0, 5), (5, 11), (11, 12)]]
    real = mask.bool()
    assert (torch.cat(parts, dim=1)[real] - full[real]).abs().max() <= 1e-5
    with pytest.raises(CaptError, match="cache holds"):
        model(ids[:, :1], cache=cache)


def test_bf16_runs_with_capsules(checkpoints):
    path = checkpoints["qwen2-tied"][1]
    ids, mask = batch(seed=12, left=True)
    fp32 = with_capsules(path, "add", "all")(ids, attention_mask=mask)
    model = load_model(path, dtype="bf16", capsules=CapsuleConfig())
    with torch.no_grad():
        for p, q in zip(capsule_vectors(model).values(), capsule_vectors(with_capsules(path, "add", "all")).values()):
            p.copy_(q)
    bf16 = model(ids, attention_mask=mask)
    assert bf16.dtype == torch.bfloat16 and capsule_vectors(model)[0].dtype == torch.float32
    real = mask.bool()
    assert (bf16.float()[real] - fp32[real]).abs().max() < 0.1
    got = model.generate(ids, attention_mask=mask, max_new_tokens=4, eos_token_id=[])
    assert got.shape == (3, 16) and torch.equal(got[:, :12], ids)
    assert torch.equal(got[:, 12], fp32[:, -1].argmax(-1))  # the first greedy token agrees with fp32


# ---------------------------------------------------------------------------------------------
# Capsules


def with_capsules(path, integration, blocks, seed=0):
    """The model with capsules attached and filled with random non-zero values."""
    model = load_model(path, capsules=CapsuleConfig(integration=integration, blocks=blocks))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in capsule_vectors(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def reference_capsule_logits(hf, ids, mask, prompt, capsules: dict, integration):
    """method.md step by step on transformers' own modules, with our own masks and positions."""
    n = 1 if integration == "add" else 2
    B, T = ids.shape
    h0 = hf.model.embed_tokens(ids)  # (B, T, d)
    m = prompt.float()
    mean0 = (m[..., None] * h0).sum(1) / m.sum(1, keepdim=True)
    p0 = capsules.get(0, torch.zeros(h0.shape[-1]))
    slots = [mean0 + p0] if integration == "add" else [mean0, p0.expand_as(mean0)]
    h = torch.cat([torch.stack(slots, 1), h0], dim=1)  # (B, n + T, d)
    keys = torch.cat([torch.ones(B, n), mask.float()], dim=1).bool()
    pool = torch.cat([torch.ones(B, n), m], dim=1)
    positions = torch.cat([torch.arange(n).expand(B, n), n + positions_from(mask)], dim=1)
    N = n + T
    allowed = torch.ones(N, N).tril().bool() & keys[:, None, :] | torch.eye(N, dtype=torch.bool)
    additive = torch.zeros(B, 1, N, N).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    cos_sin = hf.model.rotary_emb(h, positions)
    for l, layer in enumerate(hf.model.layers):
        if l > 0 and l in capsules:  # entering a later block of S: replace the slot(s)
            mean = (pool[..., None] * h).sum(1) / pool.sum(1, keepdim=True)
            h = h.clone()
            if integration == "add":
                h[:, 0] = capsules[l] + mean
            else:
                h[:, 0], h[:, 1] = mean, capsules[l]
        h = layer(h, attention_mask=additive, position_ids=positions, position_embeddings=cos_sin)
    return hf.lm_head(hf.model.norm(h[:, n:]))


@pytest.mark.parametrize("case", ["llama3", "qwen2-untied"])
@pytest.mark.parametrize("integration", ["add", "prepend"])
@pytest.mark.parametrize("blocks", ["all", "odd"])
def test_capsule_matches_stepwise_reference(checkpoints, case, integration, blocks):
    hf, single, _ = checkpoints[case]
    model = with_capsules(single, integration, blocks)
    vectors = {i: p.detach() for i, p in capsule_vectors(model).items()}
    assert len(vectors) == (3 if blocks == "all" else 2)
    for left in (False, True):
        ids, mask = batch(seed=3, left=left)
        prompt = mask.clone()
        prompt[0, 8:] = 0  # the last tokens of row 0 are a teacher-forced answer
        with torch.no_grad():
            expected = reference_capsule_logits(hf, ids, mask, prompt, vectors, integration)
            got = model(ids, attention_mask=mask, prompt_mask=prompt)
            plain = model(ids, attention_mask=mask)
        real = mask.bool()
        assert (got[real] - expected[real]).abs().max() <= 1e-4
        assert (got[real] - plain[real]).abs().max() > 1e-3  # prompt_mask matters


@pytest.mark.parametrize("integration", ["add", "prepend"])
def test_capsule_never_sees_the_answer(checkpoints, integration):
    model = with_capsules(checkpoints["llama3"][1], integration, "all")
    n = 1 if integration == "add" else 2
    slots = []
    hooks = [
        layer.register_forward_hook(lambda mod, args, out: slots.append(out[:, :n].clone()))
        for layer in model.model.layers
    ]
    ids, mask = batch(seed=4, lengths=(12, 10, 12))
    prompt = mask.clone()
    prompt[:, 7:] = 0  # tokens 7.. are answers fed for teacher forcing
    other = ids.clone()
    other[:, 7:] = torch.randint(4, VOCAB, other[:, 7:].shape, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        a = model(ids, attention_mask=mask, prompt_mask=prompt)
        first = len(slots)
        b = model(other, attention_mask=mask, prompt_mask=prompt)
    for hook in hooks:
        hook.remove()
    for s, t in zip(slots[:first], slots[first:]):
        torch.testing.assert_close(s, t, atol=1e-6, rtol=0)
    torch.testing.assert_close(a[:, :7], b[:, :7], atol=1e-6, rtol=0)
    assert (a[:, 7:] - b[:, 7:]).abs().max() > 1e-3


@pytest.mark.parametrize("integration", ["add", "prepend"])
def test_capsule_padding_invariance(checkpoints, integration):
    model = with_capsules(checkpoints["qwen2-tied"][1], integration, "odd")
    ids, _ = batch(seed=5, B=1, T=8, lengths=(8,))
    prompt = torch.ones(1, 8, dtype=torch.long)
    prompt[:, 6:] = 0
    with torch.no_grad():
        alone = model(ids, prompt_mask=prompt)[0]
        for left in (False, True):
            others, mask = batch(seed=6, B=3, T=11, lengths=(11, 8, 5), left=left)
            span = slice(3, 11) if left else slice(0, 8)
            others[1, span], mask[1] = ids[0], 0
            mask[1, span] = 1
            prompts = mask.clone()
            prompts[1, span] = prompt[0]
            got = model(others, attention_mask=mask, prompt_mask=prompts)[1, span]
            torch.testing.assert_close(got, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("integration", ["add", "prepend"])
def test_capsule_generation_cache_equals_recomputation(checkpoints, integration):
    model = with_capsules(checkpoints["llama3"][1], integration, "all")
    for ids, mask in [batch(seed=7, B=1, T=6, lengths=(6,)), batch(seed=8, T=9, lengths=(9, 4, 6), left=True)]:
        got = model.generate(ids, attention_mask=mask, max_new_tokens=10, eos_token_id=[])
        seq, seq_mask, prompt = ids, mask, mask
        with torch.no_grad():
            for _ in range(10):
                logits = model(seq, attention_mask=seq_mask, prompt_mask=prompt)[:, -1]
                seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
                seq_mask = torch.cat([seq_mask, torch.ones_like(seq_mask[:, :1])], dim=1)
                prompt = torch.cat([prompt, torch.zeros_like(prompt[:, :1])], dim=1)
        assert torch.equal(got, seq)


def test_capsule_is_formed_by_the_first_cached_call_only(checkpoints):
    """Tokens read after a cached prompt, several at once, attend to the slot but never change it."""
    model = with_capsules(checkpoints["llama3"][1], "add", "all")
    ids, mask = batch(seed=14, lengths=(12, 9, 5), left=True)
    prompt = mask.clone()
    prompt[:, 8:] = 0  # the prompt is columns 0..7; 8..11 are continuations read after it
    with torch.no_grad():
        whole = model(ids, attention_mask=mask, prompt_mask=prompt)
        outputs = {}
        for name, later_prompt in (("ignored", torch.ones(3, 4, dtype=torch.long)), ("none", None)):
            cache = model.new_cache(3, 13)
            first = model(ids[:, :8], attention_mask=mask[:, :8], cache=cache)
            later = model(ids[:, 8:], attention_mask=mask[:, 8:], prompt_mask=later_prompt, cache=cache)
            outputs[name] = torch.cat([first, later], dim=1)
    real = mask.bool()
    for got in outputs.values():
        assert (got[real] - whole[real]).abs().max() <= 1e-5


def test_capsule_config_block_indices():
    assert CapsuleConfig(blocks=[3, 0, 3.0]).blocks == [0, 3]
    for bad in ([True], [0, 1.5], [-1], ["1"], [None]):
        with pytest.raises(CaptError, match=r"^capsule blocks \[.*\]: block indices are whole numbers from 0$"):
            CapsuleConfig(blocks=bad)
    with pytest.raises(CaptError, match="or a list of indices"):
        CapsuleConfig(blocks=3)


def test_capsule_gradient_reaches_only_capsules(checkpoints):
    model = with_capsules(checkpoints["llama3"][1], "add", "odd")
    ids, mask = batch(seed=10)
    at = torch.tensor([[11], [8], [4]])
    loss = model(ids, attention_mask=mask, logits_at=at).logsumexp(-1).sum()
    loss.backward()
    grads = {k: p.grad for k, p in model.named_parameters() if p.grad is not None}
    assert set(grads) == {"model.layers.0.capsule", "model.layers.2.capsule"}
    assert all(g.abs().sum() > 0 for g in grads.values())


@pytest.mark.parametrize("case", ["llama3", "qwen2-untied"])
@pytest.mark.parametrize("method", ["capt", "capt-prepend", "deep-prompt", "prefix", "prompt", "none"])
def test_last_block_runs_at_the_read_rows_only(checkpoints, case, method):
    """With logits_at, the last block's output projection and MLP see only those rows; logits and
    gradients are bit for bit those of the full path (every position's logits, gathered), padded or not."""
    model = load_model(checkpoints[case][1])
    if method != "none":
        name, capsules = ("capt", CapsuleConfig(integration="prepend")) if method == "capt-prepend" else (method, None)
        attach(
            model, name, n=None if name == "capt" else 2, capsules=capsules, generator=torch.Generator().manual_seed(0)
        )
    trained = [p for p in model.parameters() if p.requires_grad] or [
        model.model.layers[0].mlp.up_proj.weight.requires_grad_()
    ]
    seen = []
    model.model.layers[-1].mlp.register_forward_pre_hook(lambda _, args: seen.append(args[0].shape[1]))
    at = torch.tensor([[11, 3], [8, 0], [4, 2]])
    for left in (False, True):
        ids, mask = batch(seed=11, left=left)
        got = model(ids, attention_mask=mask, logits_at=at)
        want = model(ids, attention_mask=mask).gather(1, at[..., None].expand(-1, -1, model.config.vocab_size))
        prefix = model.model.layers[0].self_attn.prefix
        # the rows read, then every row
        assert seen[-2:] == [2, ids.shape[1] + model.front_length() - (0 if prefix is None else prefix.length)]
        assert torch.equal(got, want)
        assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got.square().sum(), trained),
                                                     torch.autograd.grad(want.square().sum(), trained)))
        with torch.no_grad():
            full = model.features(ids, attention_mask=mask)
            assert torch.equal(
                model.features(ids, attention_mask=mask, hidden_at=at),
                full.gather(1, at[..., None].expand(-1, -1, full.shape[-1])),
            )


def test_sdpa_groups_heads_only_where_a_fast_kernel_does():
    """enable_gqa on the CPU always (measured as fast or faster); on CUDA only for flash (fp16 / bf16,
    no mask); CUDA fp32 or masked calls copy k and v to whole heads for the memory-efficient kernel."""
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    assert ops.native_gqa(torch.zeros(1), None) and ops.native_gqa(torch.zeros(1), mask)
    assert ops.native_gqa(Q(is_cuda=True, dtype=torch.bfloat16), None)
    assert ops.native_gqa(Q(is_cuda=True, dtype=torch.float16), None)
    assert not ops.native_gqa(Q(is_cuda=True, dtype=torch.bfloat16), mask)
    assert not ops.native_gqa(Q(is_cuda=True, dtype=torch.float32), None)


# ---------------------------------------------------------------------------------------------
# The learned integrations and two slots, against transformers' layers with the slot built outside


def instance_by_loops(h, pool, part):
    """The instance part of each sequence from its pooled rows, written out: extraction's filter by loops,
    projection's map by its formula, or (part None) the mean."""
    from test_variants import extraction_by_loops

    if isinstance(part, ops.Extraction):
        return extraction_by_loops(h, pool, part.weight.detach()).float()
    mean = (pool[..., None].float() * h).sum(1) / pool.float().sum(1, keepdim=True)
    if isinstance(part, ops.Projection):
        return mean + mean @ part.down.detach().T @ part.up.detach().T
    return mean


def reference_variant_logits(hf, model, ids, mask, n):
    """The add family of integrations step by step (method.md): n slots, slot j = p_{l,j} + the instance part of the
    pooled rows (the slots and the real tokens) at every block of S; transformers' own layers in between."""
    blocks = model.capsule_blocks()
    B, T = ids.shape
    h0 = hf.model.embed_tokens(ids)
    pool = mask.bool()
    p = {i: b.capsule.detach()[0].reshape(n, -1) for i, b in enumerate(blocks) if b.capsule is not None}
    first = instance_by_loops(h0, pool, blocks[0].capsule_instance)[:, None] + p.get(0, torch.zeros(n, h0.shape[-1]))
    h = torch.cat([first, h0], dim=1)  # (B, n + T, d)
    pool = torch.cat([torch.ones(B, n, dtype=torch.bool), pool], dim=1)
    positions = torch.cat([torch.arange(n).expand(B, n), n + positions_from(mask)], dim=1)
    N = n + T
    allowed = torch.ones(N, N).tril().bool() & pool[:, None, :] | torch.eye(N, dtype=torch.bool)
    additive = torch.zeros(B, 1, N, N).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
    cos_sin = hf.model.rotary_emb(h, positions)
    for l, layer in enumerate(hf.model.layers):
        if l > 0 and l in p:
            h = torch.cat([instance_by_loops(h, pool, blocks[l].capsule_instance)[:, None] + p[l], h[:, n:]], dim=1)
        h = layer(h, attention_mask=additive, position_ids=positions, position_embeddings=cos_sin)
    return hf.lm_head(hf.model.norm(h[:, n:]))


@pytest.mark.parametrize("case", ["llama3", "qwen2-untied"])
@pytest.mark.parametrize("caps", [CapsuleConfig(integration="extraction"), CapsuleConfig(integration="projection"),
                                  CapsuleConfig(length=2), CapsuleConfig(integration="extraction", blocks="odd")])
def test_learned_integrations_and_two_slots_match_the_stepwise_reference(checkpoints, case, caps):
    hf, single, _ = checkpoints[case]
    model = load_model(single, capsules=caps)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for t in method_parameters(model).values():
            t.add_(torch.randn(t.shape, generator=g) * 0.3)
    for left in (False, True):
        ids, mask = batch(seed=5, left=left)
        with torch.no_grad():
            expected = reference_variant_logits(hf, model, ids, mask, caps.slots)
            got = model(ids, attention_mask=mask)
            add = load_model(single, capsules=CapsuleConfig(length=caps.length, blocks=caps.blocks))
            for (i, p), (_, q) in zip(capsule_vectors(add).items(), capsule_vectors(model).items()):
                p.copy_(q)
            plain_add = add(ids, attention_mask=mask)
        real = mask.bool()
        assert (got[real] - expected[real]).abs().max() <= 1e-4
        if caps.integration != "add":  # the learned part matters
            assert (got[real] - plain_add[real]).abs().max() > 1e-3
