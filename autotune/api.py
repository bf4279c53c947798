"""What a plugin author needs, in one place: import from here, and from nothing else of autotune.

A backend (``BaseBackend``, the records it takes and returns, ``deploy_line`` for its deploy
command), its optional parts (``part``, ``ArtifactMaker``), an engine model
(``EngineModel``: parameters, rules, memory model, physics constants, and with them a twin), the
weight formats and cache types it declares, the core's measurement loop (``measure_engine`` fed
by ``serving_run``), a metric (``BaseMetric``), a search strategy (``BaseStrategy``), and the errors a plugin raises. The example
plugin (``examples/autotune-example-plugin``) imports nothing else. Everything else of autotune
is internal; autotune's own plugins also use ``autotune._builtin``, which makes no promise.
"""

from __future__ import annotations

from autotune.engine.backend import (
    BaseBackend,
    Measurement,
    MemoryEstimate,
    Param,
    Setting,
    StudyContext,
    TrialConfig,
    deploy_line,
)
from autotune.engine.declarations import CacheType, WeightFormats, WeightsBreakdown
from autotune.engine.model import EngineModel, weight_format
from autotune.errors import AutotuneError, BackendError, MeasurementError
from autotune.engine.formats import bits_per_weight, parse_format
from autotune.hookspecs import hookimpl
from autotune.measure import StreamResult, measure_engine, serving_run
from autotune.engine.metric import BaseMetric, MetricValue
from autotune.engine.strategy import BaseStrategy
from autotune.modelfiles.models import ModelSpec, resolve_model
from autotune.engine.parts import ArtifactMaker, part

__all__ = [
    # hooks
    "hookimpl",
    # a backend, the records it takes and returns, its optional parts
    "BaseBackend",
    "Setting",
    "Param",
    "TrialConfig",
    "StudyContext",
    "MemoryEstimate",
    "Measurement",
    "deploy_line",
    "part",
    "ArtifactMaker",
    # an engine model (and with it the twin), the formats and cache types it declares
    "EngineModel",
    "weight_format",
    "CacheType",
    "WeightFormats",
    "WeightsBreakdown",
    "parse_format",
    "bits_per_weight",
    "ModelSpec",
    "resolve_model",
    # measuring: the core's loop, fed with a backend's streams
    "measure_engine",
    "serving_run",
    "StreamResult",
    # a metric, a search strategy
    "BaseMetric",
    "MetricValue",
    "BaseStrategy",
    # errors
    "AutotuneError",
    "BackendError",
    "MeasurementError",
]
