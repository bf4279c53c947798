"""A trial's configuration -> what the worker allocates and how it generates (pure Python).

ExLlamaV2 0.3.2's dynamic generator (exllamav2/generator/dynamic.py) has two modes:

* **paged** (needs flash-attn >= 2.5.7: ``assert_paged_attn``): the cache is one row
  (``batch_size=1``) of ``max_seq_len`` tokens cut into 256-token pages; each job takes
  ``ceil(tokens / 256)`` pages, and up to ``max_batch_size`` jobs run together. To hold
  ``parallel`` sequences of ``ctx`` tokens each, the cache needs ``parallel x ceil(ctx/256)``
  pages: ``parallel x pad256(ctx)`` tokens (a total rounded once would be a page short, e.g.
  ctx 600 x 2 -> 1280 tokens = 5 pages, but two jobs of 600 tokens need 3 pages each).
* **unpaged** (``paged=False``, the fallback without flash-attn): ``page_size`` becomes the
  cache's whole ``max_seq_len`` and ``max_pages`` is 1, so exactly one job runs at a time,
  whatever ``max_batch_size`` says (the docstring: "the max supported batch size is 1").

Without paged attention a trial with ``parallel > 1`` can be measured two ways, chosen by
``[backends.exllamav2] unpaged_parallel``:

* ``"queue"`` (the default): the dynamic generator as a server runs it (TabbyAPI builds the
  same generator): all ``parallel`` jobs are enqueued at once and served one after another
  from a one-sequence cache. The aggregate is then about the single-stream rate and the
  later jobs wait; that is what the deploy command would deliver on that machine, so a study
  never picks a concurrency the deployed server cannot give.
* ``"batched"``: one batched forward pass over a cache of ``batch_size = parallel`` rows of
  ``pad256(ctx)`` tokens (``mode = "batched"``), every stream prefilled and decoded together.
  That is what the engine's kernels can do for offline batch work (ExLlamaV2's base
  generator with a list of prompts), not what an OpenAI-compatible server serves; the deploy
  line is then that batch job, not TabbyAPI (``backend.deploy_for``). It is how ExLlamaV2 ran
  the article's 4 streams on a V100 (64 tok/s, its row 5), a card without flash-attn 2.

Every trial records the mode and ``jobs_at_once``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune._builtin import ConfigError
from autotune_plugins.shared.generator_record import SettingsRecord

__all__ = [
    "CACHE_CHOICES",
    "PAGE_SIZE",
    "UNPAGED_CHOICES",
    "GeneratorSettings",
    "SettingsRecord",
    "generator_settings",
    "normalize_cache_type",
]

PAGE_SIZE = 256  # exllamav2/generator/dynamic.py PAGED_PAGE_SIZE
MAX_Q_SIZE = 8  # the dynamic generator's default max_q_size (tokens per sequence per step)
#: ExLlamaV2 cache modes as TabbyAPI and the examples name them (lower case in autotune, like
#: the names plugins/exllamav2/declarations.py declares).
CACHE_CHOICES = ("fp16", "q8", "q6", "q4")
#: How ``parallel > 1`` runs without paged attention (see the module's docstring).
UNPAGED_CHOICES = ("queue", "batched")


def normalize_cache_type(value: Any) -> str:
    """``"Q8"``/``"q8"`` -> ``"q8"``; anything else is a ConfigError naming the accepted values."""
    text = str(value).lower()
    if text not in CACHE_CHOICES:
        raise ConfigError(f"cache_type {value!r}: ExLlamaV2 has {', '.join(c.upper() for c in CACHE_CHOICES)}")
    return text


def pad_to_page(tokens: int) -> int:
    return -(-tokens // PAGE_SIZE) * PAGE_SIZE


@dataclass(frozen=True)
class GeneratorSettings(SettingsRecord):
    """What one trial's worker builds.

    Attributes:
        cache_type: fp16, q8, q6 or q4.
        max_seq_len: The model config's and the generator's ``max_seq_len``: ctx, padded to a page.
        max_batch_size: Concurrent jobs (the trial's ``parallel``).
        paged: Paged attention (flash-attn) available.
        mode: ``"dynamic"`` (the dynamic generator) or ``"batched"`` (batched forward passes,
            for ``parallel > 1`` without paged attention when ``unpaged_parallel = "batched"``).
        cache_batch_size: The cache's batch dimension.
        cache_max_seq_len: The cache's ``max_seq_len`` (tokens per batch row).
    """

    cache_type: str
    max_seq_len: int
    max_batch_size: int
    paged: bool
    mode: str
    cache_batch_size: int
    cache_max_seq_len: int

    @property
    def jobs_at_once(self) -> int:
        """Sequences generated together: unpaged, the dynamic generator holds one at a time."""
        if self.mode == "dynamic" and not self.paged:
            return 1
        return self.max_batch_size

    @property
    def cache_tokens(self) -> int:
        """Token capacity of the whole cache."""
        return self.cache_batch_size * self.cache_max_seq_len

    @property
    def prefill_batch(self) -> int:
        """Sequences prefilled in one forward pass (their attention scores coexist)."""
        return self.cache_batch_size


def generator_settings(
    cache_type: str, ctx: int, parallel: int, paged: bool, unpaged_parallel: str = "queue"
) -> GeneratorSettings:
    """The generator and cache a trial gets.

    Args:
        cache_type: fp16/q8/q6/q4 (any case).
        ctx: Tokens per sequence (prompt + output), >= 1.
        parallel: Concurrent sequences, >= 1.
        paged: Whether paged attention (flash-attn >= 2.5.7) is available where the worker runs.
        unpaged_parallel: ``"queue"`` or ``"batched"``: how ``parallel > 1`` runs unpaged.
    """
    if ctx < 1 or parallel < 1:
        raise ConfigError(f"ctx {ctx} and parallel {parallel}: both must be >= 1")
    if unpaged_parallel not in UNPAGED_CHOICES:
        raise ConfigError(f"unpaged_parallel {unpaged_parallel!r}: use one of {', '.join(UNPAGED_CHOICES)}")
    cache = normalize_cache_type(cache_type)
    seq = pad_to_page(ctx)
    if paged:
        return GeneratorSettings(cache, seq, parallel, True, "dynamic", 1, parallel * seq)
    if parallel == 1 or unpaged_parallel == "queue":
        return GeneratorSettings(cache, seq, parallel, False, "dynamic", 1, seq)
    return GeneratorSettings(cache, seq, parallel, False, "batched", parallel, seq)
