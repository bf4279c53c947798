"""A random-weight Qwen2.5-1.5B-shaped Hugging Face model whose tokenizer is Qwen2's own.

The source of the issue-17 bench: autotune makes every format of the study from it (GGUF with
llama.cpp's stock convert_hf_to_gguf.py and llama-quantize, EXL2 with ExLlamaV2's converter).
Unlike bench/exllamav2_h200/build_model.py, whose trained tokenizer needs the converter told
what it is, this one rebuilds Qwen2's real byte-level BPE from llama.cpp's shipped vocabulary
(models/ggml-vocab-qwen2.gguf: its 151643 tokens, 151387 merges and added tokens) with Qwen2's
normalizer and pre-tokenizer, so the converter recognises it by its own hash, and both engines
tokenize as the real model does. Weights are numpy arrays written with safetensors (FP16); no
torch, no download.

Usage: python build_qwen_source.py VOCAB_GGUF OUT_DIR [--tiny | --small]
  --tiny: 2 layers, hidden 64: the same tokenizer and vocabulary, converted in seconds on a CPU.
  --small: Qwen2.5-0.5B's shape (24 layers, hidden 896): an EXL3 conversion takes about a third
           of the 1.5B's on an H200, so one device session can make and measure every format.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

# Qwen2's tokenizer.json (Qwen/Qwen2.5-1.5B): NFC, then this split, then byte-level.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2.5-1.5B's config.json, minus what a random model does not need.
SHAPE = dict(
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=28,
    bos_token_id=151643,
    eos_token_id=151643,
)
# Qwen2.5-0.5B's config.json: the same vocabulary, 14 heads of 64, 2 K/V heads.
SMALL = dict(
    SHAPE,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_window_layers=21,
)
TINY = dict(
    SHAPE,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_window_layers=2,
)


def _strings(reader, key: str) -> list[str]:
    field = reader.fields[key]
    return [bytes(field.parts[i]).decode("utf-8") for i in field.data]


def write_tokenizer(vocab_gguf: str, out: Path) -> None:
    import gguf

    r = gguf.GGUFReader(vocab_gguf)
    tokens = _strings(r, "tokenizer.ggml.tokens")
    merges = _strings(r, "tokenizer.ggml.merges")
    types = r.fields["tokenizer.ggml.token_type"]
    kinds = [int(types.parts[i][0]) for i in types.data]
    normal = {t: i for i, (t, k) in enumerate(zip(tokens, kinds)) if k == 1}
    # Control (3) and user-defined (4) tokens are the added tokens; [PAD...] fill the rows past them.
    added = [
        {
            "id": i,
            "content": t,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": k == 4,
            "special": k == 3,
        }
        for i, (t, k) in enumerate(zip(tokens, kinds))
        if k in (3, 4) and not t.startswith("[PAD")
    ]
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": QWEN2_SPLIT}, "behavior": "Isolated", "invert": False},
                {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
            ],
        },
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": "",
            "end_of_word_suffix": "",
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": normal,
            "merges": merges,
        },
    }
    (out / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "model_max_length": 32768,
                "add_prefix_space": False,
                "errors": "replace",
                "clean_up_tokenization_spaces": False,
            }
        )
    )


def write_model(out: Path, shape: dict, seed: int = 0) -> None:
    from safetensors.numpy import save_file

    h, f, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    heads, kv = shape["num_attention_heads"], shape["num_key_value_heads"]
    d = h // heads
    rng = np.random.default_rng(seed)

    def w(*s: int) -> np.ndarray:
        return (rng.standard_normal(s, dtype=np.float32) * 0.02).astype(np.float16)

    config = {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "torch_dtype": "float16",
        "initializer_range": 0.02,
        **shape,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    shard: dict[str, np.ndarray] = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.ones(h, np.float16)}
    index: dict[str, str] = {}
    files = []

    def flush() -> None:
        name = f"model-{len(files) + 1:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        index.update({k: name for k in shard})
        files.append(name)
        shard.clear()

    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shard.update(
            {
                p + "self_attn.q_proj.weight": w(heads * d, h),
                p + "self_attn.q_proj.bias": w(heads * d),
                p + "self_attn.k_proj.weight": w(kv * d, h),
                p + "self_attn.k_proj.bias": w(kv * d),
                p + "self_attn.v_proj.weight": w(kv * d, h),
                p + "self_attn.v_proj.bias": w(kv * d),
                p + "self_attn.o_proj.weight": w(h, heads * d),
                p + "mlp.gate_proj.weight": w(f, h),
                p + "mlp.up_proj.weight": w(f, h),
                p + "mlp.down_proj.weight": w(h, f),
                p + "input_layernorm.weight": np.ones(h, np.float16),
                p + "post_attention_layernorm.weight": np.ones(h, np.float16),
            }
        )
        if sum(a.nbytes for a in shard.values()) > 2 * 2**30:
            flush()
    flush()
    total = sum((out / n).stat().st_size for n in files)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index}, indent=1)
    )


def main() -> None:
    vocab, out = sys.argv[1], Path(sys.argv[2])
    flags = sys.argv[3:]
    shape = TINY if "--tiny" in flags else SMALL if "--small" in flags else SHAPE
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    write_tokenizer(vocab, out)
    write_model(out, shape)
    print(f"{out}: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']}, {time.monotonic() - t0:.0f} s")


if __name__ == "__main__":
    main()
