"""The digital twin: backends that answer like an engine on a given GPU would, with no GPU.

Every engine model an installed plugin registers with a ``twin_name``
(:class:`autotune.engine.model.EngineModel`) gets a twin backend (``backend.py``): the engine
model's space, rules, memory model and deploy line, speed from physics (``physics.py``) with the
engine's own fitted constants (its plugin's ``engine_model.toml``, ``fit.py``), and quality from
published quantization-damage data (``quality.py``). It runs the whole tuner in seconds on a
machine with no GPU, and serves as the prior of real studies: a real backend of the same
``engine`` gets its predictions. A new engine's twin needs only that engine's plugin
(docs/plugins.md).

The twin classes are exported by the Python names their engine models give
(``from autotune_plugins.twin import TwinLlamaCpp``).
"""

from __future__ import annotations

from typing import Any

from autotune.api import BaseBackend, BaseMetric, MetricValue, ModelSpec, StudyContext, TrialConfig, hookimpl
from autotune._builtin import engine_models
from autotune_plugins.twin import quality
from autotune_plugins.twin.backend import TwinBackend, _constants_doc, load_constants, twin_class, twin_classes
from autotune_plugins.twin.strategy import TwinStrategy

__all__ = ["TwinBackend", "TwinMmlu", "load_constants", "twin_class", "twin_classes", "_constants_doc"]


def __getattr__(name: str) -> Any:
    """``TwinLlamaCpp`` and the others: the twin classes of the engine models, by the names they give."""
    classes = twin_classes()
    if name in classes:
        return classes[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class TwinMmlu(BaseMetric):
    """Predicted MMLU accuracy relative to the FP16 model (1.0 = nothing lost)."""

    name = "twin-mmlu"
    unit = "accuracy"
    higher_is_better = True
    description = "predicted MMLU accuracy vs FP16 from published quantization damage (twin backends only)"

    def value_text(self, value: float) -> str:
        return f"predicted MMLU accuracy {value:.2%} of FP16's"

    def supports(self, backend: BaseBackend) -> str | None:
        if not isinstance(backend, TwinBackend):
            return "the twin predicts quality for its own backends only; use a measured metric (mmlu, ceval, kld)"
        return None

    def covers(self, model: ModelSpec) -> str | None:
        return quality.uncovered(model)

    def evaluate(self, config: TrialConfig, backend: BaseBackend, ctx: StudyContext) -> MetricValue:
        _, _, ppk = load_constants()
        weights = backend.as_format(config.weights, ctx) if isinstance(backend, TwinBackend) else config.weights
        drop = quality.drop_points(ctx.model, weights, config.option("cache_type", "f16"), ppk)
        return MetricValue(
            value=1.0 - drop / 100.0, stderr=None, n=None, seconds=0.0, details={"predicted_drop_points_vs_fp16": drop}
        )


@hookimpl
def register_backends(register):
    """A twin of every engine model that names one."""
    for model in engine_models().values():
        if model.twin_name:
            register(twin_class(model)())


@hookimpl
def register_metrics(register):
    register(TwinMmlu())


@hookimpl
def register_strategies(register):
    register(TwinStrategy())
