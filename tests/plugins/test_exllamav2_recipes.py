"""EXL2 formats made from a Hugging Face source (plugins/exllamav2/recipes.py), without a GPU:
a stand-in for ``python -m exllamav2.conversion.convert_exl2`` records each call, so the test
sees one measurement pass shared by every bpw, the arguments ExLlamaV2's converter documents
(doc/convert.md: -om, -m, -cf, -b), and the converter's own error on failure."""

from __future__ import annotations

import json
import stat
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from autotune.modelfiles import artifacts
from autotune.modelfiles.artifacts import ArtifactError, ensure
from autotune.engine.backend import StudyContext, TrialConfig, Workload
from autotune.hardware.gpus import get_gpu
from autotune.measure import Protocol
from autotune.modelfiles.models import model_from_hf_config
from autotune_plugins.exllamav2.backend import ExLlamaV2Backend
from tests.plugins.test_exllamav2_backend import CONFIG, layer_tensors, write_safetensors

# The converter's stand-in: python -m exllamav2.conversion.convert_exl2 ARGS, logged to $CONVERT_LOG.
FAKE_PYTHON = f"""#!{sys.executable}
import json, os, sys
from pathlib import Path
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from tests.plugins.test_exllamav2_backend import CONFIG, layer_tensors, write_safetensors
args = sys.argv[1:]
assert args[:2] == ["-m", "exllamav2.conversion.convert_exl2"], args
rest = [a for a in args[2:] if a != "-nr"]
opt = dict(zip(rest[::2], rest[1::2]))
with open(os.environ["CONVERT_LOG"], "a") as log:
    log.write(json.dumps(opt) + "\\n")
if os.environ.get("CONVERT_FAIL"):
    print("Traceback (most recent call last):")
    print("RuntimeError: CUDA out of memory while quantizing layer 3")
    sys.exit(1)
if "-om" in opt:
    Path(opt["-om"]).write_text(json.dumps({{"measurement": "fake"}}))
else:
    assert Path(opt["-m"]).is_file()
    out = Path(opt["-cf"])
    out.mkdir(parents=True)
    (out / "config.json").write_text(json.dumps({{**CONFIG, "quantization_config": {{
        "quant_method": "exl2", "bits": float(opt["-b"]), "head_bits": 6}}}}))
    (out / "tokenizer.json").write_text("{{}}")
    write_safetensors(out / "output.safetensors", {{**layer_tensors(0), **layer_tensors(1)}})
"""


@pytest.fixture
def source(tmp_path) -> Path:
    d = tmp_path / "tiny-fp16"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({k: v for k, v in CONFIG.items() if k != "quantization_config"}))
    (d / "tokenizer.json").write_text("{}")
    write_safetensors(d / "model.safetensors", {"model.embed_tokens.weight": ("F16", [512, 128])})
    return d


@pytest.fixture
def ctx(tmp_path, source, monkeypatch) -> StudyContext:
    python = tmp_path / "fake-python"
    python.write_text(FAKE_PYTHON)
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CONVERT_LOG", str(tmp_path / "convert.log"))
    monkeypatch.setenv("AUTOTUNE_ENGINE_ENV", "CONVERT_LOG,CONVERT_FAIL")  # the converter gets only what it is given
    monkeypatch.setenv(artifacts.ARTIFACTS_ENV, str(tmp_path / "cache"))
    artifacts._failed.clear()
    return StudyContext(
        gpu=get_gpu("h200"),
        model=model_from_hf_config(source),
        workload=Workload(64, 16),
        vram_budget_bytes=100 * 2**30,
        protocol=Protocol(),
        settings={"python": str(python), "paged": False},
        base_dir=tmp_path,
        source=source,
    )


def calls(tmp_path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in (tmp_path / "convert.log").read_text().splitlines()]


def test_one_measurement_is_shared_by_every_bpw(ctx, tmp_path, source):
    b = ExLlamaV2Backend()
    before = b.estimate_memory(TrialConfig("exllamav2", "exl2:4.0", 512, 1, (("cache_type", "q4"),)), ctx)
    assert "not converted yet" in before.notes[0]  # predicted from the source's shape
    made = {bpw: ensure(b, f"exl2:{bpw}", ctx) for bpw in ("3.0", "4.0", "5.0")}
    log = calls(tmp_path)
    assert [c.get("-om") is not None for c in log] == [True, False, False, False]  # one measurement pass
    assert [c.get("-b") for c in log[1:]] == ["3.0", "4.0", "5.0"]
    shared = made["3.0"].path.parent / "measurement.json"  # kept in the source's cache entry
    assert shared.is_file() and all(c["-i"] == str(source) and c["-m"] == str(shared) for c in log[1:])
    for bpw, a in made.items():
        assert a.path == b.weights_path(f"exl2:{bpw}", ctx) and a.path.name == f"exl2-{float(bpw):g}bpw"
        assert b.check_weights(str(a.path), ctx) is None  # a directory the backend loads
    after = b.estimate_memory(TrialConfig("exllamav2", "exl2:4.0", 512, 1, (("cache_type", "q4"),)), ctx)
    assert "output.safetensors" in after.notes[0]  # now the directory's own tensors
    # The source itself loads as the FP16 reference; another FP16 directory is still refused.
    assert b.check_weights(str(source), ctx) is None


def test_the_converter_error_fails_the_artifact(ctx, tmp_path, monkeypatch):
    monkeypatch.setenv("CONVERT_FAIL", "1")
    with pytest.raises(ArtifactError, match="exit status 1.*CUDA out of memory while quantizing layer 3"):
        ensure(ExLlamaV2Backend(), "exl2:4.0", ctx)


def test_a_gguf_source_is_no_exl2_source(ctx, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    from autotune_plugins.exllamav2.recipes import exl2_recipe

    assert exl2_recipe("gguf:Q8_0", gguf, "python", {}, "exllamav2") is None  # another engine's format
    with pytest.raises(Exception, match="converted from a Hugging Face model directory"):
        exl2_recipe("exl2:4.0", gguf, "python", {}, "exllamav2")


def test_convert_args_reach_both_passes_and_name_their_own_entry(ctx, tmp_path):
    b = ExLlamaV2Backend()
    plain = ensure(b, "exl2:4.0", ctx)
    shorter = replace(ctx, settings={**ctx.settings, "convert_args": ["-l", "512", "-ml", "512", "-hsol", "16"]})
    made = ensure(b, "exl2:4.0", shorter)
    log = calls(tmp_path)
    assert len(log) == 4  # another artifact: its own measurement and quantization, not a cache hit
    assert all(c.get("-l") == "512" and c.get("-ml") == "512" and c.get("-hsol") == "16" for c in log[2:])
    assert made.path != plain.path and made.path.parent.name.startswith(plain.path.parent.name + "-args")
    assert ensure(b, "exl2:4.0", shorter).path == made.path and len(calls(tmp_path)) == 4  # made once


@pytest.mark.parametrize(
    "args, problem",
    [
        (["-b", "3.0"], "-b: set by autotune"),
        (["--compile_full=/x"], "--compile_full: set by autotune"),
        (["-l", 512], "list of non-empty strings"),
    ],
)
def test_convert_args_that_contradict_the_recipe_are_refused(args, problem):
    from autotune_plugins.exllamav2.recipes import convert_args_problem

    assert problem in convert_args_problem(args)
