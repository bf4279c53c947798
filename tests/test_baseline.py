"""How much better than doing nothing: each backend's default launch, measured once per study
(autotune/study/baseline.py), never a trial, compared with the winner in the summary."""

from __future__ import annotations

import optuna
import pytest

from autotune.backend import DefaultLaunch, Measurement, MemoryEstimate, StudyContext, TrialConfig
from autotune.cli import default_study_path
from autotune.config import load_study_config
from autotune.errors import BackendError, ConfigError
from autotune.measure import Stat
from autotune.report import summary_json, summary_text
from autotune.study import open_storage, records, run_study

if __package__:  # tests/ is a package
    from .fake_backends import GIB, FakeBackend, memory_dir, registered, stats_for, write_study
else:
    from fake_backends import GIB, FakeBackend, memory_dir, registered, stats_for, write_study


class DefaultingBackend(FakeBackend):
    """A fake engine with a default launch: 2 slots of 8192 tokens, marked ``defaults``; its
    speed (and spread) is what the test says, and it can fail like an out-of-memory load."""

    name = "fake-defaults"

    def __init__(self, default_runs=(10.0, 11.0, 9.0), fail: bool = False, decline: bool = False):
        super().__init__()
        self.default_runs = default_runs
        self.fail = fail
        self.decline = decline

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        # More characters, more bytes: "q8" < "f16-full", the user's highest precision.
        return MemoryEstimate(weights_bytes=GIB * len(config.weights) // 8, kv_bytes=config.ctx * config.parallel,
                              buffers_bytes=0, overhead_bytes=0)

    def default_launch(self, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        if self.decline:
            return None
        return DefaultLaunch(TrialConfig(self.name, weights, 8192, 2, (("defaults", True),)), "fake defaults")

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        if config.option("defaults"):
            if self.fail:
                raise BackendError("CUDA out of memory: tried to allocate 2.00 GiB", log_tail="cudaMalloc failed\n")
            runs = self.default_runs
            return Measurement(metrics={
                "decode_tok_s": Stat(runs, unit="tok/s"),
                "aggregate_tok_s": Stat(runs, unit="tok/s"),
                "per_user_tok_s": Stat(tuple(v / 2 for v in runs), unit="tok/s"),
            })
        return Measurement(metrics=stats_for(self.speed(config), config.parallel))


@pytest.fixture
def storage(tmp_path):
    for scratch in memory_dir(tmp_path):
        yield f"sqlite:///{scratch / 'baseline.db'}"


def study(tmp_path, extra: str = ""):
    return load_study_config(write_study(tmp_path / "b.toml", "fake-defaults", ["q8", "f16-full"], sampler="grid",
                                         parallel=(1, 2), study_extra=extra))


def load(storage: str) -> optuna.Study:
    return optuna.load_study(study_name="fake-study", storage=open_storage(storage))


def test_measured_once_before_the_search_on_the_highest_precision_weights_and_never_a_trial(tmp_path, storage):
    backend = DefaultingBackend()
    with registered(backend):
        summary = run_study(study(tmp_path), n_trials=2, storage=storage)
        assert backend.calls[0].option("defaults") and backend.calls[0].weights == "f16-full"
        assert not any(c.option("defaults") for c in backend.calls[1:])
        assert summary.n_measured == 2  # the baseline is not one of the --trials
        run_study(study(tmp_path), n_trials=2, storage=storage)  # resumed: read back, not measured again
    assert sum(1 for c in backend.calls if c.option("defaults")) == 1
    stored = records.baselines(load(storage))["fake-defaults"]
    assert stored.weights == "f16-full" and not stored.failed and stored.seconds is not None
    assert stored.deploy_command == "fake-serve --weights f16-full --ctx 8192 --parallel 2"
    # No trial holds it, and the study's header does not take it for a setting.
    assert all(not (t.user_attrs.get("config") or {}).get("defaults") for t in load(storage).trials)
    assert not any(k.startswith("baseline") for k in records.study_header(load(storage)))


def test_the_ratios_and_both_spreads_are_said(tmp_path, storage):
    with registered(DefaultingBackend()):
        summary = run_study(study(tmp_path), n_trials=4, storage=storage)
    best = summary.best
    entry = summary_json(summary)["baseline"]["fake-defaults"]
    agg = entry["ratio"]["aggregate"]
    assert agg["ratio"] == pytest.approx(best["metrics"]["aggregate_tok_s"] / 10.0)
    assert agg["baseline_spread"] == pytest.approx(0.1)  # MAD 1 over median 10
    assert entry["ratio"]["per_user"]["ratio"] == pytest.approx(best["metrics"]["per_user_tok_s"] / 5.0)
    assert entry["aggregate_tok_s"] == {"median": 10.0, "spread": pytest.approx(0.1)}
    assert not agg["within_noise"]
    text = summary_text(summary)
    assert f"{agg['ratio']:.1f}x fake-defaults's default launch's aggregate tok/s (" in text
    assert "vs 10.0 +- 10.0%" in text and "its per-user tok/s" in text
    assert "today: fake-serve --weights f16-full" in text


def test_a_baseline_faster_than_every_trial_is_never_the_best(tmp_path, storage):
    with registered(DefaultingBackend(default_runs=(1000.0,))):
        summary = run_study(study(tmp_path), n_trials=4, storage=storage)
    assert summary.best["params"].get("defaults") is None and summary.best["metrics"]["aggregate_tok_s"] < 1000
    assert summary.extra["baseline"]["fake-defaults"]["ratio"]["aggregate"]["ratio"] < 1


def test_a_gain_inside_the_spreads_is_called_noise(tmp_path, storage):
    # The best trial measures 10 * 2 + len("f16-full") + 1 = 29 tok/s; a baseline of 26 +- 15% covers it.
    with registered(DefaultingBackend(default_runs=(22.0, 26.0, 30.0))):
        summary = run_study(study(tmp_path), n_trials=4, storage=storage)
    entry = summary.extra["baseline"]["fake-defaults"]
    assert entry["ratio"]["aggregate"]["within_noise"]
    assert "within noise of fake-defaults's default launch's aggregate tok/s: no gain shown" in entry["text"]


def test_a_failed_baseline_is_recorded_with_its_reason_and_the_study_goes_on(tmp_path, storage):
    backend = DefaultingBackend(fail=True)
    with registered(backend):
        summary = run_study(study(tmp_path), n_trials=2, storage=storage)
        run_study(study(tmp_path), n_trials=1, storage=storage)
    assert summary.n_measured == 2 and summary.best is not None
    stored = records.baselines(load(storage))["fake-defaults"]
    assert stored.error.startswith("CUDA out of memory") and stored.log_tail == "cudaMalloc failed\n"
    assert sum(1 for c in backend.calls if c.option("defaults")) == 1  # a failure is not retried on resume
    assert "fake-defaults's default launch on f16-full failed: CUDA out of memory" in summary_text(summary)


def test_a_backend_that_declines_and_a_study_that_turns_it_off_measure_nothing(tmp_path, storage):
    for backend, extra in ((DefaultingBackend(decline=True), ""), (DefaultingBackend(), "baseline = false")):
        with registered(backend):
            summary = run_study(study(tmp_path, extra), n_trials=1, storage=storage)
        assert not any(c.option("defaults") for c in backend.calls)
        assert "baseline" not in summary.extra and "default launch" not in summary_text(summary)


def test_a_bad_switch_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"\[study\] baseline = 'no': must be true or false"):
        study(tmp_path, 'baseline = "no"')


def test_the_default_twin_study_says_how_much_faster_than_the_default_launch(tmp_path, storage):
    """The article's 4 -> 64 tok/s: the twin predicts llama-server's default launch of the 27B
    Q8_0 file on the V100 (layers spilled to the CPU) and ExLlamaV2's (out of memory)."""
    import autotune_plugins.twin as twin

    from tests.conftest import plugin_registered

    with plugin_registered(twin, "twin"):
        summary = run_study(load_study_config(default_study_path()), n_trials=4, storage=storage)
    found = summary.extra["baseline"]
    llama = found["twin-llama.cpp"]
    assert llama["weights"] == "gguf:Q8_0" and llama["per_user_tok_s"]["median"] < 10
    assert llama["deploy_command"].startswith("llama-server -m qwen2.5-27b-article-Q8_0.gguf -ngl 999 --host")
    assert llama["ratio"]["per_user"]["ratio"] > 3 and not llama["ratio"]["per_user"]["within_noise"]
    assert found["twin-exllamav2"]["error"].startswith("CUDA out of memory")
