"""One trial of a study: claim, judge, make its weights, launch, score, record.

The phase of ``StudyRunner`` between the sampler's proposal and the stored result
(``StudyRunner._evaluate``), following docs/architecture.md's flow: admission (rules, memory,
known quality), quality once per artifact, the launch and its measurement, the score, the
record; a configuration the storage already holds is answered, not launched again.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
import warnings
from dataclasses import dataclass
from typing import Any, Mapping

import optuna

from autotune import artifacts
from autotune import objective as objective_mod
from autotune.artifacts import ArtifactError
from autotune.backend import Measurement, TrialConfig
from autotune.dashboard import annotate_trial
from autotune.errors import BackendError, EngineUnavailableError
from autotune.measure import PROBE_STOP
from autotune.space import NotOffered
from autotune.study import calibration, records, storage, systematic, trial_writes
from autotune.study import cost
from autotune.study.admission import Verdict
from autotune.study.probe import LeaderGapPruner, make_probe
from autotune.study.records import TrialRecord, TrialState, hold, write


@dataclass
class Outcome:
    state: str
    config: dict[str, Any]
    values: list[float] | None = None
    reason: str | None = None
    answered_from: int | None = None
    failed_in: str | None = None           # the scope whose failure this is (study/systematic.py)
    worked: tuple[str, ...] = ()           # the scopes that did their part
    broken: tuple[str, ...] = ()           # the constraints a measured trial broke (its line says so)


class TrialPhase:
    """What happens to one proposed configuration; mixed into ``StudyRunner``, whose state
    (the study, the judge, the claims, the quality book) it uses."""

    def _score(self, m: Measurement, predicted_bytes: int, budget_bytes: int,
               drop: float | None, quality: Mapping[str, Any] | None = None) -> objective_mod.Score:
        """The objective of one measurement: against its measured peak memory where there is one,
        else the predicted footprint."""
        used = m.peak_vram_bytes if m.peak_vram_bytes is not None else predicted_bytes
        per_user = m.metrics.get("per_user_tok_s")
        return objective_mod.score(self.cfg.objective, m.metrics[self.cfg.objective.metric].median, used,
                                   budget_bytes, drop, per_user.median if per_user is not None else None,
                                   (quality or {}).get("admitted"),
                                   {key: m.metrics[key].median for key, _ in self.cfg.objective.slo if key in m.metrics})

    def _annotate(self, trial: optuna.Trial) -> None:
        """The trial's note for optuna-dashboard (``autotune.dashboard``); a note that cannot be
        written costs the study nothing."""
        try:
            annotate_trial(self.study, trial, self.prepared.storage_url)
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"trial {trial.number}: no dashboard note ({type(exc).__name__}: {exc})")

    def _fail_quietly(self, trial: optuna.Trial, reason: str, retry: bool = False) -> None:
        """Record ``trial`` as failed unless it already finished (an interrupt after tell)."""
        try:
            write(trial, fail_reason=reason, **({"retry": True} if retry else {}))
            self.study.tell(trial, state=TrialState.FAIL)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
            pass  # it is finished already: its outcome stands

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

    def _evaluate(self, trial: optuna.Trial) -> Outcome:
        """One trial through the flow."""
        prepared = self.prepared
        try:
            config = prepared.space.suggest(trial)
        except NotOffered as exc:  # a shared knob's value the drawn backend lacks: free, recorded
            write(trial, prune_reason=str(exc))
            self.study.tell(trial, state=TrialState.PRUNED)
            return Outcome("PRUNED", {}, reason=str(exc))
        backend = prepared.backend(config.backend)
        ctx = prepared.contexts[config.backend]
        write(trial, config=config.as_dict(), config_key=config.key, worker=self.worker)

        earlier = self._claim(trial, config)
        if earlier is not None:
            return self._answer_from(trial, earlier, config)

        # The configuration is stored before the claim (another worker that meets the claim reads
        # it); what follows is held (records.hold) and stored by the next write, which comes
        # before anything that makes, measures, launches or tells.
        verdict = self.judge.judge(config)
        if verdict.estimate is not None:
            hold(trial, predicted_vram=verdict.estimate.to_dict())
        hold(trial, deploy_command=backend.deploy_command(config, ctx))
        if not verdict.admitted:
            return self._prune(trial, config, verdict)
        deferred = self._over_budget_to_make(config)
        if deferred is not None:
            # Not the configuration's fault, and nothing launched: a later run with the time
            # for it tries it (retry), and this run proposes these weights no more.
            self._deferred_artifacts.add((config.backend, config.weights))
            write(trial, fail_reason=deferred, retry=True, deferred=True)
            self.study.tell(trial, state=TrialState.FAIL)
            self._say(f"trial {trial.number}: {deferred}")
            return Outcome("FAIL", config.as_dict(), reason=deferred)
        write(trial)  # making weights can take minutes: a crash then keeps what is known
        try:
            self._ensure_artifacts(trial, config)
        except ArtifactError as exc:
            # Only the trials needing this artifact fail; the sampler proposes it no more this run
            # (a later run tries again: the user may have fixed what the tool said).
            self._failed_artifacts.add((config.backend, config.weights))
            self.n_measured += 1
            write(trial, fail_reason=str(exc), **({"log_tail": exc.log_tail[-4000:]} if exc.log_tail else {}))
            self.study.tell(trial, state=TrialState.FAIL)
            # Too large for the disk is this artifact's size, as out of memory is a configuration's.
            return Outcome("FAIL", config.as_dict(), reason=str(exc),
                           failed_in=None if isinstance(exc, artifacts.DiskSpaceError) else systematic.making(config.backend))
        verdict = self.judge.judge(config)  # a made artifact: its own tensors, not the prediction
        if verdict.estimate is not None:
            hold(trial, predicted_vram=verdict.estimate.to_dict())
        if not verdict.admitted:
            return self._prune(trial, config, verdict)
        if self.quality is not None:
            write(trial)  # measuring quality can take minutes
            # Quality depends on the artifact, not on ctx or parallel, and is measured once per
            # study; when it rules the configuration out, launching it would be waste.
            described = self.quality.trial_quality(config)
            hold(trial, quality=described, **({"quality_drop_points": described["drop_points"]}
                                              if "drop_points" in described else {}))
            verdict = self.judge.judge(config)
            if not verdict.admitted:
                return self._prune(trial, config, verdict)

        write(trial, engine={"backend": backend.name, "engine": backend.engine, "version": backend.engine_build(ctx)},
              gpu=records.gpu_attrs(prepared.gpu))
        heard: dict[str, str] = {}
        run_ctx = ctx
        if isinstance(self.study.pruner, LeaderGapPruner):
            run_ctx = dataclasses.replace(ctx, probe=make_probe(
                trial, self.cfg.objective, verdict.estimate.total_bytes, ctx.vram_budget_bytes,  # type: ignore[union-attr]
                trial.user_attrs.get("quality_drop_points"), self.study.pruner.margin, heard))
        try:
            measurement = backend.run(config, run_ctx)
        except EngineUnavailableError:
            raise
        except BackendError as exc:
            self.n_measured += 1
            cut = cost.cut_short(exc)
            if cut is not None:  # the budget ended it, not the engine: a run with time left measures it again
                write(trial, fail_reason=cut, retry=True, **({"log_tail": exc.log_tail[-4000:]} if exc.log_tail else {}))
                self.study.tell(trial, state=TrialState.FAIL)
                return Outcome("FAIL", config.as_dict(), reason=cut)
            write(trial, fail_reason=str(exc), **({"log_tail": exc.log_tail[-4000:]} if exc.log_tail else {}))
            self.study.tell(trial, state=TrialState.FAIL)
            return Outcome("FAIL", config.as_dict(), reason=str(exc), failed_in=systematic.launching(config.backend),
                           worked=(systematic.making(config.backend),))
        self.n_measured += 1
        assert verdict.estimate is not None and verdict.raw_total_bytes is not None
        records.hold_measurement(trial, measurement, verdict.estimate.total_bytes)
        if measurement.peak_vram_bytes is not None:
            residual = measurement.peak_vram_bytes - verdict.raw_total_bytes
            hold(trial, vram_residual_bytes=int(residual))
            self.judge.learn(backend.name, residual)

        metric = self.cfg.objective.metric
        if metric not in measurement.metrics:
            raise BackendError(f"backend '{backend.name}' did not measure {metric}")
        if measurement.metrics[metric].stop_reason == PROBE_STOP:
            # One run is not a measurement to crown: recorded, never launched again, never best.
            write(trial, prune_reason=heard.get("reason", "probe: stopped after the first run"), probe=True)
            self.study.tell(trial, state=TrialState.PRUNED)
            return Outcome("PRUNED", config.as_dict(), reason=heard.get("reason"),
                           worked=(systematic.making(config.backend), systematic.launching(config.backend)))
        s = self._score(measurement, verdict.estimate.total_bytes, ctx.vram_budget_bytes,
                        trial.user_attrs.get("quality_drop_points"), records.joined(trial.user_attrs, "quality"))
        records.set_constraints(trial, s.constraints)
        write(trial, score={"values": list(s.values), "throughput": s.throughput, "penalty": s.penalty,
                            "quality_drop_points": s.quality_drop_points, "feasible": s.feasible})
        self.study.tell(trial, list(s.values))
        calibration.calibrate(prepared, self.study)  # what predicts from now on learns from this trial
        return Outcome("COMPLETE", config.as_dict(), list(s.values),
                       worked=(systematic.making(config.backend), systematic.launching(config.backend)),
                       broken=tuple(k for k, v in s.constraints.items() if v > 0))

    def _affordable(self, config: TrialConfig) -> bool:
        return (config.backend, config.weights) not in self._deferred_artifacts

    def _over_budget_to_make(self, config: TrialConfig) -> str | None:
        """Why ``config`` is not started, when making its weights (``artifacts.predict_making``)
        and then one launch (the median so far) would end after the budget; None when it fits,
        when there is nothing to make, or before anything was measured in this run (a study
        must measure something, and the first making teaches the rate)."""
        if self._deadline is None or not self._launch_seconds:
            return None
        backend = self.prepared.backend(config.backend)
        ctx = self.prepared.contexts[config.backend]
        need = artifacts.predict_making(backend, config.weights, ctx)
        if need is None or need.seconds is None:
            return None  # nothing to make, or no way to tell what it costs: it is tried
        left = self._deadline - time.monotonic()
        launch = statistics.median(self._launch_seconds)
        if need.seconds + launch <= left:
            return None
        return (f"not started: making {' then '.join(need.formats)} would take about {need.seconds:.0f} s "
                f"({need.basis}) and a launch {launch:.0f} s, with {max(left, 0):.0f} s of the budget left")

    def _ensure_artifacts(self, trial: optuna.Trial, config: TrialConfig) -> None:
        """Make (or find in the cache) the weights this trial loads, and its quality reference's.

        Inside the trial, so the making counts in the study's budget and in this trial's time;
        each artifact is recorded in the trial (path, sha256, seconds to make).
        """
        backend = self.prepared.backend(config.backend)
        ctx = self.prepared.contexts[config.backend]
        wanted = [config.weights]
        reference = self.prepared.reference.get(config.backend) if self.quality is not None else None
        if reference is not None and reference.weights not in wanted:
            wanted.append(reference.weights)
        made = []
        for weights in wanted:
            artifact = artifacts.ensure(backend, weights, ctx, say=self._say_artifact)
            if artifact is not None:
                made.append({**artifact.to_dict(), "weights": weights})
                write(trial, artifacts=made)

    def _say_artifact(self, text: str) -> None:
        """An artifact's line, each said once per run: one study said "cache hit" 324 times for
        a few artifacts, once per trial that loaded them."""
        said: set[str] = self.__dict__.setdefault("_artifact_lines", set())
        if text not in said:
            said.add(text)
            self._say(text)

    def _prune(self, trial: optuna.Trial, config: TrialConfig, verdict: Verdict) -> Outcome:
        records.set_constraints(trial, verdict.constraints)
        write(trial, prune_reason=verdict.reason)
        self.study.tell(trial, state=TrialState.PRUNED)
        return Outcome("PRUNED", config.as_dict(), reason=verdict.reason)

    def _answer_from(self, trial: optuna.Trial, earlier: TrialRecord, config: TrialConfig) -> Outcome:
        """Answer a configuration already in the storage without launching it again.

        The answer is recorded as PRUNED with the earlier trial's outcome attached, not as a
        second COMPLETE copy: copies would crowd the sampler's model of good regions (TPE
        keeps its best 10%) with one point and stop it from exploring.
        """
        skip = {"config", "config_key", "worker", "answered_from", "from_prior", "explore", "prune_reason",
                "retry"}
        # the earlier trial's record, flat columns included (a long field's parts with it)
        trial_writes.set_user_attrs(trial, {key: value for key, value in earlier.raw.items()
                                            if key.split(".", 1)[0] not in skip})
        if earlier.state == TrialState.RUNNING:
            reason = f"being measured by trial {earlier.number} (worker {earlier.worker})"
        else:
            outcome = earlier.values[0] if earlier.values else (earlier.prune_reason or earlier.fail_reason)
            reason = f"already evaluated as trial {earlier.number} ({earlier.state.name}: {outcome})"
        write(trial, answered_from=earlier.number, prune_reason=reason)
        self.study.tell(trial, state=TrialState.PRUNED)
        return Outcome(earlier.state.name, config.as_dict(), list(earlier.values) if earlier.values else None,
                        reason, earlier.number)
