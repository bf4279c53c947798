"""The prior: measure first what a model of the engine (the twin) predicts best.

For each backend of the study, the predictor is the backend itself when it can predict, else
a registered backend of the same engine that implements ``predict`` (the engine's twin),
evaluated for the study's GPU and model on the configuration as it stands: the same weights
(a format, or the file or directory the real backend loads) and options. A predictor speaks
only for configurations whose option values it accepts (the real backend's cache type must be
one of the twin's) and whose weights it can read; the others are left unranked, for the
sampler. Only configurations the study's judge admits are ranked; the predicted
metrics go through the study's own objective (penalty, per-user floor and, where a metric can
predict quality for the predictor, the quality constraint).

What the study measures first is that ranking with one exception (``cheaper_first_among_ties``):
weights that must still be made (an EXL2 conversion takes minutes) go after weights predicted
about as good that cost nothing to load.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping

import optuna

from autotune.study import objective as objective_mod
from autotune import plugins
from autotune.engine.backend import BaseBackend, StudyContext, TrialConfig
from autotune.errors import AutotuneError
from autotune.engine.metric import BaseMetric
from autotune.study.admission import Admission
from autotune.study.calibration import contexts_with_calibration
from autotune.study.predictor import predictor_for
from autotune.study.prepared import PreparedStudy
from autotune.study.quality import drop_between


def rank_by_prior(
    prepared: PreparedStudy, judge: Admission | None = None, study: optuna.Study | None = None
) -> list[tuple[TrialConfig, float]]:
    """Every admitted configuration a predictor can speak for, predicted-feasible first, best first.

    Args:
        judge: The study's judge (with what its storage learned); by default one that knows
            only the rules and the raw memory model.
        study: The study's storage: its predictors predict with what they learned from its
            measured trials (``study/calibration.py``); None: with their published constants.
    """
    judge = judge or Admission(prepared.space, prepared.contexts, prepared.cfg.objective)
    contexts = contexts_with_calibration(prepared, study)
    backends = plugins.get_backends()
    metrics = plugins.get_metrics()
    objective = prepared.cfg.objective
    ranked = []
    for config in prepared.space.enumerate():
        verdict = judge.judge(config)
        if not verdict.admitted or verdict.estimate is None:
            continue
        real = prepared.backend(config.backend)
        ctx = contexts[config.backend]
        found = predictor_for(real, config, ctx, backends)
        if found is None:
            continue
        predictor, predicted = found
        probe = replace(config, backend=predictor.name)
        if objective.metric not in predicted:
            continue
        drop = _predicted_drop(prepared, predictor, probe, prepared.reference.get(config.backend), ctx, metrics)
        s = objective_mod.score(
            objective,
            float(predicted[objective.metric]),
            verdict.estimate.total_bytes,
            ctx.vram_budget_bytes,
            drop,
            predicted.get("per_user_tok_s"),
            latencies=predicted,
        )
        ranked.append((config, s.values[0], s.feasible))
    ranked.sort(key=lambda item: (not item[2], -item[1]))
    return [(c, v) for c, v, _ in ranked]


# Predictions this close are a tie for ordering: the twin's own error on a card it has calibrated
# on is of this order, and a pick within 3% of the best is what the search counts as found.
PRIOR_TIE = 0.03


def cheaper_first_among_ties(
    ranked: list[tuple[TrialConfig, float]], making_s: Callable[[TrialConfig], float], tie: float = PRIOR_TIE
) -> list[tuple[TrialConfig, float]]:
    """``ranked`` (best first) in the order to measure it: configurations predicted within ``tie``
    of the best still unplaced form a band, and inside a band the one whose weights take the
    fewest seconds to make (``making_s``: 0 when made, ``inf`` when unknown) goes first.

    Only positive predictions band together (a relative tie means nothing around zero); the
    rest keep their rank.
    """
    out: list[tuple[TrialConfig, float]] = []
    i = 0
    while i < len(ranked):
        top = ranked[i][1]
        j = i + 1
        if top > 0:
            while j < len(ranked) and ranked[j][1] >= top * (1 - tie):
                j += 1
        band = ranked[i:j]
        out += sorted(band, key=lambda item: making_s(item[0]))  # stable: rank order among equals
        i = j
    return out


def _predicted_drop(
    prepared: PreparedStudy,
    predictor: BaseBackend,
    config: TrialConfig,
    ref: TrialConfig | None,
    ctx: StudyContext,
    metrics: Mapping[str, BaseMetric],
) -> float | None:
    """Quality drop a metric that can evaluate the predictor expects, against the reference."""
    if ref is None:
        return None
    candidates = [prepared.quality] if prepared.quality is not None else []
    candidates += [m for m in metrics.values() if m not in candidates]
    ref_probe = replace(ref, backend=predictor.name)
    for metric in candidates:
        if metric.supports(predictor) is not None:
            continue
        try:
            mine = metric.evaluate(config, predictor, ctx).to_dict()
            theirs = metric.evaluate(ref_probe, predictor, ctx).to_dict()
        except AutotuneError:
            continue
        return drop_between(metric, mine, theirs).points
    return None
