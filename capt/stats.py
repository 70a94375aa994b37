"""Paired statistics: two methods scored on the same test rows, and whether they differ beyond noise.

Seeds do not shrink the noise of a test set: every seed scores the same rows, so two methods are
compared row by row. For methods A and B (each with one or more seeds' predictions on the rows):

    difference   A's headline minus B's, each the mean over its seeds, in points
    interval     the 95% paired bootstrap interval of that difference: the rows (MultiRC: whole
                 questions) are resampled with replacement, the same draw for both methods, and
                 the difference recomputed, RESAMPLES times; the 2.5th and 97.5th percentiles
    p            the exact two-sided sign test over the rows where the two differ in how often
                 they are right (each row's share of right seeds); with one seed each this is
                 McNemar's exact test
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


def _metric(kind: str, predictions: np.ndarray, labels: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """The metric in percent of each seed's predictions (S, N) under row weights (R, N) -> (R,) mean over seeds."""
    out = np.zeros(weights.shape[0])
    classes = np.unique(np.concatenate([labels, predictions.ravel()]))
    for p in predictions:
        if kind == "accuracy":
            value = 100.0 * (weights @ (p == labels)) / weights.sum(1)
        else:
            wanted = [1] if kind == "f1a" else classes
            total, present = np.zeros(weights.shape[0]), np.zeros(weights.shape[0])
            for c in wanted:
                tp = weights @ ((p == c) & (labels == c))
                fp = weights @ ((p == c) & (labels != c))
                fn = weights @ ((p != c) & (labels == c))
                f1 = np.where(tp > 0, 200.0 * tp / np.maximum(2 * tp + fp + fn, 1e-12), 0.0)
                # macro: classes that occur
                occurs = (tp + fp + fn) > 0 if kind == "f1" else np.ones_like(tp, dtype=bool)
                total += np.where(occurs, f1, 0.0)
                present += occurs
            value = total / np.maximum(present, 1)
        out += value
    return out / len(predictions)


def compare_pair(pred_a, pred_b, labels, metric: str, groups=None, resamples: int = RESAMPLES, seed: int = 0) -> dict:
    """Method A against method B on the same rows. pred_a (Sa, N) and pred_b (Sb, N): each seed's predicted
    candidate per row; labels (N,); metric: "accuracy", "f1" (macro-F1) or "f1a" (binary F1, class 1);
    groups (N,): rows resampled together (MultiRC's questions), None for single rows. Returns the dict of
    the module docstring: a_score, b_score (each method's metric, mean over seeds), difference, low, high, p, wins,
    losses, ties, rows, verdict."""
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
    ahead = test["p"] < 0.05 and (low > 0 or high < 0)
    verdict = ("A ahead" if a > b else "B ahead") if ahead else "within noise"
    return {
        "a_score": a,
        "b_score": b,
        "difference": a - b,
        "low": low,
        "high": high,
        **test,
        "rows": n,
        "units": n_units,
        "seeds": [len(pred_a), len(pred_b)],
        "resamples": resamples,
        "verdict": verdict,
    }


def decision(comparisons: dict[str, dict], margin: float = 3.0) -> str:
    """The evidence program's rule for one task (docs/results.md, fixed before the runs), from CaPT's comparison
    with each baseline (compare_pair with A = CaPT): "holds" when CaPT is ahead of every baseline with p < 0.05;
    "refuted" when some baseline is at or above CaPT and the interval excludes a CaPT lead of `margin` points;
    else "undecided"."""
    if not comparisons:
        raise CaptError("no comparisons to decide on")
    if all(c["difference"] > 0 and c["p"] < 0.05 for c in comparisons.values()):
        return "holds"
    if any(c["difference"] <= 0 and c["high"] < margin for c in comparisons.values()):
        return "refuted"
    return "undecided"


def in_words(name_a: str, name_b: str, c: dict) -> str:
    """One sentence for a comparison: the difference, its interval and p, and whether it is within noise."""
    numbers = (f"{c['difference']:+.2f} points (95% interval {c['low']:+.2f} to {c['high']:+.2f}, sign test p = "
               f"{c['p']:.3g}, {c['rows']} rows)")
    if c["verdict"] == "within noise":
        return f"{name_a} - {name_b}: {numbers}: within noise"
    winner = name_a if c["verdict"] == "A ahead" else name_b
    return f"{name_a} - {name_b}: {numbers}: {winner} ahead"
