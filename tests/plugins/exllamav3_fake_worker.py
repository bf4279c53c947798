"""A stand-in for ``autotune_plugins.exllamav3.worker`` that speaks the real protocol.

Its behaviour comes from the first argument: ``ok`` (answers like a loaded engine),
``crash-on-load`` (prints a reason to stderr and exits 3), ``hang-on-load`` (never answers),
``other-settings`` (builds a smaller cache than asked for). With ``EXL3_FAKE_REQUESTS`` set,
every request is appended to that file as a JSON line, so tests see what the parent sent.
Loaded with speculation (``spec_type`` not ``none``), ``sample`` reports draft counters.
Loaded for scoring (``purpose = "score"``), it answers the scorer's requests with the real
worker side (``worker_scoring.PassScorer``) over ``exllamav3_fake_model.FakeModel``.
"""

from __future__ import annotations

import sys
import time

from exllamav3_fake_model import FakeModel, encode  # this script's own directory is on sys.path
from fake_worker_protocol import serve

from autotune_plugins.exllamav3 import worker_scoring

MODE = sys.argv[1]
SCORER: list[worker_scoring.PassScorer] = []
LOADED: dict = {}


def scorer() -> worker_scoring.PassScorer:
    if not SCORER:
        raise RuntimeError("no model loaded for scoring: send 'load' with purpose 'score' first")
    return SCORER[0]


def load(req: dict) -> dict:
    if MODE == "crash-on-load":
        print("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 1.50 GiB", file=sys.stderr, flush=True)
        sys.exit(3)
    if MODE == "hang-on-load":
        time.sleep(300)
    built = dict(req["settings"])
    LOADED.update(built)
    if MODE == "other-settings":  # as a worker that cut the cache to one job's pages would
        built.update(cache_tokens=256)
    if req.get("purpose") == "score":
        s = req["settings"]
        model = FakeModel(req["model_dir"], s["cache_type"], s["cache_tokens"])
        SCORER[:] = [
            worker_scoring.PassScorer(
                encode, model.forward, model.n_vocab, s["max_seq_len"], s["chunk_size"], req["model_dir"]
            )
        ]
    return {
        "ok": True,
        "engine_version": "1.6.5-fake",
        "settings": built,
        "attention": {"path": "exllamav3_paged"},
        "load_s": 0.01,
    }


def sample(req: dict, samples: int) -> dict:
    # What the real worker answers: the request alone and every request of the run, from
    # which the parent computes the metrics. Each decodes at 100 tok/s after a 40 ms first
    # token, a little faster each sample (so repeated samples differ); the run's requests
    # are the workload's lengths, or two copies of the one shape.
    lengths = req.get("requests") or [[req["prompt_tokens"], req["output_tokens"]]] * 2
    rate = 100.0 + samples

    def stream(start, p, o):
        return {
            "prompt_tokens": p,
            "output_tokens": o,
            "ttft_ms": 40.0,
            "decode_tok_s": rate,
            "prefill_tok_s": p / 0.04,
            "start_s": start,
            "end_s": start + 0.04 + (o - 1) / rate,
        }

    reply = {
        "ok": True,
        "single": stream(0.0, req["prompt_tokens"], req["output_tokens"]),
        "streams": [stream(1.0, p, o) for p, o in lengths],
        "max_allocated_bytes": 1,
        "max_reserved_bytes": 2,
    }
    if LOADED.get("spec_type", "none") != "none":
        # As the real worker's DraftCounter: per request, draft_tokens proposed per round and
        # half of them accepted, over the request alone and the run's requests.
        outs = [req["output_tokens"], *(o for _, o in lengths)]
        reply["drafts"] = {
            "requests": len(outs),
            "drafted": sum(2 * o for o in outs),
            "accepted": sum(outs),
            "generated": sum(outs),
        }
    return reply


serve("EXL3_FAKE_REQUESTS", load, sample, worker_scoring.handlers(scorer))
