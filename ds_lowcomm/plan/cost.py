"""The planner's cost model: bytes on the wire and seconds of a method's messages between replicas.

- Each collective as gloo and NCCL's ring run it between n replicas: an all-gather n-1 rounds of
  the whole payload P, an all-reduce 2(n-1) rounds of N/n, an all-to-all (whose bytes count every
  part to the others) n-1 rounds of 1/(n-1); each round one link latency plus its bytes, with
  Ethernet/IP/TCP framing, over the link's rate.
- One worker's share: a replica of G GPUs exchanges 1/G of the elements per GPU (each with its
  counterparts in the other replicas); traffic inside a replica is on its fast fabric, not counted.
- What the step waits for: a phase of a sync declared to run behind ``overlap_steps`` steps of
  compute (demo's overlap, a streaming sync's ``sync_delay``, each of the compressed all-reduce's
  two phases) is waited for only where it outlasts them; a gradient all-reduce (DDP, ZeRO's ``overlap_comm``) runs
  bucket by bucket behind the backward pass, its last bucket after it.
"""

from __future__ import annotations

import dataclasses
import math
from itertools import groupby

from ..comm.wire import Message

# Ethernet (14 + 4 FCS + 8 preamble + 12 gap are below tc: 14 counted), IPv4 20, TCP 32 (timestamps):
# a 1500-byte MTU carries 1448 bytes of payload in a 1514-byte frame, which a shaper counts.
WIRE_OVERHEAD = 1514 / 1448
# DDP's first bucket (torch.distributed's _DEFAULT_FIRST_BUCKET_BYTES): the gradients ready first
FIRST_BUCKET_BYTES = 1 << 20


def ring_rounds(kind: str, replicas: int) -> tuple[int, float]:
    """(rounds, the share of the payload each round carries) of one collective between ``replicas``
    workers as a ring (gloo's, and NCCL's ring algorithm): an all-gather is n-1 rounds of the whole
    payload, an all-reduce 2(n-1) rounds of 1/n of it (a reduce-scatter, then an all-gather); an
    all-to-all (whose ``nbytes`` already counts every part to the others) n-1 rounds of 1/(n-1)."""
    n = replicas
    if n <= 1:
        return 0, 0.0
    if kind == "all_to_all":
        return n - 1, 1.0 / (n - 1)
    return (n - 1, 1.0) if kind == "all_gather" else (2 * (n - 1), 1.0 / n)


def wire_bytes_sent(kind: str, nbytes: float, replicas: int) -> float:
    """Bytes one worker puts on the wire (payload, before framing) for one collective of
    ``nbytes`` per worker between ``replicas`` workers as a ring: an all-gather (n-1) x nbytes, an
    all-reduce 2 (n-1) / n x nbytes, an all-to-all its ``nbytes`` (the parts to the others). The
    ledger counts ``nbytes`` sent for all three (comm/ledger.py): they agree at 2 workers only. Each
    of these receives what it sends, so this is also a worker's bytes received on the wire (the
    ledger's received column: (n-1) x nbytes for an all-gather). Checked against what gloo writes
    to its sockets (tests/test_plan.py)."""
    rounds, share = ring_rounds(kind, replicas)
    return rounds * share * nbytes


def wire_bytes(msg: Message, replicas: int) -> float:
    """:func:`wire_bytes_sent` of one message."""
    return wire_bytes_sent(msg.kind, msg.nbytes, replicas)


def message_seconds(msg: Message, replicas: int, rate_bits: float, latency_s: float) -> float:
    """One collective between ``replicas`` workers as a ring: each round a latency, and the bytes
    of every round framed into Ethernet frames at the link's rate."""
    rounds, _ = ring_rounds(msg.kind, replicas)
    return rounds * latency_s + wire_bytes_sent(msg.kind, msg.nbytes, replicas) * WIRE_OVERHEAD * 8 / rate_bits


def share(msg: Message, gpus: int) -> Message:
    """One worker's share of ``msg`` in a replica of ``gpus`` GPUs (each exchanges 1/G of the elements)."""
    return dataclasses.replace(msg, nbytes=msg.nbytes / gpus) if gpus > 1 else msg


@dataclasses.dataclass(frozen=True)
class Link:
    """The link between replicas as one worker sees it: ``replicas``, its ``gpus`` per replica
    sharing their exchange, its rate (bits per second, each worker's own) and one-way latency."""

    replicas: int
    gpus: int
    rate_bits: float
    latency_s: float

    def seconds(self, messages) -> float:
        """The messages one after another: one worker's share of each, as a ring runs it."""
        return sum(message_seconds(share(m, self.gpus), self.replicas, self.rate_bits, self.latency_s)
                   for m in messages)


def exposed_seconds(messages, link: Link, compute_s: float) -> float:
    """What the steps wait for of one sync's ``messages``: each phase (its messages one after
    another) hides behind its ``overlap_steps`` k steps of compute, and is waited for where it
    outlasts them (k = 0: all of it)."""
    return sum(max(0.0, link.seconds(run) - run[0].overlap_steps * compute_s)
               for run in (list(run) for _, run in groupby(messages, key=lambda m: m.phase)))


def last_bucket_elements(shapes, bucket_cap_mb: float, element_bytes: int) -> int:
    """The elements of the bucket DDP all-reduces last: parameters in reverse order (the order the
    backward pass produces their gradients), a bucket closed once it holds at least its cap (1 MiB
    for the first, ``bucket_cap_mb`` MiB after), a parameter never split (DDP's
    ``_compute_bucket_assignment_by_size``); what is left at the end is the last bucket."""
    cap, size, elements, last = FIRST_BUCKET_BYTES, 0, 0, 0
    for shape in reversed(list(shapes)):
        n = math.prod(shape)
        size, elements = size + n * element_bytes, elements + n
        if size >= cap:
            last, size, elements, cap = elements, 0, 0, bucket_cap_mb * (1 << 20)
    return elements or last


def gradient_exposed_seconds(messages, link: Link, shapes, *, backward_s: float, bucket_cap_mb: float,
                             param_bytes: int, grad_bytes: int) -> float:
    """The step's wait for a gradient all-reduce run as DDP and ZeRO (``overlap_comm``) run it:
    bucket by bucket while the backward pass (``backward_s``) runs, the last bucket after it, and
    the rest only where the link is slower than the backward pass: the larger of the last bucket's
    all-reduce and the whole all-reduce less the backward pass (its latency rounds paid once, not
    per bucket: in the baseline's favour). DDP sends no health flag: the all-reduces only."""
    whole = link.seconds([m for m in messages if m.kind == "all_reduce"])
    # buckets sized in the gradients' own dtype (the parameters'), sent at grad_bytes an element
    last = Message("all_reduce", "all_reduce", last_bucket_elements(shapes, bucket_cap_mb, param_bytes) * grad_bytes)
    return max(link.seconds([last]), whole - backward_s)
