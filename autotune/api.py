"""The names a plugin author needs, in one place: import from here, not from autotune's modules.

A backend (``BaseBackend`` and the records it takes and returns), an engine model
(``EngineModel``: parameters, rules, memory model, physics constants, and with them a twin), a
metric (``BaseMetric``), a strategy (``BaseStrategy``), the declarations they make (cache types,
weight formats), the errors they raise, and the helpers the built-in plugins share (formats,
cache and memory arithmetic, rules as data, the measurement protocol). What is not listed in
``__all__`` is autotune's own and may change without notice; the example plugin
(``examples/autotune-example-plugin``) imports nothing else.
"""

from __future__ import annotations

from autotune.backend import BaseBackend, DefaultLaunch, Measurement, MemoryEstimate, Param, Setting, StudyContext, \
    TrialConfig, UserLoad, deploy_line, same_value
from autotune.cache_types import cache_bytes_per_element, cache_fixed_bytes, kv_bytes_per_token
from autotune.cache_types import resolve as resolve_cache_type
from autotune.declarations import CacheType, WeightFormats
from autotune.engine_model import EngineModel, engine_model, engine_models, kept, weight_format
from autotune.errors import AutotuneError, BackendError, ConfigError, EngineUnavailableError, MeasurementError, \
    UnknownNameError, UnsupportedError
from autotune.formats import WeightsBreakdown, bits_per_weight, normalize_format, parse_format, weights_for
from autotune.hardware import GpuSpec
from autotune.hookspecs import hookimpl
from autotune.measure import SERVING_UNITS, ConcurrentResult, StreamResult, measure_engine, serving_run
from autotune.metric import BaseMetric, MetricValue
from autotune.models import ModelSpec, resolve_model
from autotune.rules import Rule, load_rules, violations
from autotune.strategy import BaseStrategy, Search
from autotune.vram import SlotLayout, kv_cache_bytes

__all__ = [
    # hooks
    "hookimpl",
    # backends
    "BaseBackend", "DefaultLaunch", "Measurement", "MemoryEstimate", "Param", "Setting", "StudyContext", "TrialConfig",
    "UserLoad", "deploy_line", "same_value",
    # engine models (and with them the twin)
    "EngineModel", "engine_model", "engine_models", "kept", "weight_format", "Rule", "load_rules", "violations",
    # declarations, formats, models, hardware
    "CacheType", "WeightFormats", "WeightsBreakdown", "bits_per_weight", "normalize_format", "parse_format",
    "weights_for", "ModelSpec", "resolve_model", "GpuSpec",
    # cache and memory arithmetic
    "SlotLayout", "cache_bytes_per_element", "cache_fixed_bytes", "kv_bytes_per_token", "kv_cache_bytes",
    "resolve_cache_type",
    # measuring
    "SERVING_UNITS", "ConcurrentResult", "StreamResult", "measure_engine", "serving_run",
    # metrics and strategies
    "BaseMetric", "MetricValue", "BaseStrategy", "Search",
    # errors
    "AutotuneError", "BackendError", "ConfigError", "EngineUnavailableError", "MeasurementError", "UnknownNameError",
    "UnsupportedError",
]
