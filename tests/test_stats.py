"""capt/stats.py: the exact sign test against hand-computed binomial tails, the bootstrap's metrics against
capt.tasks' own, the interval's behaviour on cases whose answer is known, and the program's decision rule."""

import math
import random

import numpy as np
import pytest

from capt import CaptError
from capt.stats import _metric, binomial_two_sided, compare_pair, decision, in_words, randomization_test, sign_test
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


def exact_randomization_p(metric, a, b, labels, units):
    """The randomization test by enumeration: every way of swapping whole units between A and B (one seed each),
    each method's metric from capt.tasks; p = the share of swaps with |A' - B'| >= |A - B|."""
    score = {"f1a": lambda p: f1(p, labels, 1), "f1": lambda p: macro_f1(p, labels),
             "accuracy": lambda p: accuracy(p, labels)}[metric]
    observed = abs(score(a) - score(b))
    names = sorted(set(units))
    hits = 0
    for mask in range(2 ** len(names)):
        swapped = {u for i, u in enumerate(names) if mask >> i & 1}
        a2 = [y if u in swapped else x for x, y, u in zip(a, b, units)]
        b2 = [x if u in swapped else y for x, y, u in zip(a, b, units)]
        hits += abs(score(a2) - score(b2)) >= observed - 1e-9
    return hits / 2 ** len(names)


@pytest.mark.parametrize("metric, grouped", [("f1a", False), ("f1", False), ("f1a", True)])
def test_the_randomization_test_is_the_enumerated_one(metric, grouped):
    """An F1's p is the randomization test of the F1 itself: 20,000 random swaps land within sampling error
    (under 0.015) of the exact p that enumerating all 2**12 swaps (or, grouped, all 2**6 swaps of question
    pairs) gives, with the metric computed by capt.tasks."""
    rng = random.Random(3)
    classes = 2 if metric == "f1a" else 3
    labels = [rng.randrange(classes) for _ in range(12)]
    a = [y if rng.random() < 0.8 else rng.randrange(classes) for y in labels]
    b = [y if rng.random() < 0.45 else rng.randrange(classes) for y in labels]
    units = [i // 2 for i in range(12)] if grouped else list(range(12))
    c = compare_pair(a, b, labels, metric, groups=units if grouped else None, resamples=20_000)
    exact = exact_randomization_p(metric, a, b, labels, units)
    assert c["test"] == "randomization" and 0 < exact < 1
    assert c["p"] == pytest.approx(exact, abs=0.015)


def test_for_accuracy_the_randomization_test_is_mcnemars():
    """Swapping rows only moves the discordant ones, each by one answer either way: the randomization test of
    accuracy is McNemar's exact test, which compare_pair reports for accuracy."""
    rng = np.random.default_rng(5)
    labels = rng.integers(0, 2, 60)
    a = np.where(rng.random(60) < 0.75, labels, 1 - labels)
    b = np.where(rng.random(60) < 0.55, labels, 1 - labels)
    c = compare_pair(a, b, labels, "accuracy", resamples=1000)
    by_swaps = randomization_test("accuracy", a[None], b[None], labels, np.arange(60), 40_000,
                                  np.random.default_rng(0))
    assert c["test"] == "sign" and by_swaps == pytest.approx(c["p"], abs=0.01)


def test_an_f1_gap_that_right_and_wrong_rows_do_not_show():
    """A baseline that answers 0 everywhere: on accuracy it is level with A (the sign test sees nothing), on F1a it
    scores 0 against A's 50 or so, and the randomization test of F1a says so."""
    labels = np.array([1, 0] * 50)
    a = np.array([1, 1, 0, 0] * 25)  # right on half the rows, as the baseline is
    b = np.zeros(100, dtype=int)
    c = compare_pair(a, b, labels, "f1a", resamples=5000)
    assert sign_test((a == labels)[None], (b == labels)[None])["p"] == 1.0
    assert c["difference"] == pytest.approx(50.0) and c["p"] < 0.001 and c["verdict"] == "A ahead"
    assert c["low"] > 30
    assert ", randomization test p = " in in_words("A", "B", c) and in_words("A", "B", c).endswith(": A ahead")


def test_seeds_of_unequal_number_are_compared_as_they_are():
    """One seed against three: the randomization test repeats them to a common count, which leaves each method's
    metric as it is; identical methods are never apart."""
    rng = np.random.default_rng(7)
    labels = rng.integers(0, 3, 50)
    three = np.stack([np.where(rng.random(50) < 0.7, labels, (labels + 1) % 3) for _ in range(3)])
    one = np.where(rng.random(50) < 0.5, labels, (labels + 2) % 3)
    c = compare_pair(three, one, labels, "f1", resamples=2000)
    assert c["seeds"] == [3, 1] and 0 < c["p"] <= 1
    same = compare_pair(three, three, labels, "f1", resamples=500)
    assert same["p"] == 1.0 and same["verdict"] == "within noise"


def test_seeds_on_accuracy_take_the_randomization_test_where_a_sign_test_finds_gaps_that_are_not_there():
    """Both methods right on each row with the same chance (80%), 638 rows. Three seeds against one set of answers:
    the sign test over shares counts a row right 2 times in 3 as lost to a right answer. Three seeds that agree with
    each other against three that do not: the first side is one seed in effect. Either way the sign test finds a gap
    (p far below 0.05); the randomization test of the accuracy, which compare_pair takes with several seeds, does
    not. One seed each keeps McNemar's test."""
    rng = np.random.default_rng(11)
    labels = np.ones(638, dtype=np.int64)
    chance = rng.beta(8, 2, 638)
    three = (rng.random((3, 638)) < chance).astype(np.int64)
    one = (rng.random((1, 638)) < chance).astype(np.int64)
    alike = np.repeat((rng.random((1, 638)) < chance).astype(np.int64), 3, axis=0)
    for a, b in ((three, one), (alike, three)):
        assert sign_test(a == labels, b == labels)["p"] < 1e-3
        c = compare_pair(a, b, labels, "accuracy", resamples=2000)
        assert c["test"] == "randomization" and c["p"] > 0.05 and c["verdict"] == "within noise"
        assert abs(c["difference"]) < 3
    assert compare_pair(three[:1], one, labels, "accuracy", resamples=200)["test"] == "sign"
    assert compare_pair(three[:1], one, labels, "accuracy", groups=np.arange(638) // 2, resamples=200)["test"] == (
        "randomization")  # grouped rows: swapped whole, as the interval resamples them
