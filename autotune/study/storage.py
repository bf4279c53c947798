"""Where a study lives: opening, checking and naming its Optuna storage.

Through Optuna's public API; what must reach further (the RDB heartbeat, the ids and storage
behind a study or trial) is study/optuna_internals.py's, re-exported here. SQLite pragmas are
set on our own engine's connections only: a host program's other databases are not touched.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import optuna
import sqlalchemy
import sqlalchemy.exc

from autotune.study import objective as objective_mod
from autotune.config import load_study_config
from autotune.errors import ConfigError, StorageError
from autotune.study.objective import name_objectives
from autotune.toolkit.redact import mask_url, remember_url, scrub, split_url
from autotune.study import comparable, records

# What reaches into Optuna's internals lives in one module; these are re-exported for the
# runner, the claims and the tests, which know them as the storage's.
from autotune.study.optuna_internals import (  # noqa: F401
    HEARTBEAT_GRACE_S,
    HEARTBEAT_INTERVAL_S,
    Heartbeat,
    frozen,
    heartbeat_ages,
    set_finished_attrs,
    sql_engine,
    storage_of,
    study_id_of,
    trial_id_of,
    trial_snapshot,
)


if TYPE_CHECKING:  # pragma: no cover
    from autotune.study.prepared import PreparedStudy

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
        raise StorageError(
            f"storage {shown}: the password holds an unencoded {' '.join(repr(c) for c in bad)}, "
            "which the database driver reads as part of the host; percent-encode it ('@' is %40, "
            "'/' %2F, '?' %3F, '#' %23) or give the password as $PGPASSWORD"
        )
    try:
        port = sqlalchemy.engine.make_url(url).port
    except (sqlalchemy.exc.ArgumentError, ValueError, TypeError):
        port = "bad"
    if port == "bad" or (port is not None and not 0 < port < 65536):
        raise StorageError(
            f"storage {shown}: not a URL the driver can read (the port after the host must be a "
            "number from 1 to 65535); use postgresql://USER:PASSWORD@HOST:PORT/DB"
        )


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
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "autotune"
    )
    return Path(base) / "last-study" / (hashlib.sha256(where.encode()).hexdigest()[:16] + ".json")


def remember_run(url: str, study_name: str, directory: Path | None = None) -> None:
    """Record the study just run in the current directory, so that ``best``, ``report`` and
    ``dashboard`` run there read it next without being told. A URL holding a password is not
    written down (it came from $AUTOTUNE_STORAGE or the command line, and is given there again);
    a relative SQLite path is kept absolute."""
    here = (directory or Path.cwd()).resolve()
    if url.startswith("sqlite:///") and not url.startswith("sqlite:////"):
        url = "sqlite:///" + str(here / url[len("sqlite:///") :])
    keep = url if mask_url(url) == url else None
    path = _last_run_file(here)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"storage": keep, "study": study_name, "directory": str(here)}) + "\n")
    except OSError:
        pass  # an unwritable cache loses only this convenience


def reading_target(
    given: str | None, study_file: str | Path | None, study_name: str | None, default_file: Path
) -> tuple[str, str | None, str]:
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
            study_name = load_study_config(Path(study_file), read_files=False).name
        return given or os.environ[STORAGE_ENV], study_name, source
    if study_file is not None:
        cfg = load_study_config(Path(study_file), read_files=False)  # the storage alone answers
        return resolve_url(None, cfg.storage, cfg.default_storage), study_name or cfg.name, f"study file {study_file}"
    last = _last_run_file()
    if last.is_file():
        try:
            data = json.loads(last.read_text())
        except (OSError, ValueError):
            data = {}
        if isinstance(data, dict) and data.get("storage"):
            return str(data["storage"]), study_name or data.get("study"), "the study last run in this directory"
        if isinstance(data, dict) and data.get("study"):
            # Its URL held a password and was not written down: the default study's storage
            # would answer for another study, or say "does not exist" of a study that does.
            raise ConfigError(
                f"the study last run in this directory ({data['study']}) is in a storage whose URL "
                "holds a password, which autotune does not write down: give it again with --storage "
                f"URL or ${STORAGE_ENV}"
            )
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
        raise StorageError(
            f"storage {shown}: an in-memory database ends with this process, so 'autotune best', "
            "'report' and a resumed study would find nothing; give a file, e.g. sqlite:///study.db"
        )
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
                raise StorageError(
                    f"storage {shown}: {p} is a SQLite database of another application (tables: "
                    f"{', '.join(sorted(tables)[:8])}{', ...' if len(tables) > 8 else ''}); "
                    "give a new file"
                )
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
        path = url[len("journal:") :]
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
                return optuna.storages.RDBStorage(
                    read_only or url,
                    engine_kwargs=engine_kwargs,
                    heartbeat_interval=HEARTBEAT_INTERVAL_S,
                    grace_period=HEARTBEAT_GRACE_S,
                    skip_table_creation=not create,
                )
        except ImportError as exc:
            # autotune ships an extra for PostgreSQL only; another database's driver is the
            # module SQLAlchemy tried to import.
            module = exc.name or getattr(exc.__cause__ or exc.__context__, "name", None)  # Optuna re-raises
            remedy = (
                "pip install 'autotune[postgres]'"
                if url.startswith("postgresql")
                else f"install the driver SQLAlchemy imports for it (pip install {module})"
                if module
                else "install the SQLAlchemy driver for this database"
            )
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
    (
        ("disk is full", "no space left", "disk full", "could not extend file"),
        "the disk is full (or the database reached its size limit); free space there and run the same command again",
    ),
    (
        ("database is locked", "database table is locked", "lock timeout", "lock wait timeout", "deadlock"),
        "the database is locked by another process (waited {wait:g} s); let it finish or stop it, then run again",
    ),
    (
        ("readonly", "read-only", "read only"),
        "the database is read-only here; give a writable --storage (a study writes), or copy the file",
    ),
    (("no such table", 'relation "', "doesn't exist"), "not an autotune storage (Optuna's tables are missing)"),
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
        study = optuna.create_study(
            storage=store, study_name=cfg.name, sampler=sampler, directions=directions, load_if_exists=True
        )
    except sqlalchemy.exc.SQLAlchemyError as exc:
        raise StorageError(f"storage {shown}: {_first_line(exc)}") from None
    if len(study.directions) != len(directions):
        raise ConfigError(
            f"study '{cfg.name}' in {shown} has {len(study.directions)} objective(s) but the study file asks for "
            f"mode = {cfg.objective.mode!r}; use another study name or storage"
        )
    records.check_schema(study, shown, writing=True)
    _check_same_space(study, prepared)
    engines = comparable.engines_of(prepared)
    comparable.check_comparable(study, prepared, engines)
    name_objectives(study, vars(cfg.objective))
    records.write_study_header(
        study,
        {
            "gpu": records.gpu_attrs(prepared.gpu),
            # [hardware] gpus: every card and its budget (a one-card study's header is as it was).
            **({"placement": prepared.placement.to_dict()} if getattr(prepared, "placement", None) else {}),
            "model": prepared.model.key,
            "vram_budget_bytes": prepared.vram_budget_bytes,
            # What `estimate --study` needs to judge as the study does: the margin inside the
            # budget, and the workload the core's rules measure ctx against.
            "safety_margin_bytes": cfg.safety_margin_bytes,
            "workload": {
                "prompt_tokens": cfg.prompt_tokens,
                "output_tokens": cfg.output_tokens,
                # Only what differs from one shape sent parallel at once, so the default
                # study's header is as it was.
                **(
                    {
                        "profile": cfg.workload.profile,
                        "file": cfg.workload.file,
                        "requests": len(cfg.requests),
                        "arrival": cfg.workload.arrival,
                        "rate": cfg.workload.rate,
                        "longest_tokens": max(p + o for p, o in cfg.requests),
                    }
                    if cfg.requests
                    else {}
                ),
            },
            "objective": vars(cfg.objective),
            "study_file": str(cfg.path) if cfg.path else None,
            "excluded_before_search": prepared.excluded,
            comparable.ENGINES_ATTR: engines,
        },
    )
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
    changed = [
        f"{name}: stored {list(stored[name])}, file {list(wanted[name])}"
        for name in stored
        if name in wanted and stored[name] != wanted[name]
    ]
    if changed:
        raise ConfigError(
            f"study '{prepared.cfg.name}' in {prepared.shown_storage} was run with other choices for "
            f"{'; '.join(changed)}. Optuna cannot change a parameter's choices within a study: give the "
            "study a new [study] name (or another --storage) to search the new space"
        )
