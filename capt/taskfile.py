"""Your own classification task: a JSON task file describes JSONL data, the input and the answers.

    {
      "name": "sentiment",                          optional; default: the file name without .json
      "train": "train.jsonl",                       required; paths are relative to the task file
      "validation": "dev.jsonl",                    optional; without it, a seeded 90% / 10% split of train
      "test": "test.jsonl",                         needed to train (the best tensors are tested on it)
                                                    and to eval --split test
      "template": "Review: {text} Sentiment:",      the input; {field} reads that field of each row
                                                    ({{ }}: literal braces)
      "label_field": "label",                       the row field holding the answer (default "label")
      "labels": {"0": "negative", "1": "positive"}, label value -> label word; or ["negative", "positive"]
                                                    when the values are the words themselves
      "metric": "accuracy",                         or "macro-f1": the headline; both are reported
      "shorten": "text"                             optional: the one placeholder whose words may be cut
                                                    to fit --max-length
    }

The task becomes a capt.tasks.Task (tasks.get_task("FILE.json")): its candidates are the label
words, ranked by rank classification like SuperGLUE's targets, so the trainer, early stopping,
capsules and every baseline (linear-head: one class per label word) work on it unchanged. A
label word may be several tokens. Label values are matched as text: a JSON string as it is, an
integer as its digits, true / false as "true" / "false". Field values may be text or numbers;
whitespace runs collapse to one space, as in the SuperGLUE fields.

This module reads and checks the task file alone (the data files are read by capt.tasks when a
split is loaded, so a task file without data still serves `capt predict`). Every mistake is one
CaptError line naming the file and the key.
"""

from __future__ import annotations

import hashlib
import json
import re
import string
import warnings
from dataclasses import dataclass
from pathlib import Path

from .checks import json_type, parse_json, shown
from .errors import CaptError, CaptWarning

KEYS = ("name", "train", "validation", "test", "template", "label_field", "labels", "metric", "shorten")
# task file metric -> score() keys, headline first
METRICS = {"accuracy": ("accuracy", "f1"), "macro-f1": ("f1", "accuracy")}
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")  # a task name is a directory name in `capt run` output


@dataclass(frozen=True)
class TaskFile:
    """A checked task file. Paths are absolute; values[i] is the label value of words[i]."""

    path: str  # the task file itself
    sha256: str  # of its bytes: a run records it, and a resumed run must find the same file
    name: str
    template: str
    fields: tuple[str, ...]  # the template's placeholders, in order of first use
    label_field: str
    values: tuple[str, ...]  # label values as text, one per label word
    words: tuple[str, ...]  # the label words: the task's candidates
    metrics: tuple[str, ...]  # score() keys, headline first
    shorten: str | None  # the placeholder that may be cut, or None
    train: str
    validation: str | None
    test: str | None

    def split_file(self, split: str) -> str | None:
        """The data file of a split named in the task file (train | validation | test), or None."""
        return {"train": self.train, "validation": self.validation, "test": self.test}[split]


def placeholders(template: str, where: str) -> tuple[str, ...]:
    """The field names of a template's {field} placeholders; anything else in braces is refused."""
    try:
        parts = list(string.Formatter().parse(template))
    except ValueError as e:  # an unmatched brace
        raise CaptError(f"{where}: the template is not valid ({e}); write a literal brace as {{{{ or }}}}") from None
    names = []
    for _, name, spec, conversion in parts:
        if name is None:
            continue
        if not name.isidentifier() or spec or conversion:
            shown = "{" + name + (f"!{conversion}" if conversion else "") + (f":{spec}" if spec else "") + "}"
            raise CaptError(f"{where}: template placeholder {shown} is not a plain {{field}} (a row field's name)")
        if name not in names:
            names.append(name)
    if not names:
        raise CaptError(f"{where}: the template has no {{field}} placeholder, so every input would be the same")
    return tuple(names)


def label_key(value) -> str | None:
    """The text a label value is matched by: a string as it is, an integer as its digits, true / false;
    None for any other type."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, int)):
        return str(value)
    return None


def read_task_file(path: str | Path) -> TaskFile:
    """Read and check a task file (module docstring); data files are not opened here."""
    path = Path(path).absolute()
    if not path.is_file():
        raise CaptError(f"task file not found: {path}")
    where = str(path)
    try:
        raw = path.read_bytes()
    except OSError as e:
        raise CaptError(f"cannot read {path}: {e.strerror or e}") from None
    spec = parse_json(raw, path)
    if not isinstance(spec, dict):
        raise CaptError(f"{where} is not a task file: it holds a JSON {json_type(spec)}, not an object")
    unknown = [k for k in spec if k not in KEYS]
    if unknown:
        raise CaptError(f"{where}: unknown key {unknown[0]!r} (a task file has: {', '.join(KEYS)})")
    for key in ("train", "template", "labels"):
        if spec.get(key) is None:  # null is no value
            raise CaptError(f"{where}: missing key {key!r} (docs/your-data.md)")

    def text(key: str, default=None) -> str | None:
        value = spec.get(key)
        if value is None:  # absent or null: the default
            return default
        if not isinstance(value, str) or not value.strip():
            raise CaptError(f"{where}: {key!r} should be a non-empty string, got {shown(value)}")
        return value

    name = text("name", path.stem)
    if not NAME.fullmatch(name):
        raise CaptError(f"{where}: name {name!r} should be letters, digits, '-' and '_' (it names the run directories)")
    if name.lower() in ("boolq", "cb", "copa", "multirc", "rte", "wic"):
        raise CaptError(f"{where}: name {name!r} is a SuperGLUE task's; give the task file another \"name\"")

    template = text("template")
    if template != template.rstrip(" \t"):
        # a decoder reads the answer as " " + word after the prompt: a space at the template's end would come twice
        warnings.warn(CaptWarning(f"{where}: the template ends with a space, which is dropped: label words are scored "
                                  "as "
                                  "\" \" + word right after the input (docs/your-data.md)"))
        template = template.rstrip(" \t")
    fields = placeholders(template, where)
    label_field = text("label_field", "label")
    if label_field in fields:
        raise CaptError(f"{where}: the template reads the label field {{{label_field}}}: every input would hold its "
                        "answer")
    shorten = text("shorten")
    if shorten is not None and shorten not in fields:
        raise CaptError(f"{where}: shorten {shorten!r} is not one of the template's placeholders: {', '.join(fields)}")

    values, words = _labels(spec["labels"], where)
    metric = text("metric", "accuracy")
    if metric not in METRICS:
        raise CaptError(f"{where}: metric {metric!r} is not one of {', '.join(METRICS)}")

    def data_file(key: str) -> str | None:
        value = text(key)
        return None if value is None else str((path.parent / value).absolute())

    return TaskFile(
        path=str(path), sha256=hashlib.sha256(raw).hexdigest(), name=name, template=template, fields=fields,
        label_field=label_field, values=values, words=words, metrics=METRICS[metric], shorten=shorten,
        train=data_file("train"), validation=data_file("validation"), test=data_file("test"),
    )


def _labels(labels, where: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(label values, label words) from the task file's "labels": a list of words or {value: word}."""
    if isinstance(labels, list):
        pairs = [(w, w) for w in labels]
    elif isinstance(labels, dict):
        pairs = list(labels.items())
    else:
        raise CaptError(f"{where}: 'labels' should be a list of label words or an object {{label value: word}}, "
                        f"got {json.dumps(labels)}")
    if len(pairs) < 2:
        raise CaptError(f"{where}: 'labels' needs at least two label words, got {len(pairs)}")
    for value, word in pairs:
        if not isinstance(word, str) or not word.strip() or word != word.strip():
            raise CaptError(f"{where}: label word {json.dumps(word)} should be non-empty text without surrounding "
                            "spaces")
        if label_key(value) is None:
            raise CaptError(f"{where}: label value {json.dumps(value)} should be text")
    words = [w for _, w in pairs]
    double = next((w for i, w in enumerate(words) if w in words[:i]), None)
    if double is not None:
        raise CaptError(f"{where}: label word {double!r} is given twice; each label needs its own word")
    values = [label_key(v) for v, _ in pairs]
    double = next((v for i, v in enumerate(values) if v in values[:i]), None)
    if double is not None:
        raise CaptError(f"{where}: label value {double!r} is given twice")
    return tuple(values), tuple(words)
