"""The search space's parameter names: the knobs every backend shares have one name across
backends (so plots and the sampler compare them), and a version-1 storage is refused until
``autotune storage upgrade`` renames its parameters."""

from __future__ import annotations

import optuna
import pytest
from click.testing import CliRunner

from autotune.cli import cli, default_study_path
from autotune.config import load_study_config
from autotune.errors import StorageError
from autotune.report.text import load_study
from autotune.engine.space import NotOffered
from autotune.study import prepare_study, records
from tests.conftest import plugin_registered


@pytest.fixture(scope="module")
def twin_space(tmp_path_factory):
    import autotune_plugins.twin as twin

    with plugin_registered(twin, "twin"):
        return prepare_study(
            load_study_config(default_study_path()), storage=f"sqlite:///{tmp_path_factory.mktemp('s')}/s.db"
        ).space


def test_shared_knobs_have_one_name_and_the_union_of_choices(twin_space):
    dists = twin_space.distributions()
    assert {"ctx", "parallel", "flash_attn", "kv_bits"} <= set(dists)
    assert not [n for n in dists if n.endswith((".ctx", ".parallel", ".flash_attn", ".cache_type"))]
    # ExLlamaV2 has a 6-bit cache, llama.cpp has not: the shared name holds both engines' values.
    assert dists["kv_bits"] == (4, 6, 8, 16)
    assert {n for n in dists if "." in n} == {"twin-exllamav2.weights", "twin-llama.cpp.weights"}


def test_every_configuration_round_trips_through_its_parameters(twin_space):
    configs = list(twin_space.enumerate())
    assert len(configs) == twin_space.size
    for config in configs:
        params = twin_space.params_of(config)
        trial = optuna.trial.FixedTrial(params)
        assert twin_space.suggest(trial) == config
    llama = next(c for c in configs if c.backend == "twin-llama.cpp" and c.option("cache_type") == "q8_0")
    assert twin_space.params_of(llama)["kv_bits"] == 8


def test_a_shared_value_the_backend_lacks_is_refused_by_name(twin_space):
    params = twin_space.params_of(next(c for c in twin_space.enumerate() if c.backend == "twin-llama.cpp"))
    params["kv_bits"] = 6
    with pytest.raises(NotOffered, match=r"twin-llama.cpp.*kv_bits = 6.*offers 16, 8, 4"):
        twin_space.suggest(optuna.trial.FixedTrial(params))


def _v1_storage(path) -> str:
    """A study as autotune schema 1 stored it: every parameter named per backend."""
    url = f"sqlite:///{path}"
    study = optuna.create_study(storage=url, study_name="old", direction="maximize")
    study.set_user_attr(records.SCHEMA_ATTR, 1)
    C = optuna.distributions.CategoricalDistribution
    for n, (cache, par) in enumerate([("f16", 1), ("q8_0", 4), ("q4_0", 2)]):
        study.add_trial(
            optuna.trial.create_trial(
                params={
                    "backend": "llama-server",
                    "llama-server.ctx": 4096,
                    "llama-server.parallel": par,
                    "llama-server.cache_type": cache,
                    "llama-server.flash_attn": True,
                    "llama-server.weights": "m.gguf",
                },
                distributions={
                    "backend": C(["llama-server"]),
                    "llama-server.ctx": C([4096]),
                    "llama-server.parallel": C([1, 2, 4]),
                    "llama-server.cache_type": C(["f16", "q8_0", "q4_0"]),
                    "llama-server.flash_attn": C([True]),
                    "llama-server.weights": C(["m.gguf"]),
                },
                value=10.0 + n,
                user_attrs={"config": {"backend": "llama-server", "cache_type": cache, "parallel": par}},
            )
        )
    return url


def test_a_version_1_study_is_refused_then_upgraded_in_place(tmp_path, engine_plugins):
    # The upgrade names a cache by its bits as the installed backends declare them (llama-server here).
    url = _v1_storage(tmp_path / "old.db")
    with pytest.raises(StorageError, match="schema version 1.*autotune storage upgrade"):
        load_study(url)
    result = CliRunner().invoke(cli, ["storage", "upgrade", url], obj={})
    assert result.exit_code == 0, result.output
    assert "schema 1 -> 3" in result.output and "kv_bits" in result.output
    study = load_study(url)
    for t in study.trials:
        config = t.user_attrs["config"]
        assert t.params["parallel"] == config["parallel"]
        assert t.params["kv_bits"] == {"f16": 16, "q8_0": 8, "q4_0": 4}[config["cache_type"]]
        assert "llama-server.ctx" not in t.params and t.params["llama-server.weights"] == "m.gguf"
    assert [t.value for t in study.trials] == [10.0, 11.0, 12.0]
    again = CliRunner().invoke(cli, ["storage", "upgrade", url], obj={})
    assert "left as it is" in again.output


def test_upgrading_a_journal_is_refused_with_the_way_out(tmp_path):
    result = CliRunner().invoke(cli, ["storage", "upgrade", f"journal:{tmp_path}/j.log"], obj={})
    assert result.exit_code == 2 and "copy the study into SQLite" in result.output
