"""The text every backend's load is made of, and how it is cut to the workload's length.

Real text rather than random tokens: an engine tokenizes and attends to it as it would a user's
prompt. It is repeated, then trimmed, to the study's ``prompt_tokens``; each request changes its
first token so that no server answers it from a cached prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["PROMPT_TEXT", "prompt_of", "varied"]

PROMPT_TEXT = (
    "Once upon a time, in a small town by the sea, there lived an old clockmaker who repaired "
    "every watch the fishermen brought him. Each morning he opened his shop, swept the floor, "
    "and listened to the ticking of a hundred clocks. One day a girl came in with a broken "
    "compass and asked him whether he could make it point home again. He smiled, took out his "
    "smallest screwdriver, and began to explain how the needle feels the pull of the earth. "
)


def prompt_of(base: Sequence[int], n: int) -> list[int]:
    """``base`` (the tokens of :data:`PROMPT_TEXT`) repeated and cut to ``n`` tokens (at least 1)."""
    if not base:
        raise ValueError("no tokens to build a prompt from")
    tokens: list[int] = []
    while len(tokens) < n:
        tokens += base
    return tokens[:max(1, n)]


def varied(prompt: Sequence[int], i: int) -> list[int]:
    """Request ``i``'s prompt: a different first token, so that a server cannot reuse a cached prefix."""
    return [prompt[(i * 7) % len(prompt)], *prompt[1:]] if len(prompt) > 1 else list(prompt)
