"""Which model backend speaks for a real backend's configuration, and what it predicts.

A real backend is predicted by itself when it can predict (a twin study), else by a registered
backend of the same engine that implements ``predict`` (the engine's twin), on the configuration
as it stands. The prior ranks with these predictions (``study/prior.py``) and the calibration
refits the same predictor to the measured trials (``study/calibration.py``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Mapping

from autotune.engine.backend import BaseBackend, StudyContext, TrialConfig
from autotune.errors import AutotuneError

__all__ = ["model_context", "predictor_for"]


def model_context(real: BaseBackend, ctx: StudyContext) -> StudyContext:
    """``real``'s context as a model backend of its engine should see it: with what ``real`` says
    of how it runs the engine (``BaseBackend.model_settings``), which the model cannot know from the
    study file (a setting left at a default the real backend resolves on this machine)."""
    told = real.model_settings(ctx)
    return replace(ctx, settings={**ctx.settings, **told}) if told else ctx


def predictor_for(
    real: BaseBackend, config: TrialConfig, ctx: StudyContext, backends: Mapping[str, BaseBackend]
) -> tuple[BaseBackend, Mapping[str, float]] | None:
    """The backend that predicts ``config`` (``real`` itself, else one of its engine) and its
    prediction; None when none can (its option values or its weights are not the predictor's)."""
    others = [b for b in backends.values() if b.engine == real.engine and b is not real]
    for predictor in [real, *others]:
        if predictor.predictor is None:
            continue  # it measures: no say before it runs
        probe = replace(config, backend=predictor.name)
        if predictor is not real and not _takes_options(predictor, probe):
            continue
        try:
            predicted = predictor.predictor.predict(probe, ctx if predictor is real else model_context(real, ctx))
        except AutotuneError:
            # Weights it cannot read (a quantization it has no model for): no say on this one.
            continue
        if predicted:
            return predictor, predicted
    return None


def _takes_options(predictor: BaseBackend, config: TrialConfig) -> bool:
    """Whether every option of ``config`` that ``predictor`` declares has a value it accepts."""
    for name, value in config.options:
        offered = {p.name: p for p in predictor.parameters({name: (value,)})}
        if name in offered and not offered[name].choices:
            return False
    return True
