"""A generator's settings as a Python engine's parent process and its worker exchange them
(:class:`SettingsRecord`): both exllama plugins' generator settings are one, and neither owns it."""

from __future__ import annotations

from dataclasses import MISSING, asdict
from typing import Any, Mapping

from autotune._builtin import ConfigError

__all__ = ["SettingsRecord"]


class SettingsRecord:
    """A generator's settings (a frozen dataclass with ``jobs_at_once``) as the parent and its
    worker exchange them: ``to_dict`` for the ``load`` request and the trial's record,
    ``from_dict`` for what the worker says it built. Both exllama plugins' settings are one."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "jobs_at_once": self.jobs_at_once}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        """The settings ``data`` holds; a field with a default may be absent (a record written
        before the field existed, a fake worker that echoes the older keys)."""
        fields = cls.__dataclass_fields__
        missing = [k for k, f in fields.items() if k not in data and f.default is MISSING]
        if missing:
            raise ConfigError(f"generator settings lack {missing[0]!r}")
        return cls(**{k: data[k] for k in fields if k in data})
