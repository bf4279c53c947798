"""The twin on several cards (plugins/twin/multicard.py): the splits' costs, each card's share,
the catalog's links, the fit to published figures, and a study across two catalog cards."""

from __future__ import annotations

import json

import pytest

from autotune.api import TrialConfig
from autotune._builtin import ConfigError, get_gpu, get_link, host_link, load_links
from autotune_plugins.twin import multicard, multicard_evidence
from autotune_plugins.twin.backend import load_constants

STUDY = """
[study]
name = "two-cards"
seed = 0
sampler = "grid"
n_trials = 40

[hardware]
gpus = {gpus}

[model]
ref = "qwen2.5-32b"

[workload]
prompt_tokens = 512
output_tokens = 128

[[candidates]]
backend = "twin-llama.cpp"
weights = ["gguf:Q8_0"]

[space]
ctx = [4096]
parallel = [4]
flash_attn = [true]
cache_type = ["f16"]
"""


def _run(tmp_path, gpus: str):
    from autotune.config import load_study_config
    from autotune.study import run_study

    path = tmp_path / "study.toml"
    path.write_text(STUDY.format(gpus=gpus))
    return run_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 's.db'}")


def test_a_model_that_fits_neither_card_alone_wins_on_both_and_the_summary_says_why(tmp_path, twin_plugin):
    """Qwen2.5-32B at Q8_0 (~33 GiB) on two 24 GiB cards: one card cannot hold it, so the
    winner splits it, and the explanation names split_mode none as not fitting one card."""
    summary = _run(tmp_path, '["rtx3090", "rtx3090"]')
    best = summary.best
    assert best is not None and best["params"]["split_mode"] in ("layer", "tensor", "row")
    why = summary.extra["why_best"] if "why_best" in summary.extra else json.dumps(summary.extra)
    assert "split_mode none: does not fit: per card, device 0" in why
    assert "split_mode layer: measured score" in why or best["params"]["split_mode"] == "layer"


def test_the_slow_card_bounds_its_stage_of_a_layer_split_and_the_whole_of_a_tensor_split():
    engines, host, _ = load_constants()
    k = engines["llama.cpp"]
    s = multicard_evidence._scenario("tg128")
    fast, slow = get_gpu("rtx3090"), get_gpu("rtx3060-12gb")
    mk = multicard.load_multicard()

    def step(cards, mode):
        split = multicard.split_of(
            TrialConfig("t", "gguf:F16", 512, 1, (("split_mode", mode), ("tensor_split", "1,1"))), cards, "pcie4"
        )
        return multicard.step_seconds(s, k, host, split, mk, 1, 64)[0]

    # Layer split: half the layers on the slow card cost half its one-card time.
    assert step((fast, fast), "layer") < step((fast, slow), "layer") < step((slow, slow), "layer")
    # Tensor split with even shares: the slow card's half bounds every layer.
    assert step((fast, slow), "tensor") == pytest.approx(step((slow, slow), "tensor"), rel=1e-9)


def test_each_cards_share_sums_to_the_total_and_a_layer_split_follows_the_proportions():
    engines, host, _ = load_constants()
    from autotune_plugins.twin import physics

    s = multicard_evidence._scenario("tg128")
    mem = physics.memory(s, engines["llama.cpp"])
    cards = (get_gpu("rtx3090"), get_gpu("rtx3090"))
    for mode, ts in (("layer", "3,1"), ("tensor", "1,1"), ("row", "1,1"), ("none", "1,1")):
        split = multicard.split_of(
            TrialConfig("t", "gguf:F16", 512, 1, (("split_mode", mode), ("tensor_split", ts))), cards, None
        )
        est = multicard.per_device(mem, split, s.weights.per_layer_bytes, s.weights.output_bytes)
        assert sum(est.per_device_bytes) == pytest.approx(est.total_bytes, abs=len(cards))
    layer = multicard.split_of(
        TrialConfig("t", "gguf:F16", 512, 1, (("split_mode", "layer"), ("tensor_split", "3,1"))), cards, None
    )
    est = multicard.per_device(mem, layer, s.weights.per_layer_bytes, 0)
    each = mem.buffers_bytes + mem.overhead_bytes
    layers = sum(s.weights.per_layer_bytes)
    # 12 of the 16 layers (and their KV) on device 0; the 4 others and the head on device 1.
    assert est.per_device_bytes[0] - each == pytest.approx(0.75 * (layers + mem.kv_bytes), rel=1e-6)


def test_exllamav3s_gpu_split_reads_as_proportions_and_tensor_parallel_as_a_tensor_split():
    cards = (get_gpu("rtx3090"), get_gpu("rtx3060-12gb"))
    split = multicard.split_of(
        TrialConfig("t", "exl3:4.0", 512, 1, (("gpu_split", [20, 10]), ("tensor_parallel", True))), cards, None
    )
    assert split.mode == "tensor" and split.shares == pytest.approx((2 / 3, 1 / 3))
    auto = multicard.split_of(TrialConfig("t", "exl3:4.0", 512, 1, (("gpu_split", "auto"),)), cards, None)
    assert auto.mode == "layer" and auto.shares[0] > auto.shares[1]  # by memory: 24 GiB against 12


def test_the_catalog_has_pcie_and_nvlink_links_with_sources_and_an_unknown_one_is_named():
    links = load_links()
    assert {"pcie3", "pcie4", "pcie5", "nvlink"} <= set(links)
    assert links["pcie3"].gb_s < links["pcie4"].gb_s < links["pcie5"].gb_s
    assert all(link.source for link in links.values())
    assert host_link(get_gpu("rtx3090")).key == "pcie4" and host_link(get_gpu("v100-16gb")).key == "pcie3"
    with pytest.raises(ConfigError, match="accepted: pcie3, pcie4"):
        get_link("pcie9")


def test_a_faster_link_makes_a_tensor_split_faster():
    engines, host, _ = load_constants()
    s = multicard_evidence._scenario("pp512")
    cards = (get_gpu("rtx3090"), get_gpu("rtx3090"))
    config = TrialConfig("t", "gguf:F16", 1024, 1, (("split_mode", "tensor"),))
    slow = multicard.prefill_tok_s(
        s, engines["llama.cpp"], host, multicard.split_of(config, cards, "pcie3"), multicard.load_multicard()
    )
    fast = multicard.prefill_tok_s(
        s, engines["llama.cpp"], host, multicard.split_of(config, cards, "nvlink"), multicard.load_multicard()
    )
    assert fast > slow


def test_the_written_constants_are_the_fit_of_the_published_figures():
    """constants.toml's [multicard] is what --fit finds, and the fitted ratios match the published
    ones; the held-out figure is reported, not asserted close (docs/twin.md gives its error)."""
    fitted = multicard_evidence.fit()
    written = multicard.load_multicard()
    assert fitted.sync_us == pytest.approx(written.sync_us, rel=0.02)
    assert fitted.allreduce_efficiency == pytest.approx(written.allreduce_efficiency, rel=0.02)
    for row in multicard_evidence.rows(written):
        if row["role"] == "fit":
            assert row["twin_ratio"] == pytest.approx(row["published_ratio"], rel=0.03)
