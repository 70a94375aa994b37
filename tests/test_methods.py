"""The baselines of capt.methods on tiny random T5 and Llama / Qwen2 checkpoints (CPU, fp32).

Trainable counts from config.json alone; training moves only the method's tensors; save and
reload; `instance` is the zero capsule; prompt tuning and prefix tuning give peft's logits with
the same vectors copied in (Llama, Qwen2; T5's prompt tuning). peft's T5 prefix goes to the
decoder's self-attention (transformers' encoder stack drops a cache), so our encoder prefix is
checked against transformers' own encoder blocks fed the prefix as a prefilled cache, which is
what peft hands the decoder. Deep prompts against a step-by-step reference; cached generation
against recomputation.
"""

import copy
import json

import pytest
import torch
from test_llama import CASES as LLAMA_CASES
from test_llama import COMMON, batch, positions_from
from test_t5 import make_checkpoint, padded_batch

from capt.errors import CaptError
from capt.load import load_model
from capt.load import load_method, save_method, trainable_count
from capt.baselines import classify, last_token
from capt.methods import (
    METHODS,
    CapsuleConfig,
    MethodConfig,
    attach,
    capsule_vectors,
    method_parameters,
    method_tensors,
)

DEFAULT_N = {name: m.default_n for name, m in METHODS.items() if m.default_n is not None}

peft = pytest.importorskip("peft")
from peft import PrefixTuningConfig, PromptTuningConfig, PromptTuningInit, TaskType, get_peft_model  # noqa: E402
from transformers import DynamicCache  # noqa: E402

TOL = 1e-4
TRAINED = ["capt", "prompt", "deep-prompt", "prefix"]
PARITY = {}  # what was compared -> max abs logit difference, printed at the end


def llama_checkpoint(name, directory):
    config_cls, model_cls, extra = LLAMA_CASES[name]
    torch.manual_seed(1)
    hf = model_cls(config_cls(**COMMON, **extra)).eval()
    with torch.no_grad():
        for key, p in hf.named_parameters():
            p.normal_(1.0, 0.1) if key.endswith("norm.weight") else p.normal_(0.0, 0.1)
    hf.save_pretrained(directory)
    return hf


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """name -> (transformers model, checkpoint directory) for two decoder-only and one T5 checkpoint."""
    made = {}
    for name in ("llama3", "qwen2-untied"):
        directory = tmp_path_factory.mktemp(name)
        made[name] = (llama_checkpoint(name, directory), directory)
    directory = tmp_path_factory.mktemp("t5")
    made["t5"] = (make_checkpoint("v1.1", directory), directory)
    yield made
    print("\nmax |logits - yardstick|:", {k: f"{v:.2e}" for k, v in sorted(PARITY.items())})


def fill(model, seed=0, scale=0.5):
    """Random non-zero values in every trained tensor (fresh ones start at zero for some methods)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in method_tensors(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * scale)


def t5_batch(seed=4):
    return padded_batch(160, [12, 7, 3], [6, 6, 4], seed=seed)


def logits(model, kind, data):
    """Our logits for a batch: decoder-only (ids, mask) or T5 (ids, mask, dec, dec_mask)."""
    with torch.no_grad():
        if kind == "t5":
            ids, mask, dec, dec_mask = data
            return model(ids, mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
        return model(data[0], attention_mask=data[1])


# ---------------------------------------------------------------------------------------------
# Counts


T5_BASE = {"model_type": "t5", "vocab_size": 32128, "d_model": 768, "d_kv": 64, "d_ff": 3072, "num_layers": 12,
           "num_heads": 12}
LLAMA_1B = {
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "tie_word_embeddings": True,
}


def test_trainable_counts_from_config_alone():
    counts = {m: trainable_count(T5_BASE, m) for m in METHODS if m != "linear-head"}
    assert counts == {
        "capt": 12 * 768,
        "prompt": 100 * 768,
        "deep-prompt": 12 * 768,
        "prefix": 12 * 2 * 64 * 12 * 64,
        "instance": 0,
    }
    assert trainable_count(T5_BASE, "prefix") / 222_903_552 == pytest.approx(0.0053, abs=1e-4)  # the paper's 0.53%
    assert trainable_count(T5_BASE, "capt", capsules=CapsuleConfig(blocks="odd")) == 6 * 768
    with pytest.raises(CaptError, match="decoder-only"):
        trainable_count(T5_BASE, "linear-head", num_classes=2)
    assert trainable_count(LLAMA_1B, "capt") == 32_768
    assert trainable_count(LLAMA_1B, "prompt", n=20) == 20 * 2048
    assert trainable_count(LLAMA_1B, "deep-prompt", n=2) == 16 * 2 * 2048
    assert trainable_count(LLAMA_1B, "prefix", n=8) == 16 * 2 * 8 * 8 * 64  # n vectors per key/value head
    assert trainable_count(LLAMA_1B, "linear-head", num_classes=3) == 3 * 2048 + 3
    assert trainable_count(LLAMA_1B, "instance") == 0
    with pytest.raises(CaptError, match="method"):
        MethodConfig("lora")
    with pytest.raises(CaptError, match="num_classes"):
        MethodConfig("linear-head")
    assert MethodConfig("prefix").n == DEFAULT_N["prefix"] and MethodConfig("capt").n is None


# ---------------------------------------------------------------------------------------------
# Training moves the method's tensors only


CASES = [("t5", m) for m in TRAINED] + [("llama3", m) for m in TRAINED + ["linear-head"]] + [("qwen2-untied", "prefix")]


@pytest.mark.parametrize("case, method", CASES)
def test_training_lowers_loss_and_keeps_backbone(ckpt, case, method):
    _, path = ckpt[case]
    model = load_model(path)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    attach(
        model, method, n=3 if method in DEFAULT_N else None, num_classes=3, generator=torch.Generator().manual_seed(0)
    )
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and {id(p) for p in trained} == {id(p) for p in method_parameters(model).values()}
    assert all(p.dtype == torch.float32 for p in trained)
    optimizer = torch.optim.AdamW(trained, lr=0.05, weight_decay=0.0)

    if case == "t5":
        ids, mask, dec, dec_mask = t5_batch()
        targets = dec.roll(-1, dims=1)  # any fixed targets will do

        def loss_fn():
            out = model(ids, mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
            return torch.nn.functional.cross_entropy(out[dec_mask.bool()], targets[dec_mask.bool()])
    elif method == "linear-head":
        ids, mask = batch(seed=3)
        labels = torch.tensor([0, 2, 1])

        def loss_fn():
            return torch.nn.functional.cross_entropy(classify(model, ids, mask), labels)
    else:
        ids, mask = batch(seed=3)

        def loss_fn():
            out = model(ids, attention_mask=mask)[:, :-1]
            keep = mask[:, 1:].bool()
            return torch.nn.functional.cross_entropy(out[keep], ids[:, 1:][keep])

    losses = []
    for _ in range(6):
        optimizer.zero_grad()
        loss = loss_fn()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 1e-3, losses
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())  # the backbone is bit-identical
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


# ---------------------------------------------------------------------------------------------
# Files


SAVED = [("t5", m) for m in TRAINED + ["instance"]] + [("llama3", m) for m in METHODS]


@pytest.mark.parametrize("case, method", SAVED)
def test_save_and_reload_give_identical_logits(ckpt, tmp_path, case, method):
    _, path = ckpt[case]
    model = load_model(path)
    attach(model, method, n=2 if method in DEFAULT_N else None, num_classes=4)
    fill(model)
    kind = "t5" if case == "t5" else "llama"
    data = t5_batch() if kind == "t5" else batch(seed=5, left=True)
    expected = logits(model, kind, data)
    save_method(model, tmp_path)
    names = {"capt": ["capsules.safetensors", "capsules.json"]}.get(method, ["adapter.safetensors", "adapter.json"])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names)

    fresh = load_model(path)
    config = load_method(fresh, tmp_path)
    assert config.to_dict() == model.method.to_dict()
    assert sum(p.numel() for p in fresh.parameters() if p.requires_grad) == sum(
        p.numel() for p in model.parameters() if p.requires_grad
    )
    assert torch.equal(logits(fresh, kind, data), expected)
    if method == "linear-head":
        ids, mask = data
        with torch.no_grad():
            assert torch.equal(classify(fresh, ids, mask), classify(model, ids, mask))

    other = load_model(ckpt["qwen2-untied" if case != "qwen2-untied" else "llama3"][1])
    with pytest.raises(CaptError, match="different base model"):
        load_method(other, tmp_path)


def test_capsules_keep_their_file_format(ckpt, tmp_path):
    _, path = ckpt["llama3"]
    model = load_model(path)
    attach(model, "capt", capsules=CapsuleConfig(blocks="odd"))
    fill(model)
    save_method(model, tmp_path)
    meta = json.loads((tmp_path / "capsules.json").read_text())
    assert meta["capsule_config"]["blocks"] == "odd"
    again = load_model(path, capsules=tmp_path)  # the capsule loader reads them as ever
    for (i, p), (j, q) in zip(capsule_vectors(again).items(), capsule_vectors(model).items()):
        assert i == j and torch.equal(p, q)
    with pytest.raises(CaptError, match="not a saved method"):
        load_method(model, tmp_path / "nothing")


# ---------------------------------------------------------------------------------------------
# instance = the capsule model with zero vectors


@pytest.mark.parametrize("case", ["t5", "llama3"])
def test_instance_is_the_zero_capsule(ckpt, case):
    _, path = ckpt[case]
    model = load_model(path)
    attach(model, "instance")
    assert not any(p.requires_grad for p in model.parameters())
    zero_capsules = load_model(path, capsules=CapsuleConfig(integration="add", blocks="all"))
    plain = load_model(path)
    kind = "t5" if case == "t5" else "llama"
    data = t5_batch() if kind == "t5" else batch(seed=6, left=True)
    got = logits(model, kind, data)
    assert torch.equal(got, logits(zero_capsules, kind, data))
    assert (got - logits(plain, kind, data)).abs().max() > 1e-3  # the instance token does change the output


# ---------------------------------------------------------------------------------------------
# peft parity: prompt tuning and prefix tuning with the same vectors


def peft_prompt_model(hf, task, n, prompt):
    wrapped = get_peft_model(copy.deepcopy(hf), PromptTuningConfig(task_type=task, num_virtual_tokens=n,
                                                                   prompt_tuning_init=PromptTuningInit.RANDOM)).eval()
    with torch.no_grad():  # seq2seq models get 2n rows (encoder, decoder); prompt tuning reads the first n
        wrapped.prompt_encoder["default"].embedding.weight[:n] = prompt
    return wrapped


def peft_prefix_model(hf, n, model):
    """peft's prefix tuning with our keys/values: its table (n, L * 2 * Hkv * Dh) holds, for each
    virtual token, layer 0's key and value, then layer 1's, ..."""
    wrapped = get_peft_model(
        copy.deepcopy(hf), PrefixTuningConfig(task_type=TaskType.CAUSAL_LM, num_virtual_tokens=n)
    ).eval()
    table = wrapped.prompt_encoder["default"].embedding.weight
    ours = torch.stack(
        [t.detach().permute(1, 0, 2) for a in model.prefix_attentions() for t in (a.prefix.keys, a.prefix.values)],
        dim=1,
    )
    assert table.numel() == ours.numel() == sum(p.numel() for p in model.parameters() if p.requires_grad)
    with torch.no_grad():
        table.copy_(ours.reshape(n, -1))  # (n, 2L, Hkv, Dh) -> (n, 2L * Hkv * Dh)
    return wrapped


@pytest.mark.parametrize("case", ["llama3", "qwen2-untied"])
def test_prompt_tuning_matches_peft(ckpt, case):
    hf, path = ckpt[case]
    n = 4
    model = load_model(path)
    attach(model, "prompt", n=n, generator=torch.Generator().manual_seed(1))
    wrapped = peft_prompt_model(hf, TaskType.CAUSAL_LM, n, method_tensors(model)["prompt"].detach())
    worst = 0.0
    # peft drops position ids (with a warning) and transformers counts positions 0..n+T-1, so only
    # right padding (and none) gives both the same positions
    for ids, mask in [batch(seed=7), batch(seed=8, lengths=(12, 12, 12))]:
        with torch.no_grad():
            want = wrapped(input_ids=ids, attention_mask=mask).logits[:, n:]  # peft returns the prompt rows too
            got = model(ids, attention_mask=mask)
        real = mask.bool()
        worst = max(worst, (got[real] - want[real]).abs().max().item())
    PARITY[f"prompt/{case}"] = worst
    assert worst <= TOL


@pytest.mark.parametrize("case", ["llama3", "qwen2-untied"])
def test_prefix_tuning_matches_peft(ckpt, case):
    hf, path = ckpt[case]
    n = 3
    model = load_model(path)
    attach(model, "prefix", n=n, generator=torch.Generator().manual_seed(2))
    wrapped = peft_prefix_model(hf, n, model)
    worst = 0.0
    for left in (False, True):
        ids, mask = batch(seed=9, left=left)
        # peft shifts given position ids by n, as transformers does when it numbers them itself
        kwargs = {"position_ids": positions_from(mask)} if left else {}
        with torch.no_grad():
            want = wrapped(input_ids=ids, attention_mask=mask, **kwargs).logits
            got = model(ids, attention_mask=mask)
            plain = load_model(path)(ids, attention_mask=mask)
        real = mask.bool()
        worst = max(worst, (got[real] - want[real]).abs().max().item())
        assert (got[real] - plain[real]).abs().max() > 1e-2  # the prefix matters
    PARITY[f"prefix/{case}"] = worst
    assert worst <= TOL


def test_t5_prompt_tuning_matches_peft(ckpt):
    hf, path = ckpt["t5"]
    n = 4
    model = load_model(path)
    attach(model, "prompt", n=n, generator=torch.Generator().manual_seed(3))
    wrapped = peft_prompt_model(hf, TaskType.SEQ_2_SEQ_LM, n, method_tensors(model)["prompt"].detach())
    ids, mask, dec, dec_mask = t5_batch()
    with torch.no_grad():
        want = wrapped(
            input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask
        ).logits
        got = model(ids, mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    PARITY["prompt/t5"] = (got - want).abs().max().item()
    assert PARITY["prompt/t5"] <= TOL


def test_t5_prefix_matches_transformers_encoder_with_prefilled_cache(ckpt):
    """Our encoder prefix = transformers' encoder blocks given the prefix as a prefilled cache.

    peft itself cannot be the yardstick here: its T5 prefix goes into the decoder (checked below),
    because transformers' encoder stack drops any cache it is given.
    """
    hf, path = ckpt["t5"]
    n = 3
    model = load_model(path)
    attach(model, "prefix", n=n, generator=torch.Generator().manual_seed(4))
    ids, mask, dec, dec_mask = t5_batch()
    B = ids.shape[0]
    with torch.no_grad():
        cache = DynamicCache()
        for i, attention in enumerate(model.prefix_attentions()):
            cache.update(attention.prefix.keys.expand(B, -1, -1, -1), attention.prefix.values.expand(B, -1, -1, -1), i)
        h = hf.shared(ids)
        keys = torch.cat([torch.ones(B, n), mask.float()], dim=1)
        additive = (1.0 - keys)[:, None, None, :] * torch.finfo(torch.float32).min
        bias = None  # block 0 computes it: queries at n.., keys at 0.. (the cache's length), bidirectional
        for block in hf.encoder.block:
            h, bias = block(h, attention_mask=additive, position_bias=bias, past_key_values=cache)[:2]
        h = hf.encoder.final_layer_norm(h)
        want = hf(
            encoder_outputs=(h,), attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask
        ).logits
        got = model(ids, mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
        plain = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask).logits
    PARITY["prefix/t5-encoder"] = (got - want).abs().max().item()
    assert PARITY["prefix/t5-encoder"] <= TOL
    assert (got - plain).abs().max() > 1e-2

    # peft's T5 prefix: the encoder output is untouched, only the decoder's self-attention changes
    heads, head_dim = model.prefix_shape()  # peft would take d_model for heads * d_kv, which differ here
    config = PrefixTuningConfig(task_type=TaskType.SEQ_2_SEQ_LM, num_virtual_tokens=n, token_dim=heads * head_dim,
                                # the decoder takes them
                                num_attention_heads=heads, num_layers=hf.config.num_decoder_layers)
    wrapped = get_peft_model(copy.deepcopy(hf), config).eval()
    with torch.no_grad():
        out = wrapped(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
        base = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    assert torch.equal(out.encoder_last_hidden_state, base.encoder_last_hidden_state)
    assert (out.logits - base.logits).abs().max() > 1e-3


# ---------------------------------------------------------------------------------------------
# Deep prompts against a step-by-step reference


def test_deep_prompt_matches_stepwise_reference_llama(ckpt):
    hf, path = ckpt["llama3"]
    n = 2
    model = load_model(path)
    attach(model, "deep-prompt", n=n)
    fill(model, seed=3)
    vectors = [t.detach() for t in method_tensors(model).values()]
    ids, mask = batch(seed=10, left=True)
    B, T = ids.shape
    with torch.no_grad():
        h = torch.cat([vectors[0].expand(B, n, -1), hf.model.embed_tokens(ids)], dim=1)
        keys = torch.cat([torch.ones(B, n), mask.float()], dim=1).bool()
        positions = torch.cat([torch.arange(n).expand(B, n), n + positions_from(mask)], dim=1)
        N = n + T
        allowed = torch.ones(N, N).tril().bool() & keys[:, None, :] | torch.eye(N, dtype=torch.bool)
        additive = torch.zeros(B, 1, N, N).masked_fill(~allowed[:, None], torch.finfo(torch.float32).min)
        cos_sin = hf.model.rotary_emb(h, positions)
        for l, layer in enumerate(hf.model.layers):
            if l > 0:  # entering a later block: the front rows are this block's vectors
                h = torch.cat([vectors[l].expand(B, n, -1), h[:, n:]], dim=1)
            h = layer(h, attention_mask=additive, position_ids=positions, position_embeddings=cos_sin)
        want = hf.lm_head(hf.model.norm(h[:, n:]))
        got = model(ids, attention_mask=mask)
    real = mask.bool()
    PARITY["deep-prompt/llama3"] = (got[real] - want[real]).abs().max().item()
    assert PARITY["deep-prompt/llama3"] <= TOL


def test_deep_prompt_matches_stepwise_reference_t5(ckpt):
    hf, path = ckpt["t5"]
    n = 2
    model = load_model(path)
    attach(model, "deep-prompt", n=n)
    fill(model, seed=4)
    vectors = [t.detach() for t in method_tensors(model).values()]
    ids, mask, dec, dec_mask = t5_batch()
    B = ids.shape[0]
    with torch.no_grad():
        h = torch.cat([vectors[0].expand(B, n, -1), hf.shared(ids)], dim=1)
        keys = torch.cat([torch.ones(B, n), mask.float()], dim=1)
        N = h.shape[1]
        bias = hf.encoder.block[0].layer[0].SelfAttention.compute_bias(N, N)
        additive = (1.0 - keys)[:, None, None, :] * torch.finfo(torch.float32).min
        for l, block in enumerate(hf.encoder.block):
            if l > 0:
                h = torch.cat([vectors[l].expand(B, n, -1), h[:, n:]], dim=1)
            h = block(h, attention_mask=additive, position_bias=bias)[0]
        h = hf.encoder.final_layer_norm(h)
        want = hf(
            encoder_outputs=(h,), attention_mask=keys.long(), decoder_input_ids=dec, decoder_attention_mask=dec_mask
        ).logits
        got = model(ids, mask, decoder_input_ids=dec, decoder_attention_mask=dec_mask)
    PARITY["deep-prompt/t5"] = (got - want).abs().max().item()
    assert PARITY["deep-prompt/t5"] <= TOL


# ---------------------------------------------------------------------------------------------
# Generation, the linear head's hidden states


@pytest.mark.parametrize("method", ["prompt", "deep-prompt", "prefix"])
def test_cached_generation_equals_recomputation(ckpt, method):
    _, path = ckpt["llama3"]
    model = load_model(path)
    attach(model, method, n=3, generator=torch.Generator().manual_seed(5))
    fill(model, seed=5)
    ids, mask = batch(seed=11, T=9, lengths=(9, 4, 6), left=True)
    got = model.generate(ids, attention_mask=mask, max_new_tokens=8, eos_token_id=[])
    seq, seq_mask = ids, mask
    with torch.no_grad():
        for _ in range(8):
            step = model(seq, attention_mask=seq_mask)[:, -1]
            seq = torch.cat([seq, step.argmax(-1, keepdim=True)], dim=1)
            seq_mask = torch.cat([seq_mask, torch.ones_like(seq_mask[:, :1])], dim=1)
    assert torch.equal(got, seq)


@pytest.mark.parametrize("method", ["prompt", "deep-prompt", "prefix"])
def test_t5_generation_with_methods(ckpt, method):
    _, path = ckpt["t5"]
    model = load_model(path)
    attach(model, method, n=3, generator=torch.Generator().manual_seed(6))
    fill(model, seed=6)
    ids, mask, _, _ = t5_batch(seed=2)
    got = model.generate(ids, mask, max_new_tokens=6, eos_token_id=[])
    with torch.no_grad():
        assert torch.equal(model(ids, mask, decoder_input_ids=got[:, :-1]).argmax(-1), got[:, 1:])
    states, enc_mask = model.encode(ids, mask)
    front = 0 if method == "prefix" else 3  # prefix keys are not rows; prompt vectors stay in the output
    assert states.shape[1] == front + ids.shape[1] and bool(enc_mask[:, :front].all())


def test_linear_head_reads_transformers_last_hidden_state(ckpt):
    hf, path = ckpt["qwen2-untied"]
    model = load_model(path)
    attach(model, "linear-head", num_classes=3)
    fill(model, seed=7)
    for left in (False, True):
        ids, mask = batch(seed=12, left=left)
        kwargs = {"position_ids": positions_from(mask)} if left else {}
        at = last_token(mask)
        assert at.tolist() == ([11] * 3 if left else [11, 8, 4])
        with torch.no_grad():
            hidden = hf.model(input_ids=ids, attention_mask=mask, **kwargs).last_hidden_state  # after the final norm
            want = model.linear_head(hidden[torch.arange(3), at])
            got = classify(model, ids, mask)
        assert got.shape == (3, 3)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
