"""The study loop: ask a configuration, judge it, launch it, record it, until the budget is spent.

Each trial follows the flow of docs/architecture.md: sample -> admission (rules, memory,
known quality) -> quality (once per artifact) -> launch and measure -> score -> record. The
runner uses Optuna's ask/tell interface so that it can answer a configuration already in the
storage without launching it again, prune refused configurations with their reason, and leave
the storage consistent on Ctrl-C. Several processes given the same study name and a shared
storage (PostgreSQL) work on one study together; claims keep them from measuring one
configuration twice, and a heartbeat lets a survivor fail a dead worker's trial.
"""

from __future__ import annotations

import functools
import os
import statistics
import socket
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import optuna

from autotune import plugins
from autotune.engine.backend import TrialConfig
from autotune.errors import AutotuneError, BackendError, EngineUnavailableError
from autotune.measure import deadline
from autotune.toolkit.redact import scrub
from autotune.study import baseline, calibration, claims, records, storage, systematic
from autotune.study import cost  # issue 39: the probe where it pays
from autotune.study.claims import Claims
from autotune.study.explain import explain_best
from autotune.study.finish import Finish, finish_token
from autotune.study.interrupts import Interrupted, Interrupts
from autotune.study.judge import judge_for
from autotune.study.probe import LeaderGapPruner
from autotune.study.prepare import prepare_study
from autotune.study.prepared import PreparedStudy
from autotune.study.records import TrialState
from autotune.study.sampling import ScreenedSampler
from autotune.study.trial_phase import RunState, TrialPhase
from autotune.study.trial_queue import TrialQueue
from autotune.study.trial_result import TrialResult, commit
from autotune.engine.strategy import Search
from autotune.study.systematic import FailureWatch, SystematicFailure
from autotune.study.summary import StudySummary, chosen_best, summarize, trial_record
from autotune.study.verdict import best_trial

# Proposals in a row that launch nothing before the runner slips in an unexplored
# configuration (samplers on small discrete spaces keep proposing what they know), and before
# a run stops as converged.
EXPLORE_AFTER_IDLE = 25
MAX_IDLE_PROPOSALS = 300

optuna.logging.set_verbosity(optuna.logging.WARNING)
# Features we use on purpose through ask/tell: the RDB heartbeat (we beat it ourselves) and
# grouped multivariate TPE. Their warnings would only alarm users.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


@dataclass
class TrialEvent:
    """What the runner tells its progress callback after each trial."""

    number: int
    state: str
    config: dict[str, Any]
    value: float | None
    reason: str | None
    best_value: float | None
    best_config: dict[str, Any] | None
    n_done: int
    elapsed_s: float
    answered_from: int | None = None
    broken: tuple[str, ...] = ()  # constraints the measured trial broke: infeasible, said on its line


def make_sampler(prepared: PreparedStudy, seed: int) -> optuna.samplers.BaseSampler:
    """The study's inner sampler, from its strategy (``[study] sampler``). Constraints reach it
    through ``Trial.set_constraint``."""
    return plugins.get_strategy(prepared.cfg.sampler).sampler(seed)


class StudyRunner:
    """Runs trials of a prepared study until its budget is spent."""

    def __init__(self, prepared: PreparedStudy, seed: int | None = None):
        self.prepared = prepared
        self.cfg = prepared.cfg
        self.seed = self.cfg.seed if seed is None else seed
        self.strategy = plugins.get_strategy(self.cfg.sampler)
        # The sampler asks while a trial is sampled: what it reads then is the trial's snapshot.
        self.sampler = ScreenedSampler(
            self.strategy.sampler(self.seed),
            prepared.space,
            self.admissible,
            functools.partial(self._evaluated_keys, snapshot=True),
            seed=self.seed,
        )
        with storage.faults(prepared.shown_storage):  # a disk full, a lock held: one line, exit 2
            self.study = storage.open_study(prepared, self.sampler)
            # The probe as given, else on where it pays (issue 39 item 2: cost.auto_probe).
            self.forecast = cost.safe_forecast(prepared, self.study)
            margin, self.probe_note = (
                (self.cfg.probe_margin, None)
                if self.cfg.probe_margin is not None
                else cost.auto_probe(prepared, self.forecast)
            )
            if margin and len(self.study.directions) == 1:
                self.study.pruner = LeaderGapPruner(margin)
            self.judge = judge_for(prepared, self.study)
            self.quality = self.judge.quality
            self.claims = Claims(storage.sql_engine(self.study), storage.study_id_of(self.study))
            self._fail_dead_workers()
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.finish_token = finish_token(socket.gethostname(), os.getpid())
        self.n_new = 0
        self.converged = False
        self._last_cleanup = float("-inf")
        self._strategy_asks = 0  # queue_next's n
        self.run_state = RunState()
        self.queue = TrialQueue(prepared, self.study, self.judge, self.run_state, self.sampler, self._evaluated_keys)
        self.search = Search(
            seed=self.seed,
            configurations=prepared.space.enumerate,
            evaluated_keys=self._evaluated_keys,
            has_waiting=self.queue.has_waiting,
            enqueue=self.queue.enqueue,
            enqueue_unexplored=self.queue.enqueue_unexplored,
            ranking=lambda: [config for config, _ in self.queue.prior_order()],
        )
        self.interrupts = Interrupts()
        self._note: Callable[[str], None] | None = None
        self._on_trial: Callable[[optuna.Study, optuna.Trial], None] | None = None
        self._failures = FailureWatch()
        self.systematic: SystematicFailure | None = None  # what stopped this run, if a cause every trial repeats
        self.stopped: str = ""  # why the search ended, in words (the study's last line)
        self.phase = TrialPhase(
            prepared,
            self.study,
            self.judge,
            self.claims,
            self.worker,
            self.run_state,
            self._say,
            self._cleanup_dead_workers,
        )
        self.finisher = Finish(
            self.study, prepared, self.claims, self.worker, self.finish_token, self.interrupts, self.phase.score
        )

    def finish(self, note: Callable[[str], None] | None = None) -> int:
        """The noise-aware finish (``Finish.finish``)."""
        return self.finisher.finish(note)

    def _claim_once(self, key: str) -> bool:
        return self.finisher.claim_once(key)

    def _say(self, text: str) -> None:
        if self._note is not None:
            self._note(text)

    # ----------------------------------------------------------------------------- lookups

    def admissible(self, config: TrialConfig) -> bool:
        """Whether ``config`` could run and be accepted, as far as is known without launching it
        (weights whose making failed in this run are not proposed again: each would fail alike;
        nor weights too long to make in what is left of the budget)."""
        weights = (config.backend, config.weights)
        return (
            weights not in self.run_state.failed_artifacts
            and weights not in self.run_state.deferred_artifacts
            and self.judge.judge(config).admitted
        )

    def _evaluated_keys(self, snapshot: bool = False) -> set[str]:
        """Keys of the configurations the storage answers; with ``snapshot``, as of the trial being
        sampled (``storage.trial_snapshot``: the trials its sampler fits on, read once per trial
        instead of once more here)."""
        return set(records.standing_by_key(self.study, trials=storage.trial_snapshot(self.study) if snapshot else None))

    def _fail_dead_workers(self) -> None:
        """Fail the RUNNING trials of dead workers, by the one rule for every host
        (``claims.holder``): on this host a pid that no longer exists (killed -9: a study
        restarted right after a crash need not wait for the heartbeat), on any host a heartbeat
        older than ``storage.HEARTBEAT_GRACE_S``. Failed for a retry: never answers for its
        configuration, which is measured again."""
        for t, holder in claims.running_holders(self.study):
            if not holder.alive:
                why = f"worker {holder.worker or '?'} died: {holder.describe()}"
                storage.set_finished_attrs(
                    self.study, t, records.attributes({"fail_reason": why, "retry": True}), TrialState.FAIL
                )

    def _cleanup_dead_workers(self) -> None:
        """Fail the RUNNING trials of dead workers (``_fail_dead_workers``), and queue again
        what they and earlier runs left unmeasured."""
        self._fail_dead_workers()
        self.queue.requeue_cut_short()

    # ----------------------------------------------------------------------------- queueing

    @property
    def uses_prior(self) -> bool:
        """``[study] prior``, else the strategy's default (``BaseStrategy.prior``), else on for a
        real study whose engine has a model (the twin) that is not the study's backend itself.
        Replayed on the H200 grids it finds the best in 20 of 20 seeds at a quarter of the grid's
        time, TPE in 6 (docs/search.md); a twin study, which would rank with itself, keeps its
        sampler, and so does a study on the CPU (``gpu = "cpu"``: the twin models GPUs). A
        strategy that queues its own choices (``takes_prior`` false: a grid, ``sampler = "twin"``
        ranking before every launch) needs no head start."""
        if not self.strategy.takes_prior:
            return False
        given = self.cfg.prior if self.cfg.prior is not None else self.strategy.prior
        if given is not None:
            return given
        if self.prepared.gpu.is_cpu:
            return False  # the twin models GPUs: on the host its ranking would be a guess
        return bool(calibration.learning_backends(self.prepared))

    def _next_launch_fits(self, left_s: float) -> bool:
        """Whether a launch is expected to end within the ``left_s`` seconds of budget left: a
        budget is a promise to the user, and a launch started just before its end would overrun
        it by a whole trial (the median of this run's launches so far; any launch fits while
        there is none to go by)."""
        if left_s <= 0:
            return False
        return not self.run_state.launch_seconds or statistics.median(self.run_state.launch_seconds) <= left_s

    def queue_strategy_choice(self) -> bool:
        """Let a strategy that queues its own choices (``queues_each_launch``) queue the next,
        unless something waits already. False: it has nothing left to choose."""
        if self.queue.has_waiting():
            return True
        self._strategy_asks += 1
        return self.strategy.queue_next(self.search, self._strategy_asks)

    # ----------------------------------------------------------------------------- loop

    def run(
        self,
        budget_s: float | None = None,
        n_trials: int | None = None,
        callback: Callable[[TrialEvent], None] | None = None,
        note: Callable[[str], None] | None = None,
        on_trial: Callable[[optuna.Study, optuna.Trial], None] | None = None,
    ) -> StudySummary:
        """Run trials until ``budget_s`` seconds are spent or ``n_trials`` configurations launched.

        Only launches (measured or failed) count against ``n_trials``: configurations that the
        judge refuses, and proposals the storage already answers, are recorded as trials too
        but cost nothing.

        Ctrl-C (or SIGTERM) ends the trial in flight as FAIL with reason "interrupted" (a later
        run measures it again) and returns with the storage consistent. An engine that cannot
        run at all (``EngineUnavailableError``) stops the study at once: every trial would fail.
        """
        with storage.faults(self.prepared.shown_storage):  # a disk full, a lock held: one line, exit 2
            self._on_trial = on_trial
            return self._run(budget_s, n_trials, callback, note)

    def _run(
        self,
        budget_s: float | None,
        n_trials: int | None,
        callback: Callable[[TrialEvent], None] | None,
        note: Callable[[str], None] | None,
    ) -> StudySummary:
        if budget_s is None and n_trials is None:
            budget_s, n_trials = self.cfg.budget_s, self.cfg.n_trials
            if budget_s is None and n_trials is None:
                n_trials = 50
        self.strategy.queue_first(self.search)
        if self.uses_prior:
            self.queue.enqueue_prior()
        self._announce_quality_power(note)
        if self.probe_note and note is not None:
            note(self.probe_note)
        self._note = note
        heartbeat = storage.Heartbeat(self.study)
        start = time.monotonic()
        self.run_state.deadline = None if budget_s is None else start + budget_s
        interrupted = False
        with self.interrupts.installed():
            try:
                # The budget ends a request still open at its end (an engine that keeps a stream
                # alive without finishing); the finish runs after the budget, unbounded by it.
                with deadline.within(self.run_state.deadline, f"the study's budget ({budget_s or 0:g} s) ran out"):
                    first, why = cost.baselines_first(self.forecast, budget_s)
                    if first:
                        self.measure_baseline(note, budget_s)
                    elif note is not None:
                        note(why)
                    self._search(heartbeat, start, budget_s, n_trials, callback)
                    if not first:  # what the search left, within their share
                        self.measure_baseline(note, budget_s)
                if self.systematic is None:  # its launches would fail alike
                    self.finish(note)
            except (KeyboardInterrupt, Interrupted):
                self.interrupts.caught()
                interrupted = True
                self.stopped = "interrupted: the storage is consistent; run the same command again to continue"
            finally:
                heartbeat.close()
        self._store_run_facts()
        # Built once, from the storage, as `best`, `report` and the dashboard build it; what only
        # this run knows (how many it launched, how long it took) is added here.
        summary = summarize(self.study, self.prepared.shown_storage)
        summary.n_new = self.n_new
        summary.n_measured = self.run_state.n_measured
        summary.interrupted = interrupted
        summary.elapsed_s = time.monotonic() - start
        return summary

    def _storage_failed(
        self, trial: optuna.Trial | None, result: TrialResult | None, exc: BaseException
    ) -> AutotuneError:
        """The error that stops the study when its storage fails under ``trial``. The trial is
        failed for a retry where the storage still takes that write; else it stays RUNNING, and
        the next run fails it and measures its configuration again: on this host because its
        process is gone (``_fail_dead_workers``), on another once its heartbeat is older
        than ``storage.HEARTBEAT_GRACE_S``."""
        error = storage.fault(exc, self.prepared.shown_storage)
        if trial is None or result is None:
            return error
        try:
            commit(self.study, trial, result.failed(f"the storage failed: {error}", retry=True))
            left = f"trial {trial.number} was failed, to be measured again"
        except Exception:  # noqa: BLE001 - the storage refuses this write too
            left = f"trial {trial.number} is left RUNNING: the next run fails it and measures its configuration again"
        return type(error)(f"{error}; {left}")

    def _store_run_facts(self) -> None:
        """What the summary of this study reads beside its trials: whether this run converged,
        what was excluded before the search, and why the best beats its neighbours."""
        best = chosen_best(self.study)
        why = explain_best(self.prepared, self.study, trial_record(best) if best else None)
        self.study.set_user_attr(
            records.LAST_RUN_ATTR,
            {
                "converged": self.converged,
                "stopped": self.stopped,
                **({"systematic_failure": self.systematic.as_dict()} if self.systematic is not None else {}),
            },
        )
        self.study.set_user_attr(records.EXCLUDED_ATTR, self.prepared.excluded)
        self.study.set_user_attr(records.WHY_BEST_ATTR, why)

    def _search(
        self,
        heartbeat: storage.Heartbeat,
        start: float,
        budget_s: float | None,
        n_trials: int | None,
        callback: Callable[[TrialEvent], None] | None,
    ) -> None:
        """Trials until the budget, the trial count or the space runs out."""
        idle = 0
        while True:
            self.interrupts.raise_if_interrupted()
            if n_trials is not None and self.run_state.n_measured >= n_trials:
                self.stopped = f"{n_trials} trial{'s' if n_trials != 1 else ''} measured, as asked"
                return
            if budget_s is not None and not self._next_launch_fits(budget_s - (time.monotonic() - start)):
                self.stopped = f"the budget ({budget_s:g} s) is spent, or too little of it is left for another launch"
                return
            if self.strategy.ends_with_queue and not self.queue.has_waiting():
                self.stopped = "every configuration of the space was evaluated"
                return
            if self.strategy.queues_each_launch and not self.queue_strategy_choice():
                self.converged = True
                self.stopped = f"converged: the {self.cfg.sampler} strategy has nothing more worth launching"
                return
            measured_before = self.run_state.n_measured
            launch_start = time.monotonic()
            event = self._one_trial(heartbeat, start)
            if self.run_state.n_measured > measured_before:
                self.run_state.launch_seconds.append(time.monotonic() - launch_start)
            self.n_new += 1
            # Proposals answered from the storage, and refused configurations, launch
            # nothing; very many in a row mean nothing is left that could run.
            idle = 0 if self.run_state.n_measured > measured_before else idle + 1
            if callback:
                callback(event)
            if self.systematic is not None:
                self.stopped = f"stopped: {self.systematic.text}"
                return
            if idle and idle % EXPLORE_AFTER_IDLE == 0 and not self.queue.enqueue_unexplored():
                self.converged = True  # everything that can run has been evaluated
                self.stopped = "the space is exhausted: everything that can run was evaluated"
                return
            if idle >= MAX_IDLE_PROPOSALS:
                self.converged = True
                self.stopped = (
                    f"converged: {MAX_IDLE_PROPOSALS} proposals in a row were answered from the storage or refused"
                )
                return

    def measure_baseline(self, note: Callable[[str], None] | None = None, budget_s: float | None = None) -> int:
        """Each backend's default launch, once per study, before the search (``study.baseline``):
        not a trial, inside the run so that its seconds count in the budget. Workers sharing the
        study claim it, so one of them measures it; a claim of a worker killed on this machine is
        taken over, and an interrupted one is given back for the next run."""
        held: list[str] = []

        def claim(backend: str) -> bool:
            key = f"baseline:{backend}"
            if self._claim_once(key):
                held.append(key)
                return True
            return False

        launches = self.run_state.launch_seconds
        try:
            return baseline.measure(
                self.prepared,
                self.study,
                claim,
                self.worker,
                note,
                budget_s,
                lambda key: cost.expected_baseline_s(self.forecast, key, launches),
            )
        except BaseException:
            stored = records.baselines(self.study)
            for key in held:
                if key.partition(":")[2] not in stored:
                    self.claims.release(key, self.finish_token)
            raise

    def _announce_quality_power(self, note: Callable[[str], None] | None) -> None:
        """Say up front what the quality bound costs (items and seconds on this machine); kept in
        the study's attributes for ``best``. A failure to time it is said, never fatal."""
        if self.quality is None or records.QUALITY_POWER_ATTR in self.study.user_attrs:
            return
        try:
            line = self.quality.power()
        except (BackendError, AutotuneError) as exc:
            line = f"quality: could not time the reference's first batch ({exc})"
        if line is None:
            return
        self.study.set_user_attr(records.QUALITY_POWER_ATTR, line)
        if note is not None:
            note(line)

    def _one_trial(self, heartbeat: storage.Heartbeat, start: float) -> TrialEvent:
        now = time.monotonic()
        if now - self._last_cleanup >= storage.HEARTBEAT_INTERVAL_S / 2:
            # As Optuna's optimize() does before each trial: a worker that died since we started
            # must not hold its configuration forever.
            self._last_cleanup = now
            self._cleanup_dead_workers()
        trial = None
        result = TrialResult()
        try:
            with self.interrupts.deferred():
                trial = self.study.ask()
                heartbeat.beat(trial)
            self.phase.evaluate(trial, result)
            commit(self.study, trial, result)  # finished: the rest of the record, the constraints, the tell
        except (KeyboardInterrupt, Interrupted):
            if trial is not None:
                self._fail_quietly(trial, result, "interrupted", retry=True)
            raise
        except EngineUnavailableError as exc:
            assert trial is not None
            self._fail_quietly(trial, result, str(exc), retry=True)  # not the configuration's fault
            raise
        except storage.FAULTS as exc:
            # The storage failed under the trial (a disk full, a lock held past the wait): not the
            # configuration's fault, and every next trial would fail alike. The study stops.
            raise self._storage_failed(trial, result, exc) from None
        except Exception as exc:  # a bug in a plugin must not kill the study either
            assert trial is not None
            launched = "engine" in result.fields
            if launched:
                self.run_state.n_measured += 1  # it was launched: it counts like a BackendError
            if not result.told:
                result.learn(log_tail=scrub(traceback.format_exc())[-4000:])
            self._fail_quietly(trial, result, scrub(f"{type(exc).__name__}: {exc}"))
            config = result.config
            result.state, result.reason = "FAIL", scrub(str(exc))
            result.failed_in = systematic.launching(config["backend"]) if launched and "backend" in config else None
            result.worked = ()
        heartbeat.beat(None)
        outcome = result
        self._failures.worked(*outcome.worked)
        if outcome.failed_in is not None and outcome.reason:
            self.systematic = self._failures.failed(outcome.failed_in, outcome.reason) or self.systematic
        # First: it brings the finished trial into the storage's cache, where the observer reads it.
        best = best_trial(self.study)
        self._observe(trial)
        return TrialEvent(
            number=trial.number,
            state=outcome.state,
            config=outcome.config,
            value=outcome.values[0] if outcome.values else None,
            reason=outcome.reason,
            best_value=best.values[0] if best and best.values else None,
            best_config=dict(best.config) if best and best.config else None,
            n_done=self.run_state.n_measured,
            elapsed_s=time.monotonic() - start,
            answered_from=outcome.answered_from,
            broken=outcome.broken,
        )

    def _fail_quietly(self, trial: optuna.Trial, result: TrialResult, reason: str, retry: bool = False) -> None:
        """End ``result`` as failed and commit it, unless the trial already finished (an
        interrupt after the tell): its outcome stands."""
        if result.told:
            return
        result.failed(reason, **({"retry": True} if retry else {}))
        try:
            commit(self.study, trial, result)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
            pass  # it is finished already: its outcome stands

    def _observe(self, trial: optuna.Trial) -> None:
        """Tell ``on_trial`` (the CLI's dashboard note) of the finished trial; what it raises
        costs the study nothing."""
        if self._on_trial is None:
            return
        try:
            self._on_trial(self.study, trial)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"trial {trial.number}: {type(exc).__name__}: {exc}")


def run_study(
    cfg: Any,
    budget_s: float | None = None,
    n_trials: int | None = None,
    storage: str | None = None,
    seed: int | None = None,
    callback: Callable[[TrialEvent], None] | None = None,
) -> StudySummary:
    """Prepare and run a study; the library entry point behind ``autotune study``."""
    runner = StudyRunner(prepare_study(cfg, storage=storage), seed=seed)
    return runner.run(budget_s=budget_s, n_trials=n_trials, callback=callback)
