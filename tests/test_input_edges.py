"""Edge inputs a demanding new user tries, each once a hang, a silent wrong answer, a misleading
error or a traceback (issue 49 item 4): budgets, workload tables, `autotune plugins`, `autotune
init` and the reading commands. Each test failed on the behaviour it names before its fix."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Mapping, Sequence

import pytest
from click.testing import CliRunner

from autotune import hookimpl
from autotune.engine.backend import MemoryEstimate, Param, StudyContext, TrialConfig
from autotune.cli import cli
from autotune.config import MAX_STUDY_NAME, load_study_config, parse_duration
from autotune.errors import AutotuneError, ConfigError
from autotune.engine.metric import BaseMetric
from autotune.engine.parts import part
from autotune.study.storage import remember_run
from autotune.study_writer import draft_study
from tests.conftest import plugin_registered
from tests.fake_backends import FakeBackend, ForwardingArtifacts, registered, write_study

STORIES = Path(__file__).resolve().parent / "data" / "stories260K.gguf"


# --- budgets ------------------------------------------------------------------------------------


def test_a_budget_too_long_for_a_number_is_refused_not_taken_as_forever(tmp_path):
    # 400 nines overflow a float to inf: the budget was silently no budget, and a forecast's
    # "trials the budget affords" was int(inf), an OverflowError.
    huge = "9" * 400 + "s"
    with pytest.raises(ConfigError, match="finite"):
        parse_duration(huge)
    path = write_study(tmp_path / "s.toml", "fake", ["w1"])
    result = CliRunner().invoke(cli, ["study", str(path), "--budget", huge])
    assert result.exit_code == 2 and "--budget" in result.output and "finite" in result.output


# --- workload tables ----------------------------------------------------------------------------


def _study_with_workload(tmp_path: Path, workload: str) -> Path:
    path = write_study(tmp_path / "w.toml", "fake", ["w1"])
    text = path.read_text().replace("prompt_tokens = 1500\noutput_tokens = 800", workload)
    path.write_text(text)
    return path


def test_an_invalid_rate_search_beside_a_rate_is_quoted_not_said_missing(tmp_path):
    path = _study_with_workload(
        tmp_path, 'prompt_tokens = 10\noutput_tokens = 5\narrival = "poisson"\nrate = 2\nrate_search = ["a", 1]'
    )
    with pytest.raises(ConfigError) as raised:
        load_study_config(path)
    assert "rate_search = (missing)" not in str(raised.value)
    assert "[workload] rate_search = ['a', 1]: and rate = 2 are both set" in str(raised.value)


def test_a_workload_seed_with_nothing_to_draw_is_refused_not_ignored(tmp_path):
    # One request shape, closed loop: nothing is drawn, so the seed changed nothing and said so nowhere.
    path = _study_with_workload(tmp_path, "prompt_tokens = 10\noutput_tokens = 5\nseed = 3")
    with pytest.raises(ConfigError, match=r"\[workload\] seed = 3: .*profile or file.*poisson"):
        load_study_config(path)


# --- autotune plugins ---------------------------------------------------------------------------


class _NoDimensions(FakeBackend):
    name = "fake-nodims"

    def parameters(self, space):
        raise RuntimeError("torch is not installed")


class _NoFormats(FakeBackend):
    name = "fake-noformats"

    @property
    def weight_formats(self):  # type: ignore[override]
        raise ImportError("optional dependency missing")


def test_plugins_says_which_backend_could_not_list_its_dimensions_and_why():
    with registered(_NoDimensions(), name="dims-plugin"):
        result = CliRunner().invoke(cli, ["plugins"])
    assert result.exit_code == 0, result.output
    assert "dims-plugin" in result.output.split("broken (left out):")[-1]
    assert "backend fake-nodims: RuntimeError: torch is not installed" in result.output


def test_plugins_lists_the_others_when_a_backends_declarations_raise():
    with registered(_NoFormats(), FakeBackend(), name="formats-plugin"):
        result = CliRunner().invoke(cli, ["plugins"])
        as_json = CliRunner().invoke(cli, ["plugins", "--json"])
    assert result.exit_code == 0 and result.exception is None, result.output
    assert "  fake " in result.output  # the working backend is still listed
    assert "backend fake-noformats: ImportError: optional dependency missing" in result.output
    assert as_json.exit_code == 0 and '"plugin": "formats-plugin"' in as_json.output


# --- autotune init ------------------------------------------------------------------------------


def test_init_into_a_missing_directory_is_one_error_line(tmp_path):
    result = CliRunner().invoke(cli, ["init", str(STORIES), "--gpu", "cpu", "--out", str(tmp_path / "no" / "s.toml")])
    assert result.exit_code == 2 and not isinstance(result.exception, FileNotFoundError)
    assert f"--out {tmp_path / 'no' / 's.toml'}: {tmp_path / 'no'}: no such directory" in result.output


class _GgufLoader(FakeBackend):
    """Loads a .gguf file as given, makes nothing (as llama-server does from a quantized source)."""

    name = "gguf-loader"
    engine = "gguf-loader-engine"
    artifacts = part(ForwardingArtifacts)  # its artifact_recipe, below, is what init asks

    @property
    def weight_formats(self):  # type: ignore[override]
        from autotune_plugins.llama_server.declarations import GGUF

        return (GGUF,)

    def artifact_recipe(self, fmt: str, source: Path, ctx: StudyContext):
        if fmt.startswith("gguf:"):
            raise AutotuneError(f"{source}: no source to make {fmt} from")
        return None

    def check_weights(self, weights: str, ctx: StudyContext) -> str | None:
        return None if weights.endswith(".gguf") else "loads .gguf files only"

    def parameters(self, space: Mapping[str, Sequence[Any]]) -> list[Param]:
        return []

    def estimate_memory(self, config: TrialConfig, ctx: StudyContext) -> MemoryEstimate:
        return MemoryEstimate(2**20, 0, 2**20, 0)


class _Kld(BaseMetric):
    name = "kld"

    def evaluate(self, config, backend, ctx):  # pragma: no cover - init measures nothing
        raise NotImplementedError


class _LoaderAndKld:
    @staticmethod
    @hookimpl
    def register_backends(register):
        register(_GgufLoader())

    @staticmethod
    @hookimpl
    def register_metrics(register):
        register(_Kld())


def _quantized_gguf(tmp_path: Path) -> Path:
    """stories260K's header and tensors, its file type said to be Q8_0 (a quantized model)."""
    import gguf

    reader = gguf.GGUFReader(STORIES)
    out = tmp_path / "stories-q8.gguf"
    w = gguf.GGUFWriter(out, "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub_type=sub)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    for t in reader.tensors:
        w.add_tensor(t.name, t.data, raw_shape=list(reversed([int(d) for d in t.shape])), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_init_does_not_measure_quality_against_a_quantized_source(tmp_path):
    # The Q8_0 file was its own only candidate and "quality kld against the source": a drop
    # measured against itself, zero, reported as a quality check.
    source = _quantized_gguf(tmp_path)
    with plugin_registered(_LoaderAndKld, "loader-kld"):
        draft = draft_study(str(source), gpu="cpu")
        reference = draft_study(str(STORIES), gpu="cpu")
    assert draft.candidates == {"gguf-loader": [str(source)]}
    assert draft.quality is None
    assert any("Q8_0" in note and "not full precision" in note for note in draft.notes)
    assert reference.quality == "kld"  # the full-precision source is still its own reference


def test_init_of_a_model_whose_name_is_too_long_for_a_study_names_one_that_is(tmp_path):
    # The name came from the file, unchecked: the study file was written, then refused as
    # "written, but it does not validate (a bug in autotune init)".
    source = tmp_path / ("m" * 230 + ".gguf")
    shutil.copy(STORIES, source)
    with plugin_registered(_LoaderAndKld, "loader-kld"):
        draft = draft_study(str(source), gpu="cpu")
    assert 0 < len(draft.name) <= MAX_STUDY_NAME and set(draft.name) == {"m"}


# --- reading commands ---------------------------------------------------------------------------


def test_best_after_a_study_on_a_storage_with_a_password_asks_for_it(tmp_path, monkeypatch):
    # The URL is not written down (it holds a password), and `best` read the default study instead.
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("AUTOTUNE_STORAGE", raising=False)
    monkeypatch.chdir(tmp_path)
    remember_run("postgresql://me:secret@db.example/studies", "my-study")
    result = CliRunner().invoke(cli, ["best"])
    assert result.exit_code == 2, result.output
    assert "my-study" in result.output and "--storage" in result.output and "AUTOTUNE_STORAGE" in result.output
    assert "v100-qwen27b" not in result.output and "secret" not in result.output


def test_a_plugin_that_fails_to_load_is_named_by_autotune_plugins(monkeypatch):
    # It was a line on stderr at start-up only: `plugins --json` said "broken": [].
    import importlib.metadata

    from autotune import plugins

    class Unloadable:
        name, dist = "unloadable", None

        def load(self):
            raise ModuleNotFoundError("No module named 'vllm'")

    monkeypatch.setattr(plugins, "_loaded", False)
    monkeypatch.setattr(plugins, "_broken", {})
    monkeypatch.setattr(plugins.sys, "_called_from_test", False, raising=False)
    monkeypatch.setattr(importlib.metadata, "entry_points", lambda group: [Unloadable()])
    result = CliRunner().invoke(cli, ["plugins", "--json"])
    assert result.exit_code == 0, result.output
    assert {
        "plugin": "unloadable",
        "hook": "loading",
        "error": "ModuleNotFoundError: No module named 'vllm'",
    } in json.loads(result.stdout)["broken"]
    assert "plugin 'unloadable' failed in loading" in result.stderr  # still said at once, too


# --- second round (issue 49 item 4): what the first round noticed and left ----------------------


def test_a_budget_beyond_a_year_is_refused_as_a_typo_of_unit():
    # 99999999999999999h is finite: it ran, a study with no budget at all that said it had one.
    with pytest.raises(ConfigError, match=r"more than a year.*e\.g\. 90m or 2h"):
        parse_duration("99999999999999999h")
    with pytest.raises(ConfigError, match="more than a year"):
        parse_duration(10.0**12)
    assert parse_duration("8760h") == 8760 * 3600  # a year is still a budget


@pytest.mark.parametrize(
    "typed, meant, compound", [("2h30", "150m", "2h30m"), ("1h5", "65m", "1h5m"), ("2h 30", "150m", "2h30m")]
)
def test_a_budget_with_a_bare_trailing_number_suggests_what_was_meant(typed, meant, compound):
    with pytest.raises(ConfigError) as info:
        parse_duration(typed)
    said = str(info.value)
    assert f"{typed!r}" in said and f"'{meant}'" in said and f"'{compound}'" in said
    assert parse_duration(meant) == parse_duration(compound)  # both suggestions are accepted


@pytest.mark.parametrize("typed, seconds", [("2h30m", 9000), ("1h30m15s", 5415), ("1m30s", 90), ("2h 30m", 9000)])
def test_a_budget_of_hours_and_minutes_together_is_read(typed, seconds):
    assert parse_duration(typed) == seconds


def test_a_pathological_budget_string_is_refused_at_once_and_shown_cut():
    # Long runs of digits and units (what a backtracking pattern chokes on) and 1 MB of input: a
    # one-line error that quotes the start of it, not the megabyte.
    for text in ["1" * 1_000_000, "1h" * 100_000 + "x", "1." * 200_000, " " * 500_000 + "1"]:
        with pytest.raises(ConfigError) as info:
            parse_duration(text)
        assert len(str(info.value)) < 300 and "characters" in str(info.value)


def test_a_jsonl_line_with_a_repeated_key_is_refused_naming_the_key(tmp_path):
    # json.loads keeps the last of two: a request measured with a length the file also contradicts.
    from autotune.engine.workload import read_lengths

    path = tmp_path / "l.jsonl"
    path.write_text(
        '{"prompt_tokens": 10, "output_tokens": 5}\n{"prompt_tokens": 10, "output_tokens": 5, "prompt_tokens": 900}\n'
    )
    with pytest.raises(ValueError) as info:
        read_lengths(path)
    assert str(info.value).startswith(f"{path}: line 2: ") and "'prompt_tokens' twice" in str(info.value)


def test_a_csv_row_with_more_values_than_the_header_is_refused_naming_the_columns(tmp_path):
    # csv.DictReader keeps a row's surplus under the key None: the row 812,240,7 was read as
    # 812 and 240, whatever the third value meant (a shifted column, a comma in a number).
    from autotune.engine.workload import read_lengths

    path = tmp_path / "l.csv"
    path.write_text("prompt_tokens,output_tokens\n812,240\n1,200,7\n")
    with pytest.raises(ValueError) as info:
        read_lengths(path)
    message = str(info.value)
    assert (
        message.startswith(f"{path}: line 3: ") and "3 values" in message and "prompt_tokens, output_tokens" in message
    )


def test_init_says_once_that_a_quantized_gguf_is_no_source_for_any_format(tmp_path):
    source = _quantized_gguf(tmp_path)
    with plugin_registered(_LoaderAndKld, "loader-kld"):
        draft = draft_study(str(source), gpu="cpu")
    said = [line for line in draft.left_out if "no source to make" in line]
    assert len(said) == 1, draft.left_out
    assert all(f"gguf:{t}" in said[0] for t in ("F16", "Q8_0", "Q4_0"))


@pytest.mark.parametrize("kind", ["fifo", "dev-zero"])
def test_init_on_a_model_whose_config_is_a_pipe_or_device_names_what_it_is(tmp_path, kind):
    # It was "directory has no config.json": the file is there, it is the wrong kind of file.
    config = tmp_path / "m" / "config.json"
    config.parent.mkdir()
    os.mkfifo(config) if kind == "fifo" else config.symlink_to("/dev/zero")
    result = CliRunner().invoke(cli, ["init", str(config.parent), "--gpu", "cpu", "--out", str(tmp_path / "s.toml")])
    assert result.exit_code == 2
    assert f"{config}: is a {'named pipe' if kind == 'fifo' else 'character device'}" in result.output
    assert "a regular JSON file" in result.output


def test_init_on_an_enormous_config_json_refuses_it_unread(tmp_path, monkeypatch):
    # A config.json of hundreds of MB was read whole into memory (650 MB for 300 MB).
    import autotune.modelfiles.models as models

    monkeypatch.setattr(models, "MAX_CONFIG_BYTES", 1024, raising=False)
    config = tmp_path / "m" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "pad": "x" * 4096}))
    result = CliRunner().invoke(cli, ["init", str(config.parent), "--gpu", "cpu", "--out", str(tmp_path / "s.toml")])
    assert result.exit_code == 2 and f"{config}: larger than" in result.output, result.output
