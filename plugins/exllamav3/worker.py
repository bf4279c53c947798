"""The exllamav3 worker process: ``python -m autotune_plugins.exllamav3.worker``.

One worker serves one trial: it loads the EXL3 model with the trial's cache and generator,
then answers the parent's requests (the protocol of :mod:`autotune_plugins.shared.protocol`,
which both exllama workers speak) until told to exit or until its stdin closes. torch and
exllamav3 are imported here only, on ``load`` (the first import JIT-compiles exllamav3's
extension, exllamav3/ext.py), so autotune itself never needs them, and a CUDA crash or an
out-of-memory kill takes down this process, not the study.

What runs (exllamav3 1.6.5), as TabbyAPI's backends/exllamav3/model.py builds it:

* ``Config.from_directory(model_dir)``, ``Model.from_config(config)``;
* ``Cache(model, max_num_tokens=cache_tokens, layer_type=CacheLayer_quant, k_bits, v_bits,
  max_batch_size)`` (``CacheLayer_fp16`` for fp16), created before the model loads so that
  loading allocates it;
* ``model.load(reserve_per_device=[96 / 1024], max_chunk_size, max_batch_size)``: the
  autosplit loader with TabbyAPI's default reserve (``autosplit_reserve: [96]`` MB); on several
  cards ``use_per_device`` for a ``gpu_split`` in GiB and ``tensor_p`` (:func:`split_load_args`);
* ``model.warmup(cache, max_chunk_size, max_batch_size)`` before the generator takes the cache;
* ``Generator(model, cache, tokenizer, max_batch_size, max_chunk_size)``; jobs without
  ``max_rq_tokens`` (TabbyAPI's ``output_chunking: false``, see :mod:`.generator_settings`).
* With speculation (:mod:`.speculation`): the draft model (or the target's ``mtp`` component)
  and its cache of the target's size, loaded before the target as TabbyAPI does, and
  ``draft_model``, ``draft_cache``, ``num_draft_tokens``, ``ngram_match_min`` for the generator;
  ``sample`` answers the generator's drafted/accepted counters (:class:`DraftCounter`).

A worker loaded for scoring (``load`` with ``purpose = "score"``, by :mod:`.scorer`) builds the
same model and cache, no generator and no warmup, and answers ``tokenize``, ``loglikelihood``
and ``next_token_logprobs`` through :mod:`.worker_scoring`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Mapping, Sequence

from autotune.api import BackendError, StreamResult
from autotune._builtin import ConfigError

from autotune_plugins.shared.worker_engine import PROMPT_TEXT, WorkerEngine, engine_missing, run_requests, serve_engine
from autotune_plugins.exllamav3 import split, worker_scoring
from autotune_plugins.exllamav3.generator_settings import GeneratorSettings, pages_per_job

__all__ = ["AUTOSPLIT_RESERVE_GB", "Engine", "check_fits", "main", "split_load_args"]

# TabbyAPI config_sample.yml: "autosplit_reserve: [96]" (MB), passed as GB to load_gen.
AUTOSPLIT_RESERVE_GB = 96 / 1024
INSTALL = (
    "pip install -e '.[exllamav3]' in autotune's checkout (exllamav3==1.6.5, torch; it compiles its "
    "extension at first import and needs the CUDA toolkit's nvcc)"
)


def check_fits(settings: GeneratorSettings, prompt: int, output: int) -> None:
    """Refuse a request the generator would refuse or serve fewer at once than measured.

    Raises:
        ConfigError: prompt + output exceed max_seq_len, or the jobs' pages exceed the cache.
    """
    if prompt + output > settings.max_seq_len:
        raise ConfigError(f"prompt {prompt} + output {output} tokens exceed max_seq_len {settings.max_seq_len}")
    need = settings.max_batch_size * pages_per_job(prompt + output + settings.draft_tokens)
    if need > settings.pages:
        raise ConfigError(
            f"{settings.max_batch_size} jobs of {prompt + output} tokens need {need} pages; the cache "
            f"has {settings.pages}"
        )


def split_load_args(settings: GeneratorSettings) -> dict[str, Any]:
    """``model.load``'s split arguments as TabbyAPI passes them (backends/exllamav3/model.py):
    a ``gpu_split`` in GiB is ``use_per_device`` with no reserve; otherwise (one card, ``auto``)
    the autosplit reserve; ``tensor_p`` for tensor parallelism, on TabbyAPI's default backend
    ``native`` (exllamav3's own default is ``nccl``: the measurement follows the deploy line)."""
    gib = split.gpu_split_gib(settings.gpu_split) if settings.gpu_split else None
    args: dict[str, Any] = {"use_per_device": list(gib)} if gib else {"reserve_per_device": [AUTOSPLIT_RESERVE_GB]}
    if settings.tensor_parallel:
        args.update(tensor_p=True, tp_backend=split.TP_BACKEND)
    return args


class Engine(WorkerEngine):
    """The loaded model and its generator; every torch/exllamav3 import happens in ``load``
    (what it shares with ExLlamaV2's worker: :class:`autotune_plugins.shared.worker_engine.WorkerEngine`)."""

    settings: GeneratorSettings | None
    scoring: worker_scoring.PassScorer | None = None
    drafts: "DraftCounter | None" = None

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        try:
            import torch
            from exllamav3 import Cache, CacheLayer_fp16, CacheLayer_quant, Config, Generator, Model, Tokenizer
        except ImportError as exc:
            raise engine_missing("exllamav3", INSTALL, exc) from exc
        if not torch.cuda.is_available():
            raise BackendError("torch sees no CUDA device (exllamav3 runs on NVIDIA GPUs, Ampere or newer)")
        self.torch = torch
        settings = GeneratorSettings.from_dict(req["settings"])
        config = Config.from_directory(str(req["model_dir"]))
        model = Model.from_config(config)
        if settings.k_bits is None:
            cache = Cache(
                model,
                max_num_tokens=settings.cache_tokens,
                layer_type=CacheLayer_fp16,
                max_batch_size=settings.max_batch_size,
                max_history=settings.draft_tokens,
            )
        else:
            cache = Cache(
                model,
                max_num_tokens=settings.cache_tokens,
                layer_type=CacheLayer_quant,
                k_bits=settings.k_bits,
                v_bits=settings.v_bits,
                max_batch_size=settings.max_batch_size,
                max_history=settings.draft_tokens,
            )
        # TabbyAPI builds both caches first, then loads the draft (its reserve only), then the target.
        draft_model, draft_cache = self._drafter(
            settings, config, Config, Model, Cache, CacheLayer_fp16, CacheLayer_quant
        )
        if draft_model is not None:
            draft_model.load(reserve_per_device=[AUTOSPLIT_RESERVE_GB], progressbar=False)
        model.load(
            **split_load_args(settings),
            max_chunk_size=settings.chunk_size,
            max_batch_size=settings.max_batch_size,
            progressbar=False,
        )
        tokenizer = Tokenizer.from_config(config)
        if req.get("purpose", "measure") == "score":
            # One sequence scored by forward passes through the cache: no generator to take it,
            # and no warmup (Triton compiles what the passes need on the first of them).
            self.model, self.cache, self.tokenizer, self.settings = model, cache, tokenizer, settings
            self.scoring = worker_scoring.PassScorer(
                lambda text, add_bos: tokenizer.encode(text, add_bos=add_bos)[0].tolist(),
                worker_scoring.exllamav3_forward(torch, model, cache, int(config.vocab_size), settings.cache_tokens),
                int(config.vocab_size),
                settings.max_seq_len,
                settings.chunk_size,
                str(req["model_dir"]),
            )
            self.vocab = int(tokenizer.actual_vocab_size)
            return self.load_reply(started, {"path": "exllamav3_forward", "purpose": "score"}, _version())
        # Triton compilation and autotuning, the GEMM autotuner and the decode graphs' workspaces
        # (model.py warmup: "instead of on the first user requests"), before the Generator takes
        # the cache, as its docstring asks; a server pays the same on its first requests.
        model.warmup(cache=cache, max_chunk_size=settings.chunk_size, max_batch_size=settings.max_batch_size)
        self.generator = Generator(
            model=model,
            cache=cache,
            tokenizer=tokenizer,
            max_batch_size=settings.max_batch_size,
            max_chunk_size=settings.chunk_size,
            draft_model=draft_model,
            draft_cache=draft_cache,
            num_draft_tokens=settings.draft_tokens or None,
            ngram_match_min=settings.ngram_match_min,
        )
        self.drafts = DraftCounter()
        self.model, self.cache, self.tokenizer, self.settings = model, cache, tokenizer, settings
        self.vocab = int(tokenizer.actual_vocab_size)
        self.base_ids = tokenizer.encode(PROMPT_TEXT, add_bos=False)[0].tolist()
        attention = {
            "path": "exllamav3_paged",
            "qc_staging": os.environ.get("EXL3_QC_STAGING", "1"),
            "bc_attn": os.environ.get("EXL3_BC_ATTN", "1"),
        }
        return self.load_reply(started, attention, _version())

    def _drafter(
        self, s: GeneratorSettings, config: Any, Config: Any, Model: Any, Cache: Any, fp16: Any, quant: Any
    ) -> tuple[Any, Any]:
        """The draft model and its cache, as TabbyAPI builds them (backends/exllamav3/model.py):
        the draft directory's own model, or the target's ``mtp`` component on its config; a cache
        of the target's size (the generator asserts it) with ``draft_cache_type`` and the draft
        window as ``max_history``; not loaded yet. None, None for ``none`` and ``ngram``."""
        if s.spec_type not in ("draft", "mtp"):
            return None, None
        if s.spec_type == "mtp":
            draft = Model.from_config(config, component="mtp")
        else:
            draft = Model.from_config(Config.from_directory(s.draft_dir))
        bits = s.draft_kv_bits
        kw = dict(max_num_tokens=s.cache_tokens, max_batch_size=s.max_batch_size, max_history=s.draft_tokens)
        cache = (
            Cache(draft, layer_type=fp16, **kw)
            if bits is None
            else Cache(draft, layer_type=quant, k_bits=bits[0], v_bits=bits[1], **kw)
        )
        return draft, cache

    def run_shape(self, n_jobs: int, prompt_tokens: int, output_tokens: int) -> list[StreamResult]:
        return self.run_load([(prompt_tokens, output_tokens)] * n_jobs, n_jobs, None)

    def run_load(
        self, lengths: Sequence[Sequence[int]], concurrency: int, arrivals: Sequence[float] | None
    ) -> list[StreamResult]:
        """A workload's requests through the generator (:func:`.worker_engine.run_requests`);
        each request's first token is unique, so no cached page is reused and every run prefills."""
        from exllamav3 import ArgmaxSampler, Job

        if self.drafts is None:
            self.drafts = DraftCounter()
        return run_requests(
            CountingGenerator(self.generator, self.drafts),
            self._prompt_tensor,
            lambda ids, n_out, k: Job(input_ids=ids, max_new_tokens=n_out, sampler=ArgmaxSampler(), identifier=k),
            lengths,
            concurrency,
            arrivals,
        )

    def sample(self, req: dict[str, Any]) -> dict[str, Any]:
        """The shared run, and the draft counters of its requests (the one alone and the run's)."""
        self.drafts = DraftCounter()
        reply = super().sample(req)
        if self._require().spec_type != "none":
            reply["drafts"] = self.drafts.to_dict()
        return reply

    def check_sample(
        self, settings: GeneratorSettings, prompt: int, output: int, lengths: Sequence[Sequence[int]]
    ) -> None:
        check_fits(settings, prompt, output)
        for p, o in lengths:
            check_fits(settings, int(p), int(o))

    def _scorer(self) -> worker_scoring.PassScorer:
        if self.scoring is None:
            raise BackendError("no model loaded for scoring: send 'load' with purpose 'score' first")
        return self.scoring

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Mapping[str, Any]]]:
        return {"load": self.load, "sample": self.sample, **worker_scoring.handlers(self._scorer)}


class DraftCounter:
    """The generator's own counters summed over finished jobs: its last result of a job
    (``eos``) carries ``accepted_draft_tokens`` and ``rejected_draft_tokens`` when speculative
    decoding is on (generator.py iterate's docstring). The generator counts the positions past
    the end as rejected "so accepted + rejected equals the number of drafted positions"."""

    def __init__(self) -> None:
        self.requests = self.accepted = self.rejected = self.generated = 0

    def add(self, result: Mapping[str, Any]) -> None:
        if result.get("stage") == "streaming" and result.get("eos") and "accepted_draft_tokens" in result:
            self.requests += 1
            self.accepted += int(result["accepted_draft_tokens"])
            self.rejected += int(result.get("rejected_draft_tokens", 0))
            self.generated += int(result.get("new_tokens", 0))

    def to_dict(self) -> dict[str, int]:
        return {
            "requests": self.requests,
            "drafted": self.accepted + self.rejected,
            "accepted": self.accepted,
            "generated": self.generated,
        }


class CountingGenerator:
    """The generator as :func:`.worker_engine.run_requests` drives it, each result counted."""

    def __init__(self, generator: Any, counter: DraftCounter) -> None:
        self.generator, self.counter = generator, counter

    def enqueue(self, job: Any) -> None:
        self.generator.enqueue(job)

    def num_remaining_jobs(self) -> int:
        return self.generator.num_remaining_jobs()

    def iterate(self) -> list[Any]:
        results = self.generator.iterate()
        for r in results:
            self.counter.add(r)
        return results


def _version() -> str:
    from exllamav3.version import __version__

    return str(__version__)


def main() -> int:
    return serve_engine(Engine())


if __name__ == "__main__":
    sys.exit(main())
