"""A generator's settings as a Python engine's parent process and its worker exchange them
(:class:`SettingsRecord`): both exllama plugins' generator settings are one, and neither owns it."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Mapping

from autotune.api import ConfigError

__all__ = ["SettingsRecord"]


class SettingsRecord:
    """A generator's settings (a frozen dataclass with ``jobs_at_once``) as the parent and its
    worker exchange them: ``to_dict`` for the ``load`` request and the trial's record,
    ``from_dict`` for what the worker says it built. Both exllama plugins' settings are one."""

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "jobs_at_once": self.jobs_at_once}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:
        try:
            return cls(**{k: data[k] for k in cls.__dataclass_fields__})
        except KeyError as exc:
            raise ConfigError(f"generator settings lack {exc.args[0]!r}") from None


