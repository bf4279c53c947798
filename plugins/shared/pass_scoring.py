"""Where the exllama workers split a scored text into forward passes (both engines write a
pass's keys and values to the cache afterwards, so a quantized cache shows only in a later pass)."""

from __future__ import annotations

from typing import Sequence

__all__ = ["SCORE_CHUNK", "score_passes"]


#: Tokens per forward pass when scoring a whole text (next_token_logprobs).
SCORE_CHUNK = 64


def score_passes(n_tokens: int, starts: Sequence[int]) -> list[tuple[int, int]]:
    """``[begin, end)`` of the forward passes that score ``n_tokens`` tokens.

    ExLlamaV2 attends over a pass's own keys and values in FP16 and writes them to the cache
    afterwards; only a later pass reads them back through a quantized cache (Q8/Q6/Q4). One
    pass over everything would hide the cache's damage (on the H200, Q4 and FP16 caches gave
    identical distributions that way), so scoring splits the tokens where a server would:
    a prompt, then what is decoded after it.

    Args:
        n_tokens: Tokens to score, >= 1.
        starts: Where passes begin; 0 is implied, values outside ``(0, n_tokens)`` are ignored.
    """
    cuts = sorted({0, *(int(s) for s in starts if 0 < int(s) < n_tokens)})
    return [(b, e) for b, e in zip(cuts, cuts[1:] + [n_tokens])]
