"""How much better than doing nothing: each backend's baselines (its default launch, and any other
choice the engine makes for itself, such as llama.cpp's --fit), measured once per study
(autotune/study/baseline.py), never trials, compared with the winner in the summary."""

from __future__ import annotations

import optuna
import pytest

from autotune.engine.backend import (
    DefaultLaunch,
    Measurement,
    MemoryEstimate,
    StudyContext,
    TrialConfig,
    UserLoad,
    Workload,
)
from autotune.cli import default_study_path
from autotune.config import load_study_config
from autotune.errors import BackendError, ConfigError
from autotune.measure import Stat
from autotune.report.text import summary_json, summary_text
from autotune.study import noise, open_storage, records, run_study
from autotune.study.baseline import compare
from autotune.study.records import TrialRecord

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
        return MemoryEstimate(
            weights_bytes=GIB * len(config.weights) // 8,
            kv_bytes=config.ctx * config.parallel,
            buffers_bytes=0,
            overhead_bytes=0,
        )

    def default_launch(self, weights: str, ctx: StudyContext) -> DefaultLaunch | None:
        if self.decline:
            return None
        return DefaultLaunch(TrialConfig(self.name, weights, 8192, 2, (("defaults", True),)), "fake defaults")

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        if config.option("defaults"):
            if self.fail:
                raise BackendError("CUDA out of memory: tried to allocate 2.00 GiB", log_tail="cudaMalloc failed\n")
            runs = self.fit_runs if config.option("defaults") == "fit" else self.default_runs
            return Measurement(
                metrics={
                    "decode_tok_s": Stat(runs, unit="tok/s"),
                    "aggregate_tok_s": Stat(runs, unit="tok/s"),
                    "per_user_tok_s": Stat(tuple(v / 2 for v in runs), unit="tok/s"),
                }
            )
        return Measurement(metrics=stats_for(self.speed(config), config.parallel))


class FittingBackend(DefaultingBackend):
    """Also an engine that fits itself to the card (as llama.cpp's --fit): a second baseline,
    launched with the user's context and slots, faster than its default launch."""

    def __init__(self, fit_runs=(20.0, 21.0, 19.0), **kwargs):
        super().__init__(**kwargs)
        self.fit_runs = fit_runs
        self.users: list[UserLoad] = []

    def baselines(self, weights: str, ctx: StudyContext, user: UserLoad) -> list[DefaultLaunch]:
        self.users.append(user)
        fit = DefaultLaunch(
            TrialConfig(self.name, weights, user.ctx, user.parallel, (("defaults", "fit"),)),
            f"fake fitting ({user.why})",
            name="fit",
            title="fake --fit",
        )
        return [*super().baselines(weights, ctx, user), fit]


@pytest.fixture
def storage(tmp_path):
    for scratch in memory_dir(tmp_path):
        yield f"sqlite:///{scratch / 'baseline.db'}"


# A study without the finish: each baseline is launched once, its figure that launch's (the
# finish's launches of it, and the between-launch spread, are test_noise's).
ONE_LAUNCH = "finish_top = 0"


def study(tmp_path, extra: str = ""):
    return load_study_config(
        write_study(
            tmp_path / "b.toml", "fake-defaults", ["q8", "f16-full"], sampler="grid", parallel=(1, 2), study_extra=extra
        )
    )


def load(storage: str) -> optuna.Study:
    return optuna.load_study(study_name="fake-study", storage=open_storage(storage))


def test_measured_once_before_the_search_on_the_highest_precision_weights_and_never_a_trial(tmp_path, storage):
    backend = DefaultingBackend()
    with registered(backend):
        summary = run_study(study(tmp_path), n_trials=2, storage=storage)
        assert backend.calls[0].option("defaults") and backend.calls[0].weights == "f16-full"
        # Launched again only by the finish, once per round beside the leaders (issue 39 item 4).
        rounds = noise.baseline_rounds(load(storage)).get("fake-defaults", {})
        assert sum(1 for c in backend.calls[1:] if c.option("defaults")) == len(rounds)
        assert summary.n_measured == 2  # the baseline is not one of the --trials
        run_study(study(tmp_path), n_trials=2, storage=storage)  # resumed: read back, not measured again
    rounds = noise.baseline_rounds(load(storage)).get("fake-defaults", {})
    assert sum(1 for c in backend.calls if c.option("defaults")) == 1 + len(rounds)
    stored = records.baselines(load(storage))["fake-defaults"]
    assert stored.weights == "f16-full" and not stored.failed and stored.seconds is not None
    assert stored.deploy_command == "fake-serve --weights f16-full --ctx 8192 --parallel 2"
    # No trial holds it, and the study's header does not take it for a setting.
    assert all(not (TrialRecord.of(t).config or {}).get("defaults") for t in load(storage).trials)
    assert not any(k.startswith("baseline") for k in records.study_header(load(storage)))


def test_the_ratios_and_both_spreads_are_said(tmp_path, storage):
    with registered(DefaultingBackend()):
        summary = run_study(study(tmp_path, ONE_LAUNCH), n_trials=4, storage=storage)
    best = summary.best
    entry = summary_json(summary)["baseline"]["fake-defaults"]
    agg = entry["ratio"]["aggregate"]
    assert agg["ratio"] == pytest.approx(best["metrics"]["aggregate_tok_s"] / 10.0)
    assert agg["baseline_spread"] == pytest.approx(0.1)  # MAD 1 over median 10
    assert entry["ratio"]["per_user"]["ratio"] == pytest.approx(best["metrics"]["per_user_tok_s"] / 5.0)
    assert entry["aggregate_tok_s"] == {"median": 10.0, "spread": pytest.approx(0.1)}
    assert not agg["within_noise"]
    text = summary_text(summary)
    assert f"{agg['ratio']:.1f}x what fake-defaults's default launch gives in aggregate tok/s (" in text
    assert "vs 10.0 +- 10.0%" in text and "x in per-user tok/s (" in text
    assert "today: fake-serve --weights f16-full" in text


def test_a_baseline_faster_than_every_trial_is_never_the_best(tmp_path, storage):
    with registered(DefaultingBackend(default_runs=(1000.0,))):
        summary = run_study(study(tmp_path), n_trials=4, storage=storage)
    assert summary.best["params"].get("defaults") is None and summary.best["metrics"]["aggregate_tok_s"] < 1000
    assert summary.extra["baseline"]["fake-defaults"]["ratio"]["aggregate"]["ratio"] < 1


def test_a_gain_inside_the_spreads_is_called_noise(tmp_path, storage):
    # The best trial measures 10 * 2 + len("f16-full") + 1 = 29 tok/s; a baseline of 26 +- 15% covers it.
    with registered(DefaultingBackend(default_runs=(22.0, 26.0, 30.0))):
        summary = run_study(study(tmp_path, ONE_LAUNCH), n_trials=4, storage=storage)
    entry = summary.extra["baseline"]["fake-defaults"]
    assert entry["ratio"]["aggregate"]["within_noise"]
    assert (
        "within noise of what fake-defaults's default launch gives in aggregate tok/s: no gain shown" in entry["text"]
    )


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
    assert llama["deploy_command"].startswith("llama-server -m qwen2.5-27b-article-Q8_0.gguf --host")
    assert llama["ratio"]["per_user"]["ratio"] > 3 and not llama["ratio"]["per_user"]["within_noise"]
    assert found["twin-exllamav2"]["error"].startswith("CUDA out of memory")


def fitting_study(tmp_path, ctx=(1024, 4096, 8192)):
    # The workload is 1500 + 800 = 2300 tokens: 4096 is the smallest context that holds it.
    # No finish: the baselines' one launch each is what is checked (test_noise: their finish launches).
    return load_study_config(
        write_study(
            tmp_path / "f.toml",
            "fake-defaults",
            ["q8", "f16-full"],
            sampler="grid",
            ctx=ctx,
            parallel=(1, 2),
            study_extra=ONE_LAUNCH,
        )
    )


def test_a_second_baseline_takes_the_users_context_and_slots_is_measured_once_and_said(tmp_path, storage):
    backend = FittingBackend()
    with registered(backend):
        summary = run_study(fitting_study(tmp_path), n_trials=2, storage=storage)
        run_study(fitting_study(tmp_path), n_trials=1, storage=storage)  # resumed: both read back
    fits = [c for c in backend.calls if c.option("defaults") == "fit"]
    assert len(fits) == 1 and sum(1 for c in backend.calls if c.option("defaults") is True) == 1
    assert (fits[0].weights, fits[0].ctx, fits[0].parallel) == ("f16-full", 4096, 2)
    assert "smallest [space] ctx that holds the workload's 2300 tokens" in backend.users[0].why
    stored = records.baselines(load(storage))
    assert sorted(stored) == ["fake-defaults", "fake-defaults:fit"]
    assert stored["fake-defaults:fit"].name == "fit" and stored["fake-defaults"].name == "default"
    found = summary_json(summary)["baseline"]
    fit = found["fake-defaults:fit"]
    agg = fit["ratio"]["aggregate"]
    assert (fit["backend"], fit["name"], fit["title"]) == ("fake-defaults", "fit", "fake --fit")
    assert agg["ratio"] == pytest.approx(summary.best["metrics"]["aggregate_tok_s"] / 20.0)
    assert agg["baseline_spread"] == pytest.approx(0.05) and agg["winner_spread"] is not None
    assert found["fake-defaults"]["ratio"]["aggregate"]["ratio"] == pytest.approx(2 * agg["ratio"])
    text = summary_text(summary)
    assert f"{agg['ratio']:.1f}x what fake --fit gives in aggregate tok/s (" in text and "vs 20.0 +- 5.0%" in text
    # Beside the default launch's line, after it.
    assert text.index("what fake-defaults's default launch gives") < text.index("what fake --fit gives")
    assert "today: fake-serve --weights f16-full --ctx 4096 --parallel 2" in text
    # `best --json` (the summary of the stored study, one trial later) has the same shape as `study --json`,
    # and the same baselines read back.
    from autotune.study.summary import summarize

    later = summary_json(summarize(load(storage), storage))["baseline"]
    assert {k: sorted(v) for k, v in later.items()} == {k: sorted(v) for k, v in found.items()}
    assert all(
        later[k][f] == found[k][f] for k in found for f in ("aggregate_tok_s", "per_user_tok_s", "deploy_command")
    )


def test_the_users_load_is_the_most_slots_with_the_smallest_context_that_holds_the_workload():
    from autotune.engine.space import BackendSpace
    from autotune.study.baseline import user_load

    def load_of(ctx):
        return user_load(BackendSpace(FittingBackend(), ("q8",), ctx, (4, 1, 2), ()), Workload(1500, 800))

    assert (load_of((8192, 2048, 4096)).ctx, load_of((8192, 2048, 4096)).parallel) == (4096, 4)
    # A study refuses a space where no context holds the workload; a backend asked anyway gets the
    # largest, and the launch is then recorded as unable to hold it (not launched).
    assert load_of((1024, 2048)).ctx == 2048 and "none holds the workload's 2300 tokens" in load_of((1024, 2048)).why


def test_a_study_stored_before_there_were_several_reads_as_the_default_launch():
    study = optuna.create_study()
    study.set_user_attr(
        "baseline:fake-defaults",
        {
            "backend": "fake-defaults",
            "weights": "f16-full",
            "metrics": {"aggregate_tok_s": {"median": 10.0, "spread": 0.1}},
        },
    )
    stored = records.baselines(study)
    assert list(stored) == ["fake-defaults"] and stored["fake-defaults"].name == "default"
    entry = compare(None, stored)["fake-defaults"]
    assert entry["text"] == "fake-defaults's default launch on f16-full: aggregate 10.0 tok/s"
    assert (entry["name"], entry["title"]) == ("default", "fake-defaults's default launch")


class MisnamingBackend(DefaultingBackend):
    def baselines(self, weights: str, ctx: StudyContext, user: UserLoad) -> list[DefaultLaunch]:
        return [DefaultLaunch(TrialConfig(self.name, weights, 8192, 1, (("defaults", True),)), "", name="a:b")]


def test_a_baseline_name_is_a_plain_word_and_a_plugin_that_errs_does_not_stop_the_study(tmp_path, storage):
    with pytest.raises(ValueError, match="got 'a:b'"):
        DefaultLaunch(TrialConfig("x", "w", 256, 1), "", name="a:b")
    from autotune.study.prepare import prepare_study
    from autotune.study.runner import StudyRunner

    backend, said = MisnamingBackend(), []
    with registered(backend):
        summary = StudyRunner(prepare_study(study(tmp_path), storage=storage)).run(n_trials=1, note=said.append)
    assert summary.n_measured == 1 and "baseline" not in summary.extra
    assert any("fake-defaults could not say its baselines (ValueError" in line for line in said), said


def test_llama_servers_fit_launch_is_fit_on_with_the_users_context_and_slots_and_nothing_else():
    from dataclasses import replace

    from autotune.hardware.gpus import get_gpu
    from autotune.measure import Protocol
    from autotune.modelfiles.models import model_from_gguf
    from autotune_plugins.llama_server.backend import LlamaServerBackend
    from tests.conftest import shared_file

    model = shared_file("models/stories260K.gguf")
    ctx = StudyContext(
        gpu=get_gpu("t4"),
        model=model_from_gguf(model),
        workload=Workload(32, 16),
        vram_budget_bytes=15 * 2**30,
        protocol=Protocol(),
        base_dir=model.parent,
        for_gpu=True,
    )
    backend = LlamaServerBackend()
    launches = backend.baselines(model.name, ctx, UserLoad(512, 3, "the user's"))
    assert [launch.name for launch in launches] == ["default", "fit"]
    default, fit = launches
    argv = backend.server_argv(fit.config, ctx, binary="llama-server", port=8080, has_gpu=True)
    assert argv[argv.index("--fit") + 1] == "on" and argv[argv.index("-c") + 1] == "1536"
    assert argv[argv.index("-np") + 1] == "3"
    assert not {"-ngl", "-fa", "-ctk", "-ctv", "-t", "-ub", "-b"} & set(argv)  # --fit chooses the offload
    cpu = backend.server_argv(fit.config, ctx, binary="llama-server", port=8080, has_gpu=False)
    assert cpu[cpu.index("-ngl") + 1] == "0"  # a study without a GPU keeps the engine off it
    assert "--fit chooses the offload" in backend.deploy_command(fit.config, ctx)
    assert fit.title == "llama-server's --fit" and "the user's" in fit.description and "-ngl unset" in fit.description
    on_cpu = replace(ctx, for_gpu=False)
    assert "-ngl 0" in backend.baselines(model.name, on_cpu, UserLoad(512, 3))[1].description
    assert "(and -ngl 0: no GPU)" in backend.deploy_command(fit.config, on_cpu)
    plain = backend.server_argv(default.config, ctx, binary="llama-server", port=8080, has_gpu=True)
    assert not {"-ngl", "-c", "-np", "--fit", "-fa", "-t"} & set(plain)  # the engine's own default: -ngl auto, --fit on
    assert "-ngl auto" in default.description and "every flag but -m at" in backend.deploy_command(default.config, ctx)
    plain_cpu = backend.server_argv(default.config, ctx, binary="llama-server", port=8080, has_gpu=False)
    assert plain_cpu[plain_cpu.index("-ngl") + 1] == "0" and "-c" not in plain_cpu


def test_a_winner_measured_again_is_shown_with_its_range_not_as_plus_minus():
    # The winner's figure after the finish is a median over its runs with their range
    # (summary.headline); "+-" is a single measurement's spread. One sign for two things was
    # the same kind of word slip as issue 28's.
    base = records.Baseline(
        "fake",
        "f16",
        metrics={
            "aggregate_tok_s": {"median": 10.0, "spread": 0.05},
            "per_user_tok_s": {"median": 10.0, "spread": 0.05},
        },
    )
    finished = {
        "metrics": {"aggregate_tok_s": 30.0, "per_user_tok_s": 15.0},
        "spreads": {"aggregate_tok_s": 0.1, "per_user_tok_s": 0.2},
        "runs": {"aggregate_tok_s": 5, "per_user_tok_s": 5},
    }
    text = compare(finished, {"fake": base})["fake"]["text"]
    assert text == (
        "3.0x what fake's default launch gives in aggregate tok/s (30.0, range 10.0% over 5 runs, "
        "vs 10.0 +- 5.0%), 1.5x in per-user tok/s (15.0, range 20.0% over 5 runs, vs 10.0 +- 5.0%)"
    )
    once = compare({**finished, "runs": {}}, {"fake": base})["fake"]["text"]
    assert "(30.0 +- 10.0% vs 10.0 +- 5.0%)" in once
