"""capt.hf: capsules trained with capt, used on transformers' own models. The logits of a padded batch equal
capt's (fp32, 1e-5), greedy generate gives capt's tokens, remove() gives the plain model back, and every
misfit is one line. Tiny random Llama, Qwen2 and T5 checkpoints; the real SmolLM2 where it is built."""

import inspect
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers", reason="capt.hf needs transformers (pip install 'capt[hf]')")
from helpers import tiny_llama, tiny_qwen2, tiny_t5  # noqa: E402
from transformers import AutoModelForCausalLM, T5ForConditionalGeneration  # noqa: E402

from capt import CapsuleConfig, load_model  # noqa: E402
from capt import packed  # noqa: E402
from capt.errors import CaptError, CaptWarning  # noqa: E402
from capt.hf import attach_capsules  # noqa: E402
from capt.load import save_capsules  # noqa: E402
from capt.methods import attach, capsule_vectors  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SMOLLM2 = REPO / "weights" / "smollm2-135m-instruct"


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {
        "llama": tiny_llama(root / "llama", layers=3),
        "qwen2": tiny_qwen2(root / "qwen2"),
        "t5": tiny_t5(root / "t5"),
    }


def with_capsules(path: Path, blocks="all", seed: int = 0, scale: float = 0.5):
    """capt's model with random capsules (the slot moves every output), and the directory they are saved in."""
    model = load_model(path)
    attach(model, "capt", capsules=CapsuleConfig(blocks=blocks))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in capsule_vectors(model).values():
            p.copy_(torch.randn(p.shape, generator=g) * scale)
    out = path.parent / f"{path.name}-capsules-{blocks}"
    save_capsules(model, out)
    return model, out


def hf_model(path: Path):
    cls = T5ForConditionalGeneration if (path / "spiece.model").is_file() else AutoModelForCausalLM
    return cls.from_pretrained(path, dtype=torch.float32).eval()


def padded(vocab: int, lengths=(11, 7, 4), left=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    T = max(lengths)
    ids = torch.randint(4, vocab, (len(lengths), T), generator=g)
    mask = torch.zeros(len(lengths), T, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, T - n:] = 1 if left else 0
        mask[b, :n] = mask[b, :n] if left else 1
    return ids.masked_fill(mask == 0, 0), mask


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("blocks", ["all", "odd"])
@pytest.mark.parametrize("left", [True, False])
def test_decoder_logits_equal_capts(dirs, family, blocks, left):
    capt_model, saved = with_capsules(dirs[family], blocks)
    hf = hf_model(dirs[family])
    ids, mask = padded(hf.config.vocab_size, left=left)
    with torch.no_grad():
        plain = hf(ids, attention_mask=mask).logits
        handle = attach_capsules(hf, saved)
        theirs = hf(ids, attention_mask=mask).logits
        mine = capt_model(ids, attention_mask=mask)
    real = mask.bool()
    torch.testing.assert_close(theirs[real], mine[real], atol=1e-5, rtol=0)
    assert (theirs[real] - plain[real]).abs().max() > 1e-2  # the capsules change the outputs: the comparison can tell
    handle.remove()
    with torch.no_grad():
        torch.testing.assert_close(hf(ids, attention_mask=mask).logits, plain, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_greedy_generate_gives_capts_tokens(dirs, family):
    capt_model, saved = with_capsules(dirs[family])
    hf = hf_model(dirs[family])
    attach_capsules(hf, saved)
    ids, mask = padded(hf.config.vocab_size, left=True, seed=1)
    eos = hf.config.eos_token_id
    with torch.no_grad():
        theirs = hf.generate(
            ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=eos
        )
        mine = capt_model.generate(ids, attention_mask=mask, max_new_tokens=12, eos_token_id=eos)
    assert theirs[:, ids.shape[1]:].tolist() == mine[:, ids.shape[1]:].tolist()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_answers_after_a_cached_prompt_score_as_in_capt(dirs, family):
    """Rank classification's way: the prompt into the cache, then the answer tokens in one call; the capsule
    summarises the prompt only, and prompt_mask does the same in one teacher-forced pass."""
    capt_model, saved = with_capsules(dirs[family])
    hf = hf_model(dirs[family])
    attach_capsules(hf, saved)
    ids, mask = padded(hf.config.vocab_size, left=True, seed=2)
    answer = torch.randint(4, hf.config.vocab_size, (3, 3), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        cache = capt_model.new_cache(3, 1 + ids.shape[1] + 3)
        capt_model(ids, attention_mask=mask, cache=cache)
        mine = capt_model(answer, attention_mask=torch.ones_like(answer), cache=cache)
        out = hf(ids, attention_mask=mask, use_cache=True)
        full = torch.cat([mask, torch.ones_like(answer)], dim=1)
        # the cache under the name this release's forward takes: `cache` on the newest, where `past_key_values`
        # is deprecated (to go in 5.40), `past_key_values` on the older ones
        name = "cache" if "cache" in inspect.signature(hf.forward).parameters else "past_key_values"
        theirs = hf(answer, attention_mask=full, use_cache=True, **{name: out.past_key_values}).logits
        torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=0)
        both = torch.cat([ids, answer], dim=1)
        once = hf(both, attention_mask=full, prompt_mask=torch.cat([mask, torch.zeros_like(answer)], dim=1)).logits[
            :, -3:
        ]
        torch.testing.assert_close(once, mine, atol=1e-5, rtol=0)


@pytest.mark.parametrize("blocks", ["all", "latter-half"])
@pytest.mark.parametrize("left", [False, True])
def test_t5_logits_and_generate_equal_capts(dirs, blocks, left):
    capt_model, saved = with_capsules(dirs["t5"], blocks)
    hf = hf_model(dirs["t5"])
    ids, mask = padded(hf.config.vocab_size, left=left, seed=3)
    dec = torch.randint(3, hf.config.vocab_size, (3, 5), generator=torch.Generator().manual_seed(4))
    dec[:, 0] = hf.config.decoder_start_token_id
    with torch.no_grad():
        plain = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        handle = attach_capsules(hf, saved)
        theirs = hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits
        mine = capt_model(ids, attention_mask=mask, decoder_input_ids=dec)
        torch.testing.assert_close(theirs, mine, atol=1e-5, rtol=0)
        assert (theirs - plain).abs().max() > 1e-2
        generated = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert generated.tolist() == capt_model.generate(ids, attention_mask=mask, max_new_tokens=6).tolist()
        handle.remove()
        torch.testing.assert_close(
            hf(input_ids=ids, attention_mask=mask, decoder_input_ids=dec).logits, plain, atol=0, rtol=0
        )


def test_in_memory_capsules_and_run_directories(dirs, tmp_path):
    capt_model, saved = with_capsules(dirs["llama"])
    hf = hf_model(dirs["llama"])
    ids, mask = padded(hf.config.vocab_size)
    with torch.no_grad():
        expected = capt_model(ids, attention_mask=mask)
    run = tmp_path / "run"
    (run / "best").mkdir(parents=True)
    for f in saved.iterdir():
        (run / "best" / f.name).write_bytes(f.read_bytes())
    for source in (capt_model, capsule_vectors(capt_model), run):
        handle = attach_capsules(hf, source)
        with torch.no_grad():
            torch.testing.assert_close(
                hf(ids, attention_mask=mask).logits[mask.bool()], expected[mask.bool()], atol=1e-5, rtol=0
            )
        handle.remove()


def test_in_memory_capsules_train_on_the_transformers_model(dirs):
    """The tensors are used, not copied: a gradient reaches them through transformers' forward."""
    capt_model, _ = with_capsules(dirs["llama"])
    hf = hf_model(dirs["llama"]).requires_grad_(False)
    vectors = {i: p.detach().clone().requires_grad_() for i, p in capsule_vectors(capt_model).items()}
    attach_capsules(hf, vectors)
    ids, mask = padded(hf.config.vocab_size)
    hf(ids, attention_mask=mask).logits.float().logsumexp(-1).sum().backward()
    assert all(v.grad is not None and v.grad.abs().sum() > 0 for v in vectors.values())


def test_misfits_are_one_line(dirs, tmp_path):
    _, llama_caps = with_capsules(dirs["llama"])
    _, t5_caps = with_capsules(dirs["t5"])
    hf = hf_model(dirs["llama"])
    cases = [
        (lambda: attach_capsules(hf, t5_caps), "were made for a t5 model, not this llama one"),
        (
            lambda: attach_capsules(hf_model(dirs["qwen2"]), llama_caps),
            "were made for a llama model, not this qwen2 one",
        ),
        (lambda: attach_capsules(hf, {0: torch.zeros(7)}), "do not fit this model (3 blocks of width 32)"),
        (lambda: attach_capsules(hf, {9: torch.zeros(32)}), "do not fit this model"),
        (lambda: attach_capsules(hf, tmp_path), "no capsules.json in"),
        (lambda: attach_capsules(hf, 123), "capsules: give a directory"),
        (lambda: attach_capsules(torch.nn.Linear(2, 2), llama_caps), "capsules go on LlamaForCausalLM"),
        (lambda: attach_capsules(hf, {0: torch.full((32,), float("nan"))}), "hold NaN or infinite values"),
    ]
    for call, words in cases:
        with pytest.raises(CaptError, match=None) as e:
            call()
        assert words in str(e.value) and "\n" not in str(e.value), str(e.value)
    handle = attach_capsules(hf, llama_caps)
    with pytest.raises(CaptError, match="already carries capsules: call remove"):
        attach_capsules(hf, llama_caps)
    handle.remove()
    # prepend capsules, and capsules of another base with the same shapes
    model = load_model(dirs["llama"])
    attach(model, "capt", capsules=CapsuleConfig(integration="prepend"))
    save_capsules(model, tmp_path / "prepend")
    with pytest.raises(CaptError, match="serves the add integration only, not prepend"):
        attach_capsules(hf, tmp_path / "prepend")
    other = tiny_llama(tmp_path / "other", seed=1, layers=3)
    meta = json.loads((llama_caps / "capsules.json").read_text())
    meta["base_model"]["config_sha256"] = "0" * 64
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "capsules.json").write_text(json.dumps(meta))
    (tmp_path / "elsewhere" / "capsules.safetensors").write_bytes((llama_caps / "capsules.safetensors").read_bytes())
    with pytest.raises(CaptError, match="were trained on another base model .* pass any_base=True"):
        attach_capsules(hf_model(other), tmp_path / "elsewhere")
    attach_capsules(hf_model(other), tmp_path / "elsewhere", any_base=True).remove()
    # the same config.json bytes with other weights: the weights' fingerprint tells them apart
    halved = tmp_path / "halved"
    halved.mkdir()
    (halved / "config.json").write_bytes((dirs["llama"] / "config.json").read_bytes())
    tensors = {k: v / 2 for k, v in load_file(dirs["llama"] / "model.safetensors").items()}
    save_file(tensors, halved / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CaptError, match="weights_sha256"):
        attach_capsules(hf_model(halved), llama_caps)
    # weights that cannot be fingerprinted (here: saved as pytorch_model.bin) are said, not skipped in silence
    binary = tmp_path / "binary"
    binary.mkdir()
    (binary / "config.json").write_bytes((dirs["llama"] / "config.json").read_bytes())
    torch.save(load_file(dirs["llama"] / "model.safetensors"), binary / "pytorch_model.bin")
    with pytest.warns(CaptWarning, match="weights were not fingerprinted .*matched to it by config.json alone"):
        attach_capsules(hf_model(binary), llama_caps).remove()


@pytest.mark.skipif(
    not (SMOLLM2 / "config.json").is_file(), reason="needs weights/smollm2-135m-instruct (make weights)"
)
def test_smollm2_logits_and_greedy_tokens_equal_capts(tmp_path, monkeypatch):
    capt_model, saved = with_capsules(SMOLLM2, scale=0.02)  # a real model's embeddings are small: small capsules
    hf = hf_model(SMOLLM2)
    attach_capsules(hf, saved)
    from capt import load_tokenizer
    tok = load_tokenizer(SMOLLM2)
    rows = [tok.encode(t) for t in ("cb hypothesis: it rained premise: The match was called off. answer:", "The "
                                                                                                           "capital of "
                                                                                                           "France is")]
    width = max(map(len, rows))
    ids = torch.tensor([[0] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    # capt's CPU default runs larger products on oneDNN's packed weights (capt.packed.PackedLinear), here all of
    # them: another summation order, whose rounding the first token's massive activations carry to the logits
    monkeypatch.setattr(packed, "PACK_MIN_ROWS", 1)
    with torch.no_grad():
        theirs, mine = hf(ids, attention_mask=mask).logits, capt_model(ids, attention_mask=mask)
        torch.testing.assert_close(theirs[mask.bool()], mine[mask.bool()], atol=2e-3, rtol=0)
        a = hf.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
        b = capt_model.generate(ids, attention_mask=mask, max_new_tokens=8)
        assert a[:, width:].tolist() == b[:, width:].tolist()
        monkeypatch.setattr(packed, "PACK_ON_CPU", False)  # the same products as transformers: the same numbers
        mine = capt_model(ids, attention_mask=mask)
        torch.testing.assert_close(theirs[mask.bool()], mine[mask.bool()], atol=1e-5, rtol=0)


# ---------------------------------------------------------------------------------------------
# transformers' own features on a model carrying capsules: right, or refused in one line


def trainable_capsules(capt_model):
    return {i: p.detach().clone().requires_grad_() for i, p in capsule_vectors(capt_model).items()}


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_gives_the_plain_gradients(dirs, reentrant):
    capt_model, _ = with_capsules(dirs["llama"])
    ids, mask = padded(capt_model.config.vocab_size, left=False)
    grads = {}
    for checkpointing in (False, True):
        hf = hf_model(dirs["llama"])
        vectors = trainable_capsules(capt_model)
        attach_capsules(hf, vectors)
        if checkpointing:
            if hasattr(hf, "activation_checkpointing_enable"):  # the newest releases' name; the old one is deprecated
                hf.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
            else:
                hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
            hf.train()  # transformers checkpoints the blocks in training mode only
        logits = hf(ids, attention_mask=mask).logits
        logits[mask.bool()].logsumexp(-1).sum().backward()
        grads[checkpointing] = {i: v.grad for i, v in vectors.items()}
    assert all(g is not None and g.abs().sum() > 0 for g in grads[True].values())
    for i in grads[False]:
        torch.testing.assert_close(grads[True][i], grads[False][i], atol=1e-5, rtol=1e-5)


def test_hidden_states_hold_the_tokens_rows(dirs):
    capt_model, saved = with_capsules(dirs["llama"])
    hf = hf_model(dirs["llama"])
    attach_capsules(hf, saved)
    ids, mask = padded(hf.config.vocab_size, left=False)
    with torch.no_grad():
        out = hf(ids, attention_mask=mask, output_hidden_states=True)
        mine = capt_model.features(ids, attention_mask=mask)
    assert len(out.hidden_states) == hf.config.num_hidden_layers + 1
    assert all(h.shape[1] == ids.shape[1] for h in out.hidden_states)  # the slot's row is not among them
    torch.testing.assert_close(out.hidden_states[-1][mask.bool()], mine[mask.bool()], atol=1e-5, rtol=0)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_a_model_with_capsules_compiles_as_one_graph(dirs, family):
    """The bench's hf-best anchor compiles the whole step: capt.hf's hooks and stack forward must not break the graph.
    (On torch 2.11 a dict.update in the stack forward broke it and the frame resumed after it recompiled at every
    step; the torch here traces dict.update, so this guards the whole path, not that one call.)"""
    _, saved = with_capsules(dirs[family])
    hf = hf_model(dirs[family])
    attach_capsules(hf, saved)
    ids, mask = padded(hf.config.vocab_size, left=family == "llama")
    if family == "t5":
        def step(ids, mask):
            return hf(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :3]).logits.sum()
    else:
        def step(ids, mask):
            return hf(ids, attention_mask=mask, prompt_mask=mask.bool(), logits_to_keep=3).logits.sum()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(step)(ids, mask)
    torch._dynamo.reset()
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_what_capt_hf_refuses(dirs):
    import copy

    _, saved = with_capsules(dirs["llama"])
    hf = hf_model(dirs["llama"])
    handle = attach_capsules(hf, saved)
    ids, mask = padded(hf.config.vocab_size)
    with pytest.raises(CaptError, match=r"^capt.hf: generate\(use_cache=False\) is not supported"):
        hf.generate(ids, attention_mask=mask, max_new_tokens=2, use_cache=False, pad_token_id=0)
    first = hf.generate(ids, attention_mask=mask, max_new_tokens=2, return_dict_in_generate=True, pad_token_id=0)
    more = torch.cat([mask, torch.ones(mask.shape[0], 2, dtype=mask.dtype)], dim=1)
    with pytest.raises(
        CaptError, match=r"^capt.hf: generate from a cache that already holds a sequence is not supported"
    ):
        hf.generate(first.sequences, attention_mask=more, past_key_values=first.past_key_values, max_new_tokens=2,
                    pad_token_id=0)
    with pytest.raises(CaptError, match=r"^a model carrying capsules \(capt.hf\) cannot be copied"):
        copy.deepcopy(hf)
    handle.remove()
    assert copy.deepcopy(hf) is not hf  # the plain model copies
