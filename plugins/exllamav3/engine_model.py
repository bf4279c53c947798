"""exllamav3 as one engine model (:class:`autotune.engine.model.EngineModel`): EXL3 weights, a
paged cache and continuous batching. Its memory model is the exllamav3 backend's own
(:mod:`.memory`, read from its allocation code), its generator the backend's
(:mod:`.generator_settings`), its speed the twin's physics with the trellis decode cost and the
constants of ``engine_model.toml`` (docs/twin.md).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Mapping, Sequence

from autotune.api import EngineModel, MemoryEstimate, Param, StudyContext, TrialConfig, parse_format
from autotune._builtin import kept
from autotune_plugins.exllamav3 import declarations, memory, split
from autotune_plugins.exllamav3.backend import deploy_for, per_card, placement_of
from autotune_plugins.exllamav3.formats import exl3_quantization
from autotune_plugins.exllamav3.generator_settings import DEFAULT_CHUNK, generator_settings
from autotune._builtin import read_config_json
from autotune_plugins.shared.scenario import weights_on_gpu

__all__ = ["EXLLAMAV3", "ExLlamaV3Model"]


class ExLlamaV3Model(EngineModel):
    name = "exllamav3"
    weight_formats = (declarations.EXL3,)
    kv_cache_types = declarations.CACHE_TYPES
    engine_variables = declarations.PYTHON_ENGINE_VARIABLES
    cache_types = tuple(c.name for c in declarations.CACHE_TYPES)
    default_cache = "fp16"
    twin_name = "twin-exllamav3"
    twin_class = "TwinExllamaV3"
    twin_description = "digital twin of exllamav3's paged generator (physics, no GPU needed)"
    artifacts = ("exl3",)
    artifact_words = {
        "exl3": ("an EXL3 directory", 'EXL3 directories (config.json with quantization_config.quant_method "exl3")')
    }
    constants_file = Path(__file__).with_name("engine_model.toml")

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """``cache_type`` only: exllamav3 attends with its own Triton kernels, fused always."""
        offered = ("fp16", "k8v8", "k6v6", "k4v4") if "cache_type" not in space else self.cache_types
        return [
            Param(
                "cache_type",
                kept(space, "cache_type", offered),
                "KV-cache type: fp16 or k<K>v<V>, K and V bits 2-8",
                accepted=self.cache_types,
            )
        ]

    def placement_parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        """``gpu_split``, ``tensor_parallel`` (split.py), as the real backend names them."""
        return split.parameters(space)

    def placement_rules(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        return split.check(config, ctx, ctx.model, _source_config(ctx))

    def placement_space(self, ctx: StudyContext) -> dict[str, list[Any]]:
        return split.space(ctx, ctx.model, _source_config(ctx))

    def placement_memory(
        self, mem: MemoryEstimate, s: Any, config: TrialConfig, ctx: StudyContext
    ) -> MemoryEstimate | None:
        """The real backend's per-card model (backend.per_card) on the twin's predicted bytes."""
        w = memory.Exl3Weights(
            gpu_bytes=mem.weights_bytes,
            host_bytes=mem.host_bytes,
            n_tensors=0,
            files=("(predicted by the twin)",),
            per_layer_bytes=tuple(s.weights.per_layer_bytes),
        )
        settings = generator_settings(s.cache_type, s.ctx, s.parallel, DEFAULT_CHUNK, *placement_of(config, ctx))
        return per_card(mem, s.model, w, settings, ctx)

    def memory(self, s: Any, k: Any) -> MemoryEstimate:
        """The backend's own model (:func:`.memory.estimate_for`) for the paged cache its generator
        gets (``parallel`` jobs of ``ctx`` tokens, pages of 256): the twin and the backend give the
        same bytes. The CUDA context is ``context_bytes`` (the backend's ``cuda_context_mib`` default)."""
        weights_gpu, host, _ = weights_on_gpu(s, k)
        w = memory.Exl3Weights(gpu_bytes=weights_gpu, host_bytes=host, n_tensors=0, files=("(predicted by the twin)",))
        settings = generator_settings(s.cache_type, s.ctx, s.parallel)
        return memory.estimate_for(s.model, w, settings, s.prompt_tokens, int(k.context_bytes))

    def scenario(self, twin: Any, s: Any, config: TrialConfig, ctx: StudyContext) -> Any:
        # Paged: every job of the trial holds its pages at once and decodes in the same steps.
        settings = generator_settings(config.option("cache_type", "fp16"), config.ctx, config.parallel)
        return replace(s, flash_attn=True, jobs_at_once=settings.jobs_at_once)

    def attention_path(self, config: TrialConfig, ctx: StudyContext) -> str:
        return "paged"

    def deploy_command(self, twin: Any, config: TrialConfig, ctx: StudyContext) -> str:
        """The exllamav3 backend's own TabbyAPI line for the generator predicted."""
        _, bpw = parse_format(twin.as_format(config.weights, ctx), self.weight_formats)
        path = twin.weights_file(config.weights, ctx) or Path("models") / f"{ctx.model.key}-exl3-{bpw}bpw"
        settings = generator_settings(
            config.option("cache_type", "fp16"), config.ctx, config.parallel, DEFAULT_CHUNK, *placement_of(config, ctx)
        )
        return deploy_for(settings, path, config.parallel, found="predicted")

    def directory_format(self, directory: Any, check: bool = False) -> str | None:
        exl3 = exl3_quantization(directory.config, directory.path / "config.json")
        return None if exl3 is None else f"exl3:{round(exl3.bits, 2)}"

    def cache_kv_bits(self, cache_type: str) -> tuple[int, int] | None:
        try:
            return declarations.cache_kv_bits(cache_type)
        except ValueError:
            return None


def _source_config(ctx: StudyContext) -> dict | None:
    """The study's source config.json, where it has one (the architecture's tensor-parallel rule)."""
    source = getattr(ctx, "source", None)
    path = Path(source) / "config.json" if source is not None else None
    return read_config_json(Path(source)) if path is not None and path.is_file() else None


EXLLAMAV3 = ExLlamaV3Model()
