"""llama-server's card subsets (plugins/llama_server/devices.py, ``-dev``): ggml's device names,
the rules, the command line, and each device's memory with the devices left out at 0, on RPC
devices (a CPU study's several devices) and on CUDA cards, without an engine."""

from __future__ import annotations

from types import SimpleNamespace

from autotune.engine.backend import TrialConfig
from autotune.hardware.placement import CardsRequest, resolve_placement
from autotune_plugins.llama_server import devices, split


def ctx_of(*cards: str) -> SimpleNamespace:
    return SimpleNamespace(placement=resolve_placement(CardsRequest(tuple(cards), (None,), (0.0,))))


def config(**options) -> TrialConfig:
    return TrialConfig("llama-server", "m.gguf", 512, 1, tuple(sorted(options.items())))


def test_devices_are_named_as_ggml_names_them():
    assert devices.engine_names(ctx_of("cpu", "cpu")) == ("RPC0", "RPC1")
    assert devices.engine_names(ctx_of("rtx3090", "rtx3090", "t4")) == ("CUDA0", "CUDA1", "CUDA2")
    assert devices.engine_names(SimpleNamespace(placement=None)) == ()


def test_a_subset_is_checked_and_ts_and_mg_index_it():
    three = ctx_of("cpu", "cpu", "cpu")
    model = SimpleNamespace(architecture="llama")
    assert split.check(config(devices="RPC2,RPC0", split_mode="layer", tensor_split="1,1"), three, model, False) == []
    assert "at most 2" in split.check(config(devices="RPC2,RPC0", tensor_split="1,1,1"), three, model, False)[0]
    assert "devices 0..0" in split.check(config(devices="RPC1", main_gpu=1), three, model, False)[-1]
    assert "one device to split over" in split.check(config(devices="RPC1", split_mode="layer"), three, model, False)[0]
    bad = split.check(config(devices="CUDA0"), three, model, False)
    assert bad and "from RPC0, RPC1, RPC2" in bad[0]
    assert "each of the study's devices once" in split.check(config(devices="RPC0,RPC0"), three, model, False)[0]
    assert "the study has one device" in devices.problem(config(devices="CUDA0"), SimpleNamespace(placement=None))
    assert devices.selected(config(devices="RPC2,RPC0"), three) == (2, 0)
    assert devices.selected(config(), three) == (0, 1, 2)


def test_the_command_line_names_the_subset_first():
    assert split.flags(config(devices="CUDA1,CUDA0", split_mode="layer")) == ["-dev", "CUDA1,CUDA0", "-sm", "layer"]
    assert split.flags(config()) == []
    names = {p.name: p.choices for p in split.parameters({"devices": ["CUDA0,CUDA1", "", 3]})}
    assert names["devices"] == ("CUDA0,CUDA1",)


def test_devices_left_out_hold_nothing_on_rpc_devices(tmp_path, engine_plugins):
    import shutil

    from autotune.estimate import estimate_config
    from tests.conftest import shared_file

    model = tmp_path / "stories260K.gguf"
    shutil.copy(shared_file("models/stories260K.gguf"), model)

    def per(**dims):
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
            dimensions={"split_mode": "layer", **dims},
            gpus=["cpu", "cpu", "cpu"],
        )
        return r["vram"]["per_device_bytes"]

    every = per(tensor_split="1,1,1")
    pair = per(devices="RPC2,RPC0", tensor_split="1,1")
    assert len(pair) == 3 and pair[1] == 0 and pair[0] > 0 and pair[2] > 0 and all(every)
    # -dev order: RPC2 is the first device, so it holds the first half of the layers, RPC0 the
    # second and the output layer, as devices 0 and 1 would in a split over those two alone.
    alone = per(devices="RPC0,RPC1", tensor_split="1,1")
    assert (pair[2], pair[0]) == (alone[0], alone[1]) and alone[2] == 0
