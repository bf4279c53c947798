"""Studies: a study file prepared, run trial by trial, recorded and summed up.

The modules, in the order a study flows through them (docs/architecture.md):

* ``prepare``: study file -> ``PreparedStudy`` (names resolved, values and settings checked).
* ``admission``: the one judge of whether a configuration can run without launching it.
* ``quality``: each artifact's quality measured once, and the drop against the reference.
* ``prior``: the twin's ranking of what to measure first.
* ``runner``: the loop and signals; ``trial_phase`` the flow of one trial, which fills a
  ``TrialResult`` that ``trial_result.commit`` stores.
* ``records``: what a trial and a study store (one attribute per field; ``schema2_cells`` reads
  the older layout, ``upgrade`` rewrites it).
* ``storage``: opening and checking storages; ``optuna_internals``: every Optuna internal.
* ``summary``: the best trial and the Pareto front.

Import from here or from the module that holds a name: the names below are the public API.
They are loaded when first asked for, not when this package is imported: every module of the
package (``records``, ``storage``) is imported through this file, and an eager import of
``runner`` here would load the whole study machinery for each of them and close a loop through
every module the runner uses that reads records (``autotune.report.text``).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_HOME = {
    "Admission": "admission",
    "Verdict": "admission",
    "PreparedStudy": "prepared",
    "prepare_study": "prepare",
    "resolve_gpu": "prepare",
    "rank_by_prior": "prior",
    "SCHEMA_VERSION": "records",
    "TrialRecord": "records",
    "StudyRunner": "runner",
    "TrialEvent": "runner",
    "judge_for": "judge",
    "make_sampler": "runner",
    "run_study": "runner",
    "mask_url": "storage",
    "open_storage": "storage",
    "StudySummary": "summary",
    "best_trial": "verdict",
    "pareto_front": "summary",
    "summarize": "summary",
    "trial_record": "summary",
}

__all__ = [
    "Admission",
    "PreparedStudy",
    "SCHEMA_VERSION",
    "StudyRunner",
    "StudySummary",
    "TrialEvent",
    "TrialRecord",
    "Verdict",
    "best_trial",
    "judge_for",
    "make_sampler",
    "mask_url",
    "open_storage",
    "pareto_front",
    "prepare_study",
    "rank_by_prior",
    "resolve_gpu",
    "run_study",
    "summarize",
    "trial_record",
]


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    globals()[name] = value  # asked once
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOME))


if TYPE_CHECKING:  # pragma: no cover - what type checkers and IDEs see
    from autotune.study.admission import Admission, Verdict
    from autotune.study.prepare import prepare_study, resolve_gpu
    from autotune.study.prepared import PreparedStudy
    from autotune.study.prior import rank_by_prior
    from autotune.study.records import SCHEMA_VERSION, TrialRecord
    from autotune.study.runner import StudyRunner, TrialEvent, judge_for, make_sampler, run_study
    from autotune.study.storage import mask_url, open_storage
    from autotune.study.summary import StudySummary, pareto_front, summarize, trial_record
    from autotune.study.verdict import best_trial
