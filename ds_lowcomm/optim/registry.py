"""The methods by name, and ``build_optimizer``: the optimizer a :class:`LowcommConfig` names."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Iterable

import torch

from ..comm import ReplicaShard, Transport
from ..settings import ConfigError
from .adamw import AdamSettings, AllReduceAdamW
from .base import LowcommOptimizer
from .demo import DeMo
from .mtdao import MTDAO
from .outer import DCTDiLoCo, DiLoCo, OuterLoop, SparseLoCo

if TYPE_CHECKING:
    from .config import LowcommConfig

# name -> class; each class names its settings class (``settings_class``).
METHOD_CLASSES: dict[str, type[LowcommOptimizer]] = {
    cls.method: cls for cls in (AllReduceAdamW, DeMo, DiLoCo, DCTDiLoCo, SparseLoCo, MTDAO)
}
METHODS = tuple(METHOD_CLASSES)


def _apex_fused_adamw(params, adam: AdamSettings):
    try:
        from apex.optimizers import FusedAdam  # NVIDIA apex, built from source on GPU machines
    except ImportError:
        raise ConfigError("lowcomm.inner_impl is 'apex' but NVIDIA apex is not importable here; "
                          "allowed: torch, apex (apex only where it is installed)") from None
    return FusedAdam(params, adam_w_mode=True, **adam.torch_kwargs())


def build_optimizer(
    cfg: "LowcommConfig",
    params: Iterable,
    *,
    lr: float,
    transport: Transport | None = None,
    shard: ReplicaShard | None = None,
    ledger_steps: bool = True,
    inner_factory: Callable[[Iterable], torch.optim.Optimizer] | None = None,
    **adam,
) -> LowcommOptimizer:
    """The optimizer for ``cfg.method``. ``lr`` and ``adam`` (betas, eps, weight_decay; see
    :class:`AdamSettings` for their defaults) are the per-step optimizer's (AdamW's, DeMo's;
    MT-DAO takes its beta2 from ``betas[1]``, its first moments from its own settings) or, for
    outer-loop methods, the inner AdamW's, unless ``inner_factory(params)`` builds another inner
    optimizer. ``transport``, ``shard`` and ``ledger_steps``: see :class:`LowcommOptimizer`."""
    cfg.validate()
    hyper = AdamSettings.from_flat({"lr": lr, **adam}, where="optimizer", strict=True)
    cls = METHOD_CLASSES[cfg.method]
    comm = dict(settings=cfg.settings, transport=transport, shard=shard, ledger_steps=ledger_steps)
    if cls is AllReduceAdamW:
        return AllReduceAdamW(params, transport=transport, shard=shard, ledger_steps=ledger_steps,
                              **hyper.torch_kwargs())
    if cls is DeMo:
        return DeMo(params, lr=hyper.lr, weight_decay=hyper.weight_decay, **comm)
    if cls is MTDAO:
        return MTDAO(params, lr=hyper.lr, beta2=hyper.betas[1], eps=hyper.eps, weight_decay=hyper.weight_decay, **comm)
    assert issubclass(cls, OuterLoop), cls
    if inner_factory is not None:
        inner = inner_factory(params)
    elif cfg.settings.inner_impl == "apex":
        inner = _apex_fused_adamw(params, hyper)
    else:
        inner = torch.optim.AdamW(params, **hyper.torch_kwargs())
    return cls(inner, **comm)
