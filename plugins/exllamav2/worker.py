"""The ExLlamaV2 worker process: ``python -m autotune_plugins.exllamav2.worker``.

One worker serves one trial (or one scorer): it loads the EXL2 model with the trial's cache
mode and ``max_seq_len``, then answers the parent's requests (:mod:`.protocol`) until told to
exit or until its stdin closes. torch and exllamav2 are imported here only, on ``load``, so
autotune itself never needs them, and a CUDA crash or an out-of-memory kill takes down this
process, not the study.

What runs (ExLlamaV2 0.3.2):

* ``ExLlamaV2Config(model_dir)`` with ``max_seq_len`` = the trial's ctx padded to a page;
  the cache class of the mode (``ExLlamaV2Cache`` / ``_Q8`` / ``_Q6`` / ``_Q4``) built
  lazily and allocated by ``model.load_autosplit``, which fills the GPU the parent chose
  through ``CUDA_VISIBLE_DEVICES``;
* ``ExLlamaV2DynamicGenerator(max_batch_size=parallel, paged=...)`` (unpaged, it serves the
  jobs one after another), or batched forward passes for ``parallel > 1`` without paged
  attention when asked for (``unpaged_parallel = "batched"``, see :mod:`.generator_settings`).

The attention path is what ``exllamav2.attn`` found at import (``has_flash_attn``,
``has_flash_attn_with_paged``, ``has_xformers``, ``has_lower_right_sdpa``) as the model's
config left it enabled, in the order ``ExLlamaV2Attention`` picks: flash-attn, xformers,
Torch SDPA (lower-right causal mask), plain matmul.

The request loop, the prompts and the ``load``/``sample`` answers are
:mod:`.worker_engine`'s, shared with exllamav3's worker; this module builds ExLlamaV2's jobs.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Sequence

from autotune.api import BackendError, StreamResult
from autotune._builtin import ConfigError, serving_metrics

from autotune_plugins.exllamav2.generator_settings import GeneratorSettings
from autotune_plugins.shared.pass_scoring import SCORE_CHUNK, score_passes
from autotune_plugins.shared.worker_engine import (
    PROMPT_TEXT,
    WorkerEngine,
    engine_missing,
    prompt_ids,
    run_requests,
    serve_engine,
)

__all__ = [
    "Engine",
    "PROMPT_TEXT",
    "SCORE_CHUNK",
    "attention_path",
    "check_paged",
    "main",
    "prompt_ids",
    "sample_metrics",
    "score_passes",
]

CACHE_CLASSES = {
    "fp16": "ExLlamaV2Cache",
    "q8": "ExLlamaV2Cache_Q8",
    "q6": "ExLlamaV2Cache_Q6",
    "q4": "ExLlamaV2Cache_Q4",
}
INSTALL = "pip install -e '.[exllamav2]' in autotune's checkout (exllamav2==0.3.2, torch>=2.3)"


def attention_path(flags: Mapping[str, bool], paged: bool) -> str:
    """The attention kernel ExLlamaV2 runs, named as trials record it.

    Args:
        flags: ``flash_attn``, ``xformers``, ``sdpa`` availability, each already AND-ed with
            the model config's ``no_*`` switches.
        paged: Whether the dynamic generator runs paged (flash_attn_with_kvcache over pages).
    """
    if paged:
        return "flash_attn_paged"
    if flags.get("flash_attn"):
        return "flash_attn"
    if flags.get("xformers"):
        return "xformers"
    if flags.get("sdpa"):
        return "sdpa"
    return "matmul"


def check_paged(settings: GeneratorSettings, has_paged_attention: bool, no_flash_attn: bool) -> None:
    """Refuse paged settings where exllamav2 cannot page, rather than measure unpaged.

    Args:
        settings: What the parent asked for.
        has_paged_attention: ``exllamav2.attn.has_flash_attn_with_paged`` (flash-attn >= 2.5.7 imported).
        no_flash_attn: The model config turned flash-attn off (its architecture, or EXLLAMA_NO_FLASH_ATTN).
    """
    if settings.paged and (not has_paged_attention or no_flash_attn):
        why = (
            "the model's config turns flash-attn off"
            if has_paged_attention
            else "exllamav2 found no flash-attn >= 2.5.7 it could import"
        )
        raise BackendError(
            f"paged attention was chosen but {why}: set [backends.exllamav2] paged = false "
            f"(jobs are then served one at a time), or fix flash-attn's install"
        )


# One run's numbers: the core's definition, so a run means the same for every backend.
sample_metrics = serving_metrics


class Engine(WorkerEngine):
    """The loaded model and what runs it; every torch/exllamav2 import happens in ``load``."""

    settings: GeneratorSettings | None

    # -------------------------------------------------------------- load

    def load(self, req: dict[str, Any]) -> dict[str, Any]:
        started = time.monotonic()
        try:
            import torch
            import exllamav2
            from exllamav2 import attn as exl2_attn
        except ImportError as exc:
            raise engine_missing("exllamav2", INSTALL, exc) from exc
        from exllamav2 import ExLlamaV2, ExLlamaV2Config, ExLlamaV2Tokenizer
        from exllamav2.generator import ExLlamaV2DynamicGenerator

        if not torch.cuda.is_available():
            raise BackendError("torch sees no CUDA device (ExLlamaV2 runs on CUDA/ROCm GPUs only)")
        self.torch = torch
        # The parent chose the generator (its deploy line serves the same one): build exactly
        # that, or say why it cannot be built here.
        settings = GeneratorSettings.from_dict(req["settings"])
        config = ExLlamaV2Config(str(req["model_dir"]))
        check_paged(settings, bool(exl2_attn.has_flash_attn_with_paged), bool(config.no_flash_attn))
        config.max_seq_len = settings.max_seq_len
        model = ExLlamaV2(config)
        cache_cls = getattr(exllamav2, CACHE_CLASSES[settings.cache_type])
        cache = cache_cls(
            model, batch_size=settings.cache_batch_size, max_seq_len=settings.cache_max_seq_len, lazy=True
        )
        model.load_autosplit(cache, last_id_only=True)
        tokenizer = ExLlamaV2Tokenizer(config)
        self.model, self.cache, self.tokenizer, self.settings = model, cache, tokenizer, settings
        self.vocab = tokenizer.get_vocab_size()
        self.base_ids = tokenizer.encode(PROMPT_TEXT, add_bos=False)[0].tolist()
        self.generator = None
        if settings.mode == "dynamic" and req.get("purpose", "measure") == "measure":
            self.generator = ExLlamaV2DynamicGenerator(
                model=model,
                cache=cache,
                tokenizer=tokenizer,
                max_batch_size=settings.max_batch_size,
                max_seq_len=settings.max_seq_len,
                paged=settings.paged,
            )
            self.generator.warmup()  # kernel autotuning, per the generator's own docstring
        flags = {
            "flash_attn": bool(exl2_attn.has_flash_attn) and not config.no_flash_attn,
            "xformers": bool(exl2_attn.has_xformers) and not config.no_xformers,
            "sdpa": bool(exl2_attn.has_lower_right_sdpa) and not config.no_sdpa,
        }
        flash_version = getattr(sys.modules.get("flash_attn"), "__version__", None)
        return self.load_reply(
            started,
            {
                "path": attention_path(flags, settings.paged),
                "paged": settings.paged,
                "mode": settings.mode,
                "flash_attn_version": flash_version,
                **flags,
            },
            exllamav2.__version__,
        )

    # -------------------------------------------------------------- generation

    def _dynamic(self, n_jobs: int, prompt_tokens: int, output_tokens: int) -> list[StreamResult]:
        """``n_jobs`` requests of one shape, enqueued together (:meth:`_dynamic_load`)."""
        return self._dynamic_load([(prompt_tokens, output_tokens)] * n_jobs, n_jobs, None)

    def _dynamic_load(
        self, lengths: Sequence[Sequence[int]], concurrency: int, arrivals: Sequence[float] | None
    ) -> list[StreamResult]:
        """A workload's requests (autotune.engine.workload) through the dynamic generator, after its
        cached pages are forgotten (:func:`.worker_engine.run_requests`)."""
        from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

        gen = self.generator
        gen.reset_page_table()
        greedy = ExLlamaV2Sampler.Settings.greedy()
        return run_requests(
            gen,
            self._prompt_tensor,
            lambda ids, n_out, k: ExLlamaV2DynamicJob(
                input_ids=ids, max_new_tokens=n_out, gen_settings=greedy, identifier=k
            ),
            lengths,
            concurrency,
            arrivals,
        )

    def _batched(self, n_rows: int, prompt_tokens: int, output_tokens: int) -> list[StreamResult]:
        torch = self.torch
        model, cache = self.model, self.cache
        ids = torch.tensor([self._next_prompt(prompt_tokens) for _ in range(n_rows)], dtype=torch.long)
        cache.current_seq_len = 0
        torch.cuda.synchronize()
        start = time.monotonic()
        with torch.inference_mode():
            if prompt_tokens > 1:
                model.forward(ids[:, :-1], cache, preprocess_only=True)
            logits = model.forward(ids[:, -1:], cache)
            token = (
                logits[:, -1, : self.vocab].argmax(dim=-1, keepdim=True).cpu()
            )  # input ids live on the CPU (embed_cpu)
            torch.cuda.synchronize()
            first = time.monotonic()
            for _ in range(output_tokens - 1):
                logits = model.forward(token, cache)
                token = logits[:, -1, : self.vocab].argmax(dim=-1, keepdim=True).cpu()
            torch.cuda.synchronize()
        end = time.monotonic()
        return [StreamResult.from_timestamps(prompt_tokens, output_tokens, start, first, end) for _ in range(n_rows)]

    def check_sample(
        self, settings: GeneratorSettings, prompt: int, output: int, lengths: Sequence[Sequence[int]]
    ) -> None:
        if prompt + output > settings.max_seq_len:
            raise ConfigError(f"prompt {prompt} + output {output} tokens exceed max_seq_len {settings.max_seq_len}")
        if lengths and settings.mode != "dynamic":
            raise ConfigError(
                "a length distribution or Poisson arrivals need the dynamic generator: batched "
                "forward passes serve one request shape (rows of one length)"
            )
        longest = max((int(p) + int(o) for p, o in lengths), default=0)
        if longest > settings.max_seq_len:
            raise ConfigError(f"a request of {longest} tokens exceeds max_seq_len {settings.max_seq_len}")

    def run_shape(self, n_jobs: int, prompt_tokens: int, output_tokens: int) -> list[StreamResult]:
        run = self._dynamic if self._require().mode == "dynamic" else self._batched
        return run(n_jobs, prompt_tokens, output_tokens)

    run_load = _dynamic_load

    # -------------------------------------------------------------- scoring

    def tokenize(self, req: dict[str, Any]) -> dict[str, Any]:
        self._require()
        ids = self.tokenizer.encode(str(req["text"]), add_bos=bool(req.get("add_bos", False)))
        return {"tokens": ids[0].tolist()}

    def _logprobs(self, tokens: Sequence[int], starts: Sequence[int]):
        """log-softmax rows for every prefix of ``tokens``, through the trial's cache type.

        The tokens go through the model in passes that begin at ``starts`` (see
        :func:`score_passes`): a pass attends to what earlier passes left in the cache, read
        back through the cache's quantization, as a served decode step does.
        """
        torch = self.torch
        settings = self._require()
        if not 1 <= len(tokens) <= settings.cache_max_seq_len:
            raise ConfigError(f"{len(tokens)} tokens: score between 1 and {settings.cache_max_seq_len}")
        self.cache.current_seq_len = 0
        vocab = self.model.config.vocab_size
        rows = []
        with torch.inference_mode():
            for begin, end in score_passes(len(tokens), starts):
                ids = torch.tensor([list(tokens[begin:end])], dtype=torch.long)
                rows.append(self.model.forward(ids, self.cache)[0, :, :vocab].float())  # advances the cache
            return torch.log_softmax(torch.cat(rows, dim=0), dim=-1)

    def next_token_logprobs(self, req: dict[str, Any]) -> dict[str, Any]:
        import numpy as np

        tokens = req["tokens"]
        rows = self._logprobs(tokens, range(0, len(tokens), SCORE_CHUNK)).cpu().numpy()
        # Whole distributions are too big for a JSON line: they go through a file.
        fd, path = tempfile.mkstemp(suffix=".npy", dir=req.get("out_dir") or None)
        with os.fdopen(fd, "wb") as f:
            np.save(f, rows.astype(np.float32))
        return {"array_path": path, "shape": list(rows.shape)}

    def loglikelihood(self, req: dict[str, Any]) -> dict[str, Any]:
        settings = self._require()
        out = []
        for context, continuation in req["requests"]:
            ctx_ids = self.tokenizer.encode(context, add_bos=True)[0].tolist()
            cont_ids = self.tokenizer.encode(continuation, add_bos=False)[0].tolist()
            if not cont_ids:
                raise ConfigError(f"continuation {continuation[:40]!r} has no tokens")
            tokens = (ctx_ids + cont_ids)[-settings.cache_max_seq_len :]
            n = len(cont_ids)
            # The rows that predict the continuation come from a second pass over the cached
            # context, as when a server decodes an answer after its prompt.
            rows = self._logprobs(tokens, [0, len(tokens) - n - 1])
            # Row i predicts token i+1: the continuation's tokens are predicted by the rows before them.
            pred = rows[len(tokens) - n - 1 : len(tokens) - 1]
            target = self.torch.tensor(tokens[-n:], device=pred.device)
            logprob = float(pred.gather(1, target[:, None]).sum())
            greedy = bool((pred.argmax(dim=-1) == target).all())
            out.append({"logprob": logprob, "is_greedy": greedy, "n_tokens": n})
        return {"results": out}

    def handlers(self) -> dict[str, Callable[[dict[str, Any]], Mapping[str, Any]]]:
        return {
            "load": self.load,
            "sample": self.sample,
            "tokenize": self.tokenize,
            "loglikelihood": self.loglikelihood,
            "next_token_logprobs": self.next_token_logprobs,
        }


def main() -> int:
    return serve_engine(Engine())


if __name__ == "__main__":
    sys.exit(main())
