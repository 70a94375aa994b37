"""capt/stats.py: the exact sign test against hand-computed binomial tails, the bootstrap's metrics against
capt.tasks' own, the interval's behaviour on cases whose answer is known, and the program's decision rule."""

import math
import random

import numpy as np
import pytest

from capt import CaptError
from capt.stats import _metric, binomial_two_sided, compare_pair, decision, in_words, sign_test
from capt.tasks import accuracy, f1, macro_f1


def test_binomial_tails_by_hand():
    assert binomial_two_sided(1, 10) == pytest.approx(2 * (1 + 10) / 1024)  # 0.021484375
    assert binomial_two_sided(9, 10) == binomial_two_sided(1, 10)
    assert binomial_two_sided(0, 5) == pytest.approx(2 / 32)
    assert binomial_two_sided(5, 10) == 1.0 and binomial_two_sided(0, 0) == 1.0
    assert binomial_two_sided(3, 12) == pytest.approx(2 * sum(math.comb(12, i) for i in range(4)) / 4096)  # 0.146


def test_mcnemar_on_a_hand_made_table():
    """One seed each: 9 rows only A gets right, 1 only B, 20 both, 10 neither: McNemar's exact p = P(|X - 5| >= 4)."""
    a = np.array([True] * 9 + [False] + [True] * 20 + [False] * 10)
    b = np.array([False] * 9 + [True] + [True] * 20 + [False] * 10)
    test = sign_test(a[None], b[None])
    assert (test["wins"], test["losses"], test["ties"]) == (9, 1, 30)
    assert test["p"] == pytest.approx(22 / 1024)


def test_several_seeds_count_each_rows_share_of_right_seeds():
    a = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1]], dtype=bool)  # 3 seeds x 3 rows: the rows' shares 1, 2/3, 1/3
    b = np.array([[0, 1, 1], [0, 1, 0]], dtype=bool)  # 2 seeds: shares 0, 1, 1/2
    assert sign_test(a, b) == {"wins": 1, "losses": 2, "ties": 0, "p": 1.0}
    assert sign_test(a, a) == {"wins": 0, "losses": 0, "ties": 3, "p": 1.0}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_bootstraps_metrics_are_the_tasks_own(seed):
    rng = random.Random(seed)
    labels = [rng.randrange(3) for _ in range(40)]
    predictions = [rng.randrange(3) for _ in range(40)]
    binary = [rng.randrange(2) for _ in range(40)]
    ones = np.ones((1, 40))
    p, y = np.array([predictions]), np.array(labels)
    assert _metric("accuracy", p, y, ones)[0] == pytest.approx(accuracy(predictions, labels))
    assert _metric("f1", p, y, ones)[0] == pytest.approx(macro_f1(predictions, labels))
    assert _metric("f1a", np.array([binary]), np.array(labels) % 2, ones)[0] == pytest.approx(
        f1(binary, [v % 2 for v in labels], 1)
    )
    # a row drawn twice counts twice; a row not drawn does not count (a class only it holds leaves the macro mean)
    weights = np.array([[2.0] + [1.0] * 38 + [0.0]])
    listed = [0] + list(range(39))
    assert _metric("f1", p, y, weights)[0] == pytest.approx(
        macro_f1([predictions[i] for i in listed], [labels[i] for i in listed])
    )


def test_equal_methods_are_within_noise_and_a_clear_gap_is_not():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 300)
    same = compare_pair(labels[None], labels[None], labels, "accuracy", resamples=500)
    assert (same["difference"], same["low"], same["high"], same["p"], same["verdict"]) == (0.0, 0.0, 0.0, 1.0, "within "
                                                                                                               "noise")
    good = np.where(rng.random(300) < 0.85, labels, 1 - labels)
    poor = np.where(rng.random(300) < 0.55, labels, 1 - labels)
    c = compare_pair(good, poor, labels, "accuracy", resamples=2000)
    assert c["low"] > 0 and c["p"] < 1e-6 and c["verdict"] == "A ahead" and c["low"] < c["difference"] < c["high"]
    # the interval's width is about 2 x 1.96 x the standard error of the paired difference
    d = (good == labels).astype(float) - (poor == labels)
    se = 100 * d.std(ddof=1) / math.sqrt(300)
    assert (c["high"] - c["low"]) / (2 * 1.96 * se) == pytest.approx(1.0, abs=0.15)
    again = compare_pair(good, poor, labels, "accuracy", resamples=2000)
    assert again == c  # seeded: the same draws
    flipped = compare_pair(poor, good, labels, "accuracy", resamples=2000)
    assert flipped["verdict"] == "B ahead" and flipped["difference"] == -c["difference"]


def test_groups_are_resampled_whole():
    """Questions of perfectly correlated answers: resampling questions (not answers) gives the wider interval."""
    rng = np.random.default_rng(1)
    per_question = rng.random(40) < 0.7
    right_a = np.repeat(per_question, 10)  # 40 questions x 10 answers, each question all right or all wrong
    labels = np.ones(400, dtype=int)
    a = np.where(right_a, 1, 0)
    b = np.where(rng.random(400) < 0.6, 1, 0)
    groups = np.repeat(np.arange(40), 10)
    rows = compare_pair(a, b, labels, "accuracy", resamples=1000)
    whole = compare_pair(a, b, labels, "accuracy", groups=groups, resamples=1000)
    assert whole["units"] == 40 and rows["units"] == 400
    assert (whole["high"] - whole["low"]) > 2 * (rows["high"] - rows["low"])


def test_bad_shapes_are_one_line():
    with pytest.raises(CaptError, match=r"method B: expected one prediction per test row \(3\)"):
        compare_pair([0, 1, 1], [0, 1], [0, 1, 1], "accuracy")
    with pytest.raises(CaptError, match="metric 'em' is not one of"):
        compare_pair([0], [0], [0], "em")


def test_the_decision_rule():
    ahead = {"difference": 6.0, "low": 1.0, "high": 11.0, "p": 0.01}
    close = {"difference": 1.0, "low": -4.0, "high": 6.0, "p": 0.6}
    behind = {"difference": -2.0, "low": -7.0, "high": 2.5, "p": 0.4}
    level_wide = {"difference": 0.0, "low": -5.0, "high": 5.0, "p": 1.0}
    assert decision({"x": ahead, "y": dict(ahead, p=0.04)}) == "holds"
    assert decision({"x": ahead, "y": close}) == "undecided"
    assert decision({"x": ahead, "y": behind}) == "refuted"  # a baseline at or above CaPT, a CaPT lead of 3 excluded
    assert decision({"x": level_wide}) == "undecided"  # level, but a 3-point lead is not excluded
    with pytest.raises(CaptError):
        decision({})
    words = in_words("CaPT", "prompt", {**close, "rows": 277, "verdict": "within noise"})
    assert (
        words == "CaPT - prompt: +1.00 points (95% interval -4.00 to +6.00, sign test p = 0.6, 277 rows): within noise"
    )
