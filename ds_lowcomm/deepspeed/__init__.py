"""DeepSpeed glue: ``initialize`` (same arguments and return tuple as ``deepspeed.initialize``), and
the data-parallel rank and size across replicas for loaders users build themselves."""

from .data import data_parallel_rank, data_parallel_world_size
from .engine import LowcommRun, initialize

__all__ = ["LowcommRun", "data_parallel_rank", "data_parallel_world_size", "initialize"]
