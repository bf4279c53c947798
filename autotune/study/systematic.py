"""Failures that every next trial would repeat: found from the trials' own failures, so that a
study that cannot succeed stops with the cause instead of spending its budget on it.

A study of a Hugging Face model whose tokenizer llama.cpp's converter did not recognise failed
217 trials with one error ("BPE pre-tokenizer was not recognized") and exited 0 (issue 28).
The preflight cannot find every such cause (the converter's tokenizer table is only read when
it runs), so the runner watches what fails: when the launches that need one thing (a backend's
weights-making, that is its converter, or its engine) have all failed so far, ``STREAK`` of them
in a row with the same cause once numbers and paths are set aside, the study stops with exit 2.

A configuration's own failure never stops it: out of memory is a property of the configuration
(a larger context, more slots), and a scope that has worked once in this run is not broken.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from autotune.study.summary import failure_kind

# Three in a row: one failure can be a configuration's; two alike can be chance (two configurations
# too large for the same reason); three launches of different configurations failing with the same
# message, where none has ever worked, is the engine or the converter, not the configurations.
STREAK = 3

_PATH = re.compile(r"(?:[A-Za-z]:)?(?:/[^\s:'\",]+)+")
_NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+(?:\.\d+)?")


def making(backend: str) -> str:
    """The scope of making a backend's weights (its converter and quantizer)."""
    return f"{backend}: making weights"


def launching(backend: str) -> str:
    """The scope of launching a backend's engine."""
    return f"{backend}: launching the engine"


def normalized(reason: str) -> str:
    """A failure's reason with what differs between configurations set aside: paths, numbers."""
    text = _NUMBER.sub("N", _PATH.sub("<path>", reason.strip()))
    return " ".join(text.split()).lower()


@dataclass(frozen=True)
class SystematicFailure:
    """What stopped the study: the scope (``<backend>: making weights`` or ``<backend>:
    launching the engine``), the cause (the last failure's reason) and how many in a row."""

    scope: str
    cause: str
    count: int

    @property
    def remedy(self) -> str:
        return (
            "every one so far failed the same way, so every next one would too: fix the cause (the "
            "engine's or the tool's own message above), then run the same command again; the study "
            "continues where it stopped"
        )

    @property
    def text(self) -> str:
        return f"{self.scope}: {self.count} failures in a row with the same cause: {self.cause}; {self.remedy}"

    def as_dict(self) -> dict[str, object]:
        return {"scope": self.scope, "cause": self.cause, "count": self.count, "remedy": self.remedy, "text": self.text}


@dataclass
class FailureWatch:
    """The runner's record of failures by scope, in this run."""

    streak: int = STREAK
    _worked: set[str] = field(default_factory=set)
    _last: dict[str, tuple[str, int]] = field(default_factory=dict)

    def worked(self, *scopes: str) -> None:
        """These scopes did their part in a trial: they are not systematically broken."""
        for scope in scopes:
            self._worked.add(scope)
            self._last.pop(scope, None)

    def failed(self, scope: str, reason: str) -> SystematicFailure | None:
        """One failure in ``scope``; the systematic failure, once this one makes it so."""
        if scope in self._worked or failure_kind(reason) == "out of memory":
            return None
        cause = normalized(reason)
        before, n = self._last.get(scope, ("", 0))
        n = n + 1 if before == cause else 1
        self._last[scope] = (cause, n)
        return SystematicFailure(scope, reason, n) if n >= self.streak else None
