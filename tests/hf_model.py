"""A tiny Hugging Face model written offline: real Llama architecture, random weights, and a
byte-fallback BPE tokenizer trained here on autotune's own KLD text.

No torch and no download: the weights are numpy arrays saved with ``safetensors``, the
tokenizer is trained with ``tokenizers`` (both come with ``transformers``), and ``config.json``
is written by hand. llama.cpp's ``convert_hf_to_gguf.py`` reads it as it reads a real Llama
checkpoint (``LlamaHfVocab``: a BPE ``tokenizer.json`` with byte fallback).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

KLD_TEXT = Path(__file__).resolve().parents[1] / "plugins" / "quality" / "data" / "kld_text.txt"


def _tokenizer(out: Path, vocab_size: int, byte_level: bool = False) -> int:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    if byte_level:
        # GPT-2's scheme (Llama 3, Qwen): byte-level BPE, no byte fallback. llama.cpp's converter
        # recognises such a tokenizer only by the hash of its tokens on a fixed text, from a
        # table of published models; one trained here is in no table.
        tok = Tokenizer(models.BPE(unk_token=None))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=["<s>", "</s>"],
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train([str(KLD_TEXT)], trainer)
        tok.save(str(out / "tokenizer.json"))
        (out / "tokenizer_config.json").write_text(
            json.dumps(
                {
                    "tokenizer_class": "PreTrainedTokenizerFast",
                    "bos_token": "<s>",
                    "eos_token": "</s>",
                    "model_max_length": 2048,
                }
            )
        )
        return tok.get_vocab_size()
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(content=" ", left=1)]
    )
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False)
    tok.train([str(KLD_TEXT)], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "LlamaTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "add_eos_token": False,
                "model_max_length": 2048,
            }
        )
    )
    (out / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"})
    )
    return tok.get_vocab_size()


def write_tiny_llama(
    out: str | Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    heads: int = 4,
    kv_heads: int = 2,
    ffn: int = 128,
    vocab_size: int = 600,
    context: int = 2048,
    seed: int = 0,
    byte_level: bool = False,
) -> Path:
    """Writes the model directory ``out`` (config.json, model.safetensors, tokenizer files).

    The head size is ``hidden / heads`` (16 by default: q8_0 and q4_0 caches need 32; pass
    ``hidden=128`` for those). ``byte_level``: a GPT-2-style tokenizer that llama.cpp's
    converter does not recognise ("BPE pre-tokenizer was not recognized").
    """
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    n_vocab = _tokenizer(out, vocab_size, byte_level)
    head_dim = hidden // heads
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": ffn,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "vocab_size": n_vocab,
        "max_position_embeddings": context,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "tie_word_embeddings": False,
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "torch_dtype": "float16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    rng = np.random.default_rng(seed)

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.02).astype(np.float16)

    tensors = {
        "model.embed_tokens.weight": w(n_vocab, hidden),
        "model.norm.weight": np.ones(hidden, np.float16),
        "lm_head.weight": w(n_vocab, hidden),
    }
    for i in range(layers):
        p = f"model.layers.{i}."
        tensors |= {
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "mlp.gate_proj.weight": w(ffn, hidden),
            p + "mlp.up_proj.weight": w(ffn, hidden),
            p + "mlp.down_proj.weight": w(hidden, ffn),
            p + "input_layernorm.weight": np.ones(hidden, np.float16),
            p + "post_attention_layernorm.weight": np.ones(hidden, np.float16),
        }
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out
