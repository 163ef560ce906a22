"""The ``"lowcomm"`` section's public names, where users and the README import them from."""

from .optim.config import DEFAULT_METHOD, LowcommConfig
from .optim.registry import METHODS
from .settings import ConfigError, check_lr

__all__ = ["ConfigError", "DEFAULT_METHOD", "LowcommConfig", "METHODS", "check_lr"]
