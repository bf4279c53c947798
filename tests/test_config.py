"""Study files: every problem is reported at once, naming the file and the field."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from autotune.config import load_study_config, parse_duration
from autotune.errors import ConfigError
from autotune.study import prepare_study


def _edit(default: Path, dest: Path, replacements: dict[str, str]) -> Path:
    """A copy of the default study with whole lines replaced (key -> new line)."""
    lines = []
    seen = set()
    for line in default.read_text(encoding="utf-8").splitlines():
        key = line.split("=", 1)[0].strip()
        if "=" in line and key in replacements and key not in seen:
            lines.append(replacements[key])
            seen.add(key)
        else:
            lines.append(line)
    assert seen == set(replacements), f"lines not found in the default study: {set(replacements) - seen}"
    dest.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return dest


def test_default_study_loads(default_study_path):
    cfg = load_study_config(default_study_path)
    assert cfg.name == "v100-qwen27b"
    assert cfg.gpu == "v100-16gb"
    assert cfg.space["ctx"] == (2048, 4096, 8192, 16384)
    assert [c.backend for c in cfg.candidates] == ["twin-exllamav2", "twin-llama.cpp"]
    assert cfg.safety_margin_bytes == 1792 * 2**20


def test_missing_file_names_it(tmp_path):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    assert str(path) in str(err.value)
    assert "no such study file" in str(err.value)


def test_directory_is_refused(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_study_config(tmp_path)
    assert str(tmp_path) in str(err.value)


def test_malformed_toml_names_the_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("[study\nname = 'x'\n", encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: ")
    assert "not valid TOML" in message
    assert "line 1" in message  # where the parser gave up


def test_three_bad_fields_are_all_reported(tmp_path, default_study_path):
    path = _edit(
        default_study_path,
        tmp_path / "bad.toml",
        {
            "ctx": "ctx = [0, 4096]",
            "prompt_tokens": 'prompt_tokens = "many"',
            "sampler": 'sampler = "bayes"',
        },
    )
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    lines = str(err.value).splitlines()
    assert len(lines) == 3, lines
    assert all(line.startswith(f"{path}: ") for line in lines), lines
    by_field = {re.search(r"\[\w+\] \w+", line).group(0): line for line in lines}
    assert set(by_field) == {"[space] ctx", "[workload] prompt_tokens", "[study] sampler"}
    # Each line quotes the bad value and says what would be accepted.
    assert "(bad: 0)" in by_field["[space] ctx"] and ">= 256" in by_field["[space] ctx"]
    assert "'many'" in by_field["[workload] prompt_tokens"] and "integer" in by_field["[workload] prompt_tokens"]
    assert "'bayes'" in by_field["[study] sampler"] and "tpe" in by_field["[study] sampler"]


def test_unknown_fields_are_reported_with_the_known_ones(tmp_path, default_study_path):
    text = default_study_path.read_text(encoding="utf-8")
    text = text.replace("[study]\n", '[study]\ncolour = "red"\n', 1)
    text = text.replace("[hardware]\n", "[hardware]\nvram_gib = 16\n", 1)
    text += "\n[extras]\nfoo = 1\n"
    path = tmp_path / "unknown.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    message = str(err.value)
    colour = next(line for line in message.splitlines() if "colour" in line)
    assert colour.startswith(f"{path}: [study] colour: unknown field (known: ")
    assert "sampler" in colour and "n_trials" in colour
    assert f"{path}: [hardware] vram_gib: unknown field" in message
    assert "vram_budget_gib" in message  # the field the user probably meant is listed
    assert "extras: unknown field" in message


def test_missing_required_tables(tmp_path):
    path = tmp_path / "empty.toml"
    path.write_text('[study]\nname = "x"\n', encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    message = str(err.value)
    for table in ("[hardware]", "[model]", "[workload]", "[[candidates]]", "[space]"):
        assert f"{path}: {table} is missing" in message, table


@pytest.mark.parametrize(
    "text, seconds",
    [("2h", 7200.0), ("45m", 2700.0), ("90s", 90.0), ("1.5h", 5400.0), (" 10 m ", 600.0), (30, 30.0), (2.5, 2.5)],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["2hrs", "2", "h", "-5m", "0s", "2d", "", True])
def test_parse_duration_rejects(text):
    with pytest.raises(ConfigError) as err:
        parse_duration(text)
    message = str(err.value)
    assert message.startswith("--budget ")
    if text not in (True,):
        assert repr(text) in message  # the bad value is quoted


def test_parse_duration_message_gives_the_format():
    with pytest.raises(ConfigError) as err:
        parse_duration("2hrs")
    assert str(err.value) == "--budget '2hrs': use a number with s, m or h, e.g. 90m or 2h"


def test_budget_in_study_file(tmp_path, default_study_path):
    text = default_study_path.read_text(encoding="utf-8").replace("n_trials = 60", 'budget = "45m"')
    good = tmp_path / "good.toml"
    good.write_text(text, encoding="utf-8")
    assert load_study_config(good).budget_s == 2700.0
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace('"45m"', '"2hrs"'), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        load_study_config(bad)
    assert f"{bad}: [study] budget = '2hrs': use a number with s, m or h" in str(err.value)


# ------------------------------------------------------------------------ prepare_study


def test_prepare_study_reports_every_unknown_name(tmp_path, default_study_path, twin_plugin):
    path = _edit(
        default_study_path,
        tmp_path / "names.toml",
        {
            "gpu": 'gpu = "v99"',
            "ref": 'ref = "nosuchmodel"',
            "backend": 'backend = "exllama"',
            "quality": 'quality = "mmlu"',
        },
    )
    cfg = load_study_config(path)  # names are not the file's structure: it loads
    with pytest.raises(ConfigError) as err:
        prepare_study(cfg, storage=f"sqlite:///{tmp_path / 'x.db'}")
    message = str(err.value)
    lines = message.splitlines()
    assert all(line.startswith(f"{path}: ") for line in lines), lines
    gpu_line = next(line for line in lines if "[hardware] gpu" in line)
    assert "'v99'" in gpu_line and "v100-16gb" in gpu_line and "a100-80gb" in gpu_line
    model_line = next(line for line in lines if "[model] ref" in line)
    assert "'nosuchmodel'" in model_line and "qwen2.5-27b-article" in model_line
    backend_line = next(line for line in lines if "[candidates.0] backend" in line)
    assert "'exllama'" in backend_line and "not installed" in backend_line
    assert "installed: twin-exllamav2, twin-exllamav3, twin-llama.cpp, twin-vllm" in backend_line
    metric_line = next(line for line in lines if "[objective] quality" in line)
    assert "'mmlu'" in metric_line and "installed: twin-mmlu" in metric_line
    assert not (tmp_path / "x.db").exists(), "a study that cannot start must not create its storage"


@pytest.mark.parametrize(
    "field, line, expected",
    [
        ("backend", 'backend = "exllama"', ["[candidates.0] backend = 'exllama'", "installed: twin-exllamav2"]),
        ("quality", 'quality = "mmlu"', ["[objective] quality = 'mmlu'", "installed: twin-mmlu"]),
        ("gpu", 'gpu = "v99"', ["[hardware] gpu = 'v99'", "known: v100-16gb"]),
        ("ref", 'ref = "nosuchmodel"', ["[model] ref = 'nosuchmodel'", "known: qwen2.5-27b-article"]),
    ],
)
def test_prepare_study_unknown_name(tmp_path, default_study_path, twin_plugin, field, line, expected):
    path = _edit(default_study_path, tmp_path / f"{field}.toml", {field: line})
    with pytest.raises(ConfigError) as err:
        prepare_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 'x.db'}")
    message = str(err.value)
    assert len(message.splitlines()) == 1, message
    assert message.startswith(f"{path}: ")
    for part in expected:
        assert part in message


def test_prepare_study_with_no_backend_installed(tmp_path, default_study_path):
    # Autoload is off under pytest and nothing is registered: both candidates are unknown.
    with pytest.raises(ConfigError) as err:
        prepare_study(load_study_config(default_study_path), storage=f"sqlite:///{tmp_path / 'x.db'}")
    message = str(err.value)
    assert "[candidates.0] backend = 'twin-exllamav2': not installed (installed: none)" in message
    assert "[candidates.1] backend = 'twin-llama.cpp': not installed (installed: none)" in message


def test_prepare_study_unused_space_option(tmp_path, default_study_path, twin_plugin):
    path = _edit(default_study_path, tmp_path / "opt.toml", {"parallel": "parallel = [1, 2]\nrope_scale = [1, 2]"})
    with pytest.raises(ConfigError) as err:
        prepare_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 'x.db'}")
    assert f"{path}: [space] rope_scale: no backend of this study takes it" in str(err.value)


def test_prepare_default_study(default_study_path, twin_plugin, tmp_storage):
    prepared = prepare_study(load_study_config(default_study_path), storage=tmp_storage)
    assert prepared.storage_url == tmp_storage
    assert prepared.gpu.key == "v100-16gb"
    assert prepared.vram_budget_bytes == prepared.gpu.vram_bytes - 1792 * 2**20
    # The screen drops what can never run, and says why.
    assert any("ctx 2048 cannot hold the workload" in note for note in prepared.excluded)
    assert all(2048 not in entry.ctx for entry in prepared.space.entries.values())
    assert "exl2:5.0" not in prepared.space.entries["twin-exllamav2"].weights


def test_model_source_alone_names_the_model_and_neither_is_an_error(tmp_path, default_study_path):
    text = default_study_path.read_text()
    assert 'ref = "qwen2.5-27b-article"' in text
    with_source = tmp_path / "source.toml"
    with_source.write_text(text.replace('ref = "qwen2.5-27b-article"', 'source = "models/my-model"'))
    cfg = load_study_config(with_source)
    assert cfg.model_source == "models/my-model" and cfg.model == "models/my-model"
    neither = tmp_path / "neither.toml"
    neither.write_text(text.replace('ref = "qwen2.5-27b-article"', ""))
    with pytest.raises(ConfigError, match=r"neither\.toml: \[model\] ref = \(missing\): required; .*\[model\] source"):
        load_study_config(neither)


def test_a_pareto_objective_runs_the_strategys_pareto_default(tmp_path, default_study_path):
    """``BaseStrategy.pareto``: tpe gives way to nsga2; a strategy without one is kept."""
    text = default_study_path.read_text(encoding="utf-8").replace("[objective]\n", '[objective]\nmode = "pareto"\n', 1)
    path = tmp_path / "pareto.toml"
    path.write_text(text, encoding="utf-8")
    assert load_study_config(path).sampler == "nsga2"
    path.write_text(text.replace('sampler = "tpe"', 'sampler = "random"'), encoding="utf-8")
    assert load_study_config(path).sampler == "random"


# ------------------------------------------------------------------------ numbers that are not numbers


@pytest.mark.parametrize(
    "after, line, expected",
    [
        ("[hardware]", "vram_budget_gib = inf", "[hardware] vram_budget_gib = inf: must be a finite number"),
        ("[hardware]", "vram_budget_gib = 1e300", "[hardware] vram_budget_gib = 1e+300: must be > 0 and at most 1024"),
        ("[hardware]", "vram_budget_gib = 1000", None),  # within one card's range: the card is compared later
        ("[study]", "budget = nan", "[study] budget = nan: must be a finite number"),
        ("seed = 0", "seed = 9223372036854775807", "[study] seed = 9223372036854775807: must be 0..4294967295"),
        ("seed = 0", "seed = -1", "[study] seed = -1: must be 0..4294967295"),
        (
            "max_drop_points = 1.0",
            "max_drop_points = -inf",
            "[objective] max_drop_points = -inf: must be a finite number",
        ),
        # Finite, but it overflowed every score to -inf.
        (
            "penalty_per_point = 1.0",
            "penalty_per_point = 1e308",
            "[objective] penalty_per_point = 1e+308: must be 0..1000000",
        ),
        ("[space]", "rope_scale = [1.0, nan]", "[space] rope_scale = [1.0, nan]: must be a finite number"),
        (
            "[space]",
            "[backends.twin-llama.cpp]\nthreads = inf",
            "[backends.twin-llama.cpp] threads = inf: must be a finite",
        ),
    ],
)
def test_non_finite_and_absurd_numbers_are_refused_naming_the_field(
    tmp_path, default_study_path, after, line, expected
):
    text = default_study_path.read_text(encoding="utf-8")
    if line.startswith("[backends"):
        text += f"\n{line}\n"
    elif after.startswith("["):
        text = text.replace(f"{after}\n", f"{after}\n{line}\n", 1)
    else:
        text = text.replace(after, line, 1)
    path = tmp_path / "numbers.toml"
    path.write_text(text, encoding="utf-8")
    if expected is None:
        assert load_study_config(path).vram_budget_bytes == 1000 * 2**30
        return
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    lines = str(err.value).splitlines()
    assert lines == [next(line for line in lines if line.startswith(f"{path}: {expected}"))], lines


@pytest.mark.parametrize(
    "key, line",
    [
        ("safety_margin_mib", "safety_margin_mib = inf"),
        ("penalty_per_point", "penalty_per_point = inf"),
        ("min_per_user_tok_s", "min_per_user_tok_s = nan"),
    ],
)
def test_a_non_finite_number_in_the_default_study_is_one_line(tmp_path, default_study_path, key, line):
    path = _edit(default_study_path, tmp_path / "inf.toml", {key: line})
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    assert (
        str(err.value) == f"{path}: [{'hardware' if key == 'safety_margin_mib' else 'objective'}] {line}: "
        "must be a finite number (inf and nan are not accepted)"
    )


def test_every_bad_measure_field_is_reported_at_once(tmp_path, default_study_path):
    text = default_study_path.read_text(encoding="utf-8")
    path = tmp_path / "measure.toml"
    path.write_text(
        text + "\n[measure]\nwarmup_runs = -1\nmin_runs = 0\nmax_runs = 2.5\nrel_spread_tol = nan\nmax_seconds = 0\n",
        encoding="utf-8",
    )
    with pytest.raises(ConfigError) as err:
        load_study_config(path)
    lines = str(err.value).splitlines()
    assert sorted(line.split(" = ")[0] for line in lines) == [
        f"{path}: [measure] {key}" for key in ("max_runs", "max_seconds", "min_runs", "rel_spread_tol", "warmup_runs")
    ]
    path.write_text(text + "\n[measure]\nmin_runs = 5\nmax_runs = 4\n", encoding="utf-8")
    with pytest.raises(ConfigError, match=r"\[measure\] max_runs = 4: must be >= min_runs \(5\)$"):
        load_study_config(path)


def test_a_budget_of_no_time_is_told_what_is_wrong_not_to_add_the_unit_it_has():
    with pytest.raises(ConfigError, match=r"^--budget '0s': must be more than no time"):
        parse_duration("0s")
    with pytest.raises(ConfigError, match=r"^--budget nan: must be a finite number of seconds > 0"):
        parse_duration(float("nan"))


def test_a_budget_the_card_cannot_hold_is_refused_naming_both_figures(tmp_path, default_study_path, twin_plugin):
    text = default_study_path.read_text(encoding="utf-8")
    path = tmp_path / "big.toml"
    path.write_text(text.replace("[hardware]\n", "[hardware]\nvram_budget_gib = 1000\n", 1), encoding="utf-8")
    with pytest.raises(ConfigError) as err:
        prepare_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 'x.db'}")
    assert str(err.value) == (
        f"{path}: [hardware] vram_budget_gib = 1000: more than Tesla V100 16GB (the GPU catalog's v100-16gb) holds, "
        "15.78 GiB; give at most 15.78, or leave it out for all of it less [hardware] safety_margin_mib"
    )
    assert not (tmp_path / "x.db").exists()
    path.write_text(text.replace("[hardware]\n", "[hardware]\nvram_budget_gib = 15.5\n", 1), encoding="utf-8")
    assert (
        prepare_study(load_study_config(path), storage=f"sqlite:///{tmp_path / 'x.db'}").vram_budget_bytes
        == int(15.5 * 2**30) - 1792 * 2**20
    )
