"""Errors raised by autotune's library code; the CLI turns them into messages."""


class AutotuneError(Exception):
    """Base of every error autotune raises on purpose."""


class ConfigError(AutotuneError):
    """A study file, a flag or another input is invalid; the message says what would be accepted."""


class UnknownNameError(ConfigError):
    """A name (GPU, model, backend, format) is not in its catalog or registry."""


class MeasurementError(AutotuneError):
    """A measurement could not be completed (timeout, engine died, nonsense values)."""


class PluginError(AutotuneError):
    """A plugin broke the contract: a duplicate name, a missing method, a bad registration."""


class BackendError(AutotuneError):
    """A backend could not launch or measure a configuration; the message is the engine's reason.

    Attributes:
        log_tail: The last lines of the engine's log, when there is one.
    """

    def __init__(self, message: str, log_tail: str = ""):
        super().__init__(message)
        self.log_tail = log_tail


class UnsupportedError(BackendError):
    """The engine refuses this configuration on this card (e.g. BF16 weights before sm_80)."""
