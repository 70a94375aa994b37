"""The per-block step scale (capt/stepscale.py) and the answer cue: the scales are the sizes of each block's
mean-pooled input as transformers computes its hidden states, a step-scaled Adam is Adam on p = c q, the
trainer records and reuses the scales, and the input format travels with the trained tensors."""

import json

import pytest
import torch
from helpers import tiny_llama, tiny_qwen2, write_superglue
from transformers import LlamaForCausalLM, Qwen2ForCausalLM, T5ForConditionalGeneration

from capt import load_model, load_tokenizer

from capt import packed
from capt.batches import batch_nll
from capt.errors import CaptError
from capt.evaluate import encode_examples, evaluate
from capt.methods import attach, method_parameters, method_tensors
from capt.stepscale import block_input_rms, block_of, key_value_rms, param_groups
from capt.tasks import ANSWER_CUE, get_task, load_task, render
from capt.trainer import Interrupted, TrainConfig, Trainer, train


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_superglue(tmp_path_factory.mktemp("data"), {"CB": (48, 12), "COPA": (40, 10)})


def prompts_of(path, data, n=10, task="cb"):
    return encode_examples(
        load_task(task, data, "train")[:n], load_tokenizer(path), load_model(path).seq2seq, 64
    ).prompts


def hf_rms(hidden: list[torch.Tensor], mask: torch.Tensor) -> list[float]:
    """The RMS of each block input's mean over the real tokens, written from transformers' hidden states."""
    m = mask.double()[..., None]  # (B, T, 1)
    return [((h.double() * m).sum(1) / m.sum(1)).pow(2).mean().sqrt().item() for h in hidden]


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_scales_are_the_rms_of_each_block_inputs_mean(ckpts, data, family):
    path = ckpts[family]
    prompts = prompts_of(path, data)
    batches = [prompts[:4], prompts[4:]]  # unequal lengths: padding inside each batch
    mine = block_input_rms(load_model(path), batches)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    with torch.no_grad():
        if family == "llama":
            hidden = (
                LlamaForCausalLM.from_pretrained(path)
                .eval()(ids, attention_mask=mask, output_hidden_states=True)
                .hidden_states
            )
        else:
            encoder = T5ForConditionalGeneration.from_pretrained(path).eval().encoder
            hidden = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    # hidden_states[l] enters block l (the last one is after the final norm: not a block input)
    assert mine == pytest.approx(hf_rms(list(hidden[:-1]), mask), rel=1e-5)
    assert len(mine) == len(hidden) - 1 and len(set(round(c, 6) for c in mine)) == len(mine)  # one scale a block


@pytest.mark.parametrize("family", ["llama", "qwen2", "t5"])
def test_prefix_scales_are_the_rms_of_each_layers_keys_and_values(ckpts, data, family, tmp_path):
    """Written from transformers' own projections (forward hooks on each layer's key and value
    projections, keys before rotation), over the real tokens only."""
    path = tiny_qwen2(tmp_path / "qwen2", vocab_size=360, max_positions=256) if family == "qwen2" else ckpts[family]
    prompts = prompts_of(ckpts["t5" if family == "t5" else "llama"], data)
    batches = [prompts[:4], prompts[4:]]
    mine = key_value_rms(load_model(path), batches)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    if family == "t5":
        hf = T5ForConditionalGeneration.from_pretrained(path).eval()
        projections = [(b.layer[0].SelfAttention.k, b.layer[0].SelfAttention.v) for b in hf.encoder.block]
        run = lambda: hf.encoder(input_ids=ids, attention_mask=mask)  # noqa: E731
    else:
        hf = (Qwen2ForCausalLM if family == "qwen2" else LlamaForCausalLM).from_pretrained(path).eval()
        projections = [(layer.self_attn.k_proj, layer.self_attn.v_proj) for layer in hf.model.layers]
        run = lambda: hf(ids, attention_mask=mask)  # noqa: E731
    seen = {}
    hooks = [module.register_forward_hook(lambda m, args, out, key=(i, j): seen.__setitem__(key, out.double()))
             for i, pair in enumerate(projections) for j, module in enumerate(pair)]
    with torch.no_grad():
        run()
    for hook in hooks:
        hook.remove()
    real = mask.bool()
    expected = [[seen[i, j][real].pow(2).mean().sqrt().item() for j in (0, 1)] for i in range(len(projections))]
    assert mine == [pytest.approx(pair, rel=1e-5) for pair in expected]
    assert len(mine) == len(projections) and all(k != pytest.approx(v, rel=1e-3) for k, v in mine)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_scales_are_measured_on_trainings_products(ckpts, data, family, monkeypatch):
    """On the packed weights where training runs on them (capt.packed.PackedLinear); without packing, the same to
    rounding."""
    path = ckpts[family]
    batches = [prompts_of(path, data, 48)]  # 48 prompts: products of more than PACK_MIN_ROWS rows
    monkeypatch.setattr(packed, "PACK_MIN_ROWS", 1)
    model = load_model(path)
    on = block_input_rms(model, batches)
    assert any(m in packed._PACKED for m in model.modules()) == packed._ONEDNN
    monkeypatch.setattr(packed, "PACK_ON_CPU", False)
    assert block_input_rms(model, batches) == pytest.approx(on, rel=1e-5)


def test_a_zero_scale_is_refused_by_name(ckpts, data):
    model = load_model(ckpts["llama"])
    with torch.no_grad():
        model.model.layers[1].self_attn.v_proj.weight.zero_()  # layer 1's values are all zero
    with pytest.raises(CaptError, match=r"the step scale of layer 1's values is 0.0: .*train with --step-scale none"):
        key_value_rms(model, [prompts_of(ckpts["llama"], data, 2)])
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()  # block 0's input is all zero
    with pytest.raises(CaptError, match=r"the step scale of block 0 is 0.0: "):
        block_input_rms(model, [prompts_of(ckpts["llama"], data, 2)])


def test_scales_need_the_plain_model(ckpts, data):
    model = load_model(ckpts["llama"])
    attach(model, "capt")
    with pytest.raises(CaptError, match="measured on the plain model"):
        block_input_rms(model, [prompts_of(ckpts["llama"], data, 2)])


def test_a_step_scaled_adam_is_adam_on_p_equal_c_q(ckpts, data):
    """Three AdamW steps with block l's rate r c_l give the same capsules as AdamW at rate r on q_l with
    p_l = c_l q_l (the gradient of q_l is c_l times p_l's), up to Adam's eps."""
    path, r = ckpts["llama"], 0.05
    examples = load_task("cb", data, "train")[:8]
    model, tokenizer = load_model(path), load_tokenizer(path)
    encoded = encode_examples(examples, tokenizer, False, 64)
    scales = [0.3, 7.0]  # far apart, as in a real model
    attach(model, "capt")
    tensors = method_parameters(model)  # each block's (1, d) table: what the optimizer steps
    scaled = torch.optim.AdamW(param_groups(tensors, r, scales), lr=r, weight_decay=0.0)
    q = {name: torch.zeros_like(t, requires_grad=True) for name, t in tensors.items()}
    plain = torch.optim.AdamW(list(q.values()), lr=r, weight_decay=0.0)
    start = {name: t.detach().clone() for name, t in tensors.items()}
    paths = {}
    for which, optimizer in (("scaled", scaled), ("q", plain)):
        with torch.no_grad():
            for name, t in tensors.items():
                t.copy_(start[name])
        for _ in range(3):
            loss = batch_nll(model, encoded, list(range(8))).mean()
            loss.backward()
            if which == "q":
                for name, t in tensors.items():
                    q[name].grad = scales[block_of(name)] * t.grad
                    t.grad = None
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if which == "q":
                with torch.no_grad():
                    for name, t in tensors.items():
                        t.copy_(scales[block_of(name)] * q[name])
        paths[which] = {name: t.detach().clone() for name, t in tensors.items()}
    for name in tensors:
        assert paths["scaled"][name].abs().max() > 0.01  # they moved
        torch.testing.assert_close(paths["scaled"][name], paths["q"][name], rtol=1e-4, atol=1e-6)
    # and the two blocks moved by about r times their own scale per step, not by the same amount
    moved = [paths["scaled"][f"layers.{i}"].abs().mean().item() / scales[i] for i in range(2)]
    assert moved[0] == pytest.approx(moved[1], rel=0.5) and moved[0] == pytest.approx(3 * r, rel=0.5)


def test_block_of_names_the_block_or_refuses():
    assert block_of("layers.3") == 3 and block_of("layers.12.deep_prompt") == 12
    with pytest.raises(CaptError, match="prompt is not a per-block tensor"):
        block_of("prompt")
    with pytest.raises(CaptError, match="layers.1x is not a per-block tensor"):
        block_of("layers.1x")


@pytest.mark.parametrize("method", ["capt", "deep-prompt"])
def test_the_trainer_measures_records_and_reuses_the_scales(ckpts, data, tmp_path, method):
    path = ckpts["llama"]
    run = tmp_path / "run"
    config = TrainConfig(
        model=str(path),
        task="cb",
        out=str(run),
        data=str(data),
        epochs=2,
        batch_size=8,
        max_length=64,
        device="cpu",
        method=method,
        lr=0.1,
        max_steps=4,
    )
    with pytest.raises(Interrupted):  # stopped after 2 steps: the state and config.json are written
        train(config, progress=False, stop_after=2)
    saved = json.loads((run / "config.json").read_text())
    assert saved["step_scale"] == "rms" and saved["answer_cue"] is True
    # the first 4 batches of the seed's first epoch, measured on the plain model
    trainer = Trainer(TrainConfig(**{**config.to_dict(), "out": str(tmp_path / "again")}), progress=False)
    firsts = [idx for group in trainer._plan(0) for idx in group][:4]
    trainer.close()
    expected = block_input_rms(load_model(path), [[trainer.train_data.prompts[i] for i in idx] for idx in firsts])
    assert saved["step_scales"] == pytest.approx(expected, rel=1e-6)
    assert [g["initial_lr"] for g in trainer.optimizer.param_groups] == pytest.approx([0.1 * c for c in expected])
    whole = train(TrainConfig(**{**config.to_dict(), "out": str(tmp_path / "whole")}), progress=False)
    # lr taken from the run
    resumed = train(TrainConfig(**{**config.to_dict(), "lr": None}), resume=True, progress=False)
    assert resumed["metrics"] == whole["metrics"] and resumed["loss"] == whole["loss"]


def test_prefix_under_the_step_scale_starts_and_steps_at_each_layers_key_and_value_size(ckpts, data, tmp_path):
    """p = c q for prefix tuning: the keys and values start at the plain form's N(0, 1) draw times
    their layer's key or value scale, and step at r times it; resume is exact."""
    path = ckpts["llama"]
    run = tmp_path / "run"
    config = TrainConfig(
        model=str(path),
        task="cb",
        out=str(run),
        data=str(data),
        epochs=2,
        batch_size=8,
        max_length=64,
        device="cpu",
        method="prefix",
        n=3,
        step_scale="rms",
        lr=0.02,
        max_steps=4,
    )
    trainer = Trainer(TrainConfig(**{**config.to_dict(), "out": str(tmp_path / "look")}), progress=False)
    firsts = [idx for group in trainer._plan(0) for idx in group][:4]
    expected = key_value_rms(load_model(path), [[trainer.train_data.prompts[i] for i in idx] for idx in firsts])
    assert trainer.scales == [pytest.approx(pair, rel=1e-6) for pair in expected]
    plain = load_model(path)
    attach(plain, config.method_config, generator=torch.Generator().manual_seed(config.seed))
    tensors, draws = method_tensors(trainer.model), method_tensors(plain)
    assert list(tensors) == ["layers.0.prefix_k", "layers.0.prefix_v", "layers.1.prefix_k", "layers.1.prefix_v"]
    for name, t in tensors.items():
        c = trainer.scales[block_of(name)][name.endswith("prefix_v")]
        torch.testing.assert_close(t.detach(), c * draws[name].detach(), rtol=1e-6, atol=0)
        assert draws[name].std().item() == pytest.approx(1, abs=0.5)
    rates = [g["initial_lr"] for g in trainer.optimizer.param_groups]
    assert rates == pytest.approx([0.02 * c for pair in trainer.scales for c in pair])
    trainer.close()
    with pytest.raises(Interrupted):
        train(config, progress=False, stop_after=2)
    saved = json.loads((run / "config.json").read_text())
    assert saved["step_scale"] == "rms" and saved["step_scales"] == [pytest.approx(pair, rel=1e-6) for pair in expected]
    whole = train(TrainConfig(**{**config.to_dict(), "out": str(tmp_path / "whole")}), progress=False)
    resumed = train(TrainConfig(**{**config.to_dict(), "lr": None}), resume=True, progress=False)
    assert resumed["metrics"] == whole["metrics"] and resumed["loss"] == whole["loss"]
    saved["step_scales"] = [pair[0] for pair in saved["step_scales"]]  # numbers where a prefix needs pairs
    (run / "config.json").write_text(json.dumps(saved))
    with pytest.raises(
        CaptError, match=r"step_scales is \[.*\], not a list of pairs of positive numbers \(key, value\)"
    ):
        train(config, resume=True, progress=False)


def test_capt_run_trains_a_t5_prefix_under_the_step_scale(ckpts, data, tmp_path, capsys):
    """The command line end to end on T5 (prefixes on the encoder's self-attention only): a pair of
    scales per encoder block, recorded and named in the results."""
    from helpers import capt
    out = tmp_path / "out"
    code, _, err = capt(
        "run",
        "--model",
        ckpts["t5"],
        "--tasks",
        "cb",
        "--data",
        data,
        "--method",
        "prefix",
        "--n",
        "2",
        "--step-scale",
        "rms",
        "--lr",
        "0.02",
        "--max-steps",
        "2",
        "--batch-size",
        "8",
        "--device",
        "cpu",
        "--out",
        out,
        capsys=capsys,
    )
    assert code == 0, err
    config = json.loads(next(out.glob("**/config.json")).read_text())
    blocks = len(load_model(ckpts["t5"]).capsule_blocks())
    assert config["step_scale"] == "rms" and len(config["step_scales"]) == blocks
    assert all(len(pair) == 2 and min(pair) > 0 for pair in config["step_scales"])
    assert "step scale rms, r 0.02" in (out / "results.md").read_text()


def test_step_scale_none_trains_with_one_rate(ckpts, data, tmp_path):
    run = tmp_path / "run"
    train(TrainConfig(model=str(ckpts["llama"]), task="cb", out=str(run), data=str(data), epochs=1, batch_size=8,
                      device="cpu", step_scale="none", max_steps=1), progress=False)
    saved = json.loads((run / "config.json").read_text())
    assert saved["lr"] == 0.3 and saved["step_scale"] == "none" and saved["step_scales"] is None


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(method="prompt", step_scale="rms"), "for capt, deep-prompt and prefix, not prompt"),
        (dict(step_scale="adam"), "step_scale 'adam' is not one of rms, none"),
        (dict(answer_cue="yes"), r"answer_cue is 'yes' \(str\), but it must be bool \| None"),
    ],
)
def test_step_scale_and_cue_options_are_checked(ckpts, tmp_path, kwargs, words):
    with pytest.raises(CaptError, match=words):
        TrainConfig(model=str(ckpts["llama"]), task="cb", out=str(tmp_path), **kwargs)


def test_a_run_from_before_the_step_scale_is_not_resumed(ckpts, data, tmp_path):
    run = tmp_path / "run"
    config = TrainConfig(
        model=str(ckpts["llama"]), task="cb", out=str(run), data=str(data), epochs=2, batch_size=8, device="cpu"
    )
    with pytest.raises(Interrupted):
        train(config, progress=False, stop_after=1)
    saved = json.loads((run / "config.json").read_text())
    for key in ("step_scale", "step_scales", "answer_cue"):
        del saved[key]
    (run / "config.json").write_text(json.dumps(saved))
    with pytest.raises(CaptError, match="was started by an earlier capt.*cannot be continued exactly: use a new --out"):
        train(config, resume=True, progress=False)


# ---------------------------------------------------------------------------------------------
# The answer cue


def test_superglue_inputs_end_in_the_cue_for_decoders(ckpts, data, tmp_path):
    ex = load_task("cb", data, "test")[0]
    assert render(ex, cue=True) == render(ex) + ANSWER_CUE and ANSWER_CUE == " answer:"
    short = render(ex, max_len=12, count_tokens=lambda t: len(t.split()), cue=True)  # the cue counts, and is never cut
    kept = short[short.index(" premise:") + 9:-len(ANSWER_CUE)].split()
    assert short.endswith(ANSWER_CUE) and kept == ex.fields["premise"].split()[:len(kept)] and len(short.split()) == 12
    llama, t5 = (load_tokenizer(ckpts[f]) for f in ("llama", "t5"))
    assert encode_examples([ex], llama, False).prompts[0] == llama.encode(render(ex, cue=True))  # decoder-only: the cue
    assert encode_examples([ex], t5, True).prompts[0] == t5.encode(render(ex))  # T5: the paper's form
    assert encode_examples([ex], llama, False, answer_cue=False).prompts[0] == llama.encode(render(ex))


def test_a_task_file_template_is_used_as_written(tmp_path):
    from helpers import write_task
    task = get_task(str(write_task(tmp_path)))
    ex = load_task(task.spec, None, "train")[0]
    assert render(ex, cue=True) == render(ex)


def test_the_input_format_travels_with_the_trained_tensors(ckpts, data, tmp_path):
    """Trained without the cue at 40 tokens, the best capsules record it: evaluate() on the loaded model
    without arguments reproduces the run's test.json, and only an explicit cue changes it."""
    path = ckpts["llama"]
    run = tmp_path / "run"
    result = train(
        TrainConfig(
            model=str(path),
            task="cb",
            out=str(run),
            data=str(data),
            epochs=1,
            batch_size=8,
            device="cpu",
            max_length=40,
            answer_cue=False,
        ),
        progress=False,
    )
    meta = json.loads((run / "best" / "capsules.json").read_text())
    assert meta["inputs"] == {"max_length": 40, "answer_cue": False}
    model, tokenizer = load_model(path, capsules=run / "best"), load_tokenizer(path)
    test = load_task("cb", data, "test")
    again = evaluate(model, tokenizer, test)
    assert again["metrics"] == result["metrics"] and again["loss"] == pytest.approx(result["loss"], rel=1e-6)
    cued = evaluate(model, tokenizer, test, answer_cue=True)
    assert cued["loss"] != pytest.approx(result["loss"], rel=1e-3)
    # a file written before the cue existed (no "inputs" key) was trained without it
    del meta["inputs"]
    (run / "best" / "capsules.json").write_text(json.dumps(meta))
    assert load_model(path, capsules=run / "best").method.inputs == {"answer_cue": False}


def test_a_model_without_a_recorded_format_takes_the_defaults(tmp_path, data):
    path = tiny_llama(tmp_path / "m")
    model, tokenizer = load_model(path), load_tokenizer(path)
    test = load_task("cb", data, "test")
    assert (
        evaluate(model, tokenizer, test)["loss"]
        == evaluate(model, tokenizer, test, max_length=256, answer_cue=True)["loss"]
    )


@pytest.mark.parametrize("integration", ["extraction", "projection"])
def test_the_maps_start_as_the_plain_form_and_train_at_r_over_their_fan_in(ckpts, data, tmp_path, integration):
    # extraction's filter (d, 7) sums 7 taps a channel, projection's down (8, d) sums d channels and its up (d, 8)
    # sums 8 ranks: at r each of their gains could move by fan-in x r a step, which is how projection's maps
    # diverged on RTE (docs/results.md); the capsules keep r x their block's scale
    config = TrainConfig(model=str(ckpts["llama"]), task="cb", out=str(tmp_path / "run"), data=str(data), epochs=1,
                         batch_size=8, max_length=64, device="cpu", lr=0.1, integration=integration)
    trainer = Trainer(config, progress=False)
    tensors = method_parameters(trainer.model)
    fresh = load_model(ckpts["llama"])
    attach(fresh, config.method_config, generator=torch.Generator().manual_seed(config.seed))
    plain = method_parameters(fresh)
    fan_in = {".weight": 7, ".down": trainer.model.capsule_width, ".up": 8}
    maps = [name for name in tensors if name.endswith(tuple(fan_in))]
    assert len(maps) == len(trainer.scales) * (1 if integration == "extraction" else 2)
    for group, (name, t) in zip(trainer.optimizer.param_groups, tensors.items(), strict=True):
        assert group["params"] == [t]
        if name in maps:
            assert group["initial_lr"] == pytest.approx(0.1 / fan_in[name[name.rindex("."):]], rel=1e-12)
            assert torch.equal(t, plain[name])  # the identity filter; down's random start, up's zeros
        else:
            assert group["initial_lr"] == pytest.approx(0.1 * trainer.scales[int(name.split(".")[1])], rel=1e-12)
    trainer.close()
