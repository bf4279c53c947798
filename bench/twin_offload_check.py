"""The twin against the H200 offload probe (issue 27): every measured offload and MoE point, the
twin's figure beside it and the ratio, with each point's role (fit: the two offload constants were
fitted on it; check: held out).

    python bench/twin_offload_check.py            # the table (markdown)

The points are bench/results/offload_probe_h200/*.jsonl (README.md there); the scenarios and roles
are plugins/twin/evidence.py's (h200_offload), the constants plugins/twin/constants.toml. A last
table gives, for each MoE prefill point with host experts, the share of the experts each ubatch
would have to copy for the twin to meet it (evidence.implied_routed_share).
"""

from __future__ import annotations

import math
import statistics
import sys

from autotune_plugins.twin import evidence, load_constants, physics


def rows() -> list[tuple[evidence.Figure, float]]:
    """Each offload probe figure with the twin's prediction."""
    engines, host, _ = load_constants()
    return evidence.h200_offload_predicted(engines, host)


def placement(s: physics.Scenario) -> str:
    n = s.model.n_layers
    layers = "all" if s.gpu_layers == "all" else f"ngl {s.gpu_layers}"
    moe = f", n-cpu-moe {s.n_cpu_moe}" if s.n_cpu_moe else ""
    return f"{n}L {'MoE' if s.model.is_moe else 'dense'}, {layers}{moe}, ub {s.ubatch}"


def main() -> int:
    table = rows()
    print("| point | source | placement | metric | role | measured | twin | twin/measured |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for f, pred in table:
        source = f.source.rsplit("/", 1)[-1].removesuffix(".jsonl")
        print(
            f"| {f.id.removeprefix('offload-').rsplit('-', 1)[0]} | {source} | {placement(f.scenario)} | "
            f"{f.metric.removesuffix('_tok_s')} | {f.role} | {f.value:,.1f} | {pred:,.1f} | {pred / f.value:.2f} |"
        )
    print()
    print("| group | points | median twin/measured | range | within +-25% | geometric mean abs error |")
    print("| --- | --- | --- | --- | --- | --- |")
    groups: dict[str, list[float]] = {}
    for f, pred in table:
        kind = "MoE" if f.scenario.model.is_moe else "dense"
        groups.setdefault(f"{f.role} {kind} {f.metric.removesuffix('_tok_s')}", []).append(pred / f.value)
    for name, ratios in sorted(groups.items()):
        inside = sum(abs(r - 1) <= 0.25 for r in ratios)
        gm = math.exp(statistics.mean(abs(math.log(r)) for r in ratios)) - 1
        print(
            f"| {name} | {len(ratios)} | {statistics.median(ratios):.2f} | {min(ratios):.2f}-{max(ratios):.2f} | "
            f"{inside}/{len(ratios)} | {gm:.0%} |"
        )
    print()
    print("MoE prefill with experts on the host: the share of each host layer's experts a ubatch must have")
    print("copied, at the dense crossings' fitted rate, for the twin to meet the measurement (the twin's")
    print("uniform routing copies all of them; bench/twin_probe_routing.py simulates the probe's prompt)")
    print()
    print("| point | host expert layers | ubatch | implied share of experts per ubatch | twin (uniform routing) |")
    print("| --- | --- | --- | --- | --- |")
    engines, host, _ = load_constants()
    for f, _pred in table:
        share = evidence.implied_routed_share(f, engines[f.scenario.engine], host)
        if share is not None:
            s, m = f.scenario, f.scenario.model
            uniform = physics.distinct_experts(m, min(s.ubatch, s.prompt_tokens)) / m.n_experts
            print(
                f"| {f.id.removeprefix('offload-').rsplit('-', 1)[0]} | {s.n_cpu_moe} | {s.ubatch} | {share:.2f} | {uniform:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
