"""Resume refuses to add trials measured on another card, model or engine build (pyperf's rule)."""

from __future__ import annotations

import optuna
import pytest

from autotune.config import load_study_config
from autotune.errors import ConfigError
from autotune.study import run_study
from autotune.study.comparable import ENGINES_ATTR
from tests.fake_backends import FakeBackend, registered, write_study


class RebuiltBackend(FakeBackend):
    """The fake engine, rebuilt: same backend name, another build."""

    def engine_build(self, ctx: StudyContext | None = None) -> str:
        return "fake-2.0"


class UnknownBuildBackend(FakeBackend):
    def engine_build(self, ctx: StudyContext | None = None) -> str:
        return "unknown (no binary found)"


def first_run(tmp_path, storage, **kw):
    path = write_study(tmp_path / "a.toml", "fake", ["w"], **kw)
    with registered(FakeBackend()):
        run_study(load_study_config(path), n_trials=1, storage=storage)
    return path


def n_trials(storage):
    return len(optuna.load_study(study_name="fake-study", storage=storage).trials)


def test_resume_on_another_gpu_is_refused_naming_both(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    path = first_run(tmp_path, storage)
    before = n_trials(storage)
    path.write_text(path.read_text().replace('gpu = "v100-16gb"', 'gpu = "t4"'))
    with (
        registered(FakeBackend()),
        pytest.raises(ConfigError, match=r"GPU: stored 'v100-16gb', now 't4'.*new \[study\] name"),
    ):
        run_study(load_study_config(path), n_trials=2, storage=storage)
    assert n_trials(storage) == before  # nothing added


def test_resume_with_another_model_is_refused(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    path = first_run(tmp_path, storage)
    path.write_text(path.read_text().replace('ref = "qwen2.5-27b-article"', 'ref = "qwen2.5-7b"'))
    with (
        registered(FakeBackend()),
        pytest.raises(ConfigError, match=r"model: stored 'qwen2.5-27b-article', now 'qwen2.5-7b'"),
    ):
        run_study(load_study_config(path), n_trials=2, storage=storage)


def test_resume_on_another_engine_build_is_refused(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    path = first_run(tmp_path, storage)
    with (
        registered(RebuiltBackend()),
        pytest.raises(ConfigError, match=r"fake engine build: stored 'fake-1.0', now 'fake-2.0'"),
    ):
        run_study(load_study_config(path), n_trials=2, storage=storage)


def test_an_old_study_is_checked_against_its_trials_engine(tmp_path):
    # A study stored before the check has no engines attribute: its trials say the build.
    storage = f"sqlite:///{tmp_path / 's.db'}"
    path = first_run(tmp_path, storage)
    study = optuna.load_study(study_name="fake-study", storage=storage)
    study.set_user_attr(ENGINES_ATTR, None)
    with registered(RebuiltBackend()), pytest.raises(ConfigError, match=r"stored 'fake-1.0', now 'fake-2.0'"):
        run_study(load_study_config(path), n_trials=2, storage=storage)


def test_a_changed_budget_or_an_unknown_build_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    path = first_run(tmp_path, storage)
    before = n_trials(storage)
    path.write_text(path.read_text().replace("safety_margin_mib = 1792", "safety_margin_mib = 2048"))
    with registered(FakeBackend()):
        run_study(load_study_config(path), n_trials=2, storage=storage)
    grown = n_trials(storage)
    assert grown > before
    with registered(UnknownBuildBackend()):  # cannot tell: not a reason to refuse
        run_study(load_study_config(path), n_trials=3, storage=storage)
    assert n_trials(storage) > grown
