"""bench/replay.py on a tiny recorded grid: the figures it reports are computed right.

The grid is recorded the way the real ones are (the real runner, ``sampler = "grid"``), twice,
with a fake backend whose second run is 10% faster and whose trials take recorded seconds
that differ by configuration; it holds measured configurations, a rule refusal and
configurations over the memory budget.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import pytest

from tests.fake_backends import REPO, FakeBackend, memory_dir, registered, write_study

sys.path.insert(0, str(REPO / "bench"))

import replay  # noqa: E402
from replay_backend import RecordedGrid  # noqa: E402

from autotune.engine.backend import Measurement, StudyContext, TrialConfig  # noqa: E402
from autotune.config import load_study_config  # noqa: E402
from autotune.study import StudyRunner, prepare_study  # noqa: E402

# Formats (gguf:, exl2:) are what the engine plugins declare.
pytestmark = pytest.mark.usefixtures("engine_plugins")

WEIGHTS = ["tiny-Q4_0.gguf", "tiny-bigger-Q8_0.gguf"]  # the longer name is faster (FakeBackend.speed)


class TimedFake(FakeBackend):
    """A fake whose trials take time (parallel x 3 ms) and whose runs can be made faster;
    ``mode = "odd"`` with one slot is refused by its rules."""

    name = "fake-timed"

    def __init__(self, factor: float = 1.0):
        super().__init__()
        self.factor = factor

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        return ["mode odd needs two slots"] if config.option("mode") == "odd" and config.parallel == 1 else []

    def speed(self, config: TrialConfig) -> float:
        return self.factor * super().speed(config)

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        time.sleep(0.003 * min(config.parallel, 8))
        return super().run(config, ctx)


@pytest.fixture(scope="module")
def grid_files(tmp_path_factory):
    """(study file, [run 1 storage, run 2 storage]) of the tiny grid."""
    for tmp in memory_dir(tmp_path_factory.mktemp("grid")):
        study = write_study(
            tmp / "tiny.toml",
            "fake-timed",
            WEIGHTS,
            name="tiny-grid",
            sampler="grid",
            parallel=(1, 2, 4, 4096),
            extra_space='mode = ["plain", "odd"]',
        )
        urls = []
        for run, factor in enumerate((1.0, 1.1), start=1):
            url = f"journal:{tmp}/tiny-run{run}.log"  # faster to write than SQLite
            with registered(TimedFake(factor)):
                StudyRunner(prepare_study(load_study_config(study), storage=url)).run()
            urls.append(url)
        yield study, urls


def replayed(study: Path, urls: list[str], *extra: str) -> dict:
    argv = [a for url in urls for a in ("--grid", url)]
    return replay.run(replay.parse_args([*argv, "--study-file", str(study), *extra]))


def test_the_recorded_grid_is_read_as_recorded(grid_files):
    study, urls = grid_files
    grid = RecordedGrid(urls)
    assert len(grid.configs) == 16
    measured = [k for k in grid.configs if grid.measured(k)]
    assert len(measured) == 10  # 4 over the memory budget (4096 slots), 2 refused by the rule
    # The truth is the mean of the two runs: 1.05 x the fake's speed.
    key = next(k for k in measured if grid.configs[k].parallel == 4 and "bigger" in grid.configs[k].weights)
    speed = FakeBackend().speed(grid.configs[key])
    assert replay.truth_of(grid, key).value == pytest.approx(1.05 * speed)
    assert replay.between_runs(grid)["median_rel_diff"] == pytest.approx(0.1 / 1.05)


def test_budget_one_finds_the_best_at_the_whole_cost_and_prunes_what_the_grid_pruned(grid_files):
    study, urls = grid_files
    out = replayed(study, urls[:1], "--seeds", "2", "--strategies", "random,tpe", "--budget-fraction", "1.0")
    g = out["grids"][0]
    assert g["n_measured"] == 10 and g["n_pruned"] == 6
    assert g["best"]["config"]["parallel"] == 4 and g["best"]["config"]["weights"] == WEIGHTS[1]
    for name in ("random", "tpe"):
        f = g["strategies"][name]
        # One run: every launch costs exactly what the grid recorded. The whole grid's time buys
        # every launch but, at most, a last one shorter than the median, which the budget's rule
        # (start no launch expected to overrun) leaves out; the best is found either way.
        assert f == {**f, "within_3pct": 1.0, "median_ratio": 1.0, "n_seeds": 2}
        assert f["median_launches"] >= 9 and f["median_cost_fraction"] <= 1.0 + 1e-9
        assert f["pruned_but_measured"] == []  # (and nothing the grid pruned was launched: it raises)


def test_a_partial_budget_starts_no_launch_expected_to_overrun_it(grid_files):
    study, urls = grid_files
    out = replayed(study, urls, "--seeds", "3", "--strategies", "random", "--budget-fraction", "0.3")
    g = out["grids"][0]
    grid = RecordedGrid(urls)
    longest = max(t.seconds for k in grid.configs for t in grid.launched(k)) / g["measuring_s"]
    best = g["best"]["truth"]
    for seed in g["seeds"]["random"]:
        assert 0.3 - longest < seed["cost_fraction"] < 0.3 + longest
        assert seed["launches"] < 10
        key = TrialConfig.from_dict(seed["pick"]).key
        assert seed["ratio"] == pytest.approx(replay.truth_of(grid, key).value / best)
    f = g["strategies"]["random"]
    ratios = [s["ratio"] for s in g["seeds"]["random"]]
    assert f["median_ratio"] == statistics.median(ratios)
    assert f["within_3pct"] == sum(r >= 0.97 for r in ratios) / 3


class InterruptedFake(TimedFake):
    """The second run's machine time runs out (Ctrl-C) while it measures four slots after a few
    launches (or at launch ``at_launch``): that launch is stored as interrupted, the rest of the
    run never happens."""

    def __init__(self, at_launch: int | None = None):
        super().__init__(1.1)
        self.launches = 0
        self.at_launch = at_launch  # interrupt this launch instead (the grid's last: 10)

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self.launches += 1
        if (self.launches == self.at_launch) if self.at_launch else (self.launches > 3 and config.parallel == 4):
            time.sleep(0.05)  # longer than any real launch: if counted, it would show
            raise KeyboardInterrupt
        return super().run(config, ctx)


def test_a_run_cut_short_neither_answers_with_its_interrupted_launch_nor_shortens_the_grid(grid_files, tmp_path):
    study, urls = grid_files
    cut = f"journal:{tmp_path}/tiny-cut.log"
    with registered(InterruptedFake()):
        StudyRunner(prepare_study(load_study_config(study), storage=cut)).run()
    grid = RecordedGrid([urls[0], cut])
    whole = RecordedGrid(urls[:1])
    interrupted = [t for ts in grid.by_key.values() for t in ts if t.record.retry]
    assert len(interrupted) == 1 and interrupted[0].run == 1 and interrupted[0].seconds >= 0.05
    key = interrupted[0].record.config_key
    assert [t.run for t in grid.launched(key)] == [0]  # the outcome is run 1's measurement alone
    assert grid.unsettled() == [] and whole.unsettled() == []  # run 1 measured it
    # Every configuration run 2 did not reach counts at run 1's seconds, the others at the mean of
    # the runs (the old figure, the mean of the runs' sums, halved what run 2 never reached).
    expected = sum(statistics.fmean(t.seconds for t in grid.launched(k)) for k in grid.configs if grid.launched(k))
    assert grid.measuring_seconds() == pytest.approx(expected)
    assert {k for k in grid.configs if grid.launched(k)} == {k for k in whole.configs if whole.launched(k)}


def test_a_configuration_every_run_interrupted_is_unsettled_not_pruned(grid_files, tmp_path):
    study, urls = grid_files
    cut = f"journal:{tmp_path}/tiny-cut-last.log"
    with registered(InterruptedFake(at_launch=10)):
        StudyRunner(prepare_study(load_study_config(study), storage=cut)).run()
    grid = RecordedGrid([cut])
    [key] = grid.unsettled()
    assert not grid.launched(key) and all(grid.measured(k) for k in grid.configs if grid.launched(k))
    out = replayed(study, [cut], "--seeds", "2", "--strategies", "random", "--budget-fraction", "1.0")
    g = out["grids"][0]
    assert [json.dumps(c, sort_keys=True) for c in g["unsettled"]] == [json.dumps(json.loads(key), sort_keys=True)]
    assert g["n_pruned"] + len(g["unsettled"]) + g["n_measured"] == g["n_configs"]
    # The whole grid's time buys every launch: each seed tries the unsettled one too, and fails.
    assert g["strategies"]["random"]["unsettled_launches"] >= 1
    assert "unsettled" in replay.text_report(out)
