"""Does ExLlamaV2's scorer return the model's own log-probabilities? Checked against transformers.

The FP16 HF model (transformers, on the GPU) is the reference. Each EXL2 conversion of it is
opened through autotune's scorer (``ExLlamaV2Scorer``: the worker process trials use, the
artifact's cache type), and its next-token distributions over one text are compared with the
reference's: mean KL divergence and top-1 agreement. A scorer that returned anything but the
quantized model's distributions (a wrong row offset, logits of the wrong vocabulary, another
position) would show a KLD far above the quantization's and a top-1 agreement near chance;
higher bpw must also come out closer. ``loglikelihood`` is checked against the sum of the same
scorer's next-token rows.

Usage: python scorer_check.py FP16_DIR EXL2_DIR[:CACHE] ... --out result.json
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

TEXT_FILE = "exllamav2/conversion/standard_cal_data/wiki.utf8"


def reference_logprobs(fp16_dir: str, tokens: list[int]):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(fp16_dir, torch_dtype=torch.float16).cuda().eval()
    with torch.inference_mode():
        logits = model(torch.tensor([tokens], device="cuda")).logits[0].float()
    out = torch.log_softmax(logits, dim=-1).cpu().numpy()
    del model
    torch.cuda.empty_cache()
    return out


def compare(ref, got) -> dict:
    import numpy as np

    v = min(ref.shape[1], got.shape[1])
    p, q = ref[:, :v].astype(np.float64), got[:, :v].astype(np.float64)
    kld = (np.exp(p) * (p - q)).sum(axis=1)
    return {
        "rows": int(p.shape[0]),
        "vocab_compared": int(v),
        "mean_kld": float(kld.mean()),
        "max_kld": float(kld.max()),
        "top1_agreement": float((p.argmax(1) == q.argmax(1)).mean()),
        "ref_mean_entropy": float(-(np.exp(p) * p).sum(axis=1).mean()),
        "chance_top1": 1.0 / v,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("fp16_dir")
    ap.add_argument("exl2", nargs="+", help="EXL2 directory, optionally :cache_type (fp16, q8, q6, q4)")
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    import exllamav2
    from tokenizers import Tokenizer

    from autotune.engine.backend import StudyContext, Workload
    from autotune.hardware.gpus import get_gpu
    from autotune.measure import Protocol
    from autotune.modelfiles.models import model_from_hf_config
    from autotune_plugins.exllamav2.backend import ExLlamaV2Backend
    from autotune_plugins.exllamav2.scorer import ExLlamaV2Scorer

    text = (Path(exllamav2.__file__).parent.parent / TEXT_FILE).read_text(encoding="utf-8")
    tok = Tokenizer.from_file(str(Path(args.fp16_dir) / "tokenizer.json"))
    tokens = tok.encode(text).ids[: args.tokens]
    result: dict = {"fp16_dir": args.fp16_dir, "n_tokens": len(tokens), "text": TEXT_FILE, "runs": []}
    out = Path(args.out)

    t = time.monotonic()
    ref = reference_logprobs(args.fp16_dir, tokens)
    result["reference_s"] = round(time.monotonic() - t, 1)
    backend = ExLlamaV2Backend()
    for spec in args.exl2:
        path, _, cache = spec.partition(":")
        cache = cache or "fp16"
        ctx = StudyContext(
            gpu=get_gpu("h200"),
            model=model_from_hf_config(path),
            workload=Workload(prompt_tokens=64, output_tokens=16),
            vram_budget_bytes=100 * 2**30,
            protocol=Protocol(),
            settings={"load_timeout_s": 300, "scoring_ctx": 1024},
            base_dir=Path(path).parent,
        )
        t = time.monotonic()
        scorer = ExLlamaV2Scorer.open(backend, Path(path).name, cache, ctx)
        try:
            got = scorer.next_token_logprobs(tokens)
            run = {"exl2": path, "cache": cache, "scorer": scorer.description, **compare(ref, got)}
            # loglikelihood of the text's last 8 tokens given the rest = the sum of the rows the
            # same scorer gives for the tokens the worker scores (context with BOS, continuation)
            context, continuation = tok.decode(tokens[:-8]), tok.decode(tokens[-8:])
            ll = scorer.loglikelihood([(context, continuation)])[0]
            ids = scorer.tokenize(context, add_bos=True) + scorer.tokenize(continuation, add_bos=False)
            rows = scorer.next_token_logprobs(ids)
            n = ll.n_tokens
            summed = float(sum(rows[len(ids) - n - 1 + i, ids[len(ids) - n + i]] for i in range(n)))
            run.update(
                {
                    "loglikelihood": ll.logprob,
                    "loglikelihood_tokens": n,
                    "sum_of_rows": summed,
                    "seconds": round(time.monotonic() - t, 1),
                }
            )
        finally:
            scorer.close()
        result["runs"].append(run)
        out.write_text(json.dumps(result, indent=1))
        print(json.dumps(run), flush=True)
    ok = all(r["top1_agreement"] > 10 * r["chance_top1"] and math.isfinite(r["mean_kld"]) for r in result["runs"])
    print("scorer check", "passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
