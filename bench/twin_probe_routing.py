"""How many of a layer's experts the H200 offload probe's prompt routes a ubatch to (issue 27).

The probe (bench/offload_probe.py) prefills ``"{i} w0 w1 ... w96 w0 ..."``: 512 words, 1477
tokens, of which Qwen's tokenizer (one token per digit) makes ~11 distinct ids (" w", "0".."9"),
into a random-weight model (plugins/llama_server/synth.py: N(0, 0.02) weights, norms of ones).
llama.cpp copies only the experts a ubatch's ids name (ggml-backend.cpp,
ggml_backend_sched_compute_splits); the twin counts them for uniform routing, E(1-(1-k/E)^B):
all 128 of 128 for a 512-token ubatch. This script runs the first layers of that random model
in numpy (Qwen3-30B-A3B's shape, RoPE left out, one shared FFN of the experts' scale standing in
for the routed experts' output) and prints the distinct experts per ubatch, for the probe's
token pattern and for random ids of the same length.

    python bench/twin_probe_routing.py [layers]      # 3 layers: ~1 min on 2 cores

On the dev VM (3 layers, seed 0): probe prompt ub 512: 54/32/32, 48/30/28, 36/25/22 of 128
per ubatch; one 1477-token ubatch: 50, 48, 44. Random ids: 120/104/99, 60/59/57, 65/46/51 and
115, 65, 70. What the measured prefill implies at the dense crossings' rate
(evidence.implied_routed_share, bench/twin_offload_check.py): 0.12-0.22 of the experts per
512-token ubatch, 0.30-0.36 per 1477-token one.
"""

from __future__ import annotations

import sys

import numpy as np

H, N_HEAD, N_KV, HEAD, E, K, FF, STD = 2048, 32, 4, 128, 128, 8, 768, 0.02


def probe_tokens() -> np.ndarray:
    """The probe prompt's token pattern: ids 0-9 for the digits, 100 for " w", 1-2 the prefix."""
    toks = [1, 2]
    for i in range(512):
        toks.append(100)
        toks += [int(c) for c in str(i % 97)]
    return np.array(toks)


def rms(x: np.ndarray) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6)


def distinct_per_ubatch(tokens: np.ndarray, ub: int, layers: int, rng: np.random.Generator) -> list[list[int]]:
    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * STD).astype(np.float32)

    n_tok = len(tokens)
    x = w(200, H)[tokens]
    mask = np.triu(np.full((n_tok, n_tok), -np.inf, np.float32), 1)
    out = []
    for _ in range(layers):
        n = rms(x)
        q = (n @ w(H, N_HEAD * HEAD)).reshape(n_tok, N_HEAD, HEAD)
        k = (n @ w(H, N_KV * HEAD)).reshape(n_tok, N_KV, HEAD)
        v = (n @ w(H, N_KV * HEAD)).reshape(n_tok, N_KV, HEAD)
        att = np.empty((n_tok, N_HEAD, HEAD), np.float32)
        for h in range(N_HEAD):
            s = q[:, h] @ k[:, h // (N_HEAD // N_KV)].T / np.sqrt(HEAD) + mask
            s = np.exp(s - s.max(1, keepdims=True))
            att[:, h] = (s / s.sum(1, keepdims=True)) @ v[:, h // (N_HEAD // N_KV)]
        x = x + att.reshape(n_tok, -1) @ w(N_HEAD * HEAD, H)
        n = rms(x)
        top = np.argsort(-(n @ w(H, E)), 1)[:, :K]
        out.append([len(np.unique(top[i : i + ub])) for i in range(0, n_tok, ub)])
        x = x + np.sqrt(K) * (np.maximum(n @ w(H, FF), 0) @ w(FF, H))
    return out


def main() -> int:
    layers = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    rng = np.random.default_rng(0)
    tokens = probe_tokens()
    print(f"{len(tokens)} tokens, {len(np.unique(tokens))} distinct ids; distinct experts of {E} per ubatch, by layer")
    for ub in (512, 2048):
        print(f"probe prompt, ub {ub}: {distinct_per_ubatch(tokens, ub, layers, rng)}")
        print(f"random ids,   ub {ub}: {distinct_per_ubatch(rng.integers(0, 200, len(tokens)), ub, layers, rng)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
