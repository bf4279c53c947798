"""vLLM as one engine model (:class:`autotune.engine.model.EngineModel`), which openai-server
serves through its shipped template and the twin of vLLM predicts: its ``--kv-cache-dtype``
values (:mod:`.declarations`), the share of the card it reserves (its memory model), its
refusals by card and release, and its physics constants (``engine_model.toml``).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from autotune.api import (
    BackendError,
    EngineModel,
    MemoryEstimate,
    Setting,
    StudyContext,
    TrialConfig,
    WeightFormats,
    deploy_line,
)
from autotune._builtin import (
    SlotLayout,
    UnsupportedError,
    engine_model,
    kv_cache_bytes,
    normalize_format,
    resolve_cache_type,
)
from autotune_plugins.openai_server import declarations
from autotune_plugins.shared.scenario import FLASH_ATTN2_MIN_CC, GiB, VLLM_GPU_MEMORY_UTILIZATION, weights_on_gpu

__all__ = ["VLLM", "VllmModel"]

# vLLM's KV blocks (--block-size, 16 tokens on CUDA).
VLLM_BLOCK_TOKENS = 16


def card_share(value: float) -> str | None:
    return None if 0 < value <= 1 else "must be > 0 and <= 1 (a share of the card's memory)"


def _version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".") if p.isdigit())


class VllmModel(EngineModel):
    name = "vllm"
    kv_cache_types = declarations.CACHE_TYPES
    cache_types = ("auto", "fp8")
    default_cache = "auto"
    twin_name = "twin-vllm"
    twin_class = "TwinVllm"
    twin_description = "digital twin of vLLM (physics, no GPU needed); refuses Volta as recent vLLM does"
    artifacts = ("hf", "gguf")
    artifact_words = {"hf": ("a Hugging Face directory", "Hugging Face directories (config.json and *.safetensors)")}
    constants_file = Path(__file__).with_name("engine_model.toml")
    twin_settings = (
        Setting("version", str, "0.11", "the vLLM release to answer like (0.6 and later refuse Volta)"),
        Setting(
            "gpu_memory_utilization",
            float,
            VLLM_GPU_MEMORY_UTILIZATION,
            "the share of the card vLLM reserves (--gpu-memory-utilization): its memory footprint",
            check=card_share,
        ),
    )

    @property
    def weight_formats(self) -> tuple[WeightFormats, ...]:  # type: ignore[override]
        """GGUF files, as the llama.cpp engine model declares them (looked up, not copied)."""
        return engine_model("llama.cpp").weight_formats

    def memory(self, s: Any, k: Any) -> MemoryEstimate:
        """vLLM reserves ``gpu_memory_utilization`` of the card at start-up, whatever the configuration
        needs: weights, its runtime (CUDA context, the profiling run's activations, CUDA graphs:
        ``context_bytes``) and a KV pool of ``VLLM_BLOCK_TOKENS``-token blocks that fills the rest.
        The footprint is that share; a configuration whose weights, runtime and KV of ``ctx x
        parallel`` tokens exceed it does not start (``load_failure``), and its estimate says by how much."""
        weights_gpu, host, notes = weights_on_gpu(s, k)
        cache = resolve_cache_type(s.cache_type, self.kv_cache_types) or s.cache_type
        kv, _, how = kv_cache_bytes(s.model, cache, s.ctx, s.parallel, SlotLayout(pad=VLLM_BLOCK_TOKENS))
        runtime = int(k.context_bytes)
        share = int(s.gpu_memory_utilization * s.gpu.vram_bytes)
        pool = max(kv, share - weights_gpu - runtime)
        notes.append(
            f"vLLM reserves gpu_memory_utilization {s.gpu_memory_utilization:g} of the card "
            f"({share / GiB:.2f} GiB); KV of {how}: {kv / GiB:.2f} GiB, the pool {pool / GiB:.2f} GiB"
        )
        return MemoryEstimate(
            weights_bytes=weights_gpu,
            kv_bytes=pool,
            buffers_bytes=0,
            overhead_bytes=runtime,
            host_bytes=host,
            notes=tuple(notes),
        )

    def scenario(self, twin: Any, s: Any, config: TrialConfig, ctx: StudyContext) -> Any:
        return replace(s, gpu_memory_utilization=float(twin.setting(ctx, "gpu_memory_utilization")))

    def load_failure(self, twin: Any, config: TrialConfig, ctx: StudyContext, mem: MemoryEstimate) -> None:
        """vLLM fails at start-up when weights, runtime and the KV of ``ctx x parallel`` tokens
        exceed its share of the card (:meth:`memory` then estimates more than the share)."""
        share = float(twin.setting(ctx, "gpu_memory_utilization"))
        if mem.total_bytes > int(share * ctx.gpu.vram_bytes):
            raise BackendError(
                f"ValueError: needs {mem.total_bytes / 2**30:.2f} GiB, more than gpu_memory_utilization "
                f"{share:g} of the card ({share * ctx.gpu.vram_bytes / 2**30:.2f} GiB): try increasing "
                "`gpu_memory_utilization` or decreasing `max_model_len` (vLLM's advice)"
            )

    def refuse(self, twin: Any, config: TrialConfig, ctx: StudyContext) -> None:
        cc = ctx.gpu.compute_capability_tuple
        version = str(twin.setting(ctx, "version"))
        if cc < (7, 0) or (cc < (7, 5) and _version_tuple(version) >= (0, 6)):
            raise UnsupportedError(
                f"vLLM {version} does not support compute capability {ctx.gpu.compute_capability} "
                f"({ctx.gpu.name}); the last releases for Volta are 0.5.x with CUDA 11.8"
            )
        if (
            normalize_format(twin.as_format(config.weights, ctx), self.weight_formats) == "gguf:BF16"
            and not ctx.gpu.bf16
        ):
            # The article's pitfall 2: BF16 weights on a card without BF16 (vLLM's own words).
            raise UnsupportedError(
                f"Bfloat16 is only supported on GPUs with compute capability of at least 8.0. Your "
                f"{ctx.gpu.name} GPU has compute capability {ctx.gpu.compute_capability}. You can use "
                "float16 instead by explicitly setting the `dtype` flag in CLI, for example: --dtype=half."
            )
        if config.option("flash_attn", True) and cc < FLASH_ATTN2_MIN_CC:
            raise UnsupportedError("Cannot use FlashAttention-2 backend for Volta and Turing GPUs.")
        if config.option("cache_type", "auto").startswith("fp8") and cc < (8, 9):
            raise UnsupportedError(
                f"fp8 KV cache needs compute capability 8.9, {ctx.gpu.name} has {ctx.gpu.compute_capability}"
            )

    def deploy_command(self, twin: Any, config: TrialConfig, ctx: StudyContext) -> str:
        model = twin.weights_file(config.weights, ctx) or ctx.model.key
        return deploy_line(
            [
                "vllm",
                "serve",
                model,
                "--max-model-len",
                config.ctx,
                "--max-num-seqs",
                config.parallel,
                "--kv-cache-dtype",
                config.option("cache_type", "auto"),
                "--dtype",
                "half",
                "--gpu-memory-utilization",
                f"{float(twin.setting(ctx, 'gpu_memory_utilization')):g}",
            ]
        )


VLLM = VllmModel()
