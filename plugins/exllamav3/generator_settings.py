"""A trial's configuration -> the cache and generator exllamav3 builds (pure Python).

exllamav3 has one generator, always paged (exllamav3/generator/generator.py, with
``generator/pagetable.py``), over one ``Cache(model, max_num_tokens, layer_type, k_bits,
v_bits)`` (cache/cache.py) shared by every job:

* **Pages.** ``PAGE_SIZE = 256`` (exllamav3/constants.py); ``max_num_tokens`` must be a multiple
  of it (``CacheLayer_fp16`` / ``CacheLayer_quant`` assert so), and the generator holds
  ``max_num_tokens / 256`` pages.
* **A job's pages.** ``Sequence.prepare`` (generator/pagetable.py) reserves
  ``ceil((prompt + budget) / 256)`` pages when the job is enqueued, where the budget is
  ``max_new_tokens + 1`` (job.py: "the whole response plus one speculative window past the
  limit", no draft model here), unless the job is given ``max_rq_tokens`` (output chunking,
  TabbyAPI's default ``output_chunking: true``), which reserves ``pad256(prompt - 1 +
  max_rq_tokens)`` tokens instead and requeues the job when that is spent. A job that cannot
  fit the whole cache is refused at enqueue ("Job requires N pages (only M available)").
  So ``parallel`` jobs of ``ctx`` tokens each run together in a cache of
  ``parallel x pad256(ctx + 1)`` tokens. We measure without output chunking and the deploy
  line says ``output_chunking: false``: with TabbyAPI's default chunk of 2048 every job would
  reserve at least 2048 tokens, and fewer than ``parallel`` jobs would fit the cache measured.
* **Batch.** ``max_batch_size`` (generator's default 256; TabbyAPI's 128) caps the jobs in one
  step; we set it to ``parallel``, and TabbyAPI passes the same value to ``Cache``,
  ``model.load`` and ``AsyncGenerator``.
* **Chunk.** ``max_chunk_size`` (default 2048) is the prefill chunk. TabbyAPI's ``chunk_size``
  is raised to at least 256 and rounded up to a multiple of 256 (backends/exllamav3/model.py
  ``adjust_chunk_size``), and the generator's default ``shared_chunk_size`` (half of it, rounded
  up to a page) must not exceed it (generator.py asserts), so we accept multiples of 256 only:
  what was measured is what TabbyAPI runs. The chunk is cut to the cache: the loader's measuring
  pass runs ``batch_shape = (1, max_chunk_size)`` against the cache (model/model_ls.py), and
  attention asserts ``bsz * cache_max_seq_len <= cache.max_num_tokens`` ("Cache too small for
  batch shape", modules/attn.py), so one stream of ctx 1024 (a 1,280-token cache) failed to load
  with the default 2048 on the H200; no prompt is longer than the cache, so a larger chunk
  never prefilled more.

Every trial records these settings; the deploy line is built from the same object.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autotune._builtin import ConfigError

from autotune_plugins.shared.generator_record import SettingsRecord
from autotune_plugins.shared.paging import PAGE_SIZE, pad_to_page, pages_per_job  # noqa: F401  (this module's names, as before)
from autotune_plugins.exllamav3.declarations import cache_kv_bits

__all__ = [
    "DEFAULT_CHUNK",
    "PAGE_SIZE",
    "GeneratorSettings",
    "chunk_problem",
    "generator_settings",
    "normalize_cache_type",
    "pad_to_page",
    "pages_per_job",
]

DEFAULT_CHUNK = 2048  # Generator(max_chunk_size=2048), TabbyAPI chunk_size default 2048
CACHE_ACCEPTED = "fp16 or k<K>v<V> with K and V from 2 to 8 (k8v8, k4v6, ...)"


def normalize_cache_type(value: Any) -> str:
    """``"FP16"`` -> ``"fp16"``, ``"K4V6"`` -> ``"k4v6"``; anything else is a ConfigError naming
    what is accepted."""
    text = str(value).strip().lower()
    try:
        cache_kv_bits(text)
    except ValueError:
        raise ConfigError(f"cache_type {value!r}: exllamav3 has {CACHE_ACCEPTED}") from None
    return text


def chunk_problem(chunk: Any) -> str | None:
    """Why ``chunk`` cannot be a prefill chunk size (None: it can)."""
    if type(chunk) is not int or chunk < PAGE_SIZE or chunk % PAGE_SIZE:
        return f"{chunk!r}: must be a multiple of {PAGE_SIZE} (the page), at least {PAGE_SIZE}"
    return None


@dataclass(frozen=True)
class GeneratorSettings(SettingsRecord):
    """What one trial's worker builds, and what TabbyAPI is told.

    Attributes:
        cache_type: ``fp16`` or ``k<K>v<V>``.
        max_seq_len: Tokens one sequence may hold (the trial's ctx; TabbyAPI's ``max_seq_len``).
        cache_tokens: ``Cache(max_num_tokens=...)``: ``parallel x pad256(ctx + 1)`` (TabbyAPI's
            ``cache_size``).
        max_batch_size: Jobs run together (the trial's ``parallel``).
        chunk_size: The prefill chunk (``max_chunk_size``; TabbyAPI's ``chunk_size``).
        gpu_split: ``""`` (one card), ``"auto"`` or GiB per card (``"20,24"``): how ``model.load``
            spreads the model over several cards (TabbyAPI's ``gpu_split_auto`` / ``gpu_split``).
        tensor_parallel: ``model.load(tensor_p=True)`` (TabbyAPI's ``tensor_parallel``).
        spec_type: ``none``, ``draft``, ``mtp`` or ``ngram`` (:mod:`.speculation`).
        draft_tokens: ``num_draft_tokens`` (0 without speculation): every job's pages hold this
            window past its response (job.py ``max_new_tokens + 1 + max_draft_tokens``).
        ngram_match_min: The generator's ``ngram_match_min`` (0: no n-gram drafting).
        draft_cache_type: The draft cache's type (TabbyAPI ``draft_cache_mode``), draft and mtp.
        draft_dir: The draft weights' directory (spec_type draft; ``""`` otherwise).
    """

    cache_type: str
    max_seq_len: int
    cache_tokens: int
    max_batch_size: int
    chunk_size: int
    gpu_split: str = ""
    tensor_parallel: bool = False
    spec_type: str = "none"
    draft_tokens: int = 0
    ngram_match_min: int = 0
    draft_cache_type: str = "fp16"
    draft_dir: str = ""

    @property
    def pages(self) -> int:
        return self.cache_tokens // PAGE_SIZE

    @property
    def k_bits(self) -> int | None:
        bits = cache_kv_bits(self.cache_type)
        return None if bits is None else bits[0]

    @property
    def v_bits(self) -> int | None:
        bits = cache_kv_bits(self.cache_type)
        return None if bits is None else bits[1]

    @property
    def jobs_at_once(self) -> int:
        """Jobs whose pages fit the cache together (the generator admits no more)."""
        return min(self.max_batch_size, self.pages // pages_per_job(self.max_seq_len + self.draft_tokens))

    @property
    def draft_kv_bits(self) -> tuple[int, int] | None:
        return cache_kv_bits(self.draft_cache_type)


def generator_settings(
    cache_type: str,
    ctx: int,
    parallel: int,
    chunk_size: int = DEFAULT_CHUNK,
    gpu_split: str = "",
    tensor_parallel: bool = False,
    spec_type: str = "none",
    draft_tokens: int = 0,
    ngram_match_min: int = 0,
    draft_cache_type: str = "fp16",
    draft_dir: str = "",
) -> GeneratorSettings:
    """The cache and generator a trial gets.

    Args:
        cache_type: ``fp16`` or ``k<K>v<V>`` (any case).
        ctx: Tokens per sequence (prompt + output), >= 1.
        parallel: Concurrent sequences, >= 1.
        chunk_size: The prefill chunk, a multiple of 256.
        gpu_split: The split over several cards (``""``: one card; see :mod:`.split`).
        tensor_parallel: Whether the cards split every layer.
        spec_type, draft_tokens, ngram_match_min, draft_cache_type, draft_dir: The speculation
            (:mod:`.speculation`); the draft window widens every job's pages.

    Raises:
        ConfigError: A value exllamav3 or TabbyAPI would not take as it is.
    """
    if ctx < 1 or parallel < 1:
        raise ConfigError(f"ctx {ctx} and parallel {parallel}: both must be >= 1")
    problem = chunk_problem(chunk_size)
    if problem:
        raise ConfigError(f"chunk_size {problem}")
    cache = normalize_cache_type(cache_type)
    window = int(draft_tokens) if spec_type != "none" else 0
    cache_tokens = parallel * pages_per_job(ctx + window) * PAGE_SIZE
    return GeneratorSettings(
        cache,
        ctx,
        cache_tokens,
        parallel,
        min(chunk_size, cache_tokens),
        gpu_split,
        bool(tensor_parallel),
        spec_type,
        window,
        int(ngram_match_min) if spec_type == "ngram" else 0,
        normalize_cache_type(draft_cache_type),
        draft_dir if spec_type == "draft" else "",
    )
