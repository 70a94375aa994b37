"""capt attention (capt/cli/analysis.py) on tiny random checkpoints and synthetic CB data: the column
groups on a hand-made layout, masses that sum to one per layer and head, a known slot anchor, the
slot-to-token ranking of T5, the files and pictures, --curves, and the one-line errors."""

import json

import pytest
import torch
from helpers import tiny_llama, tiny_t5, write_superglue

from capt.cli.analysis import GROUPS, analyse, attention_report, column_groups, group_masses, recorded, write_report
from capt.cli.main import main
from capt.errors import CaptError
from capt.load import load_model, save_method
from capt.methods import CapsuleConfig, attach, detach, method_tensors
from capt.tasks import load_task, render
from capt.tokenizer import load_tokenizer


def attach_random_capsules(model) -> None:
    """add / all-blocks capsules drawn from N(0, 1), so the slot carries a visible share of attention."""
    attach(model, "capt", capsules=CapsuleConfig(integration="add"))
    with torch.no_grad():
        for p in method_tensors(model).values():
            p.normal_(0, 1)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_superglue(tmp_path_factory.mktemp("data"), {"CB": (20, 6)})


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return tiny_llama(tmp_path_factory.mktemp("llama"), layers=3)


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory):
    return tiny_t5(tmp_path_factory.mktemp("t5"))


def test_column_groups_on_a_hand_made_layout():
    # 1 prefix column, 1 slot, 2 prompt rows, then 4 token columns of which 3 are real (right padding)
    groups = column_groups(1, 1, 2, torch.tensor([[1, 1, 1, 0]]).bool())
    as_lists = {g: groups[g][0].int().tolist() for g in GROUPS}
    assert as_lists == {"front": [1, 0, 1, 1, 0, 0, 0, 0], "slot": [0, 1, 0, 0, 0, 0, 0, 0],
                        "first": [0, 0, 0, 0, 1, 0, 0, 0], "rest": [0, 0, 0, 0, 0, 1, 1, 0]}
    # one head, two queries (the second is padding and must not count): masses by hand
    # (1, 1, 2, 8)
    w = torch.tensor([[0.1, 0.2, 0.0, 0.3, 0.4, 0.0, 0.0, 0.0], [0.5, 0.5, 0, 0, 0, 0, 0, 0]])[None, None]
    m = group_masses(w, groups, torch.tensor([[True, False]]))
    assert {g: round(float(v[0]), 6) for g, v in m.items()} == {"front": 0.4, "slot": 0.2, "first": 0.4, "rest": 0.0}


def assert_masses_sum_to_one(numbers):
    total = torch.stack([torch.tensor(numbers["layer_head"][g]) for g in GROUPS]).sum(0)  # (L, H)
    torch.testing.assert_close(total, torch.ones_like(total), atol=1e-5, rtol=0)


@pytest.mark.parametrize("case", [None, "capt", "deep-prompt", "prefix"])
def test_llama_masses_sum_to_one_and_see_the_slot(llama_dir, data, case):
    model, tokenizer = load_model(llama_dir), load_tokenizer(llama_dir)
    examples = load_task("cb", data, "test")[:5]
    if case == "capt":
        attach(model, "capt", capsules=CapsuleConfig(integration="add"))
    elif case is not None:
        attach(model, case, n=2)
    report = analyse(model, tokenizer, examples, max_length=128, batch_size=2)
    assert report["self"]["queries"] > 0
    assert_masses_sum_to_one(report["self"])
    masses = report["self"]["layer_head"]
    if case is None:
        assert all(v == 0 for row in masses["slot"] + masses["front"] for v in row)
    if case == "capt":
        assert all(v > 0 for row in masses["slot"] for v in row) and all(v == 0 for row in masses["front"] for v in row)
    if case in ("deep-prompt", "prefix"):
        assert all(v > 0 for row in masses["front"] for v in row)
    assert report["slot_to_tokens"] is None  # a causal slot never looks forward
    keys = report["examples"]["0"]["keys"]
    assert list(report["examples"]) == ["0"] and len(report["examples"]["0"]["layers"]) == 3
    assert len(report["examples"]["0"]["layers"]["0"][0]) == len(keys)
    detach(model)


def test_masses_equal_a_direct_reading_of_one_example(llama_dir, data):
    """One example, no padding: the slot mass is the mean over its token rows of column 0, the first-token
    mass that of column 1 (the BOS right after the slot); batched with longer examples the numbers stay."""
    model, tokenizer = load_model(llama_dir), load_tokenizer(llama_dir)
    examples = load_task("cb", data, "test")[:3]
    attach_random_capsules(model)
    # a decoder-only model: the answer cue ends the input
    ids = load_tokenizer(llama_dir).encode(render(examples[0], cue=True))
    with torch.no_grad():
        with recorded(model.prefix_attentions()) as attentions:
            model(torch.tensor([ids]))
    slot = [float(w[0, :, 1:, 0].mean()) for w in attentions]  # rows 1..: the tokens; column 0: the slot
    first = [float(w[0, :, 1:, 1].mean()) for w in attentions]
    alone = analyse(model, tokenizer, examples[:1], 128)["self"]["layer"]
    assert alone["slot"] == pytest.approx(slot, abs=1e-5) and alone["first"] == pytest.approx(first, abs=1e-5)
    together = analyse(model, tokenizer, examples, 128, batch_size=3)["self"]["layer"]
    by_one = [analyse(model, tokenizer, [ex], 128)["self"] for ex in examples]
    weights = [r["queries"] for r in by_one]
    mean = [sum(r["layer"]["slot"][l] * n for r, n in zip(by_one, weights)) / sum(weights) for l in range(len(slot))]
    assert together["slot"] == pytest.approx(mean, abs=1e-5)
    detach(model)


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_chosen_examples_maps_equal_each_example_alone(llama_dir, t5_dir, data, family):
    """--examples 1,4: rows 1 (padded, in the first batch) and 4 (first of the second batch) have the maps each
    example has when analysed alone; an index past the split is one line."""
    path = llama_dir if family == "llama" else t5_dir
    model, tokenizer = load_model(path), load_tokenizer(path)
    examples = load_task("cb", data, "test")[:5]
    attach_random_capsules(model)
    report = analyse(model, tokenizer, examples, 128, batch_size=3, shown=[4, 1])
    assert list(report["examples"]) == ["1", "4"]
    for i in (1, 4):
        alone = analyse(model, tokenizer, [examples[i]], 128)["examples"]["0"]
        assert report["examples"][str(i)]["keys"] == alone["keys"]
        for layer, rows in alone["layers"].items():
            torch.testing.assert_close(
                torch.tensor(report["examples"][str(i)]["layers"][layer]), torch.tensor(rows), atol=2e-5, rtol=0
            )
    assert report["examples"]["1"]["keys"] != report["examples"]["4"]["keys"]
    with pytest.raises(CaptError, match="--examples 5: the split has 5 examples here"):
        analyse(model, tokenizer, examples, 128, shown=[5])
    detach(model)


def test_t5_encoder_cross_and_slot_to_tokens(t5_dir, data, tmp_path):
    model, tokenizer = load_model(t5_dir), load_tokenizer(t5_dir)
    examples = load_task("cb", data, "test")[:4]
    attach(model, "instance")
    report = analyse(model, tokenizer, examples, max_length=128, batch_size=3)
    assert_masses_sum_to_one(report["encoder"])
    assert_masses_sum_to_one(report["cross"])
    top = report["slot_to_tokens"]["top"]
    assert top and all(t["mass"] >= u["mass"] for t, u in zip(top, top[1:]))
    # every template holds "hypothesis:": its pieces are in every example
    assert max(t["examples"] for t in top) == len(examples)
    # the slot rows' attention to all tokens plus to the front sums to at most one per example
    assert sum(t["mass"] for t in top) <= 1.0 + 1e-6
    written = write_report(
        attention_report(model, tokenizer, examples, "cb", "test", data, 128, "instance", "instance"), tmp_path / "t5"
    )
    assert [p.name for p in written] == ["attention.json", "heatmap.png", "maps.png"]
    detach(model)


def test_capt_attention_command(llama_dir, data, tmp_path, capsys):
    model = load_model(llama_dir)
    attach_random_capsules(model)
    save_method(model, tmp_path / "caps")
    out = tmp_path / "att"
    code = main(
        [
            "attention",
            "--model",
            str(llama_dir),
            "--task",
            "cb",
            "--capsules",
            str(tmp_path / "caps"),
            "--data",
            str(data),
            "--split",
            "test",
            "--limit",
            "4",
            "--examples",
            "0,2",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    assert code == 0, capsys.readouterr().err
    report = json.loads((out / "attention.json").read_text())
    assert list(report["examples"]) == ["0", "2"]
    assert report["n"] == 4 and report["method"] == "capt" and report["model_config_sha256"]
    assert set(report["data_files"]["cb"]) == {"train.jsonl", "val.jsonl"} and report["command"].startswith("capt ")
    assert (out / "heatmap.png").stat().st_size > 1000 and (out / "maps.png").stat().st_size > 1000
    code = main(
        [
            "attention",
            "--model",
            str(llama_dir),
            "--task",
            "cb",
            "--method",
            "instance",
            "--data",
            str(data),
            "--split",
            "test",
            "--limit",
            "4",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "inst"),
        ]
    )
    assert code == 0
    code = main(
        ["attention", "--curves", str(out / "attention.json"), str(tmp_path / "inst"), "--out", str(tmp_path / "both")]
    )
    assert code == 0 and (tmp_path / "both" / "curves.png").stat().st_size > 1000
    capsys.readouterr()
    # a report of another task: the message names that file
    other = json.loads((out / "attention.json").read_text())
    (tmp_path / "rte.json").write_text(json.dumps(dict(other, task="rte")))
    code = main(["attention", "--curves", str(out / "attention.json"), str(tmp_path / "rte.json"), "--out",
                 str(tmp_path / "mixed")])
    err = capsys.readouterr().err
    assert code == 1 and len(err.splitlines()) == 1
    assert f"of different tasks or models: {tmp_path / 'rte.json'} is not of cb on config sha256 " in err


def test_capt_attention_errors(llama_dir, data, tmp_path, capsys):
    code = main(
        [
            "attention",
            "--model",
            str(llama_dir),
            "--task",
            "cb",
            "--data",
            str(data),
            "--split",
            "test",
            "--limit",
            "3",
            "--examples",
            "1,3",
            "--device",
            "cpu",
            "--out",
            str(tmp_path / "z"),
        ]
    )
    err = capsys.readouterr().err
    assert code == 1 and err == "capt: error: --examples 1,3: the split has 3 examples here (0..2)\n"
    code = main(["attention", "--task", "cb", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("capt: error: capt attention needs --model") and len(err.splitlines()) == 1
    (tmp_path / "bad.json").write_text("{}")
    code = main(["attention", "--curves", str(tmp_path / "bad.json"), "--out", str(tmp_path / "y")])
    err = capsys.readouterr().err
    assert code == 1 and "not an attention.json" in err and len(err.splitlines()) == 1


def test_eval_with_pooled_instance_tokens(llama_dir, data, tmp_path, capsys):
    base = ["eval", "--model", str(llama_dir), "--task", "cb", "--data", str(data), "--device", "cpu", "--json"]
    assert main(base + ["--method", "pooled", "--n", "2"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["method"] == "pooled" and record["pooled"] == 2 and record["n"] == 6
    model = load_model(llama_dir)
    attach(model, "deep-prompt", n=1)
    save_method(model, tmp_path / "deep")
    assert main(base + ["--method", "pooled", "--n", "3", "--adapter", str(tmp_path / "deep")]) == 0
    assert json.loads(capsys.readouterr().out)["method"] == "pooled+deep-prompt"
    attach(model, "prompt", n=2)
    save_method(model, tmp_path / "prompt")
    assert main(base + ["--method", "pooled", "--n", "3", "--adapter", str(tmp_path / "prompt")]) == 1
    assert "not on prompt" in capsys.readouterr().err
    assert main(base + ["--method", "pooled"]) == 1
    assert "with --n K" in capsys.readouterr().err
