"""Compressed activations between Megatron-Core pipeline stages: the codecs and settings of the
DeepSpeed pipeline path (``lowcomm.activations``: forward/backward codec, none/int8/int4/topk/
lowrank; :mod:`ds_lowcomm.codec.activations`), with the same codec/buffer/ledger half
(:class:`ds_lowcomm.comm.activation_wire.ActivationWire`).

Megatron's schedules (1F1B without interleaving, and the interleaved one) move every activation
and activation gradient through one method, ``P2PCommunicator._communicate`` (send to next/prev,
receive from prev/next, one tensor shape per call), and build their communicator from the name
``P2PCommunicator`` in ``megatron.core.pipeline_parallel.schedules``.
:func:`install_activation_compression` rebinds that name to a subclass whose ``_communicate``
codes what goes to the next stage with ``forward`` and what goes back with ``backward``; the
receiver decodes (a payload's size follows from the shape and ``pipeline_dtype``, so nothing else
travels). Megatron's own ``_p2p_ops``/``_batched_p2p_ops`` move the payloads, in Megatron's
order. Bytes are booked where they are sent (``activation_send``, ``activation_grad_send``) and
received (``activation_recv``, ``activation_grad_recv``), as on the DeepSpeed path.

With both codecs ``none`` the bytes on the wire are the tensors' own: training is bit-identical
to stock Megatron. Limits: decoding needs the bytes, so the receive is waited for inside the call
(``overlap_p2p_comm`` in the interleaved schedule still runs, on already-completed handles, but
gets no overlap); variable sequence lengths (a shape exchange per call) and
``use_ring_exchange_p2p`` are refused. A caller that passes its own ``p2p_communicator=`` to the
schedule bypasses the patch.
"""

from __future__ import annotations

import time
from typing import Optional

import torch

from ds_lowcomm.codec.activations import ActivationSettings
from ds_lowcomm.comm.activation_wire import ActivationWire
from ds_lowcomm.comm.ledger import ByteLedger
from ds_lowcomm.settings import ConfigError

from . import internals as mi

__all__ = ["install_activation_compression", "uninstall_activation_compression"]

_original = None  # Megatron's P2PCommunicator while ours is installed


class _Done:
    """A request that has completed: what the overlap path of the interleaved schedule waits on."""

    def wait(self) -> None:
        return None


def _recv_device(*sent: Optional[torch.Tensor]) -> torch.device:
    # Where the sent tensors live; else where Megatron allocates its receive buffers (the shim
    # maps torch.cuda.current_device() to the CPU where there is no GPU).
    for t in sent:
        if t is not None:
            return t.device
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def install_activation_compression(settings: ActivationSettings, ledger: ByteLedger | None = None) -> ByteLedger:
    """From now on (this process), code Megatron's pipeline p2p traffic with ``settings`` and
    book its bytes in ``ledger`` (a new one if None); returns the ledger. Call it on every
    pipeline stage with the same settings, after ``megatron_patches.cpu_shim`` where there is no
    GPU and before the first ``forward_backward_func`` call. Installing again replaces the
    settings; :func:`uninstall_activation_compression` puts Megatron's class back."""
    global _original
    mi.ensure_checked()  # a supported megatron-core, every internal used here as declared
    _batched_p2p_ops, _p2p_ops = mi.live(mi.BATCHED_P2P_OPS), mi.live(mi.P2P_OPS)
    if not isinstance(settings, ActivationSettings):
        raise ConfigError(f"lowcomm.activations: settings must be an ActivationSettings; got {type(settings).__name__}")
    settings.validate("lowcomm.activations")
    if ledger is None:
        ledger = ByteLedger()
    elif not isinstance(ledger, ByteLedger):
        raise ConfigError(f"lowcomm.activations: ledger must be a ByteLedger; got {type(ledger).__name__}")
    wire = ActivationWire(settings, ledger)
    if _original is None:
        _original = mi.live(mi.SCHEDULES_P2P)

    class CompressedP2PCommunicator(_original):
        """Megatron's P2PCommunicator with every activation (gradient) coded on the wire."""

        lowcomm_wire = wire

        def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                         wait_on_reqs=True):
            config = mi.get(self, mi.P2P_CONFIG)
            if config.variable_seq_lengths or config.mtp_standalone:
                raise ConfigError("lowcomm.activations: variable sequence lengths between pipeline stages are not "
                                  "supported (each payload's size follows from a fixed tensor shape)")
            if config.use_ring_exchange_p2p:
                raise ConfigError("lowcomm.activations: use_ring_exchange_p2p is not supported")
            if (recv_prev or recv_next) and (config.pipeline_dtype is None or tensor_shape is None):
                raise RuntimeError("pipeline_dtype and tensor_shape must be given to receive")  # as Megatron
            dtype = config.pipeline_dtype
            sends = {}
            for key, x, codec, op in (("next", tensor_send_next, wire.forward, "activation_send"),
                                      ("prev", tensor_send_prev, wire.backward, "activation_grad_send")):
                if x is not None:  # the receiver decodes as pipeline_dtype (a no-op cast where they agree)
                    payload = wire.encode(x if dtype is None else x.to(dtype), codec)
                    wire.book(op, sent=payload.numel())
                    sends[key] = payload if payload.numel() else None  # an empty payload: nothing to send
            device = _recv_device(tensor_send_next, tensor_send_prev)
            recvs = {}  # key -> (codec, op, buffer)
            for key, wanted, codec, op in (("prev", recv_prev, wire.forward, "activation_recv"),
                                           ("next", recv_next, wire.backward, "activation_grad_recv")):
                if wanted:
                    recvs[key] = (codec, op, wire.buffer(op, 0, codec.nbytes(tensor_shape, dtype), device))
            live = {key: buf for key, (_, _, buf) in recvs.items() if buf.numel()}
            start = time.perf_counter()
            p2p = _batched_p2p_ops if config.batch_p2p_comm else _p2p_ops
            reqs = p2p(tensor_send_prev=sends.get("prev"), tensor_recv_prev=live.get("prev"),
                       tensor_send_next=sends.get("next"), tensor_recv_next=live.get("next"),
                       group=mi.get(self, mi.P2P_PP_GROUP), prev_pipeline_rank=mi.get(self, mi.P2P_PREV_RANK),
                       next_pipeline_rank=mi.get(self, mi.P2P_NEXT_RANK))
            for req in reqs if isinstance(reqs, list) else reqs.values():
                req.wait()  # decoding needs the bytes (module docstring: no overlap)
            if config.batch_p2p_comm and config.batch_p2p_sync:
                torch.cuda.synchronize()  # as Megatron, against batch_isend_irecv's race
            wire.comm_time(time.perf_counter() - start)
            out = {}
            for key, (codec, op, buf) in recvs.items():
                wire.book(op, received=buf.numel())
                # a fresh tensor, as Megatron's own receive buffer is: a leaf that wants a gradient
                out[key] = wire.decode(buf, tensor_shape, dtype, codec).requires_grad_(True)
            if wait_on_reqs:
                handles = None
            else:  # the interleaved schedule's overlap path pops these by name and waits on them
                handles = {key: _Done() for key in (reqs if isinstance(reqs, dict) else ())}
            return out.get("prev"), out.get("next"), handles

    mi.check_override(mi.P2P_COMMUNICATE, CompressedP2PCommunicator._communicate, takes_self=True)
    mi.rebind(mi.SCHEDULES_P2P, CompressedP2PCommunicator)
    return ledger


def uninstall_activation_compression() -> None:
    """Put Megatron's own P2PCommunicator back (a no-op when none is installed)."""
    global _original
    if _original is not None:
        mi.rebind(mi.SCHEDULES_P2P, _original)
        _original = None
