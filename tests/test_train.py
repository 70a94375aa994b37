"""Evaluation and training on tiny random checkpoints (CPU).

Rank classification against a naive reference (one full forward per example and candidate, no
cache, no batching); training lowers the loss and leaves every backbone tensor untouched; an
interrupted run (stop_after, Ctrl-C in a step or in an evaluation) resumes to bit-identical
capsules and metrics; max_steps is the length of the learning-rate schedule; a NaN loss stops
the run and keeps the best capsules; resume refuses another model, task or setting (max_steps
included) and reuses a finished run's test; a start cut short before the first state.pt does not
block the directory; damaged run files and unusable devices are refused in one line; CUDA
generator states are saved only once CUDA is in use and restored on the GPUs there are.
"""

import json
import math
import shutil

import pytest
import torch
from helpers import write_superglue
from safetensors.torch import load_file

import capt.rundir as rundir_module
import capt.trainer as train_module
from capt import CapsuleConfig, load_model, load_tokenizer
from capt.methods import capsule_vectors
from capt.errors import CaptError
from capt.evaluate import encode_examples, evaluate, is_seq2seq
from capt.tasks import load_task, score
from capt.trainer import (
    Interrupted,
    Trainer,
    TrainConfig,
    TrainingDiverged,
    bucketed_batches,
    default_lr,
    lr_factor,
    train,
)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_superglue(tmp_path_factory.mktemp("data"), {"CB": (40, 12), "COPA": (30, 10)})


def randomized(path, integration="add"):
    model = load_model(path, capsules=CapsuleConfig(integration=integration))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in capsule_vectors(model).values():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def naive_scores(model, data) -> torch.Tensor:
    """One forward per (example, candidate), batch of one, no cache: the summed target log-probs."""
    out = torch.empty(len(data), len(data.targets[0]))
    for i, (prompt, targets) in enumerate(zip(data.prompts, data.targets)):
        for c, target in enumerate(targets):
            t = torch.tensor(target)
            with torch.no_grad():
                if data.seq2seq:
                    dec = torch.tensor([[model.config.decoder_start_token_id] + target[:-1]])
                    logp = model(torch.tensor([prompt]), decoder_input_ids=dec)[0].log_softmax(-1)  # (Td, V)
                    out[i, c] = logp[torch.arange(len(target)), t].sum()
                else:
                    ids = torch.tensor([prompt + target])
                    prompt_mask = torch.zeros_like(ids)
                    prompt_mask[:, : len(prompt)] = 1  # the capsule sees the prompt only
                    logp = model(ids, prompt_mask=prompt_mask)[0].log_softmax(-1)  # (L, V)
                    out[i, c] = logp[torch.arange(len(prompt) - 1, len(prompt) + len(target) - 1), t].sum()
    return out


@pytest.mark.parametrize(
    "family,capsules", [("llama", "add"), ("llama", "prepend"), ("llama", None), ("t5", "add"), ("t5", None)]
)
@pytest.mark.parametrize("task", ["cb", "copa"])
def test_eval_matches_naive_reference(ckpts, data, family, capsules, task):
    path = ckpts[family]
    model = randomized(path, capsules) if capsules else load_model(path)
    tok = load_tokenizer(path)
    examples = load_task(task, data, "test")
    encoded = encode_examples(examples, tok, is_seq2seq(model))
    if family == "llama" and task == "cb":  # a multi-token answer exercises the cached continuation
        assert max(len(t) for t in encoded.targets[0]) > 1

    positions = []  # token positions the model embeds: the prompt must not be read once per candidate
    stack = model.encoder if family == "t5" else model.model.embed_tokens
    handle = stack.register_forward_hook(lambda m, args, out: positions.append(args[0].shape[0] * args[0].shape[1]))
    result = evaluate(model, tok, examples, batch_size=5)
    handle.remove()

    expected = naive_scores(model, encoded)
    torch.testing.assert_close(result["scores"], expected, atol=2e-5, rtol=1e-5)
    assert result["predictions"] == expected.argmax(1).tolist()
    assert result["metrics"] == score(task, result["predictions"], examples)
    assert math.isclose(
        result["loss"], -expected[torch.arange(len(examples)), torch.tensor(encoded.labels)].mean().item(), rel_tol=1e-5
    )
    n_cands = len(examples[0].candidates)
    prompt_tokens = sum(len(p) for p in encoded.prompts)
    assert sum(positions) < n_cands * prompt_tokens

    lengths = torch.tensor([[len(t) for t in c] for c in encoded.targets], dtype=torch.float32)
    normalized = evaluate(model, tok, data=encoded, batch_size=7, normalize=True)
    assert normalized["predictions"] == (expected / lengths).argmax(1).tolist()


def backbone(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items() if not k.endswith("capsule")}


@pytest.mark.parametrize("family,dtype", [("llama", "fp32"), ("t5", "fp32"), ("llama", "bf16")])
def test_training_lowers_loss_and_leaves_backbone_untouched(ckpts, data, tmp_path, family, dtype):
    path = ckpts[family]
    model = load_model(path, dtype=dtype)
    before = backbone(model)
    tok = load_tokenizer(path)
    run = tmp_path / "run"
    config = TrainConfig(model=str(path), task="cb", out=str(run), data=str(data), epochs=4, batch_size=8,
                         lr=0.05, patience=100, dtype=dtype, device="cpu")
    result = train(config, model=model, tokenizer=tok, progress=False)

    after = backbone(model)
    assert before.keys() == after.keys()
    for key in before:
        assert torch.equal(before[key], after[key]), key
        assert after[key].dtype == (torch.bfloat16 if dtype == "bf16" else torch.float32)
    state = torch.load(run / "state.pt", weights_only=True)
    assert all(v.dtype == torch.float32 for v in state["tensors"].values())
    moments = [t for s in state["optimizer"]["state"].values() for t in s.values() if t.dim() > 0]
    assert moments and all(t.dtype == torch.float32 for t in moments)

    train_examples = load_task("cb", data, "train")
    _set = rundir_module.set_method
    _set(model, state["tensors"])  # the final capsules
    trained = evaluate(model, tok, train_examples)["loss"]
    _set(model, {k: torch.zeros_like(v) for k, v in state["tensors"].items()})
    untrained = evaluate(model, tok, train_examples)["loss"]
    assert trained < untrained - 1e-3

    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [5, 10, 15, 20] and [m["epoch"] for m in lines] == [1, 2, 3, 4]
    assert set(lines[0]) == {"epoch", "step", "train_loss", "validation", "best", "lr", "time"}
    assert {"headline", "f1", "accuracy", "loss"} <= set(lines[0]["validation"])
    saved = json.loads((run / "config.json").read_text())
    assert saved["task"] == "cb" and saved["seed"] == 0 and saved["lr"] == 0.05 and saved["dtype"] == dtype
    assert saved["model_config_sha256"] == model.source["config_sha256"] and saved["capt_version"]
    assert saved["trainable_parameters"] == sum(p.numel() for p in capsule_vectors(model).values())
    test = json.loads((run / "test.json").read_text())
    assert test == result and test["n"] == 12 and test["stopped"] == "epochs"
    assert (run / "best" / "capsules.safetensors").is_file() and (run / "best" / "capsules.json").is_file()


def run_files(run) -> dict:
    """What must be equal between an interrupted-and-resumed run and an uninterrupted one."""
    metrics = [
        {k: v for k, v in json.loads(line).items() if k != "time"}
        for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    state = torch.load(run / "state.pt", weights_only=True)
    return {
        "capsules": state["tensors"],
        "best": load_file(run / "best" / "capsules.safetensors"),
        "metrics": metrics,
        # wall time differs
        "test": {k: v for k, v in json.loads((run / "test.json").read_text()).items() if k != "train_seconds"},
        "step": state["train"]["step"],
    }


def assert_same(a: dict, b: dict) -> None:
    assert a["metrics"] == b["metrics"]
    assert a["test"] == b["test"] and a["step"] == b["step"]
    for key in ("capsules", "best"):
        assert a[key].keys() == b[key].keys()
        for k in a[key]:
            assert torch.equal(a[key][k], b[key][k]), (key, k)  # bit-identical


@pytest.fixture(scope="module")
def resume_setup(ckpts, data, tmp_path_factory):
    """An uninterrupted reference run: 3 epochs of 3 steps (batch 4 x 3), evaluations every 2 steps too."""
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    options = dict(model=str(path), task="cb", data=str(data), epochs=3, batch_size=4, grad_accum=3, eval_every=2,
                   lr=0.05, patience=100, device="cpu")
    run = tmp_path_factory.mktemp("resume") / "reference"
    train(TrainConfig(out=str(run), **options), model=model, tokenizer=tok, progress=False)
    return model, tok, options, run_files(run)


def test_resume_after_stop_after_is_bit_identical(resume_setup, tmp_path):
    model, tok, options, reference = resume_setup
    steps = [m["step"] for m in reference["metrics"]]
    assert steps == [2, 3, 4, 6, 8, 9]
    run = tmp_path / "run"
    with pytest.raises(CaptError, match="stop_after must be a whole number from 0, got -1"):
        train(TrainConfig(out=str(run), **options), model=model, tokenizer=tok, progress=False, stop_after=-1)
    for stop in (4, 7):  # after step 4's evaluation, then in the middle of epoch 3
        saved = (
            rf"at step {stop}; the training state is saved in .*state.pt; continue with: capt train --out .* --resume"
        )
        with pytest.raises(Interrupted, match=saved):
            train(
                TrainConfig(out=str(run), **options),
                resume=stop != 4,
                model=model,
                tokenizer=tok,
                progress=False,
                stop_after=stop,
            )
        state = torch.load(run / "state.pt", weights_only=True)
        assert state["train"]["step"] == stop and not state["train"]["finished"] and not (run / "test.json").exists()
        evaluated = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert evaluated == [s for s in steps if s <= stop]
    train(TrainConfig(out=str(run), **options), resume=True, model=model, tokenizer=tok, progress=False)
    assert_same(run_files(run), reference)


def test_a_deterministic_run_is_the_same_run_and_leaves_torch_as_it_was(resume_setup, tmp_path, monkeypatch):
    """deterministic changes which kernels run, not what they compute: on the CPU, whose kernels already repeat, the
    run equals the plain one bit for bit. torch's deterministic mode is on while it trains and as it was afterwards,
    after an interruption too; config.json records it, and a run resumed without it continues (like --device)."""
    model, tok, options, reference = resume_setup
    seen, fit = [], Trainer.fit

    def watched_fit(self, **kwargs):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return fit(self, **kwargs)

    monkeypatch.setattr(Trainer, "fit", watched_fit)
    run = tmp_path / "run"
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(Interrupted):
        train(TrainConfig(out=str(run), deterministic=True, **options), model=model, tokenizer=tok, progress=False,
              stop_after=4)
    assert seen == [True] and not torch.are_deterministic_algorithms_enabled()
    assert json.loads((run / "config.json").read_text())["deterministic"] is True
    train(TrainConfig(out=str(run), **options), resume=True, model=model, tokenizer=tok, progress=False)
    assert seen == [True, False]
    assert_same(run_files(run), reference)


@pytest.mark.parametrize("where,call", [("batch_nll", 8), ("evaluate", 2)])
def test_resume_after_ctrl_c_is_bit_identical(resume_setup, tmp_path, monkeypatch, where, call):
    model, tok, options, reference = resume_setup
    original, calls = getattr(train_module, where), []

    def interrupting(*args, **kwargs):
        calls.append(1)
        if len(calls) == call:  # in the middle of a gradient accumulation, or of an evaluation
            raise KeyboardInterrupt
        return original(*args, **kwargs)

    monkeypatch.setattr(train_module, where, interrupting)
    run = tmp_path / "run"
    with pytest.raises(Interrupted, match=r"state is saved in .*state.pt; continue with: capt train --out .* --resume"):
        train(TrainConfig(out=str(run), **options), model=model, tokenizer=tok, progress=False)
    monkeypatch.setattr(train_module, where, original)
    assert (run / "state.pt").is_file() and not (run / "test.json").exists()
    train(TrainConfig(out=str(run), **options), resume=True, model=model, tokenizer=tok, progress=False)
    assert_same(run_files(run), reference)


def test_nan_loss_stops_and_keeps_the_best_capsules(ckpts, data, tmp_path, monkeypatch):
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    original, calls = train_module.batch_nll, []

    def poisoned(*args):
        calls.append(1)
        nll = original(*args)
        return nll * float("nan") if len(calls) > 7 else nll  # finite for the first epoch (5 steps) and more

    monkeypatch.setattr(train_module, "batch_nll", poisoned)
    run = tmp_path / "run"
    config = TrainConfig(
        model=str(path), task="cb", out=str(run), data=str(data), epochs=3, batch_size=8, lr=0.05, device="cpu"
    )
    with pytest.raises(
        TrainingDiverged,
        match=r"training loss became nan at step 8 \(epoch 2\).*best capsules so far are kept in .*best",
    ):
        train(config, model=model, tokenizer=tok, progress=False)
    state = torch.load(run / "state.pt", weights_only=True)
    assert state["train"]["step"] == 5  # the state of the last evaluation
    best = load_file(run / "best" / "capsules.safetensors")
    for key, value in state["train"]["best"]["tensors"].items():
        assert torch.equal(best[key], value) and torch.isfinite(value).all()
    assert not (run / "test.json").exists()

    monkeypatch.setattr(train_module, "batch_nll", lambda *a: original(*a) * float("inf"))
    with pytest.raises(TrainingDiverged, match="became inf at step 1 .*no validation evaluation had finished"):
        train(TrainConfig(model=str(path), task="cb", out=str(tmp_path / "run2"), data=str(data), device="cpu"),
              model=model, tokenizer=tok, progress=False)


def test_resume_refuses_another_model_task_or_setting(ckpts, data, tmp_path, monkeypatch):
    llama, t5 = ckpts["llama"], ckpts["t5"]
    run = str(tmp_path / "run")
    base = dict(data=str(data), epochs=1, batch_size=8, max_steps=1, device="cpu")
    train(TrainConfig(model=str(llama), task="cb", out=run, **base), progress=False)
    with pytest.raises(CaptError, match="already holds a run; pass --resume"):
        train(TrainConfig(model=str(llama), task="cb", out=run, **base), progress=False)
    with pytest.raises(CaptError, match="was trained on a different model"):
        train(TrainConfig(model=str(t5), task="cb", out=run, **base), resume=True, progress=False)
    with pytest.raises(CaptError, match="is a cb run, not copa"):
        train(TrainConfig(model=str(llama), task="copa", out=run, **base), resume=True, progress=False)
    with pytest.raises(CaptError, match=rf"other settings: lr {default_lr('capt', 'rms'):g} \(given 0.5\)"):
        train(TrainConfig(model=str(llama), task="cb", out=run, lr=0.5, **base), resume=True, progress=False)
    for steps in (2, None):  # max_steps sets the schedule, so a resumed run keeps it
        why = r"\(max_steps is the length of the learning-rate schedule\)"
        with pytest.raises(CaptError, match=rf"other settings: max_steps 1 \(given {steps}\) {why}"):
            train(
                TrainConfig(model=str(llama), task="cb", out=run, **dict(base, max_steps=steps)),
                resume=True,
                progress=False,
            )
    tested = (tmp_path / "run" / "test.json").stat().st_mtime_ns
    with monkeypatch.context() as m:  # a finished run is reused: its test is not run again
        m.setattr(Trainer, "test", lambda self: pytest.fail("a finished run was tested again"))
        again = train(TrainConfig(model=str(llama), task="cb", out=run, **base), resume=True, progress=False)
    assert (
        again == json.loads((tmp_path / "run" / "test.json").read_text())
        and again["steps"] == 1
        and again["stopped"] == "max_steps"
    )
    assert (tmp_path / "run" / "test.json").stat().st_mtime_ns == tested
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    (tmp_path / "run" / "config.json").write_text(json.dumps(dict(saved, planned_steps=5)))  # as if planned otherwise
    with pytest.raises(CaptError, match="planned its learning-rate schedule over 5 steps, but these settings and data "
                                        "give 1"):
        train(TrainConfig(model=str(llama), task="cb", out=run, **base), resume=True, progress=False)
    with pytest.raises(CaptError, match="nothing to resume"):
        train(
            TrainConfig(model=str(llama), task="cb", out=str(tmp_path / "empty"), **base), resume=True, progress=False
        )


def test_bucketed_batches():
    lengths = [(i * 37) % 101 for i in range(300)]
    a = bucketed_batches(lengths, 8, seed=0, epoch=0)
    assert sorted(i for b in a for i in b) == list(range(300))
    assert a == bucketed_batches(lengths, 8, seed=0, epoch=0)
    assert a != bucketed_batches(lengths, 8, seed=0, epoch=1) and a != bucketed_batches(lengths, 8, seed=1, epoch=0)
    spread = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in a) / len(a)
    assert spread < 10  # sorted within chunks: little padding


@pytest.mark.parametrize(
    "n, batch, sizes",
    [
        (225, 16, [15] * 15),
        (300, 8, [8] * 34 + [7] * 4),
        (257, 16, [16] * 16 + [1]),
        (273, 16, [16] * 16 + [9, 8]),
        (20, 16, [10, 10]),
        (5, 16, [5]),
    ],
)
def test_no_step_rests_on_a_handful_of_examples(n, batch, sizes):
    """The remainder of the last chunk is spread over its batches (sizes differ by at most one): CB's 225
    rows in batches of 16 give 15 of 15, not 14 of 16 and one of 1. Full chunks keep batch_size exactly;
    a last chunk of one example is one batch of one (nothing to spread it over)."""
    got = bucketed_batches(list(range(n)), batch, seed=0, epoch=0)
    assert sorted(len(b) for b in got) == sorted(sizes)
    assert sorted(i for b in got for i in b) == list(range(n))


@pytest.mark.parametrize("max_steps,planned", [(8, 8), (60, 50)])
def test_max_steps_is_the_length_of_the_schedule(ckpts, data, tmp_path, monkeypatch, max_steps, planned):
    """10 epochs of 5 steps = 50 steps; max_steps 8: warm-up 25% of 8 = 2 steps, then decay to 0 at step 8."""
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    original, lrs = train_module.Trainer._step, []

    def recording(self, group):  # the learning rate each optimizer step uses
        lrs.append(self.optimizer.param_groups[0]["lr"] / self.scales[0])  # r: block 0's rate over its step scale
        return original(self, group)

    monkeypatch.setattr(train_module.Trainer, "_step", recording)
    run = tmp_path / "run"
    lr = 0.05
    config = TrainConfig(
        model=str(path),
        task="cb",
        out=str(run),
        data=str(data),
        epochs=10,
        batch_size=8,
        lr=lr,
        warmup=0.25,
        max_steps=max_steps,
        patience=100,
        device="cpu",
    )
    result = train(config, model=model, tokenizer=tok, progress=False)
    assert result["steps"] == len(lrs) == planned and result["stopped"] == (
        "max_steps" if max_steps == planned else "epochs"
    )
    assert json.loads((run / "config.json").read_text())["planned_steps"] == planned
    warmup = round(0.25 * planned)
    assert lrs == pytest.approx([lr * lr_factor(s, warmup, planned) for s in range(planned)], rel=1e-12)
    # warm-up: a fraction of the planned steps
    assert lrs[:warmup] == pytest.approx([lr * (s + 1) / warmup for s in range(warmup)])
    assert max(lrs) == pytest.approx(lr) and lrs.index(max(lrs)) == warmup - 1
    assert all(x >= y for x, y in zip(lrs[warmup - 1:], lrs[warmup:]))  # then linear decay ...
    assert lrs[-1] == pytest.approx(lr / (planned - warmup)) and lrs[-1] < 0.2 * lr  # ... nearly 0 at the last step
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    assert last["step"] == planned and last["lr"] == 0.0  # and 0 once the planned steps are done


def test_lr_schedule():
    factors = [lr_factor(s, warmup=4, total=20) for s in range(21)]
    assert factors[:4] == [0.25, 0.5, 0.75, 1.0] and factors[4] == 1.0
    assert factors[12] == 0.5 and factors[20] == 0.0
    assert all(x >= y for x, y in zip(factors[4:], factors[5:]))


def test_a_start_cut_short_before_the_first_state_does_not_block_the_directory(ckpts, data, tmp_path, monkeypatch):
    """config.json is written just before the first state.pt; a process that dies between leaves a fresh directory."""
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    run = tmp_path / "run"
    config = dict(
        model=str(path), task="cb", out=str(run), data=str(data), epochs=1, batch_size=8, max_steps=1, device="cpu"
    )

    def killed(self):
        raise RuntimeError("killed")

    with monkeypatch.context() as m:
        m.setattr(Trainer, "_save_state", killed)
        with pytest.raises(RuntimeError, match="killed"):
            train(TrainConfig(**config), model=model, tokenizer=tok, progress=False)
    assert (run / "config.json").is_file() and not (run / "state.pt").exists()
    with pytest.raises(
        CaptError, match=r"nothing to resume in .*: it has no state.pt \(start the run again without --resume\)"
    ):
        train(TrainConfig(**config), resume=True, model=model, tokenizer=tok, progress=False)
    result = train(TrainConfig(**config), model=model, tokenizer=tok, progress=False)  # a fresh start
    assert result["steps"] == 1 and (run / "state.pt").is_file()


@pytest.fixture(scope="module")
def finished_run(ckpts, data, tmp_path_factory):
    """A finished one-step run, to be copied and damaged."""
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    run = tmp_path_factory.mktemp("finished") / "run"
    options = dict(model=str(path), task="cb", data=str(data), epochs=1, batch_size=8, max_steps=1, device="cpu")
    train(TrainConfig(out=str(run), **options), model=model, tokenizer=tok, progress=False)
    return model, tok, options, run


def _state(run):
    return torch.load(run / "state.pt", weights_only=True)


DAMAGES = {
    "state not a dict": (
        lambda run: torch.save([1, 2], run / "state.pt"),
        r"state.pt is not a training state: it holds a list, not a dict",
    ),
    "state without keys": (
        lambda run: torch.save(
            {k: v for k, v in _state(run).items() if k not in ("optimizer", "rng")}, run / "state.pt"
        ),
        r"state.pt is not a complete training state: it lacks optimizer, rng",
    ),
    "position without a key": (
        lambda run: torch.save(
            dict(_state(run), train={k: v for k, v in _state(run)["train"].items() if k != "n_evals"}), run / "state.pt"
        ),
        r"state.pt is not a complete training state: it lacks train.n_evals",
    ),
    "optimizer of another shape": (
        lambda run: torch.save(dict(_state(run), optimizer={"state": {}, "param_groups": []}), run / "state.pt"),
        r"state.pt is a damaged training state \(ValueError: ",
    ),
    "config not an object": (
        lambda run: (run / "config.json").write_text("[1, 2]\n"),
        r"config.json is not a run's settings: it holds a JSON list, not an object",
    ),
    "metrics line not JSON": (
        lambda run: (run / "metrics.jsonl").write_text("{not json\n"),
        r"metrics.jsonl line 1: not valid JSON",
    ),
    "metrics line not a record": (
        lambda run: (run / "metrics.jsonl").write_text("[1]\n"),
        r"metrics.jsonl line 1: not a metrics record \(it is \[1\];",
    ),
    "metrics lines missing": (
        lambda run: (run / "metrics.jsonl").write_text(""),
        r"metrics.jsonl has 0 lines, but .*state.pt counts 1 evaluations",
    ),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_damaged_run_files_are_refused_in_one_line(finished_run, tmp_path, damage):
    model, tok, options, template = finished_run
    run = tmp_path / "run"
    shutil.copytree(template, run)
    spoil, message = DAMAGES[damage]
    spoil(run)
    with pytest.raises(CaptError, match=message):
        train(TrainConfig(out=str(run), **options), resume=True, model=model, tokenizer=tok, progress=False)


def test_logged_seconds_of_a_damaged_metrics_file(tmp_path):
    log = tmp_path / "metrics.jsonl"
    record = {"time": 1.5, "step": 3, "validation": {"headline": 50.0, "accuracy": 50.0, "loss": 1.25}}
    log.write_text(json.dumps(record) + "\n")
    assert rundir_module.logged_seconds(tmp_path) == 1.5
    log.write_text(json.dumps(record) + "\n{broken\n")
    with pytest.raises(CaptError, match=r"metrics.jsonl line 2: not valid JSON"):
        rundir_module.logged_seconds(tmp_path)
    log.write_text(json.dumps({"step": 3}) + "\n")
    with pytest.raises(
        CaptError, match=r"metrics.jsonl line 1: not a metrics record \(time is None; a JSON object with the step"
    ):
        rundir_module.logged_seconds(tmp_path)


def test_devices_torch_cannot_use_are_refused(ckpts, tmp_path, monkeypatch):
    base = dict(model=str(ckpts["llama"]), task="cb", out=str(tmp_path / "run"))
    with pytest.raises(CaptError, match=r"device 'foo' is not a torch device \(use cpu, cuda or cuda:N\)"):
        TrainConfig(device="foo", **base)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(CaptError, match="^device cuda requested but no CUDA GPU is available$"):
        TrainConfig(device="cuda", **base)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(
        CaptError, match=r"device cuda:2 requested but this machine has 2 CUDA GPU\(s\): cuda:0 .. cuda:1"
    ):
        TrainConfig(device="cuda:2", **base)
    assert TrainConfig(device="cuda:1", **base).device == "cuda:1" and TrainConfig(device="cpu", **base).device == "cpu"


def test_cuda_generator_states(monkeypatch):
    """Saved only once CUDA is in use (a CPU run never starts it); restored on as many GPUs as there are."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: pytest.fail("CUDA was started to save its generators"))
    assert rundir_module.rng_states()["cuda"] == []
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_rng_state_all", lambda: ["gpu0", "gpu1"])
    assert rundir_module.rng_states()["cuda"] == ["gpu0", "gpu1"]

    restored = []
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((state, device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("every saved state restored"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    rundir_module.restore_cuda_rng(["gpu0", "gpu1"])  # saved on two GPUs, resumed on one
    assert restored == [("gpu0", 0)]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    restored.clear()
    rundir_module.restore_cuda_rng(["gpu0", "gpu1"])
    assert restored == [("gpu0", 0), ("gpu1", 1)]
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    restored.clear()
    rundir_module.restore_cuda_rng(["gpu0"])  # a CPU machine resuming a GPU run
    assert restored == []


def test_warmup_longer_than_the_run_ends_at_the_last_planned_step(ckpts, data, tmp_path, monkeypatch):
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    original, lrs = train_module.Trainer._step, []

    def recording(self, group):
        lrs.append(self.optimizer.param_groups[0]["lr"] / self.scales[0])  # r: block 0's rate over its step scale
        return original(self, group)

    monkeypatch.setattr(train_module.Trainer, "_step", recording)
    lr = 0.05
    config = TrainConfig(
        model=str(path),
        task="cb",
        out=str(tmp_path / "run"),
        data=str(data),
        epochs=10,
        batch_size=8,
        lr=lr,
        warmup=100,
        max_steps=4,
        patience=100,
        device="cpu",
    )
    train(config, model=model, tokenizer=tok, progress=False)
    # warm-up over the 4 planned steps: the peak is reached
    assert lrs == pytest.approx([lr * (s + 1) / 4 for s in range(4)], rel=1e-12)
    for warmup in (1.5, 2.25):
        with pytest.raises(
            CaptError,
            match=rf"warmup {warmup:g} is neither a fraction of the planned steps \(below 1\) nor a whole number",
        ):
            TrainConfig(model=str(path), task="cb", out=str(tmp_path / "x"), warmup=warmup)
    assert TrainConfig(model=str(path), task="cb", out=str(tmp_path / "x"), warmup=3.0).warmup == 3.0


def test_code_version_marks_local_changes_to_the_package_only(tmp_path):
    import subprocess

    from capt.cli.experiment import code_version

    def git(*args):
        subprocess.run(
            ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True, capture_output=True
        )

    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "code.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("words\n")
    git("init", "-q")
    git("add", "-A")
    git("commit", "-qm", "first")
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    assert code_version(tmp_path / "pkg") == head
    (tmp_path / "README.md").write_text("other words\n")
    assert code_version(tmp_path / "pkg") == head  # outside the package
    (tmp_path / "pkg" / "new.py").write_text("y = 2\n")
    assert code_version(tmp_path / "pkg") == head + "+dirty"  # a new module counts
    (tmp_path / "pkg" / "new.py").unlink()
    (tmp_path / "pkg" / "code.py").write_text("x = 2\n")
    assert code_version(tmp_path / "pkg") == head + "+dirty"
    assert code_version(tmp_path.parent / "nowhere") is None


def test_losses_are_read_every_few_steps_and_a_nan_is_still_caught(ckpts, data, tmp_path, monkeypatch):
    """The step losses are read back together, every LOSS_READ_EVERY steps and before every evaluation
    or save: a NaN at step 2 is caught at the next read, named by its own step, and never evaluated or saved."""
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    original, calls = train_module.batch_nll, []

    def poisoned(*args):
        calls.append(1)
        nll = original(*args)
        return nll * float("nan") if len(calls) == 2 else nll  # step 2's loss (and, through the update, all later ones)

    monkeypatch.setattr(train_module, "batch_nll", poisoned)
    # 8: read before the first evaluation (epoch end, step 5); 3: after step 3
    for every, steps_run in ((8, 5), (3, 3)):
        monkeypatch.setattr(train_module, "LOSS_READ_EVERY", every)
        calls.clear()
        run = tmp_path / f"every{every}"
        config = TrainConfig(
            model=str(path), task="cb", out=str(run), data=str(data), epochs=3, batch_size=8, lr=0.05, device="cpu"
        )
        with pytest.raises(
            TrainingDiverged, match=r"became nan at step 2 \(epoch 1\).*no validation evaluation had finished"
        ):
            train(config, model=model, tokenizer=tok, progress=False)
        assert len(calls) == steps_run
        assert (
            torch.load(run / "state.pt", weights_only=True)["train"]["step"] == 0
            and not (run / "metrics.jsonl").exists()
        )


def test_a_run_keeps_each_test_rows_record_caps_its_splits_and_selects_by_loss(ckpts, data, tmp_path):
    """test.json holds each test row's prediction and gold log-probability (what paired comparisons read);
    train_rows / validation_rows sample the splits by the seed (the same rows for every method); select "loss"
    keeps the evaluation with the lowest validation gold NLL."""
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    config = TrainConfig(model=str(path), task="cb", out=str(tmp_path / "run"), data=str(data), epochs=3, batch_size=8,
                         eval_every=1, patience=100, device="cpu", train_rows=20, validation_rows=3, select="loss")
    result = train(config, model=model, tokenizer=tok, progress=False)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["examples"]["train"] == 20 and saved["examples"]["validation"] == 3
    assert saved["select"] == "loss" and saved["train_rows"] == 20
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lowest = min(lines, key=lambda m: m["validation"]["loss"])
    assert result["best"]["step"] == lowest["step"] and [m["step"] for m in lines if m["best"]][-1] == lowest["step"]
    test = json.loads((tmp_path / "run" / "test.json").read_text())
    again = evaluate(model, tok, load_task("cb", data, "test"))  # the model holds the best capsules
    assert (
        test["examples"]["prediction"] == again["predictions"]
        and test["examples"]["label"] == again["examples"]["label"]
    )
    assert test["examples"]["uid"] == [ex.uid for ex in load_task("cb", data, "test")]
    gold = again["scores"][torch.arange(again["n"]), torch.tensor(test["examples"]["label"])]
    assert test["examples"]["gold_logprob"] == pytest.approx(gold.tolist(), abs=1e-5)
    assert -sum(test["examples"]["gold_logprob"]) / test["n"] == pytest.approx(test["loss"], abs=1e-5)
    other = TrainConfig(model=str(path), task="cb", out=str(tmp_path / "other"), data=str(data), train_rows=20,
                        validation_rows=3, device="cpu")
    first = Trainer(other, model=model, tokenizer=tok, progress=False)
    try:
        assert [ex.uid for ex in first.examples["train"]] == [
            ex.uid for ex in train_module.sample_rows(load_task("cb", data, "train"), 20, 0, "train")
        ]
    finally:
        first.close()
    with pytest.raises(CaptError, match="select 'f1' is not one of headline, loss"):
        TrainConfig(model=str(path), task="cb", out=str(tmp_path / "x"), select="f1")
    with pytest.raises(CaptError, match="train_rows must be at least 1, got 0"):
        TrainConfig(model=str(path), task="cb", out=str(tmp_path / "x"), train_rows=0)


def test_a_run_that_has_not_learnt_is_told_by_its_gold_nll():
    """did_not_learn: a best validation gold NLL not below ln(words) - 0.1 nats, where the right word gets no more
    than about 1/words of the probability (an even spread over the label words)."""
    from capt.trainer import STALL_NATS, did_not_learn

    assert STALL_NATS == 0.1
    assert did_not_learn(1.0987, 3) and did_not_learn(20.5, 3) and did_not_learn(math.log(3) - 0.099, 3)
    assert not did_not_learn(math.log(3) - 0.101, 3) and not did_not_learn(0.649, 3)
    assert did_not_learn(0.677, 2) and not did_not_learn(0.55, 2)  # two words: ln 2 = 0.693
    assert not did_not_learn(5.0, 1)  # one word: nothing to tell apart
