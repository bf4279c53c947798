"""Launch-to-launch noise (issue 39 item 4, autotune/study/noise.py): every configuration measured
in more than one launch (the finish's rounds, the baselines the finish re-launches beside the
leaders) gives the study's between-launch spread; ratios to baselines use it, and the report
names both spreads."""

from __future__ import annotations

import statistics

import optuna
import pytest

from autotune.engine.backend import Measurement, StudyContext, TrialConfig
from autotune.measure import Stat
from autotune.report.text import summary_text
from autotune.study import noise, open_storage, records, run_study

if __package__:
    from .fake_backends import memory_dir, registered
    from .test_baseline import DefaultingBackend, study
else:
    from fake_backends import memory_dir, registered
    from test_baseline import DefaultingBackend, study

# Each launch's level, in launch order: what a relaunch does to a figure (the H200's 11% median).
LEVELS = (1.0, 1.12, 0.94, 1.06, 0.9, 1.1, 1.0, 0.96)


class Relaunched(DefaultingBackend):
    """Runs inside one launch agree to 1%; each launch is at the next of LEVELS."""

    def __init__(self, baseline_speed: float):
        super().__init__(default_runs=(baseline_speed,))
        self.launch = 0

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        level = LEVELS[self.launch % len(LEVELS)]
        self.launch += 1
        speed = (self.default_runs[0] if config.option("defaults") else self.speed(config)) * level
        runs = (speed * 0.99, speed, speed * 1.01)
        return Measurement(
            metrics={
                "decode_tok_s": Stat(runs, unit="tok/s"),
                "aggregate_tok_s": Stat(runs, unit="tok/s"),
                "per_user_tok_s": Stat(tuple(v / config.parallel for v in runs), unit="tok/s"),
            }
        )


@pytest.fixture
def storage(tmp_path):
    for scratch in memory_dir(tmp_path):
        yield f"sqlite:///{scratch / 'noise.db'}"


def test_the_finish_relaunches_the_baseline_and_the_between_launch_spread_judges_the_ratio(tmp_path, storage):
    # The best measures about 10 * 2 + len("f16-full") + 1 = 29 tok/s; a baseline of 27 is 7%
    # below it: outside one launch's 1% spreads, inside what launches differ by.
    backend = Relaunched(baseline_speed=27.0)
    with registered(backend):
        summary = run_study(
            study(tmp_path, "finish_top = 2\nfinish_rounds = 2\nfinish_max_rounds = 2"), n_trials=4, storage=storage
        )
    stored = optuna.load_study(study_name="fake-study", storage=open_storage(storage))
    rounds = noise.baseline_rounds(stored)["fake-defaults"]
    assert sorted(rounds) == [0, 1] and all(not r["error"] for r in rounds.values())
    # Interleaved: each round's leaders, then the baseline (A B base A B base).
    finish_calls = backend.calls[-6:]
    assert [bool(c.option("defaults")) for c in finish_calls] == [False, False, True, False, False, True]
    found = noise.estimate(stored)
    by_config = noise.launches_by_config(stored, "aggregate_tok_s")
    ranges = [noise.relative_range(v) for v in by_config.values() if len(v) > 1]
    assert found.configs == len(ranges) == 3  # the two leaders and the baseline
    assert found.between == pytest.approx(statistics.median(ranges)) and found.worst == pytest.approx(max(ranges))
    assert found.within == pytest.approx(0.01, abs=1e-6) and found.between > 5 * found.within
    assert len(by_config["baseline:fake-defaults"]) == 3  # its own launch and the finish's two
    agg = summary.extra["baseline"]["fake-defaults"]["ratio"]["aggregate"]
    assert agg["baseline_runs"] == 3 and agg["between_launches"] == pytest.approx(found.between)
    assert abs(agg["ratio"] - 1) < found.between and agg["within_noise"]
    text = summary_text(summary)
    assert (
        f"noise: within a launch 1.0% (the runs inside one launch), between launches {found.between * 100:.1f}%" in text
    )
    assert "within noise of what fake-defaults's default launch gives" in text
    assert "over 3 runs" in text and f"launches differ by {found.between * 100:.1f}%" in text
    from autotune.report.text import write_study_report

    page = write_study_report(stored, summary, tmp_path / "r.html").read_text(encoding="utf-8")
    assert "<p id='noise'>noise: within a launch 1.0%" in page


def test_without_a_second_launch_the_between_spread_is_unknown_and_said_so(tmp_path, storage):
    with registered(Relaunched(baseline_speed=5.0)):
        summary = run_study(study(tmp_path, "finish_top = 0"), n_trials=2, storage=storage)
    assert summary.extra["noise"]["between_launches"] is None
    assert "between launches unknown" in summary.extra["noise"]["text"]
    far = summary.extra["baseline"]["fake-defaults"]["ratio"]["aggregate"]
    assert not far["within_noise"] and far["baseline_runs"] == 1


def test_a_baseline_round_names_its_baseline_and_round_and_is_no_baseline_itself(tmp_path, storage):
    base = records.Baseline("b", "w", name="fit", metrics={"aggregate_tok_s": {"median": 10.0, "spread": 0.02}})
    rounds = {
        0: {"metrics": {"aggregate_tok_s": 12.0}},
        1: {"metrics": {}, "error": "boom"},
        2: {"metrics": {"aggregate_tok_s": 11.0}},
    }
    assert noise.baseline_launches(base, rounds, "aggregate_tok_s") == [10.0, 12.0, 11.0]
    assert noise.relative_range([10.0, 12.0, 11.0]) == pytest.approx(2 / 11)
    assert noise.relative_range([10.0]) is None
    study_ = optuna.create_study(storage=open_storage(storage), study_name="x")
    records.write_baseline(study_, "b", "fit", weights="w", metrics=dict(base.metrics))
    noise.write_baseline_round(study_, "b:fit", 0, metrics={"aggregate_tok_s": 12.0})
    assert noise.baseline_rounds(study_) == {
        "b:fit": {0: {"metrics": {"aggregate_tok_s": 12.0}, "error": None, "worker": None}}
    }
    assert list(records.baselines(study_)) == ["b:fit"]


def test_the_bench_script_pools_a_studys_storages_by_configuration(tmp_path, capsys):
    import importlib.util

    from autotune.study import open_storage as opened

    spec = importlib.util.spec_from_file_location(
        "noise_spreads", noise.__file__.replace("autotune/study/noise.py", "bench/noise_spreads.py")
    )
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    paths = []
    for run, level in (("a", 1.0), ("b", 1.1)):  # two storages of one study: a configuration launched in each
        path = tmp_path / f"{run}.db"
        s = optuna.create_study(storage=opened(f"sqlite:///{path}"), study_name="grid")
        records.write_baseline(
            s, "b", weights="w", metrics={"aggregate_tok_s": {"median": 10.0 * level, "spread": 0.01}}
        )
        paths.append(str(path))
    assert script.main([*paths, "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    [study_row] = out["studies"]
    assert study_row["configs"] == 1 and study_row["median"] == pytest.approx(1.0 / 10.5)
    assert all(r["configs"] == 0 for r in out["storages"])  # one launch in each alone
