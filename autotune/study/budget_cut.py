"""What a budget cuts short: the baselines' share of it, and the words for a measurement it ended
(issue 39 item 3). Apart from :mod:`.cost`, whose forecast reads the baselines, so that the
baselines can use these without importing the forecast."""

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
