"""exllamav3's scorer without a GPU: the worker side (``worker_scoring.PassScorer``) over a numpy
stand-in for the model and its cache (``exllamav3_fake_model.py``), in process and behind the
fake worker (``exllamav3_fake_worker.py``) that the backend starts as it starts the real one;
then the quality metrics (``kld``, ``mmlu``) and a study's reference through it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.engine.metric import QualityReference
from autotune.modelfiles.models import model_from_hf_config
from autotune.engine.scoring import ScoringError
from tests.plugins.exllamav3_fake_model import FakeModel, encode
from tests.plugins.test_exllamav2_backend import write_safetensors
from tests.plugins.test_exllamav3_backend import CONFIG, write_exl3

from autotune_plugins.exllamav3.backend import ExLlamaV3Backend
from autotune_plugins.exllamav3.worker_scoring import SCORE_CHUNK, PassScorer
from autotune_plugins.quality import kld
from autotune_plugins.quality.metrics import CevalMetric, KldMetric, MmluMetric

FAKE = Path(__file__).with_name("exllamav3_fake_worker.py")
SOURCE_CONFIG = {k: v for k, v in CONFIG.items() if k != "quantization_config"}


def in_process(model_dir: Path, cache_type: str = "fp16", n_ctx: int = 1024, chunk: int = 256):
    model = FakeModel(model_dir, cache_type, n_ctx + 256)
    return PassScorer(encode, model.forward, model.n_vocab, n_ctx, chunk, str(model_dir)), model


def write_source(d: Path) -> Path:
    """The study's full-precision source: FP16 tensors, no quantization_config."""
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(SOURCE_CONFIG))
    tensors = {"model.embed_tokens.weight": ("F16", [512, 128]), "model.norm.weight": ("F16", [128])}
    for i in range(2):
        tensors.update(
            {
                f"model.layers.{i}.self_attn.q_proj.weight": ("F16", [128, 128]),
                f"model.layers.{i}.mlp.down_proj.weight": ("F16", [128, 256]),
            }
        )
    write_safetensors(d / "model.safetensors", tensors)
    return d


@pytest.fixture
def dirs(tmp_path) -> dict[str, Path]:
    """The source and its EXL3 conversions at 3.0 and 5.0 bits, beside a study file's place."""
    out = {"source": write_source(tmp_path / "src")}
    for bits in (3.0, 5.0):
        config = {**CONFIG, "quantization_config": {**CONFIG["quantization_config"], "bits": bits}}
        out[f"exl3-{bits}"] = write_exl3(tmp_path / f"tiny-exl3-{bits}", config)
    return out


def make_ctx(base: Path, source: Path, **settings) -> StudyContext:
    settings.setdefault("worker_command", [sys.executable, str(FAKE), "ok"])
    return StudyContext(
        gpu=get_gpu("h200"),
        model=model_from_hf_config(source),
        workload=Workload(64, 16),
        vram_budget_bytes=100 * 2**30,
        protocol=Protocol(),
        settings=settings,
        base_dir=base,
        source=source,
    )


def write_study(base: Path, weights: list[str], quality: str | None = None) -> Path:
    """A study over exllamav3 weights beside the fixtures' directories, run by the fake worker."""
    study = base / "study.toml"
    objective = f'quality = "{quality}"' if quality else ""
    study.write_text(f"""
[study]
name = "exl3-kld"
sampler = "grid"

[hardware]
gpu = "h200"
vram_budget_gib = 20

[model]
source = "src"

[workload]
prompt_tokens = 64
output_tokens = 16

[[candidates]]
backend = "exllamav3"
weights = {json.dumps(weights)}

[space]
ctx = [512]
cache_type = ["fp16", "k4v4"]
parallel = [1]

[backends.exllamav3]
worker_command = {json.dumps([sys.executable, str(FAKE), "ok"])}

[objective]
metric = "aggregate_tok_s"
{objective}
""")
    return study


# ------------------------------------------------------------------ the worker side, in process


def test_a_text_is_scored_in_passes_of_score_chunk_from_an_empty_cache(dirs):
    scorer, model = in_process(dirs["exl3-3.0"])
    tokens = scorer.tokenize("The clockmaker swept the floor and listened to the clocks. " * 3, add_bos=True)
    rows = scorer.next_token_logprobs(tokens)
    assert rows.shape == (len(tokens), scorer.n_vocab)
    np.testing.assert_allclose(np.exp(rows.astype(np.float64)).sum(axis=1), 1.0, rtol=1e-5)
    starts = list(range(0, len(tokens), SCORE_CHUNK))
    assert model.passes == [(b, min(b + SCORE_CHUNK, len(tokens)) - b, True) for b in starts]


def test_a_quantized_cache_changes_the_rows_only_after_the_first_pass(dirs):
    fp16, _ = in_process(dirs["source"])
    k4, _ = in_process(dirs["source"], "k4v4")
    tokens = encode("x" * (SCORE_CHUNK + 20), True)
    a, b = fp16.next_token_logprobs(tokens), k4.next_token_logprobs(tokens)
    # Within a pass attention reads FP16 keys and values; the cache is read from the next pass on.
    np.testing.assert_array_equal(a[:SCORE_CHUNK], b[:SCORE_CHUNK])
    assert np.abs(a[SCORE_CHUNK:] - b[SCORE_CHUNK:]).max() > 0


def test_loglikelihood_is_the_sum_of_the_continuation_rows_after_the_context(dirs):
    scorer, model = in_process(dirs["exl3-5.0"], "k4v4")
    context, answer = "Question: which planet is red?\nAnswer:", " Mars"
    [found] = scorer.loglikelihood([(context, answer)])
    whole, start = scorer.split(context, answer)
    assert found.n_tokens == len(whole) - start == len(answer.encode())
    # The same rows, computed as the passes ran: the context prefilled, then one pass from its
    # last token, which reads the context back through the (quantized) cache.
    again, model2 = in_process(dirs["exl3-5.0"], "k4v4")
    model2.forward(whole[: start - 1], 0, False)
    rows = model2.forward(whole[start - 1 : -1], start - 1, True)
    expected = sum(float(rows[i, t]) for i, t in enumerate(whole[start:]))
    assert found.logprob == pytest.approx(expected, rel=1e-9)
    assert found.is_greedy == bool(all(rows[i].argmax() == t for i, t in enumerate(whole[start:])))
    assert model.passes == [(0, start - 1, False), (start - 1, len(whole) - start, True)]


def test_the_answers_of_one_question_share_one_prefill_and_do_not_depend_on_order(dirs):
    shared, model = in_process(dirs["exl3-3.0"], "k4v4", chunk=256)
    context = "The capital of France is" * 12  # longer than one prefill chunk
    answers = [" Paris", " Rome", " Berlin", " Madrid"]
    together = shared.loglikelihood([(context, a) for a in answers])
    prefills = [p for p in model.passes if not p[2]]
    assert [p[0] for p in prefills] == list(range(0, len(encode(context, True)) - 1, 256))  # once, in chunks
    alone = [in_process(dirs["exl3-3.0"], "k4v4", chunk=256)[0].loglikelihood([(context, a)])[0] for a in answers]
    assert together == alone
    # Another context in between is prefilled afresh, and the first one again after it.
    shared.loglikelihood([("Something else entirely", " A"), (context, answers[0])])
    assert shared.loglikelihood([(context, answers[0])])[0] == together[0]


# ------------------------------------------------------------------ through the backend's worker


def test_the_backend_scores_through_a_worker_loaded_for_scoring(dirs, tmp_path, monkeypatch):
    requests = tmp_path / "requests.jsonl"
    monkeypatch.setenv("EXL3_FAKE_REQUESTS", str(requests))
    ctx = make_ctx(tmp_path, dirs["source"], scoring_ctx=1000, chunk_size=512)
    with ExLlamaV3Backend().scoring.scorer("tiny-exl3-3.0", "K4V4", ctx) as scorer:
        tokens = scorer.tokenize("Once upon a time", add_bos=True)
        rows = scorer.next_token_logprobs(tokens)
        lls = scorer.loglikelihood([("Once upon a", " time"), ("Once upon a", " tide")])
        worker = scorer.worker
    assert worker.proc is not None and worker.proc.poll() is not None  # closing ended the worker
    assert (scorer.n_vocab, scorer.n_ctx) == (512, 1000)
    assert "cache k4v4" in scorer.description
    load = next(json.loads(line) for line in requests.read_text().splitlines() if '"load"' in line)
    assert load["purpose"] == "score"
    assert {k: load["settings"][k] for k in ("cache_type", "max_seq_len", "max_batch_size", "chunk_size")} == {
        "cache_type": "k4v4",
        "max_seq_len": 1000,
        "max_batch_size": 1,
        "chunk_size": 512,
    }
    local, _ = in_process(dirs["exl3-3.0"], "k4v4", n_ctx=1000, chunk=512)
    np.testing.assert_array_equal(rows, local.next_token_logprobs(tokens))
    assert lls == local.loglikelihood([("Once upon a", " time"), ("Once upon a", " tide")])


def test_the_scorer_refuses_what_exllamav3_cannot_load(dirs, tmp_path):
    ctx = make_ctx(tmp_path, dirs["source"])
    with pytest.raises(ScoringError, match="fp16 or k<K>v<V>"):
        ExLlamaV3Backend().scoring.scorer("tiny-exl3-3.0", "q8_0", ctx)
    with pytest.raises(ScoringError, match="no-such-dir"):
        ExLlamaV3Backend().scoring.scorer("no-such-dir", "fp16", ctx)
    crash = make_ctx(tmp_path, dirs["source"], worker_command=[sys.executable, str(FAKE), "crash-on-load"])
    with pytest.raises(ScoringError, match="out of memory"):
        ExLlamaV3Backend().scoring.scorer("tiny-exl3-3.0", "fp16", crash)


def test_kld_against_the_source_falls_with_bits_and_shows_a_quantized_cache(dirs, tmp_path):
    backend, ctx = ExLlamaV3Backend(), make_ctx(tmp_path, dirs["source"])
    metric = KldMetric()
    reference = TrialConfig("exllamav3", str(dirs["source"]), 0, 1, (("cache_type", "fp16"),))
    metric.configure({}, {"exllamav3": QualityReference(reference, backend, ctx)})

    def kld_of(weights: str, cache: str):
        return metric.evaluate(TrialConfig("exllamav3", weights, 0, 1, (("cache_type", cache),)), backend, ctx)

    itself, k4 = kld_of(str(dirs["source"]), "fp16"), kld_of(str(dirs["source"]), "k4v4")
    three, five = kld_of("tiny-exl3-3.0", "fp16"), kld_of("tiny-exl3-5.0", "fp16")
    assert itself.value == 0.0 and itself.details["top1_agreement"] == 1.0
    assert three.value > five.value > 0.0
    assert k4.value > 0.0
    # The tokens scored: the second half of every window of the text, as the GGUF path scores them.
    tokens = encode(kld.kld_text(), True)
    windows = [tokens[i : i + kld.WINDOW] for i in range(0, len(tokens), kld.WINDOW)]
    assert three.n == sum(len(w) - len(w) // 2 for w in windows if len(w) >= 4)


@pytest.mark.parametrize("metric_class", [MmluMetric, CevalMetric])
def test_benchmark_answers_through_the_worker(dirs, tmp_path, metric_class):
    backend, ctx = ExLlamaV3Backend(), make_ctx(tmp_path, dirs["source"])
    metric = metric_class()
    assert metric.supports(backend) is None
    metric.configure({"shots": 1}, {})
    items = metric.item_order()[0][:3]
    value = metric.evaluate_items(
        TrialConfig("exllamav3", "tiny-exl3-3.0", 0, 1, (("cache_type", "fp16"),)), backend, ctx, items
    )
    assert value.n == 3 and value.per_item["item"] == list(items)
    assert all(c in (0, 1) for c in value.per_item["correct"])


# ------------------------------------------------------------------ in a study


def test_a_study_over_exl3_bits_measures_kld_against_the_source(dirs, tmp_path):
    import autotune_plugins.exllamav3 as exllamav3_plugin
    import autotune_plugins.quality as quality_plugin
    from autotune.config import load_study_config
    from autotune.study.prepare import prepare_study
    from autotune.study.quality import QualityBook
    from tests.conftest import plugin_registered

    study = write_study(tmp_path, ["src", "tiny-exl3-3.0", "tiny-exl3-5.0"], quality="kld")
    with plugin_registered(exllamav3_plugin, "exllamav3"), plugin_registered(quality_plugin, "quality"):
        prepared = prepare_study(load_study_config(study))
    ref = prepared.reference["exllamav3"]
    assert (ref.weights, ref.option("cache_type")) == ("src", "fp16")  # the largest: the source, widest cache
    book = QualityBook(prepared, None)
    drops = {
        (w, c): book.trial_quality(TrialConfig("exllamav3", w, 512, 1, (("cache_type", c),)))["drop_points"]
        for w in ("tiny-exl3-3.0", "tiny-exl3-5.0")
        for c in ("fp16", "k4v4")
    }
    assert drops[("tiny-exl3-3.0", "fp16")] > drops[("tiny-exl3-5.0", "fp16")] > 0
    assert all(drops[(w, "k4v4")] != drops[(w, "fp16")] for w in ("tiny-exl3-3.0", "tiny-exl3-5.0"))


def test_kld_artifacts_scores_each_artifact_and_cache_against_the_source(dirs, tmp_path):
    """bench/exllamav3_h200/kld_artifacts.py: the H200 study's KLD step, on the fake worker."""
    import importlib.util

    import autotune_plugins.exllamav3 as exllamav3_plugin
    from tests.conftest import REPO, plugin_registered

    spec = importlib.util.spec_from_file_location(
        "kld_artifacts", REPO / "bench" / "exllamav3_h200" / "kld_artifacts.py"
    )
    kld_artifacts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(kld_artifacts)
    study = write_study(tmp_path, ["tiny-exl3-3.0", "tiny-exl3-5.0"])
    out_json, out_md = tmp_path / "kld.json", tmp_path / "kld.md"
    with plugin_registered(exllamav3_plugin, "exllamav3"):
        assert kld_artifacts.main([str(study), "--json", str(out_json), "--md", str(out_md)]) == 0
    rows = {(r["weights"], r["cache_type"]): r for r in json.loads(out_json.read_text())}
    assert set(rows) == {(w, c) for w in ("tiny-exl3-3.0", "tiny-exl3-5.0") for c in ("fp16", "k4v4")}
    assert {(r["reference"], r["reference_cache_type"]) for r in rows.values()} == {(str(dirs["source"]), "fp16")}
    assert rows[("tiny-exl3-3.0", "fp16")]["kld_mean"] > rows[("tiny-exl3-5.0", "fp16")]["kld_mean"] > 0
    assert len(out_md.read_text().splitlines()) == 2 + 4 + 2


# ------------------------------------------------------------------ what the worker asks of exllamav3


class _Rows(np.ndarray):
    """A numpy array with the few tensor methods the forward pass calls."""

    def float(self):
        return self.astype(np.float32)

    def cpu(self):
        return self

    def numpy(self):
        return np.asarray(self)


class _FakeTorch:
    long = np.int64

    @staticmethod
    def tensor(data, dtype):
        return np.asarray(data, dtype=dtype)

    @staticmethod
    def inference_mode():
        import contextlib

        return contextlib.nullcontext()

    @staticmethod
    def log_softmax(x, dim):
        x = np.asarray(x, dtype=np.float64)
        x = x - x.max(axis=dim, keepdims=True)
        return (x - np.log(np.exp(x).sum(axis=dim, keepdims=True))).view(_Rows)


class _FakeExl3Model:
    """Records the calls; its head is padded past the vocabulary, as exllamav3 pads it."""

    def __init__(self, modules=()):
        self.calls: list[tuple[str, list[int], dict]] = []
        self.modules = list(modules)

    def __iter__(self):
        return iter(self.modules)

    def prefill(self, x, params):
        self.calls.append(("prefill", x.tolist(), dict(params)))

    def forward(self, x, params):
        self.calls.append(("forward", x.tolist(), dict(params)))
        logits = np.zeros((1, x.shape[1], 520))
        logits[0, :, 515] = 100.0  # a padding column: cropped away, never part of a distribution
        return logits.view(_Rows)


def test_the_forward_pass_asks_exllamav3_for_one_sequence_in_the_cache():
    from autotune.errors import ConfigError
    from autotune_plugins.exllamav3.worker_scoring import exllamav3_forward

    model, cache = _FakeExl3Model(), object()
    forward = exllamav3_forward(_FakeTorch, model, cache, 512, 768)
    assert forward([5, 6, 7], 0, False) is None
    rows = forward([8, 9], 3, True)
    assert rows.shape == (2, 512)
    np.testing.assert_allclose(rows, np.log(1 / 512))  # the padded head's column 515 is not there
    (op1, ids1, p1), (op2, ids2, p2) = model.calls
    assert (op1, ids1, op2, ids2) == ("prefill", [[5, 6, 7]], "forward", [[8, 9]])
    for params, past in ((p1, 0), (p2, 3)):
        assert params == {"attn_mode": "flash_attn", "cache": cache, "batch_shape": (1, 768), "past_len": past}
    with pytest.raises(ConfigError, match="exceed the scorer's cache of 768"):
        forward([1] * 10, 760, True)

    class Recurrent:
        key, caps = "model.layers.0.linear_attn", {"recurrent_cache": True}

    with pytest.raises(ConfigError, match="linear_attn and 0 more layers keep a recurrent state"):
        exllamav3_forward(_FakeTorch, _FakeExl3Model([Recurrent()]), cache, 512, 768)
