"""The shipped benchmark samples (MMLU, C-Eval) and the seeded per-subject subsets drawn from them.

The files under ``data/`` are copies of the project's seeded samples (see ``data/SOURCES.md``):
10 test items per MMLU subject and 10 validation items per C-Eval subject, plus each subject's
5 dev items for few-shot prompts. Nothing is downloaded; a missing file is an error that says
which file and how to restore it.
"""

from __future__ import annotations

import functools
import json
import random
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from autotune.errors import AutotuneError

__all__ = ["BENCHMARKS", "Benchmark", "DataMissingError", "data_dir", "load_items", "subset"]


class DataMissingError(AutotuneError):
    """A benchmark file the plugin ships is not there (a broken or partial install)."""


@dataclass(frozen=True)
class Benchmark:
    """One multiple-choice benchmark as lm-eval formats it.

    Args:
        name: ``mmlu`` or ``ceval``.
        eval_file: The sampled evaluation items.
        dev_file: Each subject's dev items (few-shot examples, in file order).
        max_per_subject: Items per subject in ``eval_file``.
        max_shots: Dev items per subject.
    """

    name: str
    eval_file: str
    dev_file: str
    max_per_subject: int = 10
    max_shots: int = 5


BENCHMARKS = {
    "mmlu": Benchmark("mmlu", "mmlu_sample.jsonl", "mmlu_dev.jsonl"),
    "ceval": Benchmark("ceval", "ceval_sample.jsonl", "ceval_dev.jsonl"),
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
    with path.open(encoding="utf-8") as f:
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
        split: ``eval`` (the sampled test/val items) or ``dev`` (few-shot examples).
    """
    b = BENCHMARKS[benchmark]
    by_subject: dict[str, list[dict[str, Any]]] = {}
    for row in _read_jsonl(b.eval_file if split == "eval" else b.dev_file):
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
        raise AutotuneError(f"per_subject {per_subject}: {benchmark} ships {b.max_per_subject} items per subject "
                            f"(use 1..{b.max_per_subject})")
    out = {}
    for subject, items in load_items(benchmark).items():
        picked = sorted(random.Random(f"{seed}:{benchmark}:{subject}").sample(range(len(items)), per_subject))
        out[subject] = [items[i] for i in picked]
    return out
