"""A quality scorer over an engine worker process that holds the model (``autotune.engine.scoring``):
the protocol both exllama workers answer (tokenize, loglikelihood, next_token_logprobs); each
engine's plugin says how its worker is opened."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from autotune.api import BackendError
from autotune._builtin import LogLikelihood, Scorer, ScoringError

from autotune_plugins.shared.worker_process import WorkerProcess

if TYPE_CHECKING:  # pragma: no cover
    import numpy as np

__all__ = ["WorkerScorer"]


class WorkerScorer(Scorer):
    """A :class:`~autotune.engine.scoring.Scorer` over one worker that holds the model."""

    def __init__(
        self, worker: WorkerProcess, tmp_dir: Path, n_vocab: int, n_ctx: int, description: str, request_timeout_s: float
    ):
        self.worker = worker
        self.tmp_dir = tmp_dir
        self.n_vocab = n_vocab
        self.n_ctx = n_ctx
        self.description = description
        self.request_timeout_s = request_timeout_s
        self._closed = False

    def _ask(self, op: str, **fields):
        if self._closed:
            raise ScoringError(f"scorer {self.description} is closed")
        try:
            return self.worker.request(op, self.request_timeout_s, **fields)
        except BackendError as exc:
            raise ScoringError(str(exc)) from exc

    def tokenize(self, text: str, *, add_bos: bool = False) -> list[int]:
        return [int(t) for t in self._ask("tokenize", text=text, add_bos=add_bos)["tokens"]]

    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[LogLikelihood]:
        reply = self._ask("loglikelihood", requests=[[c, x] for c, x in requests])
        return [LogLikelihood(float(r["logprob"]), bool(r["is_greedy"]), int(r["n_tokens"])) for r in reply["results"]]

    def next_token_logprobs(self, tokens: Sequence[int]) -> "np.ndarray":
        import numpy as np

        reply = self._ask("next_token_logprobs", tokens=[int(t) for t in tokens], out_dir=str(self.tmp_dir))
        path = Path(reply["array_path"])
        try:
            return np.load(path)
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self.worker.stop()
        finally:
            shutil.rmtree(self.tmp_dir, ignore_errors=True)
