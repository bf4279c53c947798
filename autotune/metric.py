"""What a metric is: the base class of quality benchmarks and proxies.

A metric answers for an artifact as a backend loads it (weights plus KV-cache type). Quality
does not depend on ctx or parallel, so the study caches a metric's answer by
``cache_key(config)`` and measures each artifact once per study.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

if TYPE_CHECKING:  # pragma: no cover
    from autotune.backend import BaseBackend, StudyContext, TrialConfig


@dataclass(frozen=True)
class MetricValue:
    """One metric result.

    Args:
        value: The figure (accuracy in [0, 1] for benchmarks).
        stderr: Its standard error, when it is a sample estimate.
        n: How many items it was computed on.
        seconds: Wall time it took.
        details: Anything else worth recording (per-subject scores...).
    """

    value: float
    stderr: float | None = None
    n: int | None = None
    seconds: float | None = None
    details: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "value": self.value,
            "stderr": self.stderr,
            "n": self.n,
            "seconds": self.seconds,
            "details": self.details or {},
        }


@dataclass(frozen=True)
class QualityReference:
    """The artifact a study judges quality against, as one backend loads it.

    Args:
        config: The reference configuration (highest-precision weights, most precise options).
        backend: The backend that loads it.
        ctx: That backend's study context.
    """

    config: "TrialConfig"
    backend: "BaseBackend"
    ctx: "StudyContext"


class BaseMetric(abc.ABC):
    """A quality measurement of one artifact.

    Class attributes:
        name: Registry name, unique across plugins.
        unit: What ``value`` is (``accuracy``, ``kld``...).
        higher_is_better: Direction of ``value``.
        description: One line for ``autotune plugins``.
    """

    name: ClassVar[str] = ""
    unit: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True
    description: ClassVar[str] = ""

    def cache_key(self, config: "TrialConfig", backend: "BaseBackend", ctx: "StudyContext") -> str:
        """What this metric's value depends on; equal keys are measured once per study."""
        return f"{self.name}|{backend.engine}|{config.weights}|{config.option('cache_type')}"

    def configure(self, options: Mapping[str, Any], references: Mapping[str, QualityReference]) -> None:
        """Receive the study's settings before any ``evaluate`` (the runner calls it once).

        Args:
            options: The study file's ``[quality]`` table, validated by ``autotune.config``
                (``per_subject``, ``shots``, ``seed``); absent keys take the metric's defaults.
            references: The reference of each candidate backend, by backend name; a metric
                that compares with the reference itself (a KL divergence) keeps it.
        """

    def supports(self, backend: "BaseBackend") -> str | None:
        """Why this metric cannot evaluate ``backend``'s configurations (None: it can)."""
        return None

    @abc.abstractmethod
    def evaluate(self, config: "TrialConfig", backend: "BaseBackend", ctx: "StudyContext") -> MetricValue:
        """Measure the artifact of ``config`` as ``backend`` loads it."""
