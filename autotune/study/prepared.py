"""What a prepared study is: a study file resolved against plugins, catalogs and the machine.

Its own module, below ``prepare`` (which makes one) and the modules that read one (quality,
storage, comparable, admission's callers), so that none of them imports ``prepare`` back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autotune import plugins
from autotune.config import StudyConfig
from autotune.engine.backend import BaseBackend, StudyContext, TrialConfig
from autotune.engine.metric import BaseMetric
from autotune.engine.space import SearchSpace
from autotune.hardware.gpus import GpuSpec
from autotune.hardware.placement import Placement
from autotune.modelfiles.models import ModelSpec
from autotune.toolkit.redact import mask_url


@dataclass
class PreparedStudy:
    """A study file resolved against plugins, catalogs and the machine."""

    cfg: StudyConfig
    gpu: GpuSpec
    model: ModelSpec
    vram_budget_bytes: int
    space: SearchSpace
    contexts: dict[str, StudyContext]
    quality: BaseMetric | None
    reference: dict[str, TrialConfig]
    storage_url: str
    excluded: list[str] = field(default_factory=list)
    # The metric that judges a configuration whose paired drop is still undecided at the cap,
    # through the study's fitted KLD relation ([quality] undecided = "kld").
    quality_proxy: BaseMetric | None = None
    # [hardware] gpus: the study's cards and each one's budget (None: one card, [hardware] gpu).
    placement: Placement | None = None

    def backend(self, name: str) -> BaseBackend:
        return plugins.get_backend(name) if name not in self.space.entries else self.space.entries[name].backend

    @property
    def shown_storage(self) -> str:
        """The storage URL as autotune shows it (password masked)."""
        return mask_url(self.storage_url)
