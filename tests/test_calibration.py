"""Online calibration's plumbing (autotune/study/calibration.py) with fake backends: a model
backend learns from every measured trial of a real backend of its engine, the study stores it,
and what predicts afterwards (the prior, a resumed study) predicts with it."""

from __future__ import annotations

from dataclasses import replace

import optuna
import pytest

from autotune.config import load_study_config
from autotune.errors import ConfigError
from autotune.study import StudyRunner, open_storage, prepare_study, rank_by_prior
from autotune.study import calibration, records

if __package__:  # tests/ is a package
    from .fake_backends import FakeBackend, FakeModelBackend, RealExl2Backend, memory_dir, registered, write_study
else:
    from fake_backends import FakeBackend, FakeModelBackend, RealExl2Backend, memory_dir, registered, write_study


@pytest.fixture
def storage(tmp_path):
    for scratch in memory_dir(tmp_path):
        yield f"sqlite:///{scratch / 'study.db'}"


def load(storage: str, name: str = "fake-study") -> optuna.Study:
    return optuna.load_study(study_name=name, storage=open_storage(storage))


def test_a_model_backend_learns_from_each_measured_trial_and_the_prior_uses_it(tmp_path, storage):
    path = write_study(tmp_path / "s.toml", "fake", ["w1", "w22"], ctx=(4096,), parallel=(1, 2, 4))
    real, model = FakeBackend(), FakeModelBackend()
    with registered(real, model):
        prepared = prepare_study(load_study_config(path), storage=storage)
        assert calibration.learning_backends(prepared) == ["fake"]
        StudyRunner(prepared).run(n_trials=3)
        study = load(storage)
        measured = records.measured(study)

        # Called once per measured trial, each time with every measured trial so far, renamed to
        # the model backend, with the measured medians.
        assert [len(call) for call in model.calibrated] == [1, 2, 3]
        last = model.calibrated[-1]
        assert {c.backend for c, _ in last} == {"fake-model"}
        assert sorted(c.key for c, _ in last) == sorted(
            replace(r.trial_config, backend="fake-model").key for r in measured
        )
        assert all(set(m) == {"decode_tok_s", "aggregate_tok_s", "per_user_tok_s"} for _, m in last)

        # Stored in the study under the real backend's name, with the predictor that made it.
        stored = records.stored_calibrations(study)
        assert set(stored) == {"fake"}
        assert stored["fake"]["predictor"] == "fake-model" and stored["fake"]["n"] == 3
        assert stored["fake"]["after"]["factor"] == pytest.approx(2.0)

        # The prior (a resumed study's, a later re-ranking's) predicts with it: the model's
        # predictions now equal what the real backend measures.
        model.seen_calibrations.clear()
        ranked = dict((c.key, v) for c, v in rank_by_prior(prepared, study=study))
        assert model.seen_calibrations and all(c == stored["fake"] for c in model.seen_calibrations)
        for r in measured:
            assert ranked[r.trial_config.key] == pytest.approx(r.median("aggregate_tok_s"))
        # Without the study, the published (uncalibrated) model: half of it.
        uncalibrated = dict((c.key, v) for c, v in rank_by_prior(prepared))
        some = measured[0].trial_config.key
        assert uncalibrated[some] == pytest.approx(0.5 * ranked[some])
        assert calibration.contexts_with_calibration(prepared, study)["fake"].calibration == stored["fake"]
        assert prepared.contexts["fake"].calibration is None  # the runner measures with the plain context


def test_a_backend_that_predicts_itself_learns_nothing(tmp_path, storage):
    """A twin study: its measurements are its own predictions, and it must stay as fast."""
    path = write_study(tmp_path / "s.toml", "fake-model", ["w1", "w22"], parallel=(1, 2))
    model = FakeModelBackend()
    with registered(model):
        prepared = prepare_study(load_study_config(path), storage=storage)
        assert calibration.learning_backends(prepared) == []
        StudyRunner(prepared).run(n_trials=2)
    assert model.calibrated == []
    assert records.stored_calibrations(load(storage)) == {}


def test_a_failing_model_backend_is_stored_as_an_error_and_the_study_goes_on(tmp_path, storage):
    class Broken(FakeModelBackend):
        def calibrate(self, measured, ctx):
            raise ZeroDivisionError("no data")

    path = write_study(tmp_path / "s.toml", "fake", ["w1"], parallel=(1, 2))
    with registered(FakeBackend(), Broken()):
        prepared = prepare_study(load_study_config(path), storage=storage)
        summary = StudyRunner(prepared).run(n_trials=2)
        study = load(storage)
        assert summary.n_complete == 2
        assert records.stored_calibrations(study) == {
            "fake": {"predictor": "fake-model", "error": "ZeroDivisionError: no data"}
        }
        # An error is no calibration: the prior predicts with the published model.
        assert calibration.contexts_with_calibration(prepared, study)["fake"].calibration is None


def test_estimate_and_report_use_the_twins_calibration_of_a_real_study(tmp_path, storage, twin_plugin):
    """A real ExLlamaV2 study (its "measurements" 90% of the twin's aggregate) calibrates the
    ExLlamaV2 twin; `estimate --study` predicts with it, for the study's GPU and model, and the
    report shows it."""
    from autotune.estimate import estimate_config, estimate_text
    from autotune.report.text import stored_summary, summary_json, summary_text

    path = write_study(
        tmp_path / "s.toml",
        "fake-exl2",
        ["exl2:3.0", "exl2:3.5"],
        ctx=(4096,),
        parallel=(1, 2, 4),
        extra_space='cache_type = ["q8"]\nflash_attn = [true]',
    )
    with registered(RealExl2Backend()):
        StudyRunner(prepare_study(load_study_config(path), storage=storage)).run(n_trials=4)
        stored = records.stored_calibrations(load(storage))["fake-exl2"]
        assert stored["predictor"] == "twin-exllamav2" and stored["gpu"] == "v100-16gb" and stored["n"] == 4
        assert stored["after"] != stored["before"]
        assert stored["median_abs_error_after"] < stored["median_abs_error_before"]

        args = ("exllamav2", "exl2:3.3", 4096, "q8", True, 2)
        published = estimate_config("v100-16gb", "qwen2.5-27b-article", *args)
        calibrated = estimate_config(None, None, *args, study_name="fake-study", storage=storage)
        assert (calibrated["gpu"], calibrated["model"]) == ("v100-16gb", "qwen2.5-27b-article")  # the study's
        assert calibrated["calibration"]["n"] == 4 and published["calibration"] is None
        assert calibrated["predicted"]["decode_tok_s"] != published["predicted"]["decode_tok_s"]
        assert "calibrated on 4 measured trials of study fake-study" in estimate_text(calibrated)
        # Another card than the one it was fitted on: the published constants, and it says so.
        elsewhere = estimate_config("a100-80gb", None, *args, study_name="fake-study", storage=storage)
        assert elsewhere["calibration"] is None and "no calibration of twin-exllamav2 on a100-80gb" in estimate_text(
            elsewhere
        )

        # A study that ran on a card the catalog lacks (NVML's description of it): only --gpu or
        # that machine can stand for it.
        study = load(storage)
        study.set_user_attr("gpu", {**study.user_attrs["gpu"], "key": "nvml:nvidia-rtx-pro-6000"})
        with pytest.raises(
            ConfigError,
            match=r"ran on 'nvml:nvidia-rtx-pro-6000', a card the catalog does not know.*"
            r"give --gpu \(a catalog key: v100-16gb, ",
        ):
            estimate_config(None, None, *args, study_name="fake-study", storage=storage)
        assert estimate_config("v100-16gb", None, *args, study_name="fake-study", storage=storage)["gpu"] == "v100-16gb"

        summary = stored_summary(storage, "fake-study")
        text = summary_text(summary)
        assert "twin calibration" in text and "fake-exl2 by twin-exllamav2 on v100-16gb, 4 trials" in text
        assert summary_json(summary)["calibration"]["fake-exl2"]["n"] == 4
