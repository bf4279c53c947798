"""Several cards in a study ([hardware] gpus, autotune.hardware.placement): reading, budgets per card,
the judge per card, the header and the refusal to resume on another set of cards."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from autotune.hardware import gpus as hardware
from autotune.hardware import placement
from autotune.engine.backend import MemoryEstimate
from autotune.config import parse_study_config
from autotune.errors import ConfigError
from autotune.hardware.placement import CardsRequest, check_cards, resolve_placement
from autotune.study import comparable

BASE = {
    "study": {"name": "cards"},
    "model": {"ref": "qwen2.5-7b"},
    "workload": {"prompt_tokens": 64, "output_tokens": 16},
    "candidates": [{"backend": "twin-llama.cpp", "weights": ["gguf:Q4_K_M"]}],
    "space": {"ctx": [2048], "parallel": [1]},
}


def doc(**hardware_table):
    return {**BASE, "hardware": hardware_table}


def test_catalog_cards_each_get_their_own_budget_and_margin():
    cfg = parse_study_config(
        doc(gpus=["rtx3090", "rtx3060-12gb"], vram_budget_gib=[20, 10], safety_margin_mib=[512, 256])
    )
    assert cfg.cards == CardsRequest(("rtx3090", "rtx3060-12gb"), (20.0, 10.0), (512.0, 256.0))
    assert cfg.gpu == "rtx3090"  # the main card, for what reads one card
    p = resolve_placement(cfg.cards)
    assert p.keys == ("rtx3090", "rtx3060-12gb")
    assert p.budgets == (20 * 2**30 - 512 * 2**20, 10 * 2**30 - 256 * 2**20)
    assert p.total_budget_bytes == sum(p.budgets)
    lines = p.lines()
    assert lines[0].startswith("device 0: ") and "RTX 3090" in lines[0] and "19.50 GiB" in lines[0]
    assert lines[1].startswith("device 1: ") and "9.75 GiB" in lines[1]


def test_one_figure_is_every_card_s_and_no_figure_is_the_card_s_memory():
    cfg = parse_study_config(doc(gpus=["rtx3090", "rtx3090"]))
    p = resolve_placement(cfg.cards)
    card = hardware.get_gpu("rtx3090")
    assert p.budgets == (card.vram_bytes - 256 * 2**20,) * 2
    p = resolve_placement(parse_study_config(doc(gpus=["t4", "t4"], vram_budget_gib=8)).cards)
    assert p.budgets == (8 * 2**30 - 256 * 2**20,) * 2


@pytest.mark.parametrize(
    ("table", "field", "says"),
    [
        ({"gpus": []}, "gpus", "non-empty list"),
        ({"gpus": "rtx3090"}, "gpus", "catalog keys"),
        ({"gpus": ["auto", "rtx3090"]}, "gpus", "comes alone"),
        ({"gpus": ["cpu", "rtx3090"]}, "gpus", "do not mix"),
        ({"gpus": ["t4", "t4"], "gpu": "t4"}, "gpu", "give one or the other"),
        ({"gpus": ["t4", "t4"], "vram_budget_gib": [8, 8, 8]}, "vram_budget_gib", "3 figures for 2 cards"),
        ({"gpus": ["t4", "t4"], "safety_margin_mib": [-1, 5]}, "safety_margin_mib", "0..1.04858e+06"),
        ({"vram_budget_gib": [8, 8]}, "vram_budget_gib", "gpus, which is not given"),
    ],
)
def test_errors_name_the_file_the_field_and_what_is_accepted(table, field, says):
    with pytest.raises(ConfigError) as err:
        parse_study_config(doc(**table), source="s.toml")
    line = next(l for l in str(err.value).splitlines() if f"[hardware] {field}" in l)
    assert line.startswith("s.toml: [hardware] ") and says in line


def test_an_unknown_card_or_a_budget_above_the_card_is_refused_when_resolved():
    with pytest.raises(ConfigError, match=r"unknown 'rtx9999' \(accepted: v100-16gb, .*'auto', or 'cpu'\)"):
        resolve_placement(CardsRequest(("t4", "rtx9999"), (None,), (256.0,)), "s.toml: [hardware] gpus")
    with pytest.raises(ConfigError, match=r"s.toml: \[hardware\] vram_budget_gib = 20 for device 1: more than"):
        resolve_placement(CardsRequest(("rtx3090", "t4"), (20.0,), (256.0,)), "s.toml: [hardware] gpus")


def test_auto_is_every_card_cuda_shows(monkeypatch):
    h200 = hardware.get_gpu("h200")
    found = [
        hardware.DetectedGpu(i, "NVIDIA H200", h200.vram_bytes, 0, h200.vram_bytes, "560", "9.0", h200)
        for i in range(3)
    ]
    monkeypatch.setattr(hardware, "detect_gpus", lambda: found)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,0")
    monkeypatch.setattr(
        "autotune.hardware.cuda_devices.resolve_cuda_device",
        lambda i: SimpleNamespace(nvml_index=[2, 0][i]) if i < 2 else (_ for _ in ()).throw(ConfigError("x")),
    )
    p = resolve_placement(CardsRequest(("auto",), (100.0,), (1024.0,)))
    assert [c.nvml_index for c in p.cards] == [2, 0] and p.keys == ("h200", "h200")
    assert p.budgets == (100 * 2**30 - 2**30,) * 2
    # A list for "auto" is checked against the cards found, not the file's count.
    with pytest.raises(ConfigError, match=r"safety_margin_mib = \[1.0, 2.0, 3.0\]: 3 figures for the 2 card"):
        resolve_placement(CardsRequest(("auto",), (10.0, 10.0), (1.0, 2.0, 3.0)))


def test_the_judge_checks_each_card_against_its_own_budget():
    p = resolve_placement(CardsRequest(("rtx3090", "rtx3060-12gb"), (20.0, 10.0), (0.0,)))
    assert check_cards((15 * 2**30, 9 * 2**30), p) is None
    why = check_cards((5 * 2**30, 11 * 2**30), p)
    assert why is not None and why.startswith("device 1 (") and "11.00 GiB > budget 10.00 GiB" in why
    # The same total fits the whole (30 GiB), not the small card: the judge refuses it.
    from autotune.study.admission import OVER_BUDGET, Admission
    from autotune.config import Objective

    estimate = MemoryEstimate(16 * 2**30, 0, 0, 0, per_device_bytes=(5 * 2**30, 11 * 2**30))
    backend = SimpleNamespace(name="b", estimate_memory=lambda c, ctx: estimate)
    ctx = SimpleNamespace(vram_budget_bytes=p.total_budget_bytes, placement=p, gpu=p.cards[0].spec)
    judge = Admission(
        SimpleNamespace(entries={"b": SimpleNamespace(backend=backend)}, check=lambda c, x: []), {"b": ctx}, Objective()
    )
    verdict = judge.judge(SimpleNamespace(backend="b", key="k"))
    assert verdict.kind == OVER_BUDGET and "per card, device 1" in verdict.reason
    estimate = replace(estimate, per_device_bytes=(10 * 2**30, 6 * 2**30))
    judge = Admission(
        SimpleNamespace(entries={"b": SimpleNamespace(backend=backend)}, check=lambda c, x: []), {"b": ctx}, Objective()
    )
    assert judge.judge(SimpleNamespace(backend="b", key="k2")).admitted


def test_resume_refuses_another_set_of_cards():
    two = resolve_placement(CardsRequest(("rtx3090", "rtx3060-12gb"), (None,), (256.0,)))
    stored = two.to_dict()
    assert comparable._card_differences(stored, two) == []
    swapped = resolve_placement(CardsRequest(("rtx3060-12gb", "rtx3090"), (None,), (256.0,)))
    assert comparable._card_differences(stored, swapped) == [
        "cards: stored ['rtx3090', 'rtx3060-12gb'], now ['rtx3060-12gb', 'rtx3090']"
    ]
    assert comparable._card_differences(None, two) == [
        "cards: stored one card ([hardware] gpu), now ['rtx3090', 'rtx3060-12gb']"
    ]
    # Another budget on the same cards is the same study, as for one card.
    smaller = resolve_placement(CardsRequest(("rtx3090", "rtx3060-12gb"), (8.0,), (256.0,)))
    assert comparable._card_differences(stored, smaller) == []


def test_cpu_devices_are_host_memory_shares():
    p = resolve_placement(CardsRequest(("cpu", "cpu", "cpu"), (1.0,), (0.0,)))
    assert p.on_cpu and p.budgets == (2**30,) * 3
    assert placement.Placement(p.cards[:1]).total_budget_bytes == 2**30


def test_a_study_on_several_cards_prepares_with_each_budget_and_its_header_lists_them(twin_plugin, tmp_path):
    from autotune.report.progress import header_text
    from autotune.study.prepare import prepare_study

    cfg = parse_study_config(doc(gpus=["rtx3090", "rtx3060-12gb"], vram_budget_gib=[20, 10]), source="s.toml")
    prepared = prepare_study(cfg, storage=f"sqlite:///{tmp_path / 's.db'}")
    assert prepared.placement is not None and prepared.gpu.key == "rtx3090"
    assert prepared.vram_budget_bytes == prepared.placement.total_budget_bytes
    assert prepared.contexts["twin-llama.cpp"].placement is prepared.placement
    header = header_text(prepared, "s.toml")
    assert "2 cards, memory budget 29.50 GiB in all: device 0: GeForce RTX 3090: budget 19.75 GiB" in header
    assert "device 1: GeForce RTX 3060 12GB: budget 9.75 GiB" in header


def test_an_engine_on_several_cards_sees_them_all(monkeypatch):
    monkeypatch.setattr("autotune.hardware.cuda_devices.cuda_visible_entry", lambda i: f"GPU-{i}")
    two = resolve_placement(CardsRequest(("h200", "h200"), (None,), (256.0,)))
    assert placement.cuda_visible(two, 0) == "GPU-0,GPU-1"
    assert placement.cuda_visible(None, 3) == "GPU-3"
    cpus = resolve_placement(CardsRequest(("cpu", "cpu"), (1.0,), (0.0,)))
    assert placement.cuda_visible(cpus, 0) == "GPU-0"  # RPC devices on the host: no card to show
