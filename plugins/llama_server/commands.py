"""The plugin's command-line layer: ``autotune engine build`` and ``autotune synth``.

Thin on purpose: each command parses its options, calls the library function in
:mod:`~autotune_plugins.llama_server.engine` or :mod:`~autotune_plugins.llama_server.synth`
and prints the result. numpy and gguf are imported only when ``synth`` runs, because every
``autotune`` invocation imports this module.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from autotune.api import AutotuneError
from autotune._builtin import ConfigError, echo, handle_errors
from autotune_plugins.llama_server.synth_shapes import ARCH_DEFAULTS, LIMITS, SEED_RANGE

__all__ = ["add_engine_commands", "add_synth_command"]

ENGINES = ("llama.cpp",)


@contextlib.contextmanager
def _errors() -> Iterator[None]:
    """The core's error-to-exit mapping (:func:`autotune.errors.handle_errors`), with the tail
    of a build's or pip's log on stderr first: the one line alone rarely says why a compile
    failed."""
    with handle_errors(_debug()):
        try:
            yield
        except AutotuneError as exc:
            tail = getattr(exc, "log_tail", "")
            if tail:
                echo(tail, err=True)
            raise


def _debug() -> bool:
    """``autotune --debug``: the core CLI keeps it in the context object."""
    ctx = click.get_current_context(silent=True)
    obj = ctx.find_root().obj if ctx is not None else None
    return bool(obj.get("debug")) if isinstance(obj, dict) else False


def _engine_group(cli: click.Group) -> click.Group:
    """The ``engine`` group, shared with other plugins that build engines of their own."""
    existing = cli.commands.get("engine")
    if isinstance(existing, click.Group):
        return existing

    @cli.group("engine")
    def engine() -> None:
        """Build and inspect serving engines."""

    return engine


class _BuildProgress:
    """Compile progress: a bar on a terminal, a line per 10 % elsewhere (logs, CI)."""

    def __init__(self) -> None:
        self.tty = sys.stderr.isatty()
        self.bar: Any = None
        self.task: Any = None
        self.last_decile = -1

    def __enter__(self) -> "_BuildProgress":
        if self.tty:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(
                TextColumn("compiling"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("{task.description}"),
                transient=True,
            )
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def status(self, message: str) -> None:
        if self.bar is not None:
            self.bar.console.print(message, highlight=False)
        else:
            echo(message, err=True)

    def __call__(self, done: int, total: int, line: str) -> None:
        if self.bar is not None:
            what = line.rsplit("/", 1)[-1][:40]
            if self.task is None:
                self.task = self.bar.add_task(what, total=total)
            self.bar.update(self.task, completed=done, total=total, description=what)
            return
        decile = 10 * done // max(total, 1)
        if decile > self.last_decile:
            self.last_decile = decile
            echo(f"compiling: {done}/{total} ({100 * done // max(total, 1)}%)", err=True)


def add_engine_commands(cli: click.Group) -> None:
    """Add ``engine build`` and ``engine list`` to ``cli``."""
    group = _engine_group(cli)

    @group.command("build")
    @click.argument("engine", type=click.Choice(ENGINES))
    @click.option(
        "--cuda-arch",
        default="auto",
        show_default=True,
        help="auto (the detected GPUs' compute capability, or cpu without a GPU), cpu, "
        "or CUDA architectures such as 70 (V100), 86, 90, comma-separated.",
    )
    @click.option(
        "--cuda-compiler",
        type=click.Path(path_type=Path),
        default=None,
        help="nvcc of the CUDA toolkit to build with, e.g. /usr/local/cuda-12.9/bin/nvcc "
        "[default: $CUDACXX, else nvcc on PATH, else /usr/local/cuda/bin/nvcc]. "
        "CUDA 13 cannot build for sm_50 to sm_72 (V100, P100, P40): use a 12.x one.",
    )
    @click.option(
        "--jobs",
        "-j",
        type=click.IntRange(min=1),
        default=None,
        help="Parallel compile jobs [default: number of CPUs].",
    )
    @click.option(
        "--cache-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Where builds go [default: $AUTOTUNE_CACHE_DIR/engines, else "
        "$XDG_CACHE_HOME/autotune/engines, else ~/.cache/autotune/engines].",
    )
    @click.option(
        "--sdist",
        type=click.Path(exists=True, path_type=Path),
        default=None,
        help="A llama-cpp-python source distribution (.tar.gz or extracted) to build, for machines without network.",
    )
    @click.option("--force", is_flag=True, help="Rebuild even if a complete build exists.")
    @click.option("--cpu", "cpu_only", is_flag=True, help="CPU-only build (same as --cuda-arch cpu).")
    @click.option(
        "--python",
        "python_bindings",
        is_flag=True,
        help="Also install llama-cpp-python into this environment on top of the build "
        "(no second compile): the in-process engine quality scoring uses.",
    )
    def build(
        engine: str,
        cuda_arch: str,
        cuda_compiler: Path | None,
        jobs: int | None,
        cache_dir: Path | None,
        sdist: Path | None,
        force: bool,
        cpu_only: bool,
        python_bindings: bool,
    ) -> None:
        """Build ENGINE (llama.cpp: llama-server, llama-quantize, llama-bench and
        llama-batched-bench) for this machine's GPU.

        The sources are the llama.cpp tree vendored in llama-cpp-python's source distribution
        on PyPI, pinned to one version. The build is cached per version and GPU architecture,
        and reused when complete. For a CUDA build, the toolkit is checked against the
        architectures before anything is downloaded or compiled.
        """
        from autotune_plugins.llama_server import engine as engine_mod

        started = time.monotonic()
        with _errors(), _BuildProgress() as progress:
            if cpu_only and cuda_arch not in ("auto", "cpu"):
                raise ConfigError(f"--cpu and --cuda-arch {cuda_arch} contradict each other: give one of them")
            result = engine_mod.build_llama_cpp(
                "cpu" if cpu_only else cuda_arch,
                jobs=jobs,
                cache_dir=cache_dir,
                sdist=sdist,
                force=force,
                progress=progress,
                status=progress.status,
                cuda_compiler=cuda_compiler,
            )
        version = result.manifest.get("version", {})
        label = engine_mod.EngineVersion(**version).label if version else "llama.cpp"
        verb = "reused" if result.reused else f"built in {time.monotonic() - started:.0f}s"
        echo(f"{label} {result.manifest.get('tag', '')} {verb}")
        for tool in engine_mod.BUILD_TARGETS:
            echo(f"  {tool + ':':21}{result.tool(tool) or 'missing'}")
        cuda = result.manifest.get("cuda") or {}
        if cuda.get("version"):
            echo(f"  {'CUDA:':21}{cuda['version']} ({cuda.get('compiler')}) for sm_{', sm_'.join(cuda['archs'])}")
        echo(
            f"  {'libraries:':21}{result.lib_dir}  (LLAMA_CPP_LIB_PATH for llama-cpp-python "
            f"{result.manifest.get('llama_cpp_python', '')})"
        )
        echo(f"  {'build log:':21}{result.install_dir / 'build.log'}")
        if python_bindings:
            with _errors(), (result.install_dir / "build.log").open("a", encoding="utf-8") as log:
                installed = engine_mod.install_python_bindings(result, cache_dir=cache_dir, log=log)
            echo(f"  llama-cpp-python {installed} installed, loading {result.lib_dir}")

    @group.command("list")
    @click.option(
        "--cache-dir",
        type=click.Path(file_okay=False, path_type=Path),
        default=None,
        help="Where builds are [default: as for engine build].",
    )
    def list_cmd(cache_dir: Path | None) -> None:
        """List complete engine builds and the llama-server autotune would use."""
        from autotune_plugins.llama_server import engine as engine_mod

        builds = engine_mod.built_engines(cache_dir)
        if not builds:
            echo(f"no builds in {engine_mod.engines_dir(cache_dir)}")
        for b in builds:
            version = b.manifest.get("version", {})
            label = engine_mod.EngineVersion(**version).label if version else "?"
            echo(f"{b.install_dir.name:32} {label:40} {b.server}")
        with contextlib.suppress(AutotuneError):
            echo(f"llama-server in use: {engine_mod.find_llama_server(cache_dir=cache_dir)}")


def _csv(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[str, ...]:
    if not value:
        return ()
    return tuple(v.strip().upper() for v in value.split(",") if v.strip())


def _limit(field: str) -> click.IntRange:
    """The option's range: the shape's own (synth_shapes.LIMITS), refused by click before anything runs."""
    low, high, _why = LIMITS[field]
    return click.IntRange(low, high)


def add_synth_command(cli: click.Group) -> None:
    """Add ``synth`` to ``cli``."""

    @cli.command("synth")
    @click.option("--arch", type=click.Choice(sorted(ARCH_DEFAULTS)), required=True, help="GGUF architecture.")
    @click.option("--layers", type=_limit("n_layers"), required=True, help="Transformer blocks.")
    @click.option("--hidden", type=_limit("hidden"), required=True, help="Embedding width.")
    @click.option("--heads", type=_limit("n_heads"), required=True, help="Attention (query) heads.")
    @click.option("--kv-heads", type=_limit("n_kv_heads"), required=True, help="Key/value heads (GQA).")
    @click.option(
        "--ffn",
        type=_limit("ffn"),
        required=True,
        help="Feed-forward width (of a dense block; a MoE's config value is written as is).",
    )
    @click.option(
        "--head-dim",
        type=_limit("head_size"),
        default=None,
        help="Width of one head when it is not hidden / heads (Qwen3: 128).",
    )
    @click.option(
        "--experts",
        type=_limit("experts"),
        default=0,
        show_default=True,
        help="Routed experts per block (a MoE architecture such as qwen3moe).",
    )
    @click.option(
        "--experts-used",
        type=_limit("experts_used"),
        default=0,
        show_default=True,
        help="Experts each token is routed to.",
    )
    @click.option(
        "--expert-ffn",
        type=_limit("expert_ffn"),
        default=0,
        show_default=True,
        help="Feed-forward width of one expert.",
    )
    @click.option(
        "--ctx",
        "context_length",
        type=_limit("context_length"),
        default=32768,
        show_default=True,
        help="Trained context length written to the metadata.",
    )
    @click.option(
        "--vocab-from",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        default=None,
        help="A GGUF whose tokenizer to copy [default: llama.cpp's ggml-vocab-llama-bpe.gguf "
        "or ggml-vocab-qwen2.gguf from a build made by `autotune engine build`].",
    )
    @click.option("--out", type=click.Path(dir_okay=False, path_type=Path), required=True, help="Output .gguf.")
    @click.option(
        "--quantize",
        callback=_csv,
        default=None,
        help="Also write quantized copies with llama-quantize, e.g. Q4_K_M,Q8_0 (files named <out>-<TYPE>.gguf).",
    )
    @click.option(
        "--tie-embeddings",
        is_flag=True,
        help="No output.weight: the head reuses the embeddings (small Qwen2.5 models).",
    )
    @click.option(
        "--seed", type=click.IntRange(*SEED_RANGE), default=0, show_default=True, help="Random seed of the weights."
    )
    @click.option("--force", is_flag=True, help="Overwrite existing output files.")
    def synth(
        arch: str,
        layers: int,
        hidden: int,
        heads: int,
        kv_heads: int,
        ffn: int,
        head_dim: int | None,
        experts: int,
        experts_used: int,
        expert_ffn: int,
        context_length: int,
        vocab_from: Path | None,
        out: Path,
        quantize: tuple[str, ...],
        tie_embeddings: bool,
        seed: int,
        force: bool,
    ) -> None:
        """Write a random-weight GGUF model of a real architecture and size.

        The model has the real speed and memory behaviour of a model of that shape (same
        tensors, same KV cache, same kernels), but its weights are random: its output is
        gibberish and has no meaningful quality. Use it to tune speed and memory without
        downloading a model, never to measure quality.
        """
        from autotune_plugins.llama_server import synth as synth_mod

        with _errors():
            spec = synth_mod.SynthSpec(
                arch=arch,
                n_layers=layers,
                hidden=hidden,
                n_heads=heads,
                n_kv_heads=kv_heads,
                ffn=ffn,
                context_length=context_length,
                tie_embeddings=tie_embeddings,
                head_size=head_dim,
                experts=experts,
                experts_used=experts_used,
                expert_ffn=expert_ffn,
            )
            vocab = vocab_from or synth_mod.find_vocab(arch)
            written = synth_mod.write_model(
                spec,
                out,
                vocab_from=vocab,
                seed=seed,
                overwrite=force,
                progress=_echo_progress(),
                quantize=quantize,
                say=echo,
            )
            echo(
                f"wrote {written.path} ({written.size_bytes / 2**20:.1f} MiB, {written.n_params:,} "
                f"parameters, vocab {written.n_vocab} from {vocab.name})"
            )
            for qtype in quantize:
                q = synth_mod.quantize(out, qtype, overwrite=force)
                echo(f"wrote {q} ({q.stat().st_size / 2**20:.1f} MiB)")


def _echo_progress() -> Callable[[int, int], None]:
    last = [-1]

    def report(done: int, total: int) -> None:
        decile = 10 * done // max(total, 1)
        if decile > last[0]:
            last[0] = decile
            echo(f"writing tensors: {done}/{total}", err=True)

    return report
