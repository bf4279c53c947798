"""What a scoring API is: how quality metrics read log-probabilities from a backend's engine.

Quality metrics (MMLU and C-Eval through lm-eval, the KL-divergence proxy) never talk to an
engine themselves. They ask the backend for a :class:`Scorer` on one artifact
(``backend.scoring.scorer(weights, cache_type, ctx)``, :class:`autotune.engine.parts.Scoring`) and use only the methods below, so any
backend plugin that implements this small protocol gets every quality metric for free.

Lifecycle: the metric opens a scorer with ``with backend.scoring.scorer(...) as scorer:``, calls
``tokenize``, ``loglikelihood`` and ``next_token_logprobs`` as often as it likes, and the
``with`` block's end calls ``close()``, which must free the engine (model memory, a worker
process, a server). A scorer is used from one thread at a time.

The contract is deliberately small and meant to stay stable; a backend that can only answer
some of it (a server that returns top-k log-probabilities, not whole distributions) raises
:class:`ScoringUnsupportedError` from the method it cannot serve, with the reason.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from autotune.errors import AutotuneError

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = ["LogLikelihood", "Scorer", "ScoringError", "ScoringUnsupportedError"]


class ScoringError(AutotuneError):
    """A scorer could not be opened or could not score (engine missing, file unreadable...)."""


class ScoringUnsupportedError(ScoringError):
    """The backend (or this one method of its scorer) has no scoring API."""


@dataclass(frozen=True)
class LogLikelihood:
    """The answer to one ``(context, continuation)`` request.

    Args:
        logprob: Sum of the natural-log probabilities of the continuation's tokens given the
            context (and the continuation tokens before each).
        is_greedy: Whether every continuation token is the arg-max of its distribution (what
            lm-eval calls ``is_greedy``; exact-match metrics use it).
        n_tokens: How many tokens the continuation was scored as.
    """

    logprob: float
    is_greedy: bool
    n_tokens: int


class Scorer(abc.ABC):
    """Log-probabilities of one loaded artifact (weights + KV-cache type). See the module docstring.

    Attributes:
        n_vocab: Size of the vocabulary (the width of ``next_token_logprobs``' rows).
        n_ctx: The most tokens one evaluation may hold (context + continuation, or one window
            of ``next_token_logprobs``); callers truncate or chunk to it.
        description: What is loaded, for records and messages (file name, type, cache).
    """

    n_vocab: int = 0
    n_ctx: int = 0
    description: str = ""

    @abc.abstractmethod
    def tokenize(self, text: str, *, add_bos: bool = False) -> list[int]:
        """The artifact's tokens for ``text``.

        Args:
            text: Plain text; no special-token parsing.
            add_bos: Prepend the beginning-of-sequence token when the model has one.
        """

    @abc.abstractmethod
    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[LogLikelihood]:
        """Score continuations, in order; a batch so that an engine can share work.

        The continuation's tokens are those that ``context + continuation`` (tokenized whole,
        with a beginning-of-sequence token) has after the context's own tokens, as lm-eval's
        adapters split them, so that an answer such as ``" B"`` gets the tokens it has in
        running text. When the total exceeds ``n_ctx``, the context is cut from the left.

        Args:
            requests: ``(context, continuation)`` pairs; the continuation is non-empty.

        Returns:
            One :class:`LogLikelihood` per request, in the same order.
        """

    def split(self, context: str, continuation: str) -> tuple[list[int], int]:
        """The tokens :meth:`loglikelihood` scores for one request, and where the continuation
        starts in them: split as lm-eval's adapters split (see :meth:`loglikelihood`)."""
        ctx_tokens = self.tokenize(context, add_bos=True)
        whole = self.tokenize(context + continuation, add_bos=True)
        cont = whole[len(ctx_tokens) :]
        if not cont:
            cont = self.tokenize(continuation)
            whole = ctx_tokens + cont
        if len(whole) > self.n_ctx:
            whole = whole[-self.n_ctx :]  # cut the context from the left, keep every answer token
        return whole, len(whole) - len(cont)

    @abc.abstractmethod
    def next_token_logprobs(self, tokens: Sequence[int]) -> "np.ndarray":
        """The full next-token distribution after every prefix of ``tokens``.

        Args:
            tokens: At most ``n_ctx`` token ids, evaluated as one sequence from an empty cache.

        Returns:
            A float array of shape ``(len(tokens), n_vocab)``: row ``i`` holds the natural-log
            probabilities (log-softmax) of the token following ``tokens[: i + 1]``.

        Raises:
            ScoringUnsupportedError: The engine can only return top-k log-probabilities.
        """

    def close(self) -> None:
        """Free the engine; called once, at the end of the ``with`` block. Idempotent."""

    def __enter__(self) -> "Scorer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
