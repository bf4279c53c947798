"""``synth`` checks its whole plan before it writes, and leaves no partial file on any exit
(issue 41, item 5): the shape's ranges, the quantization types and the outputs are refused up
front, with the option, the value and the range, and SIGTERM removes the .partial file."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from click.testing import CliRunner

from autotune.errors import ConfigError
from autotune_plugins.llama_server.synth import write_model
from autotune_plugins.llama_server.synth_shapes import SynthSpec
from tests.plugins.test_synth import TINY, cli, stories  # noqa: F401 - fixtures

BASE = [
    "synth",
    "--arch",
    "llama",
    "--layers",
    "2",
    "--hidden",
    "64",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--ffn",
    "128",
]


def test_an_unknown_quantization_type_is_refused_before_the_model_is_written(stories, tmp_path):
    out = tmp_path / "m.gguf"
    with pytest.raises(ConfigError, match=r"--quantize 'BOGUS': not a llama.cpp type"):
        write_model(TINY, out, vocab_from=stories, quantize=("Q8_0", "BOGUS"))
    assert list(tmp_path.iterdir()) == []  # no model, no .partial


@pytest.mark.parametrize(
    "option, value, said",
    [
        ("--layers", "1000000000", "1<=x<=512"),
        ("--head-dim", "1000000", "1<=x<=1024"),
        ("--ctx", "100000000000000000000", "16<=x<=2147483647"),
        ("--seed", "-1", "0<=x<=4294967295"),
        ("--experts", "100000", "0<=x<=512"),
    ],
)
def test_a_shape_beyond_llama_cpps_limits_is_refused_with_its_range(cli, stories, tmp_path, option, value, said):
    args = [a for a in BASE]
    args += [option, value, "--vocab-from", str(stories), "--out", str(tmp_path / "m.gguf")]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2 and option in result.output and said in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert list(tmp_path.iterdir()) == []


def test_the_library_checks_the_same_ranges():
    with pytest.raises(ConfigError, match=r"head_size = 1000000: must be an integer 1\.\.1024"):
        SynthSpec(arch="llama", n_layers=2, hidden=256, n_heads=4, n_kv_heads=2, ffn=128, head_size=1_000_000)
    with pytest.raises(ConfigError, match=r"n_layers = 1000000000: must be an integer 1\.\.512"):
        SynthSpec(arch="llama", n_layers=10**9, hidden=256, n_heads=4, n_kv_heads=2, ffn=128)


def test_sigterm_while_writing_leaves_no_partial_file(stories, tmp_path):
    out = tmp_path / "m.gguf"
    script = textwrap.dedent(f"""
        import os, signal
        from autotune_plugins.llama_server.synth import write_model
        from autotune_plugins.llama_server.synth_shapes import SynthSpec

        def progress(done, total):
            if done == 2:  # mid-file: the header and two tensors are in m.gguf.partial
                assert os.path.getsize({str(out) + ".partial"!r}) > 0
                os.kill(os.getpid(), signal.SIGTERM)

        spec = SynthSpec(arch="llama", n_layers=4, hidden=64, n_heads=4, n_kv_heads=2, ffn=128)
        write_model(spec, {str(out)!r}, vocab_from={str(stories)!r}, progress=progress)
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -15, proc.stderr[-2000:]
    assert list(tmp_path.iterdir()) == []
