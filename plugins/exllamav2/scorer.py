"""Log-probabilities from ExLlamaV2's forward pass, for the quality metrics (``autotune.engine.scoring``).

The model runs in a worker process, the same one trials use, not in autotune's process:
torch and exllamav2 stay out of autotune (CI and the study runner never import them), a
CUDA failure ends the scorer rather than the study, and ``close()`` frees every byte of VRAM
by ending the process. Scoring goes through a cache of the artifact's KV-cache mode, in more
than one forward pass (the continuation after its context; a text in chunks), because
ExLlamaV2 reads keys and values back through a quantized cache only in a later pass: in one
pass a Q4 cache scores exactly like FP16 (seen on the H200). Whole next-token distributions are
too large for a JSON line; the worker saves them as ``.npy`` files in a directory of ours.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from autotune.api import BackendError, StudyContext
from autotune._builtin import ScoringError

from autotune_plugins.exllamav2.generator_settings import generator_settings
from autotune_plugins.shared.worker_scorer import WorkerScorer

if TYPE_CHECKING:  # pragma: no cover
    from autotune_plugins.exllamav2.backend import ExLlamaV2Backend

__all__ = ["ExLlamaV2Scorer"]


class ExLlamaV2Scorer(WorkerScorer):
    """A :class:`~autotune.engine.scoring.Scorer` over one exllamav2 worker that holds the model."""

    @classmethod
    def open(cls, backend: "ExLlamaV2Backend", weights: str, cache_type: str, ctx: StudyContext) -> "ExLlamaV2Scorer":
        """Start a worker and load ``weights`` with a ``cache_type`` cache of ``scoring_ctx`` tokens.

        Raises:
            ScoringError: The weights are unusable or the worker could not load them.
        """
        problem = backend.check_weights(weights, ctx)
        if problem:
            raise ScoringError(problem)
        path = backend.weights_path(weights, ctx)
        model = backend._model_of(path)
        n_ctx = min(int(backend.setting(ctx, "scoring_ctx")), model.max_context)
        # One sequence scored by forward passes: no generator, so paging changes nothing.
        settings = generator_settings(cache_type, n_ctx, 1, paged=False)
        tmp = Path(tempfile.mkdtemp(prefix="autotune-exllamav2-score-"))
        try:
            worker = backend.start_worker(ctx, tmp)
            try:
                loaded = backend.load(worker, path, settings, ctx, purpose="score")
            except BaseException:
                worker.stop()
                raise
        except BackendError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ScoringError(f"exllamav2 scorer for {path}: {exc}") from exc
        return cls(
            worker,
            tmp,
            model.vocab_size,
            min(n_ctx, settings.cache_max_seq_len),
            f"{path.name} (exl2, cache {cache_type.upper()}, attention "
            f"{loaded.get('attention', {}).get('path', 'unknown')})",
            float(backend.setting(ctx, "request_timeout_s")),
        )
