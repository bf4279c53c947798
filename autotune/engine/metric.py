"""What a metric is: the base class of quality benchmarks and proxies.

A metric answers for an artifact as a backend loads it (weights plus KV-cache type). Quality
does not depend on ctx or parallel, so the study caches a metric's answer by
``cache_key(config)`` and measures each artifact once per study.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

from autotune import plugins

if TYPE_CHECKING:  # pragma: no cover
    from autotune.engine.backend import BaseBackend, StudyContext, TrialConfig
    from autotune.modelfiles.models import ModelSpec


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


def signed_drop(points: float, unit: str = "points", digits: int = 2) -> str:
    """A drop in words, its direction a word and not a sign: "drop 1.20 points", "gain 0.30
    points" (the artifact scores better than the reference), "no drop" when it rounds to 0."""
    shown = f"{abs(points):.{digits}f}"
    if float(shown) == 0:
        return f"no drop ({shown} {unit})"
    return f"{'drop' if points > 0 else 'gain'} {shown} {unit}"


class BaseMetric(abc.ABC):
    """A quality measurement of one artifact.

    A study keeps every metric's drop against the reference in "points" (``drop_between``:
    100 x the difference of the values, for accuracy percentage points); how a value, a drop
    and a bound are said to people is the metric's (``value_text``, ``drop_text``,
    ``bound_text``, ``compared_text``), so that no reader shows a KL divergence as accuracy
    points.

    Class attributes:
        name: Registry name, unique across plugins.
        unit: What ``value`` is (``accuracy``, a fraction; ``nats``...).
        higher_is_better: Direction of ``value``.
        description: One line for ``autotune plugins``.
    """

    name: ClassVar[str] = ""
    unit: ClassVar[str] = "accuracy"
    higher_is_better: ClassVar[bool] = True
    description: ClassVar[str] = ""

    def value_text(self, value: float) -> str:
        """``value`` with what it is: "mmlu accuracy 61.20%" (an accuracy as a percentage),
        else the figure and the declared unit."""
        if self.unit == "accuracy":
            return f"{self.name} accuracy {value:.2%}"
        return f"{self.name} {value:.4g} {self.unit}"

    #: What ``drop_figure`` is, as an axis or a column is titled.
    drop_label: ClassVar[str] = "quality drop (points)"

    def drop_figure(self, points: float) -> float:
        """A drop as the number a plot or a table shows under ``drop_label``."""
        return points

    def amount_text(self, points: float) -> str:
        """A size of drop with its unit, no direction (a standard error, an interval's half)."""
        return f"{points:.2f} points"

    def drop_text(self, points: float) -> str:
        """A drop against the reference (in the study's points) in words: "drop 1.20 points",
        "gain 0.30 points"."""
        return signed_drop(points)

    def compared_text(self, value: float, points: float, reference: str) -> str:
        """The value and its drop against ``reference`` in one phrase (the best's quality line)."""
        return f"{self.value_text(value)}, {self.drop_text(points)} vs {reference}"

    def bound_text(self, points: float) -> str:
        """A bound on the drop (``[objective] max_drop_points``) in the metric's words."""
        return f"{points:g} point{'' if points == 1 else 's'}"

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

    def evaluate_items(
        self, config: "TrialConfig", backend: "BaseBackend", ctx: "StudyContext", items: "tuple[int, ...] | list[int]"
    ) -> MetricValue:
        """Measure the artifact of ``config`` on ``items`` only (ids from ``item_order``);
        the result carries ``per_item``."""
        raise NotImplementedError(f"metric '{self.name}' answers no items")

    @abc.abstractmethod
    def evaluate(self, config: "TrialConfig", backend: "BaseBackend", ctx: "StudyContext") -> MetricValue:
        """Measure the artifact of ``config`` as ``backend`` loads it."""


class _NotInstalled(BaseMetric):
    """A stored study's metric whose plugin is not installed here: its figures said generically."""

    def __init__(self, name: str):
        self.name = name  # type: ignore[misc]

    def evaluate(self, config: "TrialConfig", backend: "BaseBackend", ctx: "StudyContext") -> MetricValue:
        raise NotImplementedError(f"metric '{self.name}' is not installed")


def metric_named(name: str | None) -> BaseMetric:
    """The installed metric ``name`` (a stored trial's ``quality["metric"]``), to say its
    figures in its own words; one that says them generically when it is not installed."""
    found = plugins.get_metrics().get(str(name))
    return found if found is not None else _NotInstalled(str(name or "quality"))
