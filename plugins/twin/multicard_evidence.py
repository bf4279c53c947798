"""The twin's several-card constants, fitted to published figures, and the figures held out.

The figures: llama.cpp PR #19378 ("ggml: backend-agnostic tensor parallelism (experimental)",
https://github.com/ggml-org/llama.cpp/pull/19378, its description's "Performance on 4x RTX
4090" table), llama-bench ``-sm layer`` against ``-sm tensor`` on the same four cards and
build. The PR names no board: four RTX 4090s have no NVLink and sit on PCIe 4.0 (the
catalog's pcie4 is an assumption of this fit). The model, Llama 3.2 1B at F16, is not in the
model catalog: its shape is below, from its config.json.

What is fitted is the ratio tensor / layer of each test, so the twin's one-card error (which
both splits share) cancels; two figures fix the two constants (``sync_us``,
``allreduce_efficiency``); pp8192 is held out: it is the same model on the same cards with
16 ubatches a prompt instead of one, which the layer split pipelines and the twin does not.

    python -m autotune_plugins.twin.multicard_evidence            # the table, fitted vs held out
    python -m autotune_plugins.twin.multicard_evidence --fit --write   # refit, write constants.toml
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from scipy.optimize import least_squares

from autotune.api import ModelSpec, TrialConfig
from autotune._builtin import get_gpu, weights_for
from autotune_plugins.twin import multicard, physics
from autotune_plugins.twin.backend import load_constants
from autotune_plugins.twin.formats import twin_formats

__all__ = ["FIGURES", "Figure", "fit", "rows"]

SOURCE = "https://github.com/ggml-org/llama.cpp/pull/19378 (description, Performance on 4x RTX 4090)"

# meta-llama/Llama-3.2-1B config.json: 16 layers, hidden 2048, 32 heads of 64, 8 KV heads,
# MLP 8192, vocabulary 128256, tied embeddings; 1.236 B parameters (llama-bench: "llama 1B F16").
LLAMA_32_1B = ModelSpec(
    key="llama-3.2-1b",
    name="Llama 3.2 1B",
    architecture="llama",
    n_layers=16,
    hidden_size=2048,
    n_heads=32,
    n_kv_heads=8,
    head_dim=64,
    ffn_size=8192,
    vocab_size=128256,
    n_params=1_235_814_400,
    tie_embeddings=True,
    max_context=131072,
    source="https://huggingface.co/meta-llama/Llama-3.2-1B/blob/main/config.json",
)


@dataclass(frozen=True)
class Figure:
    """One published test: llama-bench's t/s with ``-sm layer`` and with ``-sm tensor``."""

    test: str  # pp512, pp8192, tg128
    layer_tok_s: float
    tensor_tok_s: float
    role: str  # "fit" or "held out"

    @property
    def ratio(self) -> float:
        return self.tensor_tok_s / self.layer_tok_s


FIGURES = (
    Figure("tg128", 314.75, 409.87, "fit"),
    Figure("pp512", 44766.52, 18753.39, "fit"),
    Figure("pp8192", 50398.93, 17823.13, "held out"),
)
CARDS = ("rtx4090",) * 4
LINK = "pcie4"


def _scenario(test: str) -> physics.Scenario:
    prompt = int(test[2:]) if test.startswith("pp") else 1
    output = int(test[2:]) if test.startswith("tg") else 1
    return physics.Scenario(
        engine="llama.cpp",
        gpu=get_gpu(CARDS[0]),
        model=LLAMA_32_1B,
        weights=weights_for(LLAMA_32_1B, "gguf:F16", twin_formats()),
        ctx=max(512, prompt + output),
        parallel=1,
        cache_type="f16",
        flash_attn=True,
        prompt_tokens=prompt,
        output_tokens=output,
        harness="bench",
    )


def predicted(test: str, mode: str, mk: multicard.MulticardConstants) -> float:
    """The twin's t/s of one llama-bench test on the four cards."""
    engines, host, _ = load_constants()
    s = _scenario(test)
    split = multicard.split_of(
        TrialConfig("twin-llama.cpp", "gguf:F16", s.ctx, 1, (("split_mode", mode),)), [get_gpu(c) for c in CARDS], LINK
    )
    p = multicard.predict(s, engines["llama.cpp"], host, split, mk)
    return p.prefill_tok_s if test.startswith("pp") else p.decode_tok_s


def rows(mk: multicard.MulticardConstants | None = None) -> list[dict[str, object]]:
    """Each figure with the twin's ratio beside the published one."""
    mk = mk or multicard.load_multicard()
    out = []
    for f in FIGURES:
        layer, tensor = predicted(f.test, "layer", mk), predicted(f.test, "tensor", mk)
        out.append(
            {
                "test": f.test,
                "role": f.role,
                "published_ratio": f.ratio,
                "twin_ratio": tensor / layer,
                "published_layer": f.layer_tok_s,
                "twin_layer": layer,
                "published_tensor": f.tensor_tok_s,
                "twin_tensor": tensor,
            }
        )
    return out


def fit() -> multicard.MulticardConstants:
    """The two constants whose ratios match the fitted figures (log errors, least squares)."""
    fitted = [f for f in FIGURES if f.role == "fit"]

    def residuals(x):
        mk = multicard.MulticardConstants(sync_us=math.exp(x[0]), allreduce_efficiency=math.exp(x[1]))
        return [math.log((predicted(f.test, "tensor", mk) / predicted(f.test, "layer", mk)) / f.ratio) for f in fitted]

    result = least_squares(
        residuals,
        [math.log(10.0), math.log(0.3)],
        bounds=([math.log(0.1), math.log(1e-3)], [math.log(1e3), math.log(1.0)]),
    )
    return multicard.MulticardConstants(
        sync_us=round(math.exp(result.x[0]), 2), allreduce_efficiency=round(math.exp(result.x[1]), 4)
    )


def write(mk: multicard.MulticardConstants) -> Path:
    """``[multicard]`` of the twin's constants.toml, the rest of the file as it was."""
    path = Path(str(resources.files("autotune_plugins.twin").joinpath("constants.toml")))
    text = path.read_text(encoding="utf-8")
    table = (
        f"[multicard]\n# Fitted by: python -m autotune_plugins.twin.multicard_evidence --fit --write\n"
        f"sync_us = {mk.sync_us}\nallreduce_efficiency = {mk.allreduce_efficiency}\n"
    )
    text = (
        re.sub(r"\[multicard\]\n(?:[^\[]*)", table, text) if "[multicard]" in text else text.rstrip() + "\n\n" + table
    )
    path.write_text(text, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="fit sync_us and allreduce_efficiency to the fit rows")
    parser.add_argument("--write", action="store_true", help="with --fit: write them to constants.toml")
    args = parser.parse_args(argv)
    mk = multicard.load_multicard()
    if args.fit:
        mk = fit()
        print(f"fitted: sync_us = {mk.sync_us}, allreduce_efficiency = {mk.allreduce_efficiency}")
        if args.write:
            print(f"wrote {write(mk)}")
    print(f"4x RTX 4090 ({LINK}), Llama 3.2 1B F16, {SOURCE}")
    print(f"{'test':8} {'role':9} {'tensor/layer published':>23} {'twin':>6} {'layer pub':>10} {'twin':>9}")
    for r in rows(mk):
        print(
            f"{r['test']:8} {r['role']:9} {r['published_ratio']:23.2f} {r['twin_ratio']:6.2f} "
            f"{r['published_layer']:10.0f} {r['twin_layer']:9.0f}"
        )


if __name__ == "__main__":
    main()
