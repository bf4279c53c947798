"""The statistics of a quality drop measured on paired items: its interval, the sequential
verdict against the study's bound, the items a bound needs, and KLD as a calibrated proxy.

Both artifacts answer the same items, so the drop is the mean of per-item differences and its
standard error is that of a paired difference (McNemar's setting): only the items on which the
two artifacts disagree carry variance. Two accuracies with their standard errors added in
quadrature ignore that pairing and overstate the error several times over for artifacts that
agree on most items (``PairedDrop.unpaired_stderr_points`` keeps that figure for comparison).

Every function here takes plain numbers or numpy arrays of them, so a simulation of a thousand
studies (``tests/test_paired.py``) runs through the same code as a study does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

__all__ = [
    "OVER",
    "UNDECIDED",
    "WITHIN",
    "Z_FINAL",
    "Z_INTERIM",
    "KldRelation",
    "PairedDrop",
    "decide",
    "fit_kld_relation",
    "items_needed",
    "mcnemar",
    "paired_drop",
]

WITHIN, OVER, UNDECIDED = "within", "over", "undecided"
# The reported interval is always the 95% one. A sequential measurement looks at the data after
# every batch; stopping early only when the interim interval is far wider (|z| > 3, the
# Haybittle-Peto rule: Haybittle 1971, Br J Radiol 44:793; Peto et al. 1976, Br J Cancer
# 34:585) keeps the overall error rate at that of the final 95% look, whatever the number of
# looks, without a table of boundaries.
Z_FINAL = 1.959963984540054
Z_INTERIM = 3.0
# Power for ``items_needed``: the chance that a candidate whose true drop is 0 is found within.
POWER = 0.8


def mcnemar(b: Any, c: Any, n: Any) -> tuple[Any, Any]:
    """Mean paired drop and its standard error, as fractions, from discordant counts.

    Args:
        b: Items the reference answered right and the artifact wrong.
        c: Items the artifact answered right and the reference wrong.
        n: Items both answered.

    Returns:
        ``(b - c) / n`` and the standard error of that mean of per-item differences in
        {-1, 0, 1}. 0.5 is added to each discordant count in the variance (Agresti & Min 2005,
        Biometrics 61:515), so that a first batch on which the two happen to agree everywhere
        does not give a zero-width interval and a premature verdict.
    """
    b, c, n = np.asarray(b, float), np.asarray(c, float), np.asarray(n, float)
    mean = (b - c) / n
    bb, cc = b + 0.5, c + 0.5
    var = np.maximum((bb + cc) - (bb - cc) ** 2 / n, 0.0) / (n * np.maximum(n - 1, 1))
    return mean, np.sqrt(var)


@dataclass(frozen=True)
class PairedDrop:
    """Points an artifact loses against the reference on the items both answered.

    Args:
        points: Mean per-item drop x 100 (reference right minus artifact right; negative: the
            artifact scores better).
        stderr_points: Its paired (McNemar-style) standard error.
        unpaired_stderr_points: What two accuracies' standard errors in quadrature would say.
        n: Items both answered.
        discordant: Items on which exactly one of the two was right.
        margin_drop: Mean drop of the log-probability margin of the right answer (nats): a
            continuous companion with less variance than right/wrong.
        margin_stderr: Its standard error.
    """

    points: float
    stderr_points: float
    unpaired_stderr_points: float
    n: int
    discordant: int
    margin_drop: float | None = None
    margin_stderr: float | None = None

    def interval(self, z: float = Z_FINAL) -> tuple[float, float]:
        return self.points - z * self.stderr_points, self.points + z * self.stderr_points


def paired_drop(
    mine_correct: Sequence[float],
    ref_correct: Sequence[float],
    mine_margin: Sequence[float] | None = None,
    ref_margin: Sequence[float] | None = None,
) -> PairedDrop:
    """The paired drop of one artifact against the reference, item by item (same order)."""
    mine, ref = np.asarray(mine_correct, float), np.asarray(ref_correct, float)
    n = int(mine.size)
    if n < 2:
        raise ValueError("a paired drop needs at least 2 items both artifacts answered")
    b = int(((ref == 1) & (mine == 0)).sum())
    c = int(((ref == 0) & (mine == 1)).sum())
    mean, se = mcnemar(b, c, n)
    unpaired = math.sqrt(sum(p * (1 - p) / (n - 1) for p in (mine.mean(), ref.mean())))
    margin = margin_se = None
    if mine_margin is not None and ref_margin is not None:
        d = np.asarray(ref_margin, float) - np.asarray(mine_margin, float)
        margin, margin_se = float(d.mean()), float(d.std(ddof=1) / math.sqrt(n))
    return PairedDrop(float(mean) * 100.0, float(se) * 100.0, unpaired * 100.0, n, b + c, margin, margin_se)


def decide(points: Any, stderr_points: Any, bound_points: float, final: Any) -> Any:
    """Within, over or undecided against ``bound_points``, for scalars or arrays.

    Within: the whole interval lies below the bound; over: the whole interval lies above it.
    ``final`` (the last look: the cap is reached) uses the 95% interval, an interim look the
    Haybittle-Peto one (``Z_INTERIM``).
    """
    z = np.where(final, Z_FINAL, Z_INTERIM)
    points, se = np.asarray(points, float), np.asarray(stderr_points, float)
    out = np.where(points + z * se < bound_points, WITHIN, np.where(points - z * se > bound_points, OVER, UNDECIDED))
    return str(out) if out.ndim == 0 else out


def items_needed(agreement: float, bound_points: float, power: float = POWER) -> int:
    """Items that find a candidate with no true drop within ``bound_points``, ``power`` of the
    time, when it agrees with the reference on a fraction ``agreement`` of the items.

    A paired difference is non-zero on the disagreeing items only, so its variance is about
    ``1 - agreement`` per item when the true drop is 0; the 95% interval's upper end must fall
    below the bound: n = ((z_0.975 + z_power) / bound)^2 x (1 - agreement).
    """
    if not 0 < bound_points:
        raise ValueError("the bound must be > 0 points")
    from scipy import stats  # here: scipy.stats is half a second of import the twin's study never needs

    z = Z_FINAL + float(stats.norm.ppf(power))
    return int(math.ceil((z / (bound_points / 100.0)) ** 2 * max(1.0 - agreement, 1e-6)))


@dataclass(frozen=True)
class KldRelation:
    """Expected accuracy drop (points) per nat of mean KL divergence, fitted on a study's own
    artifacts: ordinary least squares through the origin (the reference itself has KLD 0 and no
    drop), with the residual spread of the fit as the uncertainty of one new artifact.

    Args:
        slope: Points of drop per nat.
        slope_stderr: Its standard error.
        residual_sd: Spread of the measured drops around the line (points).
        n: Artifacts it was fitted on.
    """

    slope: float
    slope_stderr: float
    residual_sd: float
    n: int

    def expected_drop(self, kld: float) -> tuple[float, float]:
        """Expected drop and its standard error (points) at a mean KLD of ``kld`` nats."""
        return self.slope * kld, math.sqrt(self.residual_sd**2 + (kld * self.slope_stderr) ** 2)

    @property
    def t(self) -> float:
        """The two-sided 95% quantile for its n - 1 degrees of freedom (few points: wide)."""
        from scipy import stats  # as in items_needed

        return float(stats.t.ppf(0.975, self.n - 1))

    def to_dict(self) -> dict[str, Any]:
        return {
            "slope_points_per_nat": self.slope,
            "slope_stderr": self.slope_stderr,
            "residual_sd_points": self.residual_sd,
            "n": self.n,
            "fit": "least squares through the origin",
        }


MIN_RELATION_POINTS = 3


def fit_kld_relation(
    klds: Sequence[float], drops_points: Sequence[float], stderrs_points: Sequence[float] | None = None
) -> KldRelation | None:
    """The relation, or None with fewer than ``MIN_RELATION_POINTS`` artifacts or no spread in KLD.

    The spread around the line is never taken below the drops' own standard errors (their root
    mean square): drops measured on few items may all happen to sit on a line, and the line
    would then claim a certainty its points never had.
    """
    x, y = np.asarray(klds, float), np.asarray(drops_points, float)
    if x.size < MIN_RELATION_POINTS or float((x * x).sum()) <= 0:
        return None
    sxx = float((x * x).sum())
    slope = float((x * y).sum()) / sxx
    residual_var = float(((y - slope * x) ** 2).sum()) / (x.size - 1)
    if stderrs_points is not None:
        residual_var = max(residual_var, float(np.mean(np.asarray(stderrs_points, float) ** 2)))
    residual_sd = math.sqrt(residual_var)
    return KldRelation(slope, residual_sd / math.sqrt(sxx), residual_sd, int(x.size))
