"""Speculative decoding's acceptance as the engine counted it over a trial's requests.

Acceptance depends on the text the model writes, so it is measured on the study's own
workload and never assumed: a backend counts, per request, the tokens its engine drafted and
the tokens the target accepted (the engine's own counters, e.g. llama-server's ``timings``),
and :func:`total` sums them over the trial's measured requests. The trial stores the result
whole as its ``acceptance`` field (``study/records.py``); a configuration that does not
speculate stores none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

__all__ = ["ACCEPTANCE_ATTR", "Acceptance", "DraftCount", "total"]

# The key of a Measurement's attrs that carries the trial's acceptance (records.measurement_fields
# moves it to the trial's own field).
ACCEPTANCE_ATTR = "acceptance"


@dataclass(frozen=True)
class DraftCount:
    """One request's counters, as its engine reported them.

    Args:
        drafted: Tokens the draft (a model, MTP head or n-gram lookup) proposed.
        accepted: Of those, the tokens the target accepted.
        generated: Tokens the request generated in all (the accepted ones included).
        passes: The target's verification passes, where the engine reports them (None: not).
    """

    drafted: int
    accepted: int
    generated: int
    passes: int | None = None


@dataclass(frozen=True)
class Acceptance:
    """A trial's acceptance: the sums of its requests' counters.

    ``rate`` is accepted / drafted (None when nothing was drafted: a lookup that never found a
    match drafts nothing, which is itself the finding). ``tokens_per_pass`` is the mean tokens
    each target pass produced (1 + accepted / passes), only where the engine counts its passes.
    """

    requests: int
    drafted: int
    accepted: int
    generated: int
    passes: int | None = None

    @property
    def rate(self) -> float | None:
        return self.accepted / self.drafted if self.drafted else None

    @property
    def tokens_per_pass(self) -> float | None:
        return 1 + self.accepted / self.passes if self.passes else None

    @property
    def accepted_share(self) -> float | None:
        """Accepted draft tokens as a share of all generated tokens: what speculation saved."""
        return self.accepted / self.generated if self.generated else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "drafted": self.drafted,
            "accepted": self.accepted,
            "generated": self.generated,
            "rate": self.rate,
            "passes": self.passes,
            "tokens_per_pass": self.tokens_per_pass,
            "accepted_share": self.accepted_share,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Acceptance":
        return cls(
            int(d["requests"]),
            int(d["drafted"]),
            int(d["accepted"]),
            int(d["generated"]),
            None if d.get("passes") is None else int(d["passes"]),
        )


def total(counts: Iterable[DraftCount]) -> Acceptance:
    """The sums over a trial's requests; passes only if every request reported them.

    Raises:
        ValueError: a request that accepted more than it drafted, or a negative count (an
            engine's counters misread; stored, it would price speculation on a fiction).
    """
    counts = list(counts)
    for c in counts:
        if c.drafted < 0 or c.accepted < 0 or c.accepted > c.drafted:
            raise ValueError(f"draft counters out of range: {c.accepted} accepted of {c.drafted} drafted")
    passes = None if not counts or any(c.passes is None for c in counts) else sum(c.passes for c in counts)  # type: ignore[misc]
    return Acceptance(
        len(counts),
        sum(c.drafted for c in counts),
        sum(c.accepted for c in counts),
        sum(c.generated for c in counts),
        passes,
    )
