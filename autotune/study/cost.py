"""What measuring costs, against the study's budget (issue 39).

A budget that runs out in the middle of a measurement ends it (``measure.deadline``): that is the
budget's doing, not the engine's, and is said so ("cut short by the budget"); the configuration
or baseline is measured again by a run with time left. The baselines (``study/baseline.py``)
take at most ``BASELINE_SHARE`` of a run's budget, so that they never starve the search.
"""

from __future__ import annotations

from autotune.measure import deadline

__all__ = ["BASELINE_SHARE", "CUT_SHORT", "cut_short"]

# The most of a run's budget its baselines may take: what the user gets without tuning is worth
# knowing, but a study exists to search; a quarter leaves the search three quarters.
BASELINE_SHARE = 0.25
CUT_SHORT = "cut short by the budget"  # how every budget-ended measurement begins (summary, retries)


def cut_short(exc: BaseException) -> str | None:
    """Why a failed measurement is the budget's doing, when the deadline in force here has passed
    (it ended the requests, or the engine's loading); None when the failure is the engine's.

    The engine's own words stay in the record's log tail; the reason says what happened."""
    over = deadline.passed()
    if over is None:
        return None
    return f"{CUT_SHORT}: {over.reason} during its measurement (not the engine's failure: {exc})"
