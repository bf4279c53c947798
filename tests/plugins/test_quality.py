"""The quality plugin without an engine: data, seeded subsets, lm-eval tasks and prompts, the
penalty in a study, and the refusals (no scoring API, lm-eval missing, bad [quality] table).

A scripted scorer stands in for an engine: it knows each question's answer, so accuracies and
drops are exact and the tests can check lm-eval's arithmetic and the study's bookkeeping.
"""

from __future__ import annotations

import importlib.util
import io
import re
import zlib
from pathlib import Path
from typing import Any, Sequence

import click
import numpy as np
import optuna
import pytest
from click.testing import CliRunner

from autotune.engine.backend import StudyContext
from autotune.config import load_study_config
from autotune.errors import ConfigError
from autotune.engine.scoring import LogLikelihood, Scorer
from autotune.study import prepare_study, run_study
from autotune.study.records import TrialRecord
from tests.conftest import plugin_registered
from tests.fake_backends import FakeBackend, registered, write_study

import autotune_plugins.quality as quality_plugin
from autotune_plugins.quality import benchmarks, metrics, tasks
from autotune_plugins.quality.commands import add_quality_command
from autotune_plugins.quality.progress import QualityProgress, format_seconds
from autotune.engine.parts import part
from tests.fake_backends import ForwardingScoring

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("lm_eval") is None, reason="lm-eval is not installed (pip install -e '.[test]')"
)


def answer_table(benchmark: str) -> dict[str, int]:
    """The prompt text of every shipped question (as lm-eval's doc_to_text renders it) -> answer."""
    render = tasks._doc_to_text(tasks.ANSWER_CUE[benchmark])
    return {render(doc): doc["answer"] for docs in benchmarks.load_items(benchmark).values() for doc in docs}


class ScriptedScorer(Scorer):
    """Picks the right answer (``exact``), always " A" (``always-a``), or the right one except on
    about one item in K (``miss-K``, by a hash of the question); records every context."""

    n_vocab = 8
    n_ctx = 4096

    def __init__(self, mode: str, benchmark: str = "mmlu"):
        self.mode = mode
        self.table = answer_table(benchmark)
        self.contexts: list[str] = []
        self.description = f"scripted {mode}"

    def tokenize(self, text: str, *, add_bos: bool = False) -> list[int]:
        return [1] * add_bos + [ord(c) % self.n_vocab for c in text]

    def loglikelihood(self, requests: Sequence[tuple[str, str]]) -> list[LogLikelihood]:
        out = []
        for context, continuation in requests:
            self.contexts.append(context)
            text, answer = next((text, a) for text, a in self.table.items() if context.endswith(text))
            if self.mode.startswith("miss-") and zlib.crc32(text.encode()) % int(self.mode[5:]) == 0:
                answer = (answer + 1) % 4
            wanted = "ABCD"[answer] if self.mode != "always-a" else "A"
            hit = continuation.strip() == wanted
            out.append(LogLikelihood(0.0 if hit else -5.0, hit, 1))
        return out

    def next_token_logprobs(self, tokens: Sequence[int]) -> np.ndarray:
        shift = {"exact": 0.0, "always-a": 1.0}.get(self.mode, 0.0)
        if self.mode.startswith("miss-"):
            shift = 2.0 / int(self.mode[5:])
        logits = np.tile(np.arange(self.n_vocab, dtype=np.float64) * (1.0 + shift), (len(tokens), 1))
        return (logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))).astype(np.float32)


class ScoringFakeBackend(FakeBackend):
    """The fake backend with a scoring API: the weights name says how well the artifact answers."""

    scoring = part(ForwardingScoring)

    name = "fake-scoring"
    opened: list[str] = []

    def scorer(self, weights: str, cache_type: str | None, ctx: StudyContext) -> Scorer:
        self.opened.append(weights)
        return ScriptedScorer(weights)


@pytest.fixture
def quality_registered():
    with plugin_registered(quality_plugin, "quality"):
        yield quality_plugin


# ------------------------------------------------------------------------------ data and subsets


def test_shipped_samples_have_every_subject_with_ten_items_and_five_dev():
    for name, n_subjects in (("mmlu", 57), ("ceval", 52)):
        items, dev = benchmarks.load_items(name), benchmarks.load_items(name, "dev")
        assert len(items) == n_subjects and set(dev) == set(items)
        assert {len(v) for v in items.values()} == {10} and {len(v) for v in dev.values()} == {5}
    data = benchmarks.data_dir()
    for licence in ("LICENSE-MMLU.txt", "LICENSE-CEVAL.txt", "SOURCES.md"):
        assert (data / licence).stat().st_size > 500
    assert "BY-NC-SA 4.0" in (data / "LICENSE-CEVAL.txt").read_text(encoding="utf-8")


def test_full_sets_ship_with_every_sample_item_in_them():
    for name, rows, n_subjects in (("mmlu", 13978, 57), ("ceval", 1346, 52)):
        full = benchmarks.full_items(name)
        assert len(full) == rows and len({r["subject"] for r in full}) == n_subjects
        sample = [d for docs in benchmarks.load_items(name).values() for d in docs]
        ids = benchmarks.item_ids(name, sample)
        assert len(set(ids)) == len(sample)
        assert all(full[i]["question"] == d["question"] for i, d in zip(ids, sample))
    text = (benchmarks.data_dir() / "LICENSE-CEVAL.txt").read_text(encoding="utf-8")
    assert "ceval_val.jsonl.gz" in text
    assert "mmlu_test.jsonl.gz" in (benchmarks.data_dir() / "SOURCES.md").read_text(encoding="utf-8")


def test_stratified_order_takes_one_item_per_subject_per_round():
    order = benchmarks.stratified_order("ceval", "full", 5, seed=1)
    assert sorted(order) == list(range(1346))  # every item, once
    full = benchmarks.full_items("ceval")
    assert len({full[i]["subject"] for i in order[:52]}) == 52  # the first batch covers every subject
    assert order == benchmarks.stratified_order("ceval", "full", 5, seed=1)
    assert order != benchmarks.stratified_order("ceval", "full", 5, seed=2)
    sample = benchmarks.stratified_order("mmlu", "sample", 2, seed=0)
    chosen = benchmarks.subset("mmlu", 2, seed=0)
    assert sorted(sample) == sorted(benchmarks.item_ids("mmlu", [d for docs in chosen.values() for d in docs]))


def test_subset_is_seeded_per_subject_and_deterministic():
    a = benchmarks.subset("mmlu", 3, seed=7)
    assert a == benchmarks.subset("mmlu", 3, seed=7)
    assert {len(v) for v in a.values()} == {3}
    assert a != benchmarks.subset("mmlu", 3, seed=8)
    full = benchmarks.load_items("mmlu")
    for subject, docs in a.items():  # drawn from the subject itself, in file order
        positions = [full[subject].index(d) for d in docs]
        assert positions == sorted(positions)


def test_subset_outside_what_ships_is_refused():
    with pytest.raises(Exception, match=r"per_subject 11: mmlu ships 10 items per subject \(use 1..10\)"):
        benchmarks.subset("mmlu", 11, seed=0)


# ------------------------------------------------------------------------------ lm-eval tasks


def test_zero_shot_accuracy_is_exact_through_lm_eval():
    exact = tasks.evaluate_benchmark(ScriptedScorer("exact"), "mmlu", per_subject=2, shots=0, seed=3)
    assert (exact.value, exact.n) == (1.0, 114)
    always_a = tasks.evaluate_benchmark(ScriptedScorer("always-a"), "mmlu", per_subject=2, shots=0, seed=3)
    chosen = [d for docs in benchmarks.subset("mmlu", 2, seed=3).values() for d in docs]
    expected = sum(d["answer"] == 0 for d in chosen) / len(chosen)
    assert always_a.value == pytest.approx(expected)
    assert always_a.stderr == pytest.approx((expected * (1 - expected) / (len(chosen) - 1)) ** 0.5)
    assert sum(always_a.details["subjects"].values()) / 57 == pytest.approx(expected)


def test_five_shot_prompt_is_the_standard_mmlu_format_with_the_subjects_dev_items():
    scorer = ScriptedScorer("exact")
    tasks.evaluate_benchmark(scorer, "mmlu", per_subject=1, shots=5, seed=0)
    dev = benchmarks.load_items("mmlu", "dev")["astronomy"]
    prompt = next(c for c in scorer.contexts if "about astronomy" in c)
    assert prompt.startswith("The following are multiple choice questions (with answers) about astronomy.\n\n")
    first = dev[0]
    shot = (
        f"{first['question']}\nA. {first['choices'][0]}\nB. {first['choices'][1]}\nC. {first['choices'][2]}"
        f"\nD. {first['choices'][3]}\nAnswer: {'ABCD'[first['answer']]}\n\n"
    )
    assert shot in prompt
    assert prompt.count("\nAnswer:") == 6 and prompt.endswith("\nAnswer:")


def test_ceval_prompt_is_the_standard_chinese_format():
    scorer = ScriptedScorer("exact", "ceval")
    value = tasks.evaluate_benchmark(scorer, "ceval", per_subject=1, shots=0, seed=0)
    assert (value.value, value.n) == (1.0, 52)
    prompt = next(c for c in scorer.contexts if "计算机网络" in c)
    assert prompt.startswith("以下是中国关于计算机网络考试的单项选择题，请选出其中的正确答案。\n\n")
    assert prompt.endswith("\n答案：")


def test_tasks_need_no_network(monkeypatch):
    import datasets

    def no_hub(*args: Any, **kwargs: Any):
        raise AssertionError("datasets.load_dataset was called")

    monkeypatch.setattr(datasets, "load_dataset", no_hub)
    built = tasks.build_tasks("ceval", per_subject=2, shots=2, seed=0)
    assert len(built) == 52 and all(len(t.eval_docs) == 2 for t in built.values())


# ------------------------------------------------------------------------------ metrics


def test_metrics_register_and_refuse_a_backend_without_scoring(quality_registered):
    from autotune import plugins

    found = plugins.get_metrics()
    assert {"mmlu", "ceval", "kld"} <= set(found)
    assert found["kld"].higher_is_better is False
    why = found["mmlu"].supports(FakeBackend())
    assert why == "backend 'fake' has no scoring API (it declares no scoring part)"
    assert found["mmlu"].supports(ScoringFakeBackend()) is None


def test_benchmark_metric_says_when_lm_eval_is_missing(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    assert (
        metrics.MmluMetric().supports(ScoringFakeBackend())
        == "lm-eval is not installed: pip install 'autotune[quality]'"
    )


def test_benchmark_metric_says_when_data_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(benchmarks, "data_dir", lambda: tmp_path)
    benchmarks._read_jsonl.cache_clear()
    try:
        why = metrics.CevalMetric().supports(ScoringFakeBackend())
    finally:
        benchmarks._read_jsonl.cache_clear()
    assert why.startswith(f"{tmp_path / 'ceval_sample.jsonl'}: benchmark data missing")


def test_cache_key_is_what_quality_depends_on(tmp_path):
    from autotune.engine.backend import TrialConfig

    a, b = tmp_path / "a.gguf", tmp_path / "b.gguf"
    a.write_bytes(b"GGUF" + b"\0" * 100)
    b.write_bytes(b"GGUF" + b"\1" * 100)
    ctx = StudyContext(gpu=None, model=None, workload=None, vram_budget_bytes=0, protocol=None, base_dir=tmp_path)
    m = metrics.MmluMetric()
    key = lambda w, ctx_len=512, parallel=1, cache="f16": m.cache_key(
        TrialConfig("x", w, ctx_len, parallel, (("cache_type", cache),)), FakeBackend(), ctx
    )
    assert key("a.gguf") == key("a.gguf", ctx_len=4096, parallel=4)  # ctx and parallel do not matter
    assert key("a.gguf") != key("b.gguf")  # content does
    assert key("a.gguf") != key("a.gguf", cache="q8_0")  # the KV cache does
    m.configure({"shots": 0}, {})
    assert "shots=0" in key("a.gguf")  # the prompt does
    # Results are stored per item under full-set ids: which items a study samples is not part
    # of what one item's answer depends on.
    same = key("a.gguf")
    m.configure({"shots": 0, "per_subject": 2, "seed": 9, "pool": "full"}, {})
    assert key("a.gguf") == same


# ------------------------------------------------------------------------------ studies


def quality_study(
    tmp_path: Path, objective: str, quality_table: str = "[quality]\nper_subject = 1\nshots = 0\n"
) -> Path:
    path = write_study(tmp_path / "study.toml", "fake-scoring", ["exact", "always-a"], parallel=(1, 2))
    text = path.read_text(encoding="utf-8") + objective + "\n" + quality_table
    path.write_text(text, encoding="utf-8")
    return path


def test_study_measures_each_artifact_once_and_records_the_penalty(
    tmp_path, tmp_storage, quality_registered, monkeypatch
):
    evaluated: list[str] = []
    original = metrics.MmluMetric.evaluate_items

    def counting(self, config, backend, ctx, items):
        evaluated.append(config.weights)
        return original(self, config, backend, ctx, items)

    monkeypatch.setattr(metrics.MmluMetric, "evaluate_items", counting)
    path = quality_study(tmp_path, 'quality = "mmlu"\npenalty_per_point = 0.5\nreference_weights = "exact"\n')
    with registered(ScoringFakeBackend(), name="scoring-fakes"):
        summary = run_study(load_study_config(path), n_trials=6, storage=tmp_storage)
    assert summary.n_complete == 4  # 2 weights x 2 parallel
    assert sorted(evaluated) == ["always-a", "exact"]  # once per artifact, not per trial
    chosen = [d for docs in benchmarks.subset("mmlu", 1, seed=0).values() for d in docs]
    always_a = sum(d["answer"] == 0 for d in chosen) / len(chosen)
    study = optuna.load_study(study_name="fake-study", storage=tmp_storage)
    complete = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(complete) == 4
    for t in complete:
        q, score = TrialRecord.of(t).quality, TrialRecord.of(t).score
        expected_drop = 0.0 if TrialRecord.of(t).config["weights"] == "exact" else (1.0 - always_a) * 100
        assert q["drop_points"] == pytest.approx(expected_drop)
        assert q["n"] == q["items_used"] == 57 and q["reference_value"] == 1.0
        # Paired: the reference answers every item right, so the items always-a gets wrong are
        # the discordant ones (McNemar), with 0.5 added to each discordant count.
        wrong = round(57 * (1 - always_a)) if expected_drop else 0
        assert q["drop_stderr_points"] == pytest.approx(100 * (((wrong + 1) - wrong**2 / 57) / (57 * 56)) ** 0.5)
        # What two accuracies' errors in quadrature said before: larger.
        assert q["unpaired_stderr_points"] == pytest.approx(
            100 * (always_a * (1 - always_a) / 56) ** 0.5 if expected_drop else 0.0
        )
        assert q["verdict"] is None and q["decided_by"] == "no bound"
        assert score["penalty"] == pytest.approx(0.5 * expected_drop)
        assert score["values"][0] == pytest.approx(score["throughput"] - score["penalty"])


def test_sequential_study_decides_each_artifact_with_the_items_it_needs(tmp_path, tmp_storage, quality_registered):
    # always-a loses ~75 points: over the 5-point bound after the first batch (one item per
    # subject). exact against itself: no drop, but within only once the interval is narrow
    # enough, at the second batch.
    path = quality_study(
        tmp_path,
        'quality = "mmlu"\nmax_drop_points = 5\nreference_weights = "exact"\n',
        "[quality]\nper_subject = 2\nshots = 0\n",
    )
    with registered(ScoringFakeBackend(), name="scoring-fakes"):
        summary = run_study(load_study_config(path), n_trials=6, storage=tmp_storage)
    study = optuna.load_study(study_name="fake-study", storage=tmp_storage)
    by_weights = {d["weights"]: d for d in summary.extra["quality_decisions"]}
    assert by_weights["always-a"]["verdict"] == "over" and by_weights["always-a"]["items_used"] == 57
    assert by_weights["exact"]["verdict"] == "within" and by_weights["exact"]["items_used"] == 114
    for t in study.trials:
        q = TrialRecord.of(t).quality
        if TrialRecord.of(t).config["weights"] == "always-a":
            assert t.state == optuna.trial.TrialState.PRUNED
            assert "over the bound" in TrialRecord.of(t).prune_reason
        elif t.state == optuna.trial.TrialState.COMPLETE:
            assert (q["verdict"], q["items_used"], q["admitted"]) == ("within", 114, True)
            assert q["drop_stderr_points"] < q["unpaired_stderr_points"] or q["unpaired_stderr_points"] == 0
            assert TrialRecord.of(t).score["feasible"]
    assert "quality" in summary.extra["quality_power"] and "items per candidate" in summary.extra["quality_power"]
    from autotune.report.text import summary_text

    text = summary_text(summary)
    assert "always-a: refused (paired): over the bound" in text and "exact: admitted (paired): within the bound" in text


@pytest.mark.parametrize("policy, admitted", [("reject", False), ("accept", True)])
def test_an_undecided_configuration_is_treated_by_the_stated_policy(
    tmp_path, tmp_storage, quality_registered, policy, admitted
):
    chosen = [d for docs in benchmarks.subset("mmlu", 1, seed=0).values() for d in docs]
    drop = 100 * (1 - sum(d["answer"] == 0 for d in chosen) / len(chosen))
    # A bound right at always-a's drop: no sample of the 57-item pool can tell which side it is.
    path = quality_study(
        tmp_path,
        f'quality = "mmlu"\nmax_drop_points = {drop:.3f}\nreference_weights = "exact"\n',
        f'[quality]\nper_subject = 1\nshots = 0\nundecided = "{policy}"\n',
    )
    with registered(ScoringFakeBackend(), name="scoring-fakes"):
        summary = run_study(load_study_config(path), n_trials=6, storage=tmp_storage)
    d = {d["weights"]: d for d in summary.extra["quality_decisions"]}["always-a"]
    assert (d["verdict"], d["items_used"], d["stopped_by"]) == ("undecided", 57, "items")
    assert d["admitted"] is admitted and d["decided_by"] == f"policy {policy}"
    study = optuna.load_study(study_name="fake-study", storage=tmp_storage)
    states = {
        t.state
        for t in study.trials
        if TrialRecord.of(t).config["weights"] == "always-a" and "answered_from" not in t.user_attrs
    }
    reasons = [TrialRecord.of(t).prune_reason for t in study.trials]
    assert states == {optuna.trial.TrialState.COMPLETE if admitted else optuna.trial.TrialState.PRUNED}, reasons


def test_undecided_kld_policy_maps_kld_to_a_drop_fitted_on_the_other_artifacts(
    tmp_path, tmp_storage, quality_registered
):
    from autotune.study.quality import QualityBook

    weights = ["exact", "miss-2", "miss-12", "miss-5"]  # 0, 32, 4 and 16 of the 57 items answered wrong
    path = write_study(tmp_path / "study.toml", "fake-scoring", weights, parallel=(1,))
    bound = 20.0
    path.write_text(
        path.read_text(encoding="utf-8") + f'quality = "mmlu"\nmax_drop_points = {bound}\n'
        'reference_weights = "exact"\n\n[quality]\nper_subject = 1\nshots = 0\nundecided = "kld"\n',
        encoding="utf-8",
    )
    with registered(ScoringFakeBackend(), name="scoring-fakes"):
        prepared = prepare_study(load_study_config(path), storage=tmp_storage)
        assert prepared.quality_proxy is not None and prepared.quality_proxy.name == "kld"
        book = QualityBook(prepared, None)
        configs = {c.weights: c for c in prepared.space.enumerate()}
        out = {w: book.trial_quality(configs[w]) for w in weights[:-1]}
        assert {w: q["verdict"] for w, q in out.items()} == {"exact": "within", "miss-2": "over", "miss-12": "within"}
        # Every candidate's KLD is measured (the relation's points); it grows as misses grow.
        assert out["exact"]["kld"] == pytest.approx(0.0, abs=1e-9) and out["miss-2"]["kld"] > out["miss-12"]["kld"] > 0
        last = book.trial_quality(configs["miss-5"])
    decision = book._local[book._decision_attr(configs["miss-5"])]
    assert last["verdict"] == "undecided" and last["decided_by"] == "kld"
    from autotune.study import paired

    fitted = paired.fit_kld_relation([out[w]["kld"] for w in out], [out[w]["drop_points"] for w in out])
    assert decision["kld_relation"]["n"] == 3 and decision["kld_relation"]["slope_points_per_nat"] == pytest.approx(
        fitted.slope
    )
    expected, se = fitted.expected_drop(last["kld"])
    assert decision["kld_expected_drop_points"] == pytest.approx(expected)
    assert last["admitted"] is (expected + fitted.t * se < bound)
    assert "fitted on 3 artifacts" in last["how"]


def test_require_quality_refuses_a_backend_without_scoring(tmp_path, tmp_storage, quality_registered):
    path = write_study(tmp_path / "study.toml", "fake", ["w1", "w2"])
    path.write_text(path.read_text(encoding="utf-8") + 'quality = "mmlu"\nmax_drop_points = 1\n', encoding="utf-8")
    with registered(FakeBackend(), name="plain-fakes"):
        with pytest.raises(ConfigError) as err:
            prepare_study(load_study_config(path), storage=tmp_storage)
    assert "[objective] quality = 'mmlu' cannot evaluate backend 'fake': backend 'fake' has no scoring API" in str(
        err.value
    )


def test_require_quality_refuses_when_lm_eval_is_missing(tmp_path, tmp_storage, quality_registered, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lm_eval" else real(name, *a))
    path = quality_study(tmp_path, 'quality = "ceval"\n')
    with registered(ScoringFakeBackend(), name="scoring-fakes"):
        with pytest.raises(ConfigError, match="lm-eval is not installed"):
            prepare_study(load_study_config(path), storage=tmp_storage)


def test_require_quality_refuses_an_unknown_metric(tmp_path, tmp_storage, quality_registered):
    path = quality_study(tmp_path, 'quality = "mmlu-pro"\n')
    with registered(ScoringFakeBackend(), name="scoring-fakes"):
        with pytest.raises(
            ConfigError, match=r"\[objective\] quality = 'mmlu-pro': metric 'mmlu-pro' is not installed"
        ):
            prepare_study(load_study_config(path), storage=tmp_storage)


def test_quality_table_errors_are_all_reported(tmp_path):
    path = quality_study(tmp_path, 'quality = "mmlu"\n', "[quality]\nper_subject = 0\nshots = 9\nsubjects = 3\n")
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    lines = str(err.value).splitlines()
    assert f"{path}: [quality] per_subject = 0: must be 1..10" in lines
    assert f"{path}: [quality] shots = 9: must be 0..5" in lines
    assert (
        f"{path}: [quality] subjects: unknown field (known: batch, expected_agreement, max_items, max_seconds, "
        f"per_subject, pool, seed, shots, undecided)"
    ) in lines


def test_quality_command_on_a_backend_without_scoring(twin_plugin, quality_registered):
    group = click.Group("autotune")
    add_quality_command(group)
    result = CliRunner().invoke(
        group, ["quality", "--backend", "twin-llama.cpp", "--weights", "Q4_K_M", "--benchmark", "mmlu"]
    )
    assert result.exit_code == 2, result.output
    assert "--benchmark mmlu: backend 'twin-llama.cpp' has no scoring API" in result.output


class FileScoringBackend(ScoringFakeBackend):
    """Checks its weights as file backends do, in the words llama-server uses inside a study."""

    name = "fake-file-scoring"

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        p = ctx.path(weights)
        return None if p.is_file() else f"{p}: no such file (weights are GGUF paths relative to the study file)"


def _quality(*args: str):
    group = click.Group("autotune")
    add_quality_command(group)
    return CliRunner().invoke(group, ["quality", *args])


def test_quality_command_prints_progress_lines_when_not_a_terminal(quality_registered):
    with registered(ScoringFakeBackend(), name="scoring-fakes"):
        result = _quality(
            "--backend",
            "fake-scoring",
            "--weights",
            "exact",
            "--benchmark",
            "mmlu",
            "--per-subject",
            "1",
            "--shots",
            "0",
        )
    assert result.exit_code == 0, result.output
    lines = result.stderr.splitlines()
    # Said before the model loads, then where it got to (the last line: everything done).
    assert lines[0] == "mmlu exact: 57 items (1 per subject of 57, 0-shot); loading the model and building the tasks"
    assert re.fullmatch(r"mmlu exact: 57/57 items, \d+s elapsed", lines[-1]), lines
    assert "accuracy 100.0%" in result.stdout


def test_progress_lines_say_elapsed_and_time_left_every_few_seconds():
    now = [0.0]
    out = io.StringIO()
    with QualityProgress("mmlu m.gguf", "items", stream=out, every_s=5, tty=False, clock=lambda: now[0]) as p:
        for t, done in ((10, 10), (12, 12), (16, 16), (30, 40)):
            now[0] = t
            p.update(done, 40)
    assert out.getvalue().splitlines() == [
        "mmlu m.gguf: 10/40 items, 10s elapsed, about 30s left",
        "mmlu m.gguf: 16/40 items, 16s elapsed, about 24s left",  # 12/40 came 2 s after the last line
        "mmlu m.gguf: 40/40 items, 30s elapsed",
    ]
    assert format_seconds(185) == "3m05s" and format_seconds(3720) == "1h02m"


def test_quality_missing_weights_are_relative_to_the_current_directory(quality_registered, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with registered(FileScoringBackend(), name="file-scoring-fakes"):
        result = _quality("--backend", "fake-file-scoring", "--weights", "model.gguf", "--benchmark", "mmlu")
    assert result.exit_code == 2
    assert result.stderr.strip() == (
        f"Error: --weights 'model.gguf': no such file or directory (relative to the current directory {tmp_path})"
    )
    assert "study file" not in result.output and "Usage:" not in result.output


def test_quality_errors_are_one_error_line_with_the_cli_exit_statuses(quality_registered):
    result = _quality("--backend", "no-such-backend", "--weights", "x.gguf", "--benchmark", "mmlu")
    assert result.exit_code == 2
    assert result.stderr.startswith("Error: backend 'no-such-backend' is not installed")
    assert "Traceback" not in result.output


def test_a_kld_is_shown_as_a_kld_and_a_drop_as_a_drop(tmp_path, tmp_storage, quality_registered):
    # Issue 28: "+2.56 points" was shown for a KL divergence of 0.0256, and a "+" for a drop.
    from autotune.report.text import summary_text

    path = write_study(tmp_path / "study.toml", "fake-scoring", ["exact", "miss-12", "always-a"], parallel=(1,))
    path.write_text(
        path.read_text(encoding="utf-8") + 'quality = "kld"\nmax_drop_points = 5\nreference_weights = "exact"\n',
        encoding="utf-8",
    )
    with registered(ScoringFakeBackend(), name="scoring-fakes"):
        summary = run_study(load_study_config(path), n_trials=3, storage=tmp_storage)
    study = optuna.load_study(study_name="fake-study", storage=tmp_storage)
    kld = {r.config["weights"]: r.quality for r in map(TrialRecord.of, study.trials)}
    text = summary_text(summary)
    best = summary.best["quality"]
    assert f"  quality: KLD {best['value']:.4f} nats from exact" in text
    over = kld["always-a"]["drop_points"]
    assert over > 5  # its KLD is over 0.05 nats
    assert (
        f"weights always-a: loses too much quality: KLD {over / 100:.4f} nats > max KLD 0.0500 nats (max_drop_points 5)"
    ) in text
    assert not re.search(r"[+-]\d+\.\d+ points", text)


def test_an_accuracy_drop_is_a_drop_and_the_accuracy_a_percentage(tmp_path, tmp_storage, quality_registered):
    from autotune.report.text import summary_text

    path = quality_study(
        tmp_path,
        'quality = "mmlu"\nmax_drop_points = 5\nreference_weights = "exact"\n',
        "[quality]\nper_subject = 2\nshots = 0\n",
    )
    with registered(ScoringFakeBackend(), name="scoring-fakes"):
        summary = run_study(load_study_config(path), n_trials=6, storage=tmp_storage)
    text = summary_text(summary)
    assert "  quality: mmlu accuracy 100.00%, no drop (0.00 points) vs exact (± " in text
    always_a = {d["weights"]: d for d in summary.extra["quality_decisions"]}["always-a"]
    assert f"always-a: refused (paired): over the bound: drop {always_a['drop_points']:.2f} points ± " in text
    assert not re.search(r"[+-]\d+\.\d+ points", text)
