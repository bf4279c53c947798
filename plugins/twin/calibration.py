"""Online calibration: the twin's speed constants refit to one study's own measurements.

The published constants (``constants.toml``) are fitted across cards and articles; on one card
with one build of the engine, a real study measures what they only predict. ``fit`` moves the
speed constants of one engine (``CALIBRATED_FIELDS``) to agree with those measurements, and no
further than the measurements demand:

- each constant is a factor on its published value, fitted in log space (a constant is a rate
  or a time: being 2x off is as wrong as 0.5x), so it stays positive;
- the data residuals are ``log(predicted / measured)`` of every measured speed metric, made
  robust (soft L1: a residual beyond ``ROBUST_SCALE`` counts linearly, so one disturbed trial
  cannot drag the constants far);
- a Gaussian prior ``log(factor) / prior_sigma`` per constant keeps them at the published fit
  when there are few measurements (with one or two trials, five constants are not determined
  by the data, and the prior decides what is not);
- a constant published at 0 (a term the fit found absent) has no value to scale: it is fitted
  as an absolute value >= 0 in units of ``ZERO_SCALES`` (the size one prior sigma allows), so
  that the prior holds it at 0 and the data may switch the term on. A constant at 0 that has
  no scale there is left as published.

The robust loss is applied to the data residuals only (as ``least_squares(loss="soft_l1")``
would, by hand), so that the prior stays Gaussian: a robust prior would give way entirely to a
systematic error shared by every trial.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import fields, replace
from typing import Any, Mapping, Sequence

import numpy as np

from autotune_plugins.twin import physics

#: The speed constants a study refits (memory constants are corrected by the core's own
#: learned residual). Names of ``physics.EngineConstants`` fields; one the physics lacks is skipped.
CALIBRATED_FIELDS = (
    "weight_bw_efficiency",
    "layer_us_ghz",
    "sample_ns_per_vocab",
    "decode_compute_efficiency",
    "prefill_efficiency",
)
#: How far, in log, one prior sigma lets a constant move from its published value (0.5: x1.65).
PRIOR_SIGMA = 0.5
#: Where a constant published at 0 starts, in ZERO_SCALES units: inside its bound, because the
#: bounded solver (trf) scales a variable by its distance to the bound and would leave one that
#: starts on it where it is.
ABSOLUTE_START = 0.1
#: The measured metrics compared with the prediction, where a trial has them.
METRICS = ("decode_tok_s", "per_user_tok_s", "aggregate_tok_s", "prefill_tok_s")
#: log(predicted / measured) beyond which a residual counts linearly: x1.65, well above the
#: between-run spread of real measurements (3% median, 24% worst on the H200 grids), so that a
#: trial that is wrong (a card shared with another job) has bounded influence. Not smaller: when
#: every trial is far off (a card whose published constants are 10x off), the prior would hold
#: against the data, each of whose residuals pulls with a bounded force beyond this scale (on
#: the CPU study: 0.2 left the median error at 129%, 0.5 at 60%).
ROBUST_SCALE = 0.5
#: One prior sigma of a constant published at 0 (for some engine), in its unit. sample_ns_per_vocab:
#: the host samples a 152K vocabulary in ~0.85 ms per stream on the H200 (physics.py), ~5.6 ns each.
ZERO_SCALES: Mapping[str, float] = {"sample_ns_per_vocab": 5.0}


def median_abs_error(
    predicted: Sequence[Mapping[str, float]], observations: Sequence[tuple[Any, Mapping[str, float]]]
) -> float | None:
    """Median of ``|predicted / measured - 1|`` over every measured metric of every observation."""
    errors = [
        abs(p[m] / meas[m] - 1.0)
        for p, (_, meas) in zip(predicted, observations)
        for m in METRICS
        if _usable(meas.get(m)) and m in p
    ]
    return statistics.median(errors) if errors else None


def _usable(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


def fit(
    base: physics.EngineConstants,
    host: physics.HostConstants,
    observations: Sequence[tuple[physics.Scenario, Mapping[str, float]]],
    fields_: Sequence[str] = CALIBRATED_FIELDS,
    prior_sigma: float = PRIOR_SIGMA,
) -> tuple[physics.EngineConstants, dict[str, Any]]:
    """The engine constants refit to ``observations``, and a report of the fit.

    Args:
        base: The published constants (the prior's centre).
        observations: Each configuration as the physics sees it, with its measured metrics.
        fields_: The constants to refit.
        prior_sigma: How far (in log) one prior sigma lets a constant move from ``base``.

    Returns:
        (the fitted constants, ``{"n", "metrics", "before", "after", "median_abs_error_before",
        "median_abs_error_after"}``: constants as published and fitted, errors as fractions).
    """
    names = {f.name for f in fields(physics.EngineConstants)}
    scaled = [f for f in fields_ if f in names and float(getattr(base, f)) > 0]
    absolute = [f for f in fields_ if f in names and float(getattr(base, f)) <= 0 and f in ZERO_SCALES]
    obs = [(s, {m: float(v) for m, v in meas.items() if m in METRICS and _usable(v)}) for s, meas in observations]
    obs = [(s, meas) for s, meas in obs if meas]

    def constants(x: np.ndarray) -> physics.EngineConstants:
        values = {f: float(getattr(base, f)) * math.exp(x[i]) for i, f in enumerate(scaled)}
        values.update({f: ZERO_SCALES[f] * max(0.0, float(x[len(scaled) + j])) for j, f in enumerate(absolute)})
        return replace(base, **values)

    def predictions(k: physics.EngineConstants) -> list[dict[str, float]]:
        return [physics.predict(s, k, host).as_dict() for s, _ in obs]

    def residuals(x: np.ndarray) -> np.ndarray:
        out = []
        for p, (_, meas) in zip(predictions(constants(x)), obs):
            for m, value in meas.items():
                r = math.log(p[m] / value) / ROBUST_SCALE
                out.append(math.copysign(ROBUST_SCALE * math.sqrt(2.0 * (math.sqrt(1.0 + r * r) - 1.0)), r))
        out += [x[i] / prior_sigma for i in range(len(scaled))]
        # A term at 0 moves one ZERO_SCALES per prior sigma at the default prior_sigma.
        out += [x[len(scaled) + j] * PRIOR_SIGMA / prior_sigma for j in range(len(absolute))]
        return np.asarray(out)

    x0 = np.zeros(len(scaled) + len(absolute))
    x0[len(scaled) :] = ABSOLUTE_START
    fitted = base
    if obs and len(x0):
        lower = [-np.inf] * len(scaled) + [0.0] * len(absolute)
        from scipy.optimize import least_squares  # here: half a second of import a twin study never fits with

        result = least_squares(residuals, x0, bounds=(lower, [np.inf] * len(x0)), method="trf")
        fitted = constants(result.x)
    fitted_fields = scaled + absolute
    report = {
        "n": len(obs),
        "metrics": sorted({m for _, meas in obs for m in meas}),
        "before": {f: float(getattr(base, f)) for f in fitted_fields},
        "after": {f: float(getattr(fitted, f)) for f in fitted_fields},
        "median_abs_error_before": median_abs_error(predictions(base), obs),
        "median_abs_error_after": median_abs_error(predictions(fitted), obs),
    }
    return fitted, report
