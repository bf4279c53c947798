"""A study with no feasible configuration says why, per cause (issue 41, item 4): how many
configurations each cause stopped, with the rule's own reason or the closest miss."""

from __future__ import annotations

import json

from click.testing import CliRunner

from autotune.cli import cli
from autotune.config import load_study_config
from autotune.study import StudyRunner, prepare_study
from tests.fake_backends import FakeBackend, registered, write_study


class Refusing(FakeBackend):
    """Every configuration with mode "big" breaks a rule of its engine."""

    def parameters(self, space):
        from autotune.engine.backend import Param

        return [Param("mode", tuple(space.get("mode", ("plain",))), "a flag", accepted=("plain", "big"))]

    def check(self, config, ctx):
        if config.option("mode") == "big":
            return [f"ubatch {512 * config.parallel} exceeds batch 64: llama.cpp clamps the micro-batch to the batch"]
        return []


def _run(tmp_path, backend, objective=""):
    path = write_study(
        tmp_path / "s.toml",
        backend.name,
        ["w"],
        parallel=(1, 2, 4),
        sampler="grid",
        extra_space='mode = ["plain", "big"]',
    )
    if objective:
        path.write_text(path.read_text().replace("[objective]\n", f"[objective]\n{objective}\n", 1))
    storage = f"sqlite:///{tmp_path / 's.db'}"
    with registered(backend):
        summary = StudyRunner(prepare_study(load_study_config(path), storage=storage), seed=0).run(n_trials=6)
        best = CliRunner().invoke(cli, ["best", "--storage", storage])
        as_json = CliRunner().invoke(cli, ["best", "--storage", storage, "--json"])
    return summary, best.output, json.loads(as_json.output)


def test_every_cause_is_named_with_its_count_and_closest_miss(tmp_path):
    # A per-user floor no configuration reaches, and a rule that refuses half of them.
    summary, text, as_json = _run(tmp_path, Refusing(), "min_per_user_tok_s = 1000.0")
    assert summary.best is None
    lines = as_json["no_feasible"]
    (floor,) = [ln for ln in lines if "per-user speed floor" in ln]
    assert floor.startswith(
        "3 measured configurations broke the per-user speed floor (min_per_user_tok_s); the closest, trial "
    )
    assert "% past it" in floor
    (rule,) = [ln for ln in lines if "not launched" in ln]
    assert rule.startswith("3 not launched: ubatch ") and "exceeds batch 64: llama.cpp clamps" in rule
    for line in lines:  # `best` prints them too
        assert line in text


def test_the_study_command_exits_with_the_causes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = write_study(tmp_path / "s.toml", "fake", ["w"], parallel=(1, 2), sampler="grid")
    path.write_text(path.read_text().replace("[objective]\n", "[objective]\nmin_per_user_tok_s = 1000.0\n", 1))
    with registered(FakeBackend()):
        result = CliRunner().invoke(
            cli, ["study", str(path), "--storage", f"sqlite:///{tmp_path / 'x.db'}", "--trials", "2"]
        )
    assert result.exit_code == 1
    assert "2 measured configurations broke the per-user speed floor" in result.output
    # Each trial's own line says it missed: a figure alone read as a candidate.
    trial_lines = [ln for ln in result.output.splitlines() if ln.startswith("trial ")]
    assert len(trial_lines) == 2 and all(ln.endswith("(infeasible: per_user_below_min)") for ln in trial_lines)


class DenseOnly(FakeBackend):
    """The model is dense: n_cpu_moe other than 0 is refused by a rule naming it, whatever the rest."""

    def parameters(self, space):
        from autotune.engine.backend import Param

        return [
            *super().parameters(space),
            Param("n_cpu_moe", tuple(space.get("n_cpu_moe", (0,))), "experts on the CPU", accepted=("0..",)),
        ]

    def check(self, config, ctx):
        n = config.option("n_cpu_moe", 0)
        return [f"n_cpu_moe {n}: the model is dense (no expert tensors to keep on the CPU)"] if n else []


def test_a_value_no_configuration_can_use_is_refused_once_before_the_search(tmp_path):
    path = write_study(
        tmp_path / "s.toml",
        "fake",
        ["w", "w2"],
        parallel=(1, 2),
        sampler="grid",
        extra_space='mode = ["plain", "fast"]\nn_cpu_moe = [0, 4]',
    )
    backend = DenseOnly()
    with registered(backend):
        prepared = prepare_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 's.db'}")
        summary = StudyRunner(prepared, seed=0).run()
    assert (
        "fake: [space] n_cpu_moe = 4: refused in every configuration of this study: n_cpu_moe 4: the model is "
        "dense (no expert tensors to keep on the CPU)"
    ) in prepared.excluded
    # Said once: no trial of n_cpu_moe 4 was proposed, so none was pruned for it.
    assert summary.n_pruned == 0 and all(c.option("n_cpu_moe") == 0 for c in backend.calls)
    assert summary.best is not None


def test_a_key_with_no_usable_value_leaves_nothing_to_search(tmp_path):
    from autotune.errors import ConfigError
    import pytest

    path = write_study(
        tmp_path / "s.toml", "fake", ["w"], parallel=(1, 2), sampler="grid", extra_space="n_cpu_moe = [4]"
    )
    with registered(DenseOnly()), pytest.raises(ConfigError) as err:
        prepare_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 's.db'}")
    assert "nothing in the search space can run" in str(err.value)
    assert "n_cpu_moe = 4: refused in every configuration of this study: n_cpu_moe 4: the model is dense" in str(
        err.value
    )


class OddNeedsTwo(FakeBackend):
    def parameters(self, space):
        from autotune.engine.backend import Param

        return [Param("mode", tuple(space.get("mode", ("plain",))), "a flag", accepted=("plain", "odd"))]

    def check(self, config, ctx):
        return ["mode odd needs two slots"] if config.option("mode") == "odd" and config.parallel == 1 else []


def test_a_value_refused_only_with_some_slots_stays_in_the_space(tmp_path):
    path = write_study(
        tmp_path / "s.toml", "fake", ["w"], parallel=(1, 2), sampler="grid", extra_space='mode = ["plain", "odd"]'
    )
    with registered(OddNeedsTwo()):
        prepared = prepare_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 's.db'}")
    assert not any("mode" in line for line in prepared.excluded)
    (mode,) = [p for e in prepared.space.entries.values() for p in e.params if p.name == "mode"]
    assert mode.choices == ("plain", "odd")
