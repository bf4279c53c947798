"""A study's budget starts no launch it expects to overrun (the median launch so far)."""

from __future__ import annotations

import pytest

from autotune.config import load_study_config
from autotune.study import StudyRunner, prepare_study
from autotune.study import runner as runner_mod

if __package__:  # tests/ is a package
    from .fake_backends import FakeBackend, memory_dir, registered, write_study
else:
    from fake_backends import FakeBackend, memory_dir, registered, write_study


class Clock:
    """monotonic() for the runner: time passes only while the backend runs (10 s a launch)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TenSecondBackend(FakeBackend):
    def __init__(self, clock: Clock):
        super().__init__()
        self.clock = clock

    def run(self, config, ctx):
        self.clock.now += 10.0
        return super().run(config, ctx)


@pytest.fixture
def storage(tmp_path):
    for scratch in memory_dir(tmp_path):
        yield f"sqlite:///{scratch / 'study.db'}"


def test_no_launch_starts_that_would_overrun_the_budget(tmp_path, storage, monkeypatch):
    clock = Clock()
    monkeypatch.setattr(runner_mod.time, "monotonic", clock)
    path = write_study(
        tmp_path / "s.toml", "fake", ["w1", "w22"], parallel=(1, 2, 4), study_extra="prior = false\nfinish_top = 0"
    )
    backend = TenSecondBackend(clock)
    with registered(backend):
        summary = StudyRunner(prepare_study(load_study_config(path), storage=storage)).run(budget_s=25)
    # Launches end at 10 s and 20 s; 5 s are left, less than a launch takes: the third (which
    # would end at 30 s) is not started.
    assert summary.n_measured == 2 and len(backend.calls) == 2
