"""Online calibration: what a study's model backends learn from its measured trials.

A real backend's speed is predicted by a model backend of its engine (the prior's predictor,
``predictor.predictor_for``). After each measured trial the model backend refits its constants to
every measured trial of that real backend (``BaseBackend.calibrate``); the result is stored in
the study (``records.write_calibration``), so that everything that predicts afterwards, in this
process or another, predicts with it: the prior's ranking (``contexts_with_calibration``),
``autotune estimate --study`` and the report. Like the learned memory correction, it is a
function of the stored trials alone: a resumed study refits from the same trials.

A backend that predicts itself (a twin study) learns nothing here: its measurements are its
own predictions.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping

import optuna

from autotune import plugins
from autotune.engine.backend import BaseBackend, StudyContext, TrialConfig
from autotune.study import records
from autotune.study.prepared import PreparedStudy
from autotune.study.predictor import model_context, predictor_for

#: The measured metrics a model backend is calibrated on (``BaseBackend.calibrate``).
SPEED_METRICS = ("decode_tok_s", "aggregate_tok_s", "per_user_tok_s", "prefill_tok_s")


def _can_calibrate(backend: BaseBackend) -> bool:
    return backend.predictor is not None and backend.predictor.learns


def learning_backends(prepared: PreparedStudy) -> list[str]:
    """The study's real backends that a model backend of their engine can learn from."""
    others = [b for b in plugins.get_backends().values() if _can_calibrate(b)]
    out = []
    for name in prepared.space.entries:
        real = prepared.backend(name)
        if real.predictor is None and any(b.engine == real.engine and b is not real for b in others):
            out.append(name)
    return out


def calibrate(prepared: PreparedStudy, study: optuna.Study) -> dict[str, dict[str, Any]]:
    """Refit each model backend to its real backend's measured trials and store the results.

    For each real backend, the predictor is the one the prior would use for most of its measured
    trials; it gets those it speaks for. A model backend that fails is stored as
    ``{"predictor", "error"}`` (the report shows it) and the study goes on with the published
    constants: the calibration refines the prior, it is not needed to measure.

    Returns:
        What was stored, by real backend name.
    """
    learning = learning_backends(prepared)
    if not learning:
        return {}
    backends = plugins.get_backends()
    measured = records.measured(study)
    out: dict[str, dict[str, Any]] = {}
    for name in learning:
        real = prepared.backend(name)
        ctx = prepared.contexts[name]
        groups: dict[str, tuple[BaseBackend, list[tuple[TrialConfig, dict[str, float]]]]] = {}
        for r in measured:
            config = r.trial_config
            if config is None or config.backend != name or (r.gpu and r.gpu.get("key") != ctx.gpu.key):
                continue  # another backend's, or measured on another card before a resume
            metrics = {m: float(v) for m in SPEED_METRICS if (v := r.median(m)) is not None}
            if metrics and r.acceptance and r.acceptance.get("drafted"):
                # The engine's own draft counts: a predictor that prices speculation learns the
                # study's acceptance from them, which depends on the text, not the card.
                metrics.update(
                    acceptance_drafted=float(r.acceptance["drafted"]),
                    acceptance_accepted=float(r.acceptance["accepted"]),
                )
            found = predictor_for(real, config, ctx, backends)
            if not metrics or found is None or found[0] is real:
                continue
            predictor = found[0]
            groups.setdefault(predictor.name, (predictor, []))[1].append(
                (replace(config, backend=predictor.name), metrics)
            )
        if not groups:
            continue
        predictor, observations = max(groups.values(), key=lambda group: len(group[1]))
        try:
            result = predictor.predictor.calibrate(observations, model_context(real, ctx))
        except Exception as exc:  # a model backend's bug must not stop the measurements
            stored: dict[str, Any] = {"predictor": predictor.name, "error": f"{type(exc).__name__}: {exc}"}
        else:
            if result is None:
                continue
            stored = {"predictor": predictor.name, **result}
        records.write_calibration(study, name, stored)
        out[name] = stored
    return out


def contexts_with_calibration(prepared: PreparedStudy, study: optuna.Study | None) -> dict[str, StudyContext]:
    """The study's contexts, each carrying its backend's stored calibration (as ``prepared.contexts``
    where there is none)."""
    contexts = dict(prepared.contexts)
    for name, stored in (records.stored_calibrations(study) if study is not None else {}).items():
        if name in contexts and "error" not in stored:
            contexts[name] = replace(contexts[name], calibration=stored)
    return contexts


def calibration_for(study: optuna.Study, predictor: str, gpu: str) -> Mapping[str, Any] | None:
    """The stored calibration of ``predictor`` on card ``gpu`` (the one fitted on the most trials)."""
    found = [
        c
        for c in records.stored_calibrations(study).values()
        if c.get("predictor") == predictor and c.get("gpu") == gpu and "error" not in c
    ]
    return max(found, key=lambda c: c.get("n", 0)) if found else None
