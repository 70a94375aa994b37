"""capt predict (capt/predict.py): labels and scores for unlabelled rows, equal to what capt eval ranks.

The scores are evaluate()'s candidate scores of the same rows, the label their argmax, the
probabilities their softmax; labels come back as the data writes them (task files' values,
COPA's 0 / 1, BoolQ's true / false, one MultiRC line per answer); a run directory gives its task;
the linear head gives class log-probabilities; bad input is one line before any model is loaded.
"""

import dataclasses
import json

import pytest
import torch
from helpers import capt, one_line_error, write_superglue, write_task
from test_train import randomized

import capt.predict as predict_module
from capt import load_model, load_tokenizer
from capt.errors import CaptError
from capt.evaluate import evaluate
from capt.predict import label_values, predict
from capt.tasks import get_task, load_task, read_examples, render
from capt.trainer import TrainConfig, train


@pytest.fixture(scope="module")
def task_file(tmp_path_factory):
    """The review task with an unlabelled test file, and the same rows labelled in labelled/."""
    root = tmp_path_factory.mktemp("predict")
    write_task(root / "labelled", (40, 0, 10))
    return write_task(root, (40, 0, 10), labelled_test=False)




@pytest.mark.parametrize("family", ["llama", "t5"])
@pytest.mark.parametrize("normalize", [False, True])
def test_predictions_are_evaluations_ranking(ckpts, task_file, family, normalize):
    model, tok = randomized(ckpts[family]), load_tokenizer(ckpts[family])
    unlabelled = read_examples(str(task_file), task_file.parent / "data" / "test.jsonl")
    assert all(ex.label is None for ex in unlabelled)
    labelled = load_task(str(task_file.parent / "labelled" / "reviews.json"), None, "test")
    records = predict(model, tok, unlabelled, batch_size=3, normalize=normalize, progress=False)
    reference = evaluate(model, tok, labelled, batch_size=4, normalize=normalize)
    words = ["positive", "negative", "no opinion"]
    scores = torch.tensor([[r["scores"][w] for w in words] for r in records])
    expected = reference["scores"]
    if normalize:
        expected = expected / torch.tensor(
            [[len(tok.encode(w) if model.seq2seq else tok.encode(" " + w, add_special_tokens=False)) for w in words]],
            dtype=torch.float32,
        )
    torch.testing.assert_close(scores, expected, atol=1e-5, rtol=0)
    assert [words.index(r["word"]) for r in records] == reference["predictions"]
    assert [r["label"] for r in records] == [["1", "0", "2"][p] for p in reference["predictions"]]
    probabilities = torch.tensor([[r["probabilities"][w] for w in words] for r in records])
    # scores within 1e-5 give probabilities within 1e-5 / 4 (the softmax's slope p (1 - p) is at most 1/4)
    torch.testing.assert_close(probabilities, expected.softmax(-1), atol=2.5e-6, rtol=0)
    assert [r["row"] for r in records] == list(range(10)) and all("gold" not in r for r in records)


def test_capt_predict_with_a_run_directory(ckpts, task_file, tmp_path, capsys, monkeypatch):
    labelled = task_file.parent / "labelled" / "reviews.json"
    run = tmp_path / "run"
    code, _, err = capt(
        "train",
        "--model",
        ckpts["llama"],
        "--task",
        labelled,
        "--out",
        run,
        "--epochs",
        1,
        "--batch-size",
        8,
        "--max-steps",
        2,
        "--max-length",
        64,
        "--device",
        "cpu",
        capsys=capsys,
    )
    assert code == 0, err
    shown = []
    real = predict_module.candidate_scores
    # the progress flag
    monkeypatch.setattr(predict_module, "candidate_scores", lambda *a, **k: shown.append(a[3]) or real(*a, **k))
    out = tmp_path / "predictions.jsonl"
    # no --task: the run's own; the labelled test file also gives the metrics, which must be the run's test
    code, stdout, err = capt(
        "predict",
        "--model",
        ckpts["llama"],
        "--adapter",
        run,
        "--input",
        labelled.parent / "data" / "test.jsonl",
        "--out",
        out,
        "--device",
        "cpu",
        capsys=capsys,
    )
    assert code == 0, err
    assert shown == [f"test.jsonl, capsules {run / 'best'}"]  # a progress bar that says what it scores
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 10 and all(
        set(r) == {"row", "label", "word", "scores", "probabilities", "gold"} for r in records
    )
    test = json.loads((run / "test.json").read_text())
    assert f"f1 {test['metrics']['f1']:.2f}  accuracy {test['metrics']['accuracy']:.2f}" in stdout
    assert f"written: {out}" in stdout and [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # unlabelled rows: no metrics, no gold
    code, stdout, err = capt(
        "predict",
        "--model",
        ckpts["llama"],
        "--adapter",
        run,
        "--input",
        task_file.parent / "data" / "test.jsonl",
        "--out",
        out,
        "--device",
        "cpu",
        capsys=capsys,
    )
    assert code == 0 and "every row has a label" not in stdout, err
    assert [json.loads(line)["word"] for line in out.read_text().splitlines()] == [r["word"] for r in records]


def test_superglue_rows_keep_their_label_values(ckpts, tmp_path):
    model, tok = randomized(ckpts["llama"]), load_tokenizer(ckpts["llama"])
    data = write_superglue(tmp_path, {"COPA": (0, 4), "BoolQ": (0, 3), "MultiRC": (0, 2)})
    for task, values in (("copa", [0, 1]), ("boolq", [False, True])):
        rows = [
            {k: v for k, v in json.loads(line).items() if k != "label"}
            for line in (data / get_task(task).dirname / "val.jsonl").open()
        ]
        (tmp_path / f"{task}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        records = predict(model, tok, read_examples(task, tmp_path / f"{task}.jsonl"), progress=False)
        assert label_values(get_task(task)) == values and {r["label"] for r in records} <= set(values)
        assert all(r["label"] == values[list(get_task(task).candidates).index(r["word"])] for r in records)
    records = predict(model, tok, read_examples("multirc", data / "MultiRC" / "val.jsonl"), progress=False)
    assert [(r["row"], r["question"], r["answer"]) for r in records] == [
        (i, q, a) for i in range(2) for q in range(2) for a in range(2)
    ]
    assert all("gold" in r and r["gold"] in (0, 1) for r in records)  # these rows have labels


def test_the_linear_head_gives_class_probabilities(ckpts, task_file, tmp_path):
    model, tok = load_model(ckpts["llama"]), load_tokenizer(ckpts["llama"])
    config = TrainConfig(
        model=str(ckpts["llama"]),
        task=str(task_file.parent / "labelled" / "reviews.json"),
        out=str(tmp_path / "run"),
        method="linear-head",
        epochs=1,
        batch_size=8,
        max_steps=1,
        device="cpu",
    )
    train(config, model=model, tokenizer=tok, progress=False)
    records = predict(
        model, tok, read_examples(str(task_file), task_file.parent / "data" / "test.jsonl"), progress=False
    )
    for r in records:
        assert sum(r["probabilities"].values()) == pytest.approx(1, abs=1e-5)
        assert all(
            r["probabilities"][w] == pytest.approx(float(torch.tensor(s).exp()), abs=1e-5)
            for w, s in r["scores"].items()
        )
    with pytest.raises(CaptError, match="the linear head classifies"):
        predict(model, tok, read_examples(str(task_file), task_file.parent / "data" / "test.jsonl"), normalize=True)


@pytest.mark.parametrize(
    "case", ["no input", "bad row", "out is a directory", "no task", "method without adapter", "label unknown"]
)
def test_bad_input_is_one_line_before_loading(ckpts, task_file, tmp_path, capsys, monkeypatch, case):
    monkeypatch.setattr("capt.cli.main.load_model", lambda *a, **k: pytest.fail("the model was loaded"))
    argv = [
        "predict",
        "--model",
        ckpts["llama"],
        "--task",
        task_file,
        "--input",
        task_file.parent / "data" / "test.jsonl",
        "--out",
        tmp_path / "p.jsonl",
        "--device",
        "cpu",
    ]
    fragments = {
        "no input": ["input file not found"],
        "bad row": ["line 2: missing field 'review'"],
        "out is a directory": ["is a directory; give the file to write"],
        "no task": ["needs --task NAME or FILE.json"],
        "method without adapter": ["--method prompt needs --adapter DIR"],
        "label unknown": ["line 1: label 9 is not one of"],
    }[case]
    if case == "no input":
        argv[argv.index("--input") + 1] = tmp_path / "absent.jsonl"
    elif case in ("bad row", "label unknown"):
        bad = tmp_path / "bad.jsonl"
        bad.write_text('{"review": "good", "stars": 5, "label": 9}\n{"stars": 1}\n' if case == "label unknown" else
                       '{"review": "good", "stars": 5}\n{"stars": 1}\n')
        argv[argv.index("--input") + 1] = bad
    elif case == "out is a directory":
        argv[argv.index("--out") + 1] = tmp_path
    elif case == "no task":
        del argv[argv.index("--task"):argv.index("--task") + 2]
    else:
        argv += ["--method", "prompt"]
    code, _, err = capt(*argv, capsys=capsys)
    one_line_error(code, err, *fragments)
    assert not (tmp_path / "p.jsonl").exists()


def predict_argv(ckpts, task_file, out, *extra):
    return ["predict", "--model", ckpts["llama"], "--task", task_file, "--input",
            task_file.parent / "data" / "test.jsonl", "--out", out, "--device", "cpu", *extra]


def test_predict_never_replaces_a_file_it_did_not_write(ckpts, task_file, tmp_path, capsys):
    """--out may name a predictions file (replaced) or an empty one, not another run's config.json or a user's file."""
    config = tmp_path / "config.json"
    config.write_text('{"model": "m", "planned_steps": 12}\n')
    notes = tmp_path / "notes.txt"
    notes.write_text("my own notes\n")
    for path in (config, notes):
        before = path.read_bytes()
        code, _, err = capt(*predict_argv(ckpts, task_file, path), capsys=capsys)
        one_line_error(code, err, f"--out {path} exists and is not a predictions file capt predict wrote")
        assert path.read_bytes() == before
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert capt(*predict_argv(ckpts, task_file, empty), capsys=capsys)[0] == 0
    first = empty.read_text()
    assert len(first.splitlines()) == 10
    assert capt(*predict_argv(ckpts, task_file, empty), capsys=capsys)[0] == 0  # its own output: replaced
    assert empty.read_text() == first


def test_predict_says_which_rows_were_cut_to_the_length_budget(ckpts, task_file, tmp_path, capsys):
    out = tmp_path / "p.jsonl"
    code, stdout, err = capt(*predict_argv(ckpts, task_file, out, "--max-length", 40), capsys=capsys)
    assert code == 0, err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rows = read_examples(str(task_file), task_file.parent / "data" / "test.jsonl")
    tok = load_tokenizer(ckpts["llama"])

    def tokens(ex, words: int | None = None) -> int:  # the row's length with its review's first `words` words
        review = " ".join(ex.fields["review"].split()[:words])
        return len(tok.encode(render(dataclasses.replace(ex, fields={**ex.fields, "review": review}), cue=True)))

    for record, ex in zip(records, rows):
        if tokens(ex) <= 40:
            assert "cut" not in record
        else:  # it lost `lost` words: one fewer lost would be over the budget
            words = len(ex.fields["review"].split()) - record["cut"]["review"]
            assert tokens(ex, words) <= 40 < tokens(ex, words + 1)
    cut = sum("cut" in r for r in records)
    assert 0 < cut < 10, "the budget must cut some rows and not others for this test to mean anything"
    assert f"{cut} of 10 rows did not fit max length 40" in stdout
    code, stdout, _ = capt(*predict_argv(ckpts, task_file, out), capsys=capsys)  # the default budget cuts nothing
    assert code == 0 and "did not fit" not in stdout
    assert all("cut" not in json.loads(line) for line in out.read_text().splitlines())


def test_predict_reads_a_pipe_and_a_fifo(ckpts, task_file, tmp_path, capsys, monkeypatch):
    import os
    import subprocess
    import sys
    import threading

    rows = (task_file.parent / "data" / "test.jsonl").read_bytes()
    out = tmp_path / "p.jsonl"
    code, _, err = capt(*predict_argv(ckpts, task_file, tmp_path / "whole.jsonl"), capsys=capsys)
    assert code == 0, err
    fifo = tmp_path / "rows.fifo"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: fifo.write_bytes(rows))
    writer.start()
    argv = predict_argv(ckpts, task_file, out)
    argv[argv.index("--input") + 1] = fifo
    code, _, err = capt(*argv, capsys=capsys)
    writer.join()
    assert code == 0, err
    assert out.read_text() == (tmp_path / "whole.jsonl").read_text()
    # /dev/stdin from a pipe, as a user types it
    argv[argv.index("--input") + 1] = "/dev/stdin"
    # one thread, as in this process: the same sums in the same order, so the same digits
    done = subprocess.run([sys.executable, "-m", "capt", *map(str, argv)], input=rows, capture_output=True,
                          timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    assert out.read_text() == (tmp_path / "whole.jsonl").read_text()
    # a FIFO nobody writes to: an error after the wait, not a wait without end
    monkeypatch.setenv("CAPT_PIPE_SECONDS", "0.5")
    argv[argv.index("--input") + 1] = fifo
    code, _, err = capt(*argv, capsys=capsys)
    one_line_error(code, err, f"{fifo}: the pipe or FIFO was not closed within 0.5 s (CAPT_PIPE_SECONDS)")
    monkeypatch.setenv("CAPT_PIPE_SECONDS", "soon")  # a bad setting is one line naming it, read when used
    code, _, err = capt(*argv, capsys=capsys)
    one_line_error(code, err, "CAPT_PIPE_SECONDS is 'soon', not a positive number of seconds")
    with open(fifo, "wb"):  # let the reader still waiting in its thread go
        pass


def test_a_label_word_that_begins_another_is_refused_unless_normalized(ckpts, tmp_path, capsys):
    """" the" is the first token of " the man" (the tiny Llama's tokenizer): summed, " the man" scores
    log p(the) + log p(man | the) < log p(the) and could never win; by the mean per token it can."""
    tok = load_tokenizer(ckpts["llama"])
    short, long = (tok.encode(" " + w, add_special_tokens=False) for w in ("the", "the man"))
    assert long[: len(short)] == short and len(long) > len(short)
    path = write_task(tmp_path, (20, 0, 8), labels={"0": "the", "1": "the man", "2": "other"})
    model = load_model(ckpts["llama"])
    examples = load_task(str(path), None, "test")
    with pytest.raises(CaptError, match="the label word 'the' is the start of 'the man'.*--normalize"):
        evaluate(model, tok, examples)
    with pytest.raises(CaptError, match="the label word 'the' is the start of 'the man'"):
        predict(model, tok, examples, progress=False)
    result = evaluate(model, tok, examples, normalize=True)
    assert result["n"] == 8
    code, _, err = capt("train", "--model", ckpts["llama"], "--task", path, "--out", tmp_path / "run", "--max-steps",
                        1, "--device", "cpu", capsys=capsys)
    one_line_error(code, err, "the label word 'the' is the start of 'the man'")
    assert not (tmp_path / "run" / "state.pt").exists()
    t5 = load_model(ckpts["t5"])  # T5's targets end in EOS: no word begins another
    assert evaluate(t5, load_tokenizer(ckpts["t5"]), examples)["n"] == 8
