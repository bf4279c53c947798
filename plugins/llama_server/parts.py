"""The llama-server backend's optional parts (:mod:`autotune.engine.parts`): GGUF weights made
on demand, the split across cards and the offload to the host, and scoring through
llama-cpp-python on the same build. Each reaches the backend that declares it as ``self.backend``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from autotune._builtin import Scoring, Splitting, is_format
from autotune.api import ArtifactMaker, StudyContext
from autotune_plugins.llama_server import split

__all__ = ["LlamaArtifacts", "LlamaScoring", "LlamaSplitting"]


class LlamaArtifacts(ArtifactMaker):
    def recipe(self, fmt: str, source: Path, ctx: StudyContext):
        """GGUF formats from an HF directory or a full-precision GGUF (:mod:`.recipes`)."""
        from autotune_plugins.llama_server.recipes import gguf_recipe

        b = self.backend
        return gguf_recipe(fmt, source, b.resolved_settings(ctx), lambda: b.binary(ctx))


class LlamaSplitting(Splitting):
    def placement_space(self, ctx: StudyContext) -> dict[str, list[Any]]:
        return split.space(ctx, cuda=self.backend._on_gpu(ctx))

    def offload_space(self, weights: str, ctx: StudyContext) -> dict[str, list[Any]]:
        """What ``autotune init`` may search when ``weights`` do not fit whole: for a mixture of
        experts first ``n_cpu_moe`` (its experts are most of its bytes and least of its reads per
        token: 4.4x decode lost with every expert on the host, against 19x for every dense layer,
        bench/results/offload_probe_h200), then ``gpu_layers`` from every layer down to none, in
        about 8 steps (the judge keeps those that fit the card and host memory); each starts with
        the value that splits nothing (0, "all")."""
        # A format has the source's shape, made or not (and without asking for the engine).
        model = ctx.model if is_format(weights, self.backend.weight_formats) else self.backend._model_for(weights, ctx)
        n = model.n_layers
        step = max(1, n // 8)
        layers = ["all", *sorted({*range(n, 0, -step), 0}, reverse=True)]
        if model.is_moe:
            return {"n_cpu_moe": sorted({0, *range(step, n, step), n}), "gpu_layers": layers}
        return {"gpu_layers": layers}


class LlamaScoring(Scoring):
    def problem(self) -> str | None:
        """The scorer runs in-process through llama-cpp-python: is it installed?"""
        from autotune_plugins.llama_server.python_bindings import bindings_missing

        return bindings_missing()

    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext):
        """Log-likelihoods of ``weights`` through llama-cpp-python on this engine's build."""
        from autotune_plugins.llama_server.scoring import LlamaCppScorer

        b = self.backend
        return LlamaCppScorer(b.weights_path(weights, ctx), cache_type, b.resolved_settings(ctx))
