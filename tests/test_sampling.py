"""``FitOnceTPESampler``: the screened sampler's tries for one trial share one fit of TPE, and
propose exactly what Optuna's TPE proposes, in the same order, trial after trial."""

from __future__ import annotations

import contextlib

import optuna

from autotune.study.default_strategies import TpeStrategy
from autotune.study.optuna_internals import FitOnceTPESampler

SPACE = {
    "backend": optuna.distributions.CategoricalDistribution(["a", "b"]),
    "ctx": optuna.distributions.CategoricalDistribution([2048, 4096, 8192, 16384]),
    "parallel": optuna.distributions.CategoricalDistribution([1, 2, 4, 8]),
    "cache": optuna.distributions.CategoricalDistribution(["f16", "q8", "q4"]),
}
TRIES = 16  # ScreenedSampler's max_tries
ARGS = dict(seed=7, multivariate=True, group=True, n_startup_trials=8, constant_liar=False)


def _score(params: dict) -> float:
    return params["ctx"] / 1024 + 3 * params["parallel"] - (params["cache"] == "q4") * 5


def _tries(sampler: optuna.samplers.TPESampler, study: optuna.Study, trial: optuna.trial.FrozenTrial) -> list[dict]:
    space = sampler.infer_relative_search_space(study, trial)
    with getattr(sampler, "fitting_once", contextlib.nullcontext)():
        return [sampler.sample_relative(study, trial, space) for _ in range(TRIES)]


def _study() -> optuna.Study:
    """A study whose first trials (the start-up) are random, each told its score; some pruned,
    as the screened sampler's refusals are."""
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=3))
    for i in range(12):
        trial = study.ask(SPACE)
        if i % 4 == 3:
            study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        else:
            study.tell(trial, _score(trial.params))
    return study


def test_its_tries_propose_what_tpe_proposes_trial_after_trial():
    study = _study()
    ours, theirs = FitOnceTPESampler(**ARGS), optuna.samplers.TPESampler(**ARGS)
    distinct = []
    for _ in range(10):
        trial = study.ask()  # a new snapshot of the study: the fit of the trial before is not reused
        frozen = study._storage.get_trial(trial._trial_id)
        mine, optunas = _tries(ours, study, frozen), _tries(theirs, study, frozen)
        assert mine == optunas
        distinct.append(len({tuple(sorted(p.items())) for p in mine}))
        # The last try measured: the next trial's fit has one more trial to fit on.
        study.tell(trial, state=optuna.trial.TrialState.FAIL)
        study.add_trial(optuna.trial.create_trial(params=mine[-1], distributions=SPACE, value=_score(mine[-1])))
    assert max(distinct) > 1  # tries of one trial differ: each is a draw of its own, not the first again


def test_it_fits_once_per_trial_and_group_inside_fitting_once_only(monkeypatch):
    study = _study()
    sampler = FitOnceTPESampler(**ARGS)
    fits = []
    original = optuna.samplers.TPESampler._build_parzen_estimator

    def counted(self, *args, **kwargs):
        fits.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(optuna.samplers.TPESampler, "_build_parzen_estimator", counted)
    frozen = study._storage.get_trial(study.ask()._trial_id)
    _tries(sampler, study, frozen)
    groups = len(sampler._search_space_group.search_spaces)
    assert len(fits) == 2 * groups  # below and above, once per group
    fits.clear()
    space = sampler.infer_relative_search_space(study, frozen)
    for _ in range(3):  # outside fitting_once: TPE as it is, a fit per proposal
        sampler.sample_relative(study, frozen, space)
    assert len(fits) == 3 * 2 * groups


def test_the_tpe_strategy_uses_it_and_constant_liar_refits():
    assert isinstance(TpeStrategy().sampler(1), FitOnceTPESampler)
    study = _study()
    liar = FitOnceTPESampler(**{**ARGS, "constant_liar": True})
    with liar.fitting_once():
        frozen = study._storage.get_trial(study.ask()._trial_id)
        liar.sample_relative(study, frozen, liar.infer_relative_search_space(study, frozen))
        assert liar._fits == {}  # its fit counts running trials, which change between tries
