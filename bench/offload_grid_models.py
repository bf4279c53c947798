"""Header-only GGUF files of the two issue-27 grid models, so that a replay or the twin can be
asked about them where the real files are not (they were made on the device machine and left
there: bench/h200_offload_grids.sh).

    python bench/offload_grid_models.py [--out /tmp/offload_grid_models]

Each file is what ``autotune synth`` writes for the shape bench/h200_offload_grids.sh gives
(``SHAPES`` below repeats its synth arguments): the same metadata and tensor table (F16, the
synth's own type), the Qwen2 vocabulary of the CPU engine build, and a sparse data section of
the right length, so ``resolve_model`` reads the same ModelSpec the grid's model had (the grids
ran its Q4_K_M; a ModelSpec is the shape, the format is the replay's). Prints the paths.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from autotune_plugins.llama_server.gguf_tokenizer import read_tokenizer
from autotune_plugins.llama_server.synth import find_vocab, gguf_writer
from autotune_plugins.llama_server.synth_shapes import SynthSpec, tensor_plan

# bench/h200_offload_grids.sh prep: `autotune synth` arguments of each grid's model.
SHAPES = {
    "q7b": SynthSpec(arch="qwen2", n_layers=28, hidden=3584, n_heads=28, n_kv_heads=4, ffn=18944, context_length=32768),
    "q30a3b12": SynthSpec(
        arch="qwen3moe",
        n_layers=12,
        hidden=2048,
        n_heads=32,
        n_kv_heads=4,
        ffn=6144,
        head_size=128,
        experts=128,
        experts_used=8,
        expert_ffn=768,
        context_length=32768,
    ),
}
# The study each model served ([study] name of bench/h200_grid_*.toml).
STUDY_OF = {"q7b": "h200-grid-offload-dense", "q30a3b12": "h200-grid-moe"}


def write_header_only(spec: SynthSpec, out: Path, vocab: Path) -> Path:
    """``synth.write_model``'s file without its weights: header, metadata, tensor infos, then a
    hole as long as the aligned tensor data."""
    import gguf

    tokenizer, n_vocab = read_tokenizer(vocab)
    plan = tensor_plan(spec, n_vocab)
    w = gguf_writer(out, spec, tokenizer, n_vocab, plan)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    assert w.fout is not None
    fout = w.fout[0]
    end = gguf.GGUFWriter.ggml_pad(fout.tell(), w.data_alignment)
    for t in plan:
        end += gguf.GGUFWriter.ggml_pad(t.nbytes, w.data_alignment)
    fout.flush()
    w.close()
    with open(out, "r+b") as f:
        f.truncate(end)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("/tmp/offload_grid_models"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    for stem, spec in SHAPES.items():
        path = args.out / f"{stem}.gguf"
        if not path.exists():
            write_header_only(spec, path, find_vocab(spec.arch))
        print(f"{STUDY_OF[stem]}={path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
