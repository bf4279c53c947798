"""Whether a stored study may take more trials: the same card, model and engine builds.

A study's trials are compared with one another (the best, the finish's t-test, the prior's
calibration), so they must have been measured on the same thing. Resuming a V100 study with
``gpu = "t4"`` used to add T4 trials to a study still labelled V100; pyperf likewise refuses
to add runs whose metadata differ (``_CHECKED_METADATA``). What may change between runs: the
budget, the number of trials, the search space within Optuna's rules, the memory budget (it
only decides what is launched, not what a launch measures).

The card and the model come from the study's header (written once, by its first run); the
engine build of each backend from the header where a newer autotune wrote it, else from the
newest trial that recorded one, so studies stored before this check are checked too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

from autotune.errors import ConfigError
from autotune.study import records

if TYPE_CHECKING:  # pragma: no cover
    import optuna

    from autotune.hardware.placement import Placement
    from autotune.study.prepared import PreparedStudy

__all__ = ["ENGINES_ATTR", "check_comparable", "engines_of"]

ENGINES_ATTR = "engines"  # study attribute: backend name -> engine build, as its first run found it


def engines_of(prepared: "PreparedStudy") -> dict[str, str]:
    """The engine build of each backend of the study, as the backend names it."""
    return {
        name: str(entry.backend.engine_build(prepared.contexts.get(name)))
        for name, entry in prepared.space.entries.items()
    }


def _known(version: Any) -> bool:
    # A backend that cannot tell its build ("unknown (...)") cannot be compared; refusing on it
    # would refuse every resume of an engine that names no version.
    return isinstance(version, str) and bool(version) and not version.startswith("unknown")


def _stored_engines(study: "optuna.Study", wanted: Mapping[str, str]) -> dict[str, str]:
    stored = study.user_attrs.get(ENGINES_ATTR)
    if isinstance(stored, Mapping):
        return {str(k): str(v) for k, v in stored.items()}
    found: dict[str, str] = {}
    for t in reversed(study.get_trials(deepcopy=False)):
        engine = records.TrialRecord.of(t).engine or {}
        name, version = engine.get("backend"), engine.get("version")
        if name in wanted and name not in found and _known(version):
            found[name] = version
            if len(found) == len(wanted):
                break
    return found


def check_comparable(study: "optuna.Study", prepared: "PreparedStudy", engines: Mapping[str, str]) -> None:
    """Refuse to add trials to a study measured on another card, model or engine build.

    Args:
        study: The stored study, opened (a new one has no header yet and passes).
        prepared: What this run would measure.
        engines: This run's engine build per backend (``engines_of``).

    Raises:
        ConfigError: naming each difference, stored side and this run's side, and how to
            start a new study instead.
    """
    attrs = study.user_attrs
    if records.SCHEMA_ATTR not in attrs:
        return
    differences = []
    stored_gpu = attrs.get("gpu")
    stored_key = stored_gpu.get("key") if isinstance(stored_gpu, Mapping) else None
    if stored_key is not None and stored_key != prepared.gpu.key:
        differences.append(f"GPU: stored {stored_key!r}, now {prepared.gpu.key!r}")
    differences += _card_differences(attrs.get("placement"), getattr(prepared, "placement", None))
    stored_model = attrs.get("model")
    if isinstance(stored_model, str) and stored_model != prepared.model.key:
        differences.append(f"model: stored {stored_model!r}, now {prepared.model.key!r}")
    for name, version in sorted(_stored_engines(study, engines).items()):
        now = engines.get(name)
        if _known(version) and _known(now) and version != now:
            differences.append(f"{name} engine build: stored {version!r}, now {now!r}")
    if differences:
        raise ConfigError(
            f"study '{prepared.cfg.name}' in {prepared.shown_storage} was measured on something else, and its "
            f"trials would be compared with this run's: {'; '.join(differences)}. Give the study a new [study] "
            "name (or another --storage) to start a new one"
        )


def _card_differences(stored: Any, now: "Placement | None") -> list[str]:
    """A study on several cards compares only with one on the same cards, in the same order:
    a layer split's speed is its slowest card's, and each card's budget bounds its share."""
    stored_keys = [c.get("key") for c in stored.get("cards", [])] if isinstance(stored, Mapping) else []
    now_keys = list(now.keys) if now is not None else []
    if (stored_keys or now_keys) and stored_keys != now_keys:

        def shown(keys: list[Any]) -> str:
            return repr(keys) if keys else "one card ([hardware] gpu)"

        return [f"cards: stored {shown(stored_keys)}, now {shown(now_keys)}"]
    # The budgets may change, as one card's may (they decide what is launched, not what a
    # launch measures).
    return []
