"""Build a method by name from a :class:`LowcommConfig`."""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from ..codec import FLOAT_DTYPES
from ..comm import Transport
from ..config import ConfigError, LowcommConfig, check_lr
from .adamw import AllReduceAdamW
from .demo import DeMo
from .mtdao import MTDAO
from .outer import DCTDiLoCo, DiLoCo, SparseLoCo




def _apex_fused_adamw(params, lr, betas, eps, weight_decay):
    try:
        from apex.optimizers import FusedAdam  # NVIDIA apex, built from source on GPU machines
    except ImportError:
        raise ConfigError("lowcomm.inner_impl is 'apex' but NVIDIA apex is not importable here; "
                          "allowed: torch, apex (apex only where it is installed)") from None
    return FusedAdam(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, adam_w_mode=True)


def _compression_kwargs(cfg: LowcommConfig) -> dict:
    return dict(decay=cfg.decay, topk=cfg.topk, chunk=cfg.chunk, value_dtype=cfg.value_dtype,
                transform=cfg.transform, average=cfg.average)


def _outer_kwargs(cfg: LowcommConfig) -> dict:
    return dict(sync_every=cfg.sync_every, outer_lr=cfg.outer_lr, outer_momentum=cfg.outer_momentum,
                nesterov=cfg.nesterov, fragments=cfg.fragments, sync_delay=cfg.sync_delay,
                fragment_mix=cfg.fragment_mix, state_dtype=FLOAT_DTYPES[cfg.state_dtype])


def build_optimizer(
    cfg: LowcommConfig,
    params: Iterable,
    *,
    lr: float,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    transport: Transport | None = None,
    inner_factory: Callable[[Iterable], torch.optim.Optimizer] | None = None,
) -> torch.optim.Optimizer:
    """The optimizer for ``cfg.method``. ``lr``/``weight_decay``/``betas`` are the per-step
    optimizer's (AdamW's, DeMo's; MT-DAO takes its beta2 from ``betas[1]``, its first moments
    from ``cfg.momentum_betas``) or, for outer-loop methods, the inner AdamW's, unless
    ``inner_factory(params)`` builds another inner optimizer."""
    cfg.validate()
    check_lr(lr)
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0; got {weight_decay!r}")
    if cfg.method == "adamw":
        return AllReduceAdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, transport=transport)
    if cfg.method == "demo":
        return DeMo(params, lr=lr, weight_decay=weight_decay, transport=transport,
                    state_dtype=FLOAT_DTYPES[cfg.state_dtype], **_compression_kwargs(cfg))
    if cfg.method == "mtdao":
        return MTDAO(params, lr=lr, momentum_betas=cfg.momentum_betas, momentum_weights=cfg.momentum_weights,
                     beta2=betas[1], eps=eps, weight_decay=weight_decay, sync_every=cfg.sync_every,
                     momentum_sync_every=cfg.momentum_sync_every, second_moment_sync_every=cfg.second_moment_sync_every,
                     sync_codec=cfg.sync_codec, topk=cfg.topk, chunk=cfg.chunk, value_dtype=cfg.value_dtype,
                     transform=cfg.transform, average=cfg.average, state_dtype=FLOAT_DTYPES[cfg.state_dtype],
                     transport=transport)
    if inner_factory is not None:
        inner = inner_factory(params)
    elif cfg.inner_impl == "apex":
        inner = _apex_fused_adamw(params, lr, betas, eps, weight_decay)
    else:
        inner = torch.optim.AdamW(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    if cfg.method == "diloco":
        return DiLoCo(inner, transport=transport, **_outer_kwargs(cfg))
    if cfg.method == "dct_diloco":
        return DCTDiLoCo(inner, transport=transport, **_outer_kwargs(cfg), **_compression_kwargs(cfg))
    if cfg.method == "sparseloco":  # no outer momentum: SparseLoCo drops those two settings
        return SparseLoCo(inner, transport=transport, **_outer_kwargs(cfg), **_compression_kwargs(cfg))
    raise AssertionError(cfg.method)  # validate() admits only the methods above
