"""The real ExLlamaV2 backend: each trial in its own worker process, measured like every backend.

A trial's lifecycle (see :mod:`autotune.engine.backend`):

* weights are EXL2 directories (``config.json`` with ``quantization_config.quant_method =
  "exl2"`` and ``*.safetensors``), relative to the study file's directory, or formats
  (``exl2:4.0``) converted from the study's ``[model] source`` when a trial first needs them
  (:mod:`autotune.modelfiles.artifacts`, recipes in :mod:`~autotune_plugins.exllamav2.recipes`);
* ``check`` refuses what ExLlamaV2 refuses (a context beyond the model's, more concurrent
  jobs than the generator's step buffer holds);
* ``estimate_memory`` reads the directory's tensor bytes and follows ExLlamaV2 0.3.2's
  allocations (:mod:`.memory`);
* ``run`` starts ``python -m autotune_plugins.exllamav2.worker`` in its own session, loads
  the model there, and measures with the core's loop, :func:`autotune.measure.measure_engine`, one
  worker round trip per run (a single stream, then ``parallel`` streams together), NVML
  watching the worker's pid. The worker is always stopped, also on a crash, a hang,
  ``atexit`` or SIGTERM (:mod:`.worker_process`). That lifecycle is :class:`.worker_backend.WorkerBackend`'s,
  shared with the exllamav3 backend.

Settings (study file, ``[backends.exllamav2]``) are declared in ``SETTINGS``: the interpreter
that runs the worker, paged attention, how ``parallel > 1`` runs without it, timeouts, the CUDA
context of the memory estimate, the scorer's context and the stability metric.

The deploy line is built from the same :class:`~.generator_settings.GeneratorSettings` the worker
is told to build (it refuses rather than build another), so it serves what was measured.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from autotune.api import ArtifactMaker, part
from autotune._builtin import Scoring
from autotune.api import (
    AutotuneError,
    CacheType,
    MemoryEstimate,
    ModelSpec,
    Param,
    Setting,
    StudyContext,
    TrialConfig,
    WeightFormats,
    deploy_line,
    parse_format,
)
from autotune._builtin import (
    ConfigError,
    DefaultLaunch,
    SERVING_UNITS,
    engine_environment,
    is_format,
    path_problem,
    same_value,
)
from autotune._builtin import processes
from autotune._builtin import read_config_json

from autotune_plugins.exllamav2 import declarations, memory
from autotune_plugins.exllamav2.formats import exl2_quantization
from autotune_plugins.exllamav2.generator_settings import (
    CACHE_CHOICES,
    MAX_Q_SIZE,
    UNPAGED_CHOICES,
    GeneratorSettings,
    generator_settings,
    normalize_cache_type,
    pad_to_page,
)
from autotune_plugins.exllamav2.recipes import convert_args_problem, exl2_recipe
from autotune_plugins.shared.common_settings import STABILITY_METRIC, at_least_one, not_negative, positive
from autotune_plugins.shared.worker_backend import WorkerBackend, command_problem, preflight_script
from autotune_plugins.shared.worker_process import WorkerProcess

__all__ = ["ExLlamaV2Backend", "SETTINGS", "UNITS", "flash_attn_version", "tabbyapi_args"]

UNITS = SERVING_UNITS
MIN_PAGED_FLASH_ATTN = (2, 5, 7)  # exllamav2/attn.py: has_flash_attn_with_paged
# exllamav2/generator/dynamic.py: max_batch_size * max_q_size must fit the model's
# max_batch_size (1) * max_input_len (2048).
MAX_PARALLEL = 2048 // MAX_Q_SIZE

_PROBE = "import importlib.metadata as m\ntry: print(m.version('flash_attn'))\nexcept m.PackageNotFoundError: print('')"
SCORING_CTX = 2048
INSTALL = "pip install -e '.[exllamav2]' in autotune's checkout (exllamav2==0.3.2, torch>=2.3)"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "python", str, None, "the interpreter that runs the worker and has torch and exllamav2 (absent: autotune's own)"
    ),
    Setting(
        "worker_command",
        list,
        None,
        "the worker's whole command line, replacing python -m "
        "autotune_plugins.exllamav2.worker (tests run fake workers)",
        check=command_problem,
    ),
    Setting(
        "paged",
        (str, bool),
        "auto",
        'paged attention for concurrent jobs: "auto" (when flash-attn '
        ">= 2.5.7 is installed for the worker's interpreter), true or false",
        choices=("auto", True, False),
    ),
    Setting(
        "unpaged_parallel",
        str,
        "queue",
        'how parallel > 1 runs without paged attention: "queue" '
        '(jobs one after another, as a deployed server serves them) or "batched" (batched forward '
        "passes: offline batch work)",
        choices=UNPAGED_CHOICES,
    ),
    Setting("startup_timeout_s", float, 60.0, "seconds the worker may take to start", check=positive),
    Setting(
        "load_timeout_s",
        float,
        900.0,
        "seconds loading the model may take (the first load JIT-compiles "
        "ExLlamaV2's extension, about 4.5 minutes on an H200)",
        check=positive,
    ),
    Setting(
        "request_timeout_s", float, 600.0, "seconds one measurement run or scoring request may take", check=positive
    ),
    Setting(
        "cuda_context_mib",
        float,
        float(memory.DEFAULT_CUDA_CONTEXT_MIB),
        "CUDA context and PyTorch/cuBLAS workspace in the memory estimate, MiB (measured on an H200)",
        check=not_negative,
    ),
    Setting(
        "scoring_ctx",
        int,
        SCORING_CTX,
        "tokens a quality scorer's cache holds (at most the model's context)",
        check=at_least_one,
    ),
    STABILITY_METRIC,
    Setting(
        "convert_args",
        list,
        [],
        "more arguments for ExLlamaV2's converter when an EXL2 format is made, "
        'e.g. ["-hsol", "16"] (measurement states kept on the card: faster) or ["-l", "512", '
        '"-ml", "512"] (shorter calibration rows); they are part of the artifact\'s cache key',
        check=convert_args_problem,
    ),
)


@functools.lru_cache(maxsize=8)
def flash_attn_version(python: str) -> tuple[int, ...] | None:
    """flash-attn's version in ``python``'s environment (None: not installed), without importing it."""
    try:
        if python == sys.executable:
            import importlib.metadata as m

            text = m.version("flash_attn")
        else:
            probed = processes.run(
                [python, "-c", _PROBE],
                capture_output=True,
                text=True,
                timeout_s=60,
                env=engine_environment(declarations.PYTHON_ENGINE_VARIABLES),
            )
            if probed.returncode != 0:
                return None
            text = probed.stdout.strip()
    except Exception:  # noqa: BLE001 - not installed, or no such interpreter: no paged attention
        return None
    parts = tuple(int(p) for p in text.split("+")[0].split(".") if p.isdigit())
    return parts or None


_PREFLIGHT = preflight_script("exllamav2")


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
    return (
        f"{config_file}: rope_parameters.rope_theta = {theta} but no top-level rope_theta, "
        f"the only one ExLlamaV2 0.3.2 reads (it would run with its default base and produce wrong "
        f'text): add "rope_theta": {theta} to config.json'
    )


def tabbyapi_args(s: GeneratorSettings, model_dir: Path) -> list[str]:
    """TabbyAPI's flags that make its ExLlamaV2 generator the one ``s`` describes.

    Unpaged, TabbyAPI's cache holds one sequence (as the measured worker's did); batched
    forward passes (``mode = "batched"``) have no server equivalent, and the deploy line says so.
    """
    cache_size = s.cache_tokens if s.mode == "dynamic" else s.max_seq_len
    return [
        "--model-dir",
        str(model_dir.parent),
        "--model-name",
        model_dir.name,
        "--backend",
        "exllamav2",
        "--max-seq-len",
        str(s.max_seq_len),
        "--cache-size",
        str(cache_size),
        "--cache-mode",
        s.cache_type.upper(),
        "--max-batch-size",
        str(s.max_batch_size),
    ]


def deploy_for(
    s: GeneratorSettings,
    model_dir: Path,
    parallel: int,
    python: str = "python",
    why_unpaged: str = "flash-attn 2 needs sm_80",
    found: str = "measured",
    served_alone: tuple[float, float] | None = None,
) -> str:
    """The deploy line that delivers what ``s`` measures (or the twin predicts).

    Paged, TabbyAPI runs the ``parallel`` jobs together. Unpaged in ``"queue"`` mode, TabbyAPI's
    dynamic generator holds one sequence and serves the users one at a time (ExLlamaV2 0.3.2:
    ``paged=False`` means "the max supported batch size is 1"), which is what was measured. Unpaged
    ``"batched"`` forward passes have no server: what delivers them is an offline batch job,
    ExLlamaV2's base generator over a cache of ``parallel`` rows (exllamav2's
    examples/deprecated/batched_inference.py), and the line is that job, not TabbyAPI; where the
    single-stream figures are known (``served_alone``: decode and aggregate tok/s of one request),
    the line says what TabbyAPI would give instead.
    """
    if s.mode == "batched":
        return deploy_line(
            [python, "examples/deprecated/batched_inference.py"],
            [
                f"an offline batch job from an exllamav2 checkout, not a server: ExLlamaV2BaseGenerator.generate_simple "
                f"over {parallel} prompts at a time, config.max_batch_size = {parallel}, ExLlamaV2Cache(batch_size="
                f"{parallel}, max_seq_len={s.max_seq_len}), cache mode {s.cache_type.upper()}, model {model_dir} (set "
                f"in the script)",
                f"no server serves concurrent users with ExLlamaV2 here ({why_unpaged}): TabbyAPI "
                "would take them one at a time"
                + (
                    ""
                    if served_alone is None
                    else f", {served_alone[0]:.1f} tok/s for the user being served and "
                    f"{served_alone[1]:.1f} tok/s in all ({found})"
                ),
            ],
        )
    notes = [
        f"TabbyAPI, run from its checkout by the interpreter whose exllamav2 was {found} (config.yml "
        "model: keys of the same names)",
        "--host 0.0.0.0 serves other machines",
    ]
    if s.paged:
        notes.append(
            f"cache of {parallel} x pad256({s.max_seq_len}) tokens, paged attention: the {parallel} jobs run together"
        )
    elif parallel > 1:
        notes.append(
            f"no paged attention ({why_unpaged}): it serves the {parallel} users one at a time, as "
            f"{found}, so the aggregate is the single-stream rate"
        )
    return deploy_line(
        [python, "main.py", *tabbyapi_args(s, model_dir), "--host", "127.0.0.1", "--port", "5000"], notes
    )


class ExLlamaV2Artifacts(ArtifactMaker):
    def recipe(self, fmt: str, source: Path, ctx: StudyContext):
        """EXL2 formats from a Hugging Face directory (:mod:`.recipes`), converted by the worker's
        interpreter on the study's card."""
        b = self.backend
        version = b.engine_build(None).partition(" (")[0].replace(" ", "-")
        # The environment names the study's card; it is asked for only when converting.
        return exl2_recipe(
            fmt, source, b.python(ctx), lambda: b.worker_env(ctx), version, tuple(b.value(ctx, "convert_args"))
        )


class ExLlamaV2Scoring(Scoring):
    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext):
        from autotune_plugins.exllamav2.scorer import ExLlamaV2Scorer

        return ExLlamaV2Scorer.open(self.backend, weights, cache_type or "fp16", ctx)


class ExLlamaV2Backend(WorkerBackend):
    name: ClassVar[str] = "exllamav2"
    engine: ClassVar[str] = "exllamav2"
    description: ClassVar[str] = "ExLlamaV2's dynamic generator on an EXL2 directory, one worker process per trial"
    settings: ClassVar[tuple[Setting, ...]] = SETTINGS
    kv_cache_types: ClassVar[tuple[CacheType, ...]] = declarations.CACHE_TYPES
    weight_formats: ClassVar[tuple[WeightFormats, ...]] = (declarations.EXL2,)
    # The worker and the converter are Python: see the declaration.
    engine_variables: ClassVar[tuple[str, ...]] = declarations.PYTHON_ENGINE_VARIABLES
    artifacts = part(ExLlamaV2Artifacts)
    scoring = part(ExLlamaV2Scoring)
    worker_module: ClassVar[str] = "autotune_plugins.exllamav2.worker"
    generator_class: ClassVar[type] = GeneratorSettings
    install: ClassVar[str] = INSTALL
    preflight_script: ClassVar[str] = _PREFLIGHT
    runs_on: ClassVar[str] = "ExLlamaV2 runs on NVIDIA GPUs only"

    # -------------------------------------------------------------- space and rules

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """``cache_type``: the study's values that are ExLlamaV2 cache modes, as given (all of them
        when the study names none); none of them: no choices, and the core says so."""
        if "cache_type" not in space:
            caches: tuple[Any, ...] = CACHE_CHOICES
        else:
            kept: list[Any] = []
            for value in space["cache_type"]:
                if any(same_value(value, c) for c in CACHE_CHOICES) and value not in kept:
                    kept.append(value)
            caches = tuple(kept)
        return [
            Param(
                "cache_type", caches, "KV-cache mode: fp16, q8, q6, q4 (TabbyAPI's cache_mode)", accepted=CACHE_CHOICES
            )
        ]

    def default_launch(self, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        """ExLlamaV2's defaults: ``ExLlamaV2Config`` keeps the model's own ``max_seq_len`` (its
        config.json), ``ExLlamaV2Cache`` is FP16 and holds one sequence of that length
        (``batch_size=1``); TabbyAPI's cache_mode and cache_size default to the same."""
        model = self._model(weights, ctx)
        config = TrialConfig(self.name, weights, model.max_context, 1, (("cache_type", "fp16"),))
        return DefaultLaunch(
            config,
            (
                f"ExLlamaV2's defaults: FP16 cache of the model's own {model.max_context} tokens (max_seq_len from "
                "config.json, cache batch 1), one sequence at a time; one user"
            ),
        )

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        if is_format(weights, self.weight_formats):
            return None  # whether it can be made is the study's check (the artifacts part)
        p = self.weights_path(weights, ctx)
        problem = path_problem(p, "directory")
        if problem:
            return f"{p}: {problem} (weights are EXL2 directories relative to the study file)"
        if not (p / "config.json").is_file():
            return f"{p}: no config.json (an EXL2 directory holds config.json, tokenizer.json and *.safetensors)"
        cfg = read_config_json(p)
        # The study's own full-precision source loads as it is (ExLlamaV2 reads FP16 safetensors):
        # the reference its EXL2 conversions' quality is measured against.
        is_source = ctx.source is not None and p.resolve() == Path(ctx.source).resolve()
        if exl2_quantization(cfg, p / "config.json") is None and not is_source:
            return (
                f"{p}/config.json: no quantization_config with quant_method 'exl2' and bits "
                f"(convert with python -m exllamav2.conversion.convert_exl2 ... -cf {p})"
            )
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

    def check_config(self, config: TrialConfig, ctx: StudyContext, model: ModelSpec) -> list[str]:
        reasons = []
        try:
            normalize_cache_type(config.option("cache_type", "fp16"))
        except ConfigError as exc:
            reasons.append(str(exc))
        if pad_to_page(config.ctx) > model.max_context:
            reasons.append(
                f"ctx {config.ctx} (padded to {pad_to_page(config.ctx)}, the generator's page) exceeds "
                f"the model's max_position_embeddings {model.max_context}"
            )
        if config.parallel > MAX_PARALLEL:
            reasons.append(
                f"parallel {config.parallel}: the dynamic generator takes at most {MAX_PARALLEL} jobs "
                f"(max_batch_size x max_q_size {MAX_Q_SIZE} <= max_input_len 2048)"
            )
        return reasons

    # -------------------------------------------------------------- settings

    def paged(self, ctx: StudyContext) -> bool:
        value = self.setting(ctx, "paged")
        if isinstance(value, bool):
            return value
        version = flash_attn_version(self.python(ctx))
        return version is not None and version >= MIN_PAGED_FLASH_ATTN

    def generator_settings(self, config: TrialConfig, ctx: StudyContext) -> GeneratorSettings:
        """The generator a trial measures and its deploy line serves: one object for both."""
        return generator_settings(
            config.option("cache_type", "fp16"),
            config.ctx,
            config.parallel,
            self.paged(ctx),
            self.setting(ctx, "unpaged_parallel"),
        )

    # -------------------------------------------------------------- memory

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        context_mib = float(self.setting(ctx, "cuda_context_mib"))
        made = self._made(config.weights, ctx)
        if made is None:  # a format not converted yet: its bytes predicted from the source's shape
            _, bpw = parse_format(config.weights, self.weight_formats)
            return memory.estimate_for(
                ctx.model,
                memory.predicted_exl2_weights(ctx.model, float(bpw)),
                self.generator_settings(config, ctx),
                ctx.workload.prompt_tokens,
                int(context_mib * memory.MiB),
            )
        return memory.estimate(
            made, self.generator_settings(config, ctx), ctx.workload.prompt_tokens, int(context_mib * memory.MiB)
        )

    # -------------------------------------------------------------- commands

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        return deploy_for(
            self.generator_settings(config, ctx),
            self.weights_path(config.weights, ctx),
            config.parallel,
            self.python(ctx),
            "flash-attn >= 2.5.7 is not installed for the measured interpreter (it needs sm_80)",
        )

    # -------------------------------------------------------------- run

    def load(
        self,
        worker: WorkerProcess,
        model_dir: Path,
        settings: GeneratorSettings,
        ctx: StudyContext,
        purpose: str = "measure",
    ) -> dict[str, Any]:
        """The worker builds exactly ``settings`` (:meth:`WorkerBackend.load`) for a measurement
        or, ``purpose = "score"``, for a scorer (no generator, only the model and its cache)."""
        return super().load(worker, model_dir, settings, ctx, purpose=purpose)
