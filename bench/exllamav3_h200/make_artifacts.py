"""Make one of a study's formats ahead of the study, through the backend's own recipe and the
artifact cache the study reads (AUTOTUNE_ARTIFACTS_DIR), so that several conversions run at
once (the study itself makes them one at a time, when a trial first needs one).

    python bench/exllamav3_h200/make_artifacts.py STUDY_TOML BACKEND FORMAT

Prints the artifact's path, size and the seconds it took as one JSON line; a second run is a
cache hit (the study's too).
"""

from __future__ import annotations

import json
import sys
import time

from autotune import plugins
from autotune.modelfiles import artifacts
from autotune.config import load_study_config
from autotune.study.prepare import prepare_study


def main() -> int:
    study, backend_name, fmt = sys.argv[1:4]
    prepared = prepare_study(load_study_config(study))
    backend = plugins.get_backend(backend_name)
    ctx = prepared.contexts[backend_name]
    t0 = time.monotonic()
    made = artifacts.ensure(backend, fmt, ctx, say=lambda line: print(line, flush=True))
    path = made.path
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    print(
        json.dumps(
            {
                "backend": backend_name,
                "format": fmt,
                "path": str(path),
                "bytes": size,
                "seconds": round(time.monotonic() - t0, 1),
            }
        ),
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
