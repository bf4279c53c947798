"""Weights made on demand from one source model, kept in a content-addressed cache.

A study may name its candidates as formats (``gguf:Q4_K_M``, ``exl2:4.0``) on a real backend,
with ``[model] source`` pointing at the model they are made from (a Hugging Face directory, or
a full-precision GGUF file). The first trial that needs a format makes it; every later trial,
study and worker finds it here. How a format is made is the backend's business
(``BaseBackend.artifact_recipe``); where it is kept, when it is made, what a trial records of it
and what happens when making fails is this module's.

Layout (``$AUTOTUNE_ARTIFACTS_DIR``, else ``~/.cache/autotune/artifacts``)::

    <source sha256, 16 hex>/<tool and its version>/<file or directory named by the format>
    <source sha256, 16 hex>/<tool and its version>/<...>.json   what was made, from what, how long

The key is the source's *content* (a copied or renamed model directory is the same source; a
re-downloaded one with a changed file is not), the tool's version (a newer llama-quantize
may write different bytes) and the format. An artifact is written under a temporary name and
renamed when complete, under a file lock, so a killed conversion leaves no half file that
looks finished and two workers never make the same artifact at once.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator, Mapping

from autotune.toolkit import processes
from autotune.errors import AutotuneError, BackendError, ConfigError, UnknownNameError
from autotune.engine.formats import normalize_format, parse_format
from autotune.toolkit.redact import engine_environment, scrub

# A backend and its study context are typed ``Any`` here (what ``BaseBackend.artifact_recipe``
# returns is a Recipe of this module): artifacts stay below backend, no import cycle between them.
if TYPE_CHECKING:  # pragma: no cover
    from autotune.engine.declarations import WeightFormats

__all__ = [
    "ARTIFACTS_ENV",
    "Artifact",
    "ArtifactError",
    "Recipe",
    "artifact_path",
    "artifacts_dir",
    "MakeEstimate",
    "ensure",
    "is_format",
    "predict_making",
    "source_hash",
]

ARTIFACTS_ENV = "AUTOTUNE_ARTIFACTS_DIR"
# Room kept free beyond what a conversion is expected to write: its estimate is a prediction
# (formats.weights_for), and a full disk fails the user's other work too.
DISK_MARGIN = 1.10
_HASH_CHUNK = 1 << 22
# How often a running converter or quantizer is said to be running, output or none.
PROGRESS_S = 10.0


class ArtifactError(BackendError):
    """Making an artifact failed; the message carries the tool's own error. Fails the trials
    that need this artifact, not the study."""


def run_tool(
    argv: list[str],
    what: str,
    say: Callable[[str], None],
    *,
    cwd: Path | None = None,
    env: Mapping[str, str] | None = None,
) -> None:
    """Run a converter or quantizer: that it runs, with its latest line, passed to ``say`` every
    ``PROGRESS_S`` (a conversion takes minutes, some of them silent; it has no timeout, a 70B
    conversion's time being unknown: Ctrl-C or SIGTERM is the bound, and ends its group), and on
    failure an error carrying the tool's own last lines (its error lines first), so the trials that needed the artifact say why. Like an engine, it
    gets the allow-listed environment (``autotune.toolkit.redact.engine_environment``) unless ``env`` is
    given: a converter has no use for the storage URL or a token, and prints what it likes."""
    env = engine_environment() if env is None else dict(env)
    proc = processes.start(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        cwd=cwd,
        env=env,
    )
    lines: list[str] = []
    assert proc.stdout is not None
    stdout = proc.stdout

    def read() -> None:  # a thread: the wait below must wake to report a tool that prints nothing
        nonlocal lines
        for line in stdout:
            if line.rstrip():
                lines = [*lines[-40:], line.rstrip()]

    reader = threading.Thread(target=read, daemon=True, name="autotune-tool-output")
    reader.start()
    started = time.monotonic()
    try:
        while True:
            try:
                code = proc.wait(timeout=PROGRESS_S)
                break
            except subprocess.TimeoutExpired:
                # A silent tool (a converter writing a large tensor, or one stuck) said as such:
                # before, nothing was shown until it printed, and a stuck one looked like a hang.
                last = f": {scrub(lines[-1])[:160]}" if lines else " (no output yet)"
                say(f"  {what}: running for {time.monotonic() - started:.0f} s{last}")
    finally:
        processes.stop(proc)  # an interrupted tool's group, and what a finished one left running
    reader.join(timeout=5)  # its last lines; what held the pipe open is stopped by now
    if code != 0:
        errors = [ln for ln in lines if re.search(r"error|Error|ERROR|Traceback|No module", ln)]
        raise AutotuneError(scrub(f"{what} failed (exit status {code}): {' | '.join((errors or lines)[-3:])}"))


def is_format(weights: str, declared: Iterable[WeightFormats] = ()) -> bool:
    """Whether a candidate's weights name a format (``gguf:Q8_0``, ``exl2:4.0``) rather than a file:
    one of ``declared`` (a backend's own) or of an installed backend."""
    if ":" not in weights or "/" in weights.partition(":")[0]:
        return False
    try:
        parse_format(weights, declared)
    except UnknownNameError:
        return False
    return True


def artifacts_dir() -> Path:
    """Where artifacts live: ``$AUTOTUNE_ARTIFACTS_DIR``, else ``~/.cache/autotune/artifacts``."""
    given = os.environ.get(ARTIFACTS_ENV)
    return Path(given).expanduser() if given else Path.home() / ".cache" / "autotune" / "artifacts"


@dataclass(frozen=True)
class Recipe:
    """How one backend makes one format from one source (returned by ``artifact_recipe``).

    Attributes:
        fmt: The canonical format it makes (``gguf:Q4_K_M``).
        tool: The tool and its version, a path component (``llama.cpp-0c1e57098``): part of the key.
        name: The artifact's file or directory name inside the cache entry (``Q4_K_M.gguf``).
        expected_bytes: What it will write, for the disk check before it starts.
        make: ``make(inputs, out, say)`` writes the artifact to ``out`` (a path that does not
            exist yet; a file or a directory) from ``inputs`` (the source first, then each of
            ``needs`` made), and says what it is doing through ``say``. Raises
            ``AutotuneError`` with the tool's own error.
        needs: Formats made first and handed to ``make`` (an HF source becomes ``gguf:F16``
            before it is quantized); each is an artifact of its own, made once.
        description: The command it runs, in words, for the progress line.
        step: Which tool run this is (``llama-quantize``): what the seconds of earlier makings
            are learned per, with ``tool``.
        seconds_per_gib: A first guess of the seconds it takes per GiB it writes, from a
            measurement the backend cites, until this machine's cache has made one of its
            ``step``; None: no guess (the study then cannot tell the cost before making it).
        check: A cheap dry run of ``make`` (seconds, not the making), run before the study's
            first trial when the recipe will run (``check_makings``): the problem with its
            remedy that ``make`` would fail on, None when it would get past it. A converter
            that does not know the model's tokenizer fails every making alike; found here,
            the study stops before it starts.
    """

    fmt: str
    tool: str
    name: str
    expected_bytes: int
    make: Callable[[list[Path], Path, Callable[[str], None]], None] = field(compare=False)
    needs: tuple[str, ...] = ()
    description: str = ""
    step: str = ""
    seconds_per_gib: float | None = None
    check: Callable[[], str | None] | None = field(default=None, compare=False)


@dataclass(frozen=True)
class MakeEstimate:
    """What making a trial's weights would cost before it starts (``predict_making``).

    Attributes:
        seconds: The predicted seconds, the recipe and every unmade need together; None where
            a step has neither a rate learned on this machine nor a first guess.
        formats: What would be made, needs first.
        basis: Where each rate came from, in words.
    """

    seconds: float | None
    formats: tuple[str, ...]
    basis: str


@dataclass(frozen=True)
class Artifact:
    """One artifact ready to load, as a trial records it."""

    fmt: str
    path: Path
    sha256: str
    source_sha256: str
    tool: str
    make_seconds: float
    made_now: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.fmt,
            "path": str(self.path),
            "sha256": self.sha256,
            "source_sha256": self.source_sha256,
            "tool": self.tool,
            "make_seconds": round(self.make_seconds, 2),
            "made_now": self.made_now,
        }


# ----------------------------------------------------------------------------- source hashes


def _files_of(source: Path) -> list[Path]:
    if source.is_file():
        return [source]
    # Everything a converter reads (weights, config, tokenizer); dot-files and caches are not the model.
    return sorted(
        p
        for p in source.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(source).parts)
    )


def _sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _sha256_tree(path: Path) -> str:
    if path.is_file():
        return _sha256_file(path)
    h = hashlib.sha256()
    for p in _files_of(path):
        h.update(f"{p.relative_to(path).as_posix()}\0{_sha256_file(p)}\n".encode())
    return h.hexdigest()


_seen: dict[str, tuple[list[list[Any]], str]] = {}


def source_hash(source: str | os.PathLike[str]) -> str:
    """The sha256 of a source model's content (a file, or every file of a directory by relative name).

    Hashing a 15 GB directory takes a minute, so the result is remembered in the cache beside
    the artifacts, keyed by the path and each file's size and modification time: a file that
    changes is hashed again.
    """
    src = Path(source).resolve()
    if not src.exists():
        raise ConfigError(f"{src}: no such file or directory (the model source)")
    stamp = [
        [p.relative_to(src).as_posix() if src.is_dir() else p.name, p.stat().st_size, p.stat().st_mtime_ns]
        for p in _files_of(src)
    ]
    seen = _seen.get(str(src))
    if seen is not None and seen[0] == stamp:
        return seen[1]  # asked at every admission judgement: no file read when nothing changed
    memo_path = artifacts_dir() / "sources.json"
    try:
        memo = json.loads(memo_path.read_text())
    except (OSError, ValueError):
        memo = {}
    known = memo.get(str(src))
    if isinstance(known, dict) and known.get("stamp") == stamp and isinstance(known.get("sha256"), str):
        _seen[str(src)] = (stamp, known["sha256"])
        return known["sha256"]
    digest = _sha256_tree(src)
    _seen[str(src)] = (stamp, digest)
    memo[str(src)] = {"stamp": stamp, "sha256": digest}
    with contextlib.suppress(OSError):
        memo_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = memo_path.with_name(f"sources.json.{os.getpid()}")
        tmp.write_text(json.dumps(memo))
        tmp.replace(memo_path)
    return digest


# ----------------------------------------------------------------------------- the cache


def artifact_path(source: str | os.PathLike[str], recipe: Recipe) -> Path:
    """Where ``recipe``'s artifact of ``source`` is (or will be) in the cache."""
    return artifacts_dir() / source_hash(source)[:16] / recipe.tool / recipe.name


def _manifest_path(path: Path) -> Path:
    return path.with_name(path.name + ".json")


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _free_bytes(directory: Path) -> int:
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    return shutil.disk_usage(existing).free


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


class DiskSpaceError(ArtifactError):
    """An artifact too large for the free disk space: a property of that artifact's size (a
    smaller format may fit), so never a failure every trial would repeat (study/systematic.py)."""


def check_disk(directory: Path, need_bytes: int, what: str) -> None:
    """Refuse a conversion that would not fit on the disk, before it starts."""
    free = _free_bytes(directory)
    if need_bytes * DISK_MARGIN > free:
        raise DiskSpaceError(
            f"{what}: needs about {_gib(need_bytes * DISK_MARGIN)} in {directory} "
            f"(the artifact and {DISK_MARGIN - 1:.0%} to spare) but {_gib(free)} is free; free some "
            f"space or point {ARTIFACTS_ENV} at a larger disk"
        )


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


# Failures of this process, by artifact path: every later trial needing the same artifact fails
# at once with the same error instead of running the tool again.
_failed: dict[Path, str] = {}


def ensure(backend: Any, weights: str, ctx: Any, say: Callable[[str], None] | None = None) -> Artifact | None:
    """The artifact ``weights`` names for ``backend``, made now if the cache lacks it.

    Args:
        backend: The backend that loads it (and knows how to make it: ``artifact_recipe``).
        weights: A candidate's weights: a format, or a file path (then None: nothing to make).
        ctx: The study's context for this backend (``ctx.source`` is the model source).
        say: Progress lines ("making gguf:Q8_0 ...", "cache hit ...").

    Returns:
        The artifact, with the seconds it took to make (``made_now`` False on a cache hit); None
        for a file path, for a model backend (the twin predicts a format, it loads nothing) and
        for a backend that makes no artifacts (``artifact_recipe`` not implemented).

    Raises:
        ArtifactError: No source, a disk too small, or the tool failed (its own error quoted).
    """
    if not _made_by(backend, weights):
        return None
    return _ensure(backend, weights, ctx, say or (lambda _: None), depth=0)


def _made_by(backend: Any, weights: str) -> bool:
    """Whether ``backend`` makes ``weights`` (a format it has recipes for) rather than loading a
    file as given; a model backend (the twin) predicts a format and makes nothing."""
    return backend.predictor is None and backend.artifacts is not None and is_format(weights, backend.weight_formats)


def _recipe(backend: Any, fmt: str, ctx: Any) -> Recipe:
    if ctx.source is None:
        raise ArtifactError(
            f"weights {fmt!r}: no [model] source to make it from (name the model directory or "
            "full-precision GGUF file there)"
        )
    recipe = None if backend.artifacts is None else backend.artifacts.recipe(fmt, ctx.source, ctx)
    if recipe is None:
        raise ArtifactError(f"backend '{backend.name}' cannot make {fmt} from {ctx.source}")
    return recipe


def _ensure(backend: Any, fmt: str, ctx: Any, say: Callable[[str], None], depth: int) -> Artifact:
    if depth > 4:
        raise ArtifactError(f"{fmt}: the recipes of backend '{backend.name}' need each other in a loop")
    recipe = _recipe(backend, fmt, ctx)
    assert ctx.source is not None
    src_hash = source_hash(ctx.source)
    path = artifact_path(ctx.source, recipe)
    if path in _failed:
        raise ArtifactError(_failed[path])
    found = _read(path, recipe)
    if found is not None:
        say(f"artifact {recipe.fmt}: cache hit, {path}")
        return found
    inputs = [Path(ctx.source)] + [_ensure(backend, need, ctx, say, depth + 1).path for need in recipe.needs]
    with _locked(path):
        found = _read(path, recipe)  # another worker may have made it while we waited
        if found is not None:
            say(f"artifact {recipe.fmt}: cache hit, {path} (made by another worker)")
            return found
        what = f"making {recipe.fmt} from {ctx.source}"
        try:
            check_disk(path.parent, recipe.expected_bytes, what)
        except ArtifactError as exc:
            _failed[path] = str(exc)
            raise
        partial = path.with_name(path.name + ".partial")
        _remove(partial)
        say(
            f"artifact {recipe.fmt}: {what} ({recipe.description or recipe.tool}, about "
            f"{_gib(recipe.expected_bytes)}) -> {path}"
        )
        started = time.monotonic()
        try:
            recipe.make(inputs, partial, say)
        except AutotuneError as exc:
            _remove(partial)
            _failed[path] = f"{what} failed: {exc}"
            raise ArtifactError(_failed[path], log_tail=getattr(exc, "log_tail", "")) from exc
        except BaseException:
            _remove(partial)
            raise
        if not partial.exists():
            _failed[path] = f"{what} failed: the recipe wrote nothing at {partial}"
            raise ArtifactError(_failed[path])
        seconds = round(time.monotonic() - started, 2)
        digest = _sha256_tree(partial)
        manifest = {
            "format": recipe.fmt,
            "tool": recipe.tool,
            "source": str(ctx.source),
            "source_sha256": src_hash,
            "sha256": digest,
            "make_seconds": seconds,
            "step": recipe.step,
            "bytes": _size_of(partial),
            "made_by": backend.name,
            "made_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "inputs": [str(p) for p in inputs],
        }
        # The record first, the artifact last: an artifact in place always has its record.
        _manifest_path(path).write_text(json.dumps(manifest, indent=2))
        _remove(path)
        partial.replace(path)
    say(f"artifact {recipe.fmt}: made in {seconds:.1f} s, {path}")
    return Artifact(recipe.fmt, path, digest, src_hash, recipe.tool, seconds, True)


def _size_of(path: Path) -> int:
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in _files_of(path))


def _learned_rates() -> dict[tuple[str, str], list[float]]:
    """Seconds per GiB written, per (tool, step), of every artifact this machine's cache made."""
    rates: dict[tuple[str, str], list[float]] = {}
    root = artifacts_dir()
    for manifest in root.glob("*/*/*.json"):
        try:
            m = json.loads(manifest.read_text())
            step, n_bytes, seconds = str(m["step"]), int(m["bytes"]), float(m["make_seconds"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # not a manifest, or one written before steps were recorded
        if step and n_bytes > 0 and seconds >= 0:
            rates.setdefault((str(m.get("tool")), step), []).append(seconds / (n_bytes / 2**30))
    return rates


def predict_making(backend: Any, weights: str, ctx: Any) -> MakeEstimate | None:
    """How long making ``weights`` would take now: None when there is nothing to make (a file
    path, a cached artifact, a backend that makes none) or no recipe to ask.

    Each unmade step is predicted from its expected size at the median rate this machine's
    cache recorded for the same tool and step (conversions scale with the bytes they write),
    else at the recipe's own first guess; ``seconds`` is None where neither exists.
    """
    if not _made_by(backend, weights):
        return None
    try:
        plan = _unmade(backend, weights, ctx, depth=0)
    except AutotuneError:
        return None  # the making itself will fail and say why
    if not plan:
        return None
    learned = _learned_rates()
    total: float | None = 0.0
    bases = []
    for recipe in plan:
        seen = learned.get((recipe.tool, recipe.step))
        if seen:
            rate = sorted(seen)[len(seen) // 2]
            bases.append(f"{recipe.fmt} at {rate:.0f} s/GiB ({len(seen)} {recipe.step} run(s) on this machine)")
        elif recipe.seconds_per_gib is not None:
            rate = recipe.seconds_per_gib
            bases.append(f"{recipe.fmt} at {rate:.0f} s/GiB (the backend's first guess)")
        else:
            total = None
            bases.append(f"{recipe.fmt}: no rate known")
            continue
        if total is not None:
            total += rate * recipe.expected_bytes / 2**30
    return MakeEstimate(total, tuple(r.fmt for r in plan), "; ".join(bases))


def check_makings(backend: Any, weights: "list[str] | tuple[str, ...]", ctx: Any) -> list[str]:
    """What the recipes that will run to make ``weights`` (those not cached yet) would fail on,
    by their dry runs (``Recipe.check``), each recipe checked once: one line per problem,
    naming the step. Nothing is made.

    A format with no recipe is the study's format check's to report, not this one's.
    """
    plan: list[Recipe] = []
    for w in weights:
        if _made_by(backend, w):
            try:
                unmade = _unmade(backend, normalize_format(w, backend.weight_formats), ctx, 0)
            except AutotuneError:
                continue
            plan += [r for r in unmade if r not in plan]
    problems = []
    for recipe in plan:
        problem = recipe.check() if recipe.check is not None else None
        if problem:
            problems.append(f"making {recipe.fmt} ({recipe.description or recipe.step}) would fail: {problem}")
    return problems


def _unmade(backend: Any, fmt: str, ctx: Any, depth: int) -> list[Recipe]:
    """The recipes that would run to make ``fmt``, needs first (none when it is cached)."""
    if depth > 4:
        return []
    recipe = _recipe(backend, fmt, ctx)
    assert ctx.source is not None
    if _read(artifact_path(ctx.source, recipe), recipe) is not None:
        return []
    plan: list[Recipe] = []
    for need in recipe.needs:
        plan += [r for r in _unmade(backend, need, ctx, depth + 1) if r not in plan]
    return plan + [recipe]


def _read(path: Path, recipe: Recipe) -> Artifact | None:
    """The cached artifact at ``path``, or None when it is absent or its record is not whole."""
    if not path.exists():
        return None
    try:
        m = json.loads(_manifest_path(path).read_text())
        return Artifact(
            recipe.fmt, path, str(m["sha256"]), str(m["source_sha256"]), recipe.tool, float(m["make_seconds"]), False
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None  # renamed into place but killed before its record: made again
