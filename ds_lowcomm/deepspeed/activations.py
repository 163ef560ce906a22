"""Activation compression between DeepSpeed pipeline stages.

:func:`install_activation_compression` replaces four instructions of one ``PipelineEngine``
instance (``SendActivation``, ``RecvActivation``, ``SendGrad``, ``RecvGrad``) through an
instance-level copy of the engine's ``_INSTRUCTION_MAP``, which ``_exec_schedule`` reads as
``self._INSTRUCTION_MAP``. The class and every other engine stay untouched. The four are copies of
DeepSpeed's own methods with the sends and receives coded; ``internals.py`` declares every
DeepSpeed internal they use and checks that DeepSpeed's originals are still the bodies they were
copied from.

What changes on the wire, and what does not:

- DeepSpeed's own tensor-meta exchange (shapes and dtypes, on the first micro-batch, or on every
  one with ``dynamic_shape``, or again after ``reset_activation_shape()``) runs as shipped,
  uncompressed; it is not counted in the ledger.
- Each tensor then travels as one uint8 payload of ``codec.nbytes(shape, dtype)`` bytes: the
  forward activations under ``settings.forward``'s codec, the activation gradients under
  ``settings.backward``'s. The size follows from shape and dtype, so the receiver allocates it
  from the exchanged meta (activations) or from its own outputs (gradients): no header.
- Non-float tensors in a tuple (masks, integer ids) go raw under every codec (the codecs do
  that), and so does the attention mask DeepSpeed sends as half with ``has_bool_tensors`` /
  ``GPT2ModelPipe`` (a lossy code of a 0/1 mask would change it).
- Received float activations get ``requires_grad`` exactly where DeepSpeed sets it, so the
  receiving stage's backward produces the gradients that are sent back.
- ``none`` in a direction sends the tensor's own bytes and decodes them bit for bit: losses and
  parameters equal a stock engine's exactly (tests/test_pipeline_activations.py).

Bytes are recorded in the ledger given, one record per instruction (one micro-batch at one
stage boundary), payload bytes only: ``activation_send`` / ``activation_grad_send`` (sent) and
``activation_recv`` / ``activation_grad_recv`` (received). Codec and p2p time go to the
ledger's ``seconds["codec"]`` / ``seconds["comm"]``.

Refused with :class:`ConfigError`: an engine that is not a ``PipelineEngine``; the partitioned
pipe/grad paths (``pipeline.pipe_partitioned`` / ``grad_partitioned`` with model parallelism),
which send a partition-meta tensor plus a slice through a separate code path; an engine whose
class maps these instructions to methods of its own (they would be bypassed); a second install
on the same engine.
"""

from __future__ import annotations

import time
from typing import Sequence

import torch

from ..codec.activations import ActivationCodec, ActivationSettings
from ..comm.activation_wire import ActivationWire
from ..comm.ledger import ByteLedger
from ..settings import ConfigError
from . import internals as ds

__all__ = ["install_activation_compression"]

# DeepSpeed's instruction (a schedule class) -> its method, and the one replacing it here
_OPS = ((ds.SEND_ACTIVATION, ds.EXEC_SEND_ACTIVATIONS), (ds.RECV_ACTIVATION, ds.EXEC_RECV_ACTIVATIONS),
        (ds.SEND_GRAD, ds.EXEC_SEND_GRADS), (ds.RECV_GRAD, ds.EXEC_RECV_GRADS))
_MARK = "_lowcomm_activation_compression"


class _Wire(ActivationWire):
    """The shared codecs, buffers and bookkeeping (:class:`ActivationWire`) over DeepSpeed's
    blocking ``p2p.send``/``p2p.recv``, and DeepSpeed's names of the instructions' timers."""

    def __init__(self, settings: ActivationSettings, ledger: ByteLedger):
        super().__init__(settings, ledger)
        self._send, self._recv = ds.live(ds.P2P_SEND), ds.live(ds.P2P_RECV)
        self._timer_names = {item.name: ds.live(item) for item in (ds.SEND_OUTPUT_TIMER, ds.RECV_INPUT_TIMER,
                                                                  ds.SEND_GRAD_TIMER, ds.RECV_GRAD_TIMER)}

    def timer(self, engine, name: str, start: bool) -> None:
        """Start or stop DeepSpeed's timer ``name`` (``PIPE_SEND_OUTPUT_TIMER``, ...) as its own
        instruction does."""
        if engine.wall_clock_breakdown():
            timer = engine.timers(self._timer_names[name])
            timer.start() if start else timer.stop()

    def send(self, tensors: Sequence[torch.Tensor], codecs: Sequence[ActivationCodec], dest: int, op: str) -> None:
        sent = 0
        for x, codec in zip(tensors, codecs):
            payload = self.encode(x, codec)
            start = time.perf_counter()
            if payload.numel():  # both sides know an empty payload from the shape: nothing to send
                self._send(payload, dest)
            self.comm_time(time.perf_counter() - start)
            sent += payload.numel()
        self.book(op, sent=sent)

    def recv(self, specs, codecs: Sequence[ActivationCodec], src: int, device, op: str) -> list[torch.Tensor]:
        out, received = [], 0
        for idx, ((shape, dtype), codec) in enumerate(zip(specs, codecs)):
            nbytes = codec.nbytes(shape, dtype)
            start = time.perf_counter()
            if nbytes:
                buf = self.buffer(op, idx, nbytes, device)
                self._recv(buf, src)
            else:
                buf = torch.empty(0, dtype=torch.uint8, device=device)
            self.comm_time(time.perf_counter() - start)
            out.append(self.decode(buf, shape, dtype, codec))
            received += nbytes
        self.book(op, received=received)
        return out


def _mask_last(engine) -> bool:
    """DeepSpeed sends the last tuple element as a half-cast bool mask (and no gradient for it)."""
    return bool(engine.has_attention_mask or engine.has_bool_tensors)


# -- the four instructions (bound to the engine by _exec_schedule through MethodType) ----------
def _send_activations(wire: _Wire):
    def _exec_send_activations(self, buffer_id):
        wire.timer(self, "PIPE_SEND_OUTPUT_TIMER", True)
        outputs = self.pipe_buffers['outputs'][buffer_id]
        if not isinstance(outputs, (torch.Tensor, tuple)):
            raise NotImplementedError(f'Could not send output of type {type(outputs)}')
        if isinstance(outputs, tuple) and _mask_last(self):  # as DeepSpeed: the mask travels as half
            outputs = (*outputs[:-1], outputs[-1].half())
        if self.dynamic_shape or self.first_output_send:
            self.first_output_send = False
            ds.method(self, ds.SEND_TENSOR_META)(outputs, self.next_stage)  # DeepSpeed's own, uncompressed
        tensors = [outputs] if isinstance(outputs, torch.Tensor) else list(outputs)
        codecs = [wire.forward] * len(tensors)
        if isinstance(outputs, tuple) and _mask_last(self):
            codecs[-1] = wire.raw
        wire.send(tensors, codecs, self.next_stage, "activation_send")
        wire.timer(self, "PIPE_SEND_OUTPUT_TIMER", False)

    return _exec_send_activations


def _recv_activations(wire: _Wire):
    def _exec_recv_activations(self, buffer_id):
        wire.timer(self, "PIPE_RECV_INPUT_TIMER", True)
        if self.dynamic_shape or self.pipe_recv_buf is None:
            # DeepSpeed's own meta exchange; its buffers give the shapes and dtypes (not received into)
            self.pipe_recv_buf = ds.method(self, ds.RECV_TENSOR_META)(self.prev_stage)
        single = isinstance(self.pipe_recv_buf, torch.Tensor)
        metas = [self.pipe_recv_buf] if single else list(self.pipe_recv_buf)
        specs = [(tuple(t.shape), t.dtype) for t in metas]
        codecs = [wire.forward] * len(specs)
        if not single and _mask_last(self):
            codecs[-1] = wire.raw
        recvd = wire.recv(specs, codecs, self.prev_stage, self.device, "activation_recv")
        if single:
            recvd = recvd[0]
            recvd.requires_grad = recvd.is_floating_point()
        else:
            if _mask_last(self):
                recvd[-1] = recvd[-1].bool()
            recvd = tuple(recvd)
            for t in recvd:
                t.requires_grad = t.is_floating_point()
        self.pipe_buffers['inputs'][buffer_id] = recvd
        wire.timer(self, "PIPE_RECV_INPUT_TIMER", False)

    return _exec_recv_activations


def _send_grads(wire: _Wire):
    def _exec_send_grads(self, buffer_id):
        wire.timer(self, "PIPE_SEND_GRAD_TIMER", True)
        inputs = self.pipe_buffers['inputs'][buffer_id]
        if isinstance(inputs, torch.Tensor):
            assert inputs.grad is not None
            grads = [inputs.grad]
        else:
            inputs = list(inputs)
            if _mask_last(self):  # the mask has no gradient; the receiver skips it too
                inputs.pop()
            grads = []
            for t in inputs:
                if not t.is_floating_point():  # tensors that produce no gradient
                    assert t.grad is None
                    continue
                assert t.grad is not None
                grads.append(t.grad)
        wire.send(grads, [wire.backward] * len(grads), self.prev_stage, "activation_grad_send")
        self.pipe_buffers['inputs'][buffer_id] = None  # free the input buffer, as DeepSpeed does
        wire.timer(self, "PIPE_SEND_GRAD_TIMER", False)

    return _exec_send_grads


def _recv_grads(wire: _Wire):
    def _exec_recv_grads(self, buffer_id):
        wire.timer(self, "PIPE_RECV_GRAD_TIMER", True)
        outputs = self.pipe_buffers['outputs'][buffer_id]
        # The gradients' shapes are the outputs' own: known here, no meta needed.
        if isinstance(outputs, torch.Tensor):
            specs = [(tuple(outputs.shape), outputs.dtype)]
        else:
            specs = [(tuple(t.shape), t.dtype) for t in outputs if t.is_floating_point()]
        grads = wire.recv(specs, [wire.backward] * len(specs), self.next_stage, self.device,
                          "activation_grad_recv")
        # _exec_backward_pass reads self.grad_layer: a tensor for a tensor output, else a list
        self.grad_layer = grads[0] if isinstance(outputs, torch.Tensor) else grads
        wire.timer(self, "PIPE_RECV_GRAD_TIMER", False)

    return _exec_recv_grads


# -- install -----------------------------------------------------------------------------------
def install_activation_compression(engine, settings: ActivationSettings, ledger: ByteLedger) -> None:
    """Code the activations this pipeline stage sends forward with ``settings.forward``'s codec
    and the activation gradients it sends back with ``settings.backward``'s; decode what it
    receives into the tensors DeepSpeed expects (same shapes and dtypes, ``requires_grad`` where
    DeepSpeed sets it). Payload bytes are recorded in ``ledger`` under ``activation_send``,
    ``activation_recv``, ``activation_grad_send``, ``activation_grad_recv``.

    Call it on every stage of the pipeline with the same settings (each stage decodes what its
    neighbour encoded), after ``deepspeed.initialize`` and before the first ``train_batch`` /
    ``eval_batch``. ``none``/``none`` leaves training bit-identical to a stock engine and still
    counts the bytes. Raises :class:`ConfigError` for what it cannot support (see the module
    docstring)."""
    ds.ensure_checked()
    if not isinstance(engine, ds.live(ds.PIPELINE_ENGINE)):
        raise ConfigError("lowcomm.activations: activation compression needs DeepSpeed's PipelineEngine "
                          f"(deepspeed.initialize with a deepspeed.pipe.PipelineModule); got {type(engine).__name__}")
    if not isinstance(settings, ActivationSettings):
        raise ConfigError(f"lowcomm.activations: settings must be an ActivationSettings; got {type(settings).__name__}")
    settings.check("lowcomm.activations")
    if not isinstance(ledger, ByteLedger):
        raise ConfigError(f"lowcomm.activations: ledger must be a ByteLedger; got {type(ledger).__name__}")
    if getattr(engine, _MARK, None) is not None:
        raise ConfigError("lowcomm.activations: activation compression is already installed on this engine")
    for item in (*ds.PIPE_INSTANCE, ds.ENGINE_DEVICE):  # what the copied instructions read, on this engine
        ds.get(engine, item)
    if ds.get(engine, ds.IS_PIPE_PARTITIONED) or ds.get(engine, ds.IS_GRAD_PARTITIONED):
        raise ConfigError(
            "lowcomm.activations: DeepSpeed's partitioned pipeline path (pipeline.pipe_partitioned / "
            "pipeline.grad_partitioned with model parallel size > 1) sends a partition-meta tensor and a "
            "slice per activation and is not supported; set both to false in the DeepSpeed config")
    name = ds.INSTRUCTION_MAP.attr
    stock, class_map = ds.live(ds.INSTRUCTION_MAP), getattr(type(engine), name)
    for cmd, method in _OPS:
        if class_map.get(ds.live(cmd)) is not stock[ds.live(cmd)] or stock[ds.live(cmd)] is not ds.live(method):
            raise ConfigError(
                f"lowcomm.activations: {type(engine).__name__} maps {cmd.name} to its own method, "
                f"not {method.name}; activation compression would bypass it")
    if name in vars(engine):
        raise ConfigError(f"lowcomm.activations: this engine already has an instance-level {name} "
                          "(another override); activation compression would replace it")

    wire = _Wire(settings, ledger)
    instruction_map = dict(class_map)
    for (cmd, _), make in zip(_OPS, (_send_activations, _recv_activations, _send_grads, _recv_grads)):
        instruction_map[ds.live(cmd)] = make(wire)
    setattr(engine, name, instruction_map)  # _exec_schedule looks it up on the instance (internals.LOOKED_UP)
    setattr(engine, _MARK, wire)
