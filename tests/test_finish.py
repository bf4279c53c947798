"""The noise-aware finish: the best configurations measured again, interleaved, before a winner
is named; a tie where the lead is inside what run-to-run noise explains, resolved by memory."""

from __future__ import annotations

import os
from dataclasses import replace
import socket
import subprocess
import sys
from typing import Mapping, Sequence

import optuna
import pytest
from click.testing import CliRunner

from autotune.engine.backend import Measurement, StudyContext, TrialConfig
from autotune.cli import cli
from autotune.config import load_study_config
from autotune.errors import BackendError, ConfigError
from autotune.report.text import stored_summary, summary_json, summary_text
from autotune.study import StudyRunner, open_storage, prepare_study, records, run_study
from autotune.study.baseline import compare
from autotune.study.finish import finish_token, host_tag
from autotune.study.records import TrialRecord
from autotune.engine.parts import part
from tests.fake_backends import ForwardingPredictor

if __package__:  # tests/ is a package
    from .fake_backends import GIB, FakeBackend, memory_dir, registered, stats_for, write_study
else:
    from fake_backends import GIB, FakeBackend, memory_dir, registered, stats_for, write_study


class ScriptedBackend(FakeBackend):
    """Measures what the test scripts: per weights, the aggregate tok/s of each launch in turn
    (the first is the trial, the next ones the finish's), a measured peak, and launches that
    fail (1-based launch numbers of those weights) or are interrupted (Ctrl-C)."""

    name = "fake-scripted"

    def __init__(
        self,
        speeds: Mapping[str, Sequence[float]],
        peaks_gib: Mapping[str, float] | None = None,
        fail: Mapping[str, int] | None = None,
        interrupt_on_call: int | None = None,
    ):
        super().__init__()
        self.speeds = {k: list(v) for k, v in speeds.items()}
        self.peaks_gib = dict(peaks_gib or {})
        self.fail = dict(fail or {})
        self.interrupt_on_call = interrupt_on_call
        self.launches: dict[str, int] = {}

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        if self.interrupt_on_call is not None and len(self.calls) == self.interrupt_on_call:
            raise KeyboardInterrupt
        n = self.launches[config.weights] = self.launches.get(config.weights, 0) + 1
        if self.fail.get(config.weights) == n:
            raise BackendError("CUDA error: an illegal memory access was encountered")
        values = self.speeds[config.weights]
        peak = self.peaks_gib.get(config.weights)
        return Measurement(
            metrics=stats_for(values[min(n, len(values)) - 1], config.parallel),
            peak_vram_bytes=int(peak * GIB) if peak is not None else None,
        )


@pytest.fixture
def storage(tmp_path):
    for scratch in memory_dir(tmp_path):
        yield f"sqlite:///{scratch / 'finish.db'}"


def study_file(tmp_path, weights: Sequence[str], extra: str = ""):
    # A grid over the weights alone: every configuration measured once, in a seeded order.
    return write_study(
        tmp_path / "finish.toml", "fake-scripted", list(weights), parallel=(1,), sampler="grid", study_extra=extra
    )


def trial_of(storage: str, weights: str) -> int:
    study = optuna.load_study(study_name="fake-study", storage=open_storage(storage))
    return next(t.number for t in study.get_trials() if (TrialRecord.of(t).config or {}).get("weights") == weights)


def test_top_three_measured_again_interleaved_and_a_clear_winner(tmp_path, storage):
    backend = ScriptedBackend({"a": [120, 119, 121], "b": [100, 101, 99], "c": [80, 80, 81], "d": [60]})
    with registered(backend):
        summary = run_study(load_study_config(study_file(tmp_path, "abcd")), storage=storage)
    launched = [c.weights for c in backend.calls]
    assert sorted(launched[:4]) == ["a", "b", "c", "d"]  # the grid, each once
    assert launched[4:] == ["a", "b", "c", "a", "b", "c"]  # the best three, best first, twice, interleaved
    assert summary.n_measured == 4  # the finish's launches are not trials
    finish = summary.extra["finish"]
    assert finish["verdict"] == "winner" and finish["chosen"] == summary.best["number"] == trial_of(storage, "a")
    # Means 120 and 100, each run 1 from its mean: pooled sd 1, t(0.975, 4 df) = 2.776, so noise
    # explains a lead up to 2.776 * 1 * sqrt(2/3) / 100 = 2.27%.
    assert finish["lead"] == pytest.approx(20 / 100) and finish["needed"] == pytest.approx(0.02267, abs=1e-4)
    assert finish["spread"] == pytest.approx(2 / 100)  # b ranges 99..101: shown, not the test
    assert finish["text"].startswith(
        f"winner: trial {finish['chosen']} (lead 20.0% over trial {trial_of(storage, 'b')}, "
        "beyond the 2.3% that run-to-run noise explains at 95% confidence, 3 runs each"
    )
    study = optuna.load_study(study_name="fake-study", storage=open_storage(storage))
    stored = records.remeasures(study)
    assert [stored[trial_of(storage, "a")][i].value for i in (0, 1)] == [119, 121]
    assert all(m.worker for rounds in stored.values() for m in rounds.values())


def test_the_finish_says_what_it_measures_while_it_runs(tmp_path, storage):
    """The finish runs after the budget: one line per launch tells the user why it is still busy."""
    backend = ScriptedBackend({"a": [120, 119, 121], "b": [100, 101, 99], "c": [80, 80, 81], "d": [60]})
    heard: list[str] = []
    with registered(backend):
        StudyRunner(prepare_study(load_study_config(study_file(tmp_path, "abcd")), storage=storage)).run(
            note=heard.append
        )
    a = trial_of(storage, "a")
    assert len(heard) == 6
    assert heard[0].startswith(f"finish 1/6: trial {a} measured again (round 1 of 2, interleaved with trials {a}, ")
    assert heard[-1].startswith("finish 6/6: trial ") and "(round 2 of 2," in heard[-1]


def test_workers_sharing_a_study_share_the_finish_out(tmp_path, storage):
    """Two workers reach the finish together: a round another worker has claimed is not measured
    again here, and the user hears that it was left to that worker."""
    backend = ScriptedBackend({"a": [120, 119, 121], "b": [100, 101, 99], "c": [80, 80, 81]})
    heard: list[str] = []
    with registered(backend):
        runner = StudyRunner(prepare_study(load_study_config(study_file(tmp_path, "abc")), storage=storage))
        host = socket.gethostname()
        elsewhere = next(h for h in (f"other-{i}" for i in range(999)) if host_tag(h) != host_tag(host))
        other_worker = finish_token(elsewhere, os.getpid())  # alive or not, not ours to judge
        for number in (0, 1):  # the grid's first two trials: both among the top three
            assert runner.claims.claim(f"finish:{number}:0", other_worker) is None
        runner.run(note=heard.append)
    assert len(backend.calls) == 3 + 4  # the grid, then the four rounds nobody else claimed
    assert heard[-1] == "finish: 2 round(s) measured by another worker of this study"
    assert {(n, r) for n, rounds in records.remeasures(runner.study).items() for r in rounds} == {
        (0, 1),
        (1, 1),
        (2, 0),
        (2, 1),
    }


def test_rounds_claimed_by_a_worker_killed_on_this_machine_are_taken_over(tmp_path, storage):
    """A worker killed -9 mid-finish leaves its claims; the next run on its machine sees its pid
    gone and measures those rounds itself."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    backend = ScriptedBackend({"a": [120, 119, 121], "b": [100, 101, 99], "c": [80, 80, 81]})
    with registered(backend):
        runner = StudyRunner(prepare_study(load_study_config(study_file(tmp_path, "abc")), storage=storage))
        assert runner.claims.claim("finish:0:0", finish_token(socket.gethostname(), dead.pid)) is None
        runner.run()
    assert len(backend.calls) == 3 + 6
    assert len([r for rounds in records.remeasures(runner.study).values() for r in rounds]) == 6


def test_a_lead_inside_the_spread_is_a_tie_won_by_the_smaller_memory(tmp_path, storage):
    # a leads b by 1% on the means (100.3 vs 99.3), but a's runs vary by 3.5 (sd): noise explains
    # a lead up to 6.2%, a tie; b needs 2 GiB less.
    backend = ScriptedBackend(
        {"a": [100, 97, 104], "b": [99, 101, 98], "c": [50, 50, 50]}, peaks_gib={"a": 6.0, "b": 4.0, "c": 3.0}
    )
    with registered(backend):
        run_study(load_study_config(study_file(tmp_path, "abc")), storage=storage)
    a, b = trial_of(storage, "a"), trial_of(storage, "b")
    summary = stored_summary(storage)  # what `autotune best` reads
    finish = summary.extra["finish"]
    assert finish["verdict"] == "tie" and finish["tied"] == [a, b]
    assert finish["lead"] == pytest.approx(1 / 99.333, rel=1e-3) and finish["needed"] == pytest.approx(0.0618, abs=1e-3)
    assert summary.best["number"] == b and summary.best["params"]["weights"] == "b"
    text = summary_text(summary)
    assert (
        f"tie between trials {a} and {b} (lead 1.0%, within the 6.2% that run-to-run noise explains at 95% "
        f"confidence, 3 runs each): chose {b}, 2.00 GiB less memory"
    ) in text
    assert f"best (trial {b})" in text
    assert (
        f"trial {a}: first 100.0, again 97.0, 104.0 (mean 100.3, median 100.0, range 7.0%), 6.00 GiB measured" in text
    )
    assert summary_json(summary)["finish"]["chosen"] == b
    shown = CliRunner().invoke(cli, ["best", "--storage", storage])
    assert shown.exit_code == 0 and f"chose {b}, 2.00 GiB less memory" in shown.output


def test_a_small_models_memory_reason_is_not_zero(tmp_path, storage):
    # Issue 28: "chose 4, 0.0 GiB less memory". A tiny model's 20 MiB is said in MiB.
    backend = ScriptedBackend({"a": [100, 97, 104], "b": [99, 101, 98]}, peaks_gib={"a": 0.03, "b": 0.01})
    with registered(backend):
        run_study(load_study_config(study_file(tmp_path, "ab")), storage=storage)
    b = trial_of(storage, "b")
    text = summary_text(stored_summary(storage))
    assert f"chose {b}, 20.5 MiB less memory" in text and "0.0 GiB" not in text
    assert "10.2 MiB measured" in text  # the contender's own footprint, not "0.01 GiB"


def test_tie_on_the_same_memory_goes_to_the_higher_per_user_speed(tmp_path, storage):
    # Equal footprints (1% apart is noise): per-user speed decides; with parallel 1 it is the aggregate.
    backend = ScriptedBackend({"a": [100, 97, 104], "b": [99, 101, 98]}, peaks_gib={"a": 4.0, "b": 4.04})
    with registered(backend):
        summary = run_study(load_study_config(study_file(tmp_path, "ab")), storage=storage)
    a, b = trial_of(storage, "a"), trial_of(storage, "b")
    assert summary.extra["finish"]["verdict"] == "tie" and summary.best["number"] == a
    assert f"chose {a}, per-user 100.5 vs 99.5 tok/s" in summary.extra["finish"]["text"]


@pytest.mark.parametrize("weights_failing", ["a", "b"])
def test_a_failure_when_measured_again_does_not_stop_the_study_and_cannot_win(tmp_path, storage, weights_failing):
    backend = ScriptedBackend(
        {"a": [120, 119, 121], "b": [100, 101, 99], "c": [80, 80, 81]}, fail={weights_failing: 2}
    )  # its first re-measure
    with registered(backend):
        summary = run_study(load_study_config(study_file(tmp_path, "abc")), storage=storage)
    assert not summary.interrupted and summary.n_failed == 0  # the trials stand; the finish noted it
    assert len(backend.calls) == 3 + 6  # the finish went on after the failure
    failing, winner = trial_of(storage, weights_failing), trial_of(storage, "b" if weights_failing == "a" else "a")
    finish = summary.extra["finish"]
    assert finish["verdict"] == "winner" and summary.best["number"] == winner
    assert f"trial {failing} failed when measured again" in finish["text"]
    described = next(c for c in finish["contenders"] if c["number"] == failing)
    assert described["failures"] == ["BackendError: CUDA error: an illegal memory access was encountered"]
    assert "failed" in summary_text(summary)


def test_a_finish_cut_short_resumes_without_measuring_again_what_it_stored(tmp_path, storage):
    speeds = {"a": [120, 119, 121], "b": [100, 101, 99], "c": [80, 80, 81]}
    path = study_file(tmp_path, "abc")
    first = ScriptedBackend(speeds, interrupt_on_call=3 + 4)  # Ctrl-C on the finish's fourth launch
    with registered(first):
        summary = run_study(load_study_config(path), storage=storage)
    assert summary.interrupted
    assert summary.extra["finish"]["verdict"] == "incomplete"
    assert "3 of 6 re-measures stored" in summary.extra["finish"]["text"]
    assert summary.best["params"]["weights"] == "a"  # by its first measurement meanwhile

    second = ScriptedBackend({k: v[2:] for k, v in speeds.items()})  # what the missing round measures
    with registered(second):
        summary = run_study(load_study_config(path), storage=storage)
    assert [c.weights for c in second.calls] == ["a", "b", "c"]  # the grid is done: only the missing round
    finish = summary.extra["finish"]
    assert finish["verdict"] == "winner" and summary.best["params"]["weights"] == "a"
    a = next(c for c in finish["contenders"] if c["number"] == trial_of(storage, "a"))
    assert a["remeasured"] == [119, 121]


def test_no_finish_when_turned_off(tmp_path, storage):
    backend = ScriptedBackend({"a": [120], "b": [100], "c": [80]})
    with registered(backend):
        summary = run_study(load_study_config(study_file(tmp_path, "abc", "finish_top = 0")), storage=storage)
    assert len(backend.calls) == 3 and "finish" not in summary.extra
    assert summary.best["params"]["weights"] == "a"


def test_deterministic_runs_agree_and_the_lead_decides(tmp_path, storage):
    # The twin without noise: every run measures the same; the smallest lead wins.
    backend = ScriptedBackend({"a": [100.2], "b": [100.0], "c": [90.0]}, peaks_gib={"a": 9.0, "b": 4.0, "c": 4.0})
    with registered(backend):
        runner = StudyRunner(prepare_study(load_study_config(study_file(tmp_path, "abc")), storage=storage))
        summary = runner.run()
        assert runner.finish() == 0  # everything is stored already
    assert summary.extra["finish"]["verdict"] == "winner" and summary.best["params"]["weights"] == "a"
    assert summary.extra["finish"]["spread"] == 0.0 and summary.extra["finish"]["needed"] == 0.0


def test_more_runs_of_the_same_noise_resolve_a_lead_instead_of_hiding_it(tmp_path, storage):
    """A 3% lead with runs 4% apart: a lead under the range of the runs stays under it however
    many runs there are (a range only widens); the noise of a mean shrinks with more runs, so
    measuring more calls the winner."""
    speeds = {"a": [104, 100] * 4, "b": [101, 97] * 4, "c": [50] * 8}

    def verdict(rounds: int) -> dict:
        with registered(ScriptedBackend(speeds)):
            path = study_file(tmp_path, "abc", f"finish_rounds = {rounds}")
            return run_study(load_study_config(path), storage=storage.replace(".db", f"{rounds}.db")).extra["finish"]

    few, many = verdict(1), verdict(6)
    assert few["verdict"] == "tie" and many["verdict"] == "winner"
    assert many["lead"] == pytest.approx(0.0303, abs=1e-3) and many["lead"] < many["spread"]
    assert many["needed"] < few["needed"]


@pytest.mark.parametrize(
    "extra, message",
    [
        ("finish_top = 1", "[study] finish_top = 1: must be 0 (no finish) or >= 2"),
        ("finish_rounds = 0", "[study] finish_rounds = 0: must be >= 1"),
        ('finish_top = "3"', "[study] finish_top = '3': must be an integer"),
    ],
)
def test_bad_finish_settings_are_named(tmp_path, extra, message):
    with pytest.raises(ConfigError) as err:
        load_study_config(study_file(tmp_path, "ab", extra))
    assert message in str(err.value)


def test_a_close_tie_gets_more_rounds_until_it_resolves_or_reaches_the_cap(tmp_path, storage):
    """A 3% lead, runs 4% apart: after 2 rounds the lead is over half what noise explains, so
    rounds are added one at a time; 5 rounds resolve it, a cap of 4 leaves it a tie."""
    speeds = {"a": [104, 100] * 4, "b": [101, 97] * 4, "c": [50] * 8}

    def finish(max_rounds: int) -> tuple[dict, ScriptedBackend, list[str]]:
        backend, heard = ScriptedBackend(speeds), []
        with registered(backend):
            path = study_file(tmp_path, "abc", f"finish_max_rounds = {max_rounds}")
            runner = StudyRunner(
                prepare_study(load_study_config(path), storage=storage.replace(".db", f"{max_rounds}.db"))
            )
            runner.run(note=heard.append)
            return stored_summary(runner.prepared.storage_url).extra["finish"], backend, heard

    capped, backend, heard = finish(4)
    assert capped["verdict"] == "tie" and capped["rounds"] == 4
    assert len(backend.calls) == 3 + 3 * 4  # the grid, then 4 rounds of all three, interleaved
    assert [c.weights for c in backend.calls[3:9]] == ["a", "b", "c"] * 2
    assert any(line.startswith("finish: trials ") and "one more round (3 of at most 4)" in line for line in heard)
    resolved, backend, _ = finish(6)
    assert resolved["verdict"] == "winner" and resolved["rounds"] == 5 and len(backend.calls) == 3 + 3 * 5
    assert resolved["lead"] > resolved["needed"]


def test_a_tie_of_equals_gets_no_more_rounds(tmp_path, storage):
    # 1% apart with 7% between runs: more runs would confirm the tie, not resolve it.
    backend = ScriptedBackend({"a": [100, 97, 104], "b": [99, 101, 98], "c": [50, 50, 50]})
    with registered(backend):
        summary = run_study(load_study_config(study_file(tmp_path, "abc")), storage=storage)
    assert summary.extra["finish"]["rounds"] == 2 and len(backend.calls) == 3 + 6


def test_finish_max_rounds_below_finish_rounds_is_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_study_config(study_file(tmp_path, "ab", "finish_rounds = 3\nfinish_max_rounds = 2"))
    assert "[study] finish_max_rounds = 2: must be >= finish_rounds (3)" in str(err.value)


def test_the_lead_needed_is_students_and_zero_without_spread():
    from scipy.stats import t

    from autotune.study.verdict import CONFIDENCE, needed_lead

    a, b = [10.0, 11.0, 12.0], [9.0, 9.5, 10.0]
    se = ((2 * 1.0 + 2 * 0.25) / 4 * (1 / 3 + 1 / 3)) ** 0.5  # pooled variances 1.0 and 0.25
    assert needed_lead(a, b) == pytest.approx(t.ppf(0.5 + CONFIDENCE / 2, 4) * se / 9.5, rel=1e-12)
    assert needed_lead([61.06, 61.06], [60.4, 60.4, 60.4]) == 0.0  # the twin: every run agrees
    assert needed_lead([61.06], [60.4]) == float("inf")  # no degree of freedom


def test_the_headline_is_the_median_of_every_run_not_the_first(tmp_path, storage):
    # The case: the search picked the winner on a high first run (2386.5), the finish
    # measured it at 1722.3 and 1437.1; the figure shown, and compared with each baseline, is
    # the median of the three runs, and the first run is shown as such.
    backend = ScriptedBackend({"a": [2386.5, 1722.3, 1437.1], "b": [1000, 1000, 1000]})
    with registered(backend):
        run_study(load_study_config(study_file(tmp_path, "ab")), storage=storage)
    summary = stored_summary(storage)
    best = summary.best
    assert best["params"]["weights"] == "a"
    assert best["metrics"]["aggregate_tok_s"] == pytest.approx(1722.3)
    assert best["runs"]["aggregate_tok_s"] == 3
    assert best["spreads"]["aggregate_tok_s"] == pytest.approx((2386.5 - 1437.1) / 1722.3)
    assert best["first_run"]["metrics"]["aggregate_tok_s"] == pytest.approx(2386.5)
    text = summary_text(summary)
    assert "aggregate 1722.3 tok/s" in text and "(median of 3 runs: the first and 2 of the finish; range 55.1%)" in text
    assert "first run (the search's, picked for being high): " in text and "aggregate 2386.5 tok/s" in text
    default = records.Baseline(
        backend="fake-scripted", weights="a", metrics={"aggregate_tok_s": {"median": 1960.0, "spread": 0.01}}
    )
    ratio = compare(best, {default.key: default})[default.key]["ratio"]["aggregate"]
    assert ratio["winner"] == pytest.approx(1722.3) and ratio["ratio"] < 1 and ratio["within_noise"]


class ExactBackend(ScriptedBackend):
    """A model without noise (``repeats_exactly``): every launch says the same; weights "b" and
    "c" are predicted to need 1 GiB less than "a"."""

    predictor = part(ForwardingPredictor)

    name = "fake-scripted"

    def repeats_exactly(self, ctx: StudyContext) -> bool:
        return True

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext):
        base = super().estimate_memory(config, ctx)
        return base if config.weights == "a" else replace(base, weights_bytes=0)


def test_exact_predictions_are_not_measured_again_and_equal_ones_are_one_answer(tmp_path, storage):
    """Issue 36: the twin's figures repeat exactly, so the finish launches nothing (it measured
    the default study's leaders 4 times to report "a tie within the 0.0% noise explains"); the
    configurations predicted the same score are one answer, the one with the least memory, in
    one line."""
    backend = ExactBackend({"a": [100], "b": [100], "c": [60], "d": [50]})
    with registered(backend):
        summary = run_study(load_study_config(study_file(tmp_path, "abcd")), storage=storage)
    assert len(backend.calls) == 4  # the grid, each once; nothing again
    a, b = trial_of(storage, "a"), trial_of(storage, "b")
    finish = summary.extra["finish"]
    assert finish["verdict"] == "tie" and sorted(finish["tied"]) == sorted([a, b])
    assert finish["chosen"] == b == summary.best["number"]
    first, second = sorted([a, b])
    assert finish["text"] == (
        f"trials {first} and {second} are predicted the same score (100.0): one answer, "
        f"trial {b}, the least memory (1.00 GiB less, predicted)"
    )
    text = summary_text(stored_summary(storage))
    assert text.count(finish["text"]) == 1 and "measured again (" not in text and "noise explains" not in text
    assert records.remeasures(optuna.load_study(study_name="fake-study", storage=open_storage(storage))) == {}


def test_an_exact_lead_is_a_winner_without_a_round(tmp_path, storage):
    backend = ExactBackend({"a": [101], "b": [100], "c": [50]})
    with registered(backend):
        summary = run_study(load_study_config(study_file(tmp_path, "abc")), storage=storage)
    assert len(backend.calls) == 3
    a, b = trial_of(storage, "a"), trial_of(storage, "b")
    finish = summary.extra["finish"]
    assert finish["verdict"] == "winner" and finish["chosen"] == a == summary.best["number"]
    assert finish["text"] == (
        f"winner: trial {a} (1.0% above trial {b}; the figures are exact predictions, so nothing was measured again)"
    )
