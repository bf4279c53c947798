"""``sampler = "twin"``: every launch measures what the twin, calibrated on the study's trials so
far, predicts best among the configurations not yet evaluated; one in four explores.

The strategy is the twin plugin's (``autotune_plugins.twin.strategy``): each test registers the
plugin (``twin_plugin``), and ranks with a fake model of the fake engine."""

from __future__ import annotations

import statistics
from typing import Any, Mapping, Sequence

import optuna
import pytest

from autotune.engine.backend import StudyContext, TrialConfig
from autotune.config import load_study_config
from autotune.errors import ConfigError
from autotune.study import StudyRunner, open_storage, prepare_study, records
from autotune_plugins.twin.strategy import TwinStrategy

if __package__:  # tests/ is a package
    from .fake_backends import FakeBackend, FakeModelBackend, memory_dir, registered, write_study
else:
    from fake_backends import FakeBackend, FakeModelBackend, memory_dir, registered, write_study


class Misled(FakeModelBackend):
    """Predicts the fake's speed exactly, except that it believes weights ``w22`` serve at a
    tenth of it, until a measurement of ``w22`` tells it otherwise (its calibration)."""

    def predict(self, config: TrialConfig, ctx: StudyContext) -> Mapping[str, float] | None:
        factor = (
            ctx.calibration["after"].get("w22", 0.1)
            if ctx.calibration and config.weights == "w22"
            else (0.1 if config.weights == "w22" else 1.0)
        )
        aggregate = self.speed(config) * factor
        return {"aggregate_tok_s": aggregate, "per_user_tok_s": aggregate / config.parallel}

    def calibrate(
        self, measured: Sequence[tuple[TrialConfig, Mapping[str, float]]], ctx: StudyContext
    ) -> Mapping[str, Any] | None:
        seen = [m["aggregate_tok_s"] / self.speed(c) for c, m in measured if c.weights == "w22"]
        after = {"w22": statistics.median(seen)} if seen else {}
        return {
            "gpu": ctx.gpu.key,
            "n": len(measured),
            "before": {},
            "after": after,
            "median_abs_error_before": 0.0,
            "median_abs_error_after": 0.0,
        }


@pytest.fixture
def storage(tmp_path, twin_plugin):
    for scratch in memory_dir(tmp_path):
        yield f"sqlite:///{scratch / 'study.db'}"


def launched(storage: str) -> list[tuple[str, int, bool]]:
    study = optuna.load_study(study_name="fake-study", storage=open_storage(storage))
    return [(r.config["weights"], r.config["parallel"], r.explore) for r in records.measured(study)]


def test_each_launch_follows_the_twin_as_calibrated_so_far(tmp_path, storage, monkeypatch):
    path = write_study(tmp_path / "s.toml", "fake", ["w1", "w22", "w333"], parallel=(1, 2, 4, 8), sampler="twin")
    with registered(FakeBackend(), Misled()):
        monkeypatch.setattr(TwinStrategy, "explore_every", 10**9)
        prepared = prepare_study(load_study_config(path), storage=storage)
        StudyRunner(prepared).run(n_trials=3)
        # The twin's favourites, best first (w22 believed slow; w333 is the fastest it believes in).
        assert launched(storage) == [("w333", 8, False), ("w1", 8, False), ("w333", 4, False)]

        one = StudyRunner(prepare_study(load_study_config(path), storage=storage))
        one.queue.enqueue(TrialConfig("fake", "w22", 4096, 1, (("mode", "plain"),)))  # a measurement of w22
        one.run(n_trials=1)

        StudyRunner(prepare_study(load_study_config(path), storage=storage)).run(n_trials=1)
        # Calibrated on it, the twin now ranks w22 at 8 streams (truly 84 tok/s) above w1 at 4
        # (42), which the uncalibrated twin would have measured next.
        assert launched(storage)[-1] == ("w22", 8, False)


def test_one_launch_in_four_explores(tmp_path, storage):
    path = write_study(tmp_path / "s.toml", "fake", ["w1", "w22", "w333"], parallel=(1, 2, 4, 8), sampler="twin")
    with registered(FakeBackend(), Misled()):
        StudyRunner(prepare_study(load_study_config(path), storage=storage)).run(n_trials=8)
    explored = [i for i, (_, _, explore) in enumerate(launched(storage)) if explore]
    assert explored == [3, 7]


def test_sampler_twin_needs_a_model_of_the_engine(tmp_path, storage):
    path = write_study(tmp_path / "s.toml", "fake", ["w1"], sampler="twin")
    with registered(FakeBackend()), pytest.raises(ConfigError, match="sampler = 'twin': no installed backend predicts"):
        prepare_study(load_study_config(path), storage=storage)


def test_a_real_study_starts_from_its_twin_unless_told_otherwise(tmp_path, storage):
    """``[study] prior`` not given: on where the engine has a model that is not the backend itself."""
    real = write_study(tmp_path / "real.toml", "fake", ["w1", "w22"], sampler="tpe")
    off = write_study(
        tmp_path / "off.toml", "fake", ["w1", "w22"], sampler="tpe", study_extra="prior = false", name="off"
    )
    own = write_study(tmp_path / "own.toml", "fake-model", ["w1", "w22"], sampler="tpe", name="own")
    with registered(FakeBackend(), Misled()):
        assert StudyRunner(prepare_study(load_study_config(real), storage=storage)).uses_prior
        assert not StudyRunner(prepare_study(load_study_config(off), storage=storage)).uses_prior
        assert not StudyRunner(prepare_study(load_study_config(own), storage=storage)).uses_prior
    with registered(FakeBackend()):  # no model of the engine installed
        assert not StudyRunner(prepare_study(load_study_config(real), storage=storage)).uses_prior
