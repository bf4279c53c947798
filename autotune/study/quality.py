"""Quality in a study: each artifact measured once, and the drop against the reference.

A metric's value depends on the artifact (weights and the options that change numerics, as the
metric's ``cache_key`` says), never on ctx or parallel, so it is measured once per study and
kept in the study's attributes under a hash of that key; a resumed study, and every other
worker on a shared storage, reuses it. The drop formula lives here and nowhere else.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import optuna

from autotune.backend import BaseBackend, StudyContext, TrialConfig
from autotune.metric import BaseMetric
from autotune.study.records import QUALITY_PREFIX

if TYPE_CHECKING:  # pragma: no cover
    from autotune.study.prepare import PreparedStudy


@dataclass(frozen=True)
class Drop:
    """Accuracy points an artifact loses against the reference (negative: it scores better)."""

    points: float
    stderr_points: float | None


def drop_between(metric: BaseMetric, mine: Mapping[str, Any], ref: Mapping[str, Any]) -> Drop:
    """The drop of one measured value against the reference's, in points (x100)."""
    sign = 1.0 if metric.higher_is_better else -1.0
    points = sign * (ref["value"] - mine["value"]) * 100.0
    se = None
    if mine.get("stderr") is not None and ref.get("stderr") is not None:
        # Two independent sample estimates: their difference's standard error adds in
        # quadrature (an overestimate when both used the same items, which is the safe side).
        se = 100.0 * (mine["stderr"] ** 2 + ref["stderr"] ** 2) ** 0.5
    return Drop(points, se)


class QualityBook:
    """The study's quality values: looked up, measured once, turned into drops.

    Args:
        prepared: The study (its metric, references, backends and contexts).
        study: The Optuna study whose attributes keep the measured values (None: nothing is
            stored, e.g. before a storage is open).
    """

    def __init__(self, prepared: "PreparedStudy", study: optuna.Study | None):
        self.prepared = prepared
        self.study = study
        self.metric = prepared.quality
        self._local: dict[str, dict[str, Any]] = {}

    def _where(self, config: TrialConfig) -> tuple[BaseBackend, StudyContext]:
        return self.prepared.backend(config.backend), self.prepared.contexts[config.backend]

    def attr(self, config: TrialConfig) -> str:
        assert self.metric is not None
        key = self.metric.cache_key(config, *self._where(config))
        return QUALITY_PREFIX + hashlib.sha1(key.encode()).hexdigest()[:16]

    def cached(self, config: TrialConfig) -> dict[str, Any] | None:
        attr = self.attr(config)
        if attr not in self._local and self.study is not None and attr in self.study.user_attrs:
            self._local[attr] = self.study.user_attrs[attr]
        return self._local.get(attr)

    def measure(self, config: TrialConfig) -> dict[str, Any]:
        """The metric's value for ``config``'s artifact, measured now unless already known."""
        assert self.metric is not None
        found = self.cached(config)
        if found is not None:
            return found
        backend, ctx = self._where(config)
        value = self.metric.evaluate(config, backend, ctx)
        stored = {"key": self.metric.cache_key(config, backend, ctx), **value.to_dict()}
        if self.study is not None:
            self.study.set_user_attr(self.attr(config), stored)
        self._local[self.attr(config)] = stored
        return stored

    def reference(self, config: TrialConfig) -> TrialConfig | None:
        return self.prepared.reference.get(config.backend)

    def cached_drop(self, config: TrialConfig) -> Drop | None:
        """The drop when both values are already known (nothing is measured)."""
        ref = self.reference(config)
        if self.metric is None or ref is None:
            return None
        mine, theirs = self.cached(config), self.cached(ref)
        if mine is None or theirs is None:
            return None
        return drop_between(self.metric, mine, theirs)

    def trial_quality(self, config: TrialConfig) -> dict[str, Any]:
        """Measure ``config`` and its reference (each once) and describe the drop for the trial
        record; ``skipped`` with the reason when the metric cannot evaluate this backend."""
        assert self.metric is not None
        why = self.metric.supports(self.prepared.backend(config.backend))
        if why:
            return {"metric": self.metric.name, "skipped": why}
        ref = self.reference(config)
        assert ref is not None
        mine, theirs = self.measure(config), self.measure(ref)
        drop = drop_between(self.metric, mine, theirs)
        return {
            "metric": self.metric.name,
            "value": mine["value"],
            "stderr": mine.get("stderr"),
            "n": mine.get("n"),
            "reference_weights": ref.weights,
            "reference_value": theirs["value"],
            "drop_points": drop.points,
            "drop_stderr_points": drop.stderr_points,
        }
