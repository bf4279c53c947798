"""The one module that reaches into Optuna's private API was written for one Optuna release."""

from __future__ import annotations

import re
from pathlib import Path

import optuna

from autotune.study import optuna_internals

ROOT = Path(__file__).resolve().parent.parent
PRIVATE = re.compile(
    r"optuna\.\w+(\.\w+)*\._|_rdb\b|_cached_frozen_trial|_CONSTRAINTS_KEY|NOTE_CHUNK|"
    r"\._storage\b|\._study_id\b|\._trial_id\b|_get_trials\(|def _sample\("
)


def test_the_installed_optuna_is_the_one_the_adapter_was_written_for():
    # Changed Optuna: read study/optuna_internals.py against the new release, then move the pin.
    assert optuna.__version__ == optuna_internals.OPTUNA_VERSION, (
        f"optuna {optuna.__version__} is installed; study/optuna_internals.py was checked against "
        f"{optuna_internals.OPTUNA_VERSION}"
    )


def test_no_other_module_reaches_into_optuna():
    found = [
        f"{p.relative_to(ROOT)}:{n}: {line.strip()}"
        for base in ("autotune", "plugins")
        for p in sorted((ROOT / base).rglob("*.py"))
        if p.name != "optuna_internals.py"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if PRIVATE.search(line)
    ]
    assert found == []
