"""A budget that runs out in the middle of a measurement ends it as "cut short by the budget",
never as an engine failure; the baselines take at most cost.BASELINE_SHARE of a run's budget,
their cost is said; a baseline the budget or the machine failed is measured again on resume
(issue 39 items 3 and 7)."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import optuna
import pytest

from autotune.engine.backend import Measurement, StudyContext, TrialConfig
from autotune.errors import BackendError
from autotune.measure.local_server import wait_ready
from autotune.measure import deadline
from autotune.study import cost, open_storage, records, run_study
from autotune.study.baseline import measure_again
from autotune.study.records import TrialRecord, TrialState

if __package__:
    from .fake_backends import memory_dir, registered, stats_for
    from .test_baseline import FittingBackend, study
else:
    from fake_backends import memory_dir, registered, stats_for
    from test_baseline import FittingBackend, study


def wait_out_the_deadline(what: str) -> None:
    """What a stream the budget ends does: it runs until the deadline in force, then fails."""
    outer = deadline.current()
    assert outer is not None, f"{what} ran without the budget's deadline"
    time.sleep(max(0.0, outer.left_s()) + 0.01)
    raise BackendError(f"engine measurement failed: {outer.reason}; the engine kept the stream open without finishing")


class SlowDefaults(FittingBackend):
    """Its default launch takes as long as whatever deadline is in force while ``slow_default``;
    its trials take as long as the budget while ``slow_trials``."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.slow_default = True
        self.slow_trials = False

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        if config.option("defaults") is True and self.slow_default:
            self._log(config)
            wait_out_the_deadline("the default launch")
        if not config.option("defaults") and self.slow_trials:
            self._log(config)
            wait_out_the_deadline("a trial")
        return super().run(config, ctx)


@pytest.fixture
def storage(tmp_path):
    for scratch in memory_dir(tmp_path):
        yield f"sqlite:///{scratch / 'cut.db'}"


def load(storage: str) -> optuna.Study:
    return optuna.load_study(study_name="fake-study", storage=open_storage(storage))


def test_the_baselines_stop_at_their_share_and_a_resume_measures_them_again(tmp_path, storage):
    backend = SlowDefaults()
    budget = 2.0
    with registered(backend):
        start = time.monotonic()
        run_study(study(tmp_path), budget_s=budget, storage=storage)
        spent_on_default = backend.calls and backend.calls[0].option("defaults") is True
        stored = records.baselines(load(storage))
        default, fit = stored["fake-defaults"], stored["fake-defaults:fit"]
        # The default launch was ended by the share (a quarter of 2 s), not by the engine.
        assert spent_on_default and default.retry and default.error.startswith(cost.CUT_SHORT)
        assert "baselines' share of the budget (25% of 2 s" in default.error
        assert default.seconds == pytest.approx(cost.BASELINE_SHARE * budget, abs=0.3)
        # The second one was not launched at all: nothing of the share was left.
        assert fit.retry and "not launched" in fit.error and fit.seconds is None
        assert sum(1 for c in backend.calls if c.option("defaults") == "fit") == 0
        # The search had the rest: at least one trial measured within the budget.
        assert any(not c.option("defaults") for c in backend.calls)
        assert time.monotonic() - start < budget + 2.0
        from autotune.study.summary import summarize

        said = summarize(load(storage), storage).extra["baseline"]["fake-defaults"]["text"]
        assert said.startswith("fake-defaults's default launch on f16-full not measured: cut short by the budget")
        assert said.endswith("the next run measures it") and "f16-full failed" not in said
        # A resume with a fast engine measures both again; the stale failures are gone.
        backend.slow_default = False
        summary = run_study(study(tmp_path), n_trials=1, storage=storage)
    stored = records.baselines(load(storage))
    assert not stored["fake-defaults"].failed and not stored["fake-defaults:fit"].failed
    assert all(not e["retry"] and e["error"] is None for e in summary.extra["baseline"].values())


def test_a_trial_the_budget_ends_is_cut_short_not_an_engine_failure_and_is_measured_again(tmp_path, storage):
    backend = SlowDefaults()
    backend.slow_default, backend.slow_trials = False, True
    with registered(backend):
        first = run_study(study(tmp_path, "baseline = false"), budget_s=1.0, storage=storage)
        failed = [TrialRecord.of(t) for t in load(storage).trials if t.state == TrialState.FAIL]
        assert len(failed) == 1 and failed[0].retry and failed[0].fail_reason.startswith(cost.CUT_SHORT)
        assert "the study's budget (1 s) ran out" in failed[0].fail_reason
        assert not first.extra.get("failures"), first.extra.get("failures")
        cut_key = failed[0].config_key
        backend.slow_trials = False
        run_study(study(tmp_path, "baseline = false"), n_trials=4, storage=storage)  # the grid's rest, then it
    measured = [TrialRecord.of(t) for t in load(storage).trials if t.state == TrialState.COMPLETE]
    assert cut_key in {r.config_key for r in measured}


def test_a_baseline_failed_for_its_own_sake_stays_failed_one_failed_for_the_budgets_is_measured_again():
    own = records.Baseline("b", "w", error="llama-server exited with code 1: cudaMalloc failed: out of memory")
    assert not measure_again(own)
    assert measure_again(records.Baseline("b", "w", error="anything", retry=True))
    # Stored before Baseline.retry, in the words of that time (issue 39's report).
    legacy = records.Baseline(
        "b",
        "w",
        error="llama-server measurement failed: the study's budget (300 s) ran "
        "out; the engine kept the stream open without finishing",
    )
    assert measure_again(legacy)
    assert not measure_again(records.Baseline("b", "w", metrics={"aggregate_tok_s": {"median": 1.0}}))


def test_a_server_still_loading_when_the_budget_ends_says_so_at_once():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        start = time.monotonic()
        with httpx.Client() as http, deadline.within(time.monotonic() + 0.2, "the study's budget (3 s) ran out"):
            with pytest.raises(BackendError, match=r"budget \(3 s\) ran out while it loaded"):
                wait_ready(
                    proc, http, "http://127.0.0.1:9/health", 60, lambda what: BackendError(f"server is running: {what}")
                )
        assert time.monotonic() - start < 5  # not "not ready after 60 s"
    finally:
        proc.kill()
        proc.wait()
