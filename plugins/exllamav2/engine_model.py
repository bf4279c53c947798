"""ExLlamaV2 as one engine model (:class:`autotune.engine.model.EngineModel`): its cache modes and
EXL2 formats (:mod:`.declarations`), the generator the real backend runs on a card
(:mod:`.generator_settings`), its memory model (the chunked scratch and the measured context
overhead) and its physics constants (``engine_model.toml``), which the twin of ExLlamaV2 reads.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from autotune.api import EngineModel, MemoryEstimate, Setting, StudyContext, TrialConfig, parse_format
from autotune._builtin import (
    ConfigError,
    DefaultLaunch,
    GpuSpec,
    SlotLayout,
    cache_fixed_bytes,
    kv_bytes_per_token,
    resolve_cache_type,
)
from autotune_plugins.exllamav2 import declarations
from autotune_plugins.exllamav2.backend import deploy_for
from autotune_plugins.exllamav2.formats import EXL2_BPW_MAX, EXL2_BPW_MIN, exl2_quantization
from autotune_plugins.exllamav2.generator_settings import UNPAGED_CHOICES, GeneratorSettings, generator_settings
from autotune_plugins.shared.scenario import FLASH_ATTN2_MIN_CC, weights_on_gpu

__all__ = ["EXLLAMAV2", "ExLlamaV2Model", "buffer_bytes"]

# ExLlamaV2 runs prompts in chunks of max_input_len tokens (config.max_input_len, 2048).
EXL2_CHUNK = 2048


def has_paged_attention(gpu: GpuSpec, paged: str | bool) -> bool:
    """The ``paged`` setting resolved: ``"auto"`` is where flash-attn 2 runs (sm_80 and later)."""
    return gpu.compute_capability_tuple >= FLASH_ATTN2_MIN_CC if paged == "auto" else bool(paged)


def settings_on(
    gpu: GpuSpec, cache: str, ctx: int, parallel: int, paged: str | bool = "auto", unpaged_parallel: str = "queue"
) -> GeneratorSettings:
    """The generator the real backend would run (its ``generator_settings``) on ``gpu``: paged
    where flash-attn 2 runs; without it one job at a time (``"queue"``: TabbyAPI's dynamic
    generator) or offline batched forward passes (``"batched"``)."""
    return generator_settings(cache, ctx, parallel, has_paged_attention(gpu, paged), unpaged_parallel)


def buffer_bytes(s: Any) -> int:
    """ExLlamaV2's scratch: sized by the prompt chunk (``EXL2_CHUNK`` tokens); its matmul attention
    materialises the chunk's scores against the allocated cache in FP16 when attention is not fused."""
    m = s.model
    act = EXL2_CHUNK * (4 * m.hidden_size + 3 * m.ffn_size) * 2
    scores = 0 if s.flash_attn else EXL2_CHUNK * s.ctx * m.n_heads * 2
    logits = s.parallel * m.vocab_size * 4 * 2
    return int(act + scores + logits)


class ExLlamaV2Model(EngineModel):
    name = "exllamav2"
    weight_formats = (declarations.EXL2,)
    kv_cache_types = declarations.CACHE_TYPES
    engine_variables = declarations.PYTHON_ENGINE_VARIABLES
    cache_types = ("fp16", "q8", "q6", "q4")
    default_cache = "fp16"
    twin_name = "twin-exllamav2"
    twin_class = "TwinExllamaV2"
    twin_description = "digital twin of ExLlamaV2's dynamic generator (physics, no GPU needed)"
    artifacts = ("exl2",)
    artifact_words = {
        "exl2": ("an EXL2 directory", 'EXL2 directories (config.json with quantization_config.quant_method "exl2")')
    }
    constants_file = Path(__file__).with_name("engine_model.toml")
    # The real backend's two settings for concurrency, with its names and meanings.
    twin_settings = (
        Setting(
            "paged",
            (str, bool),
            "auto",
            'paged attention for concurrent jobs: "auto" (where flash-attn 2 runs: sm_80 and later), true or false',
            choices=("auto", True, False),
        ),
        Setting(
            "unpaged_parallel",
            str,
            "queue",
            'how parallel > 1 runs without paged attention: "queue" '
            '(one job at a time, as TabbyAPI serves them) or "batched" (offline batched passes)',
            choices=UNPAGED_CHOICES,
        ),
    )

    def generator(self, twin: Any, config: TrialConfig, ctx: StudyContext) -> GeneratorSettings:
        """The real backend's generator for this trial on this card (:func:`settings_on`)."""
        return settings_on(
            ctx.gpu,
            config.option("cache_type", "fp16"),
            config.ctx,
            config.parallel,
            twin.setting(ctx, "paged"),
            twin.setting(ctx, "unpaged_parallel"),
        )

    def jobs_at_once(self, gpu: GpuSpec, cache: str, ctx: int, parallel: int, unpaged_parallel: str) -> int:
        """Sequences the generator holds together on ``gpu`` (the fit's evidence rows ask it)."""
        return settings_on(gpu, cache, ctx, parallel, "auto", unpaged_parallel).jobs_at_once

    def memory(self, s: Any, k: Any) -> MemoryEstimate:
        """A cache of ``ctx`` cells per sequence it holds at once (no padding), the chunk's
        scratch, and the context/allocator overhead row 2 of the article measured (``context_bytes``)."""
        weights_gpu, host, notes = weights_on_gpu(s, k)
        seqs = min(s.jobs_at_once or s.parallel, s.parallel)
        if seqs < s.parallel:
            notes.append(
                f"cache of {seqs} sequence: unpaged, ExLlamaV2 serves the {s.parallel} streams {seqs} at a time"
            )
        cache = resolve_cache_type(s.cache_type, self.kv_cache_types) or s.cache_type
        kv = int(SlotLayout().cells(s.ctx, seqs) * kv_bytes_per_token(s.model, cache))
        kv += cache_fixed_bytes(s.model, cache, s.ctx * seqs)
        return MemoryEstimate(
            weights_bytes=weights_gpu,
            kv_bytes=kv,
            buffers_bytes=buffer_bytes(s),
            overhead_bytes=int(k.context_bytes),
            host_bytes=host,
            notes=tuple(notes),
        )

    def scenario(self, twin: Any, s: Any, config: TrialConfig, ctx: StudyContext) -> Any:
        return replace(s, jobs_at_once=self.generator(twin, config, ctx).jobs_at_once)

    def attention_path(self, config: TrialConfig, ctx: StudyContext) -> str:
        if not config.option("flash_attn", True):
            return "matmul"
        # flash-attn 2 needs sm_80; before that ExLlamaV2 falls back to SDPA/xformers, which
        # is still fused (no scores over the allocated cache).
        return "flash_attn" if ctx.gpu.compute_capability_tuple >= FLASH_ATTN2_MIN_CC else "sdpa"

    def default_launch(self, twin: Any, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        """ExLlamaV2's defaults, as the real backend's ``default_launch``: an FP16 cache of the
        model's own context, one sequence."""
        config = TrialConfig(
            twin.name, weights, ctx.model.max_context, 1, (("cache_type", "fp16"), ("flash_attn", True))
        )
        return DefaultLaunch(
            config,
            (
                f"predicted for ExLlamaV2's defaults: FP16 cache of the model's own {ctx.model.max_context} tokens "
                "(max_seq_len from config.json), one sequence at a time; one user"
            ),
        )

    def deploy_command(self, twin: Any, config: TrialConfig, ctx: StudyContext) -> str:
        """The real backend's deploy line (:func:`.backend.deploy_for`) for the generator predicted:
        TabbyAPI with every job at once, TabbyAPI one job at a time, or an offline batch job (with
        what TabbyAPI would give instead: one request's decode and aggregate)."""
        _, bpw = parse_format(twin.as_format(config.weights, ctx), self.weight_formats)
        path = twin.weights_file(config.weights, ctx) or Path("models") / f"{ctx.model.key}-exl2-{bpw}bpw"
        generator = self.generator(twin, config, ctx)
        alone = None
        if generator.mode == "batched":  # no server gives this: say what the one that exists gives
            one = twin.predictor.predict(replace(config, parallel=1), ctx)
            alone = None if one is None else (one["decode_tok_s"], one["aggregate_tok_s"])
        gpu = ctx.gpu
        why = f"flash-attn 2 needs sm_80, the {gpu.name} is sm_{gpu.compute_capability.replace('.', '')}"
        return deploy_for(
            generator, path, generator.max_batch_size, why_unpaged=why, found="predicted", served_alone=alone
        )

    def directory_format(self, directory: Any, check: bool = False) -> str | None:
        exl2 = exl2_quantization(directory.config, directory.path / "config.json")
        if exl2 is None:
            return None
        if check and not EXL2_BPW_MIN <= exl2.bits <= EXL2_BPW_MAX:
            raise ConfigError(
                f"{directory.path / 'config.json'}: quantization_config.bits = {exl2.bits}: the twin "
                f"knows EXL2 at {EXL2_BPW_MIN}-{EXL2_BPW_MAX} bits per weight"
            )
        return f"exl2:{round(exl2.bits, 2)}"


EXLLAMAV2 = ExLlamaV2Model()
