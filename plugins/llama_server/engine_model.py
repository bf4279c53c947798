"""llama.cpp as one engine model (:class:`autotune.engine.model.EngineModel`): the space, the
refusals (``rules.toml``), the memory model (:mod:`.memory`) and the physics constants
(``engine_model.toml``) that the llama-server backend and the twin of llama.cpp both read.
"""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from autotune.api import (
    EngineModel,
    MemoryEstimate,
    ModelSpec,
    Param,
    StudyContext,
    TrialConfig,
    deploy_line,
    parse_format,
)
from autotune._builtin import kept
from autotune.api import WeightsBreakdown
from autotune._builtin import DefaultLaunch, Rule, load_rules, violations
from autotune._builtin import read_gguf
from autotune_plugins.llama_server import declarations, memory, split
from autotune_plugins.llama_server.formats import format_of, gguf_file_weights
from autotune_plugins.llama_server.engine_defaults import DEFAULT_SLOTS, ENGINE_DEFAULTS

__all__ = ["LLAMA_CPP", "LlamaCppModel", "engine_rules"]

CACHE_CHOICES = ("f16", "q8_0", "q4_0")


@functools.lru_cache(maxsize=1)
def engine_rules() -> list[Rule]:
    """llama.cpp's refusals, kept as data beside this module (rules.toml)."""
    return load_rules(Path(__file__).with_name("rules.toml"))


def _is_gguf(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"GGUF"


def _layers_problem(value: Any) -> str | None:
    if isinstance(value, str):
        return None if value == "all" else 'must be "all" or a number of layers'
    return None if type(value) is int and value >= 0 else "must be >= 0 layers"


class LlamaCppModel(EngineModel):
    name = "llama.cpp"
    weight_formats = (declarations.GGUF,)
    kv_cache_types = declarations.CACHE_TYPES
    engine_variables = ("GGML_*",)  # ggml's own switches (GGML_CUDA_*, GGML_VK_*)
    cache_types = CACHE_CHOICES
    default_cache = "f16"
    twin_name = "twin-llama.cpp"
    twin_class = "TwinLlamaCpp"
    twin_description = "digital twin of llama.cpp's llama-server (physics, no GPU needed)"
    artifacts = ("gguf",)
    artifact_words = {"gguf": ("a GGUF file", "GGUF files")}
    constants_file = Path(__file__).with_name("engine_model.toml")

    # ------------------------------------------------------------------ space and rules

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """The study's values llama-server understands, exactly as given; a key the study does
        not name gets this engine's defaults. A key whose values are all foreign yields no
        choices, so the core reports the values with ``accepted``."""
        params = [
            Param(
                "cache_type",
                kept(space, "cache_type", CACHE_CHOICES),
                "KV-cache type (-ctk/-ctv): f16, q8_0, q4_0",
                accepted=CACHE_CHOICES,
            ),
            Param(
                "flash_attn",
                kept(space, "flash_attn", (True, False)),
                "flash attention (-fa on|off)",
                accepted=(True, False),
            ),
        ]

        def counted(name: str) -> tuple[int, ...]:
            # llama.cpp reads these with std::stoi into an int32 (declarations.OPTION_RANGES): a
            # larger value is refused by llama-server itself, so it is refused here, up front, by
            # the backend and its twin alike.
            low, high = declarations.OPTION_RANGES[name]
            return tuple(v for v in space[name] if type(v) is int and low <= v <= high)

        top = declarations.INT32_MAX
        if "ubatch" in space:
            params.append(
                Param("ubatch", counted("ubatch"), "physical batch size (-ub)", accepted=(f"an integer 1..{top}",))
            )
        # The offload dimensions (issue 27), only when the space names them: a study that does not
        # keeps today's command line, the gpu_layers setting and no -b/--n-cpu-moe.
        if "batch" in space:
            params.append(
                Param(
                    "batch",
                    counted("batch"),
                    "logical batch size (-b); ubatch <= batch",
                    accepted=(f"an integer 1..{top}",),
                )
            )
        if "gpu_layers" in space:
            layers = counted("gpu_layers")
            ngl = tuple(v for v in space["gpu_layers"] if v == "all" or (type(v) is int and v in layers))
            params.append(
                Param(
                    "gpu_layers",
                    ngl,
                    'layers on the GPU (-ngl; "all" = -ngl 999): the output layer and the last N - 1 decoder layers',
                    accepted=('"all"', f"an integer 0..{top}"),
                )
            )
        if "n_cpu_moe" in space:
            params.append(
                Param(
                    "n_cpu_moe",
                    counted("n_cpu_moe"),
                    "layers whose routed experts stay in host memory (--n-cpu-moe: the first N)",
                    accepted=(f"an integer 0..{top}",),
                )
            )
        return params

    def rules(self, config: TrialConfig, ctx: StudyContext, model: ModelSpec | None = None) -> list[str]:
        """``rules.toml`` over the configuration and what is known of the model (``model``: the
        weights file's own, else the study's); a value of a placement option of the wrong kind
        (a configuration written by hand, ``estimate --setting``) is named first."""
        model = model or ctx.model
        reasons = []
        for name, accepted, problem in (
            ("gpu_layers", '"all" or an integer >= 0 (-ngl)', _layers_problem),
            ("n_cpu_moe", "an integer >= 0 (--n-cpu-moe)", lambda v: None if type(v) is int and v >= 0 else "no"),
            ("ubatch", "an integer >= 1 (-ub)", lambda v: None if type(v) is int and v >= 1 else "no"),
            ("batch", "an integer >= 1 (-b)", lambda v: None if type(v) is int and v >= 1 else "no"),
        ):
            value = config.option(name)
            if value is not None and problem(value) is not None:
                reasons.append(f"{name} {value!r}: accepted: {accepted}")
        if reasons:
            return reasons
        options = {
            "cache_type": self.default_cache,
            "flash_attn": True,
            **dict(config.options),
            "ctx": config.ctx,
            "parallel": config.parallel,
        }
        facts = {
            "head_dim": model.head_dim,
            "ctx": config.ctx,
            "max_context": model.max_context,
            "compute_capability": getattr(ctx.gpu, "compute_capability", None),
            "moe": model.is_moe,
            "n_layers": model.n_layers,
            "all_layers": model.n_layers + 1,
            "batch": memory.DEFAULT_BATCH,
        }
        return violations(engine_rules(), options, facts)

    def placement_parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """-sm, -ts, -mg (split.py), for the twin: the real backend adds them itself."""
        return split.parameters(space)

    def placement_rules(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        p = getattr(ctx, "placement", None)
        return split.check(config, ctx, ctx.model, cuda=p is not None and not p.on_cpu)

    def placement_space(self, ctx: StudyContext) -> dict[str, list[Any]]:
        p = getattr(ctx, "placement", None)
        return split.space(ctx, cuda=p is not None and not p.on_cpu)

    # ------------------------------------------------------------------ memory and physics

    def memory(self, s: Any, k: Any) -> MemoryEstimate:
        """llama-server's own memory model (:func:`.memory.estimate`, within ~1% of NVML on an
        H200), in the scenario's placement: a layer count as ``-ngl`` means it ("auto" is the
        twin's own fill, which this every-layer figure drives) and the experts kept in host memory."""
        layers = s.gpu_layers if isinstance(s.gpu_layers, int) else None
        return memory.estimate(
            s.model,
            s.weights,
            s.ctx,
            s.parallel,
            s.cache_type,
            s.flash_attn,
            ubatch=s.ubatch,
            gpu=True,
            gpu_layers=layers,
            n_cpu_moe=s.n_cpu_moe,
            batch=s.batch,
        )

    def scenario(self, twin: Any, s: Any, config: TrialConfig, ctx: StudyContext) -> Any:
        """The placement: the trial's ``gpu_layers`` (else the setting), ``n_cpu_moe`` (else 0),
        ``ubatch`` (else llama-server's default), ``batch`` and the ``host_threads`` setting."""
        layers, batch = config.option("gpu_layers"), config.option("batch")
        threads = twin.setting(ctx, "host_threads")
        return replace(
            s,
            gpu_layers=twin.setting(ctx, "gpu_layers") if layers is None else layers,
            n_cpu_moe=int(config.option("n_cpu_moe", 0)),
            ubatch=int(config.option("ubatch", memory.DEFAULT_UBATCH)),
            batch=None if batch is None else int(batch),
            host_threads=None if threads is None else int(threads),
        )

    def load_failure(self, twin: Any, config: TrialConfig, ctx: StudyContext, mem: MemoryEstimate) -> None:
        """llama.cpp does not fail: it spills layers to the CPU (recorded as host_layers)."""

    # ------------------------------------------------------------------ artifacts

    def file_format(self, path: Path) -> str | None:
        """A GGUF file as the format its header names (:func:`.formats.format_of`)."""
        return format_of(read_gguf(path)) if _is_gguf(path) else None

    def file_weights(self, path: Path) -> WeightsBreakdown | None:
        return gguf_file_weights(path) if _is_gguf(path) else None

    # ------------------------------------------------------------------ launches

    def default_launch(self, twin: Any, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        """The real llama-server's default launch (its ``default_launch`` says where each default
        comes from): the model's trained context in one pool of 4 slots, f16 cache, flash attention
        on (``-fa auto`` where the card has it). llama.cpp's ``--fit`` would shrink that context to
        fit the card; the twin does not model it and spills layers instead, as it does for every
        configuration that does not fit."""
        config = TrialConfig(
            twin.name,
            weights,
            max(1, ctx.model.max_context // DEFAULT_SLOTS),
            DEFAULT_SLOTS,
            (("cache_type", "f16"), (ENGINE_DEFAULTS, True), ("flash_attn", True)),
        )
        return DefaultLaunch(
            config,
            (
                f"predicted for llama-server -m only: the model's own {ctx.model.max_context} tokens in one "
                f"KV pool of {DEFAULT_SLOTS} slots (-c 0, -np auto), f16 cache, -fa auto; {DEFAULT_SLOTS} users at once"
            ),
        )

    def deploy_command(self, twin: Any, config: TrialConfig, ctx: StudyContext) -> str:
        """The llama-server line that serves what the twin simulated (its layer split included)."""
        _, detail = parse_format(twin.as_format(config.weights, ctx), self.weight_formats)
        path = twin.weights_file(config.weights, ctx)
        model_file = str(path) if path is not None else f"{ctx.model.key}-{detail}.gguf"
        if config.option(ENGINE_DEFAULTS):
            return deploy_line(
                ["llama-server", "-m", model_file, "--host", "127.0.0.1", "--port", "8080"],
                ["every other flag at llama-server's default"],
            )
        cache = config.option("cache_type", "f16")
        fa = "on" if config.option("flash_attn", True) else "off"
        # The layers the simulation kept on the GPU, so the line serves what was simulated.
        scenario = twin.scenario(config, ctx)
        on_gpu = twin.layers_on_gpu(config, ctx)
        n = ctx.model.n_layers
        setting = (
            twin.setting(ctx, "gpu_layers") if config.option("gpu_layers") is None else config.option("gpu_layers")
        )
        # -ngl counts the output head as the last of n + 1 layers: N puts it and N - 1 layers on the GPU.
        if isinstance(setting, int) and on_gpu < n:
            ngl = setting
        else:
            ngl = on_gpu + 1 if on_gpu < n else max(99, n + 1)  # all of them, the output layer too
        notes = [f"-c is ctx {config.ctx} x {config.parallel} slots"]
        if on_gpu < n:
            notes.append(f"{n - on_gpu} of {n} layers run on the CPU")
        placement: list[Any] = []
        if scenario.n_cpu_moe:
            placement += ["--n-cpu-moe", scenario.n_cpu_moe]
            notes.append(f"the experts of the first {min(scenario.n_cpu_moe, n)} layers stay in host memory")
        if config.option("ubatch") is not None:
            placement += ["-ub", scenario.ubatch]
        if config.option("batch") is not None:
            placement += ["-b", scenario.batch]
        return deploy_line(
            [
                "llama-server",
                "-m",
                model_file,
                "-c",
                config.ctx * config.parallel,
                "-np",
                config.parallel,
                "-ngl",
                ngl,
                *placement,
                *split.flags(config),
                "-fa",
                fa,
                "-ctk",
                cache,
                "-ctv",
                cache,
                "--host",
                "127.0.0.1",
                "--port",
                "8080",
            ],
            notes,
        )


LLAMA_CPP = LlamaCppModel()
