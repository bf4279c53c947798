"""Log-probabilities from exllamav3's forward pass, for the quality metrics (``autotune.engine.scoring``):
the KL divergence against the full-precision model (``kld``, in nats as for GGUF) and MMLU /
C-Eval log-likelihoods, so that a study over EXL3 bits trades speed against quality.

As for ExLlamaV2, the model runs in a worker process, not in autotune's (torch and exllamav3
stay out of autotune, a CUDA failure ends the scorer and not the study, ``close()`` frees
every byte of VRAM by ending the process), loaded with the artifact's cache type; the worker's
side is :mod:`.worker_scoring`. The requests and replies are ExLlamaV2's worker's, so the
parent's side is ExLlamaV2's scorer; only opening one differs (exllamav3's settings and
generator settings).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.api import BackendError, StudyContext
from autotune._builtin import ConfigError, ScoringError

from autotune_plugins.shared.worker_scorer import WorkerScorer
from autotune_plugins.exllamav3.generator_settings import generator_settings

if TYPE_CHECKING:  # pragma: no cover
    from autotune_plugins.exllamav3.backend import ExLlamaV3Backend

__all__ = ["ExLlamaV3Scorer"]


class ExLlamaV3Scorer(WorkerScorer):
    """A :class:`~autotune.engine.scoring.Scorer` over one exllamav3 worker that holds the model."""

    @classmethod
    def open(
        cls,
        backend: "ExLlamaV3Backend",
        weights: str,
        cache_type: str,  # type: ignore[override]
        ctx: StudyContext,
    ) -> "ExLlamaV3Scorer":
        """Start a worker and load ``weights`` with a ``cache_type`` cache of ``scoring_ctx`` tokens
        (at most the model's context), prefilling in the backend's ``chunk_size``.

        Raises:
            ScoringError: The weights or the cache type are unusable, or the worker could not load them.
        """
        problem = backend.check_weights(weights, ctx)
        if problem:
            raise ScoringError(problem)
        path = backend.weights_path(weights, ctx)
        model = backend._model_of(path)
        n_ctx = min(int(backend.setting(ctx, "scoring_ctx")), model.max_context)
        try:
            # One sequence scored by forward passes: a cache of one job's pages, no generator.
            settings = generator_settings(cache_type, n_ctx, 1, backend.setting(ctx, "chunk_size"))
        except ConfigError as exc:
            raise ScoringError(f"exllamav3 scorer for {path}: {exc}") from None
        tmp = Path(tempfile.mkdtemp(prefix="autotune-exllamav3-score-"))
        try:
            worker = backend.start_worker(ctx, tmp)
            try:
                backend.load(worker, path, settings, ctx, purpose="score")
            except BaseException:
                worker.stop()
                raise
        except BackendError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ScoringError(f"exllamav3 scorer for {path}: {exc}") from exc
        return cls(
            worker,
            tmp,
            model.vocab_size,
            settings.max_seq_len,
            f"{path.name} (exllamav3, cache {settings.cache_type})",
            float(backend.setting(ctx, "request_timeout_s")),
        )
