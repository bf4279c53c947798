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
    from autotune.models import ModelSpec


@dataclass(frozen=True)
class MetricValue:
    """One metric result.

    Args:
        value: The figure (accuracy in [0, 1] for benchmarks).
        stderr: Its standard error, when it is a sample estimate.
        n: How many items it was computed on.
        seconds: Wall time it took.
        details: Anything else worth recording (per-subject scores...).
        per_item: Item by item, for metrics that answer items (see ``BaseMetric.item_order``):
            ``{"item": [ids], "correct": [1.0 or 0.0], "margin": [nats]}``, where margin is the
            log-probability of the right answer minus the best wrong one's. Drops between two
            artifacts are computed on the items both answered (``autotune.study.paired``).
    """

    value: float
    stderr: float | None = None
    n: int | None = None
    seconds: float | None = None
    details: dict[str, Any] | None = None
    per_item: dict[str, list[Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {
            "value": self.value,
            "stderr": self.stderr,
            "n": self.n,
            "seconds": self.seconds,
            "details": self.details or {},
        }
        if self.per_item is not None:
            out["per_item"] = self.per_item
        return out


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

    def covers(self, model: "ModelSpec") -> str | None:
        """Why this metric's figures mean nothing for ``model`` (None: they do); a predicting
        metric says where its evidence ends, and the study is refused before the search rather
        than scored by numbers outside it. Measuring metrics cover every model (the default)."""
        return None

    def item_order(self) -> tuple[tuple[int, ...], int] | None:
        """The items a paired measurement may draw, in the order it draws them, and the batch
        that keeps its strata balanced (one item per subject); None (the default): the metric
        answers one figure, not items, and its drop is the difference of two figures.

        A metric that returns an order implements ``evaluate_items``; the study then measures
        both artifacts on the same items, batch by batch, until the paired drop is decided
        against the study's bound (``autotune.study.quality``).
        """
        return None

    def evaluate_items(self, config: "TrialConfig", backend: "BaseBackend", ctx: "StudyContext",
                       items: "tuple[int, ...] | list[int]") -> MetricValue:
        """Measure the artifact of ``config`` on ``items`` only (ids from ``item_order``);
        the result carries ``per_item``."""
        raise NotImplementedError(f"metric '{self.name}' answers no items")

    @abc.abstractmethod
    def evaluate(self, config: "TrialConfig", backend: "BaseBackend", ctx: "StudyContext") -> MetricValue:
        """Measure the artifact of ``config`` as ``backend`` loads it."""
