"""The exllamav3 backend: each trial in its own worker process, measured like every backend.

A trial's lifecycle (see :mod:`autotune.engine.backend`):

* weights are EXL3 directories (``config.json`` with ``quantization_config.quant_method =
  "exl3"`` and ``*.safetensors``), relative to the study file's directory, or formats
  (``exl3:4.0``) converted from the study's ``[model] source`` when a trial first needs them
  (:mod:`autotune.modelfiles.artifacts`, recipe in :mod:`~autotune_plugins.exllamav3.recipes`);
* ``check`` refuses what exllamav3 and TabbyAPI refuse (a context beyond the model's, a cache
  type outside fp16 / k<K>v<V> with K, V in 2..8, a prefill chunk that is not a multiple of
  the 256-token page);
* ``estimate_memory`` reads the directory's tensor bytes and follows exllamav3 1.6.5's
  allocations (:mod:`.memory`);
* ``run`` starts ``python -m autotune_plugins.exllamav3.worker`` in its own session, loads the
  model there, and measures with the core's loop, :func:`autotune.measure.measure_engine`: the
  lifecycle ExLlamaV2's backend shares (:class:`autotune_plugins.shared.worker_backend.WorkerBackend`),
  with this engine's own refusals (``refuse_run``, ``preflight_more``) and record (``generator_attrs``).

The space: ``cache_type`` (``fp16``, ``k8v8``, ``k4v6``...; all 50 when the study names none
would be a large space, so the default is fp16 and the symmetric k8v8, k6v6, k4v4, k2v2
that TabbyAPI's legacy Q8/Q6/Q4 names mean), and ``chunk_size`` when the study's ``[space]``
names it (else the ``chunk_size`` setting, 2048 like TabbyAPI's).

Quality: ``scorer`` loads an artifact in a worker for the quality metrics (KL divergence against
the full-precision source, MMLU, C-Eval; :mod:`.scorer`).

The deploy line is TabbyAPI (``--backend exllamav3``) built from the same
:class:`~.generator_settings.GeneratorSettings` the worker was told to build (it refuses
rather than build another), so it serves what was measured.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Mapping, Sequence

from autotune.api import ArtifactMaker, part
from autotune._builtin import Scoring
from autotune._builtin import Splitting
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
    ACCEPTANCE_ATTR,
    Acceptance,
    ConfigError,
    DefaultLaunch,
    SERVING_UNITS,
    Workload,
    cuda_visible,
    engine_environment,
    is_format,
    model_from_hf_config,
    path_problem,
)
from autotune._builtin import read_config_json

from autotune_plugins.shared.common_settings import STABILITY_METRIC, at_least_one, not_negative, positive
from autotune_plugins.shared.worker_backend import WorkerBackend, command_problem, preflight_script
from autotune_plugins.shared.worker_process import default_worker_command as _worker_command
from autotune_plugins.exllamav3 import declarations, draft_memory, memory, speculation, split
from autotune_plugins.exllamav3.formats import EXL3_HEAD_BITS, exl3_quantization, head_bits_ok
from autotune_plugins.exllamav3.generator_settings import (
    DEFAULT_CHUNK,
    GeneratorSettings,
    chunk_problem,
    generator_settings,
    normalize_cache_type,
    pages_per_job,
)
from autotune_plugins.exllamav3.recipes import convert_args_problem, exl3_recipe

__all__ = [
    "DEFAULT_CACHES",
    "ExLlamaV3Backend",
    "INSTALL",
    "SETTINGS",
    "UNITS",
    "default_worker_command",
    "deploy_for",
    "per_card",
    "placement_of",
    "tabbyapi_args",
]

UNITS = SERVING_UNITS
INSTALL = (
    "pip install -e '.[exllamav3]' in autotune's checkout (exllamav3==1.6.5 and torch; exllamav3 compiles "
    "its CUDA extension at first import, so the CUDA toolkit's nvcc must be on PATH)"
)
# The space's cache types when the study names none: FP16 and the symmetric modes TabbyAPI's
# legacy names stand for (backends/exllamav3/model.py create_cache: Q8 -> 8,8, Q6 -> 6,6,
# Q4 -> 4,4), plus 2 bits; any k<K>v<V> is accepted when named.
DEFAULT_CACHES = ("fp16", "k8v8", "k6v6", "k4v4", "k2v2")
CACHE_ACCEPTED = ("fp16", "k<K>v<V> with K, V from 2 to 8")
# The scorer's context, as ExLlamaV2's and llama.cpp's: MMLU 5-shot prompts reach ~1,500 tokens.
SCORING_CTX = 2048


def _head_bits_problem(value: float) -> str | None:
    return None if head_bits_ok(float(value)) else "must be 1-8 (halves only 1.5, 2.5, 3.5) or 16, as -hb accepts"


SETTINGS: tuple[Setting, ...] = (
    Setting(
        "python",
        str,
        None,
        "the interpreter that runs the worker and the converter, with torch and exllamav3 (absent: autotune's own)",
    ),
    Setting(
        "worker_command",
        list,
        None,
        "the worker's whole command line, replacing python -m "
        "autotune_plugins.exllamav3.worker (tests run fake workers)",
        check=command_problem,
    ),
    Setting(
        "chunk_size",
        int,
        DEFAULT_CHUNK,
        "prefill chunk in tokens (Generator max_chunk_size, TabbyAPI "
        "chunk_size), a multiple of 256; [space] chunk_size searches it instead",
        check=chunk_problem,
    ),
    Setting(
        "head_bits",
        float,
        EXL3_HEAD_BITS,
        "bits of the output head when an EXL3 format is made (the converter's -hb)",
        check=_head_bits_problem,
    ),
    Setting("startup_timeout_s", float, 60.0, "seconds the worker may take to start", check=positive),
    Setting(
        "load_timeout_s",
        float,
        1800.0,
        "seconds loading the model may take (the first load JIT-compiles "
        "exllamav3's extension, many minutes; warmup compiles the Triton kernels)",
        check=positive,
    ),
    Setting("request_timeout_s", float, 600.0, "seconds one measurement run may take", check=positive),
    Setting(
        "cuda_context_mib",
        float,
        float(memory.DEFAULT_CUDA_CONTEXT_MIB),
        "CUDA context, kernels and workspaces in the memory estimate, MiB",
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
        "more arguments for exllamav3's converter when an EXL3 format is made, "
        'e.g. ["-cr", "100"] (fewer calibration rows: faster); they are part of the artifact\'s cache key',
        check=convert_args_problem,
    ),
)

# And what compiles exllamav3's extension at its first import: nvcc on PATH, or where torch's
# extension loader finds it (CUDA_HOME), unless the extension is prebuilt.
_PREFLIGHT = preflight_script(
    "exllamav3",
    """
import shutil
found["nvcc"] = shutil.which("nvcc") is not None
found["cuda_home"] = None
if found["torch"]:
    try:
        from torch.utils.cpp_extension import CUDA_HOME
        found["cuda_home"] = CUDA_HOME
    except Exception:
        pass
if found["exllamav3"]:
    found["prebuilt_ext"] = importlib.util.find_spec("exllamav3_ext") is not None
""",
)


WORKER = "autotune_plugins.exllamav3.worker"


def default_worker_command(python: str | None = None) -> list[str]:
    """``python -m autotune_plugins.exllamav3.worker`` with autotune's interpreter by default."""
    return _worker_command(python, WORKER)


def tabbyapi_args(s: GeneratorSettings, model_dir: Path) -> list[str]:
    """TabbyAPI's flags (config.yml ``model:`` keys, dashed; common/args.py) that make its
    exllamav3 generator the one ``s`` describes.

    ``output_chunking false``: jobs reserve their whole response, as measured (see
    :mod:`.generator_settings`). ``cuda_malloc_async false``: PyTorch's own caching allocator,
    the one the worker ran with (TabbyAPI's default is cudaMallocAsync, whose footprint differs).
    """
    return [
        "--model-dir",
        str(model_dir.parent),
        "--model-name",
        model_dir.name,
        "--backend",
        "exllamav3",
        "--max-seq-len",
        str(s.max_seq_len),
        "--cache-size",
        str(s.cache_tokens),
        "--cache-mode",
        declarations.tabby_cache_mode(s.cache_type),
        "--max-batch-size",
        str(s.max_batch_size),
        "--chunk-size",
        str(s.chunk_size),
        "--output-chunking",
        "false",
        "--cuda-malloc-async",
        "false",
        *split.tabbyapi_split_args(s.gpu_split, s.tensor_parallel),
        *tabbyapi_draft_args(s),
    ]


def tabbyapi_draft_args(s: GeneratorSettings) -> list[str]:
    """TabbyAPI's ``draft_model:`` keys (config_sample.yml, dashed) for ``s``'s speculation: none
    without it (``draft_mode`` defaults to ``model``, which drafts nothing without a name)."""
    if s.spec_type == "none":
        return []
    out = ["--draft-mode", speculation.TABBY_DRAFT_MODE[s.spec_type], "--draft-num-tokens", str(s.draft_tokens)]
    if s.spec_type == "draft":
        draft = Path(s.draft_dir)
        out += ["--draft-model-dir", str(draft.parent), "--draft-model-name", draft.name]
    if s.spec_type in speculation.MODEL_MODES:
        out += ["--draft-cache-mode", declarations.tabby_cache_mode(s.draft_cache_type)]
    if s.spec_type == "ngram":
        out += ["--ngram-match-min", str(s.ngram_match_min)]
    return out


def deploy_for(
    s: GeneratorSettings, model_dir: Path, parallel: int, python: str = "python", found: str = "measured"
) -> str:
    """The deploy line that delivers what ``s`` measures (or the twin predicts): TabbyAPI."""
    notes = [
        f"TabbyAPI, run from its checkout by the interpreter whose exllamav3 was {found} (config.yml "
        "model: keys of the same names; cuda_malloc_async is under memory:)",
        f"cache of {parallel} x pad256({s.max_seq_len} + 1{f' + {s.draft_tokens} drafted' if s.draft_tokens else ''}) "
        f"= {s.cache_tokens} tokens: the {parallel} jobs run "
        "together when clients send max_tokens (without it a job reserves max_seq_len)",
        "--host 0.0.0.0 serves other machines",
    ]
    return deploy_line(
        [python, "main.py", *tabbyapi_args(s, model_dir), "--host", "127.0.0.1", "--port", "5000"], notes
    )


class ExLlamaV3Artifacts(ArtifactMaker):
    def recipe(self, fmt: str, source: Path, ctx: StudyContext):
        """EXL3 formats from a Hugging Face directory (:mod:`.recipes`), converted by the worker's
        interpreter on the study's card."""
        b = self.backend
        version = b.engine_build(None).partition(" (")[0].replace(" ", "-")
        return exl3_recipe(
            fmt,
            source,
            b.python(ctx),
            lambda: b.worker_env(ctx),
            version,
            tuple(b.value(ctx, "convert_args")),
            float(b.value(ctx, "head_bits")),
        )


class ExLlamaV3Scoring(Scoring):
    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext):
        from autotune_plugins.exllamav3.scorer import ExLlamaV3Scorer

        return ExLlamaV3Scorer.open(self.backend, weights, cache_type or "fp16", ctx)


class ExLlamaV3Splitting(Splitting):
    def placement_space(self, ctx: StudyContext) -> dict[str, list[Any]]:
        """``gpu_split`` and ``tensor_parallel`` for a study on several cards (:mod:`.split`)."""
        return split.space(ctx, ctx.model, self.backend._hf_config(None, ctx))


class ExLlamaV3Backend(WorkerBackend):
    name: ClassVar[str] = "exllamav3"
    engine: ClassVar[str] = "exllamav3"
    description: ClassVar[str] = "exllamav3's paged generator on an EXL3 directory, one worker process per trial"
    settings: ClassVar[tuple[Setting, ...]] = SETTINGS
    kv_cache_types: ClassVar[tuple[CacheType, ...]] = declarations.CACHE_TYPES
    weight_formats: ClassVar[tuple[WeightFormats, ...]] = (declarations.EXL3,)
    engine_variables: ClassVar[tuple[str, ...]] = declarations.PYTHON_ENGINE_VARIABLES
    artifacts = part(ExLlamaV3Artifacts)
    scoring = part(ExLlamaV3Scoring)
    splitting = part(ExLlamaV3Splitting)
    worker_module: ClassVar[str] = WORKER
    generator_class: ClassVar[type] = GeneratorSettings
    install: ClassVar[str] = INSTALL
    preflight_script: ClassVar[str] = _PREFLIGHT
    runs_on: ClassVar[str] = "exllamav3 runs on NVIDIA GPUs (Ampere or newer) only"

    # -------------------------------------------------------------- space and rules

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """``cache_type``: the study's values that are exllamav3 cache types (any case), as given
        (:data:`DEFAULT_CACHES` when the study names none); ``chunk_size`` when the study names it."""
        if "cache_type" not in space:
            caches: tuple[Any, ...] = DEFAULT_CACHES
        else:
            kept: list[Any] = []
            for value in space["cache_type"]:
                if isinstance(value, str) and _is_cache(value) and value not in kept:
                    kept.append(value)
            caches = tuple(kept)
        params = [
            Param(
                "cache_type",
                caches,
                'KV-cache type: fp16 or k<K>v<V>, K and V bits 2-8 (TabbyAPI\'s cache_mode FP16 or "K,V")',
                accepted=CACHE_ACCEPTED,
            )
        ]
        if "chunk_size" in space:
            chunks = tuple(v for v in space["chunk_size"] if chunk_problem(v) is None)
            params.append(
                Param(
                    "chunk_size",
                    chunks,
                    "prefill chunk (max_chunk_size, TabbyAPI chunk_size)",
                    accepted=("a multiple of 256, at least 256",),
                )
            )
        return params + split.parameters(space) + speculation.parameters(space)

    def search_dimensions(self) -> list[Param]:
        """Every [space] key this backend takes (``autotune plugins``, ``estimate --set``)."""
        return self.parameters({"chunk_size": [], **{k: [] for k in (*split.KEYS, *speculation.KEYS)}})

    def search_rules(self) -> list[str]:
        """The split's and speculation's rules in words (``autotune plugins``)."""
        return list(split.RULES) + list(speculation.RULES)

    def _hf_config(self, weights: str | None, ctx: StudyContext) -> dict | None:
        """The config.json the architecture rules read: the weights' own, else the source's."""
        made = self._made(weights, ctx) if weights is not None else None
        for d in (made, Path(ctx.source) if ctx.source is not None else None):
            if d is not None and (d / "config.json").is_file():
                return read_config_json(d)
        return None

    def default_launch(self, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        """TabbyAPI's defaults for exllamav3 (backends/exllamav3/model.py): ``max_seq_len`` the
        model's own, ``cache_size`` = max_seq_len, FP16 cache, chunk 2048; one user."""
        model = self._model(weights, ctx)
        config = TrialConfig(self.name, weights, model.max_context, 1, (("cache_type", "fp16"),))
        return DefaultLaunch(
            config,
            (
                f"TabbyAPI's exllamav3 defaults: max_seq_len the model's own {model.max_context} tokens, cache_size the "
                "same (here one page more where max_seq_len fills its pages: exllamav3 reserves one token past a job's "
                "end), FP16 cache (cache_mode FP16), chunk_size 2048; one user"
            ),
        )

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        if is_format(weights, self.weight_formats):
            # Whether it can be made is the study's check (the artifacts part); whether exllamav3
            # loads the source's architecture is ours, before any conversion is spent on it.
            source = Path(ctx.source) if ctx.source is not None else None
            if source is not None and (source / "config.json").is_file():
                return declarations.architecture_problem(read_config_json(source), str(source / "config.json"))
            return None
        p = self.weights_path(weights, ctx)
        problem = path_problem(p, "directory")
        if problem:
            return f"{p}: {problem} (weights are EXL3 directories relative to the study file)"
        if not (p / "config.json").is_file():
            return f"{p}: no config.json (an EXL3 directory holds config.json, tokenizer files and *.safetensors)"
        cfg = read_config_json(p)
        # The study's own full-precision source loads as it is (modules/linear.py load_fp16).
        is_source = ctx.source is not None and p.resolve() == Path(ctx.source).resolve()
        try:
            quant = exl3_quantization(cfg, p / "config.json")
        except AutotuneError as exc:
            return str(exc)
        if quant is None and not is_source:
            return (
                f"{p}/config.json: no quantization_config with quant_method 'exl3' and bits (convert with "
                f"python -m exllamav3.conversion.convert_model -i SOURCE -o {p} -w WORKDIR -b BITS)"
            )
        arch = declarations.architecture_problem(cfg, str(p / "config.json"))
        if arch:
            return arch
        try:
            model = model_from_hf_config(p)
            memory.exl3_dir_weights(p, model.tie_embeddings)
        except AutotuneError as exc:
            return str(exc)
        return None

    def _chunk(self, config: TrialConfig, ctx: StudyContext) -> Any:
        return config.option("chunk_size", self.setting(ctx, "chunk_size"))

    def check_config(self, config: TrialConfig, ctx: StudyContext, model: ModelSpec) -> list[str]:
        reasons = []
        quantized = False
        try:
            quantized = normalize_cache_type(config.option("cache_type", "fp16")) != "fp16"
        except ConfigError as exc:
            reasons.append(str(exc))
        chunk = self._chunk(config, ctx)
        if chunk_problem(chunk):
            reasons.append(
                f"chunk_size {chunk_problem(chunk)}: TabbyAPI rounds it up to one and the generator's "
                "shared_chunk_size must be a page multiple no larger than it"
            )
        if config.ctx > model.max_context:
            reasons.append(f"ctx {config.ctx} exceeds the model's max_position_embeddings {model.max_context}")
        hf_config = self._hf_config(config.weights, ctx)
        reasons += split.check(config, ctx, model, hf_config)
        draft = config.option("draft")
        if isinstance(draft, str) and (problem := self.check_weights(draft, ctx)):
            return [*reasons, f"draft: {problem}"]
        draft_dir = self._made(draft, ctx) if isinstance(draft, str) else None
        reasons += speculation.check(config, hf_config, model_from_hf_config(draft_dir) if draft_dir else None, model)
        if quantized and model.kv_dim % 32:
            reasons.append(
                f"cache_type {config.option('cache_type')}: the model's K/V width {model.kv_dim} is not a "
                "multiple of 32, the group a quantized cache packs and scales (cache/quant.py token_dim // 32)"
            )
        return reasons

    # -------------------------------------------------------------- settings

    def generator_settings(self, config: TrialConfig, ctx: StudyContext) -> GeneratorSettings:
        """The generator a trial measures and its deploy line serves: one object for both."""
        draft = config.option("draft")
        return generator_settings(
            config.option("cache_type", "fp16"),
            config.ctx,
            config.parallel,
            self._chunk(config, ctx),
            *placement_of(config, ctx),
            spec_type=config.option("spec_type", "none"),
            draft_tokens=speculation.draft_tokens(config),
            ngram_match_min=speculation.ngram_match(config),
            draft_cache_type=config.option("draft_cache_type", "fp16"),
            draft_dir=str(self.weights_path(draft, ctx)) if isinstance(draft, str) else "",
        )

    def preflight_more(self, found: Mapping[str, Any], python: str) -> list[str]:
        """nvcc to compile exllamav3's extension at first import, unless it is prebuilt."""
        if not found.get("prebuilt_ext") and not found.get("nvcc") and not found.get("cuda_home"):
            return [
                f"exllamav3 in {python} has no prebuilt extension and no CUDA toolkit is found (nvcc not on "
                "PATH, no CUDA_HOME): it compiles exllamav3_ext at first import (exllamav3/ext.py); install "
                "the CUDA toolkit or set CUDA_HOME"
            ]
        return []

    # -------------------------------------------------------------- memory

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        context = int(float(self.setting(ctx, "cuda_context_mib")) * memory.MiB)
        settings = self.generator_settings(config, ctx)
        made = self._made(config.weights, ctx)
        if made is None:  # a format not converted yet: its bytes predicted from the source's shape
            _, bpw = parse_format(config.weights, self.weight_formats)
            model, weights = ctx.model, memory.predicted_exl3_weights(ctx.model, float(bpw))
        else:
            model = model_from_hf_config(made)
            weights = memory.exl3_dir_weights(made, model.tie_embeddings)
        mem = memory.estimate_for(model, weights, settings, ctx.workload.prompt_tokens, context)
        draft = config.option("draft")
        mem = draft_memory.with_draft(
            mem,
            model,
            settings,
            self._draft_bytes(draft, ctx) if isinstance(draft, str) else None,
            speculation.mtp_layers(self._hf_config(config.weights, ctx)),
        )
        return per_card(mem, model, weights, settings, ctx)

    def _draft_bytes(self, draft: str, ctx: StudyContext) -> tuple[str, ModelSpec, memory.Exl3Weights]:
        """The draft's architecture and bytes: its directory's, or for a format not made yet the
        source's shape at the format's bits (as the target's)."""
        made = self._made(draft, ctx)
        if made is None:
            _, bpw = parse_format(draft, self.weight_formats)
            return draft, ctx.model, memory.predicted_exl3_weights(ctx.model, float(bpw))
        shape = model_from_hf_config(made)
        return draft, shape, memory.exl3_dir_weights(made, shape.tie_embeddings)

    @classmethod
    def worker_env(cls, ctx: StudyContext) -> dict[str, str]:
        """The worker sees every card of a study on several (in device order), else the one."""
        return engine_environment(cls.engine_variables, CUDA_VISIBLE_DEVICES=cuda_visible(ctx.placement, ctx.gpu_index))

    # -------------------------------------------------------------- commands

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        return deploy_for(
            self.generator_settings(config, ctx),
            self.weights_path(config.weights, ctx),
            config.parallel,
            self.python(ctx),
        )

    # -------------------------------------------------------------- run

    def refuse_run(self, config: TrialConfig, settings: GeneratorSettings, wl: Workload) -> None:
        if wl.prompt_tokens + wl.output_tokens > settings.max_seq_len:
            raise ConfigError(
                f"the workload's prompt {wl.prompt_tokens} + output {wl.output_tokens} tokens exceed ctx {config.ctx}"
            )

    def replies_attrs(self, replies: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        """The trial's acceptance: the worker's draft counters (the generator's per-job
        ``accepted_draft_tokens`` / ``rejected_draft_tokens``) summed over every sample. The
        generator counts no verification passes, so ``passes`` stays unknown."""
        counts = [r["drafts"] for r in replies if isinstance(r.get("drafts"), Mapping)]
        if not counts:
            return {}
        acc = Acceptance(
            *(sum(int(c.get(k, 0)) for c in counts) for k in ("requests", "drafted", "accepted", "generated"))
        )
        return {ACCEPTANCE_ATTR: acc.to_dict()}

    def generator_attrs(self, settings: GeneratorSettings) -> dict[str, Any]:
        return {"pages_per_job": pages_per_job(settings.max_seq_len + settings.draft_tokens)}


def placement_of(config: TrialConfig, ctx: StudyContext) -> tuple[str, bool]:
    """The generator's ``gpu_split`` and ``tensor_parallel`` for a configuration: ``auto`` where
    a study on several cards names no split (TabbyAPI's default, ``gpu_split_auto: true``);
    nothing on one card."""
    if split.n_cards(ctx) < 2:
        return "", False
    return str(config.option("gpu_split", split.AUTO)), bool(config.option("tensor_parallel", False))


def per_card(
    mem: MemoryEstimate, model: ModelSpec, weights: memory.Exl3Weights, settings: GeneratorSettings, ctx: StudyContext
) -> MemoryEstimate:
    """``mem`` with each card's share on a study of several (:func:`.memory.per_card`): exllamav3
    fills ``gpu_split`` GiB on each card, or with ``auto`` each card's budget less TabbyAPI's
    reserve; ``mem`` unchanged on one card. The real backend and its twin both call it."""
    p = getattr(ctx, "placement", None)
    if p is None or len(p.cards) < 2 or not settings.gpu_split:
        return mem
    gib = split.gpu_split_gib(settings.gpu_split, len(p.cards))
    if not gib:
        capacities = memory.autosplit_capacity(p.budgets)
    else:
        capacities = tuple(int(g * 2**30) for g in gib) + (0,) * (len(p.cards) - len(gib))
    return memory.per_card(mem, model, weights, settings, capacities, settings.tensor_parallel)


def _is_cache(value: str) -> bool:
    try:
        normalize_cache_type(value)
    except ConfigError:
        return False
    return True
