"""The ``"lowcomm"`` section's public names, where users and the README import them from."""

from .optim.registry import DEFAULT_METHOD, METHODS, LowcommConfig
from .settings import ConfigError, check_lr

__all__ = ["ConfigError", "DEFAULT_METHOD", "LowcommConfig", "METHODS", "check_lr"]
