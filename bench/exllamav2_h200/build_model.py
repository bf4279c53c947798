"""Step 1: a random-weight Qwen2 model (Qwen2.5-1.5B shapes) as FP16 safetensors, no download.

The tokenizer is a byte-level BPE of 4096 tokens trained here, offline, on the calibration
text ExLlamaV2's wheel ships (exllamav2/conversion/standard_cal_data), with Qwen2's own
pre-tokenizer (the split regex of Qwen2's tokenizer.json, then ByteLevel). Why this one:
ExLlamaV2 0.3.2 loads only tokenizer.json; llama.cpp's converter recognises a BPE
tokenizer by a hash of its output and would refuse ours, but with Qwen2's pre-tokenizer we
may tell it "qwen2" (gguf_from_hf.py) and both engines tokenize alike. The model keeps Qwen2's
vocabulary size (151936 rows): the head's bandwidth is the real model's; ExLlamaV2's sampler
masks the rows past the tokenizer's 4096.

Usage: python build_model.py OUT_DIR [--tiny]  (about 1 minute on an H200; writes timings to $OUT)

--tiny: a 4-layer, 512-wide Qwen2 with the tokenizer's own 4096-token vocabulary and larger
random weights (initializer_range 0.1), so that its next-token distributions are peaked rather
than flat: a model whose quantization damage a scorer check can see, converted in seconds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
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
    bos_token_id=0,
    eos_token_id=0,
)

TINY = dict(
    SHAPE,
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=2,
    vocab_size=4096,
    max_position_embeddings=4096,
    sliding_window=4096,
    max_window_layers=4,
    initializer_range=0.1,
)


def build_tokenizer(out: Path, max_length: int) -> None:
    import exllamav2.conversion as conv
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    cal = sorted((Path(list(conv.__path__)[0]) / "standard_cal_data").glob("*.utf8"))
    if not cal:
        sys.exit("no calibration text under exllamav2/conversion/standard_cal_data: is exllamav2 0.3.2 installed?")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.train(
        [str(p) for p in cal],
        trainers.BpeTrainer(
            vocab_size=4096, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": None,
                "eos_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": max_length,
                "added_tokens_decoder": {
                    str(i): {
                        "content": t,
                        "special": True,
                        "lstrip": False,
                        "rstrip": False,
                        "normalized": False,
                        "single_word": False,
                    }
                    for i, t in enumerate(SPECIALS)
                },
            },
            indent=1,
        )
    )


def build_model(out: Path, shape: dict) -> None:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(**shape, torch_dtype="float16")
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = Qwen2ForCausalLM(config).to(torch.float16)
    model.save_pretrained(out, safe_serialization=True)
    # transformers 5 writes the RoPE base only under rope_parameters; ExLlamaV2 0.3.2 (and its
    # converter, which copies config.json) reads the top-level rope_theta alone.
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg.setdefault("rope_theta", shape["rope_theta"])
    cfg_path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")


def main() -> None:
    out = Path(sys.argv[1])
    shape = TINY if "--tiny" in sys.argv[2:] else SHAPE
    out.mkdir(parents=True, exist_ok=True)
    times = {}
    t = time.monotonic()
    build_tokenizer(out, shape["max_position_embeddings"])
    times["tokenizer_s"] = round(time.monotonic() - t, 1)
    t = time.monotonic()
    build_model(out, shape)
    times["model_s"] = round(time.monotonic() - t, 1)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    times["safetensors_bytes"] = size
    print(json.dumps(times))
    if os.environ.get("OUT"):
        (Path(os.environ["OUT"]) / "build_model.json").write_text(json.dumps(times, indent=1))


if __name__ == "__main__":
    main()
