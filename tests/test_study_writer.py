"""`autotune init`'s decisions (autotune/study_writer.py): formats that never fit are left out with
the figures, backends that are not ready are named with their reason, and the file it writes
validates. The engine-backed runs are in tests/plugins/test_made_artifacts_cpu.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import pytest

from autotune import hookimpl
from autotune.modelfiles.artifacts import Recipe
from autotune.engine.backend import BaseBackend, Measurement, MemoryEstimate, Param, StudyContext, TrialConfig
from autotune.config import load_study_config
from autotune.errors import ConfigError
from autotune.engine.formats import weights_for
from autotune.study.prepare import prepare_study
from autotune.study_writer import draft_study, render
from autotune_plugins.llama_server.declarations import GGUF
from autotune.engine.parts import part
from tests.fake_backends import ForwardingArtifacts, ForwardingSplitting
from tests.conftest import plugin_registered


class GgufMaker(BaseBackend):
    """Makes gguf formats; its memory is the predicted weights plus 1 GiB."""

    artifacts = part(ForwardingArtifacts)

    name = "gguf-maker"
    engine = "gguf-engine"
    weight_formats = (GGUF,)  # what init offers it: llama.cpp's GGUF formats

    def artifact_recipe(self, fmt: str, source: Path, ctx: StudyContext) -> Recipe | None:
        if not fmt.startswith("gguf:"):
            return None

        def make(inputs: list[Path], out: Path, say: Callable[[str], None]) -> None:
            out.write_text(fmt)

        return Recipe(fmt, "maker-1", fmt.split(":")[1] + ".gguf", 1, make)

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        return None if weights.startswith("gguf:") else f"{weights}: gguf-maker loads only what it makes"

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        return [Param("cache_type", ("f16", "q8_0"), "cache", accepted=("f16", "q8_0"))]

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        return MemoryEstimate(weights_for(ctx.model, config.weights).total_bytes, 0, 2**30, 0)

    def run(self, config: TrialConfig, ctx: StudyContext) -> Measurement:  # pragma: no cover - not run here
        raise NotImplementedError

    def deploy_command(self, config: TrialConfig, ctx: StudyContext) -> str:
        return "serve"


class Unready(GgufMaker):
    name = "unready"
    engine = "unready-engine"

    def preflight(self, ctx: StudyContext) -> list[str]:
        return ["its engine is not built (run the build)"]  # the caller names the backend


class Plugin:
    @staticmethod
    @hookimpl
    def register_backends(register):
        register(GgufMaker())
        register(Unready())


def test_formats_that_never_fit_are_left_out_with_the_figures(seven_b, tmp_path):
    with plugin_registered(Plugin, "makers"):
        draft = draft_study(str(seven_b), gpu="t4")
        assert draft.candidates == {"gguf-maker": ["gguf:Q8_0", "gguf:Q6_K", "gguf:Q5_K_M", "gguf:Q4_K_M", "gguf:Q4_0"]}
        (f16,) = [why for why in draft.left_out if "gguf:F16" in why]
        assert f16.startswith(
            "gguf-maker: weights gguf:F16 never fit: even ctx 2048 x 1 needs 15.19 GiB (weights 14.19)"
        )
        assert f16.endswith("> budget 14.75 GiB = 15.00 GiB (Tesla T4's memory) - 0.25 GiB safety margin")
        # Named once, by init (issue 28: "backend openai-server: backend openai-server: ...").
        assert "backend unready: its engine is not built (run the build)" in draft.left_out
        # ctx from one request (1024 + 256 tokens) up to the model's own 32768, the short end kept.
        assert draft.ctx == [2048, 4096, 8192, 16384, 32768]
        assert draft.space == {"cache_type": ["f16", "q8_0"]}
        assert draft.quality is None  # no kld metric installed here, and no full-precision format fits
        out = tmp_path / "study.toml"
        text = render(draft, out)
        out.write_text(text)
        assert 'source = "Qwen2.5-7B"' in text and 'gpu = "t4"' in text and "# Left out:" in text
        prepared = prepare_study(load_study_config(out))  # the file validates as `autotune study` reads it
        assert prepared.cfg.model_source == "Qwen2.5-7B" and prepared.contexts["gguf-maker"].source == seven_b


def test_cpu_mode_budget_is_host_memory(seven_b, tmp_path):
    with plugin_registered(Plugin, "makers"):
        draft = draft_study(str(seven_b), gpu="cpu")
    assert draft.gpu.is_cpu and draft.budget_gib is not None
    assert draft.budget_gib * 2**30 <= draft.gpu.vram_bytes  # a share of the host's memory
    out = tmp_path / "s.toml"
    text = render(draft, out)
    assert 'gpu = "cpu"' in text and f"vram_budget_gib = {draft.budget_gib}" in text
    # One budget figure (issue 28 showed 17.7, 17.45 and 17.4): the file says the one the study uses.
    out.write_text(text)
    with plugin_registered(Plugin, "makers"):
        prepared = prepare_study(load_study_config(out), dry_runs=False)
    said = f"{prepared.vram_budget_bytes / 2**30:.2f} GiB"
    assert (
        f"vram_budget_gib = {draft.budget_gib}  # the study's memory budget: {said} after the 256 MiB safety margin"
        in text
    )
    from autotune.report.progress import header_text

    assert "device: CPU: " in header_text(prepared, out) and f"(memory budget {said} = " in header_text(prepared, out)


def test_nothing_that_can_run_is_an_error_listing_why(seven_b):
    class OnlyUnready:
        @staticmethod
        @hookimpl
        def register_backends(register):
            register(Unready())

    with plugin_registered(OnlyUnready, "unready-only"):
        with pytest.raises(
            ConfigError,
            match="no backend here can make a format of this model that fits:\n  backend unready: .*not built",
        ):
            draft_study(str(seven_b), gpu="t4")


def test_a_backend_that_loads_the_source_itself_takes_it_as_its_reference(seven_b, tmp_path):
    class SourceLoader(GgufMaker):
        """Makes only quantized formats, and loads the full-precision source as it is (as
        ExLlamaV2 loads an FP16 directory)."""

        name = "source-loader"
        engine = "loader-engine"

        def artifact_recipe(self, fmt, source, ctx):
            return None if fmt.endswith("F16") else super().artifact_recipe(fmt, source, ctx)

        def check_weights(self, weights, ctx):
            return None if weights.startswith("gguf:") or ctx.path(weights) == ctx.source else "no"

        def estimate_memory(self, config, ctx):
            if config.weights.startswith("gguf:"):
                return super().estimate_memory(config, ctx)
            return MemoryEstimate(2 * ctx.model.n_params, 0, 2**30, 0)

    class Loader:
        @staticmethod
        @hookimpl
        def register_backends(register):
            register(SourceLoader())

    with plugin_registered(Loader, "loader"):
        draft = draft_study(str(seven_b), gpu="h200")
        assert draft.candidates["source-loader"][-1] == str(seven_b)
        out = tmp_path / "s.toml"
        out.write_text(render(draft, out))
        assert '"gguf:Q4_0", "Qwen2.5-7B"]' in out.read_text()
        prepared = prepare_study(load_study_config(out))
        assert prepared.space.entries["source-loader"].weights[-1] == "Qwen2.5-7B"


class Splitter(GgufMaker):
    """A GgufMaker that can keep layers in host memory: ``gpu_layers`` of 28 on the card."""

    splitting = part(ForwardingSplitting)

    name = "splitter"
    engine = "splitter-engine"

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        params = super().parameters(space)
        if "gpu_layers" in space:
            params.append(Param("gpu_layers", tuple(v for v in space["gpu_layers"] if v == "all" or type(v) is int)))
        return params

    def offload_space(self, weights: str, ctx: StudyContext) -> dict[str, list[Any]]:
        # no value of the first dimension fits: the next is offered; each starts with "no split"
        return {"experts": [0, 1], "gpu_layers": ["all", 28, 21, 14, 7, 0]}

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        total = weights_for(ctx.model, config.weights).total_bytes
        share = {None: 28, "all": 28}.get(config.option("gpu_layers"), config.option("gpu_layers"))
        return MemoryEstimate(total * share // 28, 0, 2**30, 0, host_bytes=total - total * share // 28)


def test_a_format_too_large_whole_is_offered_split(seven_b, tmp_path):
    class Plugin2:
        @staticmethod
        @hookimpl
        def register_backends(register):
            register(Splitter())

    with plugin_registered(Plugin2, "splitter"):
        draft = draft_study(str(seven_b), gpu="t4")
        # F16 (14.19 GiB of weights + 1 GiB) does not fit 14.75 GiB whole: kept, with the layer
        # counts whose lightest configuration fits; the formats that fit whole need none of them
        assert "gguf:F16" in draft.candidates["splitter"]
        assert not any("gguf:F16" in why for why in draft.left_out)
        # "all" too, for the formats that fit whole (Q8_0 and below share the space)
        assert draft.space["gpu_layers"] == ["all", 21, 14, 7, 0]
        (why,) = draft.offload
        assert why.startswith("splitter gguf:F16: does not fit whole (splitter: weights gguf:F16 never fit")
        assert why.endswith("fits with gpu_layers in [21, 14, 7, 0]")
        out = tmp_path / "study.toml"
        text = render(draft, out)
        out.write_text(text)
        assert "# Too large for the card whole, so split between the card and host memory" in text
        assert 'gpu_layers = ["all", 21, 14, 7, 0]' in text
        prepared = prepare_study(load_study_config(out))
        assert prepared.contexts["splitter"].source == seven_b


def test_llama_server_offers_experts_first_for_a_mixture_of_experts():
    from autotune.modelfiles.models import ModelSpec
    from autotune_plugins.llama_server.backend import LlamaServerBackend

    def ctx(**moe) -> StudyContext:
        from autotune.engine.backend import Workload
        from autotune.hardware.gpus import get_gpu
        from autotune.measure import Protocol

        model = ModelSpec(
            key="m",
            name="m",
            architecture="qwen3moe",
            n_layers=48,
            hidden_size=2048,
            n_heads=32,
            n_kv_heads=4,
            head_dim=128,
            ffn_size=6144,
            vocab_size=151936,
            n_params=1,
            tie_embeddings=False,
            max_context=32768,
            source="test",
            **moe,
        )
        return StudyContext(
            gpu=get_gpu("t4"),
            model=model,
            workload=Workload(64, 16),
            vram_budget_bytes=2**30,
            protocol=Protocol(),
            source=Path("/nonexistent"),
        )

    b = LlamaServerBackend()
    moe = b.splitting.offload_space("gguf:Q4_K_M", ctx(n_experts=128, n_experts_used=8, expert_ffn_size=768))
    assert list(moe) == ["n_cpu_moe", "gpu_layers"] and moe["n_cpu_moe"] == [0, 6, 12, 18, 24, 30, 36, 42, 48]
    assert b.splitting.offload_space("gguf:Q4_K_M", ctx()) == {"gpu_layers": ["all", 48, 42, 36, 30, 24, 18, 12, 6, 0]}


class HeadSizeRules(GgufMaker):
    """Refuses a quantized cache whose block of 32 does not divide the head size (llama.cpp's
    rule, plugins/llama_server/rules.toml), as its ``check`` would in a study."""

    name = "head-rules"

    def check(self, config: TrialConfig, ctx: StudyContext) -> list[str]:
        if config.option("cache_type") == "q8_0" and ctx.model.head_dim % 32:
            return [f"cache_type q8_0: its block of 32 does not divide the head size {ctx.model.head_dim}"]
        return []


class HeadRulesPlugin:
    @staticmethod
    @hookimpl
    def register_backends(register):
        register(HeadSizeRules())


def _tiny(tmp_path: Path, hidden: int, heads: int) -> Path:
    import json

    d = tmp_path / f"tiny-{hidden // heads}"
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps(
            {
                "model_type": "llama",
                "num_hidden_layers": 2,
                "hidden_size": hidden,
                "num_attention_heads": heads,
                "num_key_value_heads": heads,
                "intermediate_size": 4 * hidden,
                "vocab_size": 512,
                "max_position_embeddings": 2048,
                "tie_word_embeddings": True,
            }
        )
    )
    (d / "model.safetensors").write_bytes(b"not read by init")
    return d


@pytest.mark.parametrize("hidden, heads, refused", [(64, 8, True), (64, 4, True), (256, 2, False)])
def test_init_leaves_out_values_the_rules_refuse_for_this_model(tmp_path, hidden, heads, refused):
    # Head sizes 8 and 16: llama.cpp refuses a q8_0 cache; 128 takes it.
    with plugin_registered(HeadRulesPlugin, "head-rules"):
        draft = draft_study(str(_tiny(tmp_path, hidden, heads)), gpu="t4")
        text = render(draft, tmp_path / "study.toml")
    if refused:
        assert draft.space["cache_type"] == ["f16"]
        assert (
            f'#   cache_type = "q8_0": head-rules: cache_type q8_0: its block of 32 does not divide the head '
            f"size {hidden // heads}" in text
        )
    else:
        assert draft.space["cache_type"] == ["f16", "q8_0"] and "Left out of [space]" not in text


def test_the_quality_init_writes_counts(seven_b, tmp_path):
    # A quality metric with no penalty and no bound is measured and never counts: init writes a bound.
    with plugin_registered(Plugin, "makers"):
        draft = draft_study(str(seven_b), gpu="h200")
    draft.quality = "kld"  # as where the kld metric is installed and the full-precision format fits
    out = tmp_path / "q.toml"
    out.write_text(render(draft, out))
    objective = load_study_config(out).objective
    assert objective.quality == "kld" and objective.max_drop_points == 5.0


def test_a_backend_whose_makings_would_fail_is_left_out_with_the_cause(seven_b):
    # The converter's dry run (llama.cpp: --vocab-only) says it cannot convert this model: init
    # does not write a study that `autotune study` would refuse before its first trial.
    class UnknownTokenizer(GgufMaker):
        name = "odd-maker"

        def artifact_recipe(self, fmt, source, ctx):
            recipe = super().artifact_recipe(fmt, source, ctx)
            if recipe is None:
                return None
            return Recipe(
                recipe.fmt,
                recipe.tool,
                recipe.name,
                recipe.expected_bytes,
                recipe.make,
                description="converter",
                check=lambda: "BPE pre-tokenizer was not recognized: convert elsewhere",
            )

    class Only:
        @staticmethod
        @hookimpl
        def register_backends(register):
            register(UnknownTokenizer())

    with plugin_registered(Only, "odd-only"), pytest.raises(ConfigError) as raised:
        draft_study(str(seven_b), gpu="t4")
    assert (
        "backend odd-maker: making gguf:Q8_0 (converter) would fail: BPE pre-tokenizer was not recognized: "
        "convert elsewhere"
    ) in str(raised.value)
