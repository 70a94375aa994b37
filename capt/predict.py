"""`capt predict`: the label of every row of a JSONL file, with each label's score, as JSONL.

Rows are in the task's own format (SuperGLUE's official rows, or a task file's rows) and need no
label. Each example is ranked exactly as `capt eval` ranks it (capt/evaluate.py: candidate_scores),
so the predictions are the ones evaluation scores. One output line per input row (MultiRC: one
per answer, with its question and answer index):

    {"row": 0, "label": "1", "word": "positive", "scores": {"negative": -7.31, "positive": -2.05},
     "probabilities": {"negative": 0.0052, "positive": 0.9948}}

- row: the row's 0-based index among the input's non-empty lines.
- label: the label as the data writes it (SuperGLUE: BoolQ / WiC true / false, COPA / MultiRC
  0 / 1, CB / RTE the words; a task file: its label values as text); word: its label word.
- scores: each label word's summed log-likelihood (with normalize: per target token); the
  linear-head baseline gives its classes' log-probabilities instead.
- probabilities: the softmax of the scores over the task's label words.
- gold: the row's own label, when it has one.
- cut: only for a row over the length budget, {field: words} (the words its shortenable field lost).
- task: with several capsule sets (predict_tasks), the set named by the row's "task" field.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .errors import CaptError
from .evaluate import (
    DEFAULT_BATCH_SIZE,
    Encoded,
    candidate_scores,
    check_reachable,
    check_loaded,
    check_tasks,
    encode_examples,
    has_linear_head,
    input_format,
    is_seq2seq,
    mixed_candidate_scores,
)
from .load import atomic_write
from .tasks import DEFAULT_MAX_LEN, Example, Task, get_task, score

# CB, RTE: the words
OFFICIAL_LABELS = {"boolq": (False, True), "wic": (False, True), "copa": (0, 1), "multirc": (0, 1)}


def label_values(task: Task) -> list:
    """The label of each candidate as the task's data writes it."""
    if task.file is not None:
        return list(task.file.values)
    return list(OFFICIAL_LABELS.get(task.name, task.candidates))


def predict(
    model,
    tokenizer,
    examples: list[Example],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_length: int | None = None,
    answer_cue: bool | None = None,
    normalize: bool = False,
    progress: bool | str = True,
) -> list[dict]:
    """One prediction record per example (module docstring), in the examples' order. max_length, answer_cue:
    the input format (by default the one the model's method was trained with: evaluate.input_format)."""
    if not examples:
        raise CaptError("nothing to predict: the input has no rows")
    if normalize and has_linear_head(model):
        raise CaptError("normalize ranks targets by their length; the linear head classifies, it has no targets to "
                        "normalize")
    data = encode_examples(examples, tokenizer, is_seq2seq(model), *input_format(model, max_length, answer_cue))
    check_reachable(model, data, normalize)
    return records(data, candidate_scores(model, data, batch_size, progress), normalize)


def predict_tasks(model, tokenizer, examples: dict[str, list[Example]], *, batch_size: int = DEFAULT_BATCH_SIZE,
                  max_length: int = DEFAULT_MAX_LEN, answer_cue: bool | dict[str, bool | None] | None = None,
                  normalize: bool = False, progress: bool | str = True) -> list[dict]:
    """Rows of several tasks, each served by its own capsule set (load_model(..., capsules={name: DIR})),
    in batches that mix them: the records of predict() with a "task" field, in the input's row order.
    answer_cue: one for all or {name: cue} (None: the family's default)."""
    check_tasks(examples)
    check_loaded(model, examples)
    seq2seq = is_seq2seq(model)
    cues = answer_cue if isinstance(answer_cue, dict) else {name: answer_cue for name in examples}
    sets = {
        name: encode_examples(exs, tokenizer, seq2seq, max_length, cues.get(name)) for name, exs in examples.items()
    }
    for data in sets.values():
        check_reachable(model, data, normalize)
    scores = mixed_candidate_scores(model, sets, batch_size, progress)
    out = [{"task": name, **r} for name, data in sets.items() for r in records(data, scores[name], normalize)]
    return sorted(out, key=lambda r: (r["row"], r.get("question", 0), r.get("answer", 0)))


def records(data: Encoded, scores: torch.Tensor, normalize: bool) -> list[dict]:
    """The records of encoded examples from their (N, C) candidate scores."""
    if normalize:
        scores = scores / torch.tensor([[len(t) for t in cands] for cands in data.targets], dtype=torch.float32)
    probabilities = scores.softmax(-1)  # (N, C)
    chosen = scores.argmax(1).tolist()  # the first of equal scores wins, as in evaluate
    task = get_task(data.examples[0].task)
    values, words = label_values(task), list(task.candidates)
    out = []
    for i, ex in enumerate(data.examples):
        parts = ex.uid.split(":")  # "<task>:input:<row>" (MultiRC: ":<question>:<answer>")
        record = {"row": int(parts[2])}
        if len(parts) == 5:
            record.update(question=int(parts[3]), answer=int(parts[4]))
        record.update(
            label=values[chosen[i]],
            word=words[chosen[i]],
            scores={w: round(float(s), 6) for w, s in zip(words, scores[i])},
            probabilities={w: round(float(p), 6) for w, p in zip(words, probabilities[i])},
        )
        if ex.label is not None:
            record["gold"] = values[ex.label]
        if data.cut and data.cut[i]:  # the row did not fit max_length: which field lost how many words
            record["cut"] = {task.shorten: data.cut[i]}
        out.append(record)
    return out


def labelled_metrics(examples: list[Example], records: list[dict]) -> dict | None:
    """The task's metrics of the predictions when every row has a label, else None."""
    if any(ex.label is None for ex in examples):
        return None
    words = list(get_task(examples[0].task).candidates)
    return score(examples[0].task, [words.index(r["word"]) for r in records], examples)


def write_predictions(path: str | Path, records: list[dict]) -> Path:
    """The records as JSONL at path, written atomically."""
    path = Path(path)
    if path.is_dir():
        raise CaptError(f"--out {path} is a directory; give the file to write, e.g. {path / 'predictions.jsonl'}")
    text = "".join(json.dumps(r) + "\n" for r in records)
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    return path
