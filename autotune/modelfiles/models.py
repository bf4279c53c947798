"""Model architectures: the catalog, GGUF headers and Hugging Face configs as one ``ModelSpec``.

A ``ModelSpec`` holds what the memory and speed models need to know about a decoder-only
transformer: its shape (layers, widths, heads), its parameter count, and the sizes of real
artifacts (GGUF files, EXL2 directories) when someone has quoted or measured them.

Three sources produce one:

* the catalog, ``autotune/data/models.toml`` (:func:`load_model_catalog`, :func:`get_model`);
* a GGUF file's header (:func:`model_from_gguf`, through :mod:`autotune.modelfiles.gguf_file`, the one
  reader of GGUF files), without reading the weights themselves;
* a Hugging Face ``config.json`` (:func:`model_from_hf_config`), which is also what an EXL2
  model directory carries.

:func:`resolve_model` accepts any of the three as one string.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune._catalog import read_catalog
from autotune.errors import ConfigError, UnknownNameError
from autotune.modelfiles.gguf_file import read_gguf
from autotune.toolkit.paths import path_problem, read_json
from autotune.engine.shape_limits import expert_fields, shape_problem
from autotune.engine.declarations import installed_weight_formats
from autotune.modelfiles.model_spec import ModelSpec, count_params

__all__ = [
    "ModelSpec",
    "count_params",
    "get_model",
    "load_model_catalog",
    "model_from_gguf",
    "model_from_hf_config",
    "resolve_model",
]

# HF ``model_type`` -> GGUF ``general.architecture``. Mistral checkpoints are converted to the
# "llama" architecture by llama.cpp's convert_hf_to_gguf.py (MistralModel.model_arch = LLAMA).
_HF_TO_GGUF_ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2"}

_CATALOG_FILE = "models.toml"

# ---------------------------------------------------------------------------------------------
# The catalog
# ---------------------------------------------------------------------------------------------

_INT_FIELDS = (
    "n_layers",
    "hidden_size",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "ffn_size",
    "vocab_size",
    "n_params",
    "max_context",
)
_STR_FIELDS = ("name", "architecture", "source")


def _spec_from_table(key: str, table: Mapping[str, Any], where: str) -> ModelSpec:
    """Builds a ModelSpec from one catalog table, listing every bad field in one error."""
    problems: list[str] = []
    values: dict[str, Any] = {}
    for name in _STR_FIELDS:
        value = table.get(name)
        if not isinstance(value, str) or not value:
            problems.append(f"field '{name}' missing or not a string")
        values[name] = value
    for name in _INT_FIELDS:
        value = table.get(name)
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"field '{name}' missing or not an integer")
        values[name] = value
    tie = table.get("tie_embeddings")
    if not isinstance(tie, bool):
        problems.append("field 'tie_embeddings' missing or not a boolean")
    artifacts = table.get("artifact_bytes", {})
    if not isinstance(artifacts, Mapping) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in artifacts.values()
    ):
        problems.append("table 'artifact_bytes' must map formats to positive integers of bytes")
        artifacts = {}
    sliding_window = table.get("sliding_window")
    n_swa_layers = table.get("n_swa_layers", 0)
    if problems:
        raise ConfigError(f"{where}: [{key}] " + "; ".join(problems))
    return ModelSpec(
        key=key,
        tie_embeddings=tie,
        artifact_bytes=dict(artifacts),
        sliding_window=sliding_window,
        n_swa_layers=n_swa_layers,
        **values,
    )


@functools.lru_cache(maxsize=1)
def _catalog() -> Mapping[str, ModelSpec]:
    return read_catalog(_CATALOG_FILE, _spec_from_table)


def load_model_catalog() -> dict[str, ModelSpec]:
    """Returns the model catalog shipped in ``autotune/data/models.toml``.

    The file is parsed once; every call returns a fresh dict of the same (immutable) specs.

    Returns:
        Catalog key -> ModelSpec, in file order.

    Raises:
        ConfigError: The shipped file is malformed (a packaging bug).
    """
    return dict(_catalog())


def get_model(key: str) -> ModelSpec:
    """Looks a model up in the catalog.

    Args:
        key: A catalog key such as ``qwen2.5-7b``.

    Returns:
        The catalog's ModelSpec.

    Raises:
        UnknownNameError: ``key`` is not in the catalog; the message lists the known keys.
    """
    catalog = _catalog()
    try:
        return catalog[key]
    except KeyError:
        raise UnknownNameError(f"unknown model '{key}' (known: {', '.join(catalog)})") from None


# ---------------------------------------------------------------------------------------------
# GGUF headers
# ---------------------------------------------------------------------------------------------


def _quoted(source: Path) -> dict[str, int]:
    """``source``'s size under its format, as the family that knows it says (``WeightFormats.quote``)."""
    families = installed_weight_formats().values()
    return dict(q for f in families if f.quote is not None and (q := f.quote(source)) is not None)


def model_from_gguf(path: str | Path) -> ModelSpec:
    """A model's shape from a GGUF file's header (:func:`autotune.modelfiles.gguf_file.read_gguf`).

    Keys read: ``general.architecture``, ``{arch}.block_count``, ``{arch}.embedding_length``,
    ``{arch}.attention.head_count``, ``{arch}.attention.head_count_kv`` (defaults to the head
    count), ``{arch}.feed_forward_length``, ``{arch}.context_length``,
    ``{arch}.attention.key_length`` (head_dim; defaults to embedding_length / head_count),
    ``{arch}.attention.sliding_window``, and for a mixture of experts ``{arch}.expert_count``,
    ``{arch}.expert_used_count`` and ``{arch}.expert_feed_forward_length``. The vocabulary size is the length of
    ``tokenizer.ggml.tokens``, else the second dimension of ``token_embd.weight``. The parameter
    count is the sum of all tensors' element counts; embeddings are tied when the file has no
    ``output.weight``. When ``general.file_type`` names a known type, the file's size on disk is
    recorded in ``artifact_bytes`` under ``gguf:<TYPE>``.

    Args:
        path: A ``.gguf`` file.

    Returns:
        The ModelSpec, keyed by the file's stem.

    Raises:
        ConfigError: The file is missing, not GGUF, or lacks a required field (the message names
            the file and the field).
    """
    p = Path(path)
    header = read_gguf(p)
    arch = header.architecture
    if arch is None:
        raise ConfigError(f"{p}: field 'general.architecture' missing")

    def widest(value: Any) -> Any:
        # Per-layer arrays (e.g. head_count_kv of hybrid models): size for the widest layer.
        return (
            (max(value) if value and all(isinstance(v, int) for v in value) else value) or None
            if isinstance(value, list)
            else value
        )

    missing: list[str] = []
    problems: list[str] = []

    def read_int(key: str, field_name: str, default: Any = None) -> int:
        value = widest(header.get(key, default))
        why = f"field '{key}' missing" if value is None else shape_problem(key, value, field_name)
        if why:
            (missing if value is None else problems).append(why)
        return 1 if why else value

    n_layers = read_int(f"{arch}.block_count", "n_layers")
    hidden = read_int(f"{arch}.embedding_length", "hidden_size")
    n_heads = read_int(f"{arch}.attention.head_count", "n_heads")
    ffn = read_int(f"{arch}.feed_forward_length", "ffn_size")
    max_context = read_int(f"{arch}.context_length", "max_context")
    if missing:
        raise ConfigError(f"{p}: " + "; ".join(missing))
    n_kv_heads = read_int(f"{arch}.attention.head_count_kv", "n_kv_heads", n_heads)
    key_length = f"{arch}.attention.key_length"
    if header.get(key_length) is not None:
        head_dim = read_int(key_length, "head_dim")
    else:
        head_dim = max(hidden // n_heads, 1)
        if not problems and n_heads > hidden:
            problems.append(
                f"{arch}.attention.head_count = {n_heads} exceeds {arch}.embedding_length = {hidden} "
                f"and there is no {key_length}: a head would be {hidden / n_heads:.2f} wide"
            )

    embeddings = header.tensor("token_embd.weight")
    if header.array_lengths.get("tokenizer.ggml.tokens"):
        vocab, vocab_key = header.array_lengths["tokenizer.ggml.tokens"], "the length of tokenizer.ggml.tokens"
    elif embeddings is not None:  # GGUF shapes list ne[0] first: token_embd is [hidden, vocab].
        vocab, vocab_key = embeddings.shape[-1], "token_embd.weight's second dimension"
    else:
        raise ConfigError(f"{p}: field 'tokenizer.ggml.tokens' missing and no token_embd.weight tensor")
    if why := shape_problem(vocab_key, vocab, "vocab_size"):
        problems.append(why)
        vocab = 1

    window = header.get(f"{arch}.attention.sliding_window")
    sliding_window, n_swa = None, 0
    if window:
        if why := shape_problem(f"{arch}.attention.sliding_window", window, "max_context"):
            problems.append(why)
        else:
            sliding_window = window
            # A pattern N means every N-th layer is global (llama.cpp's sliding_window_pattern);
            # without one, treat every layer as windowed, as Mistral-style models are.
            pattern = header.get(f"{arch}.attention.sliding_window_pattern")
            n_swa = n_layers - n_layers // pattern if isinstance(pattern, int) and pattern > 0 else n_layers
    n_params = sum(t.n_elements for t in header.tensors)
    if not problems and n_kv_heads > n_heads:
        problems.append(f"{n_kv_heads} key/value heads but {n_heads} query heads: a layer has no more of them")
    if not problems and n_params <= vocab * hidden:
        problems.append(
            f"{n_params:,} parameters, no more than the embeddings alone ({vocab:,} tokens x {hidden:,} "
            f"wide): the {n_layers} decoder layers hold none"
        )
    n_experts, n_used, expert_ffn = expert_fields(lambda k: widest(header.get(f"{arch}.{k}")), arch, ffn, problems)
    if problems:
        raise ConfigError(f"{p}: " + "; ".join(problems) + " (a damaged or hand-made header?)")

    artifacts = _quoted(p)
    name = header.get("general.name")
    return ModelSpec(
        key=p.stem,
        name=name if isinstance(name, str) and name else p.stem,
        architecture=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_size=ffn,
        vocab_size=vocab,
        n_params=n_params,
        tie_embeddings=header.tensor("output.weight") is None,
        max_context=max_context,
        source=str(p),
        artifact_bytes=artifacts,
        sliding_window=sliding_window,
        n_swa_layers=n_swa,
        n_experts=n_experts,
        n_experts_used=n_used,
        expert_ffn_size=expert_ffn,
    )


# ---------------------------------------------------------------------------------------------
# Hugging Face config.json (also the config of an EXL2 directory)
# ---------------------------------------------------------------------------------------------


MAX_CONFIG_BYTES = 16 * 2**20  # the largest real ones (vocabularies of labels inside) are under 1 MiB


def _config_path(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    problem = path_problem(p, "file")
    if problem:
        raise ConfigError(f"{p}: {problem}; give the model's config.json, a regular JSON file")
    return p


def model_from_hf_config(path: str | Path) -> ModelSpec:
    """Reads a model's shape from a Hugging Face ``config.json``.

    Keys read (Qwen2 / Llama / Mistral names): ``num_hidden_layers``, ``hidden_size``,
    ``num_attention_heads``, ``num_key_value_heads`` (defaults to the head count),
    ``head_dim`` (defaults to hidden_size / num_attention_heads), ``intermediate_size``,
    ``vocab_size``, ``tie_word_embeddings`` (default false), ``max_position_embeddings``,
    ``sliding_window`` / ``use_sliding_window`` / ``max_window_layers``, ``attention_bias``.
    The parameter count is computed from the architecture (:func:`count_params`).

    An EXL2 directory's config.json carries ``quantization_config`` (``quant_method = "exl2"``,
    ``bits``); then the total size of the directory's ``*.safetensors`` files is recorded in
    ``artifact_bytes`` under ``exl2:<bits>``.

    Args:
        path: A config.json, or a directory containing one.

    Returns:
        The ModelSpec, keyed by the directory's name.

    Raises:
        ConfigError: The file is missing or invalid; the message names the file and every bad
            field, e.g. ``path/config.json: field 'num_hidden_layers' missing``.
    """
    p = _config_path(path)
    try:  # bounded: a 300 MB config.json was read whole (650 MB of memory), a larger one filled it
        cfg = read_json(p, limit=MAX_CONFIG_BYTES, what="a model's config.json")
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: must be a JSON object")
    # Multimodal wrappers keep the language model's numbers under text_config.
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}

    problems: list[str] = []

    def pos_int(key: str, field_name: str, default: int | None = None) -> int:
        value = cfg.get(key, default)
        if value is None:
            problems.append(f"field '{key}' missing")
            return 1
        if why := shape_problem(f"field '{key}'", value, field_name):
            problems.append(why)
            return 1
        return value

    n_layers = pos_int("num_hidden_layers", "n_layers")
    hidden = pos_int("hidden_size", "hidden_size")
    n_heads = pos_int("num_attention_heads", "n_heads")
    ffn = pos_int("intermediate_size", "ffn_size")
    vocab = pos_int("vocab_size", "vocab_size")
    max_context = pos_int("max_position_embeddings", "max_context")
    n_kv_heads = pos_int("num_key_value_heads", "n_kv_heads", n_heads)
    head_dim = cfg.get("head_dim")
    head_dim = pos_int("head_dim", "head_dim") if head_dim is not None else max(hidden // n_heads, 1)
    if not problems and n_kv_heads > n_heads:
        problems.append(f"field 'num_key_value_heads' = {n_kv_heads} exceeds field 'num_attention_heads' = {n_heads}")
    tie = cfg.get("tie_word_embeddings", False)
    if not isinstance(tie, bool):
        problems.append(f"field 'tie_word_embeddings' = {tie!r}: must be true or false")
    if problems:
        raise ConfigError(f"{p}: " + "; ".join(problems))

    model_type = str(cfg.get("model_type", "llama"))
    arch = _HF_TO_GGUF_ARCH.get(model_type, model_type)
    attention_bias = cfg.get("attention_bias")
    n_params = count_params(
        architecture=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_size=ffn,
        vocab_size=vocab,
        tie_embeddings=tie,
        attention_bias=attention_bias if isinstance(attention_bias, bool) else None,
    )

    # Sliding window: Qwen2 configs carry sliding_window but only use it when
    # use_sliding_window is true, and then only for layers >= max_window_layers
    # (transformers, Qwen2Attention: sliding_window if layer_idx >= max_window_layers).
    # Mistral configs have no use_sliding_window: a non-null window applies to every layer.
    window = cfg.get("sliding_window")
    sliding_window: int | None = None
    n_swa = 0
    if isinstance(window, int) and not isinstance(window, bool) and 0 < window < max_context:
        if "use_sliding_window" in cfg:
            if cfg.get("use_sliding_window"):
                first = cfg.get("max_window_layers", 0)
                n_swa = max(0, n_layers - int(first)) if isinstance(first, int) else n_layers
        else:
            n_swa = n_layers
        sliding_window = window if n_swa else None

    artifacts = _quoted(p)

    key = p.parent.name or p.stem
    return ModelSpec(
        key=key,
        name=key,
        architecture=arch,
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=n_kv_heads,
        head_dim=head_dim,
        ffn_size=ffn,
        vocab_size=vocab,
        n_params=n_params,
        tie_embeddings=tie,
        max_context=max_context,
        source=str(p),
        artifact_bytes=artifacts,
        sliding_window=sliding_window,
        n_swa_layers=n_swa,
    )


def resolve_model(ref: str) -> ModelSpec:
    """Turns what a user typed into a ModelSpec.

    Args:
        ref: A catalog key (``qwen2.5-7b``), a ``.gguf`` file, a ``config.json``, or a
            directory containing a config.json (an HF or EXL2 model directory).

    Returns:
        The ModelSpec.

    Raises:
        UnknownNameError: ``ref`` is neither a catalog key nor an existing path.
        ConfigError: The path exists but cannot be read as a model.
    """
    catalog = _catalog()
    if ref in catalog:
        return catalog[ref]
    p = Path(ref).expanduser()
    if p.is_file() and p.suffix.lower() == ".gguf":
        return model_from_gguf(p)
    if p.is_file() and p.suffix.lower() == ".json":
        return model_from_hf_config(p)
    if p.is_dir():
        if (p / "config.json").exists() or (p / "config.json").is_symlink():
            return model_from_hf_config(p)  # a FIFO or a device is named as what it is, not as missing
        raise ConfigError(f"{p}: directory has no config.json (an HF or EXL2 model directory needs one)")
    if p.exists():
        raise ConfigError(f"{p}: not a .gguf file, a config.json or a model directory")
    known = ", ".join(catalog)
    if _looks_like_path(ref):
        raise UnknownNameError(f"{ref}: no such file or directory (nor a catalog model; the catalog has: {known})")
    raise UnknownNameError(f"{ref!r}: not a catalog model (known: {known}) nor an existing file or directory")


def _looks_like_path(ref: str) -> bool:
    """Whether a user meant a file (so "no such file" is the news) rather than a catalog key."""
    return "/" in ref or "\\" in ref or ref.startswith("~") or Path(ref).suffix.lower() in (".gguf", ".json")
