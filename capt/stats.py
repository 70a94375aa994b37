"""Paired statistics: two methods scored on the same test rows, and whether they differ beyond noise.

Seeds do not shrink the noise of a test set: every seed scores the same rows, so two methods are
compared row by row. For methods A and B (each with one or more seeds' predictions on the rows):

    difference   A's headline minus B's, each the mean over its seeds, in points
    interval     the 95% paired bootstrap interval of that difference: the rows (MultiRC: whole
                 questions) are resampled with replacement, the same draw for both methods, and
                 the difference recomputed, RESAMPLES times; the 2.5th and 97.5th percentiles
    p            accuracy, one seed each, single rows: McNemar's exact test, the two-sided sign test
                 over the rows where exactly one of the two is right. Anything else (several seeds on
                 either side, a one-answer zero-shot against trained seeds, grouped rows, an F1):
                 the paired randomization test below, of the metric itself. A sign test over each
                 row's share of right seeds would hold its level only where both sides' seeds vary
                 alike within a row, which nothing ensures: with three seeds against one answer at
                 equal accuracy it counts a row right 2 times in 3 as lost to a right answer, and
                 three seeds that agree with each other against three that do not look like one
                 against three (tests/test_stats.py: both cases find gaps that are not there).
                 An F1 (macro-F1, MultiRC's F1a): a paired randomization test
                 of the F1 itself, since right and wrong rows say nothing of an F1 that counts only
                 one class's answers: under the null that A and B are interchangeable on every row
                 (MultiRC: every question), each unit's predictions are swapped between them with
                 probability 1/2, RESAMPLES times, and p is the share of swaps whose difference is
                 at least as large in size as the one observed (the observed one counted in)
    verdict      "A ahead" / "B ahead" when p < 0.05 and the interval excludes 0; else "within noise"

The headline metrics (capt/tasks.py: accuracy, macro-F1, F1a) are recomputed on each resample from
the confusion counts, so F1 is resampled as F1, not as a mean of per-row scores.
"""

from __future__ import annotations

import math

import numpy as np

from .errors import CaptError

RESAMPLES = 10_000
LEVEL = 0.95
CHUNK = 500  # resamples computed at once (memory: CHUNK x rows weights)
METRICS = ("accuracy", "f1", "f1a")  # what each task's headline is computed as


def binomial_two_sided(k: int, n: int) -> float:
    """The exact two-sided p-value of k successes in n fair coin flips: min(1, 2 P(X <= min(k, n - k)))."""
    if n == 0:
        return 1.0
    low = min(k, n - k)
    tail = sum(math.comb(n, i) for i in range(low + 1)) / 2**n
    return min(1.0, 2 * tail)


def _as_predictions(values, n_rows: int, what: str) -> np.ndarray:
    a = np.asarray(values, dtype=np.int64)
    if a.ndim == 1:
        a = a[None]
    if a.ndim != 2 or a.shape[1] != n_rows or a.shape[0] == 0:
        raise CaptError(f"{what}: expected one prediction per test row ({n_rows}) for each seed, got shape {a.shape}")
    return a


def sign_test(right_a: np.ndarray, right_b: np.ndarray) -> dict:
    """right_a (Sa, N), right_b (Sb, N) booleans: which seeds got each row right. A row is a win for A when A's
    share of right seeds is higher than B's, a loss when lower; the p-value is binomial_two_sided over them."""
    d = right_a.mean(0) - right_b.mean(0)
    wins, losses = int((d > 0).sum()), int((d < 0).sum())
    return {
        "wins": wins,
        "losses": losses,
        "ties": int(len(d) - wins - losses),
        "p": binomial_two_sided(wins, wins + losses),
    }


def _counts(kind: str, predictions: np.ndarray, labels: np.ndarray, classes: np.ndarray) -> np.ndarray:
    """Each row's share in the metric's counts, (S, K, 3, N): for each seed and each class counted (K: one for
    accuracy and F1a), whether the row is a true positive, a false positive, a false negative (accuracy: right)."""
    wanted = [1] if kind == "f1a" else classes
    out = np.zeros((len(predictions), 1 if kind == "accuracy" else len(wanted), 3, len(labels)))
    for s, p in enumerate(predictions):
        if kind == "accuracy":
            out[s, 0, 0] = p == labels
            continue
        for k, c in enumerate(wanted):
            out[s, k] = [(p == c) & (labels == c), (p == c) & (labels != c), (p != c) & (labels == c)]
    return out


def _from_counts(kind: str, counts: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """counts (R, S, K, 3) summed over the rows of each resample, rows (R,) how many rows it counts -> (R,) the
    metric in percent, the mean over the seeds."""
    if kind == "accuracy":
        return 100.0 * counts[:, :, 0, 0].mean(1) / rows
    tp, fp, fn = counts[..., 0], counts[..., 1], counts[..., 2]
    f1 = np.where(tp > 0, 200.0 * tp / np.maximum(2 * tp + fp + fn, 1e-12), 0.0)
    occurs = (tp + fp + fn) > 0 if kind == "f1" else np.ones_like(tp, dtype=bool)  # macro: the classes that occur
    return (np.where(occurs, f1, 0.0).sum(-1) / np.maximum(occurs.sum(-1), 1)).mean(1)


def _metric(kind: str, predictions: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The metric in percent of each seed's predictions (S, N) under row weights (R, N) -> (R,) mean over seeds."""
    classes = np.unique(np.concatenate([labels, predictions.ravel()]))
    counts = np.einsum("rn,skjn->rskj", weights, _counts(kind, predictions, labels, classes))
    return _from_counts(kind, counts, weights.sum(1))


def randomization_test(kind: str, pred_a: np.ndarray, pred_b: np.ndarray, labels: np.ndarray, index: np.ndarray,
                       resamples: int, rng: np.random.Generator) -> float:
    """The two-sided paired randomization test of the metric's difference A - B (the module docstring). index (N,):
    each row's unit, swapped whole. With unequal seed counts both are repeated to a common count first, which
    leaves each method's metric (a mean over seeds) as it is."""
    seeds = math.lcm(len(pred_a), len(pred_b))
    pred_a = np.tile(pred_a, (seeds // len(pred_a), 1))
    pred_b = np.tile(pred_b, (seeds // len(pred_b), 1))
    classes = np.unique(np.concatenate([labels, pred_a.ravel(), pred_b.ravel()]))
    a, b = _counts(kind, pred_a, labels, classes), _counts(kind, pred_b, labels, classes)
    rows = np.full(1, float(len(labels)))
    observed = abs(_from_counts(kind, a.sum(-1)[None], rows) - _from_counts(kind, b.sum(-1)[None], rows))[0]
    as_large = 0
    for start in range(0, resamples, CHUNK):
        r = min(CHUNK, resamples - start)
        swap = (rng.random((r, int(index.max()) + 1)) < 0.5)[:, index].astype(float)  # (r, N): B's row in A's place
        moved = np.einsum("rn,skjn->rskj", swap, b - a)
        d = _from_counts(kind, a.sum(-1) + moved, rows) - _from_counts(kind, b.sum(-1) - moved, rows)
        as_large += int((np.abs(d) >= observed - 1e-9).sum())
    return (as_large + 1) / (resamples + 1)


def compare_pair(pred_a, pred_b, labels, metric: str, groups=None, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Method A against method B on the same rows. pred_a (Sa, N) and pred_b (Sb, N): each seed's predicted
    candidate per row; labels (N,); metric: "accuracy", "f1" (macro-F1) or "f1a" (binary F1, class 1);
    groups (N,): rows resampled together (MultiRC's questions), None for single rows. Returns the dict of
    the module docstring: a_score, b_score (each method's metric, mean over seeds), difference, low, high, p and
    test ("sign" or "randomization"), the sign test's wins, losses and ties, rows, verdict."""
    if metric not in METRICS:
        raise CaptError(f"metric {metric!r} is not one of {', '.join(METRICS)}")
    labels = np.asarray(labels, dtype=np.int64)
    n = len(labels)
    if n == 0:
        raise CaptError("nothing to compare: no test rows")
    pred_a, pred_b = _as_predictions(pred_a, n, "method A"), _as_predictions(pred_b, n, "method B")
    ones = np.ones((1, n))
    a, b = float(_metric(metric, pred_a, labels, ones)[0]), float(_metric(metric, pred_b, labels, ones)[0])
    if groups is None:
        index = np.arange(n)
    else:
        _, index = np.unique(np.asarray([str(g) for g in groups]), return_inverse=True)
    n_units = int(index.max()) + 1
    rng = np.random.default_rng(seed)
    differences = []
    for start in range(0, resamples, CHUNK):
        r = min(CHUNK, resamples - start)
        draws = rng.integers(0, n_units, size=(r, n_units))
        counts = np.zeros((r, n_units))
        np.add.at(counts, (np.arange(r)[:, None], draws), 1.0)  # how often each unit is drawn
        weights = counts[:, index]  # (r, N): a row counts as often as its unit
        differences.append(_metric(metric, pred_a, labels, weights) - _metric(metric, pred_b, labels, weights))
    differences = np.concatenate(differences)
    tail = (1 - LEVEL) / 2
    low, high = (float(x) for x in np.quantile(differences, [tail, 1 - tail]))
    test = sign_test(pred_a == labels, pred_b == labels)
    by_signs = metric == "accuracy" and len(pred_a) == len(pred_b) == 1 and groups is None  # McNemar's
    if not by_signs:
        test["p"] = randomization_test(metric, pred_a, pred_b, labels, index, resamples, rng)
    ahead = test["p"] < 0.05 and (low > 0 or high < 0)
    verdict = ("A ahead" if a > b else "B ahead") if ahead else "within noise"
    return {
        "a_score": a,
        "b_score": b,
        "difference": a - b,
        "low": low,
        "high": high,
        **test,
        "test": "sign" if by_signs else "randomization",
        "rows": n,
        "units": n_units,
        "seeds": [len(pred_a), len(pred_b)],
        "resamples": resamples,
        "verdict": verdict,
    }


MARGIN = 3.0  # points: the CaPT lead that an interval must exclude for the rule's "refuted"


def decision(comparisons: dict[str, dict], margin: float = MARGIN) -> str:
    """The evidence program's rule for one task (docs/results.md, fixed before the runs), from CaPT's comparison
    with each baseline (compare_pair with A = CaPT): "holds" when CaPT is ahead of every baseline with p < 0.05;
    "refuted" when some baseline is at or above CaPT and the interval excludes a CaPT lead of `margin` points;
    else "undecided"."""
    if not comparisons:
        raise CaptError("no comparisons to decide on")
    if all(c["difference"] > 0 and c["p"] < 0.05 for c in comparisons.values()):
        return "holds"
    if any(refutes(c, margin) for c in comparisons.values()):
        return "refuted"
    return "undecided"


def refutes(c: dict, margin: float = MARGIN) -> bool:
    """Whether one comparison (A = CaPT) refutes the claim: the baseline at or above CaPT, and the interval
    excluding a CaPT lead of `margin` points."""
    return c["difference"] <= 0 and c["high"] < margin


def in_words(name_a: str, name_b: str, c: dict) -> str:
    """One sentence for a comparison: the difference, its interval and p, and whether it is within noise."""
    numbers = (f"{c['difference']:+.2f} points (95% interval {c['low']:+.2f} to {c['high']:+.2f}, "
               f"{TESTS[c.get('test', 'sign')]} p = {c['p']:.3g}, {c['rows']} rows)")
    if c["verdict"] == "within noise":
        return f"{name_a} - {name_b}: {numbers}: within noise"
    winner = name_a if c["verdict"] == "A ahead" else name_b
    return f"{name_a} - {name_b}: {numbers}: {winner} ahead"


TESTS = {"sign": "sign test", "randomization": "randomization test"}  # compare_pair's "test", as in_words says it
