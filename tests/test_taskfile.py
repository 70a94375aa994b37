"""Your own task (capt/taskfile.py, capt/tasks.py): a task file is read into a Task that the rest of
capt serves unchanged. Reading and checking the file, one line per mistake (in the file and in its
data); splits (own validation file, or the seeded 90/10 split); the template and its shortening;
both metrics with the chosen headline; rank classification equal to the naive reference with
multi-token label words; train / eval / resume / run through the command line with the task file
recorded; linear-head and T5 on it."""

import json
import math
from pathlib import Path

import pytest
import torch
from helpers import SENTIMENT, capt, one_line_error, write_superglue, write_task
from test_train import naive_scores, randomized

from capt import load_tokenizer
from capt.errors import CaptError
from capt.evaluate import encode_examples, evaluate
from capt.tasks import get_task, load_task, read_examples, render, score
from capt.taskfile import read_task_file
from capt.trainer import TrainConfig, train

FAST = ["--epochs", "1", "--batch-size", "8", "--max-steps", "2", "--device", "cpu"]
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    """train 40 rows and test 12, no validation file (so the train file is split 90/10)."""
    return write_task(tmp_path_factory.mktemp("task"), (40, 0, 12))




def test_a_task_file_becomes_a_task(task_file):
    spec = read_task_file(task_file)
    folder = task_file.parent
    assert spec.name == "reviews" and spec.fields == ("review", "stars") and spec.shorten == "review"
    assert spec.words == ("positive", "negative", "no opinion") and spec.values == ("1", "0", "2")  # the file's order
    assert spec.metrics == ("f1", "accuracy")  # macro-F1 first: the headline
    assert spec.train == str(folder / "data" / "train.jsonl") and spec.validation is None  # relative to the task file
    task = get_task(str(task_file))
    assert task is get_task(str(task_file))  # read once while the file is unchanged
    assert task.name == "reviews" and task.candidates == spec.words and task.spec == str(task_file.absolute())


def test_defaults_and_label_lists(tmp_path):
    path = write_task(tmp_path, (10, 0, 0), name=None, label_field=None, metric=None, shorten=None, test=None,
                      labels=["negative", "positive"])
    spec = read_task_file(path)
    assert spec.name == "reviews" and spec.label_field == "label" and spec.metrics == ("accuracy", "f1")
    assert spec.values == spec.words == ("negative", "positive") and spec.shorten is None and spec.test is None
    other = tmp_path / "my-task.json"
    other.write_text(
        json.dumps({"train": "data/train.jsonl", "template": "{review}", "labels": {"true": "yes", "false": "no"}})
    )
    assert read_task_file(other).name == "my-task"


@pytest.mark.parametrize("change,fragment", [
    ({"template": None}, "missing key 'template'"),
    ({"train": None}, "missing key 'train'"),
    ({"lables": ["a", "b"]}, "unknown key 'lables'"),
    ({"template": "Review: {review} {txt}", "shorten": "text"}, "shorten 'text' is not one of the template's "
                                                                "placeholders: review, txt"),
    ({"template": "Review: {review:>5}"}, "template placeholder {review:>5} is not a plain {field}"),
    ({"template": "Review: {}"}, "template placeholder {} is not a plain {field}"),
    ({"template": "Review: {review.text}"}, "template placeholder {review.text}"),
    ({"template": "Review: {review"}, "the template is not valid"),
    ({"template": "no placeholder"}, "the template has no {field} placeholder"),
    ({"template": "{review} {label}"}, "the template reads the label field {label}"),
    ({"labels": "negative,positive"}, "'labels' should be a list of label words"),
    ({"labels": ["negative"]}, "needs at least two label words"),
    ({"labels": {"0": "bad", "1": "bad"}}, "label word 'bad' is given twice"),
    ({"labels": {"0": " bad", "1": "good"}}, "label word \" bad\" should be non-empty text"),
    ({"labels": ["good", 1]}, "label word 1 should be non-empty text"),
    ({"metric": "f1"}, "metric 'f1' is not one of accuracy, macro-f1"),
    ({"name": "cb"}, "name 'cb' is a SuperGLUE task's"),
    ({"name": "my task"}, "name 'my task' should be letters, digits"),
    ({"train": ""}, "'train' should be a non-empty string"),
])
def test_bad_task_files_are_one_line(tmp_path, change, fragment):
    path = write_task(tmp_path, (10, 0, 4))
    spec = {k: v for k, v in {**json.loads(path.read_text()), **change}.items() if v is not None}
    path.write_text(json.dumps(spec))
    with pytest.raises(CaptError) as e:
        get_task(str(path))
    assert fragment in str(e.value) and str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("text,fragment", [("", "is not valid JSON (the file is empty)"), ("[1, 2]", "is not a task "
                                                                                                     "file: it holds a "
                                                                                                     "JSON list, not "
                                                                                                     "an object"),
                                           ("{'train': 1}", "is not valid JSON")])
def test_unreadable_task_files_are_one_line(tmp_path, text, fragment):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(CaptError, match=fragment.replace("(", r"\(").replace(")", r"\)")):
        get_task(str(path))
    with pytest.raises(CaptError, match="task file not found"):
        get_task(str(tmp_path / "absent.json"))


def test_splits_templates_and_shortening(tmp_path, task_file):
    train, val, test = (load_task(str(task_file), None, split, seed=3) for split in ("train", "validation", "test"))
    rows = [json.loads(line) for line in (task_file.parent / "data" / "train.jsonl").read_text().splitlines()]
    assert len(val) == 4 and len(train) == 36 and len(test) == 12  # 10% of 40, round half up
    assert sorted(int(ex.uid.split(":")[2]) for ex in train + val) == list(range(40))  # a partition of the rows
    assert load_task(str(task_file), None, "validation", seed=4) != val  # the seed chooses the split
    ex = train[0]
    row = rows[int(ex.uid.split(":")[2])]
    assert ex.task == str(task_file.absolute()) and ex.candidates == ["positive", "negative", "no opinion"]
    # value -> its word's index
    assert [ex.label for ex in train] == [[1, 0, 2][rows[int(e.uid.split(":")[2])]["label"]] for e in train]
    assert ex.fields == {"review": row["review"], "stars": str(row["stars"])}
    assert render(ex) == f"Review: {row['review']} Stars: {row['stars']}. Opinion:"

    words = lambda text: len(text.split())  # noqa: E731 (a counter: one token per word)
    long = load_task(str(task_file), None, "test")[0]
    long.fields["review"] = " ".join(f"w{i}" for i in range(50))
    cut = render(long, max_len=20, count_tokens=words)
    assert words(cut) == 20 and cut.startswith("Review: w0 w1") and cut.endswith(f"Stars: {long.fields['stars']}. "
                                                                                 "Opinion:")

    own = write_task(tmp_path, (30, 7, 5))  # a validation file of its own: no split, the seed changes nothing
    assert [len(load_task(str(own), None, s, seed=9)) for s in ("train", "validation", "test")] == [30, 7, 5]
    assert {ex.uid.split(":")[1] for ex in load_task(str(own), None, "validation")} == {"validation"}


@pytest.mark.parametrize("row,fragment", [
    ({"review": "fine", "stars": 3, "label": 7}, 'line 2: label 7 is not one of the task\'s labels (1, 0, 2;'),
    ({"review": "fine", "stars": 3}, "line 2: missing field 'label' (the task's label field)"),
    ({"stars": 3, "label": 0}, "line 2: missing field 'review' (the template's {review})"),
    ({"review": ["a"], "stars": 3, "label": 0}, "line 2: field 'review' should be text or a number"),
    ({"review": "fine", "stars": 3, "label": 0.5}, "line 2: label 0.5 is not one of the task's labels"),
])
def test_bad_rows_are_one_line(tmp_path, row, fragment):
    path = write_task(tmp_path, (10, 0, 4))
    test = tmp_path / "data" / "test.jsonl"
    test.write_text(test.read_text().splitlines()[0] + "\n" + json.dumps(row) + "\n")
    with pytest.raises(CaptError, match=str(test)) as e:
        load_task(str(path), None, "test")
    assert fragment in str(e.value)


def test_missing_or_empty_data_files_are_one_line(tmp_path, ckpts, capsys):
    path = write_task(tmp_path, (10, 0, 0))
    with pytest.raises(CaptError, match="names no test file; add \"test\""):
        load_task(str(path), None, "test")
    code, _, err = capt(
        "train", "--model", ckpts["llama"], "--task", path, "--out", tmp_path / "run", *FAST, capsys=capsys
    )
    one_line_error(code, err, "reviews.json names no test file")
    assert not (tmp_path / "run" / "state.pt").exists()
    path = write_task(tmp_path, (10, 0, 4), test="data/absent.jsonl")
    with pytest.raises(CaptError, match=r"task reviews: its test file is missing: .*absent.jsonl \(named by"):
        load_task(str(path), None, "test")
    (tmp_path / "data" / "train.jsonl").write_text("\n")
    with pytest.raises(CaptError, match="no examples"):
        load_task(str(path), None, "train")


@pytest.mark.parametrize("metric,keys", [("macro-f1", ("f1", "accuracy")), ("accuracy", ("accuracy", "f1"))])
def test_both_metrics_with_the_chosen_headline(tmp_path, metric, keys):
    path = write_task(tmp_path, (10, 0, 6), metric=metric)
    examples = load_task(str(path), None, "test")
    labels = [ex.label for ex in examples]
    predictions = [0, 1, 1, 2, 2, 0]
    got = score(str(path), predictions, examples)
    assert list(got) == ["headline", *keys] and got["headline"] == got[keys[0]]
    right = sum(p == y for p, y in zip(predictions, labels))
    assert got["accuracy"] == 100 * right / 6

    def f1(c):  # per class, by hand
        tp = sum(p == c == y for p, y in zip(predictions, labels))
        fp = sum(p == c != y for p, y in zip(predictions, labels))
        fn = sum(y == c != p for p, y in zip(predictions, labels))
        return 2 * tp / (2 * tp + fp + fn) if tp else 0.0

    classes = set(labels) | set(predictions)
    assert math.isclose(got["f1"], 100 * sum(f1(c) for c in classes) / len(classes))
    with pytest.raises(CaptError, match="example 0 has no label"):
        score(str(path), predictions, [type(ex)(ex.task, ex.fields, ex.candidates, None) for ex in examples])


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_rank_classification_equals_the_naive_reference(ckpts, task_file, family):
    model, tok = randomized(ckpts[family]), load_tokenizer(ckpts[family])
    examples = load_task(str(task_file), None, "test")
    encoded = encode_examples(examples, tok, model.seq2seq)
    assert len(encoded.targets[0][2]) > 1  # "no opinion": several tokens
    result = evaluate(model, tok, data=encoded, batch_size=5)
    expected = naive_scores(model, encoded)
    torch.testing.assert_close(result["scores"], expected, atol=2e-5, rtol=1e-5)
    assert result["task"] == "reviews" and result["metrics"] == score(
        str(task_file), expected.argmax(1).tolist(), examples
    )


def test_train_eval_resume_and_run_on_a_task_file(ckpts, tmp_path, capsys):
    folder = tmp_path / "task"
    path = write_task(folder, (40, 8, 12))
    run = tmp_path / "run"
    code, out, err = capt("train", "--model", ckpts["llama"], "--task", path, "--out", run, *FAST, capsys=capsys)
    assert code == 0, err
    assert "reviews test (12 examples)" in out and "headline f1" in out
    config, test = json.loads((run / "config.json").read_text()), json.loads((run / "test.json").read_text())
    assert config["task"] == str(path.absolute()) and config["data"] is None
    assert config["task_file"] == {"path": str(path.absolute()), "sha256": read_task_file(path).sha256}
    assert config["examples"] == {"train": 40, "validation": 8, "test": 12}
    assert test["task"] == "reviews" and test["task_file"] == config["task_file"]

    # eval of the run: the task, max length and dtype come from its config.json
    code, out, err = capt(
        "eval", "--model", ckpts["llama"], "--adapter", run, "--device", "cpu", "--json", capsys=capsys
    )
    assert code == 0, err
    assert json.loads(out)["metrics"] == test["metrics"]
    # resume of the finished run, from another directory's point of view: the recorded absolute path
    code, out, err = capt("train", "--out", run, "--resume", capsys=capsys)
    assert code == 0 and "reviews test (12 examples)" in out, err
    # a changed task file is refused on resume
    path.write_text(path.read_text().replace("Opinion:", "Verdict:"))
    code, _, err = capt("train", "--out", run, "--resume", capsys=capsys)
    one_line_error(code, err, "was trained on the task file", "restore the file or use a new --out")

    # capt run with a SuperGLUE task and the task file side by side
    data = write_superglue(tmp_path / "data", {"CB": (20, 6)})
    code, out, err = capt(
        "run",
        "--model",
        ckpts["llama"],
        "--tasks",
        f"cb,{path}",
        "--data",
        data,
        "--seeds",
        1,
        "--out",
        tmp_path / "table",
        *FAST,
        capsys=capsys,
    )
    assert code == 0, err
    results = json.loads((tmp_path / "table" / "results.json").read_text())
    assert (
        list(results["tasks"]) == ["cb", "reviews"]
        and (tmp_path / "table" / "reviews" / "seed0" / "test.json").is_file()
    )
    assert results["tasks"]["reviews"]["task_file"]["sha256"] == read_task_file(path).sha256
    assert results["tasks"]["reviews"]["metric"] == "f1"
    assert set(results["data_files"]["reviews"]) == {"task file", "train", "validation", "test"}
    assert "| reviews | f1 |" in out and "a task file's task: its test file" in out


def test_a_data_directory_is_not_needed_for_task_files(ckpts, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # no data/superglue here
    monkeypatch.delenv("CAPT_DATA", raising=False)
    path = write_task(tmp_path / "task", (20, 0, 6))
    code, _, err = capt(
        "run", "--model", ckpts["llama"], "--tasks", path, "--seeds", 1, "--out", "table", *FAST, capsys=capsys
    )
    assert code == 0, err
    assert json.loads(Path("table/results.json").read_text())["settings"]["data"] is None
    two = write_task(tmp_path / "other", (20, 0, 6))
    code, _, err = capt(
        "run", "--model", ckpts["llama"], "--tasks", f"{path},{two}", "--out", "t2", *FAST, capsys=capsys
    )
    one_line_error(code, err, "two tasks are named reviews")


@pytest.mark.parametrize(
    "family,method", [("llama", "linear-head"), ("llama", "prefix"), ("t5", "capt"), ("t5", "prompt")]
)
def test_methods_train_on_a_task_file(ckpts, task_file, tmp_path, family, method):
    config = TrainConfig(
        model=str(ckpts[family]),
        task=str(task_file),
        out=str(tmp_path / "run"),
        method=method,
        epochs=1,
        batch_size=8,
        max_steps=2,
        device="cpu",
    )
    result = train(config, progress=False)
    assert (
        result["task"] == "reviews"
        and result["steps"] == 2
        and set(result["metrics"]) == {"headline", "f1", "accuracy"}
    )
    if method == "linear-head":  # one class per label word
        assert json.loads((tmp_path / "run" / "best" / "adapter.json").read_text())["method_config"][
            "num_classes"
        ] == len(SENTIMENT)


def test_the_shipped_example_reads_the_shipped_cb_files():
    path = ROOT / "examples" / "cb-yes-no.json"
    train, val, test = (load_task(str(path), None, split) for split in ("train", "validation", "test"))
    assert (len(train), len(val), len(test)) == (225, 25, 56)
    official = load_task("cb", ROOT / "data" / "superglue", "test")
    assert [ex.label for ex in test] == [ex.label for ex in official]  # yes / no / maybe in CB's label order
    assert [ex.fields for ex in test] == [ex.fields for ex in official]
    assert render(test[0]).startswith(f"Premise: {test[0].fields['premise']}\nHypothesis: ")
    rows = read_examples(str(path), ROOT / "examples" / "unlabelled.jsonl")
    assert len(rows) == 3 and all(ex.label is None for ex in rows)


def test_a_space_at_the_templates_end_is_dropped_with_a_warning(tmp_path, ckpts):
    """A decoder reads a label word as " " + word after the input: "Answer: " + " yes" would hold two spaces."""
    from capt.errors import CaptWarning

    plain = write_task(tmp_path / "a", (10, 0, 4), template="Review: {review} Stars: {stars} Answer:")
    spaced = write_task(tmp_path / "b", (10, 0, 4), template="Review: {review} Stars: {stars} Answer: ")
    with pytest.warns(
        CaptWarning, match=r"the template ends with a space, which is dropped: label words are scored as"
    ):
        task = read_task_file(spaced)
    assert task.template == read_task_file(plain).template
    tok = load_tokenizer(ckpts["llama"])
    a = encode_examples(load_task(str(plain), None, "test"), tok, False)
    with pytest.warns(CaptWarning, match="the template ends with a space"):  # read again, told again
        b = encode_examples(load_task(str(spaced), None, "test"), tok, False)
    assert a.prompts == b.prompts and a.targets == b.targets
