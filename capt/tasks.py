"""The six SuperGLUE tasks in text-to-text form: reading, splits, input text and scores.

Tasks know nothing of models. An Example holds the text fields of one input and the candidate
target words; `render` writes the input string, shortening it to a token budget with a counter
the caller supplies (its tokenizer); the model ranks the candidates (rank classification) and
`score` turns the chosen indices into the task's metrics.

Inputs follow T5's format (docs: method.md, "Tasks"): the task name, then `name: value` pairs,
targets as words. For decoder-only models the input also ends in an answer cue, ` answer:`
(render's `cue`; the encoder-decoder T5 keeps the paper's form): without it a decoder reads
`... premise: <text>` with no sign that a label word follows, and ranks the candidates by how
well each continues the premise (docs/results.md: the answer cue).

    boolq    boolq passage: ... question: ...                          False / True
    cb       cb hypothesis: ... premise: ...                           entailment / contradiction / neutral
    copa     copa choice1: ... choice2: ... premise: ... question: cause|effect     choice1 / choice2
    multirc  multirc answer: ... paragraph: ... question: ...          False / True
    rte      rte sentence1: <premise> sentence2: <hypothesis>          entailment / not_entailment
    wic      wic sentence1: ... sentence2: ... word: ...               False / True

Data: the official SuperGLUE jsonl files, `DIR/<Task>/train.jsonl` and `DIR/<Task>/val.jsonl`
(directory names in any letter case). The official train set is split 90% / 10% (seeded) into
our train / validation; the official val set is our test set. The repository ships CB and COPA
in data/superglue (its README.md: sources, sha256, licences); `make data` fetches the others.

Choices where the method leaves room:
- Whitespace runs in every field collapse to one space. MultiRC paragraphs lose their HTML: the
  sentence markers `<b>Sent N: </b>` go entirely (marker text included), any other tag such as
  `<br>` becomes a space.
- Shortening: each task has at most one field that may be cut, the long context: BoolQ passage,
  MultiRC paragraph, CB / COPA / RTE premise. WiC has none (its two sentences carry the word
  being asked about; its inputs are far below any budget). The field keeps its first k words,
  k the largest that fits (binary search); if even k = 0 does not fit, the text comes back with
  the field empty and still too long, and the caller's model takes it as it is.
- Split: units are rows (MultiRC: paragraphs, so a question never straddles two splits);
  validation gets round-half-up of 10% of them, chosen by `random.Random(seed)`; both parts
  keep file order.
- Scores are in percent, like the paper's tables.

Your own task: a task file (capt/taskfile.py) becomes a Task like these six, named by its path
("FILE.json") wherever a task name goes; its inputs are its template filled with each row's
fields, its candidates its label words, its metrics accuracy and macro-F1 (its headline first).
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .checks import json_type, parse_json
from .errors import CaptError
from .taskfile import TaskFile, label_key, read_task_file

DEFAULT_DATA_DIR = "data/superglue"
DEFAULT_MAX_LEN = 256
ANSWER_CUE = " answer:"  # ends a SuperGLUE input for decoder-only models (render's cue)
SPLITS = ("train", "validation", "test")
VALIDATION_FRACTION = 0.1


@dataclass(frozen=True)
class Task:
    """What is fixed per task: its names, targets, the field that may be cut, its metrics."""

    name: str  # the command-line name and the first word of every input, e.g. "rte"
    dirname: str  # the official directory name, e.g. "RTE"
    candidates: tuple[str, ...]  # target words; a label is an index into them
    shorten: str | None  # the one template field that may be cut, or None
    metrics: tuple[str, ...]  # keys of score(), headline first
    file: TaskFile | None = None  # a task file's task (dirname ""), None for SuperGLUE's

    @property
    def spec(self) -> str:
        """What get_task reads back into this Task, and what Example.task holds: the name, or the task file's path."""
        return self.name if self.file is None else self.file.path


TASKS: dict[str, Task] = {
    t.name: t
    for t in (
        Task("boolq", "BoolQ", ("False", "True"), "passage", ("accuracy",)),
        Task("cb", "CB", ("entailment", "contradiction", "neutral"), "premise", ("f1", "accuracy")),
        Task("copa", "COPA", ("choice1", "choice2"), "premise", ("accuracy",)),
        Task("multirc", "MultiRC", ("False", "True"), "paragraph", ("f1a", "em")),
        Task("rte", "RTE", ("entailment", "not_entailment"), "sentence1", ("accuracy",)),
        Task("wic", "WiC", ("False", "True"), None, ("accuracy",)),
    )
}


@dataclass
class Example:
    """One input and its candidate targets.

    fields: template field name -> text, in template order (RTE's premise is "sentence1").
    candidates: the target words; label: index of the right one.
    group: MultiRC only, (paragraph row, question number) in the official file, for exact match.
    uid: "<task>:<official file>:<row>" (MultiRC adds ":<question>:<answer>"), unique per task.
    """

    task: str  # Task.spec: the task's name (a task file: its path)
    fields: dict[str, str]
    candidates: list[str]
    label: int | None  # None only in unlabelled rows read for capt predict
    group: tuple[int, int] | None = None
    uid: str = ""
    where: str = ""  # "<file> line <n>", for messages about this example


_TASK_FILES: dict[tuple[str, bytes], Task] = {}  # (path, bytes) -> its Task: render() asks for it once per example


def get_task(name: str) -> Task:
    """The Task called `name` (any letter case), or the task of a task file when `name` ends in .json."""
    task = TASKS.get(str(name).lower())
    if task is not None:
        return task
    if str(name).lower().endswith(".json"):
        path = Path(name).absolute()
        try:
            key = (str(path), path.read_bytes())
        except OSError:
            raise CaptError(f"task file not found: {path}") from None
        if key not in _TASK_FILES:
            spec = read_task_file(path)
            _TASK_FILES[key] = Task(spec.name, "", spec.words, spec.shorten, spec.metrics, spec)
        return _TASK_FILES[key]
    raise CaptError(f"unknown task {name!r}; known tasks: {', '.join(TASKS)}, or a task file FILE.json")


# ---------------------------------------------------------------------------------------------
# Input text


def _join(task: Task, fields: dict[str, str], cue: bool = False) -> str:
    """The input text: a task file's template filled in (it carries its own cue, if any), or
    SuperGLUE's `task name: value ...`, with the answer cue when `cue`."""
    if task.file is not None:
        return task.file.template.format_map(fields)
    text = " ".join([task.name] + [f"{name}: {value}" if value else f"{name}:" for name, value in fields.items()])
    return text + ANSWER_CUE if cue else text


def render(
    example: Example,
    max_len: int = DEFAULT_MAX_LEN,
    count_tokens: Callable[[str], int] | None = None,
    cue: bool = False,
) -> str:
    """The input string of `example`, shortened to at most `max_len` tokens by `count_tokens`.

    cue: end a SuperGLUE input with the answer cue (ANSWER_CUE; decoder-only models); a task
    file's template is used as written.

    count_tokens(text) -> int counts the tokens the model will see for `text` (the caller's
    tokenizer, special tokens included if it wants them counted). Without it the text is not
    shortened. Only the task's shortenable field is cut (module docstring), keeping its first
    words: the task name, question, answer, choices, hypothesis and word are never touched.
    """
    task = get_task(example.task)
    text = _join(task, example.fields, cue)
    name = task.shorten
    if count_tokens is None or name is None or count_tokens(text) <= max_len:
        return text

    words = example.fields[name].split()

    def cut(k: int) -> str:
        return _join(task, {**example.fields, name: " ".join(words[:k])}, cue)

    # Largest k whose text fits: k = lo is known to fit (or is 0), k = hi is known not to.
    lo, hi = 0, len(words)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if count_tokens(cut(mid)) <= max_len:
            lo = mid
        else:
            hi = mid
    return cut(lo)


def _clean(text: str) -> str:
    return " ".join(text.split())


_SENTENCE_MARKER = re.compile(r"<b>\s*Sent\s*\d+\s*:\s*</b>", re.IGNORECASE)
_TAG = re.compile(r"<[^>]*>")


def strip_html(text: str) -> str:
    """MultiRC paragraph text without markup: sentence markers dropped, other tags -> spaces."""
    text = _SENTENCE_MARKER.sub(" ", text)
    return _clean(_TAG.sub(" ", text))


# ---------------------------------------------------------------------------------------------
# Reading the official files


@dataclass
class _Row:
    """One parsed jsonl line and where it came from, for error messages."""

    data: dict
    path: Path
    line: int  # 1-based line number in the file
    index: int  # 0-based position among the file's rows
    labelled: bool = True  # False: the row may lack its label (rows read for capt predict)


def _where(row: _Row) -> str:
    return f"{row.path} line {row.line}"


def _get(row: _Row, obj, key: str, at: str = ""):
    """obj[key], or a CaptError naming file, line and field."""
    if not isinstance(obj, dict) or key not in obj:
        raise CaptError(f"{_where(row)}: missing field '{at}{key}'")
    return obj[key]


def _text(row: _Row, obj, key: str, at: str = "") -> str:
    value = _get(row, obj, key, at)
    if not isinstance(value, str):
        raise CaptError(f"{_where(row)}: field '{at}{key}' should be text, got {_json(value)}")
    return _clean(value)


def _list(row: _Row, obj, key: str, at: str = "") -> list:
    value = _get(row, obj, key, at)
    if not isinstance(value, list):
        raise CaptError(f"{_where(row)}: field '{at}{key}' should be a list, got {_json(value)}")
    return value


def _json(value, width: int = 60) -> str:
    """A value from a data row as JSON writes it, cut to `width` characters (a field may hold a whole document)."""
    text = json.dumps(value, ensure_ascii=False)
    return text if len(text) <= width else text[:width - 3] + "..."


_BOOL = {False: 0, True: 1}  # JSON false/true; 0/1 hash equal and are accepted too


def _label(row: _Row, obj, mapping: dict, at: str = "") -> int | None:
    if not row.labelled and isinstance(obj, dict) and "label" not in obj:
        return None  # an unlabelled row for capt predict
    value = _get(row, obj, "label", at)
    if isinstance(value, (bool, int, str)) and value in mapping:
        return mapping[value]
    known = ", ".join(json.dumps(k) for k in mapping)
    raise CaptError(f"{_where(row)}: unknown label {_json(value)} in field '{at}label' (expected {known})")


def _names(task: Task) -> dict:
    return {word: i for i, word in enumerate(task.candidates)}


def _custom_example_fields(task: Task, row: _Row) -> dict[str, str]:
    """A task file's row -> the template's fields (text or numbers, whitespace collapsed)."""
    fields = {}
    for name in task.file.fields:
        if name not in row.data:
            raise CaptError(f"{_where(row)}: missing field '{name}' (the template's {{{name}}})")
        value = row.data[name]
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise CaptError(f"{_where(row)}: field '{name}' should be text or a number, got {_json(value)}")
        fields[name] = _clean(str(value))
    return fields


def _custom_label(task: Task, row: _Row) -> int | None:
    """The index of a task file's row label among its label words (None: an unlabelled row, allowed when not
    row.labelled)."""
    spec, d = task.file, row.data
    if spec.label_field not in d:
        if not row.labelled:
            return None
        raise CaptError(f"{_where(row)}: missing field '{spec.label_field}' (the task's label field)")
    key = label_key(d[spec.label_field])
    if key not in spec.values:
        raise CaptError(f"{_where(row)}: label {_json(d[spec.label_field])} is not one of the task's labels "
                        f"({', '.join(spec.values)}; {spec.path})")
    return spec.values.index(key)


def _custom_examples(task: Task, row: _Row, source: str) -> list[Example]:
    """The one Example of a task file's row."""
    uid = f"{task.name}:{source}:{row.index}"
    return [
        Example(
            task.spec,
            _custom_example_fields(task, row),
            list(task.candidates),
            _custom_label(task, row),
            None,
            uid,
            _where(row),
        )
    ]


def _row_examples(task: Task, row: _Row, source: str) -> list[Example]:
    """The Examples of one row: a task file's, or SuperGLUE's (MultiRC: one per answer)."""
    return (_custom_examples if task.file is not None else _examples)(task, row, source)


def _examples(task: Task, row: _Row, source: str) -> list[Example]:
    """The Examples of one official row (MultiRC: one per answer, others: one)."""
    d = row.data
    uid = f"{task.name}:{source}:{row.index}"
    cands = list(task.candidates)

    def one(fields: dict[str, str], label: int) -> list[Example]:
        return [Example(task.name, fields, cands, label, None, uid, _where(row))]

    if task.name == "boolq":
        fields = {"passage": _text(row, d, "passage"), "question": _text(row, d, "question")}
        return one(fields, _label(row, d, _BOOL))
    if task.name == "cb":
        fields = {"hypothesis": _text(row, d, "hypothesis"), "premise": _text(row, d, "premise")}
        return one(fields, _label(row, d, _names(task)))
    if task.name == "copa":
        fields = {
            "choice1": _text(row, d, "choice1"),
            "choice2": _text(row, d, "choice2"),
            "premise": _text(row, d, "premise"),
            "question": _text(row, d, "question"),
        }
        if fields["question"] not in ("cause", "effect"):
            raise CaptError(f"{_where(row)}: field 'question' should be \"cause\" or \"effect\", got {d['question']!r}")
        return one(fields, _label(row, d, {0: 0, 1: 1}))
    if task.name == "rte":
        fields = {"sentence1": _text(row, d, "premise"), "sentence2": _text(row, d, "hypothesis")}
        return one(fields, _label(row, d, _names(task)))
    if task.name == "wic":
        fields = {
            "sentence1": _text(row, d, "sentence1"),
            "sentence2": _text(row, d, "sentence2"),
            "word": _text(row, d, "word"),
        }
        return one(fields, _label(row, d, _BOOL))

    # MultiRC: a paragraph with questions, each with answers -> one Example per answer.
    passage = _get(row, d, "passage")
    paragraph = strip_html(_text(row, passage, "text", "passage."))
    out = []
    for qi, q in enumerate(_list(row, passage, "questions", "passage.")):
        at_q = f"passage.questions[{qi}]."
        question = _text(row, q, "question", at_q)
        for ai, a in enumerate(_list(row, q, "answers", at_q)):
            at_a = f"{at_q}answers[{ai}]."
            fields = {"answer": _text(row, a, "text", at_a), "paragraph": paragraph, "question": question}
            label = _label(row, a, _BOOL, at_a)
            out.append(Example(task.name, fields, cands, label, (row.index, qi), f"{uid}:{qi}:{ai}", _where(row)))
    return out


PIPE_SECONDS = 60.0  # how long reading a pipe or FIFO may take; CAPT_PIPE_SECONDS sets it


def pipe_seconds() -> float:
    """CAPT_PIPE_SECONDS when set (a positive number of seconds), else PIPE_SECONDS."""
    text = os.environ.get("CAPT_PIPE_SECONDS")
    if text is None:
        return PIPE_SECONDS
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not seconds > 0 or math.isinf(seconds):
        raise CaptError(f"CAPT_PIPE_SECONDS is {text!r}, not a positive number of seconds")
    return seconds


def _read_bytes(path: Path) -> bytes:
    """A file's bytes; a pipe or a FIFO (--input /dev/stdin) is read in a thread, so that one nobody writes to is
    an error after pipe_seconds(), not a wait without end."""
    if path.is_file():
        return path.read_bytes()
    got: dict = {}

    def read():
        try:
            got["data"] = path.read_bytes()
        except OSError as e:
            got["error"] = e

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    limit = pipe_seconds()
    reader.join(limit)
    if reader.is_alive():
        raise CaptError(f"{path}: the pipe or FIFO was not closed within {limit:g} s (CAPT_PIPE_SECONDS): no program "
                        "writes to it, or the one that does has not finished")
    if "error" in got:
        raise got["error"]
    return got["data"]


def _read_rows(path: Path) -> list[_Row]:
    rows = []
    try:
        lines = _read_bytes(path).split(b"\n")
    except OSError as e:
        raise CaptError(f"cannot read {path}: {e.strerror or e}") from None
    for line_no, raw in enumerate(lines, start=1):
        if raw.strip():
            # not UTF-8, not JSON, too deep, huge integers, lone surrogates: one line
            data = parse_json(raw, path, line_no)
            if not isinstance(data, dict):
                raise CaptError(f"{path} line {line_no}: expected a JSON object, got {json_type(data)}")
            rows.append(_Row(data, path, line_no, len(rows)))
    if not rows:
        raise CaptError(f"{path}: no examples (the file is empty)")
    return rows


def resolve_data_dir(explicit: str | os.PathLike | None = None) -> Path:
    """The SuperGLUE directory: `explicit` (--data DIR), else env CAPT_DATA, else data/superglue.

    The first of these that is given is the only one used (a wrong --data or CAPT_DATA is an
    error, not a reason to fall back); if it is not a directory, the error names each place and
    how to get the data.
    """
    if explicit is not None and not isinstance(explicit, (str, os.PathLike)):
        raise CaptError(f"the data directory must be a path (str or path), not {type(explicit).__name__}")
    env = os.environ.get("CAPT_DATA") or None
    default = Path(DEFAULT_DATA_DIR)
    places = [
        ("--data", Path(explicit) if explicit is not None else None, "not given"),
        ("CAPT_DATA", Path(env) if env is not None else None, "not set"),
        (f"default {DEFAULT_DATA_DIR}", default, ""),
    ]
    label, chosen = next((label, path) for label, path, _ in places if path is not None)
    if chosen.is_dir():
        return chosen
    others = [f"{lab} {why}" for lab, path, why in places if path is None]
    raise CaptError(
        f"SuperGLUE data not found: {label} {chosen.absolute()} is not a directory"
        f" (looked at --data DIR, then env CAPT_DATA, then ./{DEFAULT_DATA_DIR}"
        + (f"; {', '.join(others)}" if others else "") + "); "
        "run `make data` to download the official SuperGLUE release (needs internet), "
        "or set CAPT_DATA / pass --data DIR with <Task>/train.jsonl and <Task>/val.jsonl in it"
    )


SHIPPED = ("CB", "COPA")  # the tasks whose official files ship in the repository's data/superglue


def _how_to_get(task: Task) -> str:
    """The hint closing a missing-data error: what ships, and the ways to get the task's files."""
    d = task.dirname
    return (
        f"this repository ships {' and '.join(SHIPPED)} only, in {DEFAULT_DATA_DIR}; run `make data` to download "
        f"the official SuperGLUE release (needs a network connection), or pass --data DIR / set CAPT_DATA to a "
        f"directory holding {d}/train.jsonl and {d}/val.jsonl"
    )


def task_dir(task: Task | str, data_dir: str | os.PathLike) -> Path:
    """The directory of `task` (a Task or its name) in data_dir: <dirname> in any letter case.

    A CaptError (one line) when data_dir is not a directory, when it has no such directory (naming
    the task, the files it needs and how to get them), or when several differ only in case.
    """
    task = task if isinstance(task, Task) else get_task(task)
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise CaptError(f"task {task.name}: {data_dir.absolute()} is not a directory ({_how_to_get(task)})")
    exact = data_dir / task.dirname
    if exact.is_dir():
        return exact
    found = [p for p in data_dir.iterdir() if p.is_dir() and p.name.lower() == task.dirname.lower()]
    if len(found) == 1:
        return found[0]
    if found:
        names = ", ".join(sorted(p.name for p in found))
        raise CaptError(
            f"task {task.name}: several {task.dirname} directories in {data_dir.absolute()}: {names}; keep one"
        )
    raise CaptError(
        f"task {task.name}: no {task.dirname} directory (any letter case) in {data_dir.absolute()} "
        f"({_how_to_get(task)})"
    )


def split_units(n: int, seed: int) -> tuple[list[int], list[int]]:
    """Row indices (train, validation) of a seeded 90% / 10% split of n rows, each sorted."""
    n_val = int(n * VALIDATION_FRACTION + 0.5)  # round half up: 250 -> 25, 456 -> 46
    order = list(range(n))
    random.Random(seed).shuffle(order)
    return sorted(order[n_val:]), sorted(order[:n_val])


def load_task(
    name: str,
    data_dir: str | os.PathLike | None = None,
    split: str = "train",
    seed: int = 0,
) -> list[Example]:
    """The Examples of one split: train | validation (from official train.jsonl) | test (val.jsonl).

    data_dir goes through resolve_data_dir (None: CAPT_DATA, then data/superglue). `seed`
    chooses the train / validation split and is ignored for test. A task file (name "FILE.json")
    names its own files and ignores data_dir; without a validation file its train file is split
    90% / 10% by `seed` as SuperGLUE's is.
    """
    task = get_task(name)
    if split not in SPLITS:
        raise CaptError(f"unknown split {split!r}; use one of: {', '.join(SPLITS)}")
    path, source, halves = _split_source(task, split, data_dir)
    rows = _read_rows(path)

    if halves:
        train_idx, val_idx = split_units(len(rows), seed)
        chosen = train_idx if split == "train" else val_idx
        if not chosen:
            raise CaptError(f"{path}: {len(rows)} rows are too few for a 90/10 split; the {split} split is empty")
        rows = [rows[i] for i in chosen]

    examples = [ex for row in rows for ex in _row_examples(task, row, source)]
    if not examples:
        raise CaptError(f"{path}: the {split} split has no examples")
    return examples


def _split_source(task: Task, split: str, data_dir) -> tuple[Path, str, bool]:
    """(the file a split is read from, its name in uids, whether the split is a 90/10 part of it)."""
    if task.file is None:
        folder = task_dir(task, resolve_data_dir(data_dir))
        source = "val" if split == "test" else "train"
        path = folder / f"{source}.jsonl"
        if not path.is_file():
            raise CaptError(
                f"task {task.name}: the {split} split needs the official {source} file, which is missing: "
                f"{path.absolute()} ({_how_to_get(task)})"
            )
        return path, source, split != "test"
    spec = task.file
    halves = split != "test" and spec.validation is None
    source = "train" if halves else split
    file = spec.split_file(source)
    if file is None:  # only test can be left out
        raise CaptError(f"task {task.name}: {spec.path} names no test file; add \"test\": \"FILE.jsonl\" "
                        "(training tests its best tensors on it)")
    if not Path(file).is_file():
        raise CaptError(f"task {task.name}: its {source} file is missing: {file} (named by {spec.path})")
    return Path(file), source, halves


def task_files(task: Task | str, data_dir=None) -> dict[str, Path]:
    """The files a task reads, by label: SuperGLUE's train.jsonl and val.jsonl; a task file and its data files."""
    task = task if isinstance(task, Task) else get_task(task)
    if task.file is None:
        folder = task_dir(task, resolve_data_dir(data_dir))
        return {name: folder / name for name in ("train.jsonl", "val.jsonl")}
    spec = task.file
    files = {"task file": spec.path, "train": spec.train, "validation": spec.validation, "test": spec.test}
    return {label: Path(file) for label, file in files.items() if file is not None}


def task_file_record(task: Task | str) -> dict | None:
    """{"path", "sha256"} of a task file's task (what a run records, to be resumed and evaluated); None for
    SuperGLUE's."""
    task = task if isinstance(task, Task) else get_task(task)
    return None if task.file is None else {"path": task.file.path, "sha256": task.file.sha256}


def input_path(path: str | os.PathLike) -> Path:
    """--input: a file, or a pipe or a FIFO (/dev/stdin); not a directory, and it must exist."""
    path = Path(path)
    if not path.exists():
        raise CaptError(f"input file not found: {path}")
    if path.is_dir():
        raise CaptError(f"--input {path} is a directory; give the JSONL file of rows")
    return path


def read_examples(task: Task | str, path: str | os.PathLike) -> list[Example]:
    """Every row of a JSONL file in the task's row format as Examples, in file order (for capt predict).

    Rows may lack labels (Example.label None); the labels given are checked.
    """
    task = task if isinstance(task, Task) else get_task(task)
    path = input_path(path)
    rows = _read_rows(path)
    for row in rows:
        row.labelled = False
    return [ex for row in rows for ex in _row_examples(task, row, "input")]


def read_mixed_examples(path: str | os.PathLike, names: list[str]) -> dict[str, list[Example]]:
    """Rows of several tasks in one JSONL file, each naming its task in a "task" field (one of
    `names`), as {name: Examples} (for capt predict with several capsule sets). Each row is in its
    task's format; Example.uid keeps its row index in the file."""
    path = input_path(path)
    out: dict[str, list[Example]] = {name: [] for name in names}
    for row in _read_rows(path):
        name = row.data.get("task")
        if name not in out:
            raise CaptError(f"{_where(row)}: its \"task\" field is {name!r}; each row must name one of the loaded "
                            f"capsule sets: {', '.join(names)}")
        row.labelled = False
        out[name] += _row_examples(get_task(name), row, "input")
    return {name: exs for name, exs in out.items() if exs}


# ---------------------------------------------------------------------------------------------
# Scores


def accuracy(predictions: list[int], labels: list[int]) -> float:
    """Percent of predictions equal to their label."""
    return 100.0 * sum(p == y for p, y in zip(predictions, labels)) / len(labels)


def f1(predictions: list[int], labels: list[int], positive: int) -> float:
    """Percent F1 of class `positive` against the rest (0 when it has no true positive)."""
    tp = sum(p == positive and y == positive for p, y in zip(predictions, labels))
    fp = sum(p == positive and y != positive for p, y in zip(predictions, labels))
    fn = sum(p != positive and y == positive for p, y in zip(predictions, labels))
    return 100.0 * 2 * tp / (2 * tp + fp + fn) if tp else 0.0


def macro_f1(predictions: list[int], labels: list[int]) -> float:
    """Percent mean of per-class F1 over the classes that occur in the labels or predictions.

    A class that is in the labels but never predicted counts with F1 = 0; a class absent from
    both (possible in a small validation split) is left out, as scikit-learn's macro average
    does. On CB's test set all three classes occur, so this is the mean over the three.
    """
    classes = sorted(set(labels) | set(predictions))
    return sum(f1(predictions, labels, c) for c in classes) / len(classes)


def exact_match(predictions: list[int], labels: list[int], groups: list) -> float:
    """Percent of groups (MultiRC questions) whose every answer is predicted right."""
    right: dict = {}
    for p, y, g in zip(predictions, labels, groups):
        right[g] = right.get(g, True) and p == y
    return 100.0 * sum(right.values()) / len(right)


def score(task: str | Task, predictions: list[int], examples: list[Example]) -> dict[str, float]:
    """The task's metrics in percent, plus "headline", the number the paper reports for it.

    predictions[i] is the index into examples[i].candidates that the model chose. Headline:
    accuracy for BoolQ, COPA, RTE, WiC; macro-F1 for CB; F1a (binary F1 over all answers, True
    positive) for MultiRC; a task file's own choice of accuracy or macro-F1 (both are given).
    """
    task = task if isinstance(task, Task) else get_task(task)
    if len(predictions) != len(examples):
        raise CaptError(f"{task.name}: {len(predictions)} predictions for {len(examples)} examples")
    if not examples:
        raise CaptError(f"{task.name}: nothing to score (no examples)")
    for i, (p, ex) in enumerate(zip(predictions, examples)):
        if ex.task != task.spec:
            raise CaptError(f"{task.name}: example {i} ({ex.uid}) belongs to task {ex.task}")
        if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < len(ex.candidates):
            raise CaptError(f"{task.name}: prediction {i} is {p!r}, not an index into {len(ex.candidates)} candidates")
    labels = [ex.label for ex in examples]

    if any(y is None for y in labels):
        raise CaptError(f"{task.name}: example {labels.index(None)} has no label, so it cannot be scored")

    if task.name == "multirc":
        groups = [ex.group for ex in examples]
        out = {"f1a": f1(predictions, labels, positive=1), "em": exact_match(predictions, labels, groups)}
    else:  # CB and task files: macro-F1 and accuracy, the others accuracy
        out = {key: {"f1": macro_f1, "accuracy": accuracy}[key](predictions, labels) for key in task.metrics}
    return {"headline": out[task.metrics[0]], **out}


def paper_average(per_task_scores: dict) -> float:
    """The six-task average as the paper reports it: the plain mean of each task's headline.

    per_task_scores maps each of the six task names to score()'s dict (its "headline" is used)
    or to the headline number itself. Convention: one number per task (BoolQ, COPA, RTE, WiC
    accuracy; CB macro-F1; MultiRC F1a), not SuperGLUE's leaderboard habit of first averaging
    CB's F1 with its accuracy and MultiRC's F1a with its exact match.
    """
    given = {get_task(name).name: value for name, value in per_task_scores.items()}
    missing = [name for name in TASKS if name not in given]
    if missing:
        raise CaptError(f"the six-task average needs every task; missing: {', '.join(missing)}")
    heads = []
    for name, value in given.items():
        head = value.get("headline") if isinstance(value, dict) else value
        if isinstance(head, bool) or not isinstance(head, (int, float)):
            raise CaptError(f"the six-task average: {name} has no headline number (got {value!r})")
        heads.append(float(head))
    return sum(heads) / len(heads)
