"""exllamav3's paged cache layout, which its plugin's generator and TabbyAPI behind openai-server
(its ``cache_size``) both size: pages of 256 tokens, a job reserving its context plus one token."""

from __future__ import annotations

__all__ = ["PAGE_SIZE", "pad_to_page", "pages_per_job"]

PAGE_SIZE = 256  # exllamav3/constants.py


def pad_to_page(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


def pages_per_job(ctx: int) -> int:
    """Pages one job of ``ctx`` tokens (prompt + output) reserves: ceil((ctx + 1) / 256)."""
    return -(-(ctx + 1) // PAGE_SIZE)
