"""A numpy stand-in for exllamav3's model, tokenizer and cache, as the scorer's worker side
(``plugins/exllamav3/worker_scoring.py``) sees them: an ``encode`` and one forward pass.

The "model" reads two positions: logits = A[this token] + B[the token before]. Quantized weights
(``quantization_config.bits`` in the directory's config.json) add noise to A that halves with
each bit, so KL divergence against the source falls as bits rise; a quantized cache
(``k<K>v<V>``) adds noise to B when the token before was read back from the cache (written by an
earlier pass), as exllamav3 dequantizes earlier passes' keys and attends over its own pass's
in FP16. Every pass is recorded, and a pass that reads a position no pass wrote fails.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

BOS = 1


def encode(text: str, add_bos: bool) -> list[int]:
    """Bytes as tokens 2..257, BOS 1."""
    return ([BOS] if add_bos else []) + [2 + b for b in text.encode("utf-8")]


def _kv_bits(cache_type: str) -> int | None:
    return None if cache_type == "fp16" else int(cache_type[1:].split("v")[0])


class FakeModel:
    def __init__(self, model_dir: str | Path, cache_type: str, seq_len: int):
        cfg = json.loads((Path(model_dir) / "config.json").read_text())
        self.n_vocab = int(cfg["vocab_size"])
        bits = (cfg.get("quantization_config") or {}).get("bits")
        v = self.n_vocab
        self.a = np.random.default_rng(0).normal(0.0, 2.0, (v, v))
        self.b = np.random.default_rng(1).normal(0.0, 2.0, (v, v))
        if bits:
            self.a = self.a + 2.0 ** -float(bits) * 4 * np.random.default_rng(2).normal(size=(v, v))
        k_bits = _kv_bits(cache_type)
        self.b_cached = (
            self.b if k_bits is None else self.b + 2.0**-k_bits * 4 * np.random.default_rng(3).normal(size=(v, v))
        )
        self.seq_len = seq_len
        self.tokens = np.zeros(seq_len, dtype=np.int64)
        self.written = 0  # positions [0, written) hold tokens some pass wrote
        self.passes: list[tuple[int, int, bool]] = []  # (past_len, tokens, rows taken)

    def forward(self, ids: Sequence[int], past_len: int, rows: bool) -> np.ndarray | None:
        if past_len > self.written:
            raise AssertionError(f"a pass at position {past_len} reads positions no pass wrote (up to {self.written})")
        if past_len + len(ids) > self.seq_len:
            raise AssertionError(f"positions up to {past_len + len(ids)} exceed the cache of {self.seq_len}")
        self.passes.append((past_len, len(ids), rows))
        self.tokens[past_len : past_len + len(ids)] = ids
        self.written = past_len + len(ids)
        if not rows:
            return None
        out = []
        for p in range(past_len, past_len + len(ids)):
            logits = self.a[self.tokens[p]].copy()
            if p > 0:
                logits += (self.b_cached if p - 1 < past_len else self.b)[self.tokens[p - 1]]
            out.append(logits)
        x = np.array(out)
        x = x - x.max(axis=1, keepdims=True)
        return (x - np.log(np.exp(x).sum(axis=1, keepdims=True))).astype(np.float32)
