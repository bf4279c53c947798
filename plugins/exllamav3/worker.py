"""The exllamav3 worker process: ``python -m autotune_plugins.exllamav3.worker``.

One worker serves one trial: it loads the EXL3 model with the trial's cache and generator,
then answers the parent's requests (the protocol of :mod:`autotune_plugins.exllamav2.protocol`,
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
  autosplit loader with TabbyAPI's default reserve (``autosplit_reserve: [96]`` MB);
* ``model.warmup(cache, max_chunk_size, max_batch_size)`` before the generator takes the cache;
* ``Generator(model, cache, tokenizer, max_batch_size, max_chunk_size)``; jobs without
  ``max_rq_tokens`` (TabbyAPI's ``output_chunking: false``, see :mod:`.generator_settings`).
"""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any, Callable, Mapping, Sequence

from autotune.errors import BackendError, ConfigError
from autotune.measure import ConcurrentResult, StreamResult, serving_metrics

from autotune_plugins.exllamav2.protocol import PROTOCOL_VERSION, encode, serve
from autotune_plugins.exllamav2.worker import PROMPT_TEXT, prompt_ids
from autotune_plugins.exllamav3.generator_settings import GeneratorSettings, pages_per_job

__all__ = ["AUTOSPLIT_RESERVE_GB", "Engine", "check_fits", "main"]

# TabbyAPI config_sample.yml: "autosplit_reserve: [96]" (MB), passed as GB to load_gen.
AUTOSPLIT_RESERVE_GB = 96 / 1024
INSTALL = ("pip install -e '.[exllamav3]' in autotune's checkout (exllamav3==1.6.5, torch; it compiles its "
           "extension at first import and needs the CUDA toolkit's nvcc)")


def check_fits(settings: GeneratorSettings, prompt: int, output: int) -> None:
    """Refuse a request the generator would refuse or serve fewer at once than measured.

    Raises:
        ConfigError: prompt + output exceed max_seq_len, or the jobs' pages exceed the cache.
    """
    if prompt + output > settings.max_seq_len:
        raise ConfigError(f"prompt {prompt} + output {output} tokens exceed max_seq_len {settings.max_seq_len}")
    need = settings.max_batch_size * pages_per_job(prompt + output)
    if need > settings.pages:
        raise ConfigError(f"{settings.max_batch_size} jobs of {prompt + output} tokens need {need} pages; the cache "
                          f"has {settings.pages}")


class Engine:
    """The loaded model and its generator; every torch/exllamav3 import happens in ``load``."""

    def __init__(self) -> None:
        self.settings: GeneratorSettings | None = None
        self.serial = 0

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        try:
            import torch
            from exllamav3 import Cache, CacheLayer_fp16, CacheLayer_quant, Config, Generator, Model, Tokenizer
        except ImportError as exc:
            raise BackendError(f"exllamav3 is not importable by {sys.executable} ({exc}): {INSTALL}, or set "
                               "[backends.exllamav3] python to an interpreter that has it") from exc
        if not torch.cuda.is_available():
            raise BackendError("torch sees no CUDA device (exllamav3 runs on NVIDIA GPUs, Ampere or newer)")
        self.torch = torch
        settings = GeneratorSettings.from_dict(req["settings"])
        config = Config.from_directory(str(req["model_dir"]))
        model = Model.from_config(config)
        if settings.k_bits is None:
            cache = Cache(model, max_num_tokens=settings.cache_tokens, layer_type=CacheLayer_fp16,
                          max_batch_size=settings.max_batch_size)
        else:
            cache = Cache(model, max_num_tokens=settings.cache_tokens, layer_type=CacheLayer_quant,
                          k_bits=settings.k_bits, v_bits=settings.v_bits, max_batch_size=settings.max_batch_size)
        model.load(reserve_per_device=[AUTOSPLIT_RESERVE_GB], max_chunk_size=settings.chunk_size,
                   max_batch_size=settings.max_batch_size, progressbar=False)
        # Triton compilation and autotuning, the GEMM autotuner and the decode graphs' workspaces
        # (model.py warmup: "instead of on the first user requests"), before the Generator takes
        # the cache, as its docstring asks; a server pays the same on its first requests.
        model.warmup(cache=cache, max_chunk_size=settings.chunk_size, max_batch_size=settings.max_batch_size)
        tokenizer = Tokenizer.from_config(config)
        self.generator = Generator(model=model, cache=cache, tokenizer=tokenizer,
                                   max_batch_size=settings.max_batch_size, max_chunk_size=settings.chunk_size)
        self.model, self.cache, self.tokenizer, self.settings = model, cache, tokenizer, settings
        self.vocab = int(tokenizer.actual_vocab_size)
        self.base_ids = tokenizer.encode(PROMPT_TEXT, add_bos=False)[0].tolist()
        torch.cuda.synchronize()
        return {
            "settings": settings.to_dict(),
            "attention": {"path": "exllamav3_paged", "qc_staging": os.environ.get("EXL3_QC_STAGING", "1"),
                          "bc_attn": os.environ.get("EXL3_BC_ATTN", "1")},
            "engine_version": _version(),
            "torch_version": torch.__version__,
            "cuda_device": torch.cuda.get_device_name(0),
            "vocab_size": self.vocab,
            "load_s": time.monotonic() - started,
            "allocated_bytes_after_load": int(torch.cuda.memory_allocated()),
            "reserved_bytes_after_load": int(torch.cuda.memory_reserved()),
        }

    def _require(self) -> GeneratorSettings:
        if self.settings is None:
            raise BackendError("no model loaded: send 'load' first")
        return self.settings

    def _run(self, n_jobs: int, prompt_tokens: int, output_tokens: int) -> list[StreamResult]:
        return self._requests([(prompt_tokens, output_tokens)] * n_jobs, n_jobs, None)

    def _requests(self, lengths: Sequence[Sequence[int]], concurrency: int,
              arrivals: Sequence[float] | None) -> list[StreamResult]:
        """Requests to their own lengths, sent closed-loop (``concurrency`` in flight, the next
        enqueued as one ends) or at their arrival times (open loop); each request's clock starts
        when it is enqueued, as a client's does (autotune.workload)."""
        from exllamav3 import ArgmaxSampler, Job

        torch = self.torch
        gen = self.generator
        n = len(lengths)
        sent: dict[int, float] = {}
        first: dict[int, float] = {}
        end: dict[int, float] = {}
        n_out: dict[int, int] = {}

        def send(k: int) -> None:
            self.serial += 1
            # A first token unique to the request: no cached page is reused, every run prefills.
            ids = torch.tensor([prompt_ids(self.base_ids, int(lengths[k][0]), self.serial, self.vocab)],
                               dtype=torch.long)
            sent[k] = time.monotonic()
            # No stop conditions: the job runs to max_new_tokens, like ignore_eos.
            gen.enqueue(Job(input_ids=ids, max_new_tokens=int(lengths[k][1]), sampler=ArgmaxSampler(), identifier=k))

        t0 = time.monotonic()
        nxt = 0
        if arrivals is None:
            for nxt in range(min(concurrency, n)):
                send(nxt)
            nxt = min(concurrency, n)
        while len(end) < n:
            if arrivals is not None:
                while nxt < n and time.monotonic() - t0 >= arrivals[nxt]:
                    send(nxt)
                    nxt += 1
                if not gen.num_remaining_jobs():
                    time.sleep(max(0.0, t0 + arrivals[nxt] - time.monotonic()))
                    continue
            for r in gen.iterate():
                if r.get("stage") != "streaming":
                    continue
                now = time.monotonic()
                i = r["identifier"]
                ids = r.get("token_ids")
                if ids is not None and ids.numel():
                    first.setdefault(i, now)
                if r.get("eos"):
                    end[i] = now
                    n_out[i] = int(r.get("new_tokens", 0))
                    if arrivals is None and nxt < n:
                        send(nxt)
                        nxt += 1
        return [StreamResult.from_timestamps(int(lengths[k][0]), n_out[k], sent[k], first.get(k, end[k]), end[k])
                for k in range(n)]

    def sample(self, req: dict[str, Any]) -> dict[str, Any]:
        settings = self._require()
        prompt, output = int(req["prompt_tokens"]), int(req["output_tokens"])
        check_fits(settings, prompt, output)
        lengths = req.get("requests")  # a workload's drawn requests (their own lengths), or one shape
        for p, o in lengths or ():
            check_fits(settings, int(p), int(o))
        single = self._run(1, prompt, output)[0]
        t0 = time.monotonic()
        if lengths:
            streams = self._requests(lengths, int(req.get("concurrency") or settings.max_batch_size), req.get("arrivals"))
        else:
            streams = self._run(settings.max_batch_size, prompt, output)
        together = ConcurrentResult(streams=tuple(streams), wall_s=time.monotonic() - t0)
        torch = self.torch
        return {
            "metrics": serving_metrics(single, together),
            "single": vars(single).copy(),
            "streams": [vars(s).copy() for s in streams],
            "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        }

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Mapping[str, Any]]]:
        return {"load": self.load, "sample": self.sample}


def _version() -> str:
    from exllamav3.version import __version__

    return str(__version__)


def main() -> int:
    # The protocol keeps the original stdout to itself; fd 1 then points at stderr, so that
    # whatever the engine prints (Python, C++, the extension's compiler) lands in the log.
    protocol_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    protocol_out.write(encode({"event": "hello", "protocol": PROTOCOL_VERSION, "pid": os.getpid(),
                               "python": platform.python_version(), "executable": sys.executable}))
    return serve(Engine().handlers(), sys.stdin.buffer, protocol_out)


if __name__ == "__main__":
    sys.exit(main())
