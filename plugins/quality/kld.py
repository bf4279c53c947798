"""The KL-divergence proxy: how far an artifact's next-token distributions move from a reference's.

This is what llama.cpp's ``llama-perplexity --kl-divergence`` reports for quantization
damage: on a fixed text, the mean over positions of KL(P_ref || P_artifact) and how often both
pick the same most likely token. Like that tool, the text is cut into windows evaluated from an
empty cache and only the second half of each window is scored, so every scored token has at
least half a window of context.

The text is ``data/kld_text.txt``: written for this project (released with it under
Apache-2.0), a short children's story (stories-style models have something to predict) then
plain expository prose and instructions (general models too). About 600 tokens on a 32k
vocabulary.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from importlib import resources
from typing import Callable

import numpy as np

from autotune.api import AutotuneError, MetricValue
from autotune._builtin import Scorer

__all__ = ["ReferenceDistributions", "compare", "kld_text", "reference_distributions"]

# Window length in tokens: long enough for real context, short enough for small models'
# trained context (stories260K: 512) and for n_ctx x n_vocab scores in memory.
WINDOW = 256


def kld_text() -> str:
    """The fixed text the proxy is measured on."""
    path = resources.files(__package__).joinpath("data", "kld_text.txt")
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise AutotuneError(f"{path}: the KLD text is missing; reinstall autotune") from None


@dataclass(frozen=True)
class ReferenceDistributions:
    """The reference's log-probabilities at every scored position, and the windows they came from.

    Args:
        windows: Token windows, as the reference tokenized the text.
        logprobs: One array per window, shape (scored positions, n_vocab).
        description: What the reference scorer loaded.
    """

    windows: tuple[tuple[int, ...], ...]
    logprobs: tuple[np.ndarray, ...]
    description: str

    @property
    def n_vocab(self) -> int:
        return self.logprobs[0].shape[1]


def _windows(tokens: list[int], size: int) -> list[list[int]]:
    """Consecutive windows of ``size`` tokens; a last short one is kept when it has context."""
    out = [tokens[i : i + size] for i in range(0, len(tokens), size)]
    return [w for w in out if len(w) >= 4]


def reference_distributions(scorer: Scorer, text: str | None = None) -> ReferenceDistributions:
    """Evaluate the reference once; every artifact of a study is compared with the result."""
    tokens = scorer.tokenize(text if text is not None else kld_text(), add_bos=True)
    size = min(WINDOW, scorer.n_ctx)
    windows = _windows(tokens, size)
    if not windows:
        raise AutotuneError("the KLD text gives no tokens to score")
    logprobs = tuple(scorer.next_token_logprobs(w)[len(w) // 2 :] for w in windows)
    return ReferenceDistributions(tuple(tuple(w) for w in windows), logprobs, scorer.description)


def compare(
    scorer: Scorer, reference: ReferenceDistributions, progress: Callable[[int, int], None] | None = None
) -> MetricValue:
    """KL(reference || artifact) per position, averaged, with top-1 agreement.

    Returns:
        ``value`` = mean KLD in nats, its standard error (of the mean of per-token values,
        treating tokens as independent, as llama-perplexity does), ``n`` scored tokens, and in
        ``details`` ``kld_mean``, ``kld_median``, ``kld_p99``, ``top1_agreement`` and its
        standard error.

    Raises:
        AutotuneError: The artifact's vocabulary differs from the reference's (not the same
            model: a KL divergence would be meaningless).
    """
    if scorer.n_vocab != reference.n_vocab:
        raise AutotuneError(
            f"{scorer.description}: vocabulary of {scorer.n_vocab} tokens, the reference "
            f"{reference.description} has {reference.n_vocab}: KLD needs the same model"
        )
    started = time.monotonic()
    klds, agree = [], []
    for i, (window, ref) in enumerate(zip(reference.windows, reference.logprobs)):
        mine = scorer.next_token_logprobs(window)[len(window) // 2 :]
        p = np.exp(ref.astype(np.float64))
        klds.append((p * (ref.astype(np.float64) - mine.astype(np.float64))).sum(axis=1))
        agree.append(ref.argmax(axis=1) == mine.argmax(axis=1))
        if progress is not None:
            progress(i + 1, len(reference.windows))
    kld = np.maximum(np.concatenate(klds), 0.0)  # rounding can give -1e-9 for identical rows
    top1 = np.concatenate(agree).astype(np.float64)
    n = int(kld.size)
    se = float(kld.std(ddof=1) / math.sqrt(n)) if n > 1 else None
    agreement = float(top1.mean())
    return MetricValue(
        value=float(kld.mean()),
        stderr=se,
        n=n,
        seconds=time.monotonic() - started,
        details={
            "kld_mean": float(kld.mean()),
            "kld_median": float(np.median(kld)),
            "kld_p99": float(np.percentile(kld, 99)),
            "top1_agreement": agreement,
            "top1_agreement_stderr": math.sqrt(agreement * (1 - agreement) / (n - 1)) if n > 1 else None,
            "reference": reference.description,
            "scorer": scorer.description,
        },
    )
