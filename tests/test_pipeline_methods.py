"""Every method through the same trainer, evaluation and commands, on tiny random checkpoints (CPU).

Each trainable method trains through train() with the backbone bit-identical afterwards, and
its best/ reloads (capt eval --adapter) to identical scores; evaluation with prompt, deep-prompt
and prefix tensors equals the naive one-forward-per-candidate reference (the key/value cache
holds their front columns); linear-head is refused on T5; resume refuses another method or n;
an old capsules-only state.pt still resumes; capt run searches prompt lengths and reports the
time; instance is evaluated, never trained. The training loss of every method is the negative of
the evaluation's gold score, and a right-padded decoder-only batch trains without an attention
mask, to the same loss as with one.
"""

import json

import pytest
import torch
from helpers import capt, one_line_error, write_superglue
from safetensors.torch import load_file
from test_train import naive_scores

from capt import load_model, load_tokenizer
from capt.cli.experiment import choose_length
from capt.cli.report import time_lines
from capt.errors import CaptError
from capt.evaluate import candidate_scores, decoder_inputs, encode_examples, evaluate, pad
from capt.load import read_config
from capt.load import load_method, trainable_count
from capt.methods import METHODS, attach, method_parameters, method_tensors
from capt.tasks import load_task
from capt.trainer import TrainConfig, batch_nll, train

DEFAULT_N = {name: m.default_n for name, m in METHODS.items() if m.default_n is not None}

FAST = dict(epochs=1, batch_size=8, max_steps=3, lr=0.05, warmup=0, device="cpu")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_superglue(tmp_path_factory.mktemp("data"), {"CB": (40, 12), "COPA": (30, 10)})




@pytest.mark.parametrize(
    "family,method,task",
    [
        ("llama", "capt", "cb"),
        ("llama", "prompt", "cb"),
        ("llama", "deep-prompt", "cb"),
        ("llama", "prefix", "cb"),
        ("llama", "linear-head", "cb"),
        ("llama", "linear-head", "copa"),
        ("t5", "prompt", "cb"),
        ("t5", "prefix", "copa"),
    ],
)
def test_each_method_trains_and_reloads(ckpts, data, tmp_path, capsys, family, method, task):
    path = ckpts[family]
    model, tok = load_model(path), load_tokenizer(path)
    backbone = {k: v.clone() for k, v in model.state_dict().items()}  # nothing attached yet
    run = tmp_path / "run"
    n = 2 if method in DEFAULT_N else None
    config = TrainConfig(model=str(path), task=task, out=str(run), data=str(data), method=method, n=n, **FAST)
    result = train(config, model=model, tokenizer=tok, progress=False)

    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in backbone.items())  # the backbone is bit-identical
    trained = {id(p) for p in model.parameters() if p.requires_grad}
    assert trained and trained == {id(p) for p in method_parameters(model).values()}

    classes = {"cb": 3, "copa": 2}[task] if method == "linear-head" else None  # COPA: choice1 / choice2
    expected = trainable_count(read_config(path), method, n=n, num_classes=classes)
    assert (
        result["method"] == method
        and result["method_config"]["n"] == n
        and result["method_config"]["num_classes"] == classes
    )
    assert result["trainable_parameters"] == expected and result["train_seconds"] > 0 and result["steps"] == 3
    saved = json.loads((run / "config.json").read_text())
    assert saved["method"] == method and saved["n"] == n and saved["trainable_parameters"] == expected
    files = ["capsules.json", "capsules.safetensors"] if method == "capt" else ["adapter.json", "adapter.safetensors"]
    assert sorted(p.name for p in (run / "best").iterdir()) == files

    state = torch.load(run / "state.pt", weights_only=True)
    fresh = load_model(path)
    attach(fresh, config.method_config, generator=torch.Generator().manual_seed(0))  # the run's initial values
    initial = method_tensors(fresh)
    assert state["tensors"].keys() == initial.keys()
    assert any(not torch.equal(state["tensors"][k], initial[k].detach()) for k in initial)  # training moved them

    # best/ reloads to identical scores: in Python, and through capt eval (run directory or best/)
    examples = load_task(task, data, "test")
    encoded = encode_examples(examples, tok, family == "t5")
    reloaded = load_model(path)
    load_method(reloaded, run / "best")
    assert torch.equal(candidate_scores(reloaded, encoded), candidate_scores(model, encoded))
    if method == "linear-head":  # argmax of the classifier over the candidates, no ranking of targets
        with torch.no_grad():
            assert evaluate(model, tok, data=encoded)["scores"].exp().sum(1).sub(1).abs().max() < 1e-5
    for where in (run, run / "best"):
        code, out, err = capt(
            "eval",
            "--model",
            path,
            "--task",
            task,
            "--data",
            data,
            "--adapter",
            where,
            "--json",
            "--device",
            "cpu",
            capsys=capsys,
        )
        assert code == 0, err
        got = json.loads(out)
        assert got["method"] == method and got["metrics"] == result["metrics"] and got["loss"] == result["loss"]
    if method == "capt":  # --capsules is the same option
        code, out, err = capt(
            "eval", "--model", path, "--task", task, "--data", data, "--capsules", run, "--device", "cpu", capsys=capsys
        )
        assert code == 0 and f"capsules {run / 'best'}" in out, err
    code, _, err = capt(
        "eval", "--model", path, "--task", task, "--data", data, "--adapter", run, "--method", "instance", capsys=capsys
    )
    one_line_error(code, err, "--method instance has no tensors to load")
    if method != "capt":
        code, _, err = capt(
            "eval", "--model", path, "--task", task, "--data", data, "--adapter", run, "--method", "capt", capsys=capsys
        )
        one_line_error(code, err, f"holds {method}", "not the method capt asked for")


@pytest.mark.parametrize("method", ["capt", "prompt", "deep-prompt", "prefix", "instance"])
def test_eval_with_methods_matches_naive_reference(ckpts, data, method):
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    attach(model, method, n=3 if method in DEFAULT_N else None, generator=torch.Generator().manual_seed(1))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in method_tensors(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    encoded = encode_examples(load_task("cb", data, "test"), tok, False)
    assert max(len(t) for t in encoded.targets[0]) > 1  # the cached continuation is used
    scores = candidate_scores(model, encoded, batch_size=5)
    torch.testing.assert_close(scores, naive_scores(model, encoded), atol=2e-5, rtol=1e-5)
    # the method's tensors are trainable, yet scoring builds no autograd graph (it once did: 2-3x the time)
    assert not scores.requires_grad and (
        method == "instance" or all(p.requires_grad for p in method_tensors(model).values())
    )


def test_linear_head_on_t5_and_instance_training_are_refused(ckpts, data, tmp_path, capsys):
    t5, llama = ckpts["t5"], ckpts["llama"]
    with pytest.raises(CaptError, match="linear-head is for decoder-only models"):
        train(
            TrainConfig(
                model=str(t5), task="cb", out=str(tmp_path / "a"), data=str(data), method="linear-head", **FAST
            ),
            progress=False,
        )
    assert not (tmp_path / "a").exists()
    code, _, err = capt(
        "train",
        "--model",
        t5,
        "--task",
        "cb",
        "--out",
        tmp_path / "b",
        "--data",
        data,
        "--method",
        "linear-head",
        capsys=capsys,
    )
    one_line_error(code, err, "linear-head is for decoder-only models")
    code, _, err = capt(
        "run",
        "--model",
        t5,
        "--tasks",
        "cb",
        "--out",
        tmp_path / "c",
        "--data",
        data,
        "--method",
        "linear-head",
        capsys=capsys,
    )
    one_line_error(code, err, "linear-head is for decoder-only models")
    code, _, err = capt(
        "train",
        "--model",
        llama,
        "--task",
        "cb",
        "--out",
        tmp_path / "d",
        "--data",
        data,
        "--method",
        "instance",
        capsys=capsys,
    )
    one_line_error(code, err, "instance trains nothing", "capt eval --method instance")
    with pytest.raises(CaptError, match="instance trains nothing"):
        train(
            TrainConfig(model=str(llama), task="cb", out=str(tmp_path / "e"), data=str(data), method="instance"),
            progress=False,
        )
    for bad, message in (
        (dict(method="capt", n=3), r"n \(vectors per place\) is for"),
        (dict(method="prompt", blocks="odd"), "capt's options"),
        (dict(method="lora"), "not one of"),
    ):
        with pytest.raises(CaptError, match=message):
            TrainConfig(model=str(llama), task="cb", out=str(tmp_path / "f"), **bad)


def test_resume_refuses_another_method_or_n(ckpts, data, tmp_path, capsys):
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    run = str(tmp_path / "run")
    base = dict(model=str(path), task="cb", out=run, data=str(data), **FAST)
    train(TrainConfig(method="prompt", n=2, **base), model=model, tokenizer=tok, progress=False)
    with pytest.raises(CaptError, match=r"other settings: method 'prompt' \(given 'capt'\), n 2 \(given None\)"):
        train(TrainConfig(**base), resume=True, model=model, tokenizer=tok, progress=False)
    with pytest.raises(CaptError, match=r"other settings: n 2 \(given 3\)"):
        train(TrainConfig(method="prompt", n=3, **base), resume=True, model=model, tokenizer=tok, progress=False)
    code, _, err = capt("train", "--out", run, "--resume", "--method", "prefix", capsys=capsys)
    one_line_error(code, err, "other settings: method 'prompt' (given 'prefix')")
    # takes the run's method and n
    code, out, err = capt("train", "--out", run, "--resume", "--device", "cpu", capsys=capsys)
    assert code == 0 and "best prompt tensors from step" in out, err


def test_version_1_state_resumes(ckpts, data, tmp_path):
    """A state.pt of the capsules-only trainer ({block index: vector}) continues like an uninterrupted run."""
    path = ckpts["llama"]
    model, tok = load_model(path), load_tokenizer(path)
    options = dict(model=str(path), task="cb", data=str(data), **dict(FAST, epochs=2, max_steps=4, eval_every=2))
    reference = train(TrainConfig(out=str(tmp_path / "ref"), **options), model=model, tokenizer=tok, progress=False)
    run = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(TrainConfig(out=str(run), **options), model=model, tokenizer=tok, progress=False, stop_after=2)
    state = torch.load(run / "state.pt", weights_only=True)
    old = {int(k.split(".")[1]): v for k, v in state.pop("tensors").items()}
    state["train"]["best"]["capsules"] = {
        int(k.split(".")[1]): v for k, v in state["train"]["best"].pop("tensors").items()
    }
    torch.save(dict(state, version=1, capsules=old), run / "state.pt")
    again = train(TrainConfig(out=str(run), **options), resume=True, model=model, tokenizer=tok, progress=False)
    drop = ("train_seconds",)
    assert {k: v for k, v in again.items() if k not in drop} == {k: v for k, v in reference.items() if k not in drop}
    ref_best, best = (
        load_file(tmp_path / "ref" / "best" / "capsules.safetensors"),
        load_file(run / "best" / "capsules.safetensors"),
    )
    assert all(torch.equal(best[k], ref_best[k]) for k in ref_best)


def test_run_searches_prompt_lengths_and_reports_the_time(ckpts, data, tmp_path, capsys):
    out_dir = tmp_path / "out"
    code, out, err = capt(
        "run",
        "--model",
        ckpts["llama"],
        "--tasks",
        "cb",
        "--method",
        "prompt",
        "--lengths",
        "4,2",
        "--seeds",
        1,
        "--out",
        out_dir,
        "--data",
        data,
        "--max-steps",
        3,
        "--lr",
        0.05,
        "--warmup",
        0,
        "--batch-size",
        8,
        # bf16: the shared model is checked with no fp32 prompt left on it
        "--dtype",
        "bf16",
        "--device",
        "cpu",
        capsys=capsys,
    )
    assert code == 0, err
    results = json.loads((out_dir / "results.json").read_text())
    assert results["method"] == "prompt" and results["lengths"] == [2, 4] and results["seeds"] == [0]
    cb = results["tasks"]["cb"]
    search = cb["search"]
    assert [e["n"] for e in search["lengths"]] == [2, 4] and all(len(e["runs"]) == 1 for e in search["lengths"])
    tests = {n: json.loads((out_dir / "cb" / f"n{n}" / "seed0" / "test.json").read_text()) for n in (2, 4)}
    for e in search["lengths"]:
        assert e["validation"] == tests[e["n"]]["best"]["validation"]["headline"]
        assert e["validation_loss"] == tests[e["n"]]["best"]["loss"]
        assert e["train_seconds"] == pytest.approx(tests[e["n"]]["train_seconds"]) and e["train_seconds"] > 0
    # the runs kept their checkpoints by headline (the default), so the length is chosen by it too: equal headlines
    # go to the lower validation gold NLL, then to the shorter
    chosen = min((2, 4), key=lambda n: (-tests[n]["best"]["validation"]["headline"], tests[n]["best"]["loss"]))
    assert search["select"] == "headline" and search["by"] == "best mean validation headline"
    assert search["chosen"] == cb["n"] == results["n"] == chosen
    assert (
        cb["runs"] == search["lengths"][[2, 4].index(chosen)]["runs"]
        and cb["mean"] == tests[chosen]["metrics"]["headline"]
    )
    total = sum(t["train_seconds"] for t in tests.values())
    assert cb["train_seconds"] == pytest.approx(total, abs=2e-3) and results["train_seconds"] == pytest.approx(
        total, abs=2e-3
    )
    d = read_config(ckpts["llama"])["hidden_size"]
    assert cb["trainable_parameters"] == results["trainable_parameters"] == chosen * d
    assert results["trainable_percent"] == pytest.approx(100 * chosen * d / results["base_parameters"])
    md = (out_dir / "results.md").read_text()
    assert md == out[: len(md)]
    assert f"Method: prompt tuning (`prompt`, n searched over 2, 4), trainable params {chosen * d:,} (" in md
    assert (
        f"Training time: {results['train_seconds']:.1f} s in all over 2 run(s), the prompt length search included" in md
    )
    assert "the length with the best mean validation headline over its seeds kept" in md
    assert f"NLL {tests[chosen]['best']['loss']:.3f}** (" in md
    assert (
        f"**{chosen}: " in md
        and "| task | metric | zero-shot | prompt tuning | per seed | other metrics | n | train s | note |" in md
    )

    code, _, err = capt(
        "run",
        "--model",
        ckpts["llama"],
        "--tasks",
        "cb",
        "--method",
        "capt",
        "--lengths",
        "2",
        "--out",
        tmp_path / "x",
        "--data",
        data,
        capsys=capsys,
    )
    one_line_error(code, err, "lengths are searched for prompt, deep-prompt, prefix, not for capt")



def test_the_length_is_chosen_by_the_rule_the_checkpoints_were_kept_by():
    """capt run --lengths keeps the length whose seeds did best on validation by the runs' own select rule: under
    "loss", the lowest mean gold NLL even where another length's headline is higher; under "headline", the best mean
    headline, equal ones going to the lower mean NLL; then the shorter length. A length without a recorded NLL (runs
    from older capt) competes on its headline alone; one whose runs all failed is passed over."""

    def run(headline, loss):
        return {"validation": {"headline": headline}, "validation_loss": loss, "train_seconds": 1.0}

    searched = {
        8: [run(50.0, 0.70), run(52.0, 0.74)],  # headline 51, NLL 0.72
        32: [run(53.0, 0.75), run(49.0, 0.73)],  # headline 51, NLL 0.74
        64: [run(55.0, 0.80), run(51.0, 0.78)],  # headline 53, NLL 0.79: best headline, worst NLL
    }
    by_headline, by_loss = choose_length(searched), choose_length(searched, "loss")
    assert by_headline["n"] == 64 and by_headline["runs"] is searched[64]
    assert by_loss["n"] == 8 and by_loss["search"]["by"] == "lowest mean validation gold NLL"
    assert [e["validation_loss"] for e in by_loss["search"]["lengths"]] == pytest.approx([0.72, 0.74, 0.79])
    assert [e["validation"] for e in by_loss["search"]["lengths"]] == pytest.approx([51.0, 51.0, 53.0])
    results = {"method": "prompt", "lengths": [8, 32, 64], "seeds": [0, 1], "train_seconds": 6.0,
               "tasks": {"rte": {"search": by_loss["search"]}}}
    text = "\n".join(time_lines(results))
    assert "over 6 run(s), the prompt length search included (3 lengths x 2 seed(s) per task, the length with the " \
           "lowest mean validation gold NLL over its seeds kept)" in text
    assert "- rte: **8: 51.00, NLL 0.720** (2.0 s), 32: 51.00, NLL 0.740 (2.0 s), 64: 53.00, NLL 0.790 (2.0 s)" in text
    del searched[64]
    assert choose_length(searched)["n"] == 8  # equal headlines (51): the lower NLL
    searched[32] = [run(50.0, 0.70), run(52.0, 0.74)]  # now equal in both: the shorter
    assert choose_length(searched)["n"] == choose_length(searched, "loss")["n"] == 8
    assert choose_length({4: [run(50.0, None)], 2: [run(50.0, 0.9)]})["n"] == 2
    assert choose_length({4: [run(60.0, None)], 2: [run(50.0, 0.9)]})["n"] == 4
    assert choose_length({4: [run(60.0, None)], 2: [run(50.0, 0.9)]}, "loss")["n"] == 2
    failed = {"failed": "diverged", "train_seconds": 1.0}
    assert choose_length({2: [failed], 4: [run(40.0, 1.2)]}, "loss")["n"] == 4
    assert choose_length({2: [failed], 4: [failed]})["n"] == 2  # nothing to compare: the shortest

def test_instance_is_evaluated_not_trained(ckpts, data, tmp_path, capsys):
    path = ckpts["llama"]
    code, out, err = capt(
        "eval",
        "--model",
        path,
        "--task",
        "cb",
        "--data",
        data,
        "--method",
        "instance",
        "--json",
        "--device",
        "cpu",
        capsys=capsys,
    )
    assert code == 0, err
    got = json.loads(out)
    model, tok = load_model(path), load_tokenizer(path)
    attach(model, "instance")
    want = evaluate(model, tok, load_task("cb", data, "test"))
    assert got["method"] == "instance" and got["metrics"] == want["metrics"] and got["loss"] == want["loss"]
    code, _, err = capt("eval", "--model", path, "--task", "cb", "--data", data, "--method", "prompt", capsys=capsys)
    one_line_error(code, err, "needs --adapter DIR")

    out_dir = tmp_path / "out"
    code, out, err = capt(
        "run",
        "--model",
        path,
        "--tasks",
        "cb,copa",
        "--method",
        "instance",
        "--out",
        out_dir,
        "--data",
        data,
        "--device",
        "cpu",
        capsys=capsys,
    )
    assert code == 0, err
    results = json.loads((out_dir / "results.json").read_text())
    cb = results["tasks"]["cb"]
    assert results["method"] == "instance" and results["trainable_parameters"] == 0 and results["train_seconds"] == 0
    assert cb["mean"] == want["metrics"]["headline"] and cb["std"] is None and cb["runs"][0]["steps"] == 0
    assert not (out_dir / "cb" / "seed0").exists() and (out_dir / "cb" / "instance.json").is_file()
    assert "Nothing is trained" in out and "Training time: none" in out and "trainable params 0 (0.0000% of" in out


def with_method(path, method, seed=1):
    """The model with `method` attached and its tensors moved off their initial values (capsules start at zero)."""
    model = load_model(path)
    attach(model, method, n=3 if method in DEFAULT_N else None, num_classes=3 if method == "linear-head" else None,
           generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in method_tensors(model).values():
            p.add_(torch.randn(p.shape, generator=g) * 0.5)
    return model


@pytest.mark.parametrize(
    "family,method",
    [("llama", "capt"), ("llama", "prompt"), ("llama", "prefix"), ("llama", "linear-head"), ("t5", "capt")],
)
def test_training_loss_is_the_negative_gold_score(ckpts, data, family, method):
    """batch_nll (teacher forcing, one right-padded batch) = -candidate_scores at the gold candidate (cached,
    left-padded)."""
    path = ckpts[family]
    model, tok = with_method(path, method), load_tokenizer(path)
    encoded = encode_examples(load_task("cb", data, "test"), tok, family == "t5")
    assert len({len(p) for p in encoded.prompts}) > 1  # the batch holds padding
    with torch.no_grad():
        nll = batch_nll(model, encoded, list(range(len(encoded))))
    gold = candidate_scores(model, encoded)[torch.arange(len(encoded)), torch.tensor(encoded.labels)]
    torch.testing.assert_close(nll, -gold, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("method", ["capt", "prompt", "deep-prompt", "prefix", "linear-head"])
def test_right_padded_training_batches_need_no_attention_mask(ckpts, data, method, monkeypatch):
    """Right padding follows every real token, so under causal attention the mask changes nothing:
    batch_nll leaves it out (SDPA's causal path) and its loss equals the loss with the mask."""
    path = ckpts["llama"]
    model, tok = with_method(path, method), load_tokenizer(path)
    encoded = encode_examples(load_task("cb", data, "test"), tok, False)
    idx = list(range(len(encoded)))
    rows = (
        encoded.prompts
        if method == "linear-head"
        else [p + t[ex.label] for p, t, ex in zip(encoded.prompts, encoded.targets, encoded.examples)]
    )
    _, mask = pad(rows)  # (b, L), right-padded
    assert not mask.all()
    masks = []
    entry = "features" if method == "linear-head" else "forward"  # what batch_nll calls: the linear head reads features
    original = getattr(model, entry)

    def spy(*args, **kwargs):
        masks.append(kwargs.get("attention_mask"))
        return original(*args, **kwargs)

    def masking(*args, **kwargs):
        return original(*args, **dict(kwargs, attention_mask=mask))

    with torch.no_grad():
        monkeypatch.setattr(model, entry, spy)
        loss = batch_nll(model, encoded, idx)
        monkeypatch.setattr(model, entry, masking)
        masked = batch_nll(model, encoded, idx)
    assert masks == [None]
    torch.testing.assert_close(loss, masked, atol=1e-6, rtol=1e-6)


def test_t5_decoder_inputs(ckpts):
    model = load_model(ckpts["t5"])
    start = model.config.decoder_start_token_id
    # shifted right, right-padded
    assert decoder_inputs(model, [[5, 6, 1], [7, 1]]).tolist() == [[start, 5, 6], [start, 7, 0]]


def test_compare_puts_runs_side_by_side(ckpts, data, tmp_path, capsys):
    fast = [
        "--seeds",
        1,
        "--data",
        data,
        "--max-steps",
        2,
        "--lr",
        0.05,
        "--warmup",
        0,
        "--batch-size",
        8,
        "--device",
        "cpu",
    ]
    runs = {
        "capt": ["--tasks", "cb,copa"],
        "prompt": ["--tasks", "cb", "--method", "prompt", "--lengths", "2,3"],
        "linear-head": ["--tasks", "cb,copa", "--method", "linear-head"],
        "instance": ["--tasks", "cb", "--method", "instance"],
    }
    for name, argv in runs.items():
        code, _, err = capt("run", "--model", ckpts["llama"], "--out", tmp_path / name, *argv, *fast, capsys=capsys)
        assert code == 0, err
    results = {name: json.loads((tmp_path / name / "results.json").read_text()) for name in runs}
    code, out, err = capt("compare", *(tmp_path / name for name in runs), "--out", tmp_path / "cmp", capsys=capsys)
    assert code == 0, err
    table = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert (tmp_path / "cmp" / "compare.md").read_text() == out[: len((tmp_path / "cmp" / "compare.md").read_text())]
    assert table["tasks"] == ["cb", "copa"] and [r["method"] for r in table["rows"]] == list(runs)
    rows = {r["method"]: r for r in table["rows"]}
    for name, row in rows.items():
        for task, cell in row["tasks"].items():
            assert (
                cell["mean"] == results[name]["tasks"][task]["mean"]
                and cell["std"] == results[name]["tasks"][task]["std"]
            )
    assert "copa" not in rows["prompt"]["tasks"] and "copa" not in rows["instance"]["tasks"]
    d = read_config(ckpts["llama"])["hidden_size"]
    assert rows["capt"]["trainable_parameters"] == [results["capt"]["trainable_parameters"]]
    assert rows["linear-head"]["trainable_parameters"] == [2 * d + 2, 3 * d + 3]  # copa: 2 classes, cb: 3
    # time relative to CaPT over the tasks both ran: prompt ran cb only, with its length search
    capt_cb = results["capt"]["tasks"]["cb"]["train_seconds"]
    assert rows["capt"]["time_vs_capt"] == pytest.approx(1.0)
    assert rows["prompt"]["time_vs_capt"] == pytest.approx(results["prompt"]["tasks"]["cb"]["train_seconds"] / capt_cb)
    assert rows["instance"]["time_vs_capt"] is None
    zero = results["capt"]["tasks"]["cb"]["zero_shot"]["f1"]
    assert table["zero_shot"]["cb"] == {"metric": "f1", "value": zero}
    assert f"| zero-shot | 0 | {zero:.2f} |" in out
    assert f"| prompt tuning (n searched: 2, 3) | {results['prompt']['trainable_parameters']:,} (" in out
    assert f"| linear head | {2 * d + 2:,}-{3 * d + 3:,} (" in out and "| 1.00x |" in out
    cb = results["instance"]["tasks"]["cb"]
    assert f"| instance | 0 (0.0000%) | {cb['mean']:.2f} | - | - | - |" in out

    # the paired comparisons: every pair on the same test rows, from each run's per-example records
    rows_cb = len(results["capt"]["tasks"]["cb"]["zero_shot_examples"]["uid"])
    assert table["test_rows"] == {
        "cb": rows_cb,
        "copa": len(results["capt"]["tasks"]["copa"]["zero_shot_examples"]["uid"]),
    }
    pairs = {(c["a"], c["b"]): c for c in table["paired"]["cb"]}
    assert len(pairs) == 10 and ("zero-shot", "CaPT") in pairs  # zero-shot + 4 rows, every pair once
    c = pairs[("zero-shot", "CaPT")]
    assert c["rows"] == rows_cb and c["seeds"] == [1, 1]
    assert c["a_score"] == pytest.approx(zero) and c["b_score"] == pytest.approx(results["capt"]["tasks"]["cb"]["mean"])
    assert c["low"] <= c["difference"] <= c["high"] and 0 < c["p"] <= 1
    assert "## Paired differences" in out and f"| cb | zero-shot | CaPT | {rows_cb} | 1, 1 |" in out
    budget = rows["capt"]["budget"]
    assert budget["max_steps"] == 2 and budget["steps"] == [2, 2]
    assert "2 optimizer steps a run (patience 5, max steps 2)" in out  # every run took 2: one figure
    assert f"Test rows: cb {rows_cb}, copa" in out
    moved = json.loads((tmp_path / "prompt" / "results.json").read_text())
    moved["tasks"]["cb"]["runs"][0]["examples"]["uid"][0] = "cb:val:other"
    (tmp_path / "moved.json").write_text(json.dumps(moved))
    code, _, err = capt("compare", tmp_path / "capt", tmp_path / "moved.json", capsys=capsys)
    one_line_error(code, err, "were scored on different test rows")
    moved["tasks"]["cb"]["runs"][0]["examples"]["label"] = moved["tasks"]["cb"]["runs"][0]["examples"]["label"][1:]
    (tmp_path / "cut.json").write_text(json.dumps(moved))
    code, _, err = capt("compare", tmp_path / "capt", tmp_path / "cut.json", capsys=capsys)
    one_line_error(code, err, "cut.json: a run's per-example records (\"examples\") are not what capt writes")

    # bad inputs: a missing directory, a file that is not JSON, a run on another base model
    code, _, err = capt("compare", tmp_path / "capt", tmp_path / "nowhere", capsys=capsys)
    one_line_error(code, err, "nowhere: no results.json")
    (tmp_path / "bad.json").write_text("{not json")
    code, _, err = capt("compare", tmp_path / "bad.json", capsys=capsys)
    one_line_error(code, err, "bad.json is not valid JSON")
    (tmp_path / "other.json").write_text("[1, 2]")
    code, _, err = capt("compare", tmp_path / "other.json", capsys=capsys)
    one_line_error(code, err, "is not a `capt run` results file")
    t5 = json.loads((tmp_path / "capt" / "results.json").read_text())
    t5["model_config_sha256"] = "f" * 64
    (tmp_path / "t5.json").write_text(json.dumps(t5))
    code, _, err = capt("compare", tmp_path / "capt", tmp_path / "t5.json", capsys=capsys)
    one_line_error(code, err, "t5.json was made on another base model")


@pytest.mark.parametrize(
    "family,method,lr,scale",
    [
        ("llama", "capt", METHODS["capt"].scaled_lr, "rms"),
        ("llama", "linear-head", 1e-3, "none"),
        ("t5", "prefix", 1e-2, "none"),
        ("llama", "prompt", 0.3, "none"),
        ("t5", "deep-prompt", METHODS["deep-prompt"].scaled_lr, "rms"),
    ],
)
def test_default_learning_rate_by_method(ckpts, data, tmp_path, family, method, lr, scale):
    """Without --lr a run takes its method's default: r of the per-block step scale for capt and deep-prompt,
    one rate for the others (prefix and linear-head differ from prompt tuning's 0.3)."""
    run = tmp_path / "run"
    options = dict(FAST, max_steps=1)
    del options["lr"]
    train(TrainConfig(model=str(ckpts[family]), task="cb", out=str(run), data=str(data), method=method,
                      n=2 if method in DEFAULT_N else None, **options), progress=False)
    saved = json.loads((run / "config.json").read_text())
    assert saved["lr"] == lr and saved["step_scale"] == scale and (saved["step_scales"] is None) == (scale == "none")
