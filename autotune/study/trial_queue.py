"""What waits to be measured beside the sampler's proposals: the prior's best first, what earlier
runs left cut short, and an unexplored configuration when the sampler keeps proposing what is
known. Each waits as an Optuna WAITING trial holding its configuration, so a queue survives a
crash and is shared by every worker of the study."""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable

import optuna

from autotune.engine.backend import TrialConfig
from autotune.modelfiles import artifacts
from autotune.study import records
from autotune.study.admission import Admission
from autotune.study.prepared import PreparedStudy
from autotune.study.prior import cheaper_first_among_ties, rank_by_prior
from autotune.study.records import TrialState
from autotune.study.sampling import ScreenedSampler
from autotune.study.trial_phase import RunState

__all__ = ["MAX_CUT_SHORT", "TrialQueue"]

# Attempts cut short (interrupt, killed worker) after which a configuration is not queued again.
MAX_CUT_SHORT = 3


class TrialQueue:
    """The study's queue of configurations to measure next (``[study] prior``, cut-short
    attempts, exploration), for the runner and the strategies (``Search``)."""

    def __init__(
        self,
        prepared: PreparedStudy,
        study: optuna.Study,
        judge: Admission,
        run_state: RunState,
        sampler: ScreenedSampler,
        evaluated_keys: Callable[[], set[str]],
    ):
        self.prepared = prepared
        self.study = study
        self.judge = judge
        self.run_state = run_state
        self.sampler = sampler
        self.evaluated_keys = evaluated_keys

    def enqueue(self, config: TrialConfig, **attrs: Any) -> None:
        self.study.enqueue_trial(
            self.prepared.space.params_of(config), user_attrs=records.attributes({"config": config.as_dict(), **attrs})
        )

    def has_waiting(self) -> bool:
        return bool(self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,)))

    def waiting_keys(self) -> set[str]:
        return {
            TrialConfig.from_dict(records.field_of(t.user_attrs, "config")).key
            for t in self.study.get_trials(deepcopy=False, states=(TrialState.WAITING,))
            if "config" in t.user_attrs
        }

    def enqueue_prior(self) -> int:
        """Measure the configurations a model backend predicts best first (``[study] prior``)."""
        done, waiting = self.evaluated_keys(), self.waiting_keys()
        n = 0
        for config, _ in self.prior_order()[: self.prepared.cfg.prior_trials]:
            if config.key not in done and config.key not in waiting:
                self.enqueue(config, from_prior=True)
                n += 1
        return n

    def prior_order(self) -> list[tuple[TrialConfig, float]]:
        """The prior's ranking, weights already made first among near-equals (``prior.PRIOR_TIE``)."""

        @functools.cache  # per weights, not per configuration: each prediction reads the cache's records
        def weights_s(backend: str, weights: str) -> float:
            need = artifacts.predict_making(self.prepared.backend(backend), weights, self.prepared.contexts[backend])
            if need is None:
                return 0.0
            return need.seconds if need.seconds is not None else float("inf")

        return cheaper_first_among_ties(
            rank_by_prior(self.prepared, self.judge, self.study),
            lambda config: weights_s(config.backend, config.weights),
        )

    def requeue_cut_short(self) -> int:
        """Queue again each configuration whose attempts were all cut short (interrupted, its
        worker killed, its engine unavailable), so that it is measured once after all: a grid
        queues every configuration once, and a lost attempt would leave it never measured.

        A configuration cut short ``MAX_CUT_SHORT`` times is left alone: what kills the worker
        every time (a host OOM, a crash in-process) would otherwise kill every resume too.
        """
        # A trial killed before it wrote its key still holds the configuration it was queued with.
        failed = records.records(self.study, (TrialState.FAIL,))
        cut_short = Counter(
            r.config_key or r.trial_config.key
            for r in failed
            if (r.config_key or r.config) and not r.stands_for_config and not r.answered and not r.deferred
        )
        deferred = {r.config_key for r in failed if r.deferred and r.config_key}
        skip = self.evaluated_keys() | self.waiting_keys()
        n = 0
        for config in self.prepared.space.enumerate():  # only what this study file still searches
            if config.key in skip:
                continue
            # A configuration deferred for the cost of its weights waits for a run with the time
            # to make them; never tried, it never counts as cut short.
            if (0 < cut_short[config.key] < MAX_CUT_SHORT or config.key in deferred) and self.affordable(config):
                self.enqueue(config)
                n += 1
        return n

    def affordable(self, config: TrialConfig) -> bool:
        return (config.backend, config.weights) not in self.run_state.deferred_artifacts

    def enqueue_unexplored(self) -> bool:
        """Queue one random configuration that has not been evaluated and could run."""
        config = self.sampler.random_admissible(self.evaluated_keys())
        if config is None:
            return False
        self.enqueue(config, explore=True)
        return True
