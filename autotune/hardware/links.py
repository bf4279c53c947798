"""Links between cards: what a model split over several cards sends its activations over.

The GPU catalog (``autotune/data/gpus.toml``) holds one ``[links.<key>]`` table per kind of
link: PCIe 3.0/4.0/5.0 x16 and NVLink, each with its one-direction bandwidth and the source of
it, and a per-copy latency that is an assumption (the file says so). A card's own link is the
PCIe generation the catalog gives it (:func:`host_link`); a study names another (a bridge, an
SXM board) where it knows better. The core reads the figures; what they cost a split is each
model's business (the twin's ``plugins/twin/multicard.py``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from autotune._catalog import read_table
from autotune.errors import ConfigError
from autotune.hardware.gpus import GpuSpec

__all__ = ["Link", "get_link", "host_link", "load_links", "slowest_link"]

_FILE = "gpus.toml"


@dataclass(frozen=True)
class Link:
    """One kind of link between cards.

    Attributes:
        key: Its catalog key (``pcie4``, ``nvlink``).
        name: For people.
        gb_s: One-direction bandwidth, GB/s (1e9 B/s), as the specification gives it.
        latency_us: Fixed cost of one small copy over it, microseconds: an ASSUMPTION.
        source: Where ``gb_s`` comes from.
    """

    key: str
    name: str
    gb_s: float
    latency_us: float
    source: str

    @property
    def bytes_per_s(self) -> float:
        return self.gb_s * 1e9


def _link(key: str, table: Any, where: str) -> Link:
    problems = []
    if not isinstance(table, Mapping):
        raise ConfigError(f"{where}: [links.{key}] must be a table with name, gb_s, latency_us and source")
    for field, kinds in (("name", (str,)), ("gb_s", (int, float)), ("latency_us", (int, float)), ("source", (str,))):
        value = table.get(field)
        if value is None:
            problems.append(f"field '{field}' missing")
        elif isinstance(value, bool) or not isinstance(value, kinds):
            problems.append(f"field '{field}' = {value!r}: wrong type")
        elif kinds != (str,) and not value > 0:
            problems.append(f"field '{field}' = {value!r}: must be > 0")
    if problems:
        raise ConfigError(f"{where}: [links.{key}] " + "; ".join(problems))
    return Link(key, table["name"], float(table["gb_s"]), float(table["latency_us"]), table["source"])


@functools.lru_cache(maxsize=1)
def _links() -> Mapping[str, Link]:
    table, where = read_table(_FILE, "links")
    return {key: _link(key, value, where) for key, value in table.items()}


def load_links() -> dict[str, Link]:
    """Every link the catalog knows, by key, in file order."""
    return dict(_links())


def get_link(key: str, source: str = "interconnect") -> Link:
    """The catalog's link ``key``.

    Raises:
        ConfigError: No such link; the message names ``source`` and the accepted keys.
    """
    known = _links()
    if key not in known:
        raise ConfigError(f"{source} = {key!r}: not a link of the catalog (accepted: {', '.join(known)})")
    return known[key]


def host_link(gpu: GpuSpec) -> Link:
    """The PCIe link a card sits on (``pcie_gen`` of its catalog entry; a CPU device counts as
    PCIe 4.0: an RPC device's copies go through host memory, which is no slower)."""
    gen = gpu.pcie_gen if gpu.pcie_gen in (3, 4, 5) else 4
    return get_link(f"pcie{gen}")


def slowest_link(gpus: Sequence[GpuSpec]) -> Link:
    """The link between the cards of a set, when the study does not name one: each card's own
    PCIe, and a copy between two goes at the slower one's pace."""
    return min((host_link(g) for g in gpus), key=lambda link: link.gb_s)
