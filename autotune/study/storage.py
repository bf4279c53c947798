"""Where a study lives: opening, checking and naming its Optuna storage.

Every use of Optuna's private API is in this module (the RDB heartbeat, the storage and ids
behind a study or trial, writing a finished trial's attributes, writing a trial's attributes and
constraints in one transaction), so an Optuna upgrade has one place to look. SQLite pragmas
are set on our own engine's connections only: a host program's other databases are not touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import threading
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import optuna
import sqlalchemy
import sqlalchemy.exc
from optuna.storages._heartbeat import is_heartbeat_enabled  # RDBStorage's heartbeat, used by optimize()

from autotune import objective as objective_mod
from autotune.config import load_study_config
from autotune.errors import ConfigError, StorageError
from autotune.objective import name_objectives
from autotune.redact import mask_url, remember_url, scrub, split_url
from autotune.space import canonical_order, dimension_of
from autotune.study import comparable, records


if TYPE_CHECKING:  # pragma: no cover
    from autotune.study.prepare import PreparedStudy

HEARTBEAT_INTERVAL_S = 20
HEARTBEAT_GRACE_S = 60
# How long a write to SQLite waits for another process's lock before it is an error (SQLite's
# busy timeout: it retries until then); said in the error, so the user knows it was waited for.
SQLITE_LOCK_WAIT_S = 60
# Optuna's own tables: a SQLite file with tables but none of these belongs to another application.
_OPTUNA_TABLES = frozenset({"studies", "version_info", "alembic_version"})
STORAGE_ENV = "AUTOTUNE_STORAGE"
_SQLITE_MAGIC = b"SQLite format 3\x00"


def check_url(url: str) -> None:
    """Refuse a server URL that the driver would misread, before it is given one: the message
    names what is wrong and never quotes the password (a driver's own error may: a port it
    cannot read is part of a password with an unencoded '@' or ':').

    Raises:
        StorageError: the password holds an unencoded '@', '/', '?' or '#', or the URL does
            not parse (a port that is not a number).
    """
    shown = mask_url(url)
    parts = split_url(url)
    if parts is None or url.startswith(("sqlite:", "journal:")):
        return
    password = parts[1].partition(":")[2]
    bad = sorted({c for c in password if c in "@/?#"})
    if bad:
        raise StorageError(f"storage {shown}: the password holds an unencoded {' '.join(repr(c) for c in bad)}, "
                           "which the database driver reads as part of the host; percent-encode it ('@' is %40, "
                           "'/' %2F, '?' %3F, '#' %23) or give the password as $PGPASSWORD")
    try:
        port = sqlalchemy.engine.make_url(url).port
    except (sqlalchemy.exc.ArgumentError, ValueError, TypeError):
        port = "bad"
    if port == "bad" or (port is not None and not 0 < port < 65536):
        raise StorageError(f"storage {shown}: not a URL the driver can read (the port after the host must be a "
                           "number from 1 to 65535); use postgresql://USER:PASSWORD@HOST:PORT/DB")


def resolve_url(given: str | None, from_file: str | None, default: str) -> str:
    """The storage URL: ``--storage``, else $AUTOTUNE_STORAGE (so a password need not sit on a
    command line), else the study file's ``[study] storage``, else the default."""
    return given or os.environ.get(STORAGE_ENV) or from_file or default


def _last_run_file(directory: Path | None = None) -> Path:
    """Where the study last run in ``directory`` is recorded: in autotune's cache
    (``$AUTOTUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/autotune``, else ``~/.cache/autotune``), one
    file per directory, so a run with ``--storage`` leaves nothing in the working directory."""
    import hashlib

    where = str((directory or Path.cwd()).resolve())
    base = os.environ.get("AUTOTUNE_CACHE_DIR") or str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autotune")
    return Path(base) / "last-study" / (hashlib.sha256(where.encode()).hexdigest()[:16] + ".json")


def remember_run(url: str, study_name: str, directory: Path | None = None) -> None:
    """Record the study just run in the current directory, so that ``best``, ``report`` and
    ``dashboard`` run there read it next without being told. A URL holding a password is not
    written down (it came from $AUTOTUNE_STORAGE or the command line, and is given there again);
    a relative SQLite path is kept absolute."""
    here = (directory or Path.cwd()).resolve()
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        url = "sqlite:///" + str(here / url[len("sqlite:///"):])
    keep = url if mask_url(url) == url else None
    path = _last_run_file(here)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"storage": keep, "study": study_name, "directory": str(here)}) + "\n")
    except OSError:
        pass  # an unwritable cache loses only this convenience


def reading_target(given: str | None, study_file: str | Path | None, study_name: str | None,
                   default_file: Path) -> tuple[str, str | None, str]:
    """Where a command that only reads (``best``, ``report``, ``dashboard``) looks, and why.

    ``--storage``, else $AUTOTUNE_STORAGE, else the study file given, else the study last run in
    this directory (``remember_run``), else the default study's storage. The study name is
    ``--study``, else the study file's or the last run's (None: the storage's only study).

    Returns:
        (URL, study name or None, where the URL came from: for the error that nothing is there).
    """
    if given or os.environ.get(STORAGE_ENV):
        source = "--storage" if given else f"${STORAGE_ENV}"
        if study_file is not None and study_name is None:
            study_name = load_study_config(Path(study_file)).name
        return given or os.environ[STORAGE_ENV], study_name, source
    if study_file is not None:
        cfg = load_study_config(Path(study_file))
        return resolve_url(None, cfg.storage, cfg.default_storage), study_name or cfg.name, f"study file {study_file}"
    last = _last_run_file()
    if last.is_file():
        try:
            data = json.loads(last.read_text())
        except (OSError, ValueError):
            data = {}
        if isinstance(data, dict) and data.get("storage"):
            return str(data["storage"]), study_name or data.get("study"), "the study last run in this directory"
    cfg = load_study_config(default_file)
    return resolve_url(None, cfg.storage, cfg.default_storage), study_name, f"the default study ({default_file.name})"


class _WalConnection(sqlite3.Connection):
    """SQLite connection of our storages: a write-ahead log lets readers (the dashboard, a
    second worker) run beside the writer, and synchronous=NORMAL spares an fsync per commit
    without losing a committed trial to a crashed process."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.execute("PRAGMA journal_mode=WAL")
        self.execute("PRAGMA synchronous=NORMAL")


def _check_file(url: str, path: str, writable: bool) -> None:
    shown = mask_url(url)
    p = Path(path).expanduser()
    if url.startswith("sqlite:") and path in ("", ":memory:"):
        raise StorageError(f"storage {shown}: an in-memory database ends with this process, so 'autotune best', "
                           "'report' and a resumed study would find nothing; give a file, e.g. sqlite:///study.db")
    if path in ("", ":memory:"):
        return
    if p.exists():
        if p.is_dir():
            raise StorageError(f"storage {shown}: {p} is a directory; name a database file")
        if not os.access(p, os.R_OK) or (writable and not os.access(p, os.W_OK)):
            raise StorageError(f"storage {shown}: {p} is not {'writable' if writable else 'readable'} by this user")
        if url.startswith("sqlite:") and p.stat().st_size:
            with open(p, "rb") as f:
                if f.read(16) != _SQLITE_MAGIC:
                    raise StorageError(f"storage {shown}: {p} is not a SQLite database")
            tables = _sqlite_tables(p)
            if tables and not tables & _OPTUNA_TABLES:
                raise StorageError(f"storage {shown}: {p} is a SQLite database of another application (tables: "
                                   f"{', '.join(sorted(tables)[:8])}{', ...' if len(tables) > 8 else ''}); "
                                   "give a new file")
        return
    if not writable:
        raise StorageError(f"storage {shown}: {p} does not exist (run 'autotune study' first, or give --storage)")
    parent = p.parent
    if not parent.is_dir():
        raise StorageError(f"storage {shown}: the directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise StorageError(f"storage {shown}: cannot create {p}: the directory {parent} is not writable")


def _sqlite_tables(p: Path) -> set[str]:
    """The tables of a SQLite file, read without writing anything (empty where it cannot be
    read this way: opening it for real then says why)."""
    try:
        with contextlib.closing(sqlite3.connect(f"file:{p}?mode=ro", uri=True, timeout=SQLITE_LOCK_WAIT_S)) as conn:
            return {row[0] for row in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error:
        return set()


def _read_only_sqlite(path: str) -> str | None:
    """The URL that opens SQLite file ``path`` read-only, where this process cannot write it or
    its directory (read-only media, another user's study); None where it can (a reader beside
    a running study then shares its write-ahead log). Immutable where no write-ahead log is
    there: no process has the database open for writing, and SQLite could not create the
    log's index beside a file in a read-only directory."""
    p = Path(path).expanduser().resolve()
    if os.access(p, os.W_OK) and os.access(p.parent, os.W_OK):
        return None
    immutable = "" if Path(f"{p}-wal").exists() else "&immutable=1"
    return f"sqlite:///file:{p}?mode=ro{immutable}&uri=true"


def open_storage(url: str, *, create: bool = True) -> optuna.storages.BaseStorage:
    """The Optuna storage behind ``url``, checked before use; RDB storages get a heartbeat.

    Args:
        url: ``sqlite:///FILE.db``, ``postgresql://USER@HOST/DB`` (or mysql), ``journal:FILE``.
        create: Whether a missing database may be created (False for commands that only read).

    Raises:
        StorageError: an unknown scheme, a missing driver, an unwritable or foreign file, an
            unreachable server, or a schema this Optuna cannot read; one line, password masked.
    """
    shown = mask_url(url)
    remember_url(url)  # engines' output is scrubbed of its password from now on
    if url.startswith("journal:"):
        path = url[len("journal:"):]
        _check_file(url, path, writable=create)
        return optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(path))
    if not url.startswith(("sqlite:", "postgresql", "mysql")):
        raise StorageError(f"storage {shown}: use sqlite:///FILE.db, postgresql://USER@HOST/DB or journal:FILE")
    check_url(url)
    if url.startswith("sqlite:"):
        path = url.split(":///", 1)[1] if ":///" in url else ""
        _check_file(url, path, writable=create)
        read_only = None if create else _read_only_sqlite(path)
        # A read-only connection cannot switch the journal to write-ahead logging
        factory = sqlite3.Connection if read_only else _WalConnection
        engine_kwargs: dict[str, Any] = {"connect_args": {"timeout": SQLITE_LOCK_WAIT_S, "factory": factory}}
    else:
        read_only = None
        engine_kwargs = {"pool_pre_ping": True}
    for attempt in range(5):
        try:
            # The heartbeat is used on purpose (the runner beats it itself); Optuna's
            # "experimental" warning would only alarm `best`, `report` and `dashboard` users.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                return optuna.storages.RDBStorage(read_only or url, engine_kwargs=engine_kwargs,
                                                  heartbeat_interval=HEARTBEAT_INTERVAL_S,
                                                  grace_period=HEARTBEAT_GRACE_S, skip_table_creation=not create)
        except ImportError as exc:
            # autotune ships an extra for PostgreSQL only; another database's driver is the
            # module SQLAlchemy tried to import.
            module = exc.name or getattr(exc.__cause__ or exc.__context__, "name", None)  # Optuna re-raises
            remedy = "pip install 'autotune[postgres]'" if url.startswith("postgresql") else \
                f"install the driver SQLAlchemy imports for it (pip install {module})" if module else \
                "install the SQLAlchemy driver for this database"
            raise StorageError(f"storage {shown}: the database driver is missing ({exc}); {remedy}") from None
        except (sqlalchemy.exc.IntegrityError, sqlalchemy.exc.ProgrammingError) as exc:
            # Workers started together on an empty database all create Optuna's tables; all but
            # one lose that race (optuna/optuna#1092). The tables exist by now.
            if attempt == 4 or not create:
                raise StorageError(f"storage {shown}: {_first_line(exc)}") from None
            time.sleep(0.2 * (attempt + 1))
        except sqlalchemy.exc.OperationalError as exc:
            raise fault(exc, shown, "cannot open the database: ") from None
        except sqlalchemy.exc.SQLAlchemyError as exc:
            raise StorageError(f"storage {shown}: {_first_line(exc)}") from None
        except optuna.exceptions.StorageInternalError as exc:
            raise fault(exc, shown) from None
        except RuntimeError as exc:  # Optuna's schema version check
            raise StorageError(f"storage {shown}: {exc}") from None
    raise AssertionError("unreachable")


def _first_line(exc: BaseException) -> str:
    """A driver error's first line, without any password of the URLs opened (a driver may
    quote its connection string)."""
    text = scrub(str(getattr(exc, "orig", None) or exc).strip())
    return text.splitlines()[0] if text else type(exc).__name__


# The database's own words for each cause (SQLite's, PostgreSQL's, MySQL's), lower case.
_CAUSES = (
    (("disk is full", "no space left", "disk full", "could not extend file"),
     "the disk is full (or the database reached its size limit); free space there and run the same command again"),
    (("database is locked", "database table is locked", "lock timeout", "lock wait timeout", "deadlock"),
     "the database is locked by another process (waited {wait:g} s); let it finish or stop it, then run again"),
    (("readonly", "read-only", "read only"),
     "the database is read-only here; give a writable --storage (a study writes), or copy the file"),
    (("no such table", 'relation "', "doesn't exist"),
     "not an autotune storage (Optuna's tables are missing)"),
)


def fault(exc: BaseException, shown: str, prefix: str = "") -> StorageError:
    """The one-line error for a storage that failed under a command, naming the cause: disk
    full, locked by another process, read-only, not an autotune storage, else the database's
    own first line. Optuna wraps every database error as "invalid data in the commit, e.g.
    exceeding max length" (StorageInternalError): the database's error under it says why."""
    while isinstance(exc, optuna.exceptions.StorageInternalError) and exc.__cause__ is not None:
        exc = exc.__cause__
    said = _first_line(exc)
    low = said.lower()
    for words, why in _CAUSES:
        if any(w in low for w in words):
            return StorageError(f"storage {shown}: {why.format(wait=SQLITE_LOCK_WAIT_S)} ({said})")
    return StorageError(f"storage {shown}: {prefix}{said}")


# What a database that fails under a running command raises (through Optuna, or our own SQL).
FAULTS = (optuna.exceptions.StorageInternalError, sqlalchemy.exc.OperationalError)


@contextlib.contextmanager
def faults(shown: str) -> Iterator[None]:
    """Turn a database failing under the body into ``fault``'s StorageError (exit status 2)."""
    try:
        yield
    except FAULTS as exc:
        raise fault(exc, shown) from None


def study_names(storage: optuna.storages.BaseStorage, shown: str) -> list[str]:
    """Names of the studies in a storage (a database that is not Optuna's is an error)."""
    try:
        return [s.study_name for s in optuna.get_all_study_summaries(storage, include_best_trial=False)]
    except sqlalchemy.exc.OperationalError as exc:
        raise fault(exc, shown) from None
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise StorageError(f"storage {shown}: not a study storage ({_first_line(exc)})") from None


# ------------------------------------------------------------------ Optuna internals, in one place


def storage_of(study: optuna.Study) -> optuna.storages.BaseStorage:
    return study._storage


def study_id_of(study: optuna.Study) -> int:
    return study._study_id


def trial_id_of(trial: optuna.Trial | optuna.trial.FrozenTrial) -> int:
    return trial._trial_id


def sql_engine(study: optuna.Study) -> sqlalchemy.engine.Engine | None:
    """The SQLAlchemy engine under a study's storage (None for journal files)."""
    storage = study._storage
    backend = getattr(storage, "_backend", storage)  # a study wraps its RDBStorage in a cache
    return getattr(backend, "engine", None)


def set_finished_attrs(study: optuna.Study, trial: optuna.trial.FrozenTrial, attrs: dict[str, Any],
                       state: optuna.trial.TrialState | None = None) -> bool:
    """Write attributes (and a state) of a trial this worker does not hold; False when another
    worker finished it first."""
    try:
        for key, value in attrs.items():
            study._storage.set_trial_user_attr(trial._trial_id, key, value)
        if state is not None:
            study._storage.set_trial_state_values(trial._trial_id, state)
    except optuna.exceptions.UpdateFinishedTrialError:
        return False
    return True


def heartbeat_ages(study: optuna.Study) -> dict[int, float]:
    """Seconds since the last heartbeat of each RUNNING trial that has one, by trial id, at the
    database's clock (as Optuna's own stale check reads it: the workers' clocks may differ);
    empty for a storage without heartbeats."""
    from optuna.storages._rdb import models

    engine = sql_engine(study)
    if engine is None or not is_heartbeat_enabled(study._storage):
        return {}
    beats = models.TrialHeartbeatModel
    with engine.connect() as conn:
        now = conn.execute(sqlalchemy.select(sqlalchemy.func.now())).scalar()
        rows = conn.execute(sqlalchemy.select(beats.trial_id, beats.heartbeat)
                            .join(models.TrialModel, models.TrialModel.trial_id == beats.trial_id)
                            .where(models.TrialModel.study_id == study._study_id,
                                   models.TrialModel.state == optuna.trial.TrialState.RUNNING)).all()
    now = now.replace(tzinfo=None)
    return {int(trial_id): max((now - beat.replace(tzinfo=None)).total_seconds(), 0.0) for trial_id, beat in rows}


def frozen(study: optuna.Study, trial_id: int) -> optuna.trial.FrozenTrial:
    return study._storage.get_trial(trial_id)


def trial_snapshot(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    """The study's trials as Optuna's samplers read them while a trial is sampled: read once per
    trial, by the first reader after ``Study.ask`` (which empties that cache), and kept until the
    next ask. Read only."""
    return study._get_trials(deepcopy=False, use_cache=True)


class Heartbeat:
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

    def beat(self, trial: optuna.Trial | None) -> None:
        self.trial_id = None if trial is None else trial._trial_id
        if self.enabled and self.trial_id is not None:
            self.storage.record_heartbeat(self.trial_id)

    def close(self) -> None:
        self.beat(None)
        self.stop.set()


# ------------------------------------------------------------------ a prepared study's storage


def open_study(prepared: "PreparedStudy", sampler: optuna.samplers.BaseSampler) -> optuna.Study:
    """Create or continue the prepared study in its storage, refusing one it would misread.

    Raises:
        StorageError: the storage cannot be used (see ``open_storage``).
        ConfigError: the stored study has another number of objectives, other choices for a
            parameter, or a schema this autotune does not read.
    """
    cfg = prepared.cfg
    shown = prepared.shown_storage
    store = open_storage(prepared.storage_url)
    directions = objective_mod.directions(cfg.objective)
    try:
        study = optuna.create_study(storage=store, study_name=cfg.name, sampler=sampler, directions=directions,
                                    load_if_exists=True)
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise StorageError(f"storage {shown}: {_first_line(exc)}") from None
    if len(study.directions) != len(directions):
        raise ConfigError(
            f"study '{cfg.name}' in {shown} has {len(study.directions)} objective(s) but the study file asks for "
            f"mode = {cfg.objective.mode!r}; use another study name or storage")
    records.check_schema(study, shown)
    _check_same_space(study, prepared)
    engines = comparable.engines_of(prepared)
    comparable.check_comparable(study, prepared, engines)
    name_objectives(study, vars(cfg.objective))
    records.write_study_header(study, {
        "gpu": records.gpu_attrs(prepared.gpu),
        # [hardware] gpus: every card and its budget (a one-card study's header is as it was).
        **({"placement": prepared.placement.to_dict()} if getattr(prepared, "placement", None) else {}),
        "model": prepared.model.key,
        "vram_budget_bytes": prepared.vram_budget_bytes,
        # What `estimate --study` needs to judge as the study does: the margin inside the
        # budget, and the workload the core's rules measure ctx against.
        "safety_margin_bytes": cfg.safety_margin_bytes,
        "workload": {"prompt_tokens": cfg.prompt_tokens, "output_tokens": cfg.output_tokens,
                     # Only what differs from one shape sent parallel at once, so the default
                     # study's header is as it was.
                     **({"profile": cfg.workload.profile, "file": cfg.workload.file, "requests": len(cfg.requests),
                         "arrival": cfg.workload.arrival, "rate": cfg.workload.rate,
                         "longest_tokens": max(p + o for p, o in cfg.requests)} if cfg.requests else {})},
        "objective": vars(cfg.objective),
        "study_file": str(cfg.path) if cfg.path else None,
        "excluded_before_search": prepared.excluded,
        comparable.ENGINES_ATTR: engines,
    })
    if comparable.ENGINES_ATTR not in study.user_attrs:  # a study stored before the check
        study.set_user_attr(comparable.ENGINES_ATTR, engines)
    # A worker that died mid-trial left its trial RUNNING: the runner fails it, by the one
    # liveness rule of every host (claims.holder), so that its configuration is measured again.
    return study


def _check_same_space(study: optuna.Study, prepared: "PreparedStudy") -> None:
    """Refuse to resume a study whose stored parameters had other choices than the file's.

    Optuna fixes a categorical parameter's choices for the life of a study; asking with other
    choices fails every trial ("does not support dynamic value space"). Said once, up front.
    """
    wanted = prepared.space.distributions()
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
            f"study '{prepared.cfg.name}' in {prepared.shown_storage} was run with other choices for "
            f"{'; '.join(changed)}. Optuna cannot change a parameter's choices within a study: give the "
            "study a new [study] name (or another --storage) to search the new space")


# ------------------------------------------------------------------ schema upgrades


def upgrade(url: str) -> list[str]:
    """Rename a version-1 storage's parameters to the shared names of schema 2 (space.py), in
    place: each study whose schema is 1 gets ``ctx``, ``parallel``, ``flash_attn`` and
    ``kv_bits`` for its ``<backend>.<name>`` parameters, every shared name with the union of
    its backends' choices (one distribution per name), and schema version 2. Trial numbers,
    states, values and attributes are untouched, so a study's records read as before.

    Optuna has no public way to rename a finished trial's parameter, so this rewrites its
    ``trial_params`` rows (param_value is the index of the choice: it is recomputed for the new
    choices), in one transaction per study. Journal storages are refused (an append-only log).

    Returns:
        One line per study: what was renamed, or why it was left alone.

    Raises:
        StorageError: not an RDB storage, or no such database.
    """
    from optuna.distributions import CategoricalDistribution, distribution_to_json, json_to_distribution

    shown = mask_url(url)
    if url.startswith("journal:"):
        raise StorageError(f"storage {shown}: a journal file cannot be upgraded in place; copy the study into "
                           "SQLite first (optuna.copy_study) and upgrade that")
    _check_file(url, url.split(":///", 1)[1] if url.startswith("sqlite:") and ":///" in url else "", writable=True)
    store = open_storage(url, create=False)  # it rewrites a database, never creates one
    engine = getattr(store, "engine", None)
    assert engine is not None
    done = []
    for name in study_names(store, shown):
        study = optuna.load_study(study_name=name, storage=store)
        version = study.user_attrs.get(records.SCHEMA_ATTR)
        if version not in records.UPGRADABLE:
            done.append(f"{name}: schema {version!r}, left as it is")
            continue
        sid = study_id_of(study)
        with engine.begin() as conn:
            rows = conn.execute(sqlalchemy.text(
                "SELECT p.param_id, p.trial_id, p.param_name, p.param_value, p.distribution_json FROM trial_params p "
                "JOIN trials t ON t.trial_id = p.trial_id WHERE t.study_id = :sid"), {"sid": sid}).all()
            renamed = []  # (param_id, new name, new external value)
            choices: dict[str, tuple] = {}
            for param_id, _trial_id, pname, internal, dist_json in rows:
                dist = json_to_distribution(dist_json)
                value = dist.to_external_repr(internal)
                backend, dot, option = pname.rpartition(".")
                if not dot or not isinstance(dist, CategoricalDistribution):
                    new_name, new_value, new_choices = pname, value, tuple(getattr(dist, "choices", ()))
                else:
                    dim = dimension_of(backend, option, tuple(dist.choices))
                    new_name, new_value, new_choices = dim.name, dim.encode(value), dim.choices
                shared = "." not in new_name and new_name != "backend"
                choices[new_name] = canonical_order(choices.get(new_name, ()) + new_choices) if shared else new_choices
                renamed.append((param_id, new_name, new_value))
            for param_id, new_name, new_value in renamed:
                dist = CategoricalDistribution(list(choices[new_name]))
                conn.execute(sqlalchemy.text(
                    "UPDATE trial_params SET param_name = :n, param_value = :v, distribution_json = :d "
                    "WHERE param_id = :id"),
                    {"n": new_name, "v": dist.to_internal_repr(new_value), "d": distribution_to_json(dist), "id": param_id})
        study.set_user_attr(records.SCHEMA_ATTR, records.SCHEMA_VERSION)
        names = sorted(n for n in choices if "." not in n and n != "backend")
        done.append(f"{name}: schema {version} -> {records.SCHEMA_VERSION}, {len(rows)} parameters of "
                    f"{len({r[1] for r in rows})} trials; shared names: {', '.join(names) or '(none)'}")
    return done
