"""Several cards: which cards a study has, and what each may hold (issue 40).

A study names its cards in ``[hardware] gpus``: ``["auto"]`` for every card CUDA shows here
(NVML's view, in CUDA's order, as ``CUDA_VISIBLE_DEVICES`` restricts it), or catalog keys, one
per card, in the engine's device order (``["rtx3090", "rtx3060-12gb"]``). ``["cpu", "cpu"]``
gives a CPU-only machine several devices whose memory is host memory, each its own share: a
backend that can run several devices on the CPU (llama.cpp's RPC backend) runs it for real,
so the placement logic is tested without GPUs.

Each card gets its own budget: ``vram_budget_gib`` and ``safety_margin_mib`` are one number
for every card or a list, one per card. :class:`Placement` is what a study carries: the cards,
their budgets, a key that says whether two studies ran on the same set of cards (a stored
study refuses another set), and the header's lines. What goes where on them is the backend's
business (its split dimensions and per-device memory model); the core only checks each card's
share against that card's budget (``check_cards``). It knows no engine by name.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from autotune.hardware import cuda_devices
from autotune.hardware import gpus as hardware
from autotune.errors import ConfigError
from autotune.hardware.gpus import CPU_KEY, GpuSpec

__all__ = ["Card", "CardsRequest", "Placement", "check_cards", "cuda_visible", "read_cards", "resolve_placement"]

AUTO = "auto"
ACCEPTED_GPUS = (
    '["auto"] (every card CUDA shows), or catalog keys, one per card, e.g. ["rtx3090", '
    '"rtx3060-12gb"] (autotune estimate --help lists them), or ["cpu", "cpu"] (host-memory devices)'
)
# No card holds more (config.MAX_VRAM_GIB says why): a typo of unit.
_MAX_GIB = 1024


@dataclass(frozen=True)
class CardsRequest:
    """``[hardware] gpus`` and its per-card budgets, as the study file wrote them.

    Attributes:
        gpus: The names, as written (``("auto",)`` or catalog keys).
        budgets_gib: One per card (None: the card's memory), or one figure for every card
            (a tuple of length 1 while ``gpus`` is ``auto``, whose count is known only here).
        margins_mib: Same, for the safety margin.
    """

    gpus: tuple[str, ...]
    budgets_gib: tuple[float | None, ...]
    margins_mib: tuple[float, ...]


@dataclass(frozen=True)
class Card:
    """One card of a study.

    Attributes:
        device: Its number among the study's cards: the engine's device order (CUDA device N
            under the study's ``CUDA_VISIBLE_DEVICES``; the N-th extra device on the CPU).
        spec: What the models know of it.
        memory_bytes: The memory its budget is taken from: the file's cap, else the card's.
        margin_bytes: Kept free of it.
        memory_source: Where ``memory_bytes`` comes from, for people.
        nvml_index: NVML's number for it (``auto``), or None for a catalog or CPU card.
    """

    device: int
    spec: GpuSpec
    memory_bytes: int
    margin_bytes: int
    memory_source: str
    nvml_index: int | None = None

    @property
    def budget_bytes(self) -> int:
        return self.memory_bytes - self.margin_bytes

    def describe(self) -> str:
        where = f", NVML {self.nvml_index}" if self.nvml_index is not None else ""
        return (
            f"device {self.device}: {self.spec.name}{where}: budget {self.budget_bytes / 2**30:.2f} GiB = "
            f"{self.memory_bytes / 2**30:.2f} GiB ({self.memory_source}) - {self.margin_bytes / 2**30:.2f} GiB "
            "safety margin"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "key": self.spec.key,
            "name": self.spec.name,
            "vram_bytes": self.spec.vram_bytes,
            "memory_bytes": self.memory_bytes,
            "margin_bytes": self.margin_bytes,
            "budget_bytes": self.budget_bytes,
            "nvml_index": self.nvml_index,
        }


@dataclass(frozen=True)
class Placement:
    """The cards a study has, in the engine's device order."""

    cards: tuple[Card, ...]

    @property
    def budgets(self) -> tuple[int, ...]:
        """Each card's budget, safety margin off, in device order."""
        return tuple(c.budget_bytes for c in self.cards)

    @property
    def total_budget_bytes(self) -> int:
        return sum(self.budgets)

    @property
    def keys(self) -> tuple[str, ...]:
        """What makes two studies' cards the same set: each card's kind, in order."""
        return tuple(c.spec.key for c in self.cards)

    @property
    def on_cpu(self) -> bool:
        return all(c.spec.is_cpu for c in self.cards)

    def lines(self) -> list[str]:
        """The run header's lines, one per card."""
        return [c.describe() for c in self.cards]

    def to_dict(self) -> dict[str, Any]:
        return {"cards": [c.to_dict() for c in self.cards]}


def _number_or_list(
    value: Any, n: int | None, key: str, low: float, high: float, unit: str, error: Callable[[str, Any, str], None]
) -> tuple[Any, ...] | None:
    """One figure for every card, or a list of one per card; None after reporting a problem."""
    values = value if isinstance(value, list) else [value]
    bad = [v for v in values if isinstance(v, bool) or not isinstance(v, (int, float)) or not low <= v <= high]
    if not values or bad:
        error(
            key,
            value,
            f"must be a number {low:g}..{high:g} ({unit} of one card) or a list of them, one per "
            "card of [hardware] gpus",
        )
        return None
    if isinstance(value, list) and n is not None and len(values) not in (1, n):
        error(
            key,
            value,
            f"gives {len(values)} figures for {n} cards of [hardware] gpus: give one figure, or one per card",
        )
        return None
    return tuple(float(v) for v in values)


def read_cards(
    hw: Mapping[str, Any], error: Callable[[str, Any, str], None], default_margin_mib: float
) -> CardsRequest | None:
    """Reads ``[hardware] gpus`` and its per-card budgets (None: the table names no ``gpus``).

    Args:
        hw: The ``[hardware]`` table.
        error: Reports one problem: (field, value as written, what is accepted).
        default_margin_mib: The margin of a card the file gives none for.
    """
    if "gpus" not in hw:
        for key in ("vram_budget_gib", "safety_margin_mib"):
            if isinstance(hw.get(key), list):
                error(
                    key,
                    hw[key],
                    "a list gives one figure per card of [hardware] gpus, which is not given: add "
                    "gpus, or give one number",
                )
        return None
    gpus = hw["gpus"]
    if not isinstance(gpus, list) or not gpus or not all(isinstance(g, str) and g.strip() for g in gpus):
        error("gpus", gpus, f"must be a non-empty list of names: {ACCEPTED_GPUS}")
        return None
    for key in ("gpu", "gpu_index"):
        if key in hw:
            error(key, hw[key], "names one card; [hardware] gpus names them all: give one or the other")
    if AUTO in gpus and len(gpus) > 1:
        error("gpus", gpus, "'auto' stands for every card CUDA shows and comes alone: [\"auto\"], or name each card")
        return None
    if CPU_KEY in gpus and set(gpus) != {CPU_KEY}:
        error("gpus", gpus, "'cpu' devices are host memory and do not mix with cards: all 'cpu', or all cards")
        return None
    n = None if gpus == [AUTO] else len(gpus)
    budgets: tuple[float | None, ...] = (None,)
    if "vram_budget_gib" in hw:
        read = _number_or_list(hw["vram_budget_gib"], n, "vram_budget_gib", 1 / 1024, _MAX_GIB, "GiB", error)
        if read is None:
            return None
        budgets = read
    margins = (float(default_margin_mib),)
    if "safety_margin_mib" in hw:
        read = _number_or_list(hw["safety_margin_mib"], n, "safety_margin_mib", 0, _MAX_GIB * 1024, "MiB", error)
        if read is None:
            return None
        margins = read
    return CardsRequest(tuple(g.strip() for g in gpus), budgets, margins)


def _per_card(values: tuple[Any, ...], i: int) -> Any:
    return values[0] if len(values) == 1 else values[i]


def _detected(source: str) -> list[tuple[GpuSpec, int]]:
    """Every card CUDA shows here, in CUDA's order, with NVML's number for each."""
    found = hardware.detect_gpus()
    if not found:
        reason = hardware.nvml_unavailable_reason() or "no GPU found"
        raise ConfigError(
            f"{source} = ['auto']: no GPU detected ({reason}); name the cards as catalog keys, e.g. "
            '["rtx3090", "rtx3060-12gb"], or ["cpu", "cpu"] for host-memory devices'
        )
    by_index = {d.index: d for d in found}
    cards: list[tuple[GpuSpec, int]] = []
    for cuda in range(len(found)):
        try:
            nvml = cuda_devices.resolve_cuda_device(cuda).nvml_index
        except ConfigError:
            break  # CUDA_VISIBLE_DEVICES shows fewer cards than NVML has
        d = by_index.get(nvml)
        if d is not None:
            cards.append((hardware.spec_for_detected(d), nvml))
    if not cards:
        raise ConfigError(f"{source} = ['auto']: CUDA_VISIBLE_DEVICES shows none of the {len(found)} card(s) NVML sees")
    return cards


def resolve_placement(request: CardsRequest, source: str = "[hardware] gpus") -> Placement:
    """The study's cards, each with its budget.

    Args:
        request: What :func:`read_cards` read.
        source: How errors name the field (``path: [hardware] gpus``).

    Raises:
        ConfigError: No card for ``auto``, an unknown key (the message lists the catalog), a
            list of budgets whose length is not the card count, or a budget above its card
            or no larger than its margin; all of them at once.
    """
    if request.gpus == (AUTO,):
        found = _detected(source)
    else:
        found, unknown = [], []
        for key in request.gpus:
            if key == CPU_KEY:
                found.append((hardware.cpu_spec(), None))
                continue
            try:
                found.append((hardware.get_gpu(key), None))
            except ConfigError:
                unknown.append(key)
        if unknown:
            known = ", ".join(hardware.load_gpu_catalog())
            raise ConfigError(
                f"{source} = {list(request.gpus)}: unknown {', '.join(map(repr, unknown))} (accepted: "
                f"{known}; or 'auto', or 'cpu')"
            )
    stem = source.rsplit("gpus", 1)[0]
    errors: list[str] = []
    for key, values in (("vram_budget_gib", request.budgets_gib), ("safety_margin_mib", request.margins_mib)):
        if len(values) not in (1, len(found)):
            errors.append(
                f"{stem}{key} = {list(values)}: {len(values)} figures for the {len(found)} card(s) found "
                "here: give one figure, or one per card"
            )
    if errors:
        raise ConfigError("\n".join(errors))
    cards = []
    for i, (spec, nvml) in enumerate(found):
        cap, margin = _per_card(request.budgets_gib, i), _per_card(request.margins_mib, i)
        memory = int(cap * 2**30) if cap else spec.vram_bytes
        name = "host memory" if spec.is_cpu else f"{spec.name}'s memory"
        if cap and memory > spec.vram_bytes:
            errors.append(
                f"{stem}vram_budget_gib = {cap:g} for device {i}: more than {spec.name} holds, "
                f"{spec.vram_bytes / 2**30:.2f} GiB"
            )
        elif int(margin * 2**20) >= memory:
            errors.append(
                f"{stem}safety_margin_mib = {margin:g} for device {i}: leaves nothing of {memory / 2**30:.2f} GiB"
            )
        cards.append(Card(i, spec, memory, int(margin * 2**20), "[hardware] vram_budget_gib" if cap else name, nvml))
    if errors:
        raise ConfigError("\n".join(errors))
    return Placement(tuple(cards))


def check_cards(per_device: Sequence[int], placement: Placement) -> str | None:
    """Why a configuration's share of each card is over that card's budget (None: every card
    holds its share). ``per_device`` is the backend's per-device memory, in device order."""
    over = [
        f"device {i} ({c.spec.name}) {b / 2**30:.2f} GiB > budget {c.budget_bytes / 2**30:.2f} GiB"
        for i, (b, c) in enumerate(zip(per_device, placement.cards))
        if b > c.budget_bytes
    ]
    if len(per_device) > len(placement.cards):
        over.append(f"{len(per_device)} devices used, the study has {len(placement.cards)}")
    return "; ".join(over) or None


def cuda_visible(placement: Placement | None, gpu_index: int) -> str:
    """``CUDA_VISIBLE_DEVICES`` of an engine: every card of a study on several, in device order
    (so an engine's tensor or pipeline parallelism sees them all), else the study's one card;
    each as the user's own variable names it."""
    if placement is None or placement.on_cpu:
        return cuda_devices.cuda_visible_entry(gpu_index)
    return ",".join(cuda_devices.cuda_visible_entry(c.device) for c in placement.cards)
