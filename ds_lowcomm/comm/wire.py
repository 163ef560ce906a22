"""What a method puts on the wire, as its class declares it (``planned_wire``): the collectives of
one sync, as the ledger books them (comm/ledger.py), and how often they run. The optimizers' ledger
tests compare a run's ledger with :meth:`WirePlan.ledger`, and ``ds-lowcomm plan`` prices the same
declaration, so the planner cannot price a format the methods no longer send.

Each message builder here is the payload of one collective of this package, from its own sizes
(the codec's :class:`~ds_lowcomm.codec.SparseSpec`, :func:`.compressed_allreduce.phase_bytes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ..codec import CodecSettings, SparseSpec
from .compressed_allreduce import phase_bytes

KINDS = ("all_gather", "all_reduce", "all_to_all")
HEALTH_FLAG_BYTES = 1  # a rank's health flag (collectives.py): the sparse payload's last byte; the dense mean's all-gather


def elements(shapes) -> int:
    """The elements of tensors of ``shapes``."""
    return sum(math.prod(s) for s in shapes)


@dataclass(frozen=True)
class Message:
    """One collective: its ledger ``op``, ``kind`` (:data:`KINDS`), ``nbytes`` sent per worker as
    the ledger counts them (an all-gather of P bytes: P; an all-reduce of N bytes: N; an all-to-all:
    the parts sent to the others), the elements the codec encodes and decodes for it,
    ``overlap_steps``: the steps of compute it runs behind before a step waits for it (0: the step
    that sends it waits), and its ``phase`` in its sync: the messages of a phase go out together,
    each phase once the one before has landed."""

    op: str
    kind: str
    nbytes: float
    codec_elements: int = 0
    overlap_steps: int = 0
    phase: int = 0


def dense_mean_messages(op: str, nbytes_by_dtype: Sequence[int], overlap_steps: int = 0) -> list[Message]:
    """:func:`~.collectives.start_all_reduce_mean_`: a one-byte health all-gather, then one flat
    all-reduce per dtype (``nbytes_by_dtype``: each dtype's tensors' bytes)."""
    return [Message(f"{op}_health", "all_gather", HEALTH_FLAG_BYTES, overlap_steps=overlap_steps),
            *(Message(op, "all_reduce", n, overlap_steps=overlap_steps) for n in nbytes_by_dtype)]


def sparse_all_gather_message(op: str, shapes, codec: CodecSettings, overlap_steps: int = 0) -> Message:
    """:class:`~.collectives.SparseAllGather` of tensors of ``shapes``: every tensor's
    :class:`SparseSpec` payload end to end and the health flag byte, one all-gather."""
    specs = [SparseSpec.build(s, chunk=codec.chunk, topk=codec.topk, value_dtype=codec.value_dtype,
                              transform=codec.transform) for s in shapes]
    return Message(op, "all_gather", sum(s.nbytes for s in specs) + HEALTH_FLAG_BYTES,
                   elements(shapes), overlap_steps)


def compressed_all_reduce_messages(op: str, shapes, replicas: int, sync_delay: int = 0) -> list[Message]:
    """:class:`~.compressed_allreduce.CompressedAllReduce` of tensors of ``shapes`` among
    ``replicas`` = n workers, its bytes its own (:func:`~.compressed_allreduce.phase_bytes`): phase
    1 an all-to-all of each chunk's sign bits, scales and health byte to its owner, phase 2 an
    all-gather of this rank's chunk's counts. Phase 2 goes out at the step after the send
    (``Pending.advance``, optim/outer.py), so with ``sync_delay`` d >= 1 the first phase runs behind
    that one step of compute and the second behind the d - 1 after it (d = 1: the step the sync
    lands on waits for it). The one place the planner and the ledger tests take this exchange from."""
    phases = phase_bytes([tuple(s) for s in shapes], max(2, replicas))
    numel = elements(shapes)
    return [Message(f"{op}_scatter", "all_to_all", phases["scatter"][0], numel, min(1, sync_delay)),
            Message(f"{op}_gather", "all_gather", phases["gather"][0], numel, max(0, sync_delay - 1), phase=1)]


@dataclass(frozen=True)
class WirePlan:
    """A method's traffic: ``fragments``, the messages of one sync of each fragment (one without
    streaming), fragment f's first sync after local step ``first_sync[f]`` and then every
    ``sync_every`` steps (1: every step); before them ``warm_steps`` steps each sending ``warm``
    (mtdao's synchronous warm start). ``gradients``: the sync is the step's all-reduce of the
    gradients, which DDP and ZeRO (``overlap_comm``) run bucket by bucket during the backward pass."""

    sync_every: int
    fragments: tuple[tuple[Message, ...], ...]
    first_sync: tuple[int, ...]
    warm_steps: int = 0
    warm: tuple[Message, ...] = ()
    gradients: bool = False

    @classmethod
    def every_step(cls, messages: Sequence[Message], gradients: bool = False) -> "WirePlan":
        return cls(1, (tuple(messages),), (1,), gradients=gradients)

    @property
    def messages(self) -> list[Message]:
        """One sync of every fragment: ``sync_every`` steps' worth."""
        return [m for part in self.fragments for m in part]

    def syncs(self, fragment: int, steps: int) -> int:
        """Syncs fragment ``fragment`` starts in ``steps`` steps after the warm ones."""
        first = self.first_sync[fragment]
        return 0 if steps < first else 1 + (steps - first) // self.sync_every

    def ledger(self, steps: int) -> dict[str, tuple[int, float]]:
        """What a run of ``steps`` steps records in its ledger per op (start-up left out): (calls,
        bytes sent)."""
        out: dict[str, tuple[int, float]] = {}

        def add(m: Message, times: int) -> None:
            if times:
                calls, sent = out.get(m.op, (0, 0))
                out[m.op] = (calls + times, sent + times * m.nbytes)

        warm = min(steps, self.warm_steps)
        for m in self.warm:
            add(m, warm)
        for f, part in enumerate(self.fragments):
            for m in part:
                add(m, self.syncs(f, steps - warm))
        return out
