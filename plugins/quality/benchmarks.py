"""The shipped benchmarks (MMLU, C-Eval): full item sets, seeded samples, and the orders drawn from them.

The files under ``data/`` are copies of the project's data (see ``data/SOURCES.md``): the full
sets (13,978 MMLU test items, 1,346 C-Eval validation items, gzip), the seeded samples drawn
from them (10 items per subject, the default for quick runs), and each subject's 5 dev items
for few-shot prompts. Nothing is downloaded; a missing file is an error that says which file
and how to restore it.

Every item is named by its position in its benchmark's full set (``item`` ids): a sample item
has the id of the same item in the full set, so per-item results measured on the sample are
reused when a study draws from the full set.
"""

from __future__ import annotations

import functools
import gzip
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from autotune.api import AutotuneError

__all__ = [
    "BENCHMARKS",
    "Benchmark",
    "DataMissingError",
    "POOLS",
    "data_dir",
    "docs_by_subject",
    "full_items",
    "item_ids",
    "load_items",
    "stratified_order",
    "subset",
]

# Where a paired measurement draws its items from: the seeded per-subject sample (``subset``)
# or the full set.
POOLS = ("sample", "full")


class DataMissingError(AutotuneError):
    """A benchmark file the plugin ships is not there (a broken or partial install)."""


@dataclass(frozen=True)
class Benchmark:
    """One multiple-choice benchmark as lm-eval formats it.

    Args:
        name: ``mmlu`` or ``ceval``.
        eval_file: The sampled evaluation items.
        dev_file: Each subject's dev items (few-shot examples, in file order).
        full_file: Every evaluation item the sample was drawn from (gzip JSON lines).
        max_per_subject: Items per subject in ``eval_file``.
        max_shots: Dev items per subject.
    """

    name: str
    eval_file: str
    dev_file: str
    full_file: str
    max_per_subject: int = 10
    max_shots: int = 5


BENCHMARKS = {
    "mmlu": Benchmark("mmlu", "mmlu_sample.jsonl", "mmlu_dev.jsonl", "mmlu_test.jsonl.gz"),
    "ceval": Benchmark("ceval", "ceval_sample.jsonl", "ceval_dev.jsonl", "ceval_val.jsonl.gz"),
}


def data_dir() -> Path:
    """The plugin's data folder (package data)."""
    return Path(str(resources.files(__package__).joinpath("data")))


def _path(name: str) -> Path:
    path = data_dir() / name
    if not path.is_file():
        raise DataMissingError(
            f"{path}: benchmark data missing; reinstall autotune (the file is package data of "
            f"autotune_plugins.quality, copied from shared/data, see data/SOURCES.md)"
        )
    return path


@functools.lru_cache(maxsize=None)
def _read_jsonl(name: str) -> tuple[dict[str, Any], ...]:
    path = _path(name)
    rows = []
    opened = gzip.open(path, "rt", encoding="utf-8") if name.endswith(".gz") else path.open(encoding="utf-8")
    with opened as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataMissingError(f"{path}:{n}: not a JSON line ({exc})") from None
    return tuple(rows)


def load_items(benchmark: str, split: str = "eval") -> dict[str, list[dict[str, Any]]]:
    """Items of one benchmark by subject (alphabetical), in file order.

    Args:
        benchmark: ``mmlu`` or ``ceval``.
        split: ``eval`` (the sampled test/val items), ``dev`` (few-shot examples) or ``full``
            (every test/val item, each with its ``item`` id).
    """
    b = BENCHMARKS[benchmark]
    if split == "full":
        rows: tuple[dict[str, Any], ...] = full_items(benchmark)
    else:
        rows = _read_jsonl(b.eval_file if split == "eval" else b.dev_file)
    by_subject: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_subject.setdefault(row["subject"], []).append(row)
    return dict(sorted(by_subject.items()))


@functools.lru_cache(maxsize=None)
def subject_names(benchmark: str) -> dict[str, str]:
    """How each subject is named inside the prompt: MMLU in English, C-Eval in Chinese."""
    if benchmark == "mmlu":
        return {s: s.replace("_", " ") for s in load_items("mmlu")}
    mapping = json.loads(_path("ceval_subject_mapping.json").read_text(encoding="utf-8"))
    return {s: names[1] for s, names in mapping.items()}


def subset(benchmark: str, per_subject: int, seed: int) -> dict[str, list[dict[str, Any]]]:
    """A seeded subset: ``per_subject`` items of each subject, the same for equal arguments.

    Each subject draws with its own generator (``Random(f"{seed}:{benchmark}:{subject}")``), so
    a subject's items do not depend on the others; the chosen items keep file order.
    """
    b = BENCHMARKS[benchmark]
    if not 1 <= per_subject <= b.max_per_subject:
        raise AutotuneError(
            f"per_subject {per_subject}: {benchmark} ships {b.max_per_subject} items per subject "
            f"(use 1..{b.max_per_subject})"
        )
    out = {}
    for subject, items in load_items(benchmark).items():
        picked = sorted(random.Random(f"{seed}:{benchmark}:{subject}").sample(range(len(items)), per_subject))
        out[subject] = [items[i] for i in picked]
    return out


def _identity(row: dict[str, Any]) -> tuple[Any, ...]:
    return row["subject"], row["question"], tuple(row["choices"]), row["answer"]


@functools.lru_cache(maxsize=None)
def full_items(benchmark: str) -> tuple[dict[str, Any], ...]:
    """The full set, each row with its ``item`` id (its 0-based line in the file)."""
    return tuple({**row, "item": i} for i, row in enumerate(_read_jsonl(BENCHMARKS[benchmark].full_file)))


@functools.lru_cache(maxsize=None)
def _ids_by_identity(benchmark: str) -> dict[tuple[Any, ...], int]:
    return {_identity(row): row["item"] for row in full_items(benchmark)}


def item_ids(benchmark: str, rows: list[dict[str, Any]]) -> list[int]:
    """The full-set ids of sample rows (every sample item is in the full set, same text)."""
    known = _ids_by_identity(benchmark)
    missing = [r["question"][:60] for r in rows if _identity(r) not in known]
    if missing:
        raise DataMissingError(
            f"{_path(BENCHMARKS[benchmark].full_file)}: {len(missing)} sample item(s) are not in the "
            f"full set (first: {missing[0]!r}); the data files do not match, reinstall autotune"
        )
    return [known[_identity(r)] for r in rows]


def stratified_order(benchmark: str, pool: str, per_subject: int, seed: int) -> tuple[int, ...]:
    """Item ids in the order a sequential measurement draws them.

    Round-robin over subjects (alphabetical): the first batch of one item per subject, then the
    next, so that however early the measurement stops, every subject weighs about equally;
    within a subject, a seeded shuffle (``Random(f"{seed}:{benchmark}:order:{subject}")``).

    Args:
        benchmark: ``mmlu`` or ``ceval``.
        pool: ``sample`` (the seeded ``per_subject`` items of each subject, as ``subset``
            draws them) or ``full`` (every item of the full set).
        per_subject: Items per subject of the ``sample`` pool.
        seed: Chooses the sample and the order.
    """
    if pool not in POOLS:
        raise AutotuneError(f"pool {pool!r}: use one of {', '.join(POOLS)}")
    if pool == "sample":
        chosen = subset(benchmark, per_subject, seed)
        by_subject = {s: item_ids(benchmark, docs) for s, docs in chosen.items()}
    else:
        by_subject = {s: [d["item"] for d in docs] for s, docs in load_items(benchmark, "full").items()}
    shuffled = []
    for subject, ids in sorted(by_subject.items()):
        ids = list(ids)
        random.Random(f"{seed}:{benchmark}:order:{subject}").shuffle(ids)
        shuffled.append(ids)
    depth = max(len(ids) for ids in shuffled)
    return tuple(ids[r] for r in range(depth) for ids in shuffled if r < len(ids))


def docs_by_subject(benchmark: str, ids: list[int] | tuple[int, ...]) -> dict[str, list[dict[str, Any]]]:
    """The full-set rows of ``ids`` by subject (alphabetical), in id order within a subject."""
    rows = full_items(benchmark)
    out: dict[str, list[dict[str, Any]]] = {}
    for i in sorted(set(ids)):
        out.setdefault(rows[i]["subject"], []).append(rows[i])
    return dict(sorted(out.items()))
