"""The capsule as a whole: counts, the fused pool-plus-add, training, saving and reloading.

Per-family behaviour (the inline capsule against a step-by-step reference, leakage, padding)
is in test_t5.py and test_llama.py; the fused kernel in test_fused.py.
"""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from capt import CaptError, CapsuleConfig, count_trainable, load_model, save_capsules, trainable_summary
from capt.methods import capsule_vectors

transformers = pytest.importorskip("transformers")

# The config.json fields that matter, as the published checkpoints have them.
PAPER_MODELS = {
    "t5-base": (
        {
            "model_type": "t5",
            "d_model": 768,
            "d_kv": 64,
            "d_ff": 3072,
            "num_layers": 12,
            "num_heads": 12,
            "vocab_size": 32128,
            "feed_forward_proj": "relu",
        },
        9216,
    ),
    "t5-large": (
        {
            "model_type": "t5",
            "d_model": 1024,
            "d_kv": 64,
            "d_ff": 4096,
            "num_layers": 24,
            "num_heads": 16,
            "vocab_size": 32128,
            "feed_forward_proj": "relu",
        },
        24576,
    ),
    "llama-3.2-1b": (
        {
            "model_type": "llama",
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "max_position_embeddings": 131072,
            "rope_theta": 500000.0,
            "tie_word_embeddings": True,
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192,
            },
        },
        32768,
    ),
    "qwen2.5-1.5b": (
        {
            "model_type": "qwen2",
            "hidden_size": 1536,
            "intermediate_size": 8960,
            "num_hidden_layers": 28,
            "num_attention_heads": 12,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "max_position_embeddings": 131072,
            "rope_theta": 1000000.0,
            "tie_word_embeddings": True,
        },
        43008,
    ),
}


@pytest.mark.parametrize("name", list(PAPER_MODELS))
def test_trainable_counts_of_the_paper(tmp_path, name):
    config, count = PAPER_MODELS[name]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert count_trainable(tmp_path) == count
    assert count_trainable(tmp_path, CapsuleConfig(integration="prepend")) == count  # same parameters, two slots
    layers = count // (config.get("d_model") or config["hidden_size"])
    width = count // layers
    assert count_trainable(tmp_path, CapsuleConfig(blocks="odd")) == (layers + 1) // 2 * width
    assert count_trainable(tmp_path, CapsuleConfig(blocks="first-half")) == layers // 2 * width
    assert count_trainable(tmp_path, CapsuleConfig(blocks="latter-half")) == (layers - layers // 2) * width
    assert count_trainable(tmp_path, CapsuleConfig(blocks=[0, 3])) == 2 * width
    heads = "num_heads" if "d_model" in config else "num_attention_heads"
    (tmp_path / "config.json").write_text(json.dumps({**config, heads: 0}))
    with pytest.raises(CaptError, match=rf"^{tmp_path / 'config.json'}: {heads} is 0, but it must be"):
        count_trainable(tmp_path)  # a value the checks refuse names the file it came from


def test_block_sets():
    assert CapsuleConfig(blocks="odd").layer_indices(5) == [0, 2, 4]
    assert CapsuleConfig(blocks="first-half").layer_indices(6) == [0, 1, 2]
    assert CapsuleConfig(blocks="latter-half").layer_indices(6) == [3, 4, 5]
    with pytest.raises(CaptError, match=r"capsule blocks \[7\] are outside the model's 6 blocks"):
        CapsuleConfig(blocks=[1, 7]).layer_indices(6)
    with pytest.raises(CaptError, match=r"capsule integration 'concat' is not one of add, prepend"):
        CapsuleConfig(integration="concat")
    with pytest.raises(CaptError, match=r"capsule blocks 'even' is not one of"):
        CapsuleConfig(blocks="even")


# --- capsules on a tiny model: training, saving, reloading ------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    root = tmp_path_factory.mktemp("tiny")
    for seed, name in [(0, "a"), (1, "b")]:  # same shapes, other weights
        torch.manual_seed(seed)
        hf = transformers.LlamaForCausalLM(config)
        with torch.no_grad():  # weights large enough that the slot visibly matters
            for key, p in hf.named_parameters():
                p.normal_(1.0, 0.1) if key.endswith("norm.weight") else p.normal_(0.0, 0.3)
        hf.save_pretrained(root / name)
    return root


def test_training_moves_only_the_capsules(tiny):
    model = load_model(tiny / "a", capsules=CapsuleConfig())
    before = {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("capsule")}
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == [
        f"model.layers.{i}.capsule" for i in range(3)
    ]
    assert "trainable params: 96 ||" in trainable_summary(model)
    torch.manual_seed(0)
    ids = torch.randint(0, 64, (8, 10))
    answer = torch.full((8, 1), 5)  # learn to answer token 5 after any nine tokens
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    prompt_mask = torch.ones_like(ids)
    prompt_mask[:, -1] = 0
    losses = []
    for _ in range(30):
        logits = model(ids, prompt_mask=prompt_mask, logits_at=torch.full((8, 1), 8))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 64), answer.reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    after = {k: v for k, v in model.state_dict().items() if not k.endswith("capsule")}
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_save_and_reload_give_identical_logits(tiny, tmp_path):
    model = load_model(tiny / "a", capsules=CapsuleConfig(blocks="odd", integration="prepend"))
    with torch.no_grad():
        for p in capsule_vectors(model).values():
            p.normal_()
    save_capsules(model, tmp_path / "caps")
    saved = load_file(tmp_path / "caps" / "capsules.safetensors")
    assert sorted(saved) == ["layers.0", "layers.2"] and all(
        t.dtype == torch.float32 and t.shape == (32,) for t in saved.values()
    )
    meta = json.loads((tmp_path / "caps" / "capsules.json").read_text())
    assert meta["capsule_config"] == {"integration": "prepend", "blocks": "odd", "init": "zeros"}
    assert meta["base_model"]["model_type"] == "llama" and meta["base_model"]["num_layers"] == 3
    again = load_model(tiny / "a", capsules=tmp_path / "caps")
    ids = torch.randint(0, 64, (2, 9))
    assert torch.equal(model(ids), again(ids))


def test_capsule_file_errors(tiny, tmp_path):
    model = load_model(tiny / "a", capsules=CapsuleConfig())
    caps = save_capsules(model, tmp_path / "caps")
    with pytest.raises(CaptError, match=r"were made for a different base model \(config_sha256"):
        load_model(_other_base(tiny, tmp_path), capsules=caps)
    state = load_file(caps / "capsules.safetensors")
    save_file({k: v for k, v in state.items() if k != "layers.1"}, caps / "capsules.safetensors")
    with pytest.raises(CaptError, match=r"missing \['layers\.1'\], extra none"):
        load_model(tiny / "a", capsules=caps)
    save_file(dict(state, **{"layers.7": torch.zeros(32)}), caps / "capsules.safetensors")
    with pytest.raises(CaptError, match=r"missing none, extra \['layers\.7'\]"):
        load_model(tiny / "a", capsules=caps)
    save_file(dict(state, **{"layers.1": torch.zeros(31)}), caps / "capsules.safetensors")
    with pytest.raises(CaptError, match=r"layers\.1 has shape \(31,\), expected \(32,\)"):
        load_model(tiny / "a", capsules=caps)
    with pytest.raises(CaptError, match=r"no capsules\.json in"):
        load_model(tiny / "a", capsules=tmp_path)


def _other_base(tiny, tmp_path):
    """A base model with the same shapes but another config.json (another rms_norm_eps)."""
    import shutil

    d = shutil.copytree(tiny / "b", tmp_path / "other")
    config = json.loads((d / "config.json").read_text())
    config["rms_norm_eps"] = 1e-5 if config.get("rms_norm_eps") != 1e-5 else 1e-6
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_save_without_capsules_is_an_error(tiny, tmp_path):
    with pytest.raises(CaptError, match=r"no capsules attached"):
        save_capsules(load_model(tiny / "a"), tmp_path)


def test_capsules_replace_another_method(tiny):
    from capt.methods import attach

    model = load_model(tiny / "a")
    attach(model, "prompt", n=3)
    attach(model, "capt", capsules=CapsuleConfig())
    assert model.front is None and model.method.method == "capt"
    ids = torch.randint(0, 64, (2, 6))
    assert model(ids).shape == (2, 6, 64)
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == [
        f"model.layers.{i}.capsule" for i in range(3)
    ]


def test_malformed_capsule_files_leave_the_model_alone(tiny, tmp_path):
    from capt.load import load_method

    caps = save_capsules(load_model(tiny / "a", capsules=CapsuleConfig()), tmp_path / "caps")
    meta = json.loads((caps / "capsules.json").read_text())
    (caps / "capsules.json").write_text(json.dumps(dict(meta, capsule_config="add")))
    with pytest.raises(CaptError, match=r"capsules\.json: the capsule settings are .add., not a JSON object"):
        load_model(tiny / "a", capsules=caps)
    (caps / "capsules.json").write_text(json.dumps(meta))
    state = load_file(caps / "capsules.safetensors")
    save_file(dict(state, **{"layers.2": torch.zeros(5)}), caps / "capsules.safetensors")
    model = load_model(tiny / "a")
    with pytest.raises(CaptError, match=r"layers\.2 has shape \(5,\), expected \(32,\)"):
        load_method(model, caps)
    assert model.method is None and all(b.capsule is None for b in model.capsule_blocks())


def test_count_trainable_of_a_baseline(tmp_path):
    config, _ = PAPER_MODELS["llama-3.2-1b"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert count_trainable(tmp_path, method="prompt", n=20) == 20 * 2048
    assert count_trainable(tmp_path, method="deep-prompt", n=1) == 16 * 2048
    # layers x (k, v) x kv heads x n x head_dim
    assert count_trainable(tmp_path, method="prefix", n=10) == 16 * 2 * 8 * 10 * 64
    assert count_trainable(tmp_path, method="linear-head", num_classes=3) == 3 * 2048 + 3
