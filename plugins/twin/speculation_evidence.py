"""The twin's speculation cycle costs, fitted to published MTP figures, and the figures held out.

The figures: llama-server with Qwen3.8-27B's MTP head (``--spec-type draft-mtp``) against the
same server without it, one slot, each with the acceptance rate (accepted / drafted) the row
reports, from github.com/sudoingX/qwen38-mtp and one community benchmark. The twin prices the
catalog's 27B stand-in (``qwen2.5-27b-article``, Q4_K_M, q4_0 cache): a dense model, where the
published Qwen3.8-27B is a hybrid, so what is compared is the ratio with / without, whose
one-card error both sides share.

Two rows fix the two constants of :class:`speculation.CycleCosts` (``draft_pass_us``,
``verify_cycle_us``): the RTX 4090 at n-max 2 and the RTX 3090 at n-max 4, whose different
draft lengths tell a cost per draft pass from a cost per cycle. The rest are held out.

    python -m autotune_plugins.twin.speculation_evidence                 # the table
    python -m autotune_plugins.twin.speculation_evidence --fit --write   # refit, write constants.toml
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from scipy.optimize import least_squares

from autotune.api import StudyContext, TrialConfig
from autotune._builtin import Protocol, Workload, get_gpu, get_model
from autotune_plugins.twin import physics, speculation
from autotune_plugins.twin.backend import load_constants

__all__ = ["FIGURES", "Figure", "fit", "rows", "twin_ratio"]

MODEL = "qwen2.5-27b-article"
REPO = "https://github.com/sudoingX/qwen38-mtp"


@dataclass(frozen=True)
class Figure:
    """One published pair: decode tok/s without and with MTP at one slot."""

    setting: str
    gpu: str
    n_max: int
    rate: float | None  # the engine's acceptance rate; None: not published (the twin's default)
    without_tok_s: float
    with_tok_s: float
    role: str  # "fit" or "held out"
    source: str

    @property
    def ratio(self) -> float:
        return self.with_tok_s / self.without_tok_s


FIGURES = (
    Figure("RTX 4090, MTP n-max 2, acceptance 0.56", "rtx4090", 2, 0.56, 47.7, 76.3, "fit", f"{REPO}/pull/5"),
    Figure(
        "RTX 3090 (250 W cap), MTP n-max 4, acceptance 0.648", "rtx3090", 4, 0.648, 31.9, 52.8, "fit", f"{REPO}/pull/42"
    ),
    Figure(
        "RTX 3090 (overclocked), UD-Q4_K_XL, MTP n-max 2, acceptance 0.78",
        "rtx3090",
        2,
        0.78,
        43.9,
        79.6,
        "held out",
        f"{REPO}/pull/36 (sweeps/rtx-3090.md)",
    ),
    Figure(
        "RTX 3090, MTP n-max 2, acceptance 0.78",
        "rtx3090",
        2,
        0.78,
        31.0,
        41.3,
        "held out",
        f"{REPO} (README, @sudoingX's row)",
    ),
    Figure(
        "Tesla V100 32GB, MTP n-max 2, acceptance 0.75",
        "v100-32gb",
        2,
        0.75,
        33.3,
        48.0,
        "held out",
        f"{REPO} (README, V100 row)",
    ),
    Figure(
        "RTX 3090 (450 W), Qwen3.6-27B Q4_K_M, MTP n-max 2, acceptance not reported",
        "rtx3090",
        2,
        None,
        38.7,
        59.5,
        "held out",
        "https://provide.ai/llama-cpp-mtp-support-landed-qwen3-6-27b-at-2-44x-on-a-strix-halo-2-17x-on-a-rtx-3090-rig/",
    ),
)


def _decode(
    gpu: str, n_max: int, rate: float | None, parallel: int, costs: speculation.CycleCosts | None, spec: bool
) -> float:
    from autotune_plugins.twin import TwinLlamaCpp

    twin = TwinLlamaCpp()
    g = get_gpu(gpu)
    settings = {} if rate is None else {"acceptance_rate": rate}
    ctx = StudyContext(
        gpu=g,
        model=get_model(MODEL),
        workload=Workload(100, 400),
        vram_budget_bytes=g.vram_bytes,
        protocol=Protocol(warmup_runs=0, min_runs=1, max_runs=1),
        settings=settings,
    )
    options = {"cache_type": "q4_0", **({"spec_type": "draft-mtp", "spec_n_max": n_max} if spec else {})}
    s = twin.scenario(TrialConfig(twin.name, "gguf:Q4_K_M", 4096, parallel, tuple(sorted(options.items()))), ctx)
    if s.speculation is not None and costs is not None:
        s = replace(s, speculation=replace(s.speculation, costs=costs))
    _, host, _ = load_constants()
    p = physics.predict(s, twin.constants(), host)
    return p.decode_tok_s if parallel == 1 else p.aggregate_tok_s


def twin_ratio(
    gpu: str, n_max: int, rate: float | None, parallel: int = 1, costs: speculation.CycleCosts | None = None
) -> float:
    """The twin's speed with MTP over without (decode at one slot, aggregate at several)."""
    return _decode(gpu, n_max, rate, parallel, costs, True) / _decode(gpu, n_max, rate, parallel, costs, False)


def rows(costs: speculation.CycleCosts | None = None) -> list[dict[str, object]]:
    """Each figure with the twin's ratio beside the published one."""
    costs = costs or speculation.load_cycle_costs()
    return [
        {"figure": f, "published_ratio": f.ratio, "twin_ratio": twin_ratio(f.gpu, f.n_max, f.rate, 1, costs)}
        for f in FIGURES
    ]


def fit() -> speculation.CycleCosts:
    """The two costs whose ratios match the fitted figures (log errors, least squares, >= 0)."""
    fitted = [f for f in FIGURES if f.role == "fit"]

    def residuals(x):
        c = speculation.CycleCosts(draft_pass_us=x[0], verify_cycle_us=x[1])
        return [math.log(twin_ratio(f.gpu, f.n_max, f.rate, 1, c) / f.ratio) for f in fitted]

    result = least_squares(residuals, [500.0, 500.0], bounds=([0.0, 0.0], [1e5, 1e5]), x_scale=[1000.0, 1000.0])
    return speculation.CycleCosts(
        draft_pass_us=round(float(result.x[0]), 1), verify_cycle_us=round(float(result.x[1]), 1)
    )


def write(c: speculation.CycleCosts) -> Path:
    """``[speculation]`` of the twin's constants.toml, the rest of the file as it was."""
    path = Path(str(resources.files("autotune_plugins.twin").joinpath("constants.toml")))
    text = path.read_text(encoding="utf-8")
    table = (
        f"[speculation]\n# Fitted by: python -m autotune_plugins.twin.speculation_evidence --fit --write\n"
        f"draft_pass_us = {c.draft_pass_us}\nverify_cycle_us = {c.verify_cycle_us}\n"
    )
    if "[speculation]" in text:
        text = re.sub(r"\[speculation\]\n(?:[^\[]*)", table, text)
    else:
        text = text.rstrip() + "\n\n" + table
    path.write_text(text, encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fit", action="store_true", help="fit draft_pass_us and verify_cycle_us to the fit rows")
    parser.add_argument("--write", action="store_true", help="with --fit: write them to constants.toml")
    args = parser.parse_args(argv)
    costs = speculation.load_cycle_costs()
    if args.fit:
        costs = fit()
        print(f"fitted: draft_pass_us = {costs.draft_pass_us}, verify_cycle_us = {costs.verify_cycle_us}")
        if args.write:
            print(f"wrote {write(costs)}")
    print(f"{'role':9} {'published':>9} {'twin':>6} {'twin/pub':>8}  setting")
    for r in rows(costs):
        f = r["figure"]
        print(
            f"{f.role:9} {r['published_ratio']:9.2f} {r['twin_ratio']:6.2f} "
            f"{r['twin_ratio'] / r['published_ratio']:8.2f}  {f.setting}"
        )


if __name__ == "__main__":
    main()
