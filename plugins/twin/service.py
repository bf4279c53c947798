"""How a batch of ``P`` requests is served when the engine runs only ``j`` of them at once.

autotune's protocol sends ``P`` requests together and measures the aggregate (all output tokens
over the wall time), the median stream's decode rate (per user) and the median time to first
token (autotune/measure/streams.py). An engine that takes every request at once decodes them
in one batch; one that holds ``j < P`` sequences (ExLlamaV2's dynamic generator without paged
attention holds one: its engine model's ``jobs_at_once``) serves them in waves of ``j``:
each wave prefills its prompts and decodes at the ``j``-stream step, and the others wait.
"""

from __future__ import annotations

import statistics


def served(
    parallel: int, jobs: int, prompt_s: float, output_tokens: int, step_s: float, request_s: float
) -> tuple[float, float, float]:
    """(aggregate tok/s, per-user tok/s, median TTFT in s) for ``parallel`` requests served in waves
    of ``jobs``: ``prompt_s`` prefills one prompt, ``step_s`` is one decode step of ``jobs``
    streams. Each wave's streams wait for the waves before them, and their per-user speed counts
    that wait (served one at a time, the fourth user of four reads at a quarter of the rate
    from the moment all four were sent, not at the single-stream rate)."""
    jobs = max(1, min(jobs, parallel))
    wave_s = jobs * prompt_s + output_tokens * step_s
    full, rest = divmod(parallel, jobs)
    # Written so that P requests one at a time give exactly the single request's aggregate.
    wall = request_s + full * wave_s + (rest * prompt_s + output_tokens * step_s if rest else 0.0)
    ttft = [i // jobs * wave_s + jobs * prompt_s + step_s for i in range(parallel)]
    # Per user as autotune measures it (ConcurrentResult.per_user_tok_s): each stream's decode
    # rate over its decode time plus its wait behind the earlier waves, the median stream's.
    decode_s = max(output_tokens - 1, 1) * step_s
    per_user = statistics.median(decode_s / step_s / (decode_s + t - ttft[0]) for t in ttft)
    return parallel * output_tokens / wall, per_user, statistics.median(ttft)
