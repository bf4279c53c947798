"""What exllamav3 1.6.5 does on one H200, before the backend is trusted with it (issue 30).

Steps (each argv[1]): ``model OUT_DIR`` writes a random-weight Qwen2.5-0.5B-shaped FP16 model
with a byte-level BPE tokenizer trained offline on exllamav3's bundled calibration text;
``measure DIR...`` loads each EXL3 directory, and for cache modes fp16 / k8v8 / k4v4 and
1 and 4 concurrent jobs times decode through exllamav3's Generator, and reads the process's
memory from NVML (the card's used memory less what it was before the load) beside what the
files and the cache's own tensors hold. Prints one JSON line per measurement and writes
them to $OUT/exl3_probe.jsonl. Random weights: speed and memory are real, text is not.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Qwen2.5-0.5B's config.json (24 layers, hidden 896, 14 heads, 2 KV heads of 64).
SHAPE = dict(
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    max_position_embeddings=32768,
    rope_theta=1000000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_sliding_window=False,
    sliding_window=32768,
    max_window_layers=24,
    bos_token_id=0,
    eos_token_id=0,
)


def emit(rec: dict) -> None:
    line = json.dumps(rec)
    print(line, flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(Path(out) / "exl3_probe.jsonl", "a", encoding="utf-8") as f:
            f.write(line + "\n")


def build(out: Path) -> None:
    import exllamav3.conversion as conv
    import torch
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Qwen2Config, Qwen2ForCausalLM

    out.mkdir(parents=True, exist_ok=True)
    cal = sorted((Path(list(conv.__path__)[0]) / "standard_cal_data").glob("*.utf8"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(SPLIT), behavior="isolated", invert=False),
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
                "model_max_length": 32768,
            }
        )
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(Qwen2Config(**SHAPE, torch_dtype="float16")).to(torch.float16)
    model.save_pretrained(out, safe_serialization=True)
    cfg = json.loads((out / "config.json").read_text())
    cfg.setdefault("rope_theta", SHAPE["rope_theta"])
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    emit({"step": "model", "bytes": sum(f.stat().st_size for f in out.glob("*.safetensors"))})


def used_mib() -> float:
    import pynvml

    pynvml.nvmlInit()
    h = pynvml.nvmlDeviceGetHandleByIndex(int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0))
    return pynvml.nvmlDeviceGetMemoryInfo(h).used / 2**20


def measure(directory: Path, cache_mode: str, jobs: int, ctx: int = 4096, new_tokens: int = 256) -> dict:
    import torch
    from exllamav3 import Cache, CacheLayer_fp16, CacheLayer_quant, Config, Generator, Job, Model, Tokenizer

    before = used_mib()
    config = Config.from_directory(str(directory))
    model = Model.from_config(config)
    tokens = ctx * jobs
    if cache_mode == "fp16":
        cache = Cache(model, max_num_tokens=tokens, layer_type=CacheLayer_fp16)
    else:
        k, v = (int(x) for x in cache_mode[1:].split("v"))
        cache = Cache(model, max_num_tokens=tokens, layer_type=CacheLayer_quant, k_bits=k, v_bits=v)
    model.load(progressbar=False)
    tokenizer = Tokenizer.from_config(config)
    gen = Generator(model=model, cache=cache, tokenizer=tokenizer, max_batch_size=jobs)
    loaded = used_mib()
    prompt = torch.randint(100, 4000, (1, 512))

    def run(n_jobs: int) -> tuple[float, float]:
        for i in range(n_jobs):
            gen.enqueue(
                Job(
                    input_ids=prompt + i,
                    max_new_tokens=new_tokens,
                    min_new_tokens=new_tokens,
                    stop_conditions=[],
                    identifier=i,
                )
            )
        t0 = time.perf_counter()
        first = None
        produced = 0
        while gen.num_remaining_jobs():
            for r in gen.iterate():
                if r.get("stage") == "streaming" and first is None:
                    first = time.perf_counter()
                if r.get("eos"):
                    produced += int(r.get("new_tokens", 0))
        t1 = time.perf_counter()
        # min_new_tokens = max_new_tokens: every job makes exactly new_tokens
        return (produced or n_jobs * new_tokens) / (t1 - t0), (first - t0) if first else float("nan")

    run(jobs)  # warm-up
    agg, ttft = run(jobs)
    peak = used_mib()
    files = sum(f.stat().st_size for f in directory.glob("*.safetensors"))
    cache_bytes = (
        sum(
            t.numel() * t.element_size()
            for layer in cache.layers.values()
            if hasattr(layer, "__dict__")
            for t in vars(layer).values()
            if isinstance(t, torch.Tensor)
        )
        if hasattr(cache, "layers")
        else None
    )
    rec = {
        "step": "measure",
        "dir": directory.name,
        "cache": cache_mode,
        "jobs": jobs,
        "ctx": ctx,
        "aggregate_tok_s": round(agg, 1),
        "ttft_s": round(ttft, 4),
        "files_mib": round(files / 2**20, 1),
        "cache_tensor_mib": None if cache_bytes is None else round(cache_bytes / 2**20, 1),
        "nvml_loaded_mib": round(loaded - before, 1),
        "nvml_peak_mib": round(peak - before, 1),
        "torch_reserved_mib": round(torch.cuda.memory_reserved() / 2**20, 1),
        "torch_allocated_mib": round(torch.cuda.memory_allocated() / 2**20, 1),
    }
    emit(rec)
    model.unload()
    del gen, cache, model
    torch.cuda.empty_cache()
    return rec


def main() -> None:
    step = sys.argv[1]
    if step == "model":
        t = time.monotonic()
        build(Path(sys.argv[2]))
        emit({"step": "model_s", "s": round(time.monotonic() - t, 1)})
    elif step == "jit":
        t = time.monotonic()
        import exllamav3.ext  # noqa: F401  (the JIT build happens on this import)

        emit({"step": "jit", "s": round(time.monotonic() - t, 1)})
    elif step == "measure":
        for d in sys.argv[2:]:
            for cache_mode in ("fp16", "k8v8", "k4v4"):
                for jobs in (1, 4):
                    try:
                        measure(Path(d), cache_mode, jobs)
                    except Exception as e:  # one failed point must not hide the others
                        emit(
                            {
                                "step": "measure",
                                "dir": Path(d).name,
                                "cache": cache_mode,
                                "jobs": jobs,
                                "error": f"{type(e).__name__}: {e}"[:500],
                            }
                        )
    else:
        sys.exit(f"unknown step {step!r}: model, jit or measure")


if __name__ == "__main__":
    main()
