"""llama-server's speculative decoding as search dimensions: conditional parameters (a draft's
length exists only when speculation is on), the engine's refusals, the flags, the acceptance
counters, and the draft's memory against llama.cpp's own start-up log."""

from __future__ import annotations

import optuna
import pytest

from autotune.engine.acceptance import Acceptance, DraftCount, total
from autotune.engine.backend import TrialConfig
from autotune.engine.space import BackendSpace, SearchSpace
from autotune.study.sampling import ScreenedSampler
from autotune_plugins.llama_server import speculation
from autotune_plugins.llama_server.backend import LlamaServerBackend
from tests.engine_fixtures import STORIES

SPACE = {
    "cache_type": ["f16"],
    "flash_attn": [True],
    "spec_type": ["none", "draft-simple", "ngram-mod"],
    "spec_n_max": [2, 4],
    "spec_n_min": [0, 3],
    "spec_ngram_n": [4, 8],
    "draft": ["d.gguf"],
}


def _space() -> SearchSpace:
    backend = LlamaServerBackend()
    params = tuple(p for p in backend.parameters(SPACE) if p.choices)
    return SearchSpace([BackendSpace(backend, ("w.gguf",), (256,), (1, 2), params)])


def test_the_spec_types_are_the_builds_own():
    # this build's `llama-server --help`, --spec-type (common/speculative.cpp's name map)
    assert speculation.SPEC_TYPES[0] == "none" and "draft-mtp" in speculation.SPEC_TYPES
    assert set(speculation.DRAFT_MODEL_TYPES) < set(speculation.SPEC_TYPES)
    assert "draft-mtp" not in speculation.DRAFT_MODEL_TYPES  # MTP runs the target's own layers


def test_a_draft_length_is_drawn_only_where_speculation_uses_it():
    space = _space()
    configs = list(space.enumerate())
    # none: 1; draft-simple: n_max 2 x n_min 2 x draft 1; ngram-mod: its lookup 2 -- times 2 slots
    assert len(configs) == space.entries["llama-server"].size == (1 + 4 + 2) * 2
    assert len({c.key for c in configs}) == len(configs)
    none = [c for c in configs if c.option("spec_type") == "none"]
    assert all(c.option("spec_n_max") is None and c.option("draft") is None for c in none)
    ngram = [c for c in configs if c.option("spec_type") == "ngram-mod"]
    assert all(c.option("spec_ngram_n") in (4, 8) and c.option("spec_n_max") is None for c in ngram)
    for config in configs:  # every configuration round-trips through Optuna's parameters
        assert space.suggest(optuna.trial.FixedTrial(space.params_of(config))) == config


def test_the_sampler_proposes_only_active_parameters():
    space = _space()
    sampler = ScreenedSampler(optuna.samplers.RandomSampler(seed=1), space, lambda c: True, lambda: set(), seed=1)
    study = optuna.create_study(sampler=sampler)
    for _ in range(12):
        trial = study.ask()
        config = space.suggest(trial)
        study.tell(trial, 1.0)
        assert ("llama-server.spec_n_max" in trial.params) == (config.option("spec_type") == "draft-simple")


def _config(**options) -> TrialConfig:
    return TrialConfig("llama-server", "w.gguf", 256, 1, tuple(sorted(options.items())))


def test_the_engines_refusals(tmp_path):
    check = lambda c, synth={}: speculation.check(c, None, STORIES, lambda w: STORIES, synth)  # noqa: E731
    assert any("needs" in r or "loads a draft model" in r for r in check(_config(spec_type="draft-simple")))
    assert any("only by" in r for r in check(_config(spec_type="ngram-mod", draft="d.gguf")))
    assert any("no nextn" in r for r in check(_config(spec_type="draft-mtp")))  # stories260K has no MTP layers
    assert any("split_mode tensor" in r for r in check(_config(spec_type="draft-mtp", split_mode="tensor")))
    assert any(
        "spec_n_min 4 > spec_n_max 2" in r
        for r in check(_config(spec_type="draft-simple", draft="d", spec_n_max=2, spec_n_min=4))
    )
    assert any(
        "[1, 3]" in r
        for r in check(_config(spec_type="draft-simple", draft="d", spec_n_max=2), {"spec_synth_len": 3.5})
    )
    assert any(
        "has 3 values" in r
        for r in check(_config(spec_type="draft-simple", draft="d", spec_n_max=2), {"spec_synth_rates": "0.9,0.8,0.7"})
    )
    assert check(_config(spec_type="draft-simple", draft="d", spec_n_max=4, spec_n_min=2)) == []
    assert check(_config(spec_type="ngram-mod", spec_ngram_n=4)) == []


def test_the_flags_are_the_builds():
    cfg = _config(
        spec_type="draft-simple",
        draft="d.gguf",
        spec_n_max=4,
        spec_p_min=0.5,
        draft_cache_type="q8_0",
        draft_gpu_layers="all",
    )
    assert speculation.flags(cfg, lambda w: f"/m/{w}", {"spec_synth_len": 2.5}) == [
        "--spec-type",
        "draft-simple",
        "-md",
        "/m/d.gguf",
        "--spec-draft-n-max",
        "4",
        "--spec-draft-p-min",
        "0.5",
        "-ngld",
        "all",
        "-ctkd",
        "q8_0",
        "-ctvd",
        "q8_0",
        "--spec-synth-len",
        "2.5",
    ]
    assert speculation.flags(_config(spec_type="ngram-simple", spec_ngram_n=6), str, {}) == [
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        "6",
    ]
    assert speculation.flags(_config(spec_type="none", spec_n_max=4), str, {}) == []


def test_acceptance_sums_the_engines_counters_and_refuses_a_fiction():
    acc = total([DraftCount(24, 24, 32), DraftCount(10, 4, 16), DraftCount(0, 0, 16)])
    assert (acc.requests, acc.drafted, acc.accepted, acc.generated) == (3, 34, 28, 64)
    assert acc.rate == pytest.approx(28 / 34) and acc.tokens_per_pass is None
    assert Acceptance.from_dict(acc.to_dict()) == acc
    assert total([DraftCount(0, 0, 16)]).rate is None  # nothing drafted: no rate, not a rate of 0
    assert total([DraftCount(4, 2, 8, passes=2)]).tokens_per_pass == 2.0
    with pytest.raises(ValueError, match="3 accepted of 2 drafted"):
        total([DraftCount(2, 3, 8)])


def _study_file(tmp_path, draft: str, space: str) -> object:
    from tests.engine_fixtures import write_llama_study

    path = write_llama_study(tmp_path / "s.toml", space=space)
    text = path.read_text().replace(f'weights = ["{STORIES}"]', f'weights = ["{STORIES}"]\ndraft = {draft}', 1)
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "draft, space, expected",
    [
        (
            '"d.gguf"',
            'spec_type = ["draft-simple"]',
            r"\[candidates.0\] draft = 'd.gguf': must be a list; a list of draft weights",
        ),
        ('[""]', 'spec_type = ["draft-simple"]', r"\[candidates.0\] draft .*non-empty strings"),
        ('["missing.gguf"]', 'spec_type = ["draft-simple"]', r"\[candidates.0\] draft 'missing.gguf': .*missing.gguf"),
        ('["gguf:Q9_9"]', 'spec_type = ["draft-simple"]', r"\[candidates.0\] draft 'gguf:Q9_9'"),
        (f'["{STORIES}"]', "", r"\[candidates.0\] draft: backend 'llama-server' searches no draft weights"),
    ],
)
def test_a_bad_draft_is_named_with_its_field(tmp_path, monkeypatch, draft, space, expected):
    import autotune_plugins.llama_server as llama_server
    from autotune.config import load_study_config
    from autotune.errors import ConfigError
    from autotune.study import prepare_study
    from tests.conftest import plugin_registered

    monkeypatch.setattr("autotune_plugins.llama_server.backend.LlamaServerBackend.preflight", lambda self, ctx: [])
    with plugin_registered(llama_server, "llama_server"), pytest.raises(ConfigError, match=expected) as err:
        prepare_study(load_study_config(_study_file(tmp_path, draft, space)), storage=f"sqlite:///{tmp_path}/s.db")
    assert "s.toml" in str(err.value)
