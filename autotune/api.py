"""The names a plugin author needs, in one place: import from here, not from autotune's modules.

A backend (``BaseBackend`` and the records it takes and returns), an engine model
(``EngineModel``: parameters, rules, memory model, physics constants, and with them a twin), a
metric (``BaseMetric``), a strategy (``BaseStrategy``), the declarations they make (cache types,
weight formats), the errors they raise, and the helpers the built-in plugins share (formats,
cache and memory arithmetic, rules as data, the measurement protocol, an engine process's
environment). What is not listed in ``__all__`` is autotune's own and may change without
notice; the example plugin (``examples/autotune-example-plugin``) imports nothing else. A
backend that runs an engine process of its own may also use the toolkit modules
``autotune.processes`` (process groups), ``autotune.local_server`` (a local HTTP server),
``autotune.measure.openai_api`` (an OpenAI-compatible server's streams and counters),
``autotune.gguf_file`` and ``autotune.safetensors_dir`` (reading weights files).
"""

from __future__ import annotations

from autotune.artifacts import Recipe, artifact_path, is_format, run_tool, source_hash
from autotune.backend import BaseBackend, DefaultLaunch, Measurement, MemoryEstimate, Param, Setting, StudyContext, \
    TrialConfig, UserLoad, deploy_line, same_value
from autotune.cache_types import cache_bytes_per_element, cache_fixed_bytes, kv_bytes_per_token
from autotune.cache_types import resolve as resolve_cache_type
from autotune.cuda_devices import cuda_visible_entry
from autotune.declarations import CacheType, WeightFormats
from autotune.deploy import control_problem
from autotune.engine_model import EngineModel, engine_model, engine_models, kept, weight_format
from autotune.errors import AutotuneError, BackendError, ConfigError, EngineUnavailableError, MeasurementError, \
    UnknownNameError, UnsupportedError, handle_errors
from autotune.formats import WeightsBreakdown, bits_per_weight, family_of, normalize_format, parse_format, \
    safetensors_dir_weights, weights_for
from autotune.hardware import GpuSpec, detect_gpus, get_gpu, has_gpu, load_gpu_catalog
from autotune.hookspecs import hookimpl
from autotune.measure import SERVING_UNITS, ConcurrentResult, Protocol, StreamResult, measure_engine, post_events, \
    serving_metrics, serving_run
from autotune.measure.load import latency_metrics, poisson_arrivals, rate_run
from autotune.measure.prompts import PROMPT_TEXT, prompt_of, varied
from autotune.measure.streams import fetch
from autotune.parts import ArtifactMaker, Predictor, Scoring, Splitting, part
from autotune.metric import BaseMetric, MetricValue, QualityReference
from autotune.models import ModelSpec, get_model, load_model_catalog, model_from_gguf, model_from_hf_config, \
    resolve_model
from autotune.links import Link, get_link, host_link, load_links, slowest_link
from autotune.paths import path_problem
from autotune.placement import cuda_visible
from autotune.redact import engine_environment, mask_argv, remember_secret
from autotune.acceptance import ACCEPTANCE_ATTR, Acceptance, DraftCount, total as total_acceptance
from autotune.shell import command_line
from autotune.space import ConditionalParam
from autotune.terminal import echo
from autotune.rules import Rule, load_rules, violations
from autotune.scoring import LogLikelihood, Scorer, ScoringError, ScoringUnsupportedError
from autotune.strategy import BaseStrategy, Search
from autotune.vram import GraphBuffers, SlotLayout, kv_cache_bytes
from autotune.workload import Workload

__all__ = [
    "ACCEPTANCE_ATTR", "Acceptance", "DraftCount", "total_acceptance",
    # hooks
    "hookimpl",
    # backends
    "BaseBackend", "ConditionalParam", "DefaultLaunch", "Measurement", "MemoryEstimate", "Param", "Setting", "StudyContext", "TrialConfig",
    "UserLoad", "Workload", "deploy_line", "same_value", "control_problem",
    # a backend's optional parts
    "ArtifactMaker", "Predictor", "Scoring", "Splitting", "part",
    # engine models (and with them the twin)
    "EngineModel", "engine_model", "engine_models", "kept", "weight_format", "Rule", "load_rules", "violations",
    # declarations, formats, artifacts, models, hardware
    "CacheType", "WeightFormats", "WeightsBreakdown", "bits_per_weight", "family_of", "normalize_format",
    "parse_format", "safetensors_dir_weights", "weights_for", "Recipe", "artifact_path", "is_format", "run_tool",
    "source_hash", "ModelSpec", "get_model", "load_model_catalog", "model_from_gguf", "model_from_hf_config",
    "resolve_model", "GpuSpec", "detect_gpus", "get_gpu", "has_gpu", "load_gpu_catalog",
    "Link", "get_link", "host_link", "load_links", "slowest_link",
    # cache and memory arithmetic
    "GraphBuffers", "SlotLayout", "cache_bytes_per_element", "cache_fixed_bytes", "kv_bytes_per_token",
    "kv_cache_bytes", "resolve_cache_type",
    # measuring, and an engine process's environment
    "SERVING_UNITS", "ConcurrentResult", "Protocol", "StreamResult", "measure_engine", "post_events",
    "serving_metrics", "serving_run", "latency_metrics", "poisson_arrivals", "rate_run", "PROMPT_TEXT", "prompt_of",
    "varied", "fetch", "cuda_visible_entry", "engine_environment", "path_problem",
    "mask_argv", "remember_secret", "command_line", "echo", "cuda_visible",
    # quality: metrics and the scorers they read
    "BaseMetric", "MetricValue", "QualityReference", "LogLikelihood", "Scorer", "ScoringError",
    "ScoringUnsupportedError",
    # strategies
    "BaseStrategy", "Search",
    # errors
    "AutotuneError", "BackendError", "ConfigError", "EngineUnavailableError", "MeasurementError", "UnknownNameError",
    "UnsupportedError", "handle_errors",
]
