"""Quality through an OpenAI-compatible server's log-probabilities (``/v1/completions``).

Two ways an engine can answer, as its template says (``[api] logprobs``):

* ``echo``: the prompt's own log-probabilities come back with ``echo = true`` (vLLM, SGLang):
  one request scores a whole continuation; the top alternatives are top-k only, so whole
  next-token distributions (the KL-divergence proxy) are refused;
* ``next_token``: the server returns the next token's distribution, up to the whole vocabulary
  (llama-server's ``logprobs`` = ``n_probs``): each scored position is one request with the
  prefix as the prompt and one token to generate; with ``logprobs`` = the vocabulary this is
  the exact distribution, so every quality metric works, one request per token;
* ``none``: the scorer refuses to open, with the template's reason.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from autotune.api import AutotuneError, TrialConfig
from autotune._builtin import LogLikelihood, Scorer, ScoringError, ScoringUnsupportedError, has_gpu

if TYPE_CHECKING:  # pragma: no cover
    from autotune.api import StudyContext
    from autotune_plugins.openai_server.backend import OpenAIServerBackend

__all__ = ["OpenAIServerScorer"]


class OpenAIServerScorer(Scorer):
    """A server started from the study's template, one slot, for scoring one artifact.

    Args:
        backend: The openai-server backend (its template, settings and command rendering).
        weights: The artifact.
        cache_type: KV-cache type (a key of the template's ``[cache_type]``), or None.
        ctx: The study context.
    """

    def __init__(self, backend: "OpenAIServerBackend", weights: str, cache_type: str | None, ctx: "StudyContext"):
        try:
            t = backend.template(ctx)
        except AutotuneError as exc:
            raise ScoringError(str(exc)) from None
        if t.logprobs == "none":
            why = t.logprobs_note or "its engine returns no prompt log-probabilities"
            raise ScoringUnsupportedError(f"template {t.name} cannot score: {why} ({t.source} [api] logprobs = none)")
        self.template = t
        self.n_vocab = int(ctx.model.vocab_size)
        self.n_ctx = min(int(backend.value(ctx, "scoring_ctx")), int(ctx.model.max_context))
        options: dict[str, Any] = {}
        if cache_type is not None:
            options["cache_type"] = cache_type
        if True in t.flash_attn:
            options["flash_attn"] = True
        config = TrialConfig(backend.name, weights, self.n_ctx, 1, tuple(sorted(options.items())))
        reasons = backend.check(config, ctx)
        if reasons:
            raise ScoringError(f"{weights} with cache {cache_type}: " + "; ".join(reasons))
        self.description = f"{weights} (KV cache {cache_type or 'default'}, template {t.name}, /v1/completions)"
        self._server = backend.launch(config, ctx, has_gpu=has_gpu(), t=t)
        try:
            self._server.wait_ready(t.ready, backend.startup_timeout(ctx, t))
            self._model = self._server.served_model()
        except BaseException:
            self._server.close()
            raise

    # ------------------------------------------------------------------ requests

    def _complete(self, body: Mapping[str, Any]) -> Mapping[str, Any]:
        payload = {"max_tokens": 1, "temperature": 0, **body}
        if self._model:
            payload["model"] = self._model
        response = self._server.post("/v1/completions", payload, 600)
        try:
            return response["choices"][0]["logprobs"] or {}
        except (KeyError, IndexError, TypeError):
            raise ScoringError(
                f"template {self.template.name}: /v1/completions gave no logprobs: {str(response)[:200]}"
            ) from None

    def _next(self, prefix: Sequence[int], k: int) -> dict[int, float]:
        """Log-probabilities of the next token's top ``k`` candidates by token id."""
        lp = self._complete({"prompt": list(prefix), "logprobs": k})
        content = lp.get("content")
        if not content:
            raise ScoringError(
                f"template {self.template.name}: logprobs without 'content' (per-token entries with ids)"
            )
        top = content[0].get("top_logprobs") or []
        if top and "id" not in top[0]:
            raise ScoringUnsupportedError(
                f"template {self.template.name}: the server's top log-probabilities carry "
                "no token ids, so a given token cannot be looked up"
            )
        return {int(e["id"]): float(e["logprob"]) for e in top}

    # ------------------------------------------------------------------ the Scorer API

    def tokenize(self, text: str, *, add_bos: bool = False) -> list[int]:
        t = self.template
        if not t.tokenize:
            raise ScoringUnsupportedError(f"template {t.name} names no tokenize path ([api] tokenize)")
        body: dict[str, Any] = {t.tokenize_field: text}
        if t.tokenize_add_special:
            body[t.tokenize_add_special] = add_bos
        data = self._server.post(t.tokenize, body, 60)
        raw = data.get("tokens") if isinstance(data, dict) else data
        return [tok if isinstance(tok, int) else int(tok["id"]) for tok in raw or ()]

    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[LogLikelihood]:
        out = []
        for context, continuation in requests:
            whole, start = self.split(context, continuation)
            if self.template.logprobs == "echo":
                out.append(self._echo(whole, start))
                continue
            total, greedy = 0.0, True
            for pos in range(start, len(whole)):
                dist = self._next(whole[:pos], self.n_vocab)
                target = whole[pos]
                if target not in dist:
                    raise ScoringError(
                        f"template {self.template.name}: token {target} is not among the "
                        f"{len(dist)} log-probabilities the server returned"
                    )
                total += dist[target]
                greedy = greedy and max(dist, key=dist.__getitem__) == target
            out.append(LogLikelihood(total, greedy, len(whole) - start))
        return out

    def _echo(self, whole: Sequence[int], start: int) -> LogLikelihood:
        lp = self._complete({"prompt": list(whole), "echo": True, "logprobs": 1})
        values = lp.get("token_logprobs")
        tokens = lp.get("tokens")
        tops = lp.get("top_logprobs") or []
        if not isinstance(values, list) or len(values) < len(whole):
            raise ScoringError(
                f"template {self.template.name}: echo returned {len(values or [])} prompt "
                f"log-probabilities for {len(whole)} tokens"
            )
        picked = values[start : len(whole)]
        if any(v is None for v in picked):
            raise ScoringError(
                f"template {self.template.name}: echo left a continuation token without a log-probability"
            )
        greedy = True
        for i in range(start, len(whole)):
            top = tops[i] if i < len(tops) and isinstance(tops[i], dict) else None
            if not top or tokens is None:
                greedy = False
                break
            greedy = greedy and max(top, key=top.__getitem__) == tokens[i]
        return LogLikelihood(float(sum(picked)), greedy, len(whole) - start)

    def next_token_logprobs(self, tokens: Sequence[int]) -> np.ndarray:
        if self.template.logprobs != "next_token":
            raise ScoringUnsupportedError(
                f"template {self.template.name}: its engine returns top-k log-probabilities "
                "only, not whole next-token distributions"
            )
        if len(tokens) > self.n_ctx:
            raise ScoringError(f"{len(tokens)} tokens do not fit the scorer's context of {self.n_ctx}")
        rows = np.full((len(tokens), self.n_vocab), -math.inf, dtype=np.float32)
        for i in range(len(tokens)):
            dist = self._next(tokens[: i + 1], self.n_vocab)
            if len(dist) < self.n_vocab:
                raise ScoringUnsupportedError(
                    f"template {self.template.name}: the server returned {len(dist)} of "
                    f"{self.n_vocab} log-probabilities; a whole distribution is needed"
                )
            for tok, value in dist.items():
                if 0 <= tok < self.n_vocab:
                    rows[i, tok] = value
        return rows

    def close(self) -> None:
        server, self._server = getattr(self, "_server", None), None
        if server is not None:
            server.close()
