"""The start-up broadcast: every rank, inside and across replicas, starts from rank 0's weights.

Plain DeepSpeed broadcasts rank 0's parameters over its data-parallel group; here that group is
one replica, so ``initialize`` broadcasts over the whole world first, before the method's
optimizer (whose start-up check wants equal parameters across replicas) is built. The bytes are
start-up traffic (``SETUP_OP``) in the engine ledger, in no step. Equal parameters stay
bit-identical (a broadcast copies bits).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from ..comm import ByteLedger, TorchDistTransport
from ..comm.ledger import SETUP_OP


def _tensors(model: torch.nn.Module | None, params: Iterable) -> list[torch.Tensor]:
    seen: set[int] = set()
    out: list[torch.Tensor] = []

    def add(t):
        if torch.is_tensor(t) and id(t) not in seen:
            seen.add(id(t))
            out.append(t)

    if model is not None:
        for p in model.parameters():
            add(p)
        for b in model.buffers():
            add(b)
    for p in params:  # parameters handed over apart from the model (or as groups)
        group = p["params"] if isinstance(p, dict) else p
        # a group's generator is left for the optimizer to consume (the model's parameters are above)
        for q in ([group] if torch.is_tensor(group) else group if isinstance(group, (list, tuple)) else []):
            add(q)
    return out


@torch.no_grad()
def broadcast_initial_state(model: torch.nn.Module | None, params: Iterable, ledger: ByteLedger,
                            group=None, timeout_s: float | None = None) -> None:
    """Broadcast rank 0's parameters and buffers to every rank (one flat buffer per dtype/device);
    with ``group`` (a pipeline stage's ranks), the group's first rank's to the group."""
    transport = TorchDistTransport(group, ledger=ledger, timeout_s=timeout_s)
    if transport.world_size == 1:
        return
    buckets: dict[tuple, list[torch.Tensor]] = {}
    for t in _tensors(model, params):
        buckets.setdefault((t.dtype, t.device), []).append(t)
    for tensors in buckets.values():
        data = [t.detach() for t in tensors]
        flat = _flatten_dense_tensors(data)
        transport.broadcast_(flat.view(torch.uint8), 0, op=SETUP_OP)  # bits, any dtype
        if transport.rank != 0:
            for t, new in zip(data, _unflatten_dense_tensors(flat, data)):
                t.copy_(new)
