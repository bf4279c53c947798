"""The paired drop's statistics against a simulation with known per-item truth.

A population of items with a fixed right/wrong answer for the reference and for a candidate is
the truth; each repetition samples items from it, as a study samples a benchmark, and runs the
library's own functions (vectorised over a thousand seeded repetitions).
"""

from __future__ import annotations

import numpy as np
import pytest

from autotune.study import paired

REPS = 1000
POOL = 14_000  # about MMLU's test set


def population(
    rng: np.random.Generator, ref_acc: float, discordant: float, drop_points: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-item truth: the reference's and the candidate's answers, with exactly the given
    accuracy, disagreement rate and drop (fractions of the pool)."""
    b = int(round(POOL * (discordant + drop_points / 100) / 2))  # reference right, candidate wrong
    c = int(round(POOL * (discordant - drop_points / 100) / 2))  # candidate right, reference wrong
    both = int(round(POOL * ref_acc)) - b
    ref = np.zeros(POOL)
    mine = np.zeros(POOL)
    ref[:both] = mine[:both] = 1
    ref[both : both + b] = 1
    mine[both + b : both + b + c] = 1
    order = rng.permutation(POOL)
    return ref[order], mine[order]


def counts(ref: np.ndarray, mine: np.ndarray, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cumulative discordant counts along axis 1 of an index array (repetitions x items)."""
    r, m = ref[idx], mine[idx]
    return np.cumsum((r == 1) & (m == 0), axis=1), np.cumsum((r == 0) & (m == 1), axis=1)


def test_the_95_interval_of_the_paired_drop_covers_the_true_drop_95_percent_of_the_time():
    rng = np.random.default_rng(19)
    ref, mine = population(rng, ref_acc=0.45, discordant=0.16, drop_points=2.0)
    truth = (ref - mine).mean() * 100
    n = 570
    idx = rng.integers(0, POOL, (REPS, n))
    b, c = counts(ref, mine, idx)
    mean, se = paired.mcnemar(b[:, -1], c[:, -1], n)
    lo, hi = 100 * (mean - paired.Z_FINAL * se), 100 * (mean + paired.Z_FINAL * se)
    coverage = float(((lo <= truth) & (truth <= hi)).mean())
    assert 0.93 <= coverage <= 0.97, coverage
    # The same items scored as two independent accuracies: sqrt(2 x 0.45 x 0.55 / 0.16), about
    # 1.76 times as wide, although both artifacts answered the same items.
    p_ref, p_mine = ref[idx].mean(axis=1), mine[idx].mean(axis=1)
    unpaired = 100 * np.sqrt((p_ref * (1 - p_ref) + p_mine * (1 - p_mine)) / (n - 1))
    assert float(np.median(unpaired / (100 * se))) > 1.6


def test_paired_drop_of_one_artifact_matches_the_counts_and_shows_both_errors():
    ref = np.array([1, 1, 1, 0, 0, 1, 0, 1, 1, 0] * 30)
    mine = np.array([1, 0, 1, 0, 1, 1, 0, 1, 0, 0] * 30)
    d = paired.paired_drop(mine, ref, mine_margin=mine * 2.0 - 1, ref_margin=ref * 2.0 - 1)
    assert (d.n, d.discordant) == (300, 90)
    assert d.points == pytest.approx(100 * (60 - 30) / 300)
    assert d.stderr_points < d.unpaired_stderr_points
    assert d.margin_drop == pytest.approx(2 * 30 / 300)
    lo, hi = d.interval()
    assert lo < d.points < hi


def sequential(
    ref: np.ndarray, mine: np.ndarray, rng: np.random.Generator, bound: float, batch: int, cap: int
) -> tuple[np.ndarray, np.ndarray]:
    """Verdicts and items used by the sequential rule, one row per repetition."""
    idx = rng.integers(0, POOL, (REPS, cap))
    b, c = counts(ref, mine, idx)
    looks = np.arange(batch, cap + 1, batch)
    verdict = np.full(REPS, paired.UNDECIDED, dtype=object)
    used = np.full(REPS, cap)
    open_ = np.ones(REPS, bool)
    for n in looks:
        mean, se = paired.mcnemar(b[:, n - 1], c[:, n - 1], n)
        v = paired.decide(100 * mean, 100 * se, bound, final=n == looks[-1])
        stop = open_ & (v != paired.UNDECIDED)
        verdict[stop], used[stop] = v[stop], n
        open_ &= ~stop
    return verdict, used


def fixed_errors(
    ref: np.ndarray, mine: np.ndarray, rng: np.random.Generator, bound: float, right: str, sizes: np.ndarray
) -> np.ndarray:
    """Error rate (not the right verdict) of a fixed sample of each size, judged once by its 95% interval."""
    b, c = counts(ref, mine, rng.integers(0, POOL, (REPS, int(sizes[-1]))))
    mean, se = paired.mcnemar(b[:, sizes - 1], c[:, sizes - 1], sizes)
    return (paired.decide(100 * mean, 100 * se, bound, final=True) != right).mean(axis=0)


@pytest.mark.parametrize("drop_points, right", [(0.0, paired.WITHIN), (7.0, paired.OVER)])
def test_sequential_sampling_decides_with_fewer_items_than_a_fixed_sample_of_the_same_error_rate(drop_points, right):
    rng = np.random.default_rng(7)
    bound, batch, cap = 3.0, 57, 57 * 20
    ref, mine = population(rng, ref_acc=0.45, discordant=0.18, drop_points=drop_points)
    verdict, used = sequential(ref, mine, rng, bound, batch, cap)
    seq_error = float((verdict != right).mean())  # wrong, or undecided at the cap
    assert float((verdict == ({paired.WITHIN, paired.OVER} - {right}).pop()).mean()) <= 0.01
    # The smallest fixed sample (in whole batches) whose error is no larger.
    sizes = np.arange(batch, 3 * cap + 1, batch)
    reached = np.flatnonzero(fixed_errors(ref, mine, rng, bound, right, sizes) <= seq_error)
    assert reached.size, "no fixed sample reached the sequential rule's error rate"
    n = int(sizes[reached[0]])
    assert used.mean() < n, (used.mean(), n, seq_error)


def test_sequential_wrong_verdicts_stay_at_the_one_sided_5_percent_level_on_the_bound():
    # The hardest case: the true drop equals the bound; "within" is then a wrong verdict.
    rng = np.random.default_rng(11)
    ref, mine = population(rng, ref_acc=0.45, discordant=0.18, drop_points=3.0)
    verdict, _ = sequential(ref, mine, rng, 3.0, 57, 57 * 20)
    assert float((verdict == paired.WITHIN).mean()) <= 0.04


def test_items_needed_follows_the_disagreement_rate_and_the_bound():
    one_point = paired.items_needed(0.9, 1.0)
    assert one_point == pytest.approx(((1.96 + 0.8416) / 0.01) ** 2 * 0.1, rel=0.01)
    assert paired.items_needed(0.9, 2.0) == pytest.approx(one_point / 4, rel=0.01)
    assert paired.items_needed(0.8, 1.0) == pytest.approx(one_point * 2, rel=0.01)


def test_kld_relation_is_fitted_through_the_origin_with_its_uncertainty():
    assert paired.fit_kld_relation([0.1, 0.2], [1.0, 2.0]) is None  # too few artifacts
    rel = paired.fit_kld_relation([0.05, 0.1, 0.4, 0.8], [0.6, 0.9, 4.2, 7.9])
    assert rel is not None and rel.slope == pytest.approx(10.0, rel=0.05)
    low, high = rel.expected_drop(0.1), rel.expected_drop(1.0)
    assert low[0] < high[0] and low[1] < high[1]  # farther from the data: less certain
    # Drops that happen to lie on a line claim no more certainty than their own errors.
    flat = paired.fit_kld_relation([0.004, 0.26, 0.40], [0.0, 0.0, 0.0], [1.8, 3.1, 3.1])
    assert (
        flat is not None and flat.slope == 0.0 and flat.residual_sd == pytest.approx(((1.8**2 + 2 * 3.1**2) / 3) ** 0.5)
    )
