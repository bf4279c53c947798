"""The lm-eval model adapter: lm-eval's ``LM`` interface over an ``autotune.engine.scoring.Scorer``.

lm-eval builds the prompts and computes the metrics; the backend's scorer only answers
log-likelihood requests. Multiple-choice tasks (MMLU, C-Eval) need nothing else, so the
generative and rolling request types say plainly that they are not served.
"""

from __future__ import annotations

from typing import Any, Callable

from autotune.api import AutotuneError
from autotune._builtin import Scorer

__all__ = ["ScorerLM", "lm_eval_missing", "require_lm_eval"]

# Requests handed to the scorer at once: big enough for an engine to share work, small enough
# that progress moves on a slow CPU.
BATCH = 32


def lm_eval_missing() -> str | None:
    """Why lm-eval cannot be used here (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("lm_eval") is None:
        return "lm-eval is not installed: pip install 'autotune[quality]'"
    return None


def require_lm_eval() -> None:
    """Raise the clear message when lm-eval is missing."""
    why = lm_eval_missing()
    if why:
        raise AutotuneError(why)


def _lm_base() -> type:
    require_lm_eval()
    from lm_eval.api.model import LM

    return LM


def ScorerLM(scorer: Scorer, progress: Callable[[int], None] | None = None) -> Any:
    """An ``lm_eval.api.model.LM`` answering through ``scorer``.

    A factory, because the class derives from lm-eval's, which is imported only when used (the
    ``quality`` extra is optional).

    Args:
        scorer: The backend's scorer on the artifact under test.
        progress: Called with the number of requests answered after each batch.
    """

    class _ScorerLM(_lm_base()):
        def loglikelihood(self, requests, disable_tqdm: bool = False):
            out: list[tuple[float, bool]] = []
            for start in range(0, len(requests), BATCH):
                batch = [req.args for req in requests[start : start + BATCH]]
                out += [(r.logprob, r.is_greedy) for r in scorer.loglikelihood(batch)]
                if progress is not None:
                    progress(len(batch))
            return out

        def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
            raise AutotuneError(
                "autotune's lm-eval adapter scores multiple-choice tasks only (no rolling log-likelihood)"
            )

        def generate_until(self, requests, disable_tqdm: bool = False):
            raise AutotuneError("autotune's lm-eval adapter scores multiple-choice tasks only (no generation)")

    return _ScorerLM()
