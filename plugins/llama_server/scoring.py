"""Scoring GGUF artifacts in process with llama-cpp-python, on autotune's own llama.cpp build.

The server is not used for quality: llama-server's completion log-probabilities are top-n of
the sampled token, not the log-likelihood of a given continuation nor whole distributions.
llama-cpp-python (ctypes over the engine build's ``libllama.so``, imported through
``engine.import_llama_cpp``) evaluates a token sequence and returns every position's logits
(``logits_all``), which is all :class:`autotune.engine.scoring.Scorer` needs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from autotune.api import AutotuneError
from autotune._builtin import LogLikelihood, Scorer, ScoringError

__all__ = ["LlamaCppScorer", "GGML_CACHE_TYPES", "log_softmax"]

# llama.cpp's KV-cache type names (-ctk/-ctv) -> ggml type ids (ggml.h enum ggml_type), which
# llama-cpp-python takes as type_k / type_v.
GGML_CACHE_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "iq4_nl": 20, "bf16": 30}
# Default context of a scorer: MMLU 5-shot prompts reach ~1,500 tokens on a 32k vocabulary and
# C-Eval's Chinese falls back to bytes on small vocabularies; logits_all keeps n_ctx x n_vocab
# float32 scores, so the window is bounded (setting ``scoring_ctx``).
DEFAULT_SCORING_CTX = 2048


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise natural-log softmax, computed in float64 so that tiny tails are not lost."""
    x = logits.astype(np.float64, copy=False)
    shifted = x - x.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


class LlamaCppScorer(Scorer):
    """One GGUF file loaded in process for scoring.

    Args:
        path: The GGUF file.
        cache_type: KV-cache type (``f16``, ``q8_0``, ``q4_0``...); None is f16.
        settings: The backend's settings with their declared defaults filled in
            (``LlamaServerBackend.resolved_settings``): ``threads``, ``gpu_layers`` ("all" or a
            number), ``scoring_ctx``, ``binary`` (pins the engine build). A key left out
            means the engine's own default.
    """

    def __init__(
        self, path: str | os.PathLike[str], cache_type: str | None = None, settings: Mapping[str, Any] | None = None
    ):
        from autotune_plugins.llama_server import engine

        settings = settings or {}
        cache = cache_type or "f16"
        if cache not in GGML_CACHE_TYPES:
            raise ScoringError(f"cache_type {cache!r}: llama.cpp scoring knows {', '.join(GGML_CACHE_TYPES)}")
        path = Path(path)
        if not path.is_file():
            raise ScoringError(f"{path}: no such GGUF file")
        try:
            llama_cpp = engine.import_llama_cpp(settings)
        except AutotuneError as exc:
            raise ScoringError(str(exc)) from None
        gpu_layers = settings.get("gpu_layers")
        n_ctx = int(settings.get("scoring_ctx") or DEFAULT_SCORING_CTX)
        kwargs: dict[str, Any] = dict(
            model_path=str(path),
            n_ctx=n_ctx,
            logits_all=True,
            verbose=False,
            n_gpu_layers=-1 if gpu_layers in ("all", None) else int(gpu_layers),
            type_k=GGML_CACHE_TYPES[cache],
            type_v=GGML_CACHE_TYPES[cache],
            # llama.cpp needs flash attention for a quantized V cache (the backend's own rule);
            # otherwise unfused, which scored C-Eval 2.5x faster on a 2-core CPU (measured).
            flash_attn=cache not in ("f16", "f32", "bf16"),
        )
        if settings.get("threads"):
            kwargs["n_threads"] = kwargs["n_threads_batch"] = int(settings["threads"])
        try:
            self._llm = llama_cpp.Llama(**kwargs)
        except (ValueError, RuntimeError, OSError) as exc:
            raise ScoringError(f"llama.cpp could not load {path.name} with cache {cache} for scoring: {exc}") from None
        self.n_vocab = int(self._llm.n_vocab())
        self.n_ctx = int(self._llm.n_ctx())
        self.description = f"{path.name} (KV cache {cache}, llama.cpp in process)"

    # ------------------------------------------------------------------ evaluation

    def _evaluate(self, tokens: Sequence[int]) -> np.ndarray:
        """Logits after every prefix of ``tokens``, reusing the common prefix already in the cache.

        The four answers of a multiple-choice question share their context; re-evaluating only
        the differing tail makes a question cost about one prompt, not four.
        """
        llm = self._llm
        done = llm.input_ids[: llm.n_tokens]
        common = 0
        limit = min(len(done), len(tokens) - 1)  # always evaluate at least the last token
        while common < limit and done[common] == tokens[common]:
            common += 1
        llm.n_tokens = common
        llm.eval(list(tokens[common:]))
        return llm.scores[: len(tokens)]

    def tokenize(self, text: str, *, add_bos: bool = False) -> list[int]:
        return list(self._llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=False))

    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[LogLikelihood]:
        out = []
        for context, continuation in requests:
            whole, start = self.split(context, continuation)
            cont = whole[start:]
            logits = self._evaluate(whole)
            rows = log_softmax(logits[start - 1 : len(whole) - 1])
            picked = rows[np.arange(len(cont)), cont]
            greedy = bool(np.all(rows.argmax(axis=-1) == np.asarray(cont)))
            out.append(LogLikelihood(float(picked.sum()), greedy, len(cont)))
        return out

    def next_token_logprobs(self, tokens: Sequence[int]) -> np.ndarray:
        if not tokens:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        if len(tokens) > self.n_ctx:
            raise ScoringError(f"{len(tokens)} tokens do not fit the scorer's context of {self.n_ctx}")
        self._llm.n_tokens = 0  # a fresh sequence: KLD compares whole windows from an empty cache
        self._llm.eval(list(tokens))
        return log_softmax(self._llm.scores[: len(tokens)]).astype(np.float32)

    def close(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.close()
