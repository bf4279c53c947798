"""The one judge of "can this configuration run, and be accepted, without launching it?".

In order: the rules (the core's and the backend's ``check``), the memory model with what this
study learned about it (the median of measured - predicted peaks, per backend), the part a
configuration leaves in host memory against this machine's memory, and an
already-measured quality drop over the study's bound. The runner, the sampler's screening,
the prior's ranking, the pre-search screen, the report's "why not a neighbour", ``autotune
init`` (which formats can fit) and ``autotune estimate`` all ask this judge, with the budget
:func:`budget_of` gives, so they cannot disagree.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Mapping

from autotune.hardware import gpus as hardware
from autotune.study import objective as objective_mod
from autotune.engine import vram
from autotune.engine.backend import MemoryEstimate, StudyContext, TrialConfig
from autotune.config import Objective
from autotune.hardware.placement import check_cards
from autotune.engine.space import BackendSpace, SearchSpace

if TYPE_CHECKING:  # pragma: no cover
    from autotune.engine.backend import BaseBackend, Param
    from autotune.hardware.gpus import GpuSpec
    from autotune.study.quality import QualityBook

ADMITTED, INVALID, OVER_BUDGET, LOW_QUALITY = "admitted", "invalid", "over_budget", "low_quality"


@dataclass(frozen=True)
class Budget:
    """What a configuration may hold in device memory, and where the figure comes from.

    Args:
        memory_bytes: The card's memory, or the cap a study file sets ([hardware]
            vram_budget_gib; on the CPU, the share of host memory ``init`` writes there).
        margin_bytes: Kept free of it ([hardware] safety_margin_mib).
        memory_source: What ``memory_bytes`` is, for people ("Tesla V100-SXM2-16GB's memory").
    """

    memory_bytes: int
    margin_bytes: int
    memory_source: str

    @property
    def bytes(self) -> int:
        return self.memory_bytes - self.margin_bytes

    def describe(self) -> str:
        """Where the budget comes from: "15.00 GiB (Tesla T4's memory) - 0.25 GiB safety margin"."""
        return f"{_gib(self.memory_bytes)} GiB ({self.memory_source}) - {_gib(self.margin_bytes)} GiB safety margin"


def budget_text(n_bytes: int | None) -> str:
    """The study's memory budget as every output says it (the run's header, the judge's
    refusals, why not a neighbour, the report, its plot, ``estimate``): what a configuration
    may use, the safety margin already off, in GiB to two decimals: one figure, one rounding
    (``[hardware] vram_budget_gib`` is the memory before the margin, and ``init`` says both)."""
    return "-" if n_bytes is None else f"{n_bytes / 2**30:.2f} GiB"


def budget_of(gpu: "GpuSpec", cap_bytes: int | None, margin_bytes: int) -> Budget:
    """The budget of a study on ``gpu``: its cap, else the card's memory, less the margin."""
    if cap_bytes:
        return Budget(cap_bytes, margin_bytes, "[hardware] vram_budget_gib")
    return Budget(gpu.vram_bytes, margin_bytes, "host memory" if gpu.is_cpu else f"{gpu.name}'s memory")


@dataclass(frozen=True)
class Verdict:
    """The judge's answer.

    Args:
        kind: ``admitted``, ``invalid``, ``over_budget`` or ``low_quality``.
        reason: Why it was refused, for people (None when admitted).
        estimate: The memory prediction, learned correction included (None when invalid).
        raw_total_bytes: The backend's own prediction, before the correction.
        constraints: What Optuna is told of a refused configuration that never ran.
        quality_drop_points: The known drop that refused it (``low_quality`` only).
        reasons: The rules it breaks, one each (``invalid`` only).
    """

    kind: str
    reason: str | None = None
    estimate: MemoryEstimate | None = None
    raw_total_bytes: int | None = None
    constraints: Mapping[str, float] = field(default_factory=dict)
    quality_drop_points: float | None = None
    reasons: tuple[str, ...] = ()

    @property
    def admitted(self) -> bool:
        return self.kind == ADMITTED


def _lighter(a: Verdict, b: Verdict) -> bool:
    """Whether ``a`` is the lighter of two verdicts with estimates: one the judge admits before
    one it refuses (a split that fits the card can still be over host memory), then the smaller
    footprint on the card."""
    assert a.estimate is not None and b.estimate is not None
    return (not a.admitted, a.estimate.total_bytes) < (not b.admitted, b.estimate.total_bytes)


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f}"


class Admission:
    """Judges configurations of one study.

    Args:
        space: The search space (its ``check`` holds the rules).
        contexts: Each backend's study context (its budget among them).
        objective: The study's objective (its quality bound).
        quality: The study's quality values (None: quality is not judged).
        residuals: Measured - predicted peak bytes by backend, learned so far.
    """

    def __init__(
        self,
        space: SearchSpace,
        contexts: Mapping[str, StudyContext],
        objective: Objective,
        quality: "QualityBook | None" = None,
        residuals: Mapping[str, list[int]] | None = None,
    ):
        self.space = space
        self.contexts = contexts
        self.objective = objective
        self.quality = quality
        self.residuals: dict[str, list[int]] = {k: list(v) for k, v in (residuals or {}).items()}
        self._memo: dict[str, Verdict] = {}

    @classmethod
    def for_backend(
        cls,
        backend: "BaseBackend",
        ctx: StudyContext,
        objective: Objective | None = None,
        residuals: list[int] | None = None,
    ) -> "Admission":
        """The judge of one backend's configurations outside a study's search (``init``,
        ``estimate``): the same rules, memory model and budget, with ``residuals`` the
        measured - predicted peaks a stored study learned for this backend."""
        # The space's values are not asked: the judge reads only the backend and the rules.
        space = SearchSpace([BackendSpace(backend, (), (), (), ())])
        return cls(
            space, {backend.name: ctx}, objective or Objective(), None, {backend.name: residuals} if residuals else None
        )

    def correction(self, backend: str) -> tuple[int | None, int]:
        """Bytes the judge adds to ``backend``'s predictions (None: nothing learned), and from
        how many measured trials."""
        found = self.residuals.get(backend, [])
        return vram.learned_correction(found), len(found)

    def learn(self, backend: str, residual_bytes: int) -> None:
        """Add one measured - predicted peak; every later memory verdict uses it."""
        self.residuals.setdefault(backend, []).append(int(residual_bytes))
        self._memo.clear()

    def memory(self, config: TrialConfig) -> tuple[MemoryEstimate, int]:
        """The backend's estimate plus what the study learned about it; and the raw total."""
        backend = self.space.entries[config.backend].backend
        raw = backend.estimate_memory(config, self.contexts[config.backend])
        return vram.apply_correction(raw, *self.correction(config.backend)), raw.total_bytes

    def judge(self, config: TrialConfig) -> Verdict:
        """Rules, then memory, then an already-measured quality drop."""
        verdict = self._memo.get(config.key)
        if verdict is None:
            verdict = self._memo[config.key] = self._rules_and_memory(config)
        if verdict.admitted and self.quality is not None:
            low = self._known_low_quality(config)
            if low is not None:
                return low
        return verdict

    def _rules_and_memory(self, config: TrialConfig) -> Verdict:
        ctx = self.contexts[config.backend]
        reasons = self.space.check(config, ctx)
        if reasons:
            return Verdict(
                INVALID,
                "invalid: " + "; ".join(reasons),
                constraints=objective_mod.unmeasured_constraints(self.objective),
                reasons=tuple(reasons),
            )
        estimate, raw = self.memory(config)
        budget = ctx.vram_budget_bytes
        if estimate.total_bytes > budget:
            e = estimate
            reason = (
                f"infeasible: predicted {_gib(e.total_bytes)} GiB > budget {budget_text(budget)} (weights "
                f"{_gib(e.weights_bytes)}, KV {_gib(e.kv_bytes)}, buffers {_gib(e.buffers_bytes)}, "
                f"overhead {_gib(e.overhead_bytes)} GiB)"
            )
            over = objective_mod.vram_constraint(e.total_bytes, budget)
            return Verdict(
                OVER_BUDGET, reason, estimate, raw, objective_mod.unmeasured_constraints(self.objective, over)
            )
        # Several cards: each holds its own share, within its own budget (autotune.hardware.placement).
        cards = getattr(ctx, "placement", None)
        if cards is not None and estimate.per_device_bytes:
            why = check_cards(estimate.per_device_bytes, cards)
            if why:
                over = max(
                    objective_mod.vram_constraint(b, c.budget_bytes)
                    for b, c in zip(estimate.per_device_bytes, cards.cards)
                )
                return Verdict(
                    OVER_BUDGET,
                    f"infeasible: per card, {why}",
                    estimate,
                    raw,
                    objective_mod.unmeasured_constraints(self.objective, over),
                )
        host = estimate.host_bytes + estimate.host_buffers_bytes
        # On the CPU the budget above is host memory already; on a GPU what the card does not
        # hold (layers or experts left on the host, their cache, pinned buffers) must fit the host.
        if host and not getattr(ctx.gpu, "is_cpu", False) and host > self.host_memory_bytes:
            e = estimate
            reason = (
                f"infeasible: predicted {_gib(host)} GiB in host memory > {_gib(self.host_memory_bytes)} GiB "
                f"(this machine's memory; weights and KV left on the host {_gib(e.host_bytes)}, host "
                f"buffers {_gib(e.host_buffers_bytes)} GiB)"
            )
            over = objective_mod.vram_constraint(host, self.host_memory_bytes)
            return Verdict(
                OVER_BUDGET, reason, estimate, raw, objective_mod.unmeasured_constraints(self.objective, over)
            )
        return Verdict(ADMITTED, None, estimate, raw)

    @functools.cached_property
    def host_memory_bytes(self) -> int:
        """This machine's memory, which a configuration's host part must fit (read once)."""
        return hardware.host_memory_bytes()

    def _known_low_quality(self, config: TrialConfig) -> Verdict | None:
        limit = self.objective.max_drop_points
        drop = self.quality.cached_drop(config) if self.quality is not None and limit is not None else None
        if drop is None or limit is None:
            return None
        if drop.admitted is None:  # only a point estimate: the bound applies to it
            if drop.points <= limit:
                return None
            metric = self.quality.metric
            assert metric is not None
            reason = f"infeasible: quality {metric.drop_text(drop.points)} > max {metric.bound_text(limit)}"
        elif drop.admitted:
            return None
        else:
            reason = f"infeasible: quality {drop.reason} (max_drop_points {limit:g})"
        constraints = objective_mod.unmeasured_constraints(self.objective, 0.0)
        constraints[objective_mod.QUALITY] = max(drop.points - limit, objective_mod.QUALITY_REFUSED)
        base = self._memo[config.key]
        return Verdict(LOW_QUALITY, reason, base.estimate, base.raw_total_bytes, constraints, drop.points)

    def lightest(
        self, base: TrialConfig, params: "tuple[Param, ...] | list[Param]"
    ) -> tuple[TrialConfig, Verdict] | None:
        """Of ``base`` under each combination of ``params``' choices, the one the rules accept
        with the smallest footprint (learned correction included; an admitted one first), and its
        verdict; when the rules accept none, the last one and its ``invalid`` verdict (None: no
        combination)."""
        best: tuple[TrialConfig, Verdict] | None = None
        refused: tuple[TrialConfig, Verdict] | None = None
        for combo in itertools.product(*(p.choices for p in params)):
            config = replace(base, options=tuple(sorted(zip((p.name for p in params), combo))))
            verdict = self.judge(config)
            if verdict.estimate is None:
                refused = (config, verdict)
            elif best is None or _lighter(verdict, best[1]):
                best = (config, verdict)
        return best or refused

    def never_fits(self, config: TrialConfig, verdict: Verdict) -> str:
        """Why weights never fit, from their lightest configuration's verdict (``lightest``)."""
        e, budget = verdict.estimate, self.contexts[config.backend].vram_budget_bytes
        assert e is not None
        if e.total_bytes <= budget:  # the card would hold it: host memory would not
            return (
                f"{config.backend}: weights {config.weights} never fit: even ctx {config.ctx} x {config.parallel} "
                f"is {verdict.reason}"
            )
        return (
            f"{config.backend}: weights {config.weights} never fit: even ctx {config.ctx} x {config.parallel} "
            f"needs {_gib(e.total_bytes)} GiB (weights {_gib(e.weights_bytes)}) > budget {budget_text(budget)}"
        )

    def screen(self, entry: BackendSpace) -> tuple[BackendSpace | None, list[str]]:
        """Drop values that no configuration can use, before the sampler ever sees them.

        A context shorter than one sequence of the workload is never valid, and weights whose
        lightest configuration (shortest ctx, one slot, least memory-hungry options) is over
        the budget never fit. Trials spent on them would teach the sampler nothing the rules
        and the memory model do not already know.

        Returns:
            The narrowed space (None when nothing is left) and one line per value dropped.
        """
        notes: list[str] = []
        name = entry.backend.name
        ctx = self.contexts[name]
        need = ctx.workload.sequence_tokens
        ctx_ok = tuple(c for c in entry.ctx if c >= need)
        for c in entry.ctx:
            if c < need:
                notes.append(f"{name}: ctx {c} cannot hold the workload ({ctx.workload.need_text})")
        if not ctx_ok:
            return None, notes
        lightest_ctx, lightest_parallel = min(ctx_ok), min(entry.parallel)
        weights_ok = []
        for w in entry.weights:
            lightest = self.lightest(TrialConfig(name, w, lightest_ctx, lightest_parallel), entry.params)
            if lightest is not None and lightest[1].kind == OVER_BUDGET:
                notes.append(self.never_fits(*lightest))
            else:
                weights_ok.append(w)
        if not weights_ok:
            return None, notes
        return BackendSpace(entry.backend, tuple(weights_ok), ctx_ok, entry.parallel, entry.params), notes
