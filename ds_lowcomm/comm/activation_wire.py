"""The framework-neutral half of pipeline activation compression: the two codecs of
``lowcomm.activations`` (forward: activations to the next stage; backward: activation gradients
to the previous one), reusable receive buffers, and the ledger bookkeeping (codec time, payload
bytes). The transport (DeepSpeed's ``p2p.send``/``recv``, Megatron's ``isend``/``irecv``) stays
with each framework's glue: ``ds_lowcomm/deepspeed/activations.py`` and
``megatron_patches/activations.py``.

Op names in the ledger, the same on both paths: ``activation_send`` / ``activation_recv``
(forward) and ``activation_grad_send`` / ``activation_grad_recv`` (backward).
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..codec.activations import ActivationCodec, ActivationSettings, make_activation_codec
from .ledger import ByteLedger

__all__ = ["ActivationWire", "FORWARD_OPS", "BACKWARD_OPS"]

FORWARD_OPS = ("activation_send", "activation_recv")
BACKWARD_OPS = ("activation_grad_send", "activation_grad_recv")


class ActivationWire:
    """The codecs of one pipeline stage, its ledger, and its receive buffers (uint8, one per
    (op, position), reused while the size and device hold: every decode writes fresh memory, so a
    buffer is free again once decoded; a new size replaces it)."""

    def __init__(self, settings: ActivationSettings, ledger: ByteLedger):
        self.settings = settings
        self.forward = make_activation_codec(settings.forward, settings)
        self.backward = make_activation_codec(settings.backward, settings)
        self.raw = make_activation_codec("none", settings)
        self.ledger = ledger
        self._buffers: dict[tuple[str, int], torch.Tensor] = {}

    def buffer(self, op: str, idx: int, nbytes: int, device) -> torch.Tensor:
        buf = self._buffers.get((op, idx))
        if buf is None or buf.numel() != nbytes or buf.device != torch.device(device):
            buf = self._buffers[(op, idx)] = torch.empty(nbytes, dtype=torch.uint8, device=device)
        return buf

    def encode(self, x: torch.Tensor, codec: ActivationCodec) -> torch.Tensor:
        """x's payload (a view of x's memory under ``none``); the time goes to ``codec``. The
        caller books the bytes where it sends them (:meth:`book`)."""
        start = time.perf_counter()
        payload = codec.encode(x.detach())
        self.ledger.add_time("codec", time.perf_counter() - start)
        return payload

    def decode(self, data: torch.Tensor, shape: Sequence[int], dtype: torch.dtype,
               codec: ActivationCodec) -> torch.Tensor:
        """A received payload -> a fresh, detached tensor of ``shape``/``dtype``."""
        start = time.perf_counter()
        out = codec.decode(data, shape, dtype).detach()
        self.ledger.add_time("codec", time.perf_counter() - start)
        return out

    def book(self, op: str, sent: int = 0, received: int = 0) -> None:
        self.ledger.record(op, sent, received)

    def comm_time(self, seconds: float) -> None:
        self.ledger.add_time("comm", seconds)
