"""exllamav3 across several cards (plugins/exllamav3/split.py, memory.per_card): the rules read in
exllamav3 1.6.5, each card's share under a layer split and a tensor-parallel split, TabbyAPI's
keys on the deploy line, the worker's load arguments, and the twin agreeing with the backend."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import get_model
from autotune.hardware.placement import CardsRequest, check_cards, resolve_placement
from autotune_plugins.exllamav3 import split
from autotune_plugins.exllamav3.backend import ExLlamaV3Backend
from autotune_plugins.exllamav3.generator_settings import generator_settings
from autotune_plugins.exllamav3.worker import AUTOSPLIT_RESERVE_GB, split_load_args

GiB = 2**30
FAKE = Path(__file__).with_name("exllamav3_fake_worker.py")
FAST = Protocol(warmup_runs=1, min_runs=2, max_runs=3, rel_spread_tol=0.5)


def ctx_of(
    tmp_path: Path, *cards: str, budget_gib: float | None = None, model: str = "qwen2.5-32b", **settings
) -> StudyContext:
    placement = resolve_placement(CardsRequest(tuple(cards), (budget_gib,), (0.0,))) if len(cards) > 1 else None
    return StudyContext(
        gpu=get_gpu(cards[0]),
        model=get_model(model),
        workload=Workload(prompt_tokens=512, output_tokens=128),
        vram_budget_bytes=int((budget_gib or 24) * GiB),
        protocol=FAST,
        settings=settings,
        base_dir=tmp_path,
        placement=placement,
    )


def cfg(weights: str = "exl3:4.0", ctx: int = 4096, parallel: int = 2, **options) -> TrialConfig:
    return TrialConfig("exllamav3", weights, ctx, parallel, (("cache_type", "fp16"), *sorted(options.items())))


# ------------------------------------------------------------------ rules


def test_rules_read_in_exllamav3_and_tabbyapi(tmp_path):
    b = ExLlamaV3Backend()
    two = ctx_of(tmp_path, "rtx3090", "rtx3090")
    model = two.model  # 40 query heads, 8 K/V heads of 128 channels
    assert split.check(cfg(gpu_split="20,20", tensor_parallel=True), two, model, None) == []
    assert "at most 2 GiB figures" in split.check(cfg(gpu_split="10,10,4"), two, model, None)[0]
    assert "at most 2 GiB figures" in split.check(cfg(gpu_split="0,0"), two, model, None)[0]
    one = ctx_of(tmp_path, "rtx3090")
    assert "need several cards" in split.check(cfg(tensor_parallel=True), one, model, None)[0]
    olmo = {"architectures": ["Olmo3ForCausalLM"]}
    assert "does not implement it for Olmo3ForCausalLM" in split.check(cfg(tensor_parallel=True), two, model, olmo)[0]
    mistral4 = {"architectures": ["Mistral3ForConditionalGeneration"], "text_config": {"model_type": "mistral4"}}
    assert split.tp_problem(model, mistral4) is not None
    assert split.tp_problem(model, {"architectures": ["Mistral3ForConditionalGeneration"]}) is None
    # head_dim 64 needs pairs of heads per 128-channel unit: 3 K/V heads do not divide.
    assert split.kv_units(64, 4) == 2 and split.kv_units(128, 8) == 8 and split.kv_units(64, 3) is None
    assert split.kv_units(192, 4) == 2  # attn.py's own example: head_dim 192 -> pairs
    # The backend applies them with the rest of its rules.
    assert any("need several cards" in r for r in b.check(cfg(gpu_split="20"), one))


def test_only_values_exllamav3_takes_become_choices():
    params = {
        p.name: p
        for p in split.parameters(
            {"gpu_split": ["auto", "20,4", [20, 4], "x"], "tensor_parallel": [True, False, "yes"]}
        )
    }
    assert params["gpu_split"].choices == ("auto", "20,4")
    assert params["tensor_parallel"].choices == (True, False)


def test_a_study_on_several_cards_searches_auto_an_even_split_and_tensor_parallel(tmp_path):
    two = ctx_of(tmp_path, "rtx3090", "rtx3060-12gb")
    found = ExLlamaV3Backend().splitting.placement_space(two)
    assert found["gpu_split"][0] == "auto" and found["gpu_split"][1] == "12,12"
    assert found["tensor_parallel"] == [False, True]
    assert ExLlamaV3Backend().splitting.placement_space(ctx_of(tmp_path, "rtx3090")) == {}


# ------------------------------------------------------------------ each card's memory


def test_a_layer_split_fills_the_first_card_before_the_next_and_puts_the_cache_with_its_layers(tmp_path):
    b = ExLlamaV3Backend()
    two = ctx_of(tmp_path, "rtx3090", "rtx3090")
    # ~16 GiB of weights and 8 GiB of cache: more than one 24 GiB card.
    one = b.estimate_memory(cfg(ctx=8192, parallel=4), ctx_of(tmp_path, "rtx3090", budget_gib=80))
    auto = b.estimate_memory(cfg(ctx=8192, parallel=4, gpu_split="auto"), two)
    d0, d1 = auto.per_device_bytes
    assert d0 > d1 > 0 and check_cards(auto.per_device_bytes, two.placement) is None
    assert d0 <= two.placement.budgets[0] - 96 * 2**20  # autosplit_reserve on card 0
    # Weights and cache are each on one card; the second card pays its own CUDA context.
    assert auto.weights_bytes == one.weights_bytes and auto.kv_bytes > one.kv_bytes - 1
    assert d0 + d1 == pytest.approx(one.total_bytes + one.overhead_bytes + one.buffers_bytes, rel=0.02)


def test_a_gpu_split_beyond_one_card_is_refused_naming_that_card(tmp_path):
    two = ctx_of(tmp_path, "rtx3060-12gb", "rtx3060-12gb")
    mem = ExLlamaV3Backend().estimate_memory(cfg(gpu_split="20,4"), two)
    why = check_cards(mem.per_device_bytes, two.placement)
    assert why is not None and why.startswith("device 0 (") and "device 1" not in why
    # What the split cannot hold stays on the last card it names: the judge sees it overflow.
    small = ExLlamaV3Backend().estimate_memory(cfg(gpu_split="6,6"), two)
    assert small.per_device_bytes[0] <= 6 * GiB < small.per_device_bytes[1]


def test_a_card_given_0_gib_holds_nothing(tmp_path):
    two = ctx_of(tmp_path, "rtx3090", "rtx3090")
    mem = ExLlamaV3Backend().estimate_memory(cfg(gpu_split="0,23"), two)
    assert mem.per_device_bytes[0] == 0 and mem.per_device_bytes[1] > 0


def test_tensor_parallel_divides_weights_and_cache_by_the_cards_memory(tmp_path):
    b = ExLlamaV3Backend()
    two = ctx_of(tmp_path, "rtx3090", "rtx3090")
    layer = b.estimate_memory(cfg(gpu_split="auto"), two)
    tp = b.estimate_memory(cfg(gpu_split="auto", tensor_parallel=True), two)
    d0, d1 = tp.per_device_bytes
    assert d0 == pytest.approx(d1, rel=0.05)  # equal cards: equal shares (8 K/V heads, 4 each)
    assert tp.weights_bytes == pytest.approx(layer.weights_bytes, rel=1e-3)
    uneven = b.estimate_memory(cfg(gpu_split="16,8", tensor_parallel=True), two).per_device_bytes
    assert uneven[0] > 1.6 * uneven[1]
    assert any("tensor parallel over 2 of 2 cards" in n for n in tp.notes)


# ------------------------------------------------------------------ what is launched and deployed


def test_the_deploy_line_carries_tabbyapis_split_keys_and_a_one_card_line_none(tmp_path):
    b = ExLlamaV3Backend()
    two = ctx_of(tmp_path, "rtx3090", "rtx3090")
    line = b.deploy_command(cfg(gpu_split="20,4", tensor_parallel=True), two)
    assert "--gpu-split-auto false --gpu-split 20 4" in line
    assert "--tensor-parallel true --tensor-parallel-backend native" in line
    assert "--gpu-split-auto true" in b.deploy_command(cfg(), two)  # several cards, no split named: auto
    assert "gpu-split" not in b.deploy_command(cfg(), ctx_of(tmp_path, "rtx3090"))


def test_the_worker_loads_the_split_as_tabbyapi_does():
    s = generator_settings("fp16", 1024, 1, 256, "20,4", True)
    assert split_load_args(s) == {"use_per_device": [20.0, 4.0], "tensor_p": True, "tp_backend": "native"}
    assert split_load_args(generator_settings("fp16", 1024, 1, 256, "auto")) == {
        "reserve_per_device": [AUTOSPLIT_RESERVE_GB]
    }
    assert split_load_args(generator_settings("fp16", 1024, 1)) == {"reserve_per_device": [AUTOSPLIT_RESERVE_GB]}


def test_a_trial_on_two_cards_tells_the_worker_its_split_and_shows_it_both_cards(tmp_path, monkeypatch):
    """The fake worker echoes the settings it was sent; the parent refuses any other."""
    d = tmp_path / "m"
    d.mkdir()
    from tests.plugins.test_exllamav3_backend import CONFIG, write_exl3

    write_exl3(d / "tiny-exl3-4.0", CONFIG)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    ctx = ctx_of(d, "rtx3090", "rtx3090", model="qwen2.5-32b", worker_command=[sys.executable, str(FAKE), "ok"])
    ctx = StudyContext(**{**ctx.__dict__, "workload": Workload(prompt_tokens=64, output_tokens=16)})
    b = ExLlamaV3Backend()
    assert b.worker_env(ctx)["CUDA_VISIBLE_DEVICES"] == "0,1"
    config = TrialConfig("exllamav3", "tiny-exl3-4.0", 512, 1, (("cache_type", "fp16"), ("gpu_split", "20,4")))
    m = b.run(config, ctx)
    assert m.attrs["generator"]["gpu_split"] == "20,4" and m.attrs["generator"]["tensor_parallel"] is False


# ------------------------------------------------------------------ the twin


def test_twin_exllamav3_places_the_model_as_the_backend_does(tmp_path, twin_plugin):
    from autotune import plugins

    twin = plugins.get_backends()["twin-exllamav3"]
    two = ctx_of(tmp_path, "rtx3090", "rtx3090")
    names = {p.name for p in twin.parameters({"gpu_split": ["auto"], "tensor_parallel": [True]})}
    assert {"gpu_split", "tensor_parallel"} <= names
    assert twin.splitting.placement_space(two) == ExLlamaV3Backend().splitting.placement_space(two)
    config = TrialConfig("twin-exllamav3", "exl3:4.0", 4096, 2, (("cache_type", "fp16"), ("gpu_split", "6,23")))
    mem = twin.estimate_memory(config, two)
    assert len(mem.per_device_bytes) == 2 and mem.per_device_bytes[0] <= 6 * GiB
    assert any("layer split over 2 of 2 cards" in n for n in mem.notes)
    assert "--gpu-split 6 23" in twin.deploy_command(config, two)
    assert any(
        "does not implement" in r or "need several" in r
        for r in twin.check(
            TrialConfig("twin-exllamav3", "exl3:4.0", 4096, 1, (("tensor_parallel", True),)),
            ctx_of(tmp_path, "rtx3090"),
        )
    )
