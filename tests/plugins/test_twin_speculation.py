"""The twin's speculative decoding: acceptance length, the draft's and the verify pass's cost, a
twin study over spec type x parallel, and ``estimate --acceptance`` on the command line."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import get_model
from autotune_plugins.twin import TwinLlamaCpp, speculation

MODEL = "qwen2.5-27b-article"


def ctx_for(gpu: str = "rtx4090", **settings) -> StudyContext:
    g = get_gpu(gpu)
    return StudyContext(
        gpu=g,
        model=get_model(MODEL),
        workload=Workload(100, 400),
        vram_budget_bytes=g.vram_bytes,
        protocol=Protocol(warmup_runs=0, min_runs=1, max_runs=1),
        settings=settings,
    )


def speed(ctx: StudyContext, parallel: int = 1, metric: str = "decode_tok_s", **options) -> float:
    twin = TwinLlamaCpp()
    config = TrialConfig(
        twin.name, "gguf:Q4_K_M", 4096, parallel, tuple(sorted({"cache_type": "q4_0", **options}.items()))
    )
    return twin.predictor.predict(config, ctx)[metric]


def test_acceptance_length_and_the_engines_rate_are_one_relation():
    assert speculation.expected_tokens(0.0, 4) == 1.0  # nothing kept: the target's own token
    assert speculation.expected_tokens(0.5, 2) == pytest.approx(1.75)
    assert speculation.expected_tokens(1.0, 3) == 4.0
    a = speculation.per_token(0.56, 2)
    assert speculation.rate_of(a, 2) == pytest.approx(0.56, abs=1e-9)
    assert 0.66 < a < 0.68  # (a + a^2) / 2 = 0.56
    keep, kept = speculation.gated(0.8, 0.0)
    assert (keep, kept) == (1.0, 0.8)
    keep, kept = speculation.gated(0.8, 0.6)
    assert keep < 1.0 and kept < 0.8 and kept / keep > 0.8  # shorter drafts, each more likely kept


def test_speculation_pays_at_one_stream_and_more_with_higher_acceptance():
    plain = speed(ctx_for())
    low = speed(ctx_for(acceptance=0.4), spec_type="draft-mtp", spec_n_max=2)
    high = speed(ctx_for(acceptance=0.85), spec_type="draft-mtp", spec_n_max=2)
    assert plain < low < high
    assert 1.5 < high / plain < 2.5  # published MTP gains at n-max 2 on a 24 GB card: 1.3-1.9x
    # An n-gram lookup costs next to nothing: at the same acceptance it beats a draft model.
    ngram = speed(ctx_for(acceptance=0.6), spec_type="ngram-simple", spec_n_max=3)
    drafted = speed(ctx_for(acceptance=0.6), spec_type="draft-simple", spec_n_max=3, draft="gguf:Q4_0")
    assert ngram > drafted
    # A draft the size of the target (itself at a lower quant) costs about as much as it saves.
    assert drafted < 1.1 * plain


def test_deep_drafts_at_low_acceptance_lose_to_none():
    plain = speed(ctx_for())
    assert speed(ctx_for(acceptance=0.2), spec_type="draft-mtp", spec_n_max=8) < plain


def test_the_acceptance_setting_is_checked_where_the_study_file_is_read():
    twin = TwinLlamaCpp()
    setting = next(s for s in twin.settings if s.name == "acceptance")
    assert setting.problem({"mtp": 0.8, "ngram-mod": 0.3}) is None
    assert "no spec type or family" in setting.problem({"medusa": 0.5})
    assert "must be a per-token acceptance" in setting.problem(1.2)


def test_draft_types_need_a_draft_and_n_min_at_most_n_max():
    twin = TwinLlamaCpp()
    ctx = ctx_for()
    bad = TrialConfig(twin.name, "gguf:Q4_K_M", 4096, 1, (("spec_type", "draft-simple"),))
    assert any("needs draft weights" in r for r in twin.check(bad, ctx))
    short = TrialConfig(
        twin.name, "gguf:Q4_K_M", 4096, 1, (("spec_n_max", 2), ("spec_n_min", 4), ("spec_type", "draft-mtp"))
    )
    assert any("spec_n_min 4 > spec_n_max 2" in r for r in twin.check(short, ctx))


def test_the_default_twin_space_has_no_speculation():
    """A study that does not name spec_type keeps its space: the default study is unchanged."""
    names = {p.name for p in TwinLlamaCpp().parameters({"cache_type": ("f16",)})}
    assert not names & {"spec_type", "spec_n_max", "draft"}


SPEC_STUDY = """
[study]
name = "spec-slots"
seed = 0
sampler = "grid"
n_trials = 40

[hardware]
gpu = "rtx4090"

[model]
ref = "qwen2.5-27b-article"

[workload]
prompt_tokens = 200
output_tokens = 400

[[candidates]]
backend = "twin-llama.cpp"
weights = ["gguf:Q4_K_M"]

[space]
ctx = [4096]
cache_type = ["q4_0"]
flash_attn = [true]
parallel = [1, 2, 4, 8]
spec_type = ["none", "draft-mtp"]
spec_n_max = [3]

[objective]
metric = "aggregate_tok_s"
"""


def test_a_twin_study_over_spec_and_parallel_finds_speculation_wins_at_one_slot_and_loses_at_many(
    tmp_path, twin_plugin
):
    from autotune.config import load_study_config
    from autotune.report.text import summary_text
    from autotune.study import StudyRunner, prepare_study
    from autotune.study.summary import summarize

    path = tmp_path / "spec.toml"
    path.write_text(SPEC_STUDY, encoding="utf-8")
    url = f"sqlite:///{tmp_path / 'spec.db'}"
    runner = StudyRunner(prepare_study(load_study_config(path), storage=url))
    runner.run()
    summary = summarize(runner.study, url)
    found = summary.extra["speculation_gain"]
    by_slots = {g["parallel"]: g["gain"] for g in found["slots"]}
    assert sorted(by_slots) == [1, 2, 4, 8]
    assert by_slots[1] > 1.2 and by_slots[8] < 1.0
    assert found["verdict"].startswith("speculation loses from ")
    text = summary_text(summary)
    assert found["verdict"] in text and "parallel 1: x" in text
    from autotune.report.html import render

    page = render(runner.study, summary)
    assert "id='speculation'" in page and "plot-speculation" in page


def test_estimate_acceptance_on_the_command_line(twin_plugin):
    from autotune.cli import cli

    args = [
        "estimate",
        "--gpu",
        "rtx4090",
        "--model",
        MODEL,
        "--weights",
        "gguf:Q4_K_M",
        "--backend",
        "twin-llama.cpp",
        "--ctx",
        "4096",
        "--cache",
        "q4_0",
        "--set",
        "spec_type=draft-mtp",
        "--set",
        "spec_n_max=2",
    ]
    low = CliRunner().invoke(cli, [*args, "--acceptance", "0.3", "--json"])
    high = CliRunner().invoke(cli, [*args, "--acceptance", "0.8", "--json"])
    assert low.exit_code == 0 and high.exit_code == 0, low.output + high.output
    lo, hi = json.loads(low.output)["speculation"], json.loads(high.output)["speculation"]
    assert lo["acceptance_rate"] == 0.3 and hi["gain"]["decode_tok_s"] > lo["gain"]["decode_tok_s"] > 1.0
    text = CliRunner().invoke(cli, [*args, "--acceptance", "0.56"])
    assert "speculation draft-mtp n-max 2 at acceptance 0.56 (accepted / drafted): decode x" in text.output
    none = CliRunner().invoke(cli, [*args[:-4], "--acceptance", "0.5"])
    assert none.exit_code == 2 and "--set spec_type=draft-mtp" in none.output


def test_the_published_table_in_the_docs_is_what_the_twin_computes():
    """docs/twin.md's speculation table: each published row with the twin's ratio, fitted rows
    within 2% (two constants, two rows), held-out rows as they fall, the misses included."""
    from pathlib import Path

    from autotune_plugins.twin import speculation_evidence

    doc = (Path(__file__).resolve().parents[2] / "docs" / "twin.md").read_text(encoding="utf-8")
    for r in speculation_evidence.rows():
        f = r["figure"]
        line = next((x for x in doc.splitlines() if x.startswith(f"| {f.setting} |")), None)
        assert line is not None, f.setting
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == f.role and float(cells[3]) == pytest.approx(f.ratio, abs=0.005)
        assert float(cells[4]) == pytest.approx(r["twin_ratio"], abs=0.005)
        if f.role == "fit":
            assert r["twin_ratio"] / f.ratio == pytest.approx(1.0, abs=0.02)


def test_the_cycle_costs_are_what_brought_the_twin_down_to_the_published_gains():
    from autotune_plugins.twin import speculation, speculation_evidence

    free = speculation.CycleCosts()
    fitted = speculation.load_cycle_costs()
    assert fitted.draft_pass_us > 0 and fitted.verify_cycle_us > 0
    for f in speculation_evidence.FIGURES:
        assert speculation_evidence.twin_ratio(f.gpu, f.n_max, f.rate, 1, fitted) < speculation_evidence.twin_ratio(
            f.gpu, f.n_max, f.rate, 1, free
        )


@pytest.mark.parametrize("gpu", ["v100-32gb", "p40", "t4", "rtx3090", "rtx4090", "a100-80gb", "h200"])
def test_a_verify_row_is_never_cheaper_than_a_plain_row_on_the_same_kernel(gpu):
    """A verify pass of P slots x (n + 1) rows costs the arithmetic of a plain step of as many
    rows; where the card multiplies the rows past the matrix-vector batch on the same units with
    the same dp4a (before Turing, below 64 rows), each such row costs what a plain row does, so
    many slots do not make speculation cheap there. (The twin used to price them on the FP16
    tensor cores, which llama.cpp leaves to cuBLAS's larger batches: a V100 gained x1.4 at 8 slots.)"""
    from autotune_plugins.twin import physics

    twin = TwinLlamaCpp()
    ctx = ctx_for(gpu, acceptance_rate=0.75)
    options = (("cache_type", "q4_0"), ("spec_n_max", 2), ("spec_type", "draft-mtp"))
    s = twin.scenario(TrialConfig(twin.name, "gguf:Q4_K_M", 4096, 8, options), ctx)
    k = twin.constants()
    from autotune_plugins.twin.backend import load_constants

    host = load_constants()[1]
    compute = {r: physics.step_terms(s, k, host, r, 300, s.model.n_layers)["compute"] for r in (1, 8, 24)}
    verify = physics.step_terms(s, k, host, 8, 300, s.model.n_layers, tokens_per_stream=3)["compute"]
    assert verify == pytest.approx(compute[24])
    per_row_small, per_row_past = compute[8] / 8, (compute[24] - compute[8]) / 16
    if get_gpu(gpu).compute_capability_tuple < (7, 5):
        assert per_row_past == pytest.approx(per_row_small)
    else:
        assert per_row_past < per_row_small  # INT8 tensor cores take the rows past the vector batch


@pytest.mark.parametrize("gpu, rate", [("v100-32gb", 0.75), ("rtx3090", 0.78), ("rtx4090", 0.56)])
def test_speculation_loses_by_four_slots_on_every_card(gpu, rate):
    """Published several-slot MTP figures lose against none by 4 slots (docs/twin.md); so does
    the twin, on Volta too."""
    from autotune_plugins.twin import speculation_evidence

    gains = {p: speculation_evidence.twin_ratio(gpu, 2, rate, p) for p in (1, 4, 8, 16)}
    assert gains[1] > 1.3 and max(gains[4], gains[8], gains[16]) < 1.0


def test_the_calibration_prices_later_trials_at_the_acceptance_the_study_measured():
    """Trials that counted their drafts (the core passes the counts beside the metrics) give the
    twin's calibration a per-token acceptance per spec type, pooled over n-max; later trials of
    that type are priced at it, not at the assumed default."""
    from dataclasses import replace

    twin = TwinLlamaCpp()
    ctx = ctx_for()
    a = 0.6
    measured = []
    for n_max, drafted in ((2, 400), (4, 800)):
        config = TrialConfig(
            twin.name,
            "gguf:Q4_K_M",
            4096,
            1,
            (("cache_type", "q4_0"), ("spec_n_max", n_max), ("spec_type", "draft-mtp")),
        )
        metrics = dict(twin.predictor.predict(config, ctx))
        metrics.update(acceptance_drafted=float(drafted), acceptance_accepted=drafted * speculation.rate_of(a, n_max))
        measured.append((config, metrics))
    report = twin.predictor.calibrate(measured, ctx)
    assert report["acceptance"]["draft-mtp"]["per_token"] == pytest.approx(a, abs=1e-3)
    assert report["acceptance"]["draft-mtp"]["drafted"] == 1200
    calibrated = replace(ctx, calibration=report)
    priced = speed(calibrated, spec_type="draft-mtp", spec_n_max=3)
    assumed = speed(ctx, spec_type="draft-mtp", spec_n_max=3)  # the default, mtp 0.8
    at_measured = speed(ctx_for(acceptance=a), spec_type="draft-mtp", spec_n_max=3)
    assert priced == pytest.approx(at_measured, rel=0.02) and priced < assumed
    # A spec type the study never measured keeps the assumption.
    assert speed(calibrated, spec_type="ngram-simple", spec_n_max=3) == pytest.approx(
        speed(ctx, spec_type="ngram-simple", spec_n_max=3), rel=0.02
    )
