"""Rank classification: every candidate target is scored by its log-likelihood; the best one wins.

No answer is ever invalid: the prediction is the argmax over the task's candidate words, so
zero-shot evaluation (no capsules) and evaluation with capsules use the same code.

T5: each input is encoded once; the decoder then reads every candidate target (its tokens,
EOS included) with teacher forcing, all candidates of a batch in one decode call, the rows of
one example next to each other so that they share the encoder output and its cross-attention
keys/values.

Llama / Qwen2: each prompt is read once into the key/value cache, left-padded so that every
prompt ends in the same column. The first answer token's log-prob comes from that pass; the
cache is then repeated once per candidate and the remaining answer tokens (" " + word, no
special tokens) are read from it in one call. The capsule summarises the prompt only (it is
formed in the prompt pass and then stays fixed), exactly as in training, where prompt_mask
leaves the teacher-forced answer out.

Several tasks in one pass (evaluate_tasks): the examples of every task are sorted by prompt
length together and batched across tasks; each row carries its task's capsule set (`tasks`,
when the model holds several) and its own candidates. A batch's examples are given the same
number of candidates by repeating an example's first candidate (CB has 3, the others 2); the
repeats' scores are dropped, so every task's scores and metrics are those of its own run.

The linear-head baseline (a classifier over the prompt's last hidden state, capt/methods.py)
has no candidate targets to rank: its (N, C) scores are the classifier's log-probabilities of
the task's C candidates, the prediction their argmax and the loss their cross-entropy, through
the same evaluate() and tasks.score.

Choices:
- Score = sum of the target tokens' log-probs (the sequence log-likelihood); `normalize=True`
  divides by the number of target tokens instead. Ties go to the first candidate.
- The reported loss is the mean negative log-likelihood of the gold target (summed over its
  tokens), the quantity training minimises.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from tqdm import tqdm

from . import distributed
from .checks import check_count, shown
from .errors import CaptError
from .baselines import classify
from .tasks import DEFAULT_MAX_LEN, Example, get_task, render, score

DEFAULT_BATCH_SIZE = 32


class NonFiniteScores(CaptError):
    """The model scored some candidates NaN or infinite: its weights or the method's tensors are not usable."""


def is_seq2seq(model) -> bool:
    """True for the encoder-decoder family (T5), False for decoder-only models."""
    return model.seq2seq


# ---------------------------------------------------------------------------------------------
# Token ids, computed once per example


@dataclass
class Encoded:
    """The token ids of a list of Examples, ready to batch.

    prompts[i]: the input ids of example i (its tokenizer's special tokens included).
    targets[i][c]: candidate c's target ids (T5: the word with EOS; Llama / Qwen2: the tokens
        of " " + word, no special tokens).
    """

    examples: list[Example]
    prompts: list[list[int]]
    targets: list[list[list[int]]]
    seq2seq: bool
    cut: list[int] | None = None  # per example: the words its shortenable field lost to max_length (0: none)

    @property
    def max_id(self) -> int:
        """The largest token id of the prompts and targets (computed once)."""
        if not hasattr(self, "_max_id"):
            self._max_id = max(max((max(p, default=-1) for p in self.prompts), default=-1),
                               max((max(t, default=-1) for cands in self.targets for t in cands), default=-1))
        return self._max_id

    @property
    def labels(self) -> list[int]:
        return [ex.label for ex in self.examples]

    def __len__(self) -> int:
        return len(self.examples)


def input_format(model, max_length: int | None = None, answer_cue: bool | None = None) -> tuple[int, bool]:
    """(max_length, answer_cue) to encode inputs for `model` with: the values given, else those its
    method's tensors were trained with (MethodConfig.inputs, read from capsules.json / adapter.json),
    else DEFAULT_MAX_LEN and the answer cue for decoder-only models (not for T5)."""
    saved = (model.method.inputs if model.method is not None else None) or {}
    if max_length is None:
        max_length = saved.get("max_length", DEFAULT_MAX_LEN)
    if answer_cue is None:
        answer_cue = saved.get("answer_cue", not is_seq2seq(model))
    return max_length, answer_cue


def encode_examples(examples: list[Example], tokenizer, seq2seq: bool, max_length: int = DEFAULT_MAX_LEN,
                    answer_cue: bool | None = None) -> Encoded:
    """Render and tokenize every example once (inputs shortened to max_length tokens; SuperGLUE
    inputs end in the answer cue when answer_cue, by default for decoder-only models)."""
    if not isinstance(examples, (list, tuple)) or not all(isinstance(ex, Example) for ex in examples):
        raise CaptError("examples must be a list of capt.tasks.Example (tasks.load_task, tasks.read_examples), not "
                        f"{shown(examples)}")
    check_count(max_length, "max_length", 1)
    if answer_cue is not None and not isinstance(answer_cue, bool):
        raise CaptError(f"answer_cue must be True, False or None (by family), got {shown(answer_cue)}")
    cue = not seq2seq if answer_cue is None else answer_cue
    if not examples:
        raise CaptError("nothing to evaluate: the list of examples is empty")
    words: dict[str, list[int]] = {}

    def target(word: str) -> list[int]:
        if word not in words:
            ids = tokenizer.encode(word) if seq2seq else tokenizer.encode(" " + word, add_special_tokens=False)
            if not ids:
                raise CaptError(f"the target {word!r} has no tokens under this tokenizer")
            words[word] = ids
        return words[word]

    prompts, cut = [], []
    for ex in examples:
        seen: dict[str, list[int]] = {}

        def count(text: str) -> int:  # render's token counter; the final text's ids are kept
            seen[text] = tokenizer.encode(text)
            return len(seen[text])

        text = render(ex, max_length, count, cue)
        prompts.append(seen[text] if text in seen else tokenizer.encode(text))
        cut.append(len(render(ex, cue=cue).split()) - len(text.split()))  # only the field's words go
        if len(prompts[-1]) > max_length:  # the fields that are never cut are too long on their own
            cut = get_task(ex.task).shorten
            raise CaptError(f"{ex.where or ex.uid}: the {ex.task} input is {len(prompts[-1])} tokens"
                            f"{f' even with its {cut} cut to nothing' if cut else ''}, over the max length "
                            f"{max_length}; "
                            "raise --max-length or shorten that row")
    targets = [[target(w) for w in ex.candidates] for ex in examples]
    for candidates in {tuple(ex.candidates) for ex in examples}:  # a label that tokenizes like another could never win
        seen: dict[tuple[int, ...], str] = {}
        for word in candidates:
            other = seen.setdefault(tuple(words[word]), word)
            if other != word:
                raise CaptError(f"the label words {other!r} and {word!r} tokenize alike ({words[word]}), so rank "
                                "classification "
                                "could never tell them apart and one would never be predicted; give the task distinct "
                                "label words")
    return Encoded(list(examples), prompts, targets, seq2seq, cut)


def check_reachable(model, data: Encoded, normalize: bool = False) -> None:
    """Refuse label words of which one's tokens begin another's (" the" and " the man" under a Llama
    tokenizer): a summed log-likelihood adds a log-probability (< 0) per further token, so the longer word
    always scores below the shorter and could never be predicted. Ranking by the mean per token
    (normalize) reaches both, and the linear head has no targets; T5's targets end in EOS, so no word of
    its begins another."""
    if normalize or has_linear_head(model):
        return
    for i in {tuple(ex.candidates): i for i, ex in enumerate(data.examples)}.values():  # one row per set of words
        words, ids = data.examples[i].candidates, data.targets[i]
        for a, short in enumerate(ids):
            for b, long in enumerate(ids):
                if len(short) < len(long) and long[:len(short)] == short:
                    raise CaptError(f"the label word {words[a]!r} is the start of {words[b]!r} under this tokenizer "
                                    f"({short} of {long}), so by summed log-likelihood {words[b]!r} could never be "
                                    "predicted: give the task label words none of which begins another, or rank "
                                    "by the mean per token (--normalize)")


def check_vocab(model, data: Encoded) -> None:
    """Every token id of the encoded examples is a row of the model's embedding: a tokenizer whose ids reach
    past config.json's vocab_size belongs to another checkpoint. Read from the id lists on the CPU, so the
    check costs no device sync (and a Python max over the ids once per Encoded)."""
    vocab = model.input_embedding().num_embeddings
    if data.max_id >= vocab:
        where = next((ex.where or ex.uid for ex, p, cands in zip(data.examples, data.prompts, data.targets)
                      if max(p, default=-1) >= vocab or any(max(t) >= vocab for t in cands)), "")
        raise CaptError(f"the tokenizer gives token ids up to {data.max_id} (the first beyond the embedding: {where}), "
                        "but the "
                        f"model's embedding has {vocab} rows "
                        "(config.json vocab_size): the tokenizer files and the checkpoint do not belong together")


def pad(rows: list[list[int]], value: int = 0, left: bool = False, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Lists of ids -> (B, T) long tensor padded with value, and its (B, T) bool mask of real ids."""
    width = max(len(r) for r in rows)
    ids = [([value] * (width - len(r)) + r) if left else (r + [value] * (width - len(r))) for r in rows]
    mask = [
        ([False] * (width - len(r)) + [True] * len(r)) if left else ([True] * len(r) + [False] * (width - len(r)))
        for r in rows
    ]
    return torch.tensor(ids, dtype=torch.long, device=device), torch.tensor(mask, dtype=torch.bool, device=device)


def decoder_inputs(model, targets: list[list[int]], device=None) -> torch.Tensor:
    """(B, Td) T5 teacher forcing: the decoder reads the start token and each target but its last token."""
    start = model.config.decoder_start_token_id
    return pad([[start] + t[:-1] for t in targets], device=device)[0]  # right-padded like the targets


# ---------------------------------------------------------------------------------------------
# Scoring the candidates


def _t5_scores(model, prompts, targets, device, tasks=None) -> torch.Tensor:
    """(B, C) summed log-probs of each candidate target; the input is encoded once per example.
    tasks: each example's capsule set when the model holds several."""
    B, C = len(prompts), len(targets[0])
    ids, mask = pad(prompts, device=device)  # (B, T)
    states, enc_mask = model.encode(ids, mask, tasks)  # (B, N, d): one row per example
    rows = [t for cands in targets for t in cands]  # B * C rows, each example's candidates together
    dec_in = decoder_inputs(model, rows, device)  # (B*C, Td) teacher forcing
    gold, gold_mask = pad(rows, device=device)  # (B*C, Td)
    # right padding under a causal mask cannot change the real steps, so no decoder mask is needed
    logits = model.decode(dec_in, states, enc_mask)  # (B*C, Td, V), each encoded row serves C decoder rows
    logp = logits.float().log_softmax(-1).gather(-1, gold[..., None])[..., 0]  # (B*C, Td)
    return (logp * gold_mask).sum(-1).view(B, C)


def _repeat_cache(cache, n: int) -> None:
    """Repeat each row of a Llama KVCache n times in place (row b -> rows b*n .. b*n + n - 1)."""
    cache.k = [k.repeat_interleave(n, dim=0) for k in cache.k]
    cache.v = [v.repeat_interleave(n, dim=0) for v in cache.v]
    cache.key_mask = cache.key_mask.repeat_interleave(n, dim=0)
    cache.seen = cache.seen.repeat_interleave(n, dim=0)


def _decoder_scores(model, prompts, targets, device, tasks=None) -> torch.Tensor:
    """(B, C) summed log-probs of each candidate's answer tokens after the prompt, prompt read once.
    tasks: each example's capsule set when the model holds several (read by the prompt pass)."""
    B, C = len(prompts), len(targets[0])
    ids, mask = pad(prompts, left=True, device=device)  # (B, T): every prompt ends in column T - 1
    T = ids.shape[1]
    gold, gold_mask = pad([t for cands in targets for t in cands], device=device)  # (B*C, A)
    A = gold.shape[1]
    cache = model.new_cache(B, model.front_length() + T + A - 1)  # capsule slots, prompt vectors or prefix first
    last = torch.full((B, 1), T - 1, dtype=torch.long, device=device)
    # the prompt pass: the capsule is formed here from the prompt tokens alone
    # (B, V)
    first = model(ids, attention_mask=mask, logits_at=last, cache=cache, tasks=tasks)[:, 0].float().log_softmax(-1)
    logp = torch.zeros(B * C, A, device=device)
    rows = torch.arange(B, device=device).repeat_interleave(C)  # the example of each candidate row
    logp[:, 0] = first[rows, gold[:, 0]]  # the first answer token, predicted at the prompt's end
    if A > 1:  # answer token j >= 1 is predicted at answer token j - 1, read after the cached prompt
        _repeat_cache(cache, C)
        step_mask = gold_mask[:, 1:]  # input j is needed only when target j + 1 exists
        logits = model(gold[:, :-1], attention_mask=step_mask, cache=cache)  # (B*C, A-1, V)
        logp[:, 1:] = logits.float().log_softmax(-1).gather(-1, gold[:, 1:, None])[..., 0]
    return (logp * gold_mask).sum(-1).view(B, C)


def has_linear_head(model) -> bool:
    """True when the linear-head baseline is attached: it classifies instead of ranking targets."""
    return model.linear_head is not None


def _head_scores(model, prompts, targets, device) -> torch.Tensor:
    """(B, C) log-probabilities of the linear head's classes, read at each prompt's last token."""
    ids, mask = pad(prompts, device=device)  # (B, T), right-padded: baselines.last_token finds each row's end
    return classify(model, ids, mask).float().log_softmax(-1)  # (B, C)


def bar_label(progress: bool | str) -> str:
    """The progress bar's label: what is scored, when the caller said (a string), else "eval"."""
    return progress if isinstance(progress, str) and progress else "eval"


@torch.no_grad()  # scoring builds no autograd graph, even when the model has trainable tensors
def candidate_scores(
    model, data: Encoded, batch_size: int = DEFAULT_BATCH_SIZE, progress: bool | str = False
) -> torch.Tensor:
    """(N, C) fp32 summed log-likelihood of each example's candidates, on the CPU (with a linear head:
    the log-probability of each class). progress: a progress bar on stderr when slow; a string turns
    it on and says what is scored ("cb test, zero-shot").

    Examples are batched by prompt length (longest first) to waste little on padding; the result
    is in the examples' own order. Under torchrun the batches are shared among the ranks and every
    rank returns all the scores (capt/distributed.py).
    """
    check_count(batch_size, "batch_size", 1)
    n_cands = {len(t) for t in data.targets}
    if len(n_cands) != 1:
        raise CaptError(f"every example must have the same number of candidates, got {sorted(n_cands)}")
    n_cands = n_cands.pop()
    check_vocab(model, data)
    device = next(model.parameters()).device
    one_batch = _t5_scores if data.seq2seq else _decoder_scores
    if has_linear_head(model):
        if model.linear_head.out_features != n_cands:
            raise CaptError(f"the linear head has {model.linear_head.out_features} classes, but the task has {n_cands} "
                            "candidates")
        one_batch = _head_scores
    order = sorted(range(len(data)), key=lambda i: -len(data.prompts[i]))
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    # Under torchrun the same batches are dealt to the ranks in turn (each example is scored in the
    # same batch as in one process); the rows are then gathered. Under FSDP every rank must run as
    # many batches as the others, so a rank short of one scores batch 0 again and drops the result
    # (every example of a task has the same candidates, so every batch makes the same forward calls).
    world = distributed.current()
    mine = batches[world.rank::world.size]
    rounds = -(-len(batches) // world.size)  # batches per rank, rounded up
    spare = rounds - len(mine) if distributed.is_sharded(model) else 0
    out = torch.zeros(len(data), n_cands)
    with distributed.collective("evaluation", inside_model=True):
        for k, idx in enumerate(tqdm(mine + batches[:1] * spare, desc=bar_label(progress), unit="batch", leave=False,
                                     disable=not progress, delay=2.0)):  # shown if slow
            scores = one_batch(model, [data.prompts[i] for i in idx], [data.targets[i] for i in idx], device)
            if k < len(mine):
                out[idx] = scores.cpu()
    return distributed.gather_rows(out)


def evaluate(
    model,
    tokenizer,
    examples: list[Example] | None = None,
    *,
    data: Encoded | None = None,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_length: int | None = None,
    answer_cue: bool | None = None,
    normalize: bool = False,
    progress: bool | str = False,
) -> dict:
    """Rank-classify examples (or already encoded `data`) and score the predictions.

    max_length, answer_cue: the input format (input_format: by default the one the model's method
    was trained with, else DEFAULT_MAX_LEN and the family's cue).
    Returns {"task", "n", "metrics" (tasks.score: headline first), "loss" (mean gold NLL),
    "predictions" (candidate index per example), "scores" ((N, C) tensor of summed log-probs),
    "examples" (per_example: each example's uid, label, prediction and gold log-probability)}.
    normalize: rank by the mean log-prob per target token instead of the sum.
    """
    if data is None:
        if examples is None:
            raise CaptError("evaluate needs examples or encoded data")
        data = encode_examples(examples, tokenizer, is_seq2seq(model), *input_format(model, max_length, answer_cue))
    if normalize and has_linear_head(model):
        raise CaptError("normalize ranks targets by their length; the linear head classifies, it has no targets to "
                        "normalize")
    check_reachable(model, data, normalize)
    scores = candidate_scores(model, data, batch_size, progress)  # (N, C)
    return summarize(data, scores, normalize)


def summarize(data: Encoded, scores: torch.Tensor, normalize: bool = False) -> dict:
    """evaluate's result for encoded data and its (N, C) candidate scores."""
    bad = int((~torch.isfinite(scores)).any(1).sum())
    if bad:  # a NaN never ranks, and a NaN loss is no result: say so instead of reporting metrics
        raise NonFiniteScores(f"the model's scores are NaN or infinite for {bad} of {len(data)} examples: "
                              "its weights or the method's tensors hold values it cannot use")
    ranked = scores
    if normalize:
        lengths = torch.tensor([[len(t) for t in cands] for cands in data.targets], dtype=torch.float32)
        ranked = scores / lengths
    predictions = ranked.argmax(1).tolist()  # the first of equal scores wins
    task = get_task(data.examples[0].task)
    labels = torch.tensor(data.labels)
    loss = -scores[torch.arange(len(data)), labels].mean().item()
    return {
        "task": task.name,
        "n": len(data),
        "metrics": score(task, predictions, data.examples),
        "loss": loss,
        "predictions": predictions,
        "scores": scores,
        "examples": per_example(data, predictions, scores),
    }


def per_example(data: Encoded, predictions: list[int], scores: torch.Tensor) -> dict:
    """Each example of an evaluation, column by column (what a paired comparison of two methods on the same
    rows reads, capt/stats.py): uid, group (MultiRC's question as "row:question", else None), label,
    prediction (candidate index) and gold_logprob (the gold candidate's summed log-probability, rounded to
    1e-6: its negative is the example's gold NLL)."""
    labels = data.labels
    gold = scores[torch.arange(len(data)), torch.tensor(labels)].tolist()
    return {
        "uid": [ex.uid for ex in data.examples],
        "group": [None if ex.group is None else f"{ex.group[0]}:{ex.group[1]}" for ex in data.examples],
        "label": labels,
        "prediction": list(predictions),
        "gold_logprob": [round(x, 6) for x in gold],
    }


# ---------------------------------------------------------------------------------------------
# Several tasks in one pass


def check_tasks(examples) -> None:
    """Several tasks' examples: {name: list of Examples}."""
    if not isinstance(examples, dict) or not all(isinstance(name, str) for name in examples):
        raise CaptError(f"examples of several tasks are {{name: list of Examples}}, not {shown(examples)}")


def check_loaded(model, names) -> None:
    """With several capsule sets loaded, every name must be one of them (model.tasks)."""
    missing = [] if model.tasks is None else [name for name in names if name not in model.tasks]
    if missing:
        raise CaptError(f"capsule set {missing[0]!r} is not loaded: this model holds {', '.join(model.tasks)}")


@torch.no_grad()
def mixed_candidate_scores(model, sets: dict[str, Encoded], batch_size: int = DEFAULT_BATCH_SIZE,
                           progress: bool | str = False) -> dict[str, torch.Tensor]:
    """{name: (N, C) fp32 scores on the CPU} for several sets of encoded examples scored in shared batches.

    The examples of all sets are sorted by prompt length together (longest first) and batched
    across sets. When the model holds several capsule sets (model.tasks), every row is served by
    the set of its name. Within a batch every example gets the batch's largest candidate count,
    by repeating its first candidate; those repeats' scores are dropped.
    """
    check_count(batch_size, "batch_size", 1)
    if not sets:
        raise CaptError("nothing to evaluate: no task given")
    if has_linear_head(model):
        raise CaptError("the linear head classifies one task's classes; several tasks in one pass need capsules or "
                        "zero-shot")
    check_loaded(model, sets)
    out = {}
    for name, data in sets.items():
        n_cands = {len(t) for t in data.targets}
        if len(n_cands) != 1:
            raise CaptError(f"{name}: every example must have the same number of candidates, got {sorted(n_cands)}")
        check_vocab(model, data)
        out[name] = torch.empty(len(data), n_cands.pop())
    device = next(model.parameters()).device
    one_batch = _t5_scores if is_seq2seq(model) else _decoder_scores
    rows = [(name, i) for name, data in sets.items() for i in range(len(data))]
    rows.sort(key=lambda row: -len(sets[row[0]].prompts[row[1]]))  # stable: ties keep the sets' order
    batches = [rows[s:s + batch_size] for s in range(0, len(rows), batch_size)]
    for batch in tqdm(batches, desc=bar_label(progress), unit="batch", leave=False, disable=not progress, delay=2.0):
        width = max(out[name].shape[1] for name, _ in batch)
        targets = [
            sets[name].targets[i] + [sets[name].targets[i][0]] * (width - out[name].shape[1]) for name, i in batch
        ]
        tasks = None if model.tasks is None else [name for name, _ in batch]
        # (B, width)
        scores = one_batch(model, [sets[name].prompts[i] for name, i in batch], targets, device, tasks).cpu()
        for row, (name, i) in enumerate(batch):
            out[name][i] = scores[row, :out[name].shape[1]]  # the repeated candidates' scores are dropped
    return out


def evaluate_tasks(
    model,
    tokenizer,
    examples: dict[str, list[Example]],
    *,
    batch_size: int = DEFAULT_BATCH_SIZE,
    max_length: int | dict[str, int] = DEFAULT_MAX_LEN,
    answer_cue: bool | dict[str, bool | None] | None = None,
    normalize: bool = False,
    progress: bool | str = False,
) -> dict[str, dict]:
    """Rank-classify several tasks in one pass: {name: examples} -> {name: evaluate's result}.

    With several capsule sets loaded (load_model(path, capsules={name: directory, ...})), each
    name is the capsule set that serves its examples (CLI: the task's name); zero-shot, the names
    are labels only. Batches mix the tasks (sorted by prompt length together); each task's scores
    and metrics are those that evaluate() gives it alone, up to floating-point rounding of the
    batch shapes. max_length: one budget for all, or {name: budget}; answer_cue likewise (None: the
    family's default, the cue for decoder-only models).
    """
    if normalize and has_linear_head(model):
        raise CaptError("normalize ranks targets by their length; the linear head classifies, it has no targets to "
                        "normalize")
    check_tasks(examples)
    check_loaded(model, examples)
    budgets = max_length if isinstance(max_length, dict) else {name: max_length for name in examples}
    seq2seq = is_seq2seq(model)
    cues = answer_cue if isinstance(answer_cue, dict) else {name: answer_cue for name in examples}
    sets = {name: encode_examples(exs, tokenizer, seq2seq, budgets.get(name, DEFAULT_MAX_LEN), cues.get(name))
            for name, exs in examples.items()}
    for data in sets.values():
        check_reachable(model, data, normalize)
    scores = mixed_candidate_scores(model, sets, batch_size, progress)
    return {name: summarize(sets[name], scores[name], normalize) for name in sets}
