"""A study's cost is known before it is spent (issue 39 item 1, autotune/study/cost.py): from the
workload, the protocol and the engine's model's prediction, the header says what one trial and
each baseline cost and how many trials the budget affords; a budget that cannot measure the
baselines and one trial is refused before anything runs (exit 2, the figures and the remedies)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from autotune.cli import cli
from autotune.config import load_study_config
from autotune.measure import Protocol
from autotune.study import cost
from autotune.study.prepare import prepare_study
from autotune.engine.workload import RATE_SEARCH_STEPS, Workload

if __package__:
    from .fake_backends import GIB, FakeBackend, FakeModelBackend, memory_dir, registered, write_study
    from .test_baseline import DefaultingBackend
else:
    from fake_backends import GIB, FakeBackend, FakeModelBackend, memory_dir, registered, write_study
    from test_baseline import DefaultingBackend

RATES = {"decode_tok_s": 20.0, "prefill_tok_s": 1000.0, "aggregate_tok_s": 50.0}


class Rates(FakeModelBackend):
    """The fake engine's model: the same rates for every configuration (RATES)."""

    def predict(self, config, ctx):
        return dict(RATES, per_user_tok_s=RATES["aggregate_tok_s"] / config.parallel)


class Defaults(DefaultingBackend):
    engine = FakeBackend.engine  # Rates speaks for it


def test_one_run_is_the_request_alone_then_the_runs_requests_at_the_predicted_rates():
    alone = 100 / 1000 + 50 / 20  # prompt at prefill, output at decode
    one_shape = Workload(100, 50)
    assert cost.run_seconds(one_shape, 4, RATES) == pytest.approx((alone, alone + 4 * 100 / 1000 + 4 * 50 / 50))
    drawn = Workload(100, 50, requests=((200, 10), (100, 90)))
    assert cost.run_seconds(drawn, 4, RATES)[1] == pytest.approx(alone + 300 / 1000 + 100 / 50)
    slow_arrivals = Workload(100, 50, requests=((200, 10), (100, 90)), arrival="poisson", rate=0.1)
    assert cost.run_seconds(slow_arrivals, 4, RATES)[1] == pytest.approx(alone + 2 / 0.1)  # the arrivals' span
    searched = Workload(100, 50, requests=((200, 10), (100, 90)), arrival="poisson", rate_search=(0.1, 0.1))
    assert cost.run_seconds(searched, 4, RATES)[1] == pytest.approx(alone + (RATE_SEARCH_STEPS + 1) * 2 / 0.1)
    assert cost.run_seconds(one_shape, 4, {"aggregate_tok_s": 5.0}) is None  # no decode rate: no forecast
    launch = cost.launch_cost(one_shape, Protocol(warmup_runs=1, min_runs=3), 4, RATES, file_bytes=4e9)
    assert launch.start_s == pytest.approx(cost.START_FIXED_S + 4e9 / cost.LOAD_BYTES_S)
    assert launch.seconds == pytest.approx(launch.start_s + alone + 4 * launch.run_s)
    assert launch.probed_s(1) == pytest.approx(launch.start_s + alone + 2 * launch.run_s)


def study_file(tmp_path, extra: str = ""):
    return write_study(
        tmp_path / "c.toml", "fake-defaults", ["q8", "f16-full"], sampler="grid", parallel=(1, 2), study_extra=extra
    )


def test_the_forecast_prices_a_trial_and_each_baseline_and_counts_the_trials_the_budget_affords(tmp_path):
    with registered(Defaults(), Rates()):
        for scratch in memory_dir(tmp_path):
            prepared = prepare_study(load_study_config(study_file(tmp_path)), storage=f"sqlite:///{scratch / 'c.db'}")
            fc = cost.forecast(prepared)
    assert fc is not None and fc.requests == 2  # one shape: the most slots' requests
    workload = prepared.contexts["fake-defaults"].workload
    # Each configuration's launch at the model's rates (the fake's weights: len(name) / 8 GiB
    # each); the forecast's trial is their median, its range their extremes.
    expected = sorted(
        cost.launch_cost(workload, Protocol(), p, RATES, GIB * len(w) // 8).seconds
        for p in (1, 2)
        for w in ("q8", "f16-full")
    )
    assert fc.trial.seconds == pytest.approx(expected[2]) and fc.trial_range == pytest.approx(
        (expected[0], expected[-1])
    )
    assert [title for title, _ in fc.baselines] == ["fake-defaults's default launch"]
    affordable = fc.trials_affordable(10 * fc.need_s())
    assert affordable == int((10 * fc.need_s() - fc.baselines_s) // fc.trial.seconds)
    text = fc.text(600)
    assert f"one trial about {fc.trial.seconds:.0f} s" in text and "affords about" in text
    assert "fake-model's prediction" in text and "fake-defaults's default launch about" in text
    assert fc.refusal(fc.need_s(), probe=False) is None and fc.refusal(None, probe=False) is None
    refused = fc.refusal(0.4 * fc.need_s(), probe=False)
    assert "cannot measure the baselines and one trial" in refused
    assert "--budget" in refused and "probe_margin" in refused
    # One request shape: shorter requests; drawn ones: fewer of them.
    assert "[workload] output_tokens" in refused and "[workload] requests" not in refused
    from dataclasses import replace

    assert "[workload] requests = " in replace(fc, drawn=True).refusal(0.4 * fc.need_s(), probe=False)
    assert "probe_margin" not in fc.refusal(0.4 * fc.need_s(), probe=True)


def test_the_cli_refuses_a_budget_too_small_before_anything_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    backend = Defaults()
    with registered(backend, Rates()):
        result = CliRunner().invoke(
            cli,
            [
                "study",
                str(study_file(tmp_path)),
                "--budget",
                "1s",
                "--quiet",
                "--storage",
                f"sqlite:///{tmp_path / 'r.db'}",
            ],
        )
        assert result.exit_code == 2, result.output
        assert "cannot measure the baselines and one trial" in result.output and "Remedies" in result.output
        assert backend.calls == []  # refused before any launch
        ok = CliRunner().invoke(
            cli, ["study", str(study_file(tmp_path)), "--trials", "1", "--storage", f"sqlite:///{tmp_path / 'r.db'}"]
        )
    assert ok.exit_code in (0, 1), ok.output
    assert "cost forecast: one trial about" in ok.output


def test_a_study_of_model_backends_has_no_forecast(tmp_path):
    with registered(Rates()):
        for scratch in memory_dir(tmp_path):
            path = write_study(tmp_path / "m.toml", "fake-model", ["q8"], parallel=(1, 2))
            prepared = prepare_study(load_study_config(path), storage=f"sqlite:///{scratch / 'm.db'}")
            assert cost.forecast(prepared) is None  # a prediction costs no measuring


class FastRates(Rates):
    """A model that predicts launches all start and no measuring (the engine's start dominates)."""

    def predict(self, config, ctx):
        fast = {k: v * 1e4 for k, v in RATES.items()}
        return dict(fast, per_user_tok_s=fast["aggregate_tok_s"] / config.parallel)


@pytest.mark.parametrize(
    "model, extra, on",
    [
        (Rates, "", True),  # 2 of 4 runs saved of a launch that is mostly runs
        (FastRates, "", False),  # a launch that is mostly its start: a probe saves little
        (Rates, "probe_margin = 0", False),  # off as asked
        (FastRates, "probe_margin = 0.2", True),  # on as asked, whatever it saves
    ],
)
def test_the_probe_is_on_by_default_where_it_pays(tmp_path, model, extra, on):
    from autotune.study.probe import LeaderGapPruner
    from autotune.study.runner import StudyRunner

    with registered(Defaults(), model()):
        for scratch in memory_dir(tmp_path):
            prepared = prepare_study(
                load_study_config(study_file(tmp_path, extra)), storage=f"sqlite:///{scratch / 'p.db'}"
            )
            runner = StudyRunner(prepared)
            assert isinstance(runner.study.pruner, LeaderGapPruner) is on
            if on and not extra:
                fc = cost.forecast(prepared)
                saved = fc.trial.seconds - fc.trial.probed_s(1)
                assert saved / fc.trial.seconds >= cost.PROBE_PAYS and runner.study.pruner.margin == cost.PROBE_MARGIN
                assert runner.probe_note.startswith("probe: on ([study] probe_margin not given)")
            elif not extra:
                assert runner.probe_note is None


def test_baselines_forecast_beyond_their_share_are_measured_after_the_search(tmp_path):
    from autotune.study.runner import StudyRunner

    backend = Defaults()
    said: list[str] = []
    with registered(backend, Rates()):
        for scratch in memory_dir(tmp_path):
            prepared = prepare_study(
                load_study_config(study_file(tmp_path, "finish_top = 0")), storage=f"sqlite:///{scratch / 'a.db'}"
            )
            runner = StudyRunner(prepared)
            fc = runner.forecast
            budget = 0.9 * fc.baselines_s / cost.BASELINE_SHARE  # their forecast is more than their share
            assert not cost.baselines_first(fc, budget)[0] and cost.baselines_first(fc, 2 * budget)[0]
            summary = runner.run(budget_s=budget, note=said.append)
    kinds = [bool(c.option("defaults")) for c in backend.calls]
    assert kinds == sorted(kinds) and kinds[0] is False and kinds[-1] is True  # every trial, then the baseline
    assert any(line.startswith("baseline: measured after the search") for line in said), said
    assert summary.extra["baseline"]["fake-defaults"]["error"] is None


def test_a_baseline_expected_to_outlast_the_budget_left_is_not_launched(tmp_path):
    import time

    import optuna

    from autotune.measure import deadline
    from autotune.study import baseline, records
    from autotune.study.prepare import prepare_study as prepare

    backend = Defaults()
    with registered(backend, Rates()):
        for scratch in memory_dir(tmp_path):
            prepared = prepare(load_study_config(study_file(tmp_path)), storage=f"sqlite:///{scratch / 'e.db'}")
            study_ = optuna.create_study(storage=f"sqlite:///{scratch / 'e2.db'}", study_name="e")
            with deadline.within(time.monotonic() + 60, "the study's budget (60 s) ran out"):
                baseline.measure(prepared, study_, lambda key: True, "w", expect=lambda key: (1000.0, "its forecast"))
            stored = records.baselines(study_)["fake-defaults"]
    assert backend.calls == [] and stored.retry and baseline.measure_again(stored)
    assert "expected to take 1000 s (its forecast), more than the 60 s left before the study's budget" in stored.error
    # The pace: this run's launches against the forecast trial scale a baseline's forecast.
    fc = cost.Forecast(
        cost.LaunchCost(1.0, 1.0, 2.0, 4), (10.0, 10.0), (("b", 20.0),), 2, Protocol(), "x", baseline_by_key={"b": 20.0}
    )
    assert cost.expected_baseline_s(fc, "b", [])[0] == pytest.approx(20.0)
    assert cost.expected_baseline_s(fc, "b", [25.0, 30.0, 35.0])[0] == pytest.approx(20.0 * 30.0 / fc.trial.seconds)
    assert cost.expected_baseline_s(None, "b", [1.0]) is None and cost.expected_baseline_s(fc, "c", []) is None
