"""DeepSpeed glue: ``initialize`` (same arguments and return tuple as ``deepspeed.initialize``)."""

from .engine import LowcommRun, initialize

__all__ = ["LowcommRun", "initialize"]
