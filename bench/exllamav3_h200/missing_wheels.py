"""Print the wheels of a directory whose modules this interpreter cannot import, one per line.

    python bench/exllamav3_h200/missing_wheels.py .carry/whl-exl3 [--always NAME ...]

A wheel's modules are its top-level entries (packages and single-file modules, from the zip's
names); it is missing when any of them does not import. The image's own packages are kept that
way, and only what it lacks is installed (pip --target shadows whatever it installs). --always
names wheels (by distribution name prefix) to list regardless (the engine itself).
"""

from __future__ import annotations

import importlib.util
import sys
import zipfile
from pathlib import Path


def modules(wheel: Path) -> set[str]:
    names = set()
    with zipfile.ZipFile(wheel) as z:
        for name in z.namelist():
            top = name.split("/", 1)[0]
            if top.endswith((".dist-info", ".data")) or top.startswith("_") and top.endswith(".pth"):
                continue
            if "/" in name:
                names.add(top)
            elif top.endswith(".py"):
                names.add(top[:-3])
            elif top.endswith(".so"):
                names.add(top.split(".", 1)[0])
    return {n for n in names if n.isidentifier()}


def main() -> int:
    folder = Path(sys.argv[1])
    always = sys.argv[sys.argv.index("--always") + 1 :] if "--always" in sys.argv else []
    for wheel in sorted(folder.glob("*.whl")):
        dist = wheel.name.split("-", 1)[0].lower()
        if any(dist == a.lower().replace("-", "_") for a in always):
            print(wheel)
            continue
        mods = modules(wheel)
        if not mods or any(importlib.util.find_spec(m) is None for m in mods):
            print(wheel)
    return 0


if __name__ == "__main__":
    sys.exit(main())
