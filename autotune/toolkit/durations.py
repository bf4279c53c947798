"""Durations as people write them (``2h``, ``45m``, ``2h30m``, or seconds), read into seconds with
the limits a budget must keep."""

from __future__ import annotations

import math
import re
from autotune.errors import ConfigError
from autotune.toolkit.fields import show, show_long


# Hours, minutes and seconds, each at most once and in that order ("2h30m", "90m", "1.5h"). Each
# number is followed by its letter, so a run of digits is tried once per unit: linear in the
# input, which is cut at _DURATION_CHARS before it is matched anyway.
_DURATION = re.compile(r"(?:(\d+(?:\.\d+)?)\s*h)?\s*(?:(\d+(?:\.\d+)?)\s*m)?\s*(?:(\d+(?:\.\d+)?)\s*s)?")
_DURATION_CHARS = 40
# A budget of more than a year is a typo of unit (99999999999999999h ran as no budget at all).
MAX_DURATION_S = 365 * 86400


def parse_duration(text: str | int | float, source: str = "--budget") -> float:
    """``'2h'``, ``'45m'``, ``'90s'``, ``'2h30m'`` (or a number of seconds) -> seconds.

    Raises:
        ConfigError: not a duration, none, or more than a year; the message quotes ``source``,
            the value (cut when long) and what would be accepted.
    """
    accepted = "e.g. 90m or 2h"
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        if not math.isfinite(text) or text <= 0:
            raise ConfigError(
                f"{source} {show(text)}: must be a finite number of seconds > 0, or a string such as '90m' or '2h'"
            )
        seconds = float(text)
    else:
        typed = str(text)
        stripped = typed.strip()
        if len(typed) > _DURATION_CHARS:
            raise ConfigError(
                f"{source} {show_long(typed)}: too long for a duration; give a finite one, a number "
                f"with s, m or h, {accepted}"
            )
        match = _DURATION.fullmatch(stripped)
        if not stripped or not match or not any(match.groups()):
            bare = re.fullmatch(r"(\d+)\s*h\s*(\d+)", stripped)
            if bare:  # "2h30": minutes meant, the unit left off
                minutes = int(bare.group(1)) * 60 + int(bare.group(2))
                raise ConfigError(
                    f"{source} {typed!r}: the last number has no unit; write '{minutes}m' or "
                    f"'{bare.group(1)}h{bare.group(2)}m'"
                )
            raise ConfigError(f"{source} {typed!r}: use a number with s, m or h, {accepted}")
        h, m, s = (float(g) if g else 0.0 for g in match.groups())
        seconds = h * 3600 + m * 60 + s
        if not math.isfinite(seconds):  # 400 digits overflow to inf: no budget at all, said as one
            raise ConfigError(
                f"{source} {show_long(typed)}: too large for a number of seconds; give a finite duration, {accepted}"
            )
        if seconds <= 0:
            raise ConfigError(f"{source} {typed!r}: must be more than no time, {accepted}")
    if seconds > MAX_DURATION_S:
        raise ConfigError(
            f"{source} {show_long(str(text))}: more than a year ({MAX_DURATION_S // 3600}h), a typo of "
            f"unit; give a duration up to 8760h, {accepted}"
        )
    return seconds
