"""The study runner: one Optuna study over serving configurations.

Each trial follows the flow of DESIGN.md: sample -> validate -> predict memory -> launch and
measure -> quality -> score -> record. The runner uses Optuna's ask/tell interface so that it
can answer a configuration already in the storage without launching it again, prune invalid
and over-budget configurations with their reason, and leave the storage consistent on Ctrl-C.
Several processes given the same study name and a shared storage (PostgreSQL) work on one
study together, as Optuna supports; a heartbeat lets a survivor fail a dead worker's trial.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import random
import signal
import socket
import threading
import time
import traceback
import warnings
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Mapping

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.storages._heartbeat import is_heartbeat_enabled  # RDBStorage's heartbeat, used by optimize()

from autotune import objective as objective_mod
from autotune import plugins
from autotune.claims import Claims
from autotune import vram
from autotune.backend import BaseBackend, Measurement, MemoryEstimate, StudyContext, TrialConfig, Workload
from autotune.config import StudyConfig
from autotune.errors import AutotuneError, BackendError, ConfigError
from autotune import hardware
from autotune.hardware import GpuSpec
from autotune.measure import Protocol
from autotune.metric import BaseMetric, MetricValue, QualityReference
from autotune.models import ModelSpec, resolve_model
from autotune.sampling import ScreenedSampler
from autotune.space import SearchSpace, build_backend_space, screen

SCHEMA_VERSION = 1
HEARTBEAT_INTERVAL_S = 20
HEARTBEAT_GRACE_S = 60
# Proposals in a row that launch nothing before the runner slips in an unexplored
# configuration (samplers on small discrete spaces keep proposing what they know), and before
# a run stops as converged.
EXPLORE_AFTER_IDLE = 25
MAX_IDLE_PROPOSALS = 300

optuna.logging.set_verbosity(optuna.logging.WARNING)
# Features we use on purpose through ask/tell: the RDB heartbeat (we beat it ourselves, see
# _Heartbeat) and grouped multivariate TPE. Their warnings would only alarm users.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")


@dataclass
class PreparedStudy:
    """A study file resolved against plugins, catalogs and the machine."""

    cfg: StudyConfig
    gpu: GpuSpec
    model: ModelSpec
    vram_budget_bytes: int
    space: SearchSpace
    contexts: dict[str, StudyContext]
    quality: BaseMetric | None
    reference: dict[str, TrialConfig]
    storage_url: str
    excluded: list[str] = field(default_factory=list)

    def backend(self, name: str) -> BaseBackend:
        return plugins.get_backend(name) if name not in self.space.entries else self.space.entries[name].backend


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


@dataclass
class StudySummary:
    """The outcome of ``run_study``."""

    study_name: str
    storage: str
    n_trials: int
    n_complete: int
    n_failed: int
    n_pruned: int
    n_new: int
    n_measured: int
    interrupted: bool
    elapsed_s: float
    best: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def resolve_gpu(cfg: StudyConfig) -> GpuSpec:
    """The study's GPU: a catalog key, or the card NVML finds for ``auto``."""
    return hardware.resolve_gpu(cfg.gpu, cfg.gpu_index,
                                source=f"{cfg.path}: [hardware] gpu" if cfg.path else "[hardware] gpu")


def prepare_study(cfg: StudyConfig, storage: str | None = None) -> PreparedStudy:
    """Resolve a study file against installed plugins, catalogs and the machine.

    Raises:
        ConfigError: every unknown backend, metric, model or GPU and every unusable
            candidate, all at once, each naming the file and field.
    """
    src = str(cfg.path) if cfg.path else "<study>"
    errors: list[str] = []
    gpu = None
    try:
        gpu = resolve_gpu(cfg)
    except ConfigError as exc:
        errors.append(str(exc))
    model = None
    try:
        ref = cfg.model
        candidate_path = cfg.base_dir / ref
        model = resolve_model(str(candidate_path) if candidate_path.exists() else ref)
    except AutotuneError as exc:
        errors.append(f"{src}: [model] ref = {cfg.model!r}: {exc}")

    backends = plugins.get_backends()
    protocol = None
    try:
        protocol = Protocol(**cfg.measure)
    except (AutotuneError, TypeError) as exc:
        errors.append(f"{src}: [measure]: {exc}")

    budget = 0
    if gpu is not None:
        total = cfg.vram_budget_bytes or gpu.vram_bytes
        budget = total - cfg.safety_margin_bytes
        if budget <= 0:
            errors.append(f"{src}: [hardware] safety_margin_mib leaves no memory of {total} bytes")

    entries = []
    taken: set[str] = set()
    contexts: dict[str, StudyContext] = {}
    seen: set[str] = set()
    for i, cand in enumerate(cfg.candidates):
        if cand.backend not in backends:
            errors.append(
                f"{src}: [candidates.{i}] backend = {cand.backend!r}: not installed "
                f"(installed: {', '.join(backends) or 'none'})"
            )
            continue
        if cand.backend in seen:
            errors.append(f"{src}: [candidates.{i}] backend = {cand.backend!r}: listed twice; merge its weights into one entry")
            continue
        seen.add(cand.backend)
        backend = backends[cand.backend]
        if gpu is None or model is None or protocol is None:
            continue
        ctx = StudyContext(
            gpu=gpu,
            model=model,
            workload=Workload(cfg.prompt_tokens, cfg.output_tokens),
            vram_budget_bytes=budget,
            protocol=protocol,
            seed=cfg.seed,
            settings=cfg.backend_settings.get(cand.backend, {}),
            base_dir=cfg.base_dir,
            gpu_index=cfg.gpu_index,
        )
        for w in cand.weights:
            problem = backend.check_weights(w, ctx)
            if problem:
                errors.append(f"{src}: [candidates.{i}] weights {w!r}: {problem}")
        contexts[cand.backend] = ctx
        if "ctx" in cfg.space and "parallel" in cfg.space:
            entry, took = build_backend_space(backend, cand.weights, cfg.space)
            entries.append(entry)
            taken |= took
    for name in cfg.backend_settings:
        if name not in backends:
            errors.append(f"{src}: [backends.{name}]: no such backend (installed: {', '.join(backends) or 'none'})")
    if entries:
        unused = set(cfg.space) - taken - {"ctx", "parallel"}
        for key in sorted(unused):
            errors.append(
                f"{src}: [space] {key}: no backend of this study takes it "
                f"(backends: {', '.join(e.backend.name for e in entries)})"
            )

    quality = None
    if cfg.objective.quality:
        try:
            quality = plugins.get_metric(cfg.objective.quality)
        except AutotuneError as exc:
            errors.append(f"{src}: [objective] quality = {cfg.objective.quality!r}: {exc}")
        else:
            for entry in entries:
                why = quality.supports(entry.backend)
                if why and cfg.objective.require_quality:
                    errors.append(
                        f"{src}: [objective] quality = {quality.name!r} cannot evaluate backend "
                        f"'{entry.backend.name}': {why} (set require_quality = false to run without it)"
                    )
    if errors:
        raise ConfigError("\n".join(errors))

    reference = _references(cfg, SearchSpace(entries), contexts) if quality else {}
    if quality is not None:
        quality.configure(cfg.quality_options, {
            name: QualityReference(ref, backends[ref.backend], contexts[ref.backend]) for name, ref in reference.items()
        })
    screened, excluded = [], []
    for entry in entries:
        narrowed, notes = screen(entry, contexts[entry.backend.name])
        excluded += notes
        if narrowed is not None:
            screened.append(narrowed)
    if not screened:
        raise ConfigError(f"{src}: nothing in the search space can run:\n  " + "\n  ".join(excluded))
    space = SearchSpace(screened)
    return PreparedStudy(
        cfg=cfg,
        gpu=gpu,
        model=model,
        vram_budget_bytes=budget,
        space=space,
        contexts=contexts,
        quality=quality,
        reference=reference,
        storage_url=storage or cfg.storage or cfg.default_storage,
        excluded=excluded,
    )


def _references(cfg: StudyConfig, space: SearchSpace, contexts: Mapping[str, StudyContext]) -> dict[str, TrialConfig]:
    """The configuration each backend's quality is compared against.

    The study file may name the reference weights; otherwise the largest candidate (by the
    backend's own weights estimate) is the highest-precision one. The options are the
    backend's most precise ones (``quality_reference`` picks them).
    """
    refs: dict[str, TrialConfig] = {}
    named = cfg.objective.reference_weights
    for name, entry in space.entries.items():
        ctx = contexts[name]
        weights = entry.weights
        if named and named in weights:
            chosen = named
        elif named and any(named in e.weights for e in space.entries.values()):
            # Another backend owns the reference: compare against that one's quality.
            continue
        else:
            def size(w: str) -> int:
                probe = TrialConfig(name, w, entry.ctx[0], 1, tuple((p.name, p.choices[0]) for p in entry.params))
                return entry.backend.estimate_memory(probe, ctx).weights_bytes
            chosen = max(weights, key=size)
        options = entry.backend.quality_reference({p.name: p.choices for p in entry.params})
        refs[name] = TrialConfig(name, chosen, max(entry.ctx), 1, tuple(sorted(options.items())))
    if named and refs:
        owner = next((n for n, e in space.entries.items() if named in e.weights), None)
        if owner is None:
            raise ConfigError(
                f"{cfg.path}: [objective] reference_weights = {named!r}: not among the candidates' weights"
            )
        for name in space.entries:
            refs.setdefault(name, refs[owner])
    return refs


class _Heartbeat:
    """Records the running trial's heartbeat so another worker can fail it if we die."""

    def __init__(self, study: optuna.Study):
        self.storage = study._storage
        self.trial_id: int | None = None
        self.stop = threading.Event()
        self.enabled = is_heartbeat_enabled(self.storage)
        if self.enabled:
            threading.Thread(target=self._loop, daemon=True, name="autotune-heartbeat").start()

    def _loop(self) -> None:
        while not self.stop.wait(HEARTBEAT_INTERVAL_S / 2):
            trial_id = self.trial_id
            if trial_id is not None:
                try:
                    self.storage.record_heartbeat(trial_id)
                except Exception:  # a missed beat only risks a spurious stale mark later
                    pass

    def beat(self, trial_id: int | None) -> None:
        self.trial_id = trial_id
        if self.enabled and trial_id is not None:
            self.storage.record_heartbeat(trial_id)


def open_storage(url: str) -> optuna.storages.BaseStorage:
    """Optuna storage for a URL; RDB storages get a heartbeat (stale trials of dead workers).

    Raises:
        ConfigError: an unknown scheme, or a database driver that is not installed.
    """
    if url.startswith(("sqlite:", "postgresql", "mysql")):
        engine_kwargs = {"connect_args": {"timeout": 60}} if url.startswith("sqlite:") else {"pool_pre_ping": True}
        for attempt in range(5):
            try:
                return optuna.storages.RDBStorage(
                    url,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=HEARTBEAT_INTERVAL_S,
                    grace_period=HEARTBEAT_GRACE_S,
                )
            except ImportError as exc:
                extra = "postgres" if url.startswith("postgresql") else "a driver for it"
                raise ConfigError(f"storage {url!r}: the database driver is missing ({exc}); "
                                  f"pip install 'autotune[{extra}]'") from None
            except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError):
                # Workers started together on an empty database all create Optuna's tables;
                # all but one lose that race (optuna/optuna#1092). The tables exist by now.
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
    if url.startswith("journal:"):
        path = url[len("journal:"):]
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    raise ConfigError(f"storage {url!r}: use sqlite:///FILE.db, postgresql://USER@HOST/DB or journal:FILE")


@sqlalchemy.event.listens_for(sqlalchemy.engine.Engine, "connect")
def _sqlite_pragmas(dbapi_connection: Any, connection_record: Any) -> None:
    """Write-ahead log for SQLite storages: readers do not block the writer, and a commit
    costs no fsync of the whole database (a crashed process still loses nothing)."""
    if type(dbapi_connection).__module__.startswith("sqlite3"):
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA synchronous=NORMAL")
        cursor.close()


def make_sampler(prepared: PreparedStudy, seed: int) -> optuna.samplers.BaseSampler:
    """The study's inner sampler. Constraints reach it through ``Trial.set_constraint``."""
    cfg = prepared.cfg
    if cfg.sampler == "random" or cfg.sampler == "grid":
        return optuna.samplers.RandomSampler(seed=seed)
    if cfg.sampler == "nsga2":
        return optuna.samplers.NSGAIISampler(seed=seed, population_size=20)
    # Multivariate TPE with groups models each backend's parameters jointly: the space is
    # conditional on the backend, and cache type, ctx and parallel interact through memory.
    # Exact duplicates from parallel workers are caught by the runner, so no constant liar.
    return optuna.samplers.TPESampler(seed=seed, multivariate=True, group=True, n_startup_trials=8,
                                      constant_liar=False)


def create_or_load(prepared: PreparedStudy, seed: int, sampler: optuna.samplers.BaseSampler | None = None) -> optuna.Study:
    cfg = prepared.cfg
    storage = open_storage(prepared.storage_url)
    study = optuna.create_study(
        storage=storage,
        study_name=cfg.name,
        sampler=sampler or make_sampler(prepared, seed),
        directions=objective_mod.directions(cfg.objective),
        load_if_exists=True,
    )
    if len(study.directions) != len(objective_mod.directions(cfg.objective)):
        raise ConfigError(
            f"study '{cfg.name}' in {prepared.storage_url} has {len(study.directions)} objective(s) but the "
            f"study file asks for mode = {cfg.objective.mode!r}; use another study name or storage"
        )
    _check_same_space(study, prepared)
    if "autotune_schema_version" not in study.user_attrs:
        study.set_user_attr("autotune_schema_version", SCHEMA_VERSION)
        study.set_user_attr("gpu", _gpu_attrs(prepared.gpu))
        study.set_user_attr("model", prepared.model.key)
        study.set_user_attr("vram_budget_bytes", prepared.vram_budget_bytes)
        study.set_user_attr("objective", vars(cfg.objective))
        study.set_user_attr("study_file", str(cfg.path) if cfg.path else None)
        study.set_user_attr("excluded_before_search", prepared.excluded)
    # A worker that died mid-trial left it RUNNING; fail it so the configuration is measured
    # again (it carries no fail_reason, so it never answers for its configuration).
    optuna.storages.fail_stale_trials(study)
    return study


def _check_same_space(study: optuna.Study, prepared: PreparedStudy) -> None:
    """Refuse to resume a study whose stored parameters had other choices than the file's.

    Optuna fixes a categorical parameter's choices for the life of a study; asking with other
    choices fails every trial ("does not support dynamic value space"). Said once, up front.
    """
    wanted: dict[str, tuple[Any, ...]] = {"backend": tuple(prepared.space.entries)}
    for entry in prepared.space.entries.values():
        wanted.update({dim: tuple(choices) for dim, choices in entry.dimensions()})
    stored: dict[str, tuple[Any, ...]] = {}
    for t in study.get_trials(deepcopy=False):
        for name, dist in t.distributions.items():
            if isinstance(dist, optuna.distributions.CategoricalDistribution):
                stored.setdefault(name, tuple(dist.choices))
        if len(stored) >= len(wanted):
            break
    changed = [f"{name}: stored {list(stored[name])}, file {list(wanted[name])}"
               for name in stored if name in wanted and stored[name] != wanted[name]]
    if changed:
        raise ConfigError(
            f"study '{prepared.cfg.name}' in {prepared.storage_url} was run with other choices for "
            f"{'; '.join(changed)}. Optuna cannot change a parameter's choices within a study: give the "
            "study a new [study] name (or another --storage) to search the new space"
        )


def _gpu_attrs(gpu: GpuSpec) -> dict[str, Any]:
    return {
        "key": gpu.key,
        "name": gpu.name,
        "vram_bytes": gpu.vram_bytes,
        "mem_bandwidth_gb_s": gpu.mem_bandwidth_gb_s,
        "compute_capability": gpu.compute_capability,
    }


class _Interrupted(BaseException):
    """Ctrl-C or SIGTERM: a BaseException, like KeyboardInterrupt, so that a plugin's
    ``except Exception`` cannot turn the user's interrupt into one failed trial and go on."""


class StudyRunner:
    """Runs trials of a prepared study until its budget is spent."""

    def __init__(self, prepared: PreparedStudy, seed: int | None = None):
        self.prepared = prepared
        self.cfg = prepared.cfg
        self.seed = self.cfg.seed if seed is None else seed
        self._admissible: dict[str, bool] = {}
        self.sampler = ScreenedSampler(make_sampler(prepared, self.seed), prepared.space, self.admissible,
                                       self._evaluated_keys, seed=self.seed)
        self.study = create_or_load(prepared, self.seed, self.sampler)
        self.claims = Claims(self.study._storage, self.study._study_id)
        self._fail_dead_local_workers()
        self.worker = f"{socket.gethostname()}:{os.getpid()}"
        self.n_measured = 0
        self.n_new = 0
        self.converged = False
        self._last_cleanup = float("-inf")
        self._defer_signals = False
        self._deferred_signal: int | None = None
        self._quality_local: dict[str, dict[str, Any]] = {}
        self._vram_residuals: dict[str, list[int]] | None = None

    def _fail_dead_local_workers(self) -> None:
        """Fail RUNNING trials of processes on this host that no longer exist (killed -9).

        The heartbeat catches dead workers on any host, but only after its grace period; a
        study restarted right after a crash on the same machine should not wait for that.
        """
        host = socket.gethostname()
        for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
            worker = str(t.user_attrs.get("worker", ""))
            name, _, pid = worker.rpartition(":")
            if name != host or not pid.isdigit() or _alive(int(pid)):
                continue
            try:
                self.study._storage.set_trial_user_attr(t._trial_id, "fail_reason", f"worker {worker} died")
                self.study._storage.set_trial_user_attr(t._trial_id, "retry", True)
                self.study._storage.set_trial_state_values(t._trial_id, optuna.trial.TrialState.FAIL)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # another worker got there first

    # ----------------------------------------------------------------------------- lookups

    def admissible(self, config: TrialConfig) -> bool:
        """Whether ``config`` could run and be accepted, as far as is known without launching it."""
        key = config.key
        if key not in self._admissible:
            prepared = self.prepared
            ctx = prepared.contexts[config.backend]
            ok = not prepared.space.check(config, ctx)
            if ok:
                ok = self._memory(prepared.backend(config.backend), config, ctx)[0].total_bytes <= ctx.vram_budget_bytes
            self._admissible[key] = ok
        if not self._admissible[key]:
            return False
        return not self._known_low_quality(config)

    def _known_low_quality(self, config: TrialConfig) -> bool:
        """True when the quality of this artifact is already measured and over the allowed drop."""
        prepared, limit = self.prepared, self.cfg.objective.max_drop_points
        if prepared.quality is None or limit is None:
            return False
        backend = prepared.backend(config.backend)
        ctx = prepared.contexts[config.backend]
        mine = self._cached_quality(prepared.quality.cache_key(config, backend, ctx))
        ref_config = prepared.reference.get(config.backend)
        if mine is None or ref_config is None:
            return False
        ref = self._cached_quality(prepared.quality.cache_key(ref_config, prepared.backend(ref_config.backend),
                                                               prepared.contexts[ref_config.backend]))
        if ref is None:
            return False
        sign = 1.0 if prepared.quality.higher_is_better else -1.0
        return sign * (ref["value"] - mine["value"]) * 100.0 > limit

    def _cached_quality(self, key: str) -> dict[str, Any] | None:
        attr = "quality:" + hashlib.sha1(key.encode()).hexdigest()[:16]
        return self._quality_local.get(attr) or self.study.user_attrs.get(attr)

    def _evaluated_keys(self) -> set[str]:
        return set(self._finished_by_key())

    def _finished_by_key(self) -> dict[str, optuna.trial.FrozenTrial]:
        """Trials whose outcome stands for their configuration (first one wins)."""
        out: dict[str, optuna.trial.FrozenTrial] = {}
        for t in self.study.get_trials(deepcopy=False):
            key = t.user_attrs.get("config_key")
            if key is None or key in out or t.user_attrs.get("answered_from") is not None:
                continue
            if t.state == optuna.trial.TrialState.RUNNING:
                out[key] = t
            elif t.state in (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.PRUNED):
                out[key] = t
            elif t.state == optuna.trial.TrialState.FAIL and t.user_attrs.get("fail_reason") and not t.user_attrs.get("retry"):
                out[key] = t
        return out

    # ----------------------------------------------------------------------------- prior

    def enqueue_prior(self) -> int:
        """Measure the configurations a model backend predicts best first (``[study] prior``)."""
        ranked = rank_by_prior(self.prepared)
        if not ranked:
            return 0
        done = self._finished_by_key()
        waiting = {
            TrialConfig.from_dict(t.user_attrs["config"]).key
            for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,))
            if "config" in t.user_attrs
        }
        n = 0
        for config, _ in ranked[: self.cfg.prior_trials]:
            if config.key in done or config.key in waiting:
                continue
            self.study.enqueue_trial(self.prepared.space.params_of(config), user_attrs={"config": config.as_dict(), "from_prior": True})
            n += 1
        return n

    def _enqueue_unexplored(self) -> bool:
        """Queue one random configuration that has not been evaluated and could run."""
        config = self.sampler.random_admissible(self._evaluated_keys())
        if config is None:
            return False
        self.study.enqueue_trial(self.prepared.space.params_of(config), user_attrs={"explore": True})
        return True

    def enqueue_grid(self) -> int:
        """Grid search: every configuration once, in a seeded random order."""
        configs = list(self.prepared.space.enumerate())
        random.Random(self.seed).shuffle(configs)
        done = self._finished_by_key()
        n = 0
        if any(t.state == optuna.trial.TrialState.WAITING for t in self.study.get_trials(deepcopy=False)):
            return 0
        for config in configs:
            if config.key not in done:
                self.study.enqueue_trial(self.prepared.space.params_of(config), user_attrs={"config": config.as_dict()})
                n += 1
        return n

    # ----------------------------------------------------------------------------- loop

    def run(
        self,
        budget_s: float | None = None,
        n_trials: int | None = None,
        callback: Callable[[TrialEvent], None] | None = None,
    ) -> StudySummary:
        """Run trials until ``budget_s`` seconds are spent or ``n_trials`` configurations launched.

        Only launches (measured or failed) count against ``n_trials``: configurations that the
        rules or the memory model reject, and proposals the storage already answers, are
        recorded as trials too but cost nothing.

        Ctrl-C (or SIGTERM) ends the trial in flight as FAIL with reason "interrupted" (a
        later run measures it again) and returns with the storage consistent.
        """
        if budget_s is None and n_trials is None:
            budget_s, n_trials = self.cfg.budget_s, self.cfg.n_trials
            if budget_s is None and n_trials is None:
                n_trials = 50
        if self.cfg.sampler == "grid":
            self.enqueue_grid()
        elif self.cfg.prior:
            self.enqueue_prior()
        heartbeat = _Heartbeat(self.study)
        start = time.monotonic()
        interrupted = False
        idle = 0
        in_main = threading.current_thread() is threading.main_thread()
        previous = {}
        if in_main:
            for signum in (signal.SIGINT, signal.SIGTERM):
                previous[signum] = signal.getsignal(signum)
                signal.signal(signum, self._on_signal)
        try:
            while True:
                if n_trials is not None and self.n_measured >= n_trials:
                    break
                if budget_s is not None and time.monotonic() - start >= budget_s:
                    break
                if self.cfg.sampler == "grid" and not self._has_waiting():
                    break
                measured_before = self.n_measured
                event = self._one_trial(heartbeat, start)
                self.n_new += 1
                if self.n_measured > measured_before:
                    idle = 0
                else:
                    # Proposals answered from the storage, and configurations rejected by the
                    # rules or the memory model, launch nothing: they are recorded but do not
                    # count against --trials. Very many in a row mean the sampler has nothing
                    # left to try that could run.
                    idle += 1
                if callback:
                    callback(event)
                if idle and idle % EXPLORE_AFTER_IDLE == 0 and not self._enqueue_unexplored():
                    self.converged = True  # everything that can run has been evaluated
                    break
                if idle >= MAX_IDLE_PROPOSALS:
                    self.converged = True
                    break
        except (KeyboardInterrupt, _Interrupted):
            interrupted = True
        finally:
            heartbeat.beat(None)
            heartbeat.stop.set()
            for signum, handler in previous.items():
                signal.signal(signum, handler)
        summary = summarize(self.prepared, self.study)
        summary.n_new = self.n_new
        summary.n_measured = self.n_measured
        summary.interrupted = interrupted
        summary.elapsed_s = time.monotonic() - start
        summary.extra["converged"] = self.converged
        summary.extra["excluded_before_search"] = self.prepared.excluded
        return summary

    def _has_waiting(self) -> bool:
        return any(t.state == optuna.trial.TrialState.WAITING for t in self.study.get_trials(deepcopy=False))

    def _one_trial(self, heartbeat: _Heartbeat, start: float) -> TrialEvent:
        now = time.monotonic()
        if now - self._last_cleanup >= HEARTBEAT_INTERVAL_S / 2:
            # As Optuna's optimize() does before each trial: a worker that died since we started
            # must not hold its configuration forever.
            self._last_cleanup = now
            self._cleanup_dead_workers()
        trial = None
        try:
            with self._signals_deferred():
                trial = self.study.ask()
                heartbeat.beat(trial._trial_id)
            state, values, config, reason, answered = self._evaluate(trial)
        except (KeyboardInterrupt, _Interrupted):
            if trial is not None:
                self._fail_quietly(trial, "interrupted", retry=True)
            raise
        except Exception as exc:  # a bug in a plugin must not kill the study either
            assert trial is not None
            if "engine" in trial.user_attrs:
                self.n_measured += 1  # it was launched: it counts like a BackendError
            trial.set_user_attr("log_tail", traceback.format_exc()[-4000:])
            self._fail_quietly(trial, f"{type(exc).__name__}: {exc}")
            state, values, config, reason, answered = "FAIL", None, trial.user_attrs.get("config", {}), str(exc), None
        heartbeat.beat(None)
        best = best_trial(self.study)
        return TrialEvent(
            number=trial.number,
            state=state,
            config=config,
            value=values[0] if values else None,
            reason=reason,
            best_value=best.values[0] if best else None,
            best_config=best.user_attrs.get("config") if best else None,
            n_done=self.n_measured,
            elapsed_s=time.monotonic() - start,
            answered_from=answered,
        )

    @contextlib.contextmanager
    def _signals_deferred(self):
        """Hold Ctrl-C/SIGTERM while a trial is being created, then deliver it.

        An interrupt inside ``study.ask()`` would leave a RUNNING trial that nobody holds a
        handle to; deferring it until ``ask`` returns lets the runner fail that trial cleanly.
        """
        self._defer_signals = True
        try:
            yield
        finally:
            self._defer_signals = False
        if self._deferred_signal is not None:
            self._deferred_signal = None
            raise _Interrupted()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self._defer_signals:
            self._deferred_signal = signum
            return
        raise _Interrupted()

    def _fail_quietly(self, trial: optuna.Trial, reason: str, retry: bool = False) -> None:
        """Record ``trial`` as failed unless it already finished (an interrupt after tell)."""
        try:
            trial.set_user_attr("fail_reason", reason)
            if retry:
                trial.set_user_attr("retry", True)
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
        except (optuna.exceptions.UpdateFinishedTrialError, ValueError, RuntimeError):
            pass  # it is finished already: its outcome stands

    def _cleanup_dead_workers(self) -> None:
        """Fail the RUNNING trials of dead workers (heartbeat lapsed, or a dead local pid)."""
        optuna.storages.fail_stale_trials(self.study)
        self._fail_dead_local_workers()

    def _claim(self, trial: optuna.Trial, config: TrialConfig) -> optuna.trial.FrozenTrial | None:
        """Claim ``config`` for ``trial``; returns the trial that answers for it instead, if any."""
        if self.claims.engine is None:
            earlier = self._finished_by_key().get(config.key)
            return earlier if earlier is not None and earlier.number != trial.number else None
        storage = self.study._storage
        holder = None
        for _ in range(3):
            holder_id = self.claims.claim(config.key, trial._trial_id)
            if holder_id is None or holder_id == trial._trial_id:
                return None
            holder = storage.get_trial(holder_id)
            if holder.state == optuna.trial.TrialState.RUNNING:
                self._cleanup_dead_workers()
                holder = storage.get_trial(holder_id)
            abandoned = holder.state == optuna.trial.TrialState.FAIL and (
                holder.user_attrs.get("retry") or not holder.user_attrs.get("fail_reason"))
            if not abandoned:
                return holder
            if self.claims.take_over(config.key, holder_id, trial._trial_id):
                return None
        return holder

    def _evaluate(self, trial: optuna.Trial):
        """Run one trial through the flow; returns (state, values, config, reason, answered_from)."""
        prepared = self.prepared
        config = prepared.space.suggest(trial)
        backend = prepared.backend(config.backend)
        ctx = prepared.contexts[config.backend]
        trial.set_user_attr("config", config.as_dict())
        trial.set_user_attr("config_key", config.key)
        trial.set_user_attr("worker", self.worker)

        earlier = self._claim(trial, config)
        if earlier is not None:
            return self._answer_from(trial, earlier, config)

        reasons = prepared.space.check(config, ctx)
        if reasons:
            reason = "invalid: " + "; ".join(reasons)
            trial.set_user_attr("prune_reason", reason)
            _set_constraints(trial, objective_mod.unmeasured_constraints(self.cfg.objective))
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            return "PRUNED", None, config.as_dict(), reason, None

        estimate, raw_bytes = self._memory(backend, config, ctx)
        trial.set_user_attr("predicted_vram", estimate.to_dict())
        trial.set_user_attr("deploy_command", backend.deploy_command(config, ctx))
        if estimate.total_bytes > ctx.vram_budget_bytes:
            over = objective_mod.vram_constraint(estimate.total_bytes, ctx.vram_budget_bytes)
            reason = (
                f"infeasible: predicted {estimate.total_bytes / 2**30:.2f} GiB > budget "
                f"{ctx.vram_budget_bytes / 2**30:.2f} GiB (weights {estimate.weights_bytes / 2**30:.2f}, "
                f"KV {estimate.kv_bytes / 2**30:.2f}, buffers {estimate.buffers_bytes / 2**30:.2f}, "
                f"overhead {estimate.overhead_bytes / 2**30:.2f} GiB)"
            )
            trial.set_user_attr("prune_reason", reason)
            _set_constraints(trial, objective_mod.unmeasured_constraints(self.cfg.objective, over))
            self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
            return "PRUNED", None, config.as_dict(), reason, None

        # Quality depends on the artifact, not on ctx or parallel, and is measured once per
        # study; when it already rules the configuration out, launching it would be waste.
        drop = None
        if prepared.quality is not None:
            drop = self._quality(trial, config, backend, ctx)
            limit = self.cfg.objective.max_drop_points
            if drop is not None and limit is not None and drop > limit:
                reason = f"infeasible: quality drop {drop:.2f} points > max_drop_points {limit:g}"
                trial.set_user_attr("prune_reason", reason)
                constraints = objective_mod.unmeasured_constraints(self.cfg.objective, 0.0)
                constraints[objective_mod.QUALITY] = drop - limit
                _set_constraints(trial, constraints)
                self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                return "PRUNED", None, config.as_dict(), reason, None

        trial.set_user_attr("engine", {"backend": backend.name, "engine": backend.engine, "version": backend.engine_version()})
        trial.set_user_attr("gpu", _gpu_attrs(prepared.gpu))
        try:
            measurement = backend.run(config, ctx)
        except BackendError as exc:
            self.n_measured += 1
            trial.set_user_attr("fail_reason", str(exc))
            if exc.log_tail:
                trial.set_user_attr("log_tail", exc.log_tail[-4000:])
            self.study.tell(trial, state=optuna.trial.TrialState.FAIL)
            return "FAIL", None, config.as_dict(), str(exc), None
        self.n_measured += 1
        self._record_measurement(trial, measurement, estimate.total_bytes)
        if measurement.peak_vram_bytes is not None:
            self._learn_vram(trial, backend.name, measurement.peak_vram_bytes - raw_bytes)

        metric = self.cfg.objective.metric
        if metric not in measurement.metrics:
            raise BackendError(f"backend '{backend.name}' did not measure {metric}")
        used = measurement.peak_vram_bytes if measurement.peak_vram_bytes is not None else estimate.total_bytes
        per_user = measurement.metrics.get("per_user_tok_s")
        s = objective_mod.score(self.cfg.objective, measurement.metrics[metric].median, used, ctx.vram_budget_bytes,
                                drop, per_user.median if per_user is not None else None)
        _set_constraints(trial, s.constraints)
        trial.set_user_attr("score", {"values": list(s.values), "throughput": s.throughput, "penalty": s.penalty,
                                      "quality_drop_points": s.quality_drop_points, "feasible": s.feasible})
        self.study.tell(trial, list(s.values))
        return "COMPLETE", list(s.values), config.as_dict(), None, None

    # ----------------------------------------------------------------------------- memory

    def _memory(self, backend: BaseBackend, config: TrialConfig, ctx: StudyContext) -> tuple[MemoryEstimate, int]:
        """The backend's estimate plus what this study learned about it; and the raw total."""
        raw = backend.estimate_memory(config, ctx)
        residuals = self._residuals().get(backend.name, [])
        return vram.apply_correction(raw, vram.learned_correction(residuals), len(residuals)), raw.total_bytes

    def _residuals(self) -> dict[str, list[int]]:
        # Read once from the storage, so a resumed study keeps what it learned.
        if self._vram_residuals is None:
            found: dict[str, list[int]] = {}
            for t in self.study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
                if "vram_residual_bytes" in t.user_attrs:
                    found.setdefault(str(t.user_attrs.get("config", {}).get("backend")), []).append(
                        int(t.user_attrs["vram_residual_bytes"]))
            self._vram_residuals = found
        return self._vram_residuals

    def _learn_vram(self, trial: optuna.Trial, backend: str, residual: int) -> None:
        """Record (measured - predicted) of a measured trial; later estimates add the median."""
        trial.set_user_attr("vram_residual_bytes", int(residual))
        self._residuals().setdefault(backend, []).append(int(residual))
        self._admissible.clear()  # budgets are judged again with the new correction

    def _record_measurement(self, trial: optuna.Trial, m: Measurement, predicted_bytes: int) -> None:
        trial.set_user_attr("metrics", {k: v.to_dict() for k, v in m.metrics.items()})
        for k, v in m.metrics.items():
            trial.set_user_attr(k, v.median)  # flat copies: sortable columns in optuna-dashboard
        if m.peak_vram_bytes is not None:
            trial.set_user_attr("measured_vram_bytes", m.peak_vram_bytes)
            trial.set_user_attr("vram_prediction_error", (predicted_bytes - m.peak_vram_bytes) / m.peak_vram_bytes)
        if m.telemetry is not None:
            trial.set_user_attr("telemetry", m.telemetry.to_dict())
        if m.attrs:
            trial.set_user_attr("engine_facts", dict(m.attrs))

    def _answer_from(self, trial: optuna.Trial, earlier: optuna.trial.FrozenTrial, config: TrialConfig):
        """Answer a configuration already in the storage without launching it again.

        The answer is recorded as PRUNED with the earlier trial's outcome attached, not as a
        second COMPLETE copy: copies would crowd the sampler's model of good regions (TPE
        keeps its best 10%) with one point and stop it from exploring.
        """
        trial.set_user_attr("answered_from", earlier.number)
        skip = {"config", "config_key", "worker", "answered_from", "from_prior", "prune_reason"}
        for key, value in earlier.user_attrs.items():
            if key not in skip:
                trial.set_user_attr(key, value)
        if earlier.state == optuna.trial.TrialState.RUNNING:
            reason = f"being measured by trial {earlier.number} (worker {earlier.user_attrs.get('worker')})"
        else:
            outcome = earlier.values[0] if earlier.values else earlier.user_attrs.get(
                "prune_reason", earlier.user_attrs.get("fail_reason"))
            reason = f"already evaluated as trial {earlier.number} ({earlier.state.name}: {outcome})"
        trial.set_user_attr("prune_reason", reason)
        self.study.tell(trial, state=optuna.trial.TrialState.PRUNED)
        values = list(earlier.values) if earlier.values else None
        return earlier.state.name, values, config.as_dict(), reason, earlier.number

    # ----------------------------------------------------------------------------- quality

    def _quality_value(self, config: TrialConfig, backend: BaseBackend, ctx: StudyContext) -> dict[str, Any]:
        """A metric's value for an artifact, measured once per study (cached in the storage)."""
        metric = self.prepared.quality
        assert metric is not None
        key = metric.cache_key(config, backend, ctx)
        attr = "quality:" + hashlib.sha1(key.encode()).hexdigest()[:16]
        if attr in self._quality_local:
            return self._quality_local[attr]
        stored = self.study.user_attrs.get(attr)
        if stored is None:
            value: MetricValue = metric.evaluate(config, backend, ctx)
            stored = {"key": key, **value.to_dict()}
            self.study.set_user_attr(attr, stored)
        self._quality_local[attr] = stored
        return stored

    def _quality(self, trial: optuna.Trial, config: TrialConfig, backend: BaseBackend, ctx: StudyContext) -> float | None:
        metric = self.prepared.quality
        assert metric is not None
        why = metric.supports(backend)
        if why:
            trial.set_user_attr("quality", {"metric": metric.name, "skipped": why})
            return None
        ref_config = self.prepared.reference[config.backend]
        ref_backend = self.prepared.backend(ref_config.backend)
        mine = self._quality_value(config, backend, ctx)
        ref = self._quality_value(ref_config, ref_backend, self.prepared.contexts[ref_config.backend])
        sign = 1.0 if metric.higher_is_better else -1.0
        drop = sign * (ref["value"] - mine["value"]) * 100.0
        se = None
        if mine.get("stderr") is not None and ref.get("stderr") is not None:
            # Two independent sample estimates: their difference's standard error adds in
            # quadrature (an overestimate when both used the same items, which is the safe side).
            se = 100.0 * (mine["stderr"] ** 2 + ref["stderr"] ** 2) ** 0.5
        trial.set_user_attr(
            "quality",
            {
                "metric": metric.name,
                "value": mine["value"],
                "stderr": mine.get("stderr"),
                "n": mine.get("n"),
                "reference_weights": ref_config.weights,
                "reference_value": ref["value"],
                "drop_points": drop,
                "drop_stderr_points": se,
            },
        )
        trial.set_user_attr("quality_drop_points", drop)
        return drop


def quality_drop_cached(prepared: PreparedStudy, study: optuna.Study, config: TrialConfig) -> float | None:
    """Accuracy points ``config``'s artifact loses against the reference, if both are cached."""
    metric = prepared.quality
    ref_config = prepared.reference.get(config.backend)
    if metric is None or ref_config is None:
        return None
    values = []
    for c in (config, ref_config):
        key = metric.cache_key(c, prepared.backend(c.backend), prepared.contexts.get(c.backend, prepared.contexts[config.backend]))
        stored = study.user_attrs.get("quality:" + hashlib.sha1(key.encode()).hexdigest()[:16])
        if stored is None:
            return None
        values.append(stored["value"])
    sign = 1.0 if metric.higher_is_better else -1.0
    return sign * (values[1] - values[0]) * 100.0


def _set_constraints(trial: optuna.Trial, constraints: Mapping[str, float]) -> None:
    for key, value in constraints.items():
        trial.set_constraint(key, value)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def rank_by_prior(prepared: PreparedStudy) -> list[tuple[TrialConfig, float]]:
    """Every admissible configuration ranked by a model backend's predicted score.

    For each backend of the study, the predictor is the backend itself when it can predict,
    else a registered backend of the same engine that implements ``predict`` (the digital
    twin), evaluated for the study's GPU and model. The predicted metrics go through the
    study's own objective: the penalty, the per-user floor and, where a metric can predict
    quality for the predictor (the twin's), the quality constraint. Predicted-feasible
    configurations come first, best first.
    """
    backends = plugins.get_backends()
    metrics = plugins.get_metrics()
    objective = prepared.cfg.objective
    ranked = []
    for config in prepared.space.enumerate():
        real = prepared.backend(config.backend)
        ctx = prepared.contexts[config.backend]
        if prepared.space.check(config, ctx):
            continue
        mem = real.estimate_memory(config, ctx)
        if mem.total_bytes > ctx.vram_budget_bytes:
            continue
        predictor = _predictor_for(real, config, ctx, backends)
        if predictor is None:
            continue
        probe = replace(config, backend=predictor.name)
        predicted = predictor.predict(probe, ctx)
        if not predicted or objective.metric not in predicted:
            continue
        drop = _predicted_drop(prepared, predictor, probe, prepared.reference.get(config.backend), ctx, metrics)
        s = objective_mod.score(objective, float(predicted[objective.metric]), mem.total_bytes, ctx.vram_budget_bytes,
                                drop, predicted.get("per_user_tok_s"))
        ranked.append((config, s.values[0], s.feasible))
    ranked.sort(key=lambda item: (not item[2], -item[1]))
    return [(c, v) for c, v, _ in ranked]


def _predictor_for(real: BaseBackend, config: TrialConfig, ctx: StudyContext,
                   backends: Mapping[str, BaseBackend]) -> BaseBackend | None:
    if real.predict(config, ctx) is not None:
        return real
    for other in backends.values():
        if other.engine == real.engine and other is not real:
            if other.predict(replace(config, backend=other.name), ctx) is not None:
                return other
    return None


def _predicted_drop(prepared: PreparedStudy, predictor: BaseBackend, config: TrialConfig,
                    ref: TrialConfig | None, ctx: StudyContext, metrics: Mapping[str, BaseMetric]) -> float | None:
    """Quality drop a metric that can evaluate the predictor expects, against the reference."""
    if ref is None:
        return None
    candidates = [prepared.quality] if prepared.quality is not None else []
    candidates += [m for m in metrics.values() if m not in candidates]
    ref_probe = replace(ref, backend=predictor.name)
    for metric in candidates:
        if metric.supports(predictor) is not None:
            continue
        try:
            mine = metric.evaluate(config, predictor, ctx).value
            theirs = metric.evaluate(ref_probe, predictor, ctx).value
        except AutotuneError:
            continue
        return (1.0 if metric.higher_is_better else -1.0) * (theirs - mine) * 100.0
    return None


def best_trial(study: optuna.Study) -> optuna.trial.FrozenTrial | None:
    """The best feasible complete trial (first objective for a Pareto study)."""
    best = None
    for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,)):
        if not all(c <= 0 for c in t.constraints.values()):
            continue
        if t.user_attrs.get("answered_from") is not None:
            continue
        if best is None or t.values[0] > best.values[0]:
            best = t
    return best


def summarize(prepared: PreparedStudy | None, study: optuna.Study) -> StudySummary:
    """Counts and best trial of a study as stored."""
    trials = study.get_trials(deepcopy=False)
    states = [t.state for t in trials]
    best = best_trial(study)
    n_answered = sum(1 for t in trials if t.user_attrs.get("answered_from") is not None)
    summary = StudySummary(
        study_name=study.study_name,
        storage=prepared.storage_url if prepared else "",
        n_trials=len(trials),
        n_complete=states.count(optuna.trial.TrialState.COMPLETE),
        n_failed=states.count(optuna.trial.TrialState.FAIL),
        n_pruned=states.count(optuna.trial.TrialState.PRUNED) - n_answered,
        n_new=0,
        n_measured=0,
        interrupted=False,
        elapsed_s=0.0,
        best=trial_record(best) if best else None,
        extra={"n_answered_from_storage": n_answered},
    )
    if len(study.directions) > 1:
        summary.extra["pareto_front"] = [trial_record(t) for t in pareto_front(study)]
    return summary


def pareto_front(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """Feasible measured trials that no other feasible one beats on every objective."""
    signs = [1.0 if d == optuna.study.StudyDirection.MAXIMIZE else -1.0 for d in study.directions]
    pool = [t for t in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
            if t.user_attrs.get("answered_from") is None and all(c <= 0 for c in t.constraints.values())]

    def dominates(a: optuna.trial.FrozenTrial, b: optuna.trial.FrozenTrial) -> bool:
        pairs = [(s * x, s * y) for s, x, y in zip(signs, a.values, b.values)]
        return all(x >= y for x, y in pairs) and any(x > y for x, y in pairs)

    front = [t for t in pool if not any(dominates(o, t) for o in pool if o is not t)]
    return sorted(front, key=lambda t: -signs[0] * t.values[0])


def trial_record(t: optuna.trial.FrozenTrial) -> dict[str, Any]:
    """What ``autotune best`` shows of a trial."""
    return {
        "number": t.number,
        "params": t.user_attrs.get("config", t.params),
        "values": list(t.values) if t.values else None,
        "metrics": {k: v.get("median") for k, v in t.user_attrs.get("metrics", {}).items()},
        "quality": t.user_attrs.get("quality"),
        "predicted_vram": t.user_attrs.get("predicted_vram"),
        "measured_vram_bytes": t.user_attrs.get("measured_vram_bytes"),
        "deploy_command": t.user_attrs.get("deploy_command"),
        "engine": t.user_attrs.get("engine"),
    }


def run_study(
    cfg: StudyConfig,
    budget_s: float | None = None,
    n_trials: int | None = None,
    storage: str | None = None,
    seed: int | None = None,
    callback: Callable[[TrialEvent], None] | None = None,
) -> StudySummary:
    """Prepare and run a study; the library entry point behind ``autotune study``."""
    prepared = prepare_study(cfg, storage=storage)
    runner = StudyRunner(prepared, seed=seed)
    return runner.run(budget_s=budget_s, n_trials=n_trials, callback=callback)
