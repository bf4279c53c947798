"""The worker side that ExLlamaV2's and exllamav3's worker processes share.

Both workers load one model in their own process and answer the parent's requests
(:mod:`.protocol`); what they share is here, and what each engine builds stays in its worker:

* :func:`prompt_ids`: prompts that never reuse a cached page, so every request prefills;
* :func:`run_requests`: a run's requests enqueued into a paged generator (closed loop or at
  arrival times) and timed per request, first token and end; the engines differ only in how a
  job is built, which the caller passes in;
* :class:`WorkerEngine`: what an engine holds between requests and how it answers ``load`` and
  ``sample`` (one request alone, then the run's requests, as
  :func:`autotune.measure.serving_metrics` defines a run);
* :func:`serve_engine`: a worker's ``main``, with the engine's own prints kept off the protocol.

Nothing here imports torch or an engine: the engines hand their modules in.
"""

from __future__ import annotations

import os
import platform
import sys
import time
from typing import Any, Callable, Mapping, Sequence

from autotune.api import BackendError, StreamResult
from autotune._builtin import ConcurrentResult, ConfigError, serving_metrics

from autotune_plugins.shared.protocol import PROTOCOL_VERSION, encode, serve

__all__ = ["PROMPT_TEXT", "WorkerEngine", "engine_missing", "prompt_ids", "run_requests", "serve_engine"]

# First token ids of generated prompts start above the byte/special range of common
# vocabularies; only a distinct first token per request matters (no shared cache pages).
FIRST_TOKEN_BASE = 1000

PROMPT_TEXT = (
    "Once upon a time, in a small town by the sea, there lived an old clockmaker who repaired "
    "every watch the fishermen brought him. Each morning he opened his shop, swept the floor, "
    "and listened to the ticking of a hundred clocks. "
)


def prompt_ids(base: Sequence[int], n_tokens: int, serial: int, vocab: int) -> list[int]:
    """``n_tokens`` prompt ids: ``base`` repeated, with a first token unique to ``serial``.

    A paged generator reuses cache pages whose token hashes match (prefix caching); a
    different first token changes every page's hash, so each request really prefills.
    """
    if n_tokens < 1:
        raise ConfigError(f"prompt of {n_tokens} tokens: must be >= 1")
    if not base:
        raise BackendError("the tokenizer returned no tokens for the prompt text")
    ids = [base[i % len(base)] for i in range(n_tokens)]
    span = max(1, vocab - FIRST_TOKEN_BASE)
    ids[0] = FIRST_TOKEN_BASE + serial % span if vocab > FIRST_TOKEN_BASE else serial % vocab
    return ids


def run_requests(
    gen: Any,
    prompt: Callable[[int], Any],
    make_job: Callable[[Any, int, int], Any],
    lengths: Sequence[Sequence[int]],
    concurrency: int,
    arrivals: Sequence[float] | None,
) -> list[StreamResult]:
    """A run's requests through a paged generator, each timed as its client would time it.

    Requests go closed-loop (``concurrency`` in flight, the next enqueued as one ends) or, with
    ``arrivals``, each at its time after the start (open loop); a request's clock starts when it
    is enqueued. No job has stop conditions: each runs to its ``max_new_tokens``, like ignore_eos.

    Args:
        gen: The generator: ``enqueue(job)``, ``num_remaining_jobs()``, ``iterate()`` yielding
            result dicts with ``stage``, ``identifier``, ``token_ids``, ``eos``, ``new_tokens``
            (ExLlamaV2's dynamic generator and exllamav3's ``Generator`` both do).
        prompt: Prompt ids of this many tokens, as the job takes them.
        make_job: ``(input_ids, max_new_tokens, identifier)`` -> the engine's job.
        lengths: Each request's (prompt tokens, output tokens), in order.
        concurrency: Requests in flight at once, closed loop.
        arrivals: Seconds after the start at which each request is sent (open loop), or None.
    """
    n = len(lengths)
    sent: dict[int, float] = {}
    first: dict[int, float] = {}
    end: dict[int, float] = {}
    n_out: dict[int, int] = {}

    def send(k: int) -> None:
        ids = prompt(int(lengths[k][0]))
        sent[k] = time.monotonic()
        gen.enqueue(make_job(ids, int(lengths[k][1]), k))

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
    return [
        StreamResult.from_timestamps(int(lengths[k][0]), n_out[k], sent[k], first.get(k, end[k]), end[k])
        for k in range(n)
    ]


def engine_missing(engine: str, install: str, exc: ImportError) -> BackendError:
    """The failure of a worker whose interpreter cannot import its engine."""
    return BackendError(
        f"{engine} is not importable by {sys.executable} ({exc}): {install}, or set "
        f"[backends.{engine}] python to an interpreter that has it"
    )


class WorkerEngine:
    """A loaded model and what runs it, between a worker's requests.

    A subclass's ``load`` imports torch and its engine (sets ``torch``, ``settings``, ``vocab``,
    ``base_ids``, and answers with :meth:`load_reply`); its ``check_sample``, ``run_shape`` and
    ``run_load`` are what :meth:`sample` runs.
    """

    def __init__(self) -> None:
        self.settings: Any = None
        self.serial = 0

    def _require(self) -> Any:
        if self.settings is None:
            raise BackendError("no model loaded: send 'load' first")
        return self.settings

    def _next_prompt(self, n_tokens: int) -> list[int]:
        self.serial += 1
        return prompt_ids(self.base_ids, n_tokens, self.serial, self.vocab)

    def _prompt_tensor(self, n_tokens: int) -> Any:
        """One prompt as a job's ``input_ids`` (a batch of one row)."""
        return self.torch.tensor([self._next_prompt(n_tokens)], dtype=self.torch.long)

    def load_reply(self, started: float, attention: Mapping[str, Any], engine_version: str) -> dict[str, Any]:
        """What ``load`` answers once the model is on the card (``started``: when loading began)."""
        torch = self.torch
        torch.cuda.synchronize()
        return {
            "settings": self.settings.to_dict(),
            "attention": dict(attention),
            "engine_version": engine_version,
            "torch_version": torch.__version__,
            "cuda_device": torch.cuda.get_device_name(0),
            "vocab_size": self.vocab,
            "load_s": time.monotonic() - started,
            "allocated_bytes_after_load": int(torch.cuda.memory_allocated()),
            "reserved_bytes_after_load": int(torch.cuda.memory_reserved()),
        }

    def check_sample(self, settings: Any, prompt: int, output: int, lengths: Sequence[Sequence[int]]) -> None:
        """Raise ConfigError for a run the generator would refuse or serve otherwise than asked."""

    def run_shape(self, n_jobs: int, prompt_tokens: int, output_tokens: int) -> list[StreamResult]:
        """``n_jobs`` requests of one shape, all in flight together."""
        raise NotImplementedError

    def run_load(
        self, lengths: Sequence[Sequence[int]], concurrency: int, arrivals: Sequence[float] | None
    ) -> list[StreamResult]:
        """A workload's requests (:func:`run_requests`)."""
        raise NotImplementedError

    def sample(self, req: dict[str, Any]) -> dict[str, Any]:
        """One run: the request alone, then the run's requests (a workload's drawn ``requests`` at
        their ``concurrency`` or ``arrivals``, else ``max_batch_size`` copies of the one shape)."""
        settings = self._require()
        prompt, output = int(req["prompt_tokens"]), int(req["output_tokens"])
        lengths = req.get("requests")
        self.check_sample(settings, prompt, output, lengths or ())
        single = self.run_shape(1, prompt, output)[0]
        t0 = time.monotonic()
        if lengths:
            streams = self.run_load(
                lengths, int(req.get("concurrency") or settings.max_batch_size), req.get("arrivals")
            )
        else:
            streams = self.run_shape(settings.max_batch_size, prompt, output)
        together = ConcurrentResult(streams=tuple(streams), wall_s=time.monotonic() - t0)
        torch = self.torch
        return {
            "metrics": serving_metrics(single, together),
            "single": vars(single).copy(),
            "streams": [vars(s).copy() for s in streams],
            "max_allocated_bytes": int(torch.cuda.max_memory_allocated()),
            "max_reserved_bytes": int(torch.cuda.max_memory_reserved()),
        }


def serve_engine(engine: Any) -> int:
    """A worker's ``main``: say hello, then answer ``engine.handlers()`` until told to exit."""
    # The protocol keeps the original stdout to itself; fd 1 then points at stderr, so that
    # whatever the engine prints (Python, C++, an extension's compiler) lands in the log.
    protocol_out = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    protocol_out.write(
        encode(
            {
                "event": "hello",
                "protocol": PROTOCOL_VERSION,
                "pid": os.getpid(),
                "python": platform.python_version(),
                "executable": sys.executable,
            }
        )
    )
    return serve(engine.handlers(), sys.stdin.buffer, protocol_out)
