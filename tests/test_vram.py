"""autotune.engine.vram: the engine-neutral memory model, and a study learning from measured peaks."""

from __future__ import annotations


import optuna
import pytest

from autotune.engine.backend import MemoryEstimate, Measurement, StudyContext, TrialConfig
from autotune.config import load_study_config
from autotune.errors import ConfigError
from autotune.engine.cache_types import kv_bytes_per_token
from autotune_plugins.llama_server.formats import gguf_file_weights
from autotune.modelfiles.models import get_model, model_from_gguf
from autotune.study import StudyRunner, prepare_study, run_study
from autotune.engine.vram import GraphBuffers, SlotLayout, apply_correction, kv_cache_bytes, learned_correction
from autotune.engine.parts import part
from tests.fake_backends import ForwardingPredictor
from tests.conftest import shared_file
from tests.fake_backends import GIB, FakeBackend, registered, stats_for, write_study

MiB = 2**20


def test_gguf_file_weights_are_the_tensor_table(tmp_path):
    import gguf

    path = shared_file("models/stories260K.gguf")
    w = gguf_file_weights(path)
    reader = gguf.GGUFReader(path)
    assert w.total_bytes == sum(int(t.n_bytes) for t in reader.tensors)
    assert w.embedding_bytes == 512 * 64 * 4  # token_embd, F32
    assert len(w.per_layer_bytes) == 5 and len(set(w.per_layer_bytes)) == 1
    assert not w.embedding_on_gpu  # llama.cpp's input layer stays in host memory
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"PK\x03\x04 not a gguf")
    with pytest.raises(ConfigError, match=r"x\.gguf: not a GGUF file"):
        gguf_file_weights(bad)
    with pytest.raises(ConfigError, match="missing.gguf: no such file"):
        gguf_file_weights(tmp_path / "missing.gguf")


def test_the_memory_model_reads_no_files():
    import ast

    import autotune.engine.vram as vram

    tree = ast.parse(open(vram.__file__, encoding="utf-8").read())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    called = {getattr(n.func, "attr", getattr(n.func, "id", None)) for n in ast.walk(tree) if isinstance(n, ast.Call)}
    assert not imported & {"gguf", "os", "pathlib", "io", "autotune.modelfiles.gguf_file"}
    assert not called & {"open", "stat", "read_gguf", "GGUFReader", "read_bytes", "read_text"}


def test_slot_layouts():
    per_slot = SlotLayout(pad=256)
    assert per_slot.cells(600, 2) == 2 * 768  # each slot padded on its own
    assert SlotLayout(pad=256, unified=True).cells(600, 2) == 1280  # one pool, padded once
    assert SlotLayout().cells(600, 2) == 1200  # ExLlamaV2-like: max_seq_len x batch


def test_kv_bytes_follow_the_cache_type_and_sliding_window(engine_plugins):
    model = get_model("qwen2.5-7b")
    f16, cells, _ = kv_cache_bytes(model, "f16", 4096, 4, SlotLayout(pad=256))
    q8, _, _ = kv_cache_bytes(model, "q8_0", 4096, 4, SlotLayout(pad=256))
    assert cells == 4 * 4096
    assert f16 == 28 * 4 * 128 * 2 * 2 * cells  # layers x kv heads x head dim x (K+V) x 2 bytes
    assert q8 * 2 * 32 == f16 * 34  # q8_0: 34 bytes per 32 values
    swa = model.__class__(**{**model.__dict__, "sliding_window": 1024, "n_swa_layers": 14})
    windowed, _, how = kv_cache_bytes(swa, "f16", 8192, 1, SlotLayout(pad=256))
    expected = kv_bytes_per_token(swa, "f16", n_layers=14) * 8192 + kv_bytes_per_token(swa, "f16", n_layers=14) * 1024
    assert windowed == int(expected) and "sliding-window" in how


def test_graph_buffers_take_the_larger_phase():
    model = model_from_gguf(shared_file("models/stories260K.gguf"))
    g = GraphBuffers(ffn_coef=3, hidden_coef=4, attn_hidden_coef=5)
    fused = g.bytes(model, 4096, 512, True)
    unfused = g.bytes(model, 4096, 512, False)
    assert fused == 512 * (3 * model.ffn_size + 4 * model.hidden_size) * 4 + 4096 * 512 * 2
    assert unfused == 512 * 4096 * model.n_heads * 4 + 512 * 5 * model.hidden_size * 4 + 4096 * 512 * 4
    assert g.bytes(model, 4096, 256, True) < fused  # a smaller ubatch, a smaller buffer


def test_learned_correction_is_a_median_that_only_raises():
    assert learned_correction([]) is None
    assert learned_correction([100, 300, 10_000]) == 300  # one outlier does not move it
    assert learned_correction([-500, -400]) == 0  # over-prediction is kept: it is the safe side
    est = MemoryEstimate(1, 2, 3, 4)
    assert apply_correction(est, None, 0) is est
    corrected = apply_correction(est, 10 * MiB, 3)
    assert corrected.total_bytes == est.total_bytes + 10 * MiB and "3 measured trials" in corrected.notes[-1]


class HungryBackend(FakeBackend):
    """Uses 2 GiB more than it predicts, as a backend with an unknown CUDA context would."""

    name = "fake-hungry"

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        return MemoryEstimate(weights_bytes=GIB, kv_bytes=4 * GIB * config.parallel, buffers_bytes=0, overhead_bytes=0)

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:
        self._log(config)
        peak = self.estimate_memory(config, ctx).total_bytes + 2 * GIB
        return Measurement(metrics=stats_for(self.speed(config), config.parallel), peak_vram_bytes=peak)


def test_a_study_learns_its_backends_overhead(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    backend = HungryBackend()
    path = write_study(tmp_path / "b.toml", "fake-hungry", ["w"], parallel=(1, 2, 3))
    with registered(backend):
        # One measured trial at parallel 1 teaches the study that the backend needs 2 GiB more.
        runner = StudyRunner(prepare_study(load_study_config(path), storage=storage))
        runner.study.enqueue_trial(runner.prepared.space.params_of(TrialConfig("fake-hungry", "w", 4096, 1)))
        run_study(load_study_config(path), n_trials=1, storage=storage)
        assert [c.parallel for c in backend.calls] == [1]
        # parallel 3: 13 GiB predicted by the backend, under the 14.25 GiB budget; 15 GiB really.
        runner = StudyRunner(prepare_study(load_study_config(path), storage=storage))
        ctx = runner.prepared.contexts["fake-hungry"]
        p3 = TrialConfig("fake-hungry", "w", 4096, 3)
        assert backend.estimate_memory(p3, ctx).total_bytes <= ctx.vram_budget_bytes
        estimate, raw = runner.judge.memory(p3)
        assert raw == 13 * GIB and estimate.total_bytes == 15 * GIB  # learned from the storage
        assert "learned from 1 measured trial" in estimate.notes[-1]
        assert not runner.admissible(p3)
        summary = run_study(load_study_config(path), n_trials=5, storage=storage)
    launched = {c.parallel for c in backend.calls}
    assert launched == {1, 2} and summary.n_failed == 0
    study = optuna.load_study(study_name="fake-study", storage=storage)
    measured = [
        t for t in study.trials if "vram_residual_bytes" in t.user_attrs and "answered_from" not in t.user_attrs
    ]
    assert all(t.user_attrs["vram_residual_bytes"] == 2 * GIB for t in measured)
    # After the first, every prediction carried the correction and was exact.
    assert all(abs(t.user_attrs["vram_prediction_error"]) < 1e-9 for t in measured[1:])


def test_a_study_resumed_with_other_choices_is_refused_up_front(tmp_path):
    storage = f"sqlite:///{tmp_path / 's.db'}"
    with registered(FakeBackend()):
        run_study(
            load_study_config(write_study(tmp_path / "a.toml", "fake", ["w"], parallel=(1,))),
            n_trials=1,
            storage=storage,
        )
        with pytest.raises(
            ConfigError, match=r"other choices for parallel: stored \[1\], file \[1, 2\].*new \[study\] name"
        ):
            run_study(
                load_study_config(write_study(tmp_path / "b.toml", "fake", ["w"], parallel=(1, 2))),
                n_trials=1,
                storage=storage,
            )


class PredictingHungryBackend(HungryBackend):
    """The hungry backend with a model of itself, so the prior can rank its configurations."""

    predictor = part(ForwardingPredictor)

    name = "fake-hungry"

    def predict(self, config: TrialConfig, ctx: StudyContext):
        return {"aggregate_tok_s": self.speed(config), "decode_tok_s": 10.0, "per_user_tok_s": 10.0}


def test_one_judge_refuses_over_budget_only_after_the_learned_correction(tmp_path):
    # parallel 3 is 13 GiB by the raw model (under the 14.25 GiB budget) and 15 GiB really.
    from autotune.study.explain import explain_best
    from autotune.study import judge_for, rank_by_prior

    storage = f"sqlite:///{tmp_path / 's.db'}"
    path = write_study(tmp_path / "b.toml", "fake-hungry", ["w"], parallel=(1, 2, 3))
    p3 = TrialConfig("fake-hungry", "w", 4096, 3, (("mode", "plain"),))
    with registered(PredictingHungryBackend()):
        prepared = prepare_study(load_study_config(path), storage=storage)
        before = judge_for(prepared, None)
        assert before.judge(p3).admitted
        assert p3.key in {c.key for c, _ in rank_by_prior(prepared, before)}

        runner = StudyRunner(prepared)
        runner.study.enqueue_trial(
            prepared.space.params_of(TrialConfig("fake-hungry", "w", 4096, 2, (("mode", "plain"),)))
        )
        runner.run(n_trials=1)  # measures parallel 2: 2 GiB over its prediction

        # The runner, the prior and the report all ask the judge with what the storage learned.
        after = judge_for(prepared, runner.study)
        verdicts = {after.judge(p3).kind, runner.judge.judge(p3).kind}
        assert verdicts == {"over_budget"}
        assert not runner.admissible(p3)
        assert p3.key not in {c.key for c, _ in rank_by_prior(prepared, after)}
        best = {"params": TrialConfig("fake-hungry", "w", 4096, 2, (("mode", "plain"),)).as_dict(), "values": [1.0]}
        why = {line.split(":")[0]: line for line in explain_best(prepared, runner.study, best)}
        assert why["parallel 3"].startswith("parallel 3: does not fit: needs 15.00 GiB")
