"""The text every backend's load is made of, and how it is cut to the workload's length.

Real text rather than random tokens: an engine tokenizes and attends to it as it would a user's
prompt. It is repeated, then trimmed, to the study's ``prompt_tokens``; each request changes its
first tokens so that no server answers it from a cached prefix.
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
    return tokens[: max(1, n)]


# Request numbers a prompt's first tokens tell apart: the digits of ``i`` in base ``n`` (the
# prompt's distinct tokens), this many of them.
VARIED_TOKENS = 3


def varied(prompt: Sequence[int], i: int) -> list[int]:
    """Request ``i``'s prompt: its first tokens spell ``i`` in the prompt's own distinct tokens, so
    that no two requests of a launch share a first token sequence and no server answers one from
    a cached prefix. (One first token picked by position repeated: real text repeats its
    tokens, and a peer check against aiperf found requests answered from llama-server's cache.)"""
    if len(prompt) <= 1:
        return list(prompt)
    alphabet = sorted(set(prompt))
    n, digits = len(alphabet), min(VARIED_TOKENS, len(prompt) - 1)
    head = [alphabet[(i // n**d) % n] for d in range(digits)]
    return [*head, *prompt[digits:]]
