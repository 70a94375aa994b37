"""Loading: strictness, dtypes, and one clear error for each kind of bad checkpoint."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from capt import CaptError, load_model

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # non-trivial weights: the default init gives near-zero logits that any dtype matches
        for key, p in hf.named_parameters():
            p.normal_(1.0, 0.3) if key.endswith("norm.weight") else p.normal_(0.0, 0.3)
    root = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(root / "single")
    hf.save_pretrained(root / "sharded", max_shard_size="20KB")
    return root


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_loads_fp32_and_bf16(llama_dir):
    fp32 = load_model(llama_dir / "single")
    bf16 = load_model(llama_dir / "sharded", dtype="bf16")
    assert all(p.dtype == torch.float32 for p in fp32.parameters())
    assert all(p.dtype == torch.bfloat16 for p in bf16.parameters())
    assert not any(p.requires_grad for p in fp32.parameters())
    ids = torch.randint(0, 96, (4, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = fp32(ids), bf16(ids)
    assert got.dtype == torch.bfloat16 and want.std() > 1.0  # logits of a real spread, not near zero
    relative = ((got.float() - want).norm() / want.norm()).item()
    assert 0 < relative < 0.05  # bf16 rounding (about 2% here); a wrong weight or cast costs far more
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9


def test_missing_config(tmp_path):
    with pytest.raises(CaptError, match=r"no config\.json in"):
        load_model(tmp_path)
    with pytest.raises(CaptError, match=r"model directory not found"):
        load_model(tmp_path / "nowhere")


def test_unsupported_model_type(tmp_path, llama_dir):
    d = copy(llama_dir / "single", tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, model_type="gpt2")))
    with pytest.raises(CaptError, match=r"model_type 'gpt2' is not supported; supported: llama, qwen2, t5"):
        load_model(d)


def test_truncated_and_corrupt_safetensors(tmp_path, llama_dir):
    d = copy(llama_dir / "single", tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CaptError, match=r"model\.safetensors is corrupt or truncated"):
        load_model(d)
    (d / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CaptError, match=r"model\.safetensors is corrupt or truncated"):
        load_model(d)


def test_missing_shard(tmp_path, llama_dir):
    d = copy(llama_dir / "sharded", tmp_path / "m")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    victim = sorted(set(index["weight_map"].values()))[1]
    (d / victim).unlink()
    with pytest.raises(CaptError, match=rf"missing shard {victim}"):
        load_model(d)


def test_shape_that_does_not_match_config(tmp_path, llama_dir):
    d = copy(llama_dir / "single", tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, intermediate_size=64)))
    with pytest.raises(
        CaptError, match=r"tensor model\.layers\.\d\.mlp\.\w+_proj\.weight has shape \(\d+, \d+\), but the config gives"
    ):
        load_model(d)


def test_unknown_and_missing_tensors(tmp_path, llama_dir):
    d = copy(llama_dir / "single", tmp_path / "m")
    state = load_file(d / "model.safetensors")
    save_file(dict(state, **{"model.layers.0.self_attn.rotary.weight": torch.zeros(3)}), d / "model.safetensors")
    with pytest.raises(
        CaptError, match=r"checkpoint tensor model\.layers\.0\.self_attn\.rotary\.weight is not part of a llama model"
    ):
        load_model(d)
    del state["model.norm.weight"]
    save_file(state, d / "model.safetensors")
    with pytest.raises(CaptError, match=r"lacks tensor model\.norm\.weight"):
        load_model(d)


def test_tied_copy_must_equal_its_matrix(tmp_path, llama_dir):
    d = copy(llama_dir / "single", tmp_path / "m")
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(dict(config, tie_word_embeddings=True)))
    with pytest.raises(
        CaptError,
        match=r"ties lm_head\.weight to model\.embed_tokens\.weight, but the checkpoint holds different values",
    ):
        load_model(d)
    state = load_file(d / "model.safetensors")
    state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    save_file(state, d / "model.safetensors")
    model = load_model(d)  # an equal copy is fine: the model keeps one matrix
    assert "lm_head.weight" not in model.state_dict()


def test_bad_dtype(llama_dir):
    with pytest.raises(CaptError, match=r"dtype 'fp8' is not one of"):
        load_model(llama_dir / "single", dtype="fp8")
