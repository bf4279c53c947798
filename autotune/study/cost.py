"""What measuring costs, against the study's budget (issue 39).

A budget that runs out in the middle of a measurement ends it (``measure.deadline``): that is the
budget's doing, not the engine's, and is said so ("cut short by the budget"); the configuration
or baseline is measured again by a run with time left. The baselines (``study/baseline.py``)
take at most ``BASELINE_SHARE`` of a run's budget, so that they never starve the search.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Mapping

from autotune.measure.protocol import Protocol
from autotune.engine.workload import RATE_SEARCH_STEPS, Workload
from autotune import plugins
from autotune.errors import ConfigError
from autotune.study import records
from autotune.study.admission import Admission
from autotune.study.baseline import highest_precision, measure_again, title_of, user_load
from autotune.study.budget_cut import BASELINE_SHARE, CUT_SHORT, cut_short
from autotune.study.predictor import predictor_for
from autotune.study.probe import LeaderGapPruner

if TYPE_CHECKING:  # pragma: no cover
    import optuna

    from autotune.study.prepared import PreparedStudy

__all__ = [
    "BASELINE_SHARE",
    "CUT_SHORT",
    "Forecast",
    "LaunchCost",
    "cut_short",
    "forecast",
    "launch_cost",
    "run_seconds",
]

# The budget's share and its words live in budget_cut (the baselines use them without the forecast).


# ------------------------------------------------------------------------------ the forecast

# A launch loads its weights before it measures: a fixed start (process, allocator, CUDA
# context, warm kernels) and the file read. Assumed, not measured here: a page-cached or NVMe
# read runs at several GB/s, a cold network disk slower; the forecast says it is an assumption.
START_FIXED_S = 3.0
LOAD_BYTES_S = 2e9
# A budget below this share of what the baselines and one trial need is refused before
# anything runs: the forecast is a model's and may be off by about 2x either way, so a budget
# close to the need is let through (the budget then cuts what does not fit, and says so).
REFUSE_BELOW = 0.5
SAMPLED_CONFIGS = 12  # configurations predicted for the trial's cost (spread over the space)


@dataclass(frozen=True)
class LaunchCost:
    """What one launch is forecast to cost: its start, one run (the request alone, then the
    run's requests), and the runs the protocol takes (warm-ups and ``min_runs``)."""

    start_s: float
    alone_s: float
    run_s: float
    runs: int

    @property
    def seconds(self) -> float:
        # measure_engine's warm-up request, then warm-up and measured runs
        return self.start_s + self.alone_s + self.runs * self.run_s

    def with_requests(self, fraction: float) -> "LaunchCost":
        """The same launch with ``fraction`` of the run's requests."""
        return replace(self, run_s=self.alone_s + (self.run_s - self.alone_s) * fraction)

    def probed_s(self, warmup_runs: int) -> float:
        """A launch the probe stops: its warm-ups and one run."""
        return self.start_s + self.alone_s + (warmup_runs + 1) * self.run_s


def run_seconds(workload: Workload, parallel: int, predicted: Mapping[str, float]) -> tuple[float, float] | None:
    """(the request alone, one run) in seconds at the predicted rates, or None without them.

    A run is the request alone (the typical request's prompt at the prefill rate, its output at
    the decode rate), then the run's requests (``Workload.run_lengths``): their prompts at the
    prefill rate and their outputs at the aggregate rate, ``parallel`` in flight; open-loop
    arrivals take at least the span of their arrivals, and a rate search sends its bisection's
    loads first (``RATE_SEARCH_STEPS`` of them, then the run)."""
    decode, agg = predicted.get("decode_tok_s"), predicted.get("aggregate_tok_s")
    prefill = predicted.get("prefill_tok_s")
    if not decode or not agg or decode <= 0 or agg <= 0:
        return None

    def prompt_s(tokens: float) -> float:
        return tokens / prefill if prefill and prefill > 0 else 0.0

    alone = prompt_s(workload.prompt_tokens) + workload.output_tokens / decode
    lengths = workload.run_lengths(parallel)
    served = prompt_s(sum(p for p, _ in lengths)) + sum(o for _, o in lengths) / agg
    loads = 1
    if workload.arrival == "poisson":
        rate = workload.rate
        if workload.rate_search:
            low, high = workload.rate_search
            rate = math.sqrt(low * high)  # the bisection's middle
            loads = RATE_SEARCH_STEPS + 1
        if rate:
            served = max(served, len(lengths) / rate)
    return alone, alone + loads * served


def launch_cost(
    workload: Workload, protocol: Protocol, parallel: int, predicted: Mapping[str, float], file_bytes: float
) -> LaunchCost | None:
    timed = run_seconds(workload, parallel, predicted)
    if timed is None:
        return None
    return LaunchCost(
        START_FIXED_S + file_bytes / LOAD_BYTES_S, timed[0], timed[1], protocol.warmup_runs + protocol.min_runs
    )


@dataclass(frozen=True)
class Forecast:
    """A study's cost before it runs (issue 39 item 1).

    Attributes:
        trial: The median launch of the configurations predicted (``SAMPLED_CONFIGS`` spread
            over the space); ``trial_range`` the cheapest and dearest of them, in seconds.
        baselines: (title, seconds) of each baseline this run must still measure.
        requests: Requests one run sends; ``protocol`` the study's.
        basis: Whose rates these are (the engine's model for this card).
    """

    trial: LaunchCost
    trial_range: tuple[float, float]
    baselines: tuple[tuple[str, float], ...]
    requests: int
    protocol: Protocol
    basis: str
    drawn: bool = False  # the run's requests are drawn from a distribution ([workload] requests sets how many)
    baseline_by_key: Mapping[str, float] = field(default_factory=dict)  # Baseline.key -> seconds

    @property
    def baselines_s(self) -> float:
        return sum(s for _, s in self.baselines)

    def need_s(self) -> float:
        """The baselines and one trial."""
        return self.baselines_s + self.trial.seconds

    def trials_affordable(self, budget_s: float) -> int:
        """Trials the budget affords after the baselines (they take at most their share)."""
        left = budget_s - min(self.baselines_s, BASELINE_SHARE * budget_s)
        return max(0, int(left // self.trial.seconds)) if self.trial.seconds > 0 else 0

    def text(self, budget_s: float | None) -> str:
        t, p = self.trial, self.protocol
        lo, hi = self.trial_range
        line = (
            f"cost forecast: one trial about {t.seconds:.0f} s ({lo:.0f}-{hi:.0f} s over the configurations "
            f"predicted): start {t.start_s:.0f} s, then {p.warmup_runs} warm-up + {p.min_runs} runs of "
            f"{t.run_s:.1f} s ({self.requests} requests each, and one alone)"
        )
        if self.baselines:
            line += "; baselines " + ", ".join(f"{title} about {s:.0f} s" for title, s in self.baselines)
        if budget_s:
            n = self.trials_affordable(budget_s)
            line += (
                f"; the {budget_s:g} s budget affords about {n} trial{'' if n == 1 else 's'} "
                f"after the baselines (at most {BASELINE_SHARE:.0%} of it)"
            )
        return f"{line} ({self.basis}; the start assumes {LOAD_BYTES_S / 1e9:g} GB/s reads)"

    def refusal(self, budget_s: float | None, *, probe: bool) -> str | None:
        """Why ``budget_s`` is refused (it cannot measure the baselines and one trial: below
        ``REFUSE_BELOW`` of the forecast need), with the figures and the remedies; else None."""
        need = self.need_s()
        if budget_s is None or budget_s >= REFUSE_BELOW * need:
            return None
        t, p = self.trial, self.protocol
        fewer = max(1, self.requests // 4)
        cheaper = t.with_requests(fewer / max(self.requests, 1)).seconds
        remedies = [
            f"a larger budget (--budget {math.ceil(need * 1.2 / 60)}m: the need and a fifth more)",
            f"fewer requests per run ([workload] requests = {fewer}: a trial then costs about {cheaper:.0f} s)"
            if self.drawn
            else f"shorter requests ([workload] output_tokens, prompt_tokens: a run is {self.requests} of them)",
        ]
        if not probe:
            remedies.append(
                f"the probe ([study] probe_margin = 0.15: a configuration far behind the leader stops "
                f"after its first run, about {t.probed_s(p.warmup_runs):.0f} s)"
            )
        parts = " + ".join([*(f"{title} {s:.0f} s" for title, s in self.baselines), f"one trial {t.seconds:.0f} s"])
        return (
            f"--budget {budget_s:g} s cannot measure the baselines and one trial: the forecast needs about "
            f"{need:.0f} s ({parts}; {self.basis}), and a budget below {REFUSE_BELOW:.0%} of that is refused "
            f"before anything runs. Remedies: {'; '.join(remedies)}"
        )


def forecast(prepared: "PreparedStudy", study: "optuna.Study | None" = None) -> Forecast | None:
    """The study's cost from its workload, its protocol and its engines' models' predictions for
    this card; None where nothing predicts a configuration of it, and for a study of model
    backends (a twin predicts itself: its trials cost no measuring). ``study``: a resumed
    study's storage (its baselines already measured cost nothing)."""

    backends = plugins.get_backends()
    judge = Admission(prepared.space, prepared.contexts, prepared.cfg.objective)
    configs = list(prepared.space.enumerate())
    step = max(1, len(configs) // SAMPLED_CONFIGS)
    costs: list[LaunchCost] = []
    basis: set[str] = set()
    for config in configs[::step][:SAMPLED_CONFIGS]:
        real = prepared.backend(config.backend)
        if real.predictor is not None:
            return None  # a model backend's study: nothing is measured
        ctx = prepared.contexts.get(config.backend)
        verdict = judge.judge(config)
        if ctx is None or not verdict.admitted or verdict.estimate is None:
            continue
        found = predictor_for(real, config, ctx, backends)
        if found is None:
            continue
        est = verdict.estimate
        cost = launch_cost(
            ctx.workload, ctx.protocol, config.parallel, found[1], est.weights_bytes + (est.host_bytes or 0)
        )
        if cost is not None:
            costs.append(cost)
            basis.add(found[0].name)
    if not costs:
        return None
    costs.sort(key=lambda c: c.seconds)
    trial = costs[len(costs) // 2]
    stored = records.baselines(study) if study is not None else {}
    baselines: list[tuple[str, float]] = []
    by_key: dict[str, float] = {}
    if prepared.cfg.baseline:
        for cand in prepared.cfg.candidates:
            entry, ctx = prepared.space.entries.get(cand.backend), prepared.contexts.get(cand.backend)
            if entry is None or ctx is None:
                continue
            backend = prepared.backend(cand.backend)
            try:
                weights = highest_precision(backend, cand.weights, ctx)
                launches = backend.baselines(weights, ctx, user_load(entry, ctx.workload))
            except Exception:  # noqa: BLE001 - a forecast never stops a study; baseline.measure says why
                continue
            for launch in launches:
                base = stored.get(records.baseline_key(cand.backend, launch.name))
                if base is not None and not measure_again(base):
                    continue
                seconds = _baseline_cost(backend, launch.config, ctx, backends, trial).seconds
                baselines.append((title_of(cand.backend, launch.title), seconds))
                by_key[records.baseline_key(cand.backend, launch.name)] = seconds
    workload = next(iter(prepared.contexts.values())).workload
    protocol = next(iter(prepared.contexts.values())).protocol
    requests = workload.run_size(max(c.parallel for c in configs)) if configs else 0
    return Forecast(
        trial,
        (costs[0].seconds, costs[-1].seconds),
        tuple(baselines),
        requests,
        protocol,
        f"rates from {', '.join(sorted(basis))}'s prediction for this card, {len(costs)} configurations",
        drawn=bool(workload.requests),
        baseline_by_key=by_key,
    )


def _baseline_cost(backend: Any, config: Any, ctx: Any, backends: Mapping[str, Any], trial: LaunchCost) -> LaunchCost:
    """A baseline's launch at its model's prediction; the median trial's where none predicts it
    (an engine's own flags, as llama.cpp's --fit, are not the model's options)."""

    try:
        found = predictor_for(backend, config, ctx, backends)
        est = backend.estimate_memory(config, ctx)
    except Exception:  # noqa: BLE001
        return trial
    if found is None:
        return trial
    cost = launch_cost(ctx.workload, ctx.protocol, config.parallel, found[1], est.weights_bytes + (est.host_bytes or 0))
    return cost or trial


# ------------------------------------------------------------------------------ the probe by default

PROBE_MARGIN = 0.15  # docs/search.md: wider than the recorded grids' between-run spread (median 2.5-3.5%)
# The probe pays where a launch it stops saves at least this share of a full one: its runs after
# the first are the measurement's bulk (long requests, many of them), not the engine's start.
# On the recorded H200 grids a stopped 7B launch saved 15-20% (half of a launch is the start),
# one launch more in a quarter of the grid's time and no better pick (docs/search.md); a chat
# workload of hundreds of requests on a slow card saves most of a 4-minute launch.
PROBE_PAYS = 1 / 3


def safe_forecast(prepared: "PreparedStudy", study: "optuna.Study | None" = None) -> Forecast | None:
    """``forecast``, or None where it fails: a forecast never stops a study that could run."""
    try:
        return forecast(prepared, study)
    except Exception:  # noqa: BLE001
        return None


def baselines_first(fc: Forecast | None, budget_s: float | None) -> tuple[bool, str | None]:
    """Whether the baselines go before the search (their forecast fits their share of the
    budget), else after it, with what the budget leaves (issue 39 item 3: they never starve the
    search), and the line that says so."""
    if fc is None or budget_s is None or not fc.baselines or fc.baselines_s <= BASELINE_SHARE * budget_s:
        return True, None
    return False, (
        f"baseline: measured after the search: their forecast {fc.baselines_s:.0f} s is more than "
        f"{BASELINE_SHARE:.0%} of the {budget_s:g} s budget; what the search leaves of it (at most that "
        "share) goes to them, and a resume measures any not launched"
    )


def expected_baseline_s(fc: Forecast | None, key: str, launch_seconds: list[float]) -> tuple[float, str] | None:
    """What baseline ``key`` is expected to take, and on what: its forecast, scaled by how this
    run's launches so far compared with the forecast trial (the twin can be off 2-3x: its
    MoE prefill with experts on the host); None without a forecast."""
    if fc is None or key not in fc.baseline_by_key:
        return None
    seconds = fc.baseline_by_key[key]
    if launch_seconds and fc.trial.seconds > 0:
        pace = statistics.median(launch_seconds) / fc.trial.seconds
        return seconds * pace, (
            f"its forecast {seconds:.0f} s x {pace:.2f}, this run's launches against the forecast trial"
        )
    return seconds, "its forecast"


def auto_probe(prepared: "PreparedStudy", fc: Forecast | None = None) -> tuple[float | None, str | None]:
    """The probe's margin for a study that does not set ``[study] probe_margin`` (None: off),
    and the line that says why it is on; off where nothing forecasts the launch's cost."""
    fc = fc if fc is not None else safe_forecast(prepared)
    if fc is None:
        return None, None
    saved = fc.trial.seconds - fc.trial.probed_s(fc.protocol.warmup_runs)
    share = saved / fc.trial.seconds if fc.trial.seconds > 0 else 0.0
    if share < PROBE_PAYS:
        return None, None
    return PROBE_MARGIN, (
        f"probe: on ([study] probe_margin not given): a launch whose first run is more than {PROBE_MARGIN:.0%} below "
        f"the leader stops there, saving about {saved:.0f} s of its forecast {fc.trial.seconds:.0f} s ({share:.0%}, "
        f"at least {PROBE_PAYS:.0%} pays); probe_margin = 0 turns it off"
    )


def forecast_line(forecast: Any, budget_s: float | None, pruner: Any) -> str | None:
    """The study header's cost line (the runner's forecast), or None where nothing
    forecasts it.

    Raises:
        ConfigError: The budget cannot measure the baselines and one trial (exit 2, before
            anything runs), with the figures and the remedies.
    """
    if forecast is None:
        return None
    refusal = forecast.refusal(budget_s, probe=isinstance(pruner, LeaderGapPruner))
    if refusal:
        raise ConfigError(refusal)
    return forecast.text(budget_s)
