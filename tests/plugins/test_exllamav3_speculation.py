"""exllamav3's speculative decoding without a GPU: the space, the rules, the draft's memory, the
TabbyAPI deploy keys, the counters through the fake worker and the real worker's counting."""

from __future__ import annotations

import json
import sys
from dataclasses import replace

import pytest

from autotune.engine.backend import TrialConfig
from autotune.modelfiles.models import model_from_hf_config
from autotune.engine.space import ConditionalParam
from tests.plugins.test_exllamav3_backend import CONFIG, FAKE, make_ctx, write_exl3

from autotune_plugins.exllamav3 import memory, speculation
from autotune_plugins.exllamav3.backend import ExLlamaV3Backend, tabbyapi_args
from autotune_plugins.exllamav3.generator_settings import GeneratorSettings
from autotune_plugins.exllamav3.worker import CountingGenerator, DraftCounter

# A smaller draft of the same vocabulary: 2 layers of hidden 64 (write_exl3's tensors are of
# hidden 128, so its weights are those bytes; only the config's shape sizes its cache).
DRAFT = {**CONFIG, "hidden_size": 64, "num_key_value_heads": 1, "num_attention_heads": 2}


@pytest.fixture
def dirs(tmp_path):
    write_exl3(tmp_path / "tiny-exl3-4.0")
    write_exl3(tmp_path / "tiny-draft", DRAFT)
    return tmp_path


def cfg(**options) -> TrialConfig:
    return TrialConfig(
        "exllamav3",
        "tiny-exl3-4.0",
        options.pop("ctx", 510),
        options.pop("parallel", 2),
        (("cache_type", "fp16"), *options.items()),
    )


def test_the_space_draws_the_draft_options_only_for_the_modes_that_read_them():
    params = {
        p.name: p
        for p in ExLlamaV3Backend().parameters(
            {
                "spec_type": ["none", "draft", "ngram", "eagle"],
                "draft": ["d1", ""],
                "spec_n_max": [2, 4, 0],
                "spec_ngram_n": [2, 3],
                "draft_cache_type": ["fp16", "K8V8", "q8"],
            }
        )
    }
    assert params["spec_type"].choices == ("none", "draft", "ngram")  # eagle is no exllamav3 mode
    assert not isinstance(params["spec_type"], ConditionalParam)
    assert params["draft"].choices == ("d1",) and params["draft"].parent_values == ("draft",)
    assert params["spec_n_max"].choices == (2, 4) and set(params["spec_n_max"].parent_values) == {
        "draft",
        "mtp",
        "ngram",
    }
    assert params["spec_ngram_n"].parent_values == ("ngram",)
    assert params["draft_cache_type"].choices == ("fp16", "K8V8") and params["draft_cache_type"].parent_values == (
        "draft",
        "mtp",
    )
    assert [p.name for p in ExLlamaV3Backend().parameters({})] == ["cache_type"]  # no spec_type: no speculation
    assert set(speculation.KEYS) <= {p.name for p in ExLlamaV3Backend().search_dimensions()}


def test_the_rules_refuse_what_exllamav3_and_tabbyapi_refuse(dirs):
    b, c = ExLlamaV3Backend(), make_ctx(dirs)
    model = c.model
    assert any("has no draft weights" in r for r in b.check_config(cfg(spec_type="draft"), c, model))
    assert any(
        "loaded only by spec_type draft" in r
        for r in b.check_config(cfg(spec_type="ngram", draft="tiny-draft"), c, model)
    )
    assert any("Qwen2ForCausalLM declares no MTP layers" in r for r in b.check_config(cfg(spec_type="mtp"), c, model))
    assert b.check_config(cfg(spec_type="draft", draft="tiny-draft", spec_n_max=3), c, model) == []
    assert any(
        r.startswith("draft: ") and "no-such" in r
        for r in b.check_config(cfg(spec_type="draft", draft="no-such"), c, model)
    )
    qwen35 = {"architectures": ["Qwen3_5ForConditionalGeneration"], "text_config": {"mtp_num_hidden_layers": 1}}
    assert speculation.mtp_layers(qwen35) == 1 and speculation.check(cfg(spec_type="mtp"), qwen35, None, model) == []
    assert speculation.mtp_layers({**qwen35, "text_config": {"mtp_num_hidden_layers": 0}}) == 0
    assert any(
        "vocabulary 1000 is not the target's 512" in r
        for r in speculation.check(cfg(spec_type="draft", draft="x"), None, replace(model, vocab_size=1000), model)
    )


def test_the_draft_window_widens_every_jobs_pages_and_the_draft_adds_its_weights_and_cache(dirs):
    b, c = ExLlamaV3Backend(), make_ctx(dirs)
    plain = b.generator_settings(cfg(), c)
    spec = b.generator_settings(cfg(spec_type="draft", draft="tiny-draft", spec_n_max=4, draft_cache_type="k8v8"), c)
    # job.py: a job reserves max_new_tokens + 1 + max_draft_tokens: 510 + 1 fits 2 pages, 515 needs 3.
    assert (plain.cache_tokens, spec.cache_tokens) == (2 * 2 * 256, 2 * 3 * 256) and spec.jobs_at_once == 2
    assert (spec.draft_tokens, spec.draft_dir) == (4, str(dirs / "tiny-draft"))
    base = b.estimate_memory(cfg(spec_type="none"), c)
    with_spec = b.estimate_memory(cfg(spec_type="draft", draft="tiny-draft", spec_n_max=4, draft_cache_type="k8v8"), c)
    target_only = memory.estimate_for(
        c.model, memory.exl3_dir_weights(dirs / "tiny-exl3-4.0", True), spec, c.workload.prompt_tokens
    )
    draft = model_from_hf_config(dirs / "tiny-draft")
    draft_w = memory.exl3_dir_weights(dirs / "tiny-draft", True)
    assert with_spec.weights_bytes == target_only.weights_bytes + draft_w.gpu_bytes
    assert with_spec.kv_bytes == target_only.kv_bytes + memory.cache_bytes(draft, 8, 8, spec.cache_tokens)
    assert with_spec.kv_bytes > base.kv_bytes and any("draft tiny-draft" in n for n in with_spec.notes)
    # n-gram drafting holds no model: only the window's pages grow
    ngram = b.estimate_memory(cfg(spec_type="ngram", spec_n_max=4), c)
    assert ngram.weights_bytes == base.weights_bytes and ngram.kv_bytes > base.kv_bytes


def test_the_deploy_line_carries_tabbyapis_draft_model_keys(dirs):
    b, c = ExLlamaV3Backend(), make_ctx(dirs)
    line = b.deploy_command(cfg(spec_type="draft", draft="tiny-draft", spec_n_max=3, draft_cache_type="k8v8"), c)
    assert (
        f"--draft-mode model --draft-num-tokens 3 --draft-model-dir {dirs} --draft-model-name tiny-draft "
        "--draft-cache-mode 8,8"
    ) in line and "+ 3 drafted" in line
    ngram = b.deploy_command(cfg(spec_type="ngram", spec_ngram_n=3), c)
    assert "--draft-mode ngram --draft-num-tokens 4 --ngram-match-min 3" in ngram and "--draft-model" not in ngram
    assert "--draft-mode mtp --draft-num-tokens 4 --draft-cache-mode FP16" in b.deploy_command(cfg(spec_type="mtp"), c)
    assert "--draft" not in b.deploy_command(cfg(spec_type="none"), c) and "--draft" not in b.deploy_command(cfg(), c)


def test_a_speculating_trial_stores_the_workers_draft_counters_as_its_acceptance(dirs, monkeypatch):
    requests = dirs / "requests.jsonl"
    monkeypatch.setenv("EXL3_FAKE_REQUESTS", str(requests))
    b, c = ExLlamaV3Backend(), make_ctx(dirs, worker_command=[sys.executable, str(FAKE), "ok"])
    config = cfg(spec_type="draft", draft="tiny-draft", spec_n_max=4)
    m = b.run(config, c)
    (load,) = [r for r in map(json.loads, requests.read_text().splitlines()) if r["op"] == "load"]
    s = GeneratorSettings.from_dict(load["settings"])
    assert (s.spec_type, s.draft_tokens, s.draft_dir) == ("draft", 4, str(dirs / "tiny-draft"))
    assert " ".join(tabbyapi_args(s, dirs / "tiny-exl3-4.0")) in b.deploy_command(config, c)
    n = len([r for r in map(json.loads, requests.read_text().splitlines()) if r["op"] == "sample"])
    acc = m.attrs["acceptance"]  # the fake: 3 requests of 16 tokens a sample, 2 drafted per token, half accepted
    assert (acc["requests"], acc["drafted"], acc["accepted"], acc["rate"]) == (3 * n, 96 * n, 48 * n, 0.5)
    assert "acceptance" not in b.run(cfg(), c).attrs


def test_the_worker_sums_the_generators_own_counters_over_finished_jobs():
    results = [
        [{"stage": "streaming", "eos": False, "identifier": 0}],
        [
            {
                "stage": "streaming",
                "eos": True,
                "new_tokens": 10,
                "accepted_draft_tokens": 6,
                "rejected_draft_tokens": 10,
            },
            {"stage": "prefill"},
        ],
        [{"stage": "streaming", "eos": True, "new_tokens": 5}],
    ]  # no SD keys: not counted

    class Gen:
        def iterate(self):
            return results.pop(0)

    counter = DraftCounter()
    gen = CountingGenerator(Gen(), counter)
    for _ in range(3):
        gen.iterate()
    assert counter.to_dict() == {"requests": 1, "drafted": 16, "accepted": 6, "generated": 10}


def test_the_worker_builds_the_drafter_tabbyapi_builds():
    from autotune_plugins.exllamav3.generator_settings import generator_settings
    from autotune_plugins.exllamav3.worker import Engine

    made = []

    class Model:
        @staticmethod
        def from_config(config, component="text"):
            made.append(("model", config, component))
            return "draft-model"

    class Config:
        @staticmethod
        def from_directory(d):
            return f"config of {d}"

    def cache(model, **kw):
        made.append(("cache", model, kw))
        return "draft-cache"

    def build(**spec):
        made.clear()
        s = generator_settings("fp16", 510, 2, **spec)
        return Engine()._drafter(s, "target config", Config, Model, cache, "fp16-layer", "quant-layer"), list(made)

    (pair, calls) = build(spec_type="draft", draft_tokens=3, draft_cache_type="k8v6", draft_dir="/m/d")
    assert pair == ("draft-model", "draft-cache") and calls[0] == ("model", "config of /m/d", "text")
    assert calls[1] == (
        "cache",
        "draft-model",
        {
            "max_num_tokens": 2 * 3 * 256,
            "max_batch_size": 2,
            "max_history": 3,
            "layer_type": "quant-layer",
            "k_bits": 8,
            "v_bits": 6,
        },
    )
    (pair, calls) = build(spec_type="mtp", draft_tokens=2)
    assert calls[0] == ("model", "target config", "mtp") and calls[1][2]["layer_type"] == "fp16-layer"
    assert build(spec_type="ngram", draft_tokens=4, ngram_match_min=2) == ((None, None), [])
