"""Studies: a study file prepared, run trial by trial, recorded and summed up.

The modules, in the order a study flows through them (docs/architecture.md):

* ``prepare``: study file -> ``PreparedStudy`` (names resolved, values and settings checked).
* ``admission``: the one judge of whether a configuration can run without launching it.
* ``quality``: each artifact's quality measured once, and the drop against the reference.
* ``prior``: the twin's ranking of what to measure first.
* ``runner``: the loop, signals and the flow of one trial.
* ``records``: what a trial and a study store (the one writer and reader).
* ``storage``: opening and checking storages; every Optuna internal.
* ``summary``: the best trial and the Pareto front.
"""

from autotune.study.admission import Admission, Verdict
from autotune.study.prepare import PreparedStudy, prepare_study, resolve_gpu
from autotune.study.prior import rank_by_prior
from autotune.study.records import SCHEMA_VERSION, TrialRecord
from autotune.study.runner import StudyRunner, TrialEvent, judge_for, make_sampler, run_study
from autotune.study.storage import mask_url, open_storage
from autotune.study.summary import StudySummary, best_trial, pareto_front, summarize, trial_record

__all__ = [
    "Admission", "PreparedStudy", "SCHEMA_VERSION", "StudyRunner", "StudySummary", "TrialEvent", "TrialRecord",
    "Verdict", "best_trial", "judge_for", "make_sampler", "mask_url", "open_storage", "pareto_front",
    "prepare_study", "rank_by_prior", "resolve_gpu", "run_study", "summarize", "trial_record",
]
