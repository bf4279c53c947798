"""The real ExLlamaV2 backend: each trial in its own worker process, measured like every backend.

A trial's lifecycle (see :mod:`autotune.backend`):

* weights are EXL2 directories (``config.json`` with ``quantization_config.quant_method =
  "exl2"`` and ``*.safetensors``), relative to the study file's directory;
* ``check`` refuses what ExLlamaV2 refuses (a context beyond the model's, more concurrent
  jobs than the generator's step buffer holds);
* ``estimate_memory`` reads the directory's tensor bytes and follows ExLlamaV2 0.3.2's
  allocations (:mod:`.memory`);
* ``run`` starts ``python -m autotune_plugins.exllamav2.worker`` in its own session, loads
  the model there, and drives :func:`autotune.measure.repeat_until_stable_many` with one
  worker round trip per run (a single stream, then ``parallel`` streams together), with
  :class:`autotune.measure.GpuSampler` watching the worker's pid. The worker is always
  stopped, also on a crash, a hang, ``atexit`` or SIGTERM (:mod:`.worker_process`).

Settings (study file, ``[backends.exllamav2]``):
    python: interpreter that has torch and exllamav2 (default: autotune's own).
    worker_command: the whole worker command line, a list (tests use fake workers).
    paged: "auto" (default: paged attention when flash-attn >= 2.5.7 is installed), true, false.
    unpaged_parallel: how parallel > 1 runs without paged attention: "queue" (default: the
        dynamic generator serves the jobs one after another, as a deployed server would) or
        "batched" (one batched forward pass: offline batch work; see .generator_settings).
    startup_timeout_s: bound on the worker's hello (default 60).
    load_timeout_s: bound on loading the model (default 900: the first load JIT-compiles
        ExLlamaV2's extension, about 4.5 minutes on an H200).
    request_timeout_s: bound on one measurement run (default 600).
    cuda_context_mib: CUDA context and PyTorch/cuBLAS workspace in the estimate (default 1190,
        measured on an H200).
    scoring_ctx: tokens a scorer's cache holds (default 2048, at most the model's context).
    stability_metric: the quantity whose spread decides when to stop (default aggregate_tok_s).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from autotune.backend import BaseBackend, Measurement, MemoryEstimate, Param, StudyContext, TrialConfig
from autotune.errors import AutotuneError, BackendError, ConfigError
from autotune.measure import GpuSampler, repeat_until_stable_many
from autotune.models import ModelSpec, model_from_hf_config

from autotune_plugins.exllamav2 import memory
from autotune_plugins.exllamav2.generator_settings import (
    CACHE_CHOICES, MAX_Q_SIZE, UNPAGED_CHOICES, GeneratorSettings, generator_settings, normalize_cache_type,
    pad_to_page)
from autotune_plugins.exllamav2.worker_process import WorkerProcess, default_worker_command
from autotune.hardware import has_gpu as _has_gpu

__all__ = ["ExLlamaV2Backend", "UNITS", "flash_attn_version"]

UNITS = {
    "decode_tok_s": "tok/s",
    "prefill_tok_s": "tok/s",
    "ttft_ms": "ms",
    "aggregate_tok_s": "tok/s",
    "per_user_tok_s": "tok/s",
}
MIN_PAGED_FLASH_ATTN = (2, 5, 7)  # exllamav2/attn.py: has_flash_attn_with_paged
# exllamav2/generator/dynamic.py: max_batch_size * max_q_size must fit the model's
# max_batch_size (1) * max_input_len (2048).
MAX_PARALLEL = 2048 // MAX_Q_SIZE

_PROBE = "import importlib.metadata as m\ntry: print(m.version('flash_attn'))\nexcept m.PackageNotFoundError: print('')"


@functools.lru_cache(maxsize=8)
def flash_attn_version(python: str) -> tuple[int, ...] | None:
    """flash-attn's version in ``python``'s environment (None: not installed), without importing it."""
    try:
        if python == sys.executable:
            import importlib.metadata as m

            text = m.version("flash_attn")
        else:
            text = subprocess.run([python, "-c", _PROBE], capture_output=True, text=True,
                                  timeout=60, check=True).stdout.strip()
    except Exception:  # noqa: BLE001 - not installed, or no such interpreter: no paged attention
        return None
    parts = tuple(int(p) for p in text.split("+")[0].split(".") if p.isdigit())
    return parts or None


def _config(model_dir: Path) -> dict:
    """The directory's config.json as a dict; {} when it is missing or not a JSON object."""
    try:
        cfg = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _exl2_bits(cfg: dict) -> float | None:
    q = cfg.get("quantization_config")
    if isinstance(q, dict) and q.get("quant_method") == "exl2" and isinstance(q.get("bits"), (int, float)):
        return float(q["bits"])
    return None


def _rope_problem(cfg: dict, config_file: Path) -> str | None:
    """A config.json whose RoPE base ExLlamaV2 0.3.2 would not see.

    transformers 5 writes ``rope_parameters: {rope_theta: ...}`` and no top-level
    ``rope_theta``; ExLlamaV2 0.3.2 reads only the latter (exllamav2/config.py) and silently
    falls back to its architecture default (10000 for Qwen2), so every position past the
    first is rotated wrongly. Seen on the H200: KL divergence ~4.8 nats against transformers.
    """
    params = cfg.get("rope_parameters")
    if "rope_theta" in cfg or not isinstance(params, dict) or "rope_theta" not in params:
        return None
    theta = params["rope_theta"]
    return (f"{config_file}: rope_parameters.rope_theta = {theta} but no top-level rope_theta, "
            f"the only one ExLlamaV2 0.3.2 reads (it would run with its default base and produce wrong "
            f"text): add \"rope_theta\": {theta} to config.json")


class ExLlamaV2Backend(BaseBackend):
    name: ClassVar[str] = "exllamav2"
    engine: ClassVar[str] = "exllamav2"
    weight_families: ClassVar[tuple[str, ...]] = ("exl2",)
    description: ClassVar[str] = "ExLlamaV2's dynamic generator on an EXL2 directory, one worker process per trial"

    # -------------------------------------------------------------- space and rules

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        caches = []
        for value in space.get("cache_type", CACHE_CHOICES):
            try:
                name = normalize_cache_type(value)
            except ConfigError:
                continue  # another engine's cache type (f16, q8_0...)
            if name not in caches:
                caches.append(name)
        return [Param("cache_type", tuple(caches) or ("fp16",), "KV-cache mode: fp16, q8, q6, q4 (TabbyAPI's cache_mode)")]

    def weights_path(self, weights: str, ctx: StudyContext) -> Path:
        return ctx.path(weights)

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        p = self.weights_path(weights, ctx)
        if not p.is_dir():
            return f"{p}: no such directory (weights are EXL2 directories relative to the study file)"
        if not (p / "config.json").is_file():
            return f"{p}: no config.json (an EXL2 directory holds config.json, tokenizer.json and *.safetensors)"
        cfg = _config(p)
        if _exl2_bits(cfg) is None:
            return (f"{p}/config.json: no quantization_config with quant_method 'exl2' and bits "
                    f"(convert with python -m exllamav2.conversion.convert_exl2 ... -cf {p})")
        if not (p / "tokenizer.json").is_file():
            return f"{p}: no tokenizer.json (ExLlamaV2 0.3.2 loads tokenizers from tokenizer.json only)"
        rope = _rope_problem(cfg, p / "config.json")
        if rope:
            return rope
        try:
            model = self._model_of(p)
            memory.exl2_weights(p, model.tie_embeddings)
        except AutotuneError as exc:
            return str(exc)
        return None

    @staticmethod
    def _model_of(path: Path) -> ModelSpec:
        return model_from_hf_config(path)

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        problem = self.check_weights(config.weights, ctx)
        if problem:
            return [problem]
        reasons = []
        model = self._model_of(self.weights_path(config.weights, ctx))
        try:
            normalize_cache_type(config.option("cache_type", "fp16"))
        except ConfigError as exc:
            reasons.append(str(exc))
        if pad_to_page(config.ctx) > model.max_context:
            reasons.append(f"ctx {config.ctx} (padded to {pad_to_page(config.ctx)}, the generator's page) exceeds "
                           f"the model's max_position_embeddings {model.max_context}")
        if config.parallel > MAX_PARALLEL:
            reasons.append(f"parallel {config.parallel}: the dynamic generator takes at most {MAX_PARALLEL} jobs "
                           f"(max_batch_size x max_q_size {MAX_Q_SIZE} <= max_input_len 2048)")
        return reasons

    # -------------------------------------------------------------- settings

    def python(self, ctx: StudyContext) -> str:
        return str(ctx.settings.get("python") or sys.executable)

    def paged(self, ctx: StudyContext) -> bool:
        value = ctx.settings.get("paged", "auto")
        if isinstance(value, bool):
            return value
        if value != "auto":
            raise BackendError(f"[backends.exllamav2] paged = {value!r}: use \"auto\", true or false")
        version = flash_attn_version(self.python(ctx))
        return version is not None and version >= MIN_PAGED_FLASH_ATTN

    def unpaged_parallel(self, ctx: StudyContext) -> str:
        value = ctx.settings.get("unpaged_parallel", "queue")
        if value not in UNPAGED_CHOICES:
            raise BackendError(f"[backends.exllamav2] unpaged_parallel = {value!r}: use "
                               + " or ".join(f'"{c}"' for c in UNPAGED_CHOICES))
        return str(value)

    def generator_settings(self, config: TrialConfig, ctx: StudyContext) -> GeneratorSettings:
        return generator_settings(config.option("cache_type", "fp16"), config.ctx, config.parallel, self.paged(ctx),
                                  self.unpaged_parallel(ctx))

    def _seconds(self, ctx: StudyContext, key: str, default: float) -> float:
        value = ctx.settings.get(key, default)
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            seconds = -1.0
        if not seconds > 0:
            raise BackendError(f"[backends.exllamav2] {key} = {value!r}: must be a number of seconds > 0")
        return seconds

    # -------------------------------------------------------------- memory

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        context_mib = float(ctx.settings.get("cuda_context_mib", memory.DEFAULT_CUDA_CONTEXT_MIB))
        return memory.estimate(self.weights_path(config.weights, ctx), self.generator_settings(config, ctx),
                               ctx.workload.prompt_tokens, int(context_mib * memory.MiB))

    # -------------------------------------------------------------- commands

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        path = self.weights_path(config.weights, ctx)
        s = self.generator_settings(config, ctx)
        args = ["python", "main.py", "--model-dir", str(path.parent), "--model-name", path.name,
                "--backend", "exllamav2", "--max-seq-len", str(s.max_seq_len), "--cache-size",
                str(s.cache_tokens if s.paged else s.max_seq_len), "--cache-mode", s.cache_type.upper(),
                "--max-batch-size", str(s.max_batch_size), "--host", "0.0.0.0", "--port", "5000"]
        line = " ".join(args) + "  # TabbyAPI (config.yml model: keys of the same names)"
        if s.paged:
            return line + f"; cache of {config.parallel} x pad256({config.ctx}) tokens, paged attention"
        if s.mode == "batched":
            return line + (f"; measured as batched forward passes of {config.parallel} rows (offline batch "
                           f"work); without flash-attn >= 2.5.7 this server answers one request at a time")
        return line + ("; without flash-attn >= 2.5.7 requests are served one at a time (as measured); "
                       "install it for concurrent jobs")

    def engine_version(self) -> str:
        try:
            import importlib.metadata as m

            return f"exllamav2 {m.version('exllamav2')}"
        except Exception:  # noqa: BLE001 - not installed here; the worker reports its own
            return "exllamav2 (not installed in autotune's environment)"

    # -------------------------------------------------------------- run

    def worker_command(self, ctx: StudyContext) -> list[str]:
        command = ctx.settings.get("worker_command")
        if command is None:
            return default_worker_command(self.python(ctx))
        if not isinstance(command, (list, tuple)) or not command or not all(isinstance(c, str) for c in command):
            raise BackendError(f"[backends.exllamav2] worker_command = {command!r}: must be a non-empty list of strings")
        return list(command)

    def start_worker(self, ctx: StudyContext, log_dir: Path) -> WorkerProcess:
        env = dict(os.environ)
        env.setdefault("CUDA_VISIBLE_DEVICES", str(ctx.gpu_index))
        # The worker imports autotune_plugins from wherever this process does.
        roots = [str(Path(__file__).resolve().parents[2])]
        env["PYTHONPATH"] = os.pathsep.join(roots + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
        worker = WorkerProcess(self.worker_command(ctx), log_dir / "exllamav2-worker.log", env=env)
        worker.start(self._seconds(ctx, "startup_timeout_s", 60))
        return worker

    def load(self, worker: WorkerProcess, model_dir: Path, cache_type: str, seq_len: int, parallel: int,
             ctx: StudyContext, purpose: str = "measure") -> dict[str, Any]:
        paged = ctx.settings.get("paged", "auto")
        return worker.request("load", self._seconds(ctx, "load_timeout_s", 900), model_dir=str(model_dir),
                              cache_type=normalize_cache_type(cache_type), ctx=seq_len, parallel=parallel,
                              paged=paged, unpaged_parallel=self.unpaged_parallel(ctx), purpose=purpose)

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        has_gpu = _has_gpu()
        request_s = self._seconds(ctx, "request_timeout_s", 600)
        key = str(ctx.settings.get("stability_metric", "aggregate_tok_s"))
        wl = ctx.workload
        with tempfile.TemporaryDirectory(prefix="autotune-exllamav2-") as tmp:
            worker = self.start_worker(ctx, Path(tmp))
            try:
                loaded = self.load(worker, self.weights_path(config.weights, ctx),
                                   config.option("cache_type", "fp16"), config.ctx, config.parallel, ctx)
                last: dict[str, Any] = {}

                def sample() -> Mapping[str, float]:
                    reply = worker.request("sample", request_s, prompt_tokens=wl.prompt_tokens,
                                           output_tokens=wl.output_tokens)
                    last.update(reply)
                    return reply["metrics"]

                telemetry = peak = None
                if has_gpu:
                    with GpuSampler(index=ctx.gpu_index, pid=worker.pid) as gpu:
                        stats = repeat_until_stable_many(sample, ctx.protocol, UNITS, key=key)
                    telemetry = gpu.result()
                    if telemetry.available:
                        peak = telemetry.peak_process_bytes if telemetry.peak_process_bytes is not None \
                            else telemetry.peak_delta_bytes
                else:
                    stats = repeat_until_stable_many(sample, ctx.protocol, UNITS, key=key)
            except BackendError:
                raise
            except Exception as exc:  # measurement errors, a malformed reply: the worker's log says more
                raise worker.failure(f"measurement failed ({type(exc).__name__}: {exc})") from exc
            finally:
                worker.stop()
        attention = loaded.get("attention") or {}
        attrs: dict[str, Any] = {
            "engine_version": f"exllamav2 {loaded.get('engine_version', 'unknown')}",
            "attention_path": attention.get("path", "unknown"),
            "attention": attention,
            "generator": loaded.get("settings", {}),
            "torch_version": loaded.get("torch_version"),
            "cuda_device": loaded.get("cuda_device"),
            "load_s": loaded.get("load_s"),
            "torch_max_allocated_bytes": last.get("max_allocated_bytes"),
            "torch_max_reserved_bytes": last.get("max_reserved_bytes"),
            "command": " ".join(self.worker_command(ctx)),
            "gpu": has_gpu,
            "prompt_tokens": wl.prompt_tokens,
        }
        return Measurement(metrics=stats, peak_vram_bytes=peak, telemetry=telemetry, attrs=attrs)

    # -------------------------------------------------------------- scoring

    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext):
        from autotune_plugins.exllamav2.scorer import ExLlamaV2Scorer

        return ExLlamaV2Scorer.open(self, weights, cache_type or "fp16", ctx)
