"""``autotune storage upgrade``: rewrite a storage an older autotune wrote to this one's schema.

Schema 1 -> 2 renames the parameters every backend shares (``<backend>.ctx`` -> ``ctx``, space.py);
schema 2 -> 3 stores each of a trial's fields as one attribute holding its whole value, where
schema 2 had cut long values into 72-column parts (study/schema2_cells.py), and adds the flat
columns (``records.FLAT``). A version-1 study takes both steps. Trial numbers, states, values,
parameters and constraints are untouched by the second, so a study's records read the same.

Optuna has no public way to rename a parameter or delete an attribute of a finished trial, so
this rewrites the rows in SQL, in one transaction per study and step. Journal storages are
refused (an append-only log).
"""

from __future__ import annotations

import json

import optuna
import sqlalchemy

from autotune.errors import StorageError
from autotune.toolkit.redact import mask_url
from autotune.engine.space import canonical_order, dimension_of
from autotune.study import optuna_internals, records, schema2_cells
from autotune.study.storage import _check_file, open_storage, study_names


def upgrade(url: str) -> list[str]:
    """Bring every study of the storage at ``url`` to ``records.SCHEMA_VERSION``, in place.

    Returns:
        One line per study: what was rewritten, or why it was left alone.

    Raises:
        StorageError: not an RDB storage, or no such database.
    """
    shown = mask_url(url)
    if url.startswith("journal:"):
        raise StorageError(
            f"storage {shown}: a journal file cannot be upgraded in place; copy the study into "
            "SQLite first (optuna.copy_study) and upgrade that"
        )
    _check_file(url, url.split(":///", 1)[1] if url.startswith("sqlite:") and ":///" in url else "", writable=True)
    store = open_storage(url, create=False)  # it rewrites a database, never creates one
    engine = getattr(store, "engine", None)
    assert engine is not None
    done = []
    for name in study_names(store, shown):
        study = optuna.load_study(study_name=name, storage=store)
        version = study.user_attrs.get(records.SCHEMA_ATTR)
        if version not in records.UPGRADABLE | records.READ_ONLY:
            done.append(f"{name}: schema {version!r}, left as it is")
            continue
        steps = []
        if version in records.UPGRADABLE:
            steps.append(_shared_names(engine, optuna_internals.study_id_of(study)))
            study.set_user_attr(records.SCHEMA_ATTR, 2)
        steps.append(_whole_fields(engine, optuna_internals.study_id_of(study)))
        study.set_user_attr(records.SCHEMA_ATTR, records.SCHEMA_VERSION)
        done.append(f"{name}: schema {version} -> {records.SCHEMA_VERSION}, " + "; ".join(steps))
    return done


def _shared_names(engine: sqlalchemy.engine.Engine, sid: int) -> str:
    """Schema 1 -> 2: each ``<backend>.<name>`` parameter of a shared knob renamed to the shared
    name, every shared name with the union of its backends' choices (one distribution per
    name); ``param_value`` is the index of the choice, recomputed for the new choices."""
    from optuna.distributions import CategoricalDistribution, distribution_to_json, json_to_distribution

    with engine.begin() as conn:
        rows = conn.execute(
            sqlalchemy.text(
                "SELECT p.param_id, p.trial_id, p.param_name, p.param_value, p.distribution_json FROM trial_params p "
                "JOIN trials t ON t.trial_id = p.trial_id WHERE t.study_id = :sid"
            ),
            {"sid": sid},
        ).all()
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
            conn.execute(
                sqlalchemy.text(
                    "UPDATE trial_params SET param_name = :n, param_value = :v, distribution_json = :d "
                    "WHERE param_id = :id"
                ),
                {"n": new_name, "v": dist.to_internal_repr(new_value), "d": distribution_to_json(dist), "id": param_id},
            )
    names = sorted(n for n in choices if "." not in n and n != "backend")
    return (
        f"{len(rows)} parameters of {len({r[1] for r in rows})} trials renamed; shared names: "
        f"{', '.join(names) or '(none)'}"
    )


def _whole_fields(engine: sqlalchemy.engine.Engine, sid: int) -> str:
    """Schema 2 -> 3: each trial's user attributes replaced by its fields, each whole (joined
    from its parts by the schema-2 reader), and their flat columns; the parts, their markers
    and schema 2's flat copies of every metric go."""
    before = after = 0
    with engine.begin() as conn:
        rows = conn.execute(
            sqlalchemy.text(
                "SELECT a.trial_id, a.key, a.value_json FROM trial_user_attributes a "
                "JOIN trials t ON t.trial_id = a.trial_id WHERE t.study_id = :sid"
            ),
            {"sid": sid},
        ).all()
        by_trial: dict[int, dict[str, object]] = {}
        for trial_id, key, value_json in rows:
            by_trial.setdefault(trial_id, {})[key] = json.loads(value_json)
        for trial_id, attrs in by_trial.items():
            fields = {name: schema2_cells.joined(attrs, name) for name in records.STORED if name in attrs}
            new = records.attributes(fields)
            before += len(attrs)
            after += len(new)
            conn.execute(sqlalchemy.text("DELETE FROM trial_user_attributes WHERE trial_id = :t"), {"t": trial_id})
            if new:
                conn.execute(
                    sqlalchemy.text(
                        "INSERT INTO trial_user_attributes (trial_id, key, value_json) VALUES (:t, :k, :v)"
                    ),
                    [{"t": trial_id, "k": k, "v": json.dumps(v)} for k, v in new.items()],
                )
    return f"{before} attribute rows of {len(by_trial)} trials -> {after}, each field whole"
