"""DeepSpeed glue: ``initialize`` (same arguments and return tuple as ``deepspeed.initialize``), and
the data-parallel rank and size across replicas for loaders users build themselves, and
``replica_layout`` (this rank's replica when replicas differ in shape, ``lowcomm.replicas``)."""

from .data import data_parallel_rank, data_parallel_world_size
from .engine import LowcommRun, initialize, replica_layout

__all__ = ["LowcommRun", "data_parallel_rank", "data_parallel_world_size", "initialize", "replica_layout"]
