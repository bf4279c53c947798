"""exllamav3's scorer, the worker's side: log-probabilities from the loaded model's forward passes.

The worker (:mod:`.worker`) loads a model for scoring (``load`` with ``purpose = "score"``:
the cache, no generator) and answers ``tokenize``, ``loglikelihood`` and
``next_token_logprobs`` through :class:`PassScorer`, which the parent's scorer
(:mod:`.scorer`) asks over the workers' protocol. The requests and replies are those of
ExLlamaV2's worker, so one parent class serves both engines.

How tokens go through the model decides what is measured:

* **Passes through the cache.** exllamav3's attention (modules/attn.py, cache/quant.py) reads
  earlier positions back from the cache, dequantized, and attends over a pass's own keys and
  values in FP16 before quantizing them into it. One pass over a whole text would hide a
  quantized cache's damage, as it did for ExLlamaV2 on the H200
  (bench/results/h200_exllamav2_scorer_check.md), so a text is scored in passes of
  ``SCORE_CHUNK`` tokens and a continuation in a pass after its context, as ExLlamaV2's scorer
  does (the same pass boundaries: EXL2 and EXL3 figures compare).
* **A context prefilled once.** The answers of a multiple-choice question share their context;
  it is prefilled (chunks of the generator's ``max_chunk_size``, rows not taken) once, and each
  answer's pass starts at the context's last token. The cache is reused only when it holds
  what a fresh prefill of the same tokens wrote (the same passes: GPU kernels may round
  differently for other shapes), so an answer's log-likelihood does not depend on which
  request came before it.
* **Rows.** log-softmax over the model's ``vocab_size`` logits (exllamav3 pads its head and
  crops to that width itself, model.py ``lm_head_argmax``), computed on the GPU; only the
  rows asked for leave it.

Nothing here imports torch or exllamav3 at module level: :func:`exllamav3_forward` is given
them by the worker, and tests drive :class:`PassScorer` with a fake forward pass.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from autotune._builtin import ConfigError, LogLikelihood, Scorer

from autotune_plugins.shared.pass_scoring import SCORE_CHUNK, score_passes

__all__ = ["Forward", "PassScorer", "exllamav3_forward", "handlers"]

#: One forward pass: ``(ids, past_len, rows)`` puts ``ids`` at positions ``past_len``... of the
#: one sequence in the cache, attending to what earlier passes left at the positions before,
#: and writes their keys and values; with ``rows`` it returns their log-softmax rows, float32
#: of shape ``(len(ids), n_vocab)`` (row ``i`` predicts the token after ``ids[i]``), else None.
Forward = Callable[[Sequence[int], int, bool], "np.ndarray | None"]


class PassScorer(Scorer):
    """A :class:`~autotune.engine.scoring.Scorer` over one sequence's forward passes through a cache.

    Args:
        encode: ``(text, add_bos)`` -> token ids (no special-token parsing).
        forward: One pass (:data:`Forward`).
        n_vocab: Width of the rows ``forward`` returns.
        n_ctx: Positions the cache holds for the sequence.
        chunk: The longest prefill pass (the generator's ``max_chunk_size``).
        description: What is loaded.
    """

    def __init__(
        self,
        encode: Callable[[str, bool], Sequence[int]],
        forward: Forward,
        n_vocab: int,
        n_ctx: int,
        chunk: int,
        description: str = "",
    ):
        self._encode = encode
        self._forward = forward
        self.n_vocab = int(n_vocab)
        self.n_ctx = int(n_ctx)
        self.chunk = int(chunk)
        self.description = description
        # The tokens whose keys and values the cache holds from position 0 as a chunked prefill
        # of exactly them writes them; [] when the cache holds anything else.
        self._prefilled: list[int] = []

    def tokenize(self, text: str, *, add_bos: bool = False) -> list[int]:
        return [int(t) for t in self._encode(text, add_bos)]

    def _rows(self, tokens: Sequence[int], begin: int, end: int, step: int) -> np.ndarray:
        """Rows for ``tokens[begin:end]`` in passes of at most ``step`` tokens, on top of the cache."""
        out = []
        for b, e in score_passes(end - begin, range(0, end - begin, step)):
            rows = self._forward(tokens[begin + b : begin + e], begin + b, True)
            assert rows is not None
            out.append(np.asarray(rows, dtype=np.float32))
        return np.concatenate(out, axis=0)

    def _prefill(self, tokens: Sequence[int], end: int) -> None:
        """Leave ``tokens[:end]`` in the cache, prefilled in chunks, unless it is there already."""
        want = [int(t) for t in tokens[:end]]
        if self._prefilled == want:  # only the same prefill: kernels may round otherwise for other shapes
            return
        self._prefilled = []  # a failure half-way leaves nothing that could be mistaken for reuse
        for begin in range(0, end, self.chunk):
            self._forward(want[begin : min(begin + self.chunk, end)], begin, False)
        self._prefilled = want

    def next_token_logprobs(self, tokens: Sequence[int]) -> np.ndarray:
        tokens = [int(t) for t in tokens]
        if not 1 <= len(tokens) <= self.n_ctx:
            raise ConfigError(f"{len(tokens)} tokens: score between 1 and {self.n_ctx} (the scorer's context)")
        self._prefilled = []  # these passes overwrite what a prefill left
        return self._rows(tokens, 0, len(tokens), SCORE_CHUNK)

    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[LogLikelihood]:
        out = []
        for context, continuation in requests:
            whole, start = self.split(context, continuation)
            if start < 1:
                raise ConfigError(
                    f"context {context[:40]!r} has no tokens (and the model adds no BOS): nothing "
                    "predicts the continuation's first token"
                )
            # Row start-1 (the context's last token) predicts the continuation's first token; the
            # pass from there reads the context back through the cache, as a server's decode does.
            self._prefill(whole, start - 1)
            rows = self._rows(whole, start - 1, len(whole) - 1, self.chunk)
            target = np.asarray(whole[start:])
            picked = rows[np.arange(len(target)), target].astype(np.float64)
            out.append(LogLikelihood(float(picked.sum()), bool(np.all(rows.argmax(axis=1) == target)), len(target)))
        return out


def handlers(scorer: Callable[[], PassScorer]) -> dict[str, Callable[[dict[str, Any]], Mapping[str, Any]]]:
    """The worker's scoring requests, answered by the scorer ``scorer()`` returns (it raises
    when no model is loaded for scoring); the replies are ExLlamaV2's worker's."""

    def tokenize(req: dict[str, Any]) -> dict[str, Any]:
        return {"tokens": scorer().tokenize(str(req["text"]), add_bos=bool(req.get("add_bos", False)))}

    def loglikelihood(req: dict[str, Any]) -> dict[str, Any]:
        found = scorer().loglikelihood([(str(c), str(x)) for c, x in req["requests"]])
        return {"results": [{"logprob": r.logprob, "is_greedy": r.is_greedy, "n_tokens": r.n_tokens} for r in found]}

    def next_token_logprobs(req: dict[str, Any]) -> dict[str, Any]:
        rows = scorer().next_token_logprobs(req["tokens"])
        # Whole distributions are too big for a JSON line: they go through a file the parent reads
        # and deletes.
        fd, path = tempfile.mkstemp(suffix=".npy", dir=req.get("out_dir") or None)
        with os.fdopen(fd, "wb") as f:
            np.save(f, rows)
        return {"array_path": path, "shape": list(rows.shape)}

    return {"tokenize": tokenize, "loglikelihood": loglikelihood, "next_token_logprobs": next_token_logprobs}


def exllamav3_forward(torch: Any, model: Any, cache: Any, n_vocab: int, seq_len: int) -> Forward:
    """:data:`Forward` over exllamav3's ``Model`` and ``Cache`` (1.6.5): one sequence in a cache
    of ``seq_len`` positions, addressed as attn.py's ``batch_shape`` mode (a block table of the
    cache's pages, ``past_len`` positions already there).

    A pass without rows runs ``model.prefill`` (it stops at the last layer that writes the
    cache, as the generator's prefill does); one with rows runs ``model.forward``.

    Raises:
        ConfigError: The model has recurrent layers (their state lives outside the cache's pages
            and the generator carries it between passes; these passes do not).
    """
    recurrent = [getattr(m, "key", "?") for m in model if (getattr(m, "caps", None) or {}).get("recurrent_cache")]
    if recurrent:
        raise ConfigError(
            f"the scorer runs models whose only state is the K/V cache; {recurrent[0]} and "
            f"{len(recurrent) - 1} more layers keep a recurrent state"
        )

    def forward(ids: Sequence[int], past_len: int, rows: bool) -> np.ndarray | None:
        if past_len + len(ids) > seq_len:
            raise ConfigError(f"positions {past_len}..{past_len + len(ids)} exceed the scorer's cache of {seq_len}")
        x = torch.tensor([list(ids)], dtype=torch.long)
        params = {"attn_mode": "flash_attn", "cache": cache, "batch_shape": (1, seq_len), "past_len": past_len}
        with torch.inference_mode():
            if not rows:
                model.prefill(x, params)
                return None
            logits = model.forward(x, params)[0, :, :n_vocab].float()
            return torch.log_softmax(logits, dim=-1).cpu().numpy()

    return forward
