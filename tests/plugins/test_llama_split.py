"""llama-server across several devices (plugins/llama_server/split.py): where layers go, the
rules of each split mode, the command line, each device's memory, without an engine."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from autotune.engine.backend import MemoryEstimate, TrialConfig
from autotune.engine.formats import WeightsBreakdown
from autotune.hardware.placement import CardsRequest, resolve_placement
from autotune_plugins.llama_server import split


def ctx_of(*cards: str, budget_gib: float | None = None) -> SimpleNamespace:
    return SimpleNamespace(placement=resolve_placement(CardsRequest(tuple(cards), (budget_gib,), (0.0,))))


def config(**options) -> TrialConfig:
    return TrialConfig("llama-server", "m.gguf", 512, 1, tuple(sorted(options.items())))


@pytest.mark.parametrize(
    ("n_layers", "ngl", "ts", "devices"),
    [
        (5, None, (1, 1), [0, 0, 0, 1, 1, 1]),  # 6 layers with the output, split at 3/6
        (5, None, (3, 1), [0, 0, 0, 0, 0, 1]),  # split at 0.75: 4/6 < 0.75 <= 5/6
        (5, 3, (1, 1), [None, None, None, 0, 0, 1]),  # -ngl 3: the last 2 layers and the output
        (8, None, (1, 1, 1), [0, 0, 0, 1, 1, 1, 2, 2, 2]),  # 3/9 is on the split point 1/3: the next device
        (4, 0, (1, 1), [None] * 5),
    ],
)
def test_layers_go_where_load_tensors_puts_them(n_layers, ngl, ts, devices):
    assert split.layer_devices(n_layers, ngl, ts) == devices


def test_ts_candidates_are_few_and_follow_the_budgets():
    assert split.ts_candidates([24 * 2**30]) == []
    found = split.ts_candidates([24 * 2**30, 12 * 2**30])
    assert found[:2] == ["1,1", "2,1"] and len(found) == len(set(found)) <= 4
    assert all(split.parse_ts(t, 2) for t in found)
    assert split.ts_candidates([10, 10, 10])[0] == "1,1,1"


def test_rules_from_llama_cpp_s_source():
    two = ctx_of("cpu", "cpu")
    model = SimpleNamespace(architecture="llama")
    assert split.check(config(split_mode="layer", tensor_split="3,1"), two, model, cuda=False) == []
    row = split.check(config(split_mode="row"), two, model, cuda=False)
    assert len(row) == 1 and "no split buffers" in row[0]
    assert split.check(config(split_mode="row"), two, model, cuda=True) == []
    assert "needs flash_attn on" in split.check(config(split_mode="tensor", flash_attn=False), two, model, True)[0]
    assert (
        "architecture 'deepseek2'"
        in split.check(config(split_mode="tensor"), two, SimpleNamespace(architecture="deepseek2"), True)[0]
    )
    assert "at most 2" in split.check(config(tensor_split="1,1,1"), two, model, False)[0]
    assert "devices 0..1" in split.check(config(main_gpu=2), two, model, False)[0]
    one = SimpleNamespace(placement=None)
    assert "one device" in split.check(config(split_mode="layer"), one, model, True)[0]


def test_flags_only_for_what_the_configuration_names():
    assert split.flags(config()) == []
    assert split.flags(config(split_mode="layer", tensor_split="3,1")) == ["-sm", "layer", "-ts", "3,1"]
    # -ts means nothing to split mode none: the deploy line leaves it out.
    assert split.flags(config(split_mode="none", tensor_split="3,1", main_gpu=1)) == ["-sm", "none", "-mg", "1"]


def test_each_device_holds_its_layers_their_kv_and_a_compute_buffer():
    w = WeightsBreakdown(
        embedding_bytes=1000, output_bytes=700, per_layer_bytes=(100, 100, 100, 100, 100), other_bytes=10
    )
    model = SimpleNamespace(n_layers=5)
    base = MemoryEstimate(0, 0, 0, 0, host_bytes=1000)
    kv_all = 50 * 5
    e = split.estimate(base, model, w, config(split_mode="layer", tensor_split="1,1"), 2, None, kv_all, 30, 0)
    # Layers 0-2 on device 0; 3, 4 and the output (700 + 10) on device 1.
    assert e.per_device_bytes == (300 + 150 + 30, 200 + 710 + 100 + 30)
    assert e.total_bytes == sum(e.per_device_bytes) and e.host_bytes == 1000
    e = split.estimate(base, model, w, config(split_mode="none", main_gpu=1), 2, None, kv_all, 30, 5)
    assert e.per_device_bytes == (0, 500 + 710 + 250 + 35)
    e = split.estimate(base, model, w, config(split_mode="tensor", tensor_split="1,1"), 2, None, kv_all, 30, 0)
    assert e.per_device_bytes[0] == e.per_device_bytes[1] and e.kv_bytes == kv_all


def test_plugins_lists_every_dimension_with_its_accepted_values_and_the_rules(engine_plugins):
    from click.testing import CliRunner

    from autotune.cli import cli

    out = CliRunner().invoke(cli, ["plugins"]).stdout
    mine = out.split("  llama-server ", 1)[1].split("\n  openai-server", 1)[0]
    for line in (
        '[space] gpu_layers = "all", an integer 0..2147483647:',
        "[space] n_cpu_moe = an integer 0..2147483647:",
        "[space] ubatch = an integer 1..2147483647:",
        "[space] split_mode = none, layer, row, tensor:",
        "[space] tensor_split = proportions such as",
        "[space] main_gpu = a device number from 0:",
        "rule: split_mode row: CUDA cards only",
        "rule: quantized V cache needs flash attention",
    ):
        assert line in mine, line


def test_estimate_takes_every_dimension_and_judges_each_card(tmp_path, engine_plugins):
    import shutil

    from autotune.estimate import estimate_config
    from autotune.errors import ConfigError
    from tests.conftest import shared_file

    model = tmp_path / "stories260K.gguf"
    shutil.copy(shared_file("models/stories260K.gguf"), model)
    r = estimate_config(
        None,
        str(model),
        "llama-server",
        None,
        512,
        None,
        None,
        1,
        64,
        16,
        dimensions={"split_mode": "layer", "tensor_split": "3,1", "ubatch": 128},
        gpus=["rtx3090", "rtx3060-12gb"],
    )
    assert r["config"]["split_mode"] == "layer" and r["config"]["ubatch"] == 128
    per = r["vram"]["per_device_bytes"]
    assert len(per) == 2 == len(r["card_budgets"]) and sum(per) == r["vram"]["total_bytes"]
    assert r["verdict"] == "fits"
    with pytest.raises(ConfigError, match=r"--set split_mode='diagonal': llama-server takes split_mode = none, layer"):
        estimate_config(
            None,
            str(model),
            "llama-server",
            None,
            512,
            None,
            None,
            1,
            64,
            16,
            dimensions={"split_mode": "diagonal"},
            gpus=["t4", "t4"],
        )
    with pytest.raises(ConfigError, match=r"--set warp: not a dimension of llama-server \(it has: cache_type"):
        estimate_config("t4", str(model), "llama-server", None, 512, None, None, 1, 64, 16, dimensions={"warp": 9})


def test_a_device_with_only_the_output_layer_has_no_compute_buffer_and_pipelining_adds_copies():
    w = WeightsBreakdown(embedding_bytes=1000, output_bytes=700, per_layer_bytes=(100,) * 5, other_bytes=10)
    base = MemoryEstimate(0, 0, 0, 0)
    e = split.estimate(
        base,
        SimpleNamespace(n_layers=5),
        w,
        config(split_mode="layer", tensor_split="3,1"),
        2,
        None,
        250,
        30,
        7,
        pipeline_bytes=11,
    )
    # Layers 0-4 on device 0 (5/6 is past the 0.75 split point only for the output layer).
    assert e.per_device_bytes == (500 + 250 + 30 + 11 + 7, 710 + 7)
    model = SimpleNamespace(hidden_size=64)
    assert split.pipeline_copies_bytes(model, 256, 128, True) == 3 * (256 * 128 * 2 + 128 * (64 * 4 + 112))
    assert split.pipeline_copies_bytes(model, 256, 128, False) == 3 * (256 * 128 * 4 + 128 * (64 * 4 + 112))
