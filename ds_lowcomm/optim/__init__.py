"""The methods, usable with plain torch.distributed; each has a complete state_dict()."""

from .adamw import AllReduceAdamW
from .base import LowcommOptimizer
from .demo import DeMo
from .mtdao import MTDAO
from .outer import DCTDiLoCo, DiLoCo, OuterLoop, SparseLoCo
from .registry import build_optimizer

__all__ = ["AllReduceAdamW", "DCTDiLoCo", "DeMo", "DiLoCo", "LowcommOptimizer", "MTDAO", "OuterLoop", "SparseLoCo",
           "build_optimizer"]
