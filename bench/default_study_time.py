"""Time the default study (``autotune study``, no arguments: the embedded twin) of two installs,
interleaved (A B A B ...), each run in a fresh directory (the default storage is
``sqlite:///v100-qwen27b.db`` in the working directory), and check that both print the same.

    python bench/default_study_time.py OLD/.venv/bin/autotune NEW/.venv/bin/autotune --rounds 4

Prints each run's wall and CPU (user + system) seconds, the medians per install, the load
average before and after, and whether every run's output equals the first run's (the summary,
the "why not a neighbour" lines, the trials in order). On a shared machine wall time follows
the load; CPU seconds follow it less.
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import tempfile
import time


def one_run(autotune: str) -> tuple[float, float, str]:
    """Wall seconds, CPU seconds and stdout of one default study in a fresh directory."""
    with tempfile.TemporaryDirectory(prefix="default-study-") as tmp:
        env = {k: v for k, v in os.environ.items() if k != "AUTOTUNE_STORAGE"}
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        start = time.perf_counter()
        done = subprocess.run([autotune, "study"], cwd=tmp, env=env, capture_output=True, text=True, check=True)
        wall = time.perf_counter() - start
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        return wall, cpu, done.stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("autotune", nargs="+", help="autotune executables to compare (one per install)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"load before: {os.getloadavg()}")
    runs: dict[str, list[tuple[float, float]]] = {a: [] for a in args.autotune}
    outputs: dict[str, set[str]] = {a: set() for a in args.autotune}
    for r in range(args.rounds):
        for a in args.autotune:
            wall, cpu, out = one_run(a)
            runs[a].append((wall, cpu))
            outputs[a].add(out)
            print(f"round {r + 1} {a}: {wall:.1f} s wall, {cpu:.1f} s cpu, load {os.getloadavg()[0]:.1f}", flush=True)
    print(f"load after: {os.getloadavg()}")
    first = next(iter(outputs[args.autotune[0]]))
    for a in args.autotune:
        walls, cpus = [w for w, _ in runs[a]], [c for _, c in runs[a]]
        same = outputs[a] == {first}
        print(
            f"{a}: median {statistics.median(walls):.1f} s wall (min {min(walls):.1f}), "
            f"{statistics.median(cpus):.1f} s cpu (min {min(cpus):.1f}); output {'same' if same else 'DIFFERS'}"
        )


if __name__ == "__main__":
    main()
