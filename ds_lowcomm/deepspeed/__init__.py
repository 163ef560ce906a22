"""DeepSpeed glue: ``initialize`` (same arguments and return tuple as ``deepspeed.initialize``), and
the data-parallel rank and size across replicas for loaders users build themselves, and
``replica_layout`` (this rank's replica when replicas differ in shape, ``lowcomm.replicas``), and
``install`` (the Hugging Face Trainer, Accelerate and Lightning use ds_lowcomm where their DeepSpeed
config has a lowcomm section)."""

from .data import data_parallel_rank, data_parallel_world_size
from .engine import LowcommRun, initialize, replica_layout
from .install import install, uninstall

__all__ = ["LowcommRun", "data_parallel_rank", "data_parallel_world_size", "initialize", "install", "replica_layout",
           "uninstall"]
