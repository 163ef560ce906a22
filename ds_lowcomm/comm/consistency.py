"""Start-up check that every rank trains with the same settings and the same starting point."""

from __future__ import annotations

import json
import math
from typing import Any, Iterable, Mapping

import torch

from .ledger import SETUP_OP
from .transport import Transport


def param_checksums(params: Iterable[torch.Tensor]) -> list[float]:
    """Two cheap float64 sums per tensor, computed where the tensor lives."""
    out = []
    for p in params:
        d = p.detach().double()
        out.extend([d.sum().item(), d.abs().sum().item()])
    return out


def same_checksums(a: list[float], b: list[float]) -> bool:
    """Whether two lists of :func:`param_checksums` say the same tensors, to a relative 1e-9 (so
    that copies on different device types agree)."""
    return len(a) == len(b) and all(math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12) for x, y in zip(a, b))


def gather_json(transport: Transport, obj: Any) -> list[Any]:
    """Every rank's JSON-able ``obj``, in rank order (collective over ``transport``, bounded by its
    ``timeout_s``; recorded as start-up traffic)."""
    dev = transport.device
    data = torch.tensor(list(json.dumps(obj, sort_keys=True).encode()), dtype=torch.uint8, device=dev)
    length = torch.tensor([data.numel()], dtype=torch.int64, device=dev).view(torch.uint8)
    lengths = transport.all_gather_bytes(length, op=SETUP_OP).view(torch.int64).reshape(-1)
    padded = torch.zeros(int(lengths.max()), dtype=torch.uint8, device=dev)
    padded[: data.numel()] = data
    rows = transport.all_gather_bytes(padded, op=SETUP_OP)
    rows = rows.cpu()
    return [json.loads(bytes(rows[r, : int(lengths[r])].tolist()).decode()) for r in range(rows.shape[0])]


def settings_differences(a: Mapping[str, Any], b: Mapping[str, Any], a_has: str, b_has: str) -> str:
    """Every field whose value differs between ``a`` and ``b``, with both values, e.g.
    ``"topk: rank 0 has 4, rank 1 has 2"`` (``a_has="rank 0 has"``); ``"; "`` between fields, ``""``
    when none does. A field missing on one side reads None there. The one place that words a
    difference of settings: across ranks here, checkpoint against run in the optimizers and
    integrations."""
    keys = sorted(set(a) | set(b))
    return "; ".join(f"{k}: {a_has} {a.get(k)!r}, {b_has} {b.get(k)!r}" for k in keys if a.get(k) != b.get(k))


START_DIFFERS = ("starts from different parameters than rank 0: initialise every rank with the same seed, or "
                 "broadcast the parameters from rank 0 before building the optimizer")


def assert_same_across_ranks(transport: Transport, settings: dict, params: Iterable[torch.Tensor] | None = None,
                             differs: str = START_DIFFERS) -> None:
    """Raise on every rank if any rank's settings differ, or its starting parameters do.

    ``settings`` is a JSON-able dict (method settings, parameter shapes, ...); ``differs`` what the
    error says of a rank whose tensors are not rank 0's. Parameters are
    compared through float64 checksums with a relative tolerance of 1e-9, so replicas on
    different device types still agree.
    """
    record = {"settings": settings}
    if params is not None:
        record["checksums"] = param_checksums(params)
    everyone = gather_json(transport, record)
    mine = everyone[0]
    for rank, theirs in enumerate(everyone[1:], start=1):
        a, b = mine["settings"], theirs["settings"]
        if a != b:
            detail = settings_differences(a, b, "rank 0 has", f"rank {rank} has")
            raise ValueError(f"lowcomm settings differ across ranks ({detail})")
        if "checksums" in mine and not same_checksums(mine["checksums"], theirs["checksums"]):
            raise ValueError(f"rank {rank} {differs}")
