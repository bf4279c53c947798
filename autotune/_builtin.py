"""For autotune's own plugins (plugins/, importable as autotune_plugins): no stability promise.

What the built-in plugins share with the core beyond ``autotune.api``: the records and parts of
backends that model or split (``DefaultLaunch``, ``Predictor``, ``Splitting``), cache and memory
arithmetic, catalogs (GPUs, links, models), the measurement protocol's finer pieces, an engine
process's environment and the engine-process toolkit (``processes``, the local HTTP server,
an OpenAI-compatible server's streams, GGUF and safetensors readers). A third-party plugin
imports ``autotune.api`` only; these names may change or go without notice.
"""

from __future__ import annotations

from autotune.toolkit import processes
from autotune.engine.acceptance import ACCEPTANCE_ATTR, Acceptance, DraftCount, total as total_acceptance
from autotune.modelfiles.artifacts import Recipe, artifact_path, is_format, run_tool, source_hash
from autotune.engine.backend import DefaultLaunch, UserLoad, same_value
from autotune.engine.cache_types import cache_bytes_per_element, cache_fixed_bytes, kv_bytes_per_token
from autotune.engine.cache_types import resolve as resolve_cache_type
from autotune.hardware.cuda_devices import cuda_visible_entry
from autotune.engine.deploy import control_problem
from autotune.engine.model import engine_model, engine_models, kept
from autotune.errors import ConfigError, EngineUnavailableError, UnknownNameError, UnsupportedError, handle_errors
from autotune.errors import EngineUnavailableError
from autotune.engine.formats import family_of, normalize_format, safetensors_dir_weights, weights_for
from autotune.modelfiles.gguf_file import GgufFile, GgufTensor, read_gguf
from autotune.hardware.gpus import GpuSpec, detect_gpus, get_gpu, has_gpu, load_gpu_catalog
from autotune.hardware.links import Link, get_link, host_link, load_links, slowest_link
from autotune.measure.local_server import free_port, loopback, read_log, server_url, tail, wait_ready
from autotune.measure import SERVING_UNITS, ConcurrentResult, Protocol, post_events, serving_metrics
from autotune.measure.load import latency_metrics, poisson_arrivals, rate_run
from autotune.measure.openai_api import ServerCounters, disagreements, parse_prometheus, stream_completion
from autotune.measure.prompts import PROMPT_TEXT, prompt_of, varied
from autotune.measure.streams import fetch
from autotune.engine.metric import QualityReference
from autotune.modelfiles.models import get_model, load_model_catalog, model_from_gguf, model_from_hf_config
from autotune.engine.parts import Predictor, Scoring, Splitting
from autotune.toolkit.paths import path_problem
from autotune.plugins import get_backend, get_metric
from autotune.hardware.placement import cuda_visible
from autotune.toolkit.redact import engine_environment, mask_argv, remember_secret
from autotune.engine.rules import Rule, load_rules, violations
from autotune.modelfiles.safetensors_dir import SafetensorsDir, read_config_json, read_safetensors_dir
from autotune.engine.scoring import LogLikelihood, Scorer, ScoringError, ScoringUnsupportedError
from autotune.toolkit.shell import command_line
from autotune.engine.space import ConditionalParam
from autotune.engine.strategy import Search
from autotune.toolkit.terminal import echo
from autotune.engine.vram import GraphBuffers, SlotLayout, kv_cache_bytes
from autotune.engine.workload import Workload

__all__ = [
    "ACCEPTANCE_ATTR",
    "Acceptance",
    "DraftCount",
    "total_acceptance",
    "ConditionalParam",
    "DefaultLaunch",
    "UserLoad",
    "Workload",
    "same_value",
    "control_problem",
    "Predictor",
    "Scoring",
    "Splitting",
    "engine_model",
    "engine_models",
    "kept",
    "Rule",
    "load_rules",
    "violations",
    "family_of",
    "normalize_format",
    "safetensors_dir_weights",
    "weights_for",
    "Recipe",
    "artifact_path",
    "is_format",
    "run_tool",
    "source_hash",
    "get_model",
    "load_model_catalog",
    "model_from_gguf",
    "model_from_hf_config",
    "GpuSpec",
    "detect_gpus",
    "get_gpu",
    "has_gpu",
    "load_gpu_catalog",
    "Link",
    "get_link",
    "host_link",
    "load_links",
    "slowest_link",
    "GraphBuffers",
    "SlotLayout",
    "cache_bytes_per_element",
    "cache_fixed_bytes",
    "kv_bytes_per_token",
    "kv_cache_bytes",
    "resolve_cache_type",
    "SERVING_UNITS",
    "ConcurrentResult",
    "Protocol",
    "post_events",
    "serving_metrics",
    "latency_metrics",
    "poisson_arrivals",
    "rate_run",
    "PROMPT_TEXT",
    "prompt_of",
    "varied",
    "fetch",
    "cuda_visible_entry",
    "engine_environment",
    "path_problem",
    "mask_argv",
    "remember_secret",
    "command_line",
    "echo",
    "cuda_visible",
    "QualityReference",
    "LogLikelihood",
    "Scorer",
    "ScoringError",
    "ScoringUnsupportedError",
    "Search",
    "ConfigError",
    "EngineUnavailableError",
    "UnknownNameError",
    "UnsupportedError",
    "handle_errors",
    "get_backend",
    "get_metric",
    "processes",
    "GgufFile",
    "GgufTensor",
    "read_gguf",
    "free_port",
    "loopback",
    "read_log",
    "server_url",
    "tail",
    "wait_ready",
    "ServerCounters",
    "disagreements",
    "parse_prometheus",
    "stream_completion",
    "SafetensorsDir",
    "read_config_json",
    "read_safetensors_dir",
    "EngineUnavailableError",
]
