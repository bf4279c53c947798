"""The study's judge: admission (``study/admission.py``) with what its storage has learned.

Everything that asks "can this configuration run, does it fit" about a stored study (the
runner, the prior, ``autotune estimate --study``, the report's "why not a neighbour") builds its
judge here, so they weigh memory with the same learned correction and quality with the same
cached values.
"""

from __future__ import annotations

import optuna

from autotune.study import records
from autotune.study.admission import Admission
from autotune.study.prepared import PreparedStudy
from autotune.study.quality import QualityBook
from autotune.study.records import TrialState

__all__ = ["judge_for", "learned_residuals"]


def learned_residuals(study: optuna.Study) -> dict[str, list[int]]:
    """Measured - predicted peak bytes by backend, as the study stored them (so a resumed
    study, the prior and the report judge memory as the runner does)."""
    found: dict[str, list[int]] = {}
    for r in records.records(study, (TrialState.COMPLETE,)):
        if r.vram_residual_bytes is not None and r.config:
            found.setdefault(str(r.config.get("backend")), []).append(int(r.vram_residual_bytes))
    return found


def judge_for(prepared: PreparedStudy, study: optuna.Study | None) -> Admission:
    """The study's judge, with what its storage learned (memory corrections, quality values)."""
    book = QualityBook(prepared, study) if prepared.quality is not None else None
    return Admission(
        prepared.space,
        prepared.contexts,
        prepared.cfg.objective,
        book,
        learned_residuals(study) if study is not None else None,
    )
