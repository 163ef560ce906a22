"""Compressed activations between Megatron-Core pipeline stages: the codecs and settings of the
DeepSpeed pipeline path (``lowcomm.activations``: forward/backward codec, none/int8/int4/topk/
lowrank; :mod:`ds_lowcomm.codec.activations`).

Megatron's schedules move every activation and activation gradient through one method,
``P2PCommunicator._communicate`` (send to next/prev, receive from prev/next, one tensor shape per
call). :func:`install_activation_compression` puts a subclass in place of ``P2PCommunicator`` in
``megatron.core.pipeline_parallel.schedules`` (where the schedules build theirs): what goes to
the next stage is coded with ``forward``, what goes back with ``backward``, the receiver decodes
(a payload's size follows from the shape and dtype, so nothing else travels), and the bytes are
booked in a ledger where they are sent (``activation_send``, ``activation_grad_send``). With
both codecs ``none`` the bytes on the wire are the tensors' own: training is bit-identical to
stock Megatron. The send/receive ordering is Megatron's own (``_p2p_ops``); the receive waits
before decoding, so ``overlap_p2p_comm`` (interleaved schedules) gets no overlap, and variable
sequence lengths and ring exchange are refused.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ds_lowcomm.codec.activations import ActivationCodec, ActivationSettings, make_activation_codec
from ds_lowcomm.comm.ledger import ByteLedger
from ds_lowcomm.settings import ConfigError

_original = None  # Megatron's P2PCommunicator while ours is installed


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def install_activation_compression(settings: ActivationSettings, ledger: ByteLedger | None = None) -> ByteLedger:
    """Code Megatron's pipeline p2p traffic with ``settings`` from now on (this process);
    returns the ledger the bytes go to. Call before the first forward_backward."""
    global _original
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator, _p2p_ops

    settings.validate("lowcomm.activations")
    ledger = ledger if ledger is not None else ByteLedger()
    forward = make_activation_codec(settings.forward, settings)
    backward = make_activation_codec(settings.backward, settings)
    base = _original or schedules.P2PCommunicator

    def encode(codec: ActivationCodec, x: Optional[torch.Tensor], dtype, op: str) -> Optional[torch.Tensor]:
        if x is None:
            return None
        start = time.perf_counter()
        payload = codec.encode(x.detach().to(dtype))
        ledger.add_time("codec", time.perf_counter() - start)
        ledger.record(op, payload.numel(), 0)
        return payload if payload.numel() else None  # both sides know an empty payload from the shape

    class CompressedP2PCommunicator(base):
        """Megatron's P2PCommunicator with every tensor coded on the wire (module docstring)."""

        def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                         wait_on_reqs=True):
            config = self.config
            if config.variable_seq_lengths or getattr(config, "mtp_standalone", False):
                raise ConfigError("lowcomm.activations: variable sequence lengths between pipeline stages are not "
                                  "supported (each payload's size follows from a fixed tensor shape)")
            if config.use_ring_exchange_p2p:
                raise ConfigError("lowcomm.activations does not support use_ring_exchange_p2p")
            dtype = config.pipeline_dtype
            send_next = encode(forward, tensor_send_next, dtype, "activation_send")
            send_prev = encode(backward, tensor_send_prev, dtype, "activation_grad_send")
            bufs = {name: torch.empty(codec.nbytes(tensor_shape, dtype), dtype=torch.uint8, device=_device())
                    for name, wanted, codec in (("prev", recv_prev, forward), ("next", recv_next, backward)) if wanted}
            live = {name: buf for name, buf in bufs.items() if buf.numel()}
            start = time.perf_counter()
            reqs = _p2p_ops(tensor_send_prev=send_prev, tensor_send_next=send_next,
                            tensor_recv_prev=live.get("prev"), tensor_recv_next=live.get("next"),
                            group=self.pp_group, prev_pipeline_rank=self.prev_rank,
                            next_pipeline_rank=self.next_rank)
            for req in reqs.values():  # decoding needs the bytes: wait here (see the module docstring)
                req.wait()
            ledger.add_time("comm", time.perf_counter() - start)
            start = time.perf_counter()
            out = {}
            for name, codec, op in (("prev", forward, "activation_recv"), ("next", backward, "activation_grad_recv")):
                if name in bufs:
                    ledger.record(op, 0, bufs[name].numel())
                    out[name] = codec.decode(bufs[name], tensor_shape, dtype).detach().requires_grad_(True)
            ledger.add_time("codec", time.perf_counter() - start)
            return out.get("prev"), out.get("next"), ([] if config.batch_p2p_comm else {})

    if _original is None:
        _original = schedules.P2PCommunicator
    schedules.P2PCommunicator = CompressedP2PCommunicator
    return ledger


def uninstall_activation_compression() -> None:
    """Put Megatron's own P2PCommunicator back."""
    global _original
    if _original is not None:
        from megatron.core.pipeline_parallel import schedules

        schedules.P2PCommunicator = _original
        _original = None


__all__ = ["install_activation_compression", "uninstall_activation_compression"]
