"""The methods, usable with plain torch.distributed; each has a complete state_dict()."""

from .adamw import AdamSettings, AllReduceAdamW, AllReduceSettings
from .base import LowcommOptimizer
from .demo import DeMo, DeMoSettings
from .dion import Dion, DionSettings
from .mtdao import MTDAO, MTDAOSettings
from .outer import (DCTDiLoCo, DCTDiLoCoSettings, DiLoCo, DiLoCoSettings, OuterLoop, SparseLoCo, SparseLoCoSettings,
                    StreamingSettings)
from .registry import METHODS, LowcommConfig, build_optimizer, model_param_groups, takes_muon_decision

__all__ = ["AdamSettings", "AllReduceAdamW", "AllReduceSettings", "DCTDiLoCo", "DCTDiLoCoSettings", "DeMo",
           "DeMoSettings", "Dion", "DionSettings", "DiLoCo", "DiLoCoSettings", "LowcommConfig", "LowcommOptimizer", "METHODS", "MTDAO",
           "MTDAOSettings", "OuterLoop", "SparseLoCo", "SparseLoCoSettings", "StreamingSettings", "build_optimizer",
           "model_param_groups", "takes_muon_decision"]
