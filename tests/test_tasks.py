"""SuperGLUE tasks: templates, shortening, splits, metrics, real-data counts and bad input."""

import hashlib
import json
import os
import re
from pathlib import Path

import pytest

from capt.errors import CaptError
from capt.tasks import (
    TASKS,
    Example,
    get_task,
    load_task,
    macro_f1,
    paper_average,
    render,
    resolve_data_dir,
    score,
    strip_html,
    task_dir,
)

# One hand-written official row per task, and the input text each must give.
ROWS = {
    "BoolQ": {"question": "is the sky blue", "passage": "Sky -- The sky  is blue.", "idx": 0, "label": True},
    "CB": {"premise": "He said it rained.", "hypothesis": "it rained", "label": "neutral", "idx": 0},
    "COPA": {"premise": "The man fell.", "choice1": "He slipped.", "choice2": "He sang.",
             "question": "cause", "label": 0, "idx": 0},
    "MultiRC": {"idx": 0, "version": 1.1, "passage": {
        "text": "<b>Sent 1: </b>Tom ran home.<br><b>Sent 2: </b>He  was late.<br>",
        "questions": [
            {"question": "Who ran?", "idx": 0, "answers": [
                {"text": "Tom", "idx": 0, "label": 1}, {"text": "Ann", "idx": 1, "label": 0}]},
            {"question": "Was he late?", "idx": 1, "answers": [{"text": "Yes", "idx": 2, "label": 1}]},
        ]}},
    "RTE": {"premise": "Cats purr.", "hypothesis": "Dogs purr.", "label": "not_entailment", "idx": 0},
    "WiC": {"word": "bank", "sentence1": "The river bank.", "sentence2": "The bank lent money.",
            "idx": 0, "label": False, "start1": 10, "end1": 14, "start2": 4, "end2": 8, "version": 1.1},
}
EXPECTED = {
    "BoolQ": ["boolq passage: Sky -- The sky is blue. question: is the sky blue"],
    "CB": ["cb hypothesis: it rained premise: He said it rained."],
    "COPA": ["copa choice1: He slipped. choice2: He sang. premise: The man fell. question: cause"],
    "MultiRC": [
        "multirc answer: Tom paragraph: Tom ran home. He was late. question: Who ran?",
        "multirc answer: Ann paragraph: Tom ran home. He was late. question: Who ran?",
        "multirc answer: Yes paragraph: Tom ran home. He was late. question: Was he late?",
    ],
    "RTE": ["rte sentence1: Cats purr. sentence2: Dogs purr."],
    "WiC": ["wic sentence1: The river bank. sentence2: The bank lent money. word: bank"],
}
LABELS = {"BoolQ": [1], "CB": [2], "COPA": [0], "MultiRC": [1, 0, 1], "RTE": [1], "WiC": [0]}


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def words(text: str) -> int:
    return len(text.split())


def make_data(root: Path, n_train: int = 30, dirname=str) -> Path:
    """Every task with val = the hand-written row, train = n_train copies with distinct idx."""
    for name, row in ROWS.items():
        write_jsonl(root / dirname(name) / "val.jsonl", [row])
        write_jsonl(root / dirname(name) / "train.jsonl", [{**row, "idx": i} for i in range(n_train)])
    return root


@pytest.fixture
def data(tmp_path):
    return make_data(tmp_path / "sg")


# --- templates ------------------------------------------------------------------------------


@pytest.mark.parametrize("dirname", list(ROWS))
def test_template_strings(data, dirname):
    examples = load_task(dirname.lower(), data, "test")
    assert [render(ex) for ex in examples] == EXPECTED[dirname]
    assert [ex.label for ex in examples] == LABELS[dirname]
    assert all(ex.candidates == list(TASKS[dirname.lower()].candidates) for ex in examples)


def test_candidates_are_the_method_words():
    assert {name: t.candidates for name, t in TASKS.items()} == {
        "boolq": ("False", "True"),
        "cb": ("entailment", "contradiction", "neutral"),
        "copa": ("choice1", "choice2"),
        "multirc": ("False", "True"),
        "rte": ("entailment", "not_entailment"),
        "wic": ("False", "True"),
    }


def test_multirc_html_stripped_and_grouped(data):
    assert strip_html("<b>Sent 1: </b>A b.<br><b>Sent 2: </b>C <i>d</i>.<br>") == "A b. C d ."
    examples = load_task("multirc", data, "test")
    assert all("<" not in ex.fields["paragraph"] for ex in examples)
    assert [ex.group for ex in examples] == [(0, 0), (0, 0), (0, 1)]
    assert len({ex.uid for ex in examples}) == 3


def test_names_case_insensitive(tmp_path):
    root = make_data(tmp_path / "lower", n_train=10, dirname=str.lower)
    for name in ("BoolQ", "BOOLQ", "boolq"):
        assert render(load_task(name, root, "test")[0]) == EXPECTED["BoolQ"][0]
    assert get_task("MultiRC").name == "multirc"


# --- shortening -----------------------------------------------------------------------------


def long_example(task: str, fields: dict) -> Example:
    return Example(task, fields, list(TASKS[task].candidates), 0)


def test_shortening_cuts_only_the_long_field():
    passage = " ".join(f"w{i}" for i in range(1000))
    ex = long_example("boolq", {"passage": passage, "question": "is it long"})
    text = render(ex, max_len=50, count_tokens=words)
    assert words(text) == 50
    assert text == "boolq passage: " + " ".join(f"w{i}" for i in range(44)) + " question: is it long"
    assert render(ex, max_len=2000, count_tokens=words) == render(ex)  # fits: untouched

    ex = long_example("copa", {"choice1": "a b c", "choice2": "d e", "premise": passage, "question": "effect"})
    text = render(ex, max_len=30, count_tokens=words)
    assert text.startswith("copa choice1: a b c choice2: d e premise: w0 w1 ")
    assert text.endswith(" question: effect") and words(text) == 30

    ex = long_example("multirc", {"answer": "an answer", "paragraph": passage, "question": "what now?"})
    text = render(ex, max_len=20, count_tokens=words)
    assert text.startswith("multirc answer: an answer paragraph: w0 ")
    assert text.endswith(" question: what now?") and words(text) == 20

    ex = long_example("rte", {"sentence1": passage, "sentence2": "short hypothesis"})
    assert render(ex, max_len=20, count_tokens=words).endswith(" sentence2: short hypothesis")


def test_shortening_is_a_search_not_a_walk():
    calls = []

    def counting(text):
        calls.append(text)
        return words(text)

    ex = long_example("boolq", {"passage": "x " * 20000, "question": "q"})
    assert words(render(ex, max_len=256, count_tokens=counting)) == 256
    assert len(calls) <= 20


def test_shortening_never_touches_other_fields():
    # WiC has no shortenable field; when even an empty field cannot fit, the rest stays whole.
    ex = long_example("wic", {"sentence1": "a " * 300, "sentence2": "b", "word": "a"})
    assert render(ex, max_len=10, count_tokens=words) == render(ex)
    ex = long_example("cb", {"hypothesis": " ".join(["h"] * 50), "premise": " ".join(["p"] * 50)})
    assert render(ex, max_len=10, count_tokens=words) == "cb hypothesis: " + "h " * 50 + "premise:"


# --- splits ---------------------------------------------------------------------------------


def test_splits_deterministic_disjoint_covering(data):
    uids = lambda split, seed: [ex.uid for ex in load_task("rte", data, split, seed)]
    train, val = uids("train", 1), uids("validation", 1)
    assert train == uids("train", 1) and val == uids("validation", 1)
    assert len(val) == 3 and len(train) == 27
    assert not set(train) & set(val)
    assert sorted(train + val) == sorted(uids("train", 1) + uids("validation", 1))
    assert set(train + val) == {f"rte:train:{i}" for i in range(30)}
    assert val != uids("validation", 2)


def test_multirc_split_keeps_paragraphs_whole(data):
    train = load_task("multirc", data, "train", seed=3)
    val = load_task("multirc", data, "validation", seed=3)
    assert {ex.group[0] for ex in train}.isdisjoint({ex.group[0] for ex in val})
    assert len(train) + len(val) == 30 * 3 and len(val) == 3 * 3


# --- metrics --------------------------------------------------------------------------------


def examples_for(task, labels, groups=None):
    groups = groups or [None] * len(labels)
    return [Example(task, {}, list(TASKS[task].candidates), y, g, str(i))
            for i, (y, g) in enumerate(zip(labels, groups))]


def test_cb_macro_f1_with_a_class_never_predicted():
    labels, preds = [0, 0, 1, 1, 2], [0, 0, 1, 0, 1]
    # class 0: tp 2 fp 1 fn 0 -> 0.8; class 1: tp 1 fp 1 fn 1 -> 0.5; class 2 never predicted -> 0.
    s = score("cb", preds, examples_for("cb", labels))
    assert s["f1"] == pytest.approx(100 * (0.8 + 0.5 + 0) / 3)
    assert s["accuracy"] == pytest.approx(60.0)
    assert s["headline"] == s["f1"]
    # A class absent from labels and predictions is left out of the mean.
    assert macro_f1([0, 1], [0, 1]) == pytest.approx(100.0)


def test_multirc_f1a_and_grouped_exact_match():
    groups = [(0, 0), (0, 0), (0, 1), (0, 1), (1, 0)]
    labels = [1, 0, 1, 1, 0]
    preds = [1, 0, 1, 0, 0]  # question (0, 1) has one wrong answer
    s = score("multirc", preds, examples_for("multirc", labels, groups))
    assert s["em"] == pytest.approx(200 / 3)
    assert s["f1a"] == pytest.approx(100 * 2 * 2 / (2 * 2 + 0 + 1))  # tp 2, fp 0, fn 1
    assert s["headline"] == s["f1a"]


def test_accuracy_and_paper_average():
    s = score("RTE", [0, 1, 1, 1], examples_for("rte", [0, 1, 0, 1]))
    assert s == {"headline": 75.0, "accuracy": 75.0}
    scores = {"boolq": 80.0, "cb": {"headline": 90.0, "f1": 90.0, "accuracy": 95.0}, "copa": 60.0,
              "multirc": 70.0, "rte": 75.0, "WiC": 65.0}
    assert paper_average(scores) == pytest.approx(440 / 6)


# --- real data ------------------------------------------------------------------------------

REAL = os.environ.get("CAPT_DATA")
# (train, validation, test) example counts; MultiRC counts answers (456 paragraphs -> 410 / 46).
COUNTS = {"cb": (225, 25, 56), "copa": (360, 40, 100), "rte": (2241, 249, 277),
          "wic": (4885, 543, 638), "multirc": (None, None, 4848)}


@pytest.mark.skipif(not REAL, reason="set CAPT_DATA to the SuperGLUE directory to check the real files")
@pytest.mark.parametrize("task", list(COUNTS))
def test_real_counts(task):
    train, val = load_task(task, REAL, "train", 0), load_task(task, REAL, "validation", 0)
    test = load_task(task, REAL, "test")
    want = COUNTS[task]
    if task == "multirc":
        assert len(train) + len(val) == 27243
        assert len({ex.group[0] for ex in train}) == 410 and len({ex.group[0] for ex in val}) == 46
    else:
        assert (len(train), len(val)) == want[:2]
    assert len(test) == want[2]
    assert all("<" not in ex.fields.get("paragraph", "") for ex in test)


@pytest.mark.skipif(not REAL, reason="set CAPT_DATA to the SuperGLUE directory to check the real files")
def test_real_boolq_has_test_only():
    assert len(load_task("boolq", None, "test")) == 3270  # data dir from CAPT_DATA
    with pytest.raises(CaptError, match=r"official train file, which is missing: .*BoolQ/train\.jsonl"):
        load_task("boolq", REAL, "train")


# --- shipped data (data/superglue: CB and COPA) -------------------------------------------------

REPO = Path(__file__).resolve().parents[1]
SHIPPED_DIR = REPO / "data" / "superglue"
SHIPPED_FILES = ["CB/train.jsonl", "CB/val.jsonl", "COPA/train.jsonl", "COPA/val.jsonl"]


@pytest.mark.parametrize("task", ["cb", "copa"])
def test_shipped_data_loads_by_default(task, monkeypatch):
    # Neither --data nor CAPT_DATA: the default data/superglue, which is relative to the current
    # directory, so this runs from the repository root (as the Makefile does).
    monkeypatch.delenv("CAPT_DATA", raising=False)
    monkeypatch.chdir(REPO)
    assert resolve_data_dir() == Path("data/superglue")
    train, val, test = (load_task(task, None, split, 0) for split in ("train", "validation", "test"))
    assert (len(train), len(val), len(test)) == COUNTS[task]
    assert {ex.uid for ex in train}.isdisjoint(ex.uid for ex in val)
    assert all(0 <= ex.label < len(ex.candidates) for ex in train + val + test)


def test_shipped_files_match_the_readme_sha256():
    readme = (SHIPPED_DIR / "README.md").read_text(encoding="utf-8")
    written = {}
    for line in readme.splitlines():
        paths = re.findall(r"\b(?:CB|COPA)/(?:train|val)\.jsonl\b", line)
        digests = re.findall(r"\b[0-9a-f]{64}\b", line)
        if digests:
            assert len(paths) == 1 and len(digests) == 1, f"one file and one sha256 per line: {line}"
            written[paths[0]] = digests[0]
    assert sorted(written) == sorted(SHIPPED_FILES)
    actual = {name: hashlib.sha256((SHIPPED_DIR / name).read_bytes()).hexdigest() for name in SHIPPED_FILES}
    assert actual == written
    assert "make data" in readme and "CAPT_DATA" in readme and "BSD 2-Clause" in readme


# --- bad input ------------------------------------------------------------------------------


def error(fn, *args, **kwargs) -> str:
    with pytest.raises(CaptError) as e:
        fn(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message
    return message


def test_unknown_task_and_split(data):
    msg = error(load_task, "squad", data, "test")
    assert "squad" in msg and "boolq, cb, copa, multirc, rte, wic" in msg
    assert "train, validation, test" in error(load_task, "rte", data, "val")


def test_missing_data_dir(tmp_path, monkeypatch):
    monkeypatch.delenv("CAPT_DATA", raising=False)
    monkeypatch.chdir(tmp_path)
    msg = error(resolve_data_dir)
    assert str(tmp_path / "data" / "superglue") in msg and "CAPT_DATA not set" in msg
    assert "make data" in msg and "--data" in msg
    msg = error(resolve_data_dir, tmp_path / "nowhere")
    assert f"--data {tmp_path / 'nowhere'}" in msg
    monkeypatch.setenv("CAPT_DATA", str(tmp_path / "elsewhere"))
    assert f"CAPT_DATA {tmp_path / 'elsewhere'}" in error(load_task, "rte", None, "test")
    (tmp_path / "data" / "superglue").mkdir(parents=True)
    monkeypatch.delenv("CAPT_DATA")
    assert resolve_data_dir() == Path("data/superglue")


def test_missing_task_dir_and_split_file(tmp_path):
    assert "no RTE directory" in error(load_task, "rte", tmp_path, "test")
    write_jsonl(tmp_path / "BoolQ" / "val.jsonl", [ROWS["BoolQ"]])
    msg = error(load_task, "boolq", tmp_path, "validation")
    assert "train file, which is missing" in msg and str(tmp_path / "BoolQ" / "train.jsonl") in msg


def test_missing_task_says_which_files_and_how_to_get_them(tmp_path):
    write_jsonl(tmp_path / "CB" / "val.jsonl", [ROWS["CB"]])
    # No RTE directory at all: the task, its directory, the files it needs, and the three ways to get them.
    msg = error(load_task, "rte", tmp_path, "test")
    assert msg.startswith(f"task rte: no RTE directory (any letter case) in {tmp_path}")
    assert "RTE/train.jsonl and RTE/val.jsonl" in msg
    assert "ships CB and COPA only" in msg and "`make data`" in msg and "--data DIR" in msg and "CAPT_DATA" in msg
    # The directory is there but one of its files is not: the missing file by its full path.
    msg = error(load_task, "cb", tmp_path, "train")
    assert msg.startswith("task cb: the train split needs the official train file, which is missing: "
                          f"{tmp_path / 'CB' / 'train.jsonl'} (")
    assert "`make data`" in msg and "CB/train.jsonl and CB/val.jsonl" in msg
    assert len(load_task("cb", tmp_path, "test")) == 1  # the file that is there still loads
    # task_dir directly (as `capt train --tasks all` uses it), by name or Task, and on a data dir that is absent.
    assert task_dir("cb", tmp_path) == tmp_path / "CB" == task_dir(TASKS["cb"], tmp_path)
    assert "task wic: no WiC directory" in error(task_dir, "wic", tmp_path) and "`make data`" in error(
        task_dir, "wic", tmp_path
    )
    assert "is not a directory" in error(task_dir, "cb", tmp_path / "nowhere")


def test_malformed_and_incomplete_rows(tmp_path):
    path = write_jsonl(tmp_path / "RTE" / "val.jsonl", [ROWS["RTE"], "", '{"premise": "x",'])
    assert error(load_task, "rte", tmp_path, "test").startswith(f"{path} line 3: not valid JSON")

    write_jsonl(path, [ROWS["RTE"], {"premise": "x", "label": "entailment"}])
    msg = error(load_task, "rte", tmp_path, "test")
    assert msg == f"{path} line 2: missing field 'hypothesis'"

    write_jsonl(path, [{**ROWS["RTE"], "label": "maybe"}])
    msg = error(load_task, "rte", tmp_path, "test")
    assert f"{path} line 1" in msg and '"maybe"' in msg and "'label'" in msg

    bad = json.loads(json.dumps(ROWS["MultiRC"]))
    del bad["passage"]["questions"][1]["answers"][0]["label"]
    path = write_jsonl(tmp_path / "MultiRC" / "val.jsonl", [bad])
    msg = error(load_task, "multirc", tmp_path, "test")
    assert msg == f"{path} line 1: missing field 'passage.questions[1].answers[0].label'"


def test_empty_files_and_splits(tmp_path):
    path = write_jsonl(tmp_path / "CB" / "val.jsonl", [])
    assert error(load_task, "cb", tmp_path, "test") == f"{path}: no examples (the file is empty)"
    write_jsonl(tmp_path / "CB" / "train.jsonl", [ROWS["CB"]])
    assert "validation split is empty" in error(load_task, "cb", tmp_path, "validation")


def test_bad_scoring_input():
    exs = examples_for("rte", [0, 1])
    assert "1 predictions for 2 examples" in error(score, "rte", [0], exs)
    assert "not an index" in error(score, "rte", [0, 2], exs)
    assert "missing: wic" in error(paper_average, {t: 1.0 for t in TASKS if t != "wic"})
