"""One trial of a study: claim, judge, make its weights, launch, score, record.

The phase of a study between the sampler's proposal and the stored result
(``TrialPhase.evaluate``, which ``StudyRunner`` calls for each trial), following
docs/architecture.md's flow: admission (rules, memory, known quality), quality once per
artifact, the launch and its measurement, the score, the record; a configuration the storage
already holds is answered, not launched again.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

import optuna

from autotune.modelfiles import artifacts
from autotune.study import objective as objective_mod
from autotune.modelfiles.artifacts import ArtifactError
from autotune.engine.backend import Measurement, TrialConfig
from autotune.errors import BackendError, EngineUnavailableError
from autotune.measure import PROBE_STOP
from autotune.engine.space import DRAFT_OPTION, NotOffered
from autotune.study import calibration, cost, records, storage, systematic
from autotune.study.probe import LeaderGapPruner, make_probe
from autotune.study.records import TrialRecord, TrialState
from autotune.study.trial_result import TrialResult, commit

if TYPE_CHECKING:  # pragma: no cover
    from autotune.study.admission import Admission
    from autotune.study.claims import Claims
    from autotune.study.prepared import PreparedStudy


@dataclasses.dataclass
class RunState:
    """What one run has learnt so far, kept by the runner, whose loop stops on it, and added to
    by its trial phase."""

    n_measured: int = 0  # trials launched, or failed making their weights: what ``n_trials`` counts
    launch_seconds: list[float] = dataclasses.field(default_factory=list)  # each such trial's, making included
    deadline: float | None = None  # time.monotonic() at which this run's budget ends
    # Weights (backend, weights) not proposed again in this run: their making failed (each
    # trial would fail alike), or would take longer than what is left of the budget.
    failed_artifacts: set[tuple[str, str]] = dataclasses.field(default_factory=set)
    deferred_artifacts: set[tuple[str, str]] = dataclasses.field(default_factory=set)


class TrialPhase:
    """What happens to one proposed configuration.

    Args:
        prepared, study: The prepared study and its Optuna study.
        judge: The study's judge (``study/judge.py``), its quality book with it.
        claims: The study's claims (``study/claims.py``).
        worker: This worker's name, stored with each trial.
        run_state: What this run has learnt, shared with the runner.
        say: Says a line of progress.
        cleanup_dead_workers: Fails the trials of dead workers (a claim's holder may be one).
    """

    def __init__(
        self,
        prepared: "PreparedStudy",
        study: optuna.Study,
        judge: "Admission",
        claims: "Claims",
        worker: str,
        run_state: RunState,
        say: Callable[[str], None],
        cleanup_dead_workers: Callable[[], None],
    ):
        self.prepared, self.cfg, self.study = prepared, prepared.cfg, study
        self.judge, self.quality, self.claims, self.worker = judge, judge.quality, claims, worker
        self.run_state, self._say, self._cleanup_dead_workers = run_state, say, cleanup_dead_workers
        self._artifact_lines: set[str] = set()

    def score(
        self,
        m: Measurement,
        predicted_bytes: int,
        budget_bytes: int,
        drop: float | None,
        quality: Mapping[str, Any] | None = None,
    ) -> objective_mod.Score:
        """The objective of one measurement: against its measured peak memory where there is one,
        else the predicted footprint."""
        used = m.peak_vram_bytes if m.peak_vram_bytes is not None else predicted_bytes
        per_user = m.metrics.get("per_user_tok_s")
        return objective_mod.score(
            self.cfg.objective,
            m.metrics[self.cfg.objective.metric].median,
            used,
            budget_bytes,
            drop,
            per_user.median if per_user is not None else None,
            (quality or {}).get("admitted"),
            {key: m.metrics[key].median for key, _ in self.cfg.objective.slo if key in m.metrics},
        )

    def _claim(self, trial: optuna.Trial, config: TrialConfig) -> TrialRecord | None:
        """Claim ``config`` for ``trial``; returns the trial that answers for it instead, if any."""
        if self.claims.engine is None:
            earlier = records.standing_by_key(self.study).get(config.key)
            return earlier if earlier is not None and earlier.number != trial.number else None
        holder = None
        for _ in range(3):
            holder_id = self.claims.claim(config.key, storage.trial_id_of(trial))
            if holder_id is None or holder_id == storage.trial_id_of(trial):
                return None
            frozen = storage.frozen(self.study, holder_id)
            if frozen.state == TrialState.RUNNING:
                self._cleanup_dead_workers()
                frozen = storage.frozen(self.study, holder_id)
            holder = TrialRecord.of(frozen)
            abandoned = holder.state == TrialState.FAIL and (holder.retry or not holder.fail_reason)
            if not abandoned:
                return holder
            if self.claims.take_over(config.key, holder_id, storage.trial_id_of(trial)):
                return None
        return holder

    def evaluate(self, trial: optuna.Trial, r: TrialResult) -> TrialResult:
        """One trial through the flow, learnt into ``r`` (and returned); committed at the
        checkpoints of study/trial_result.py, the last one (finished) by the runner."""
        prepared = self.prepared
        try:
            config = prepared.space.suggest(trial)
        except NotOffered as exc:  # a shared knob's value the drawn backend lacks: free, recorded
            return r.pruned(str(exc))
        backend = prepared.backend(config.backend)
        ctx = prepared.contexts[config.backend]
        r.config = config.as_dict()
        r.learn(config=r.config, config_key=config.key, worker=self.worker)
        commit(self.study, trial, r)  # started: another worker that meets the claim reads them

        earlier = self._claim(trial, config)
        if earlier is not None:
            return self._answer_from(r, earlier)

        verdict = self.judge.judge(config)
        if verdict.estimate is not None:
            r.learn(predicted_vram=verdict.estimate.to_dict())
        r.learn(deploy_command=backend.deploy_command(config, ctx))
        if not verdict.admitted:
            return r.pruned(verdict.reason, verdict.constraints)
        deferred = self._over_budget_to_make(config)
        if deferred is not None:
            # Not the configuration's fault, and nothing launched: a later run with the time
            # for it tries it (retry), and this run proposes these weights no more.
            self.run_state.deferred_artifacts.add((config.backend, config.weights))
            self._say(f"trial {trial.number}: {deferred}")
            return r.failed(deferred, retry=True, deferred=True)
        commit(self.study, trial, r)  # making weights can take minutes: a crash then keeps what is known
        try:
            self._ensure_artifacts(trial, config, r)
        except ArtifactError as exc:
            # Only the trials needing this artifact fail; the sampler proposes it no more this run
            # (a later run tries again: the user may have fixed what the tool said).
            self.run_state.failed_artifacts.add((config.backend, config.weights))
            self.run_state.n_measured += 1
            r.failed(str(exc), exc.log_tail)
            # Too large for the disk is this artifact's size, as out of memory is a configuration's.
            r.failed_in = None if isinstance(exc, artifacts.DiskSpaceError) else systematic.making(config.backend)
            return r
        verdict = self.judge.judge(config)  # a made artifact: its own tensors, not the prediction
        if verdict.estimate is not None:
            r.learn(predicted_vram=verdict.estimate.to_dict())
        if not verdict.admitted:
            return r.pruned(verdict.reason, verdict.constraints)
        if self.quality is not None:
            commit(self.study, trial, r)  # measuring quality can take minutes
            # Quality depends on the artifact, not on ctx or parallel, and is measured once per
            # study; when it rules the configuration out, launching it would be waste.
            described = self.quality.trial_quality(config)
            r.learn(
                quality=described,
                **({"quality_drop_points": described["drop_points"]} if "drop_points" in described else {}),
            )
            verdict = self.judge.judge(config)
            if not verdict.admitted:
                return r.pruned(verdict.reason, verdict.constraints)

        r.learn(
            engine={"backend": backend.name, "engine": backend.engine, "version": backend.engine_build(ctx)},
            gpu=records.gpu_attrs(prepared.gpu),
        )
        commit(self.study, trial, r)  # the launch
        drop = r.fields.get("quality_drop_points")
        heard: dict[str, str] = {}
        run_ctx = ctx
        if isinstance(self.study.pruner, LeaderGapPruner):
            run_ctx = dataclasses.replace(
                ctx,
                probe=make_probe(
                    trial,
                    self.cfg.objective,
                    verdict.estimate.total_bytes,
                    ctx.vram_budget_bytes,  # type: ignore[union-attr]
                    drop,
                    self.study.pruner.margin,
                    heard,
                ),
            )
        made = (systematic.making(config.backend),)
        try:
            measurement = backend.run(config, run_ctx)
        except EngineUnavailableError:
            raise
        except BackendError as exc:
            self.run_state.n_measured += 1
            cut = cost.cut_short(exc)
            if cut is not None:  # the budget ended it, not the engine: a run with time left measures it again
                return r.failed(cut, exc.log_tail, retry=True)
            r.failed(str(exc), exc.log_tail)
            r.failed_in, r.worked = systematic.launching(config.backend), made
            return r
        self.run_state.n_measured += 1
        assert verdict.estimate is not None and verdict.raw_total_bytes is not None
        r.learn(**records.measurement_fields(measurement, verdict.estimate.total_bytes))
        if measurement.peak_vram_bytes is not None:
            residual = measurement.peak_vram_bytes - verdict.raw_total_bytes
            r.learn(vram_residual_bytes=int(residual))
            self.judge.learn(backend.name, residual)

        metric = self.cfg.objective.metric
        if metric not in measurement.metrics:
            raise BackendError(f"backend '{backend.name}' did not measure {metric}")
        r.worked = made + (systematic.launching(config.backend),)
        if measurement.metrics[metric].stop_reason == PROBE_STOP:
            # One run is not a measurement to crown: recorded, never launched again, never best.
            r.pruned(heard.get("reason", "probe: stopped after the first run"), probe=True)
            r.reason = heard.get("reason")
            return r
        s = self.score(measurement, verdict.estimate.total_bytes, ctx.vram_budget_bytes, drop, r.fields.get("quality"))
        r.learn(
            score={
                "values": list(s.values),
                "throughput": s.throughput,
                "penalty": s.penalty,
                "quality_drop_points": s.quality_drop_points,
                "feasible": s.feasible,
            }
        )
        r.completed(list(s.values), s.constraints)
        commit(self.study, trial, r)  # finished: the calibration reads this trial
        calibration.calibrate(prepared, self.study)  # what predicts from now on learns from this trial
        r.broken = tuple(k for k, v in s.constraints.items() if v > 0)
        return r

    def _over_budget_to_make(self, config: TrialConfig) -> str | None:
        """Why ``config`` is not started, when making its weights (``artifacts.predict_making``)
        and then one launch (the median so far) would end after the budget; None when it fits,
        when there is nothing to make, or before anything was measured in this run (a study
        must measure something, and the first making teaches the rate)."""
        if self.run_state.deadline is None or not self.run_state.launch_seconds:
            return None
        backend = self.prepared.backend(config.backend)
        ctx = self.prepared.contexts[config.backend]
        need = artifacts.predict_making(backend, config.weights, ctx)
        if need is None or need.seconds is None:
            return None  # nothing to make, or no way to tell what it costs: it is tried
        left = self.run_state.deadline - time.monotonic()
        launch = statistics.median(self.run_state.launch_seconds)
        if need.seconds + launch <= left:
            return None
        return (
            f"not started: making {' then '.join(need.formats)} would take about {need.seconds:.0f} s "
            f"({need.basis}) and a launch {launch:.0f} s, with {max(left, 0):.0f} s of the budget left"
        )

    def _ensure_artifacts(self, trial: optuna.Trial, config: TrialConfig, r: TrialResult) -> None:
        """Make (or find in the cache) the weights this trial loads, and its quality reference's.

        Inside the trial, so the making counts in the study's budget and in this trial's time;
        each artifact is recorded in the trial (path, sha256, seconds to make).
        """
        backend = self.prepared.backend(config.backend)
        ctx = self.prepared.contexts[config.backend]
        wanted = [config.weights]
        draft = config.option(DRAFT_OPTION)  # speculative decoding's draft weights, made like the main ones
        if isinstance(draft, str) and draft not in wanted:
            wanted.append(draft)
        reference = self.prepared.reference.get(config.backend) if self.quality is not None else None
        if reference is not None and reference.weights not in wanted:
            wanted.append(reference.weights)
        made = []
        for weights in wanted:
            artifact = artifacts.ensure(backend, weights, ctx, say=self._say_artifact)
            if artifact is not None:
                made.append({**artifact.to_dict(), "weights": weights})
                r.learn(artifacts=list(made))
                commit(self.study, trial, r)

    def _say_artifact(self, text: str) -> None:
        """An artifact's line, each said once per run: one study said "cache hit" 324 times for
        a few artifacts, once per trial that loaded them."""
        if text not in self._artifact_lines:
            self._artifact_lines.add(text)
            self._say(text)

    def _answer_from(self, r: TrialResult, earlier: TrialRecord) -> TrialResult:
        """Answer a configuration already in the storage without launching it again.

        The answer is recorded as PRUNED with the earlier trial's outcome attached, not as a
        second COMPLETE copy: copies would crowd the sampler's model of good regions (TPE
        keeps its best 10%) with one point and stop it from exploring.
        """
        skip = {"config", "config_key", "worker", "answered_from", "from_prior", "explore", "prune_reason", "retry"}
        # the earlier trial's record (its flat columns follow from its fields)
        r.learn(**{name: getattr(earlier, name) for name in records.STORED if name in earlier.raw and name not in skip})
        if earlier.state == TrialState.RUNNING:
            reason = f"being measured by trial {earlier.number} (worker {earlier.worker})"
        else:
            outcome = earlier.values[0] if earlier.values else (earlier.prune_reason or earlier.fail_reason)
            reason = f"already evaluated as trial {earlier.number} ({earlier.state.name}: {outcome})"
        r.pruned(reason, answered_from=earlier.number)
        r.state, r.answered_from = earlier.state.name, earlier.number
        r.values = list(earlier.values) if earlier.values else None
        return r
