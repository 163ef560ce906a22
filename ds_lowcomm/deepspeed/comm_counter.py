"""Count the bytes of DeepSpeed's own collectives, where DeepSpeed issues them.

Every collective DeepSpeed runs goes through the communication backend object
``deepspeed.comm.comm.cdb``; wrapping its methods records each call in a :class:`ByteLedger`
(same conventions as ours: payload bytes this rank contributes and gets back; nothing over a
group of one rank). This is how the tests see that the engine's gradient all-reduce did not run
when a method communicates itself, and how the adamw baseline's bytes through DeepSpeed compare.
"""

from __future__ import annotations

import threading

import torch.distributed as dist

from ..comm import ByteLedger

_depth = threading.local()


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _size(group) -> int:
    return dist.get_world_size(group)


# op name -> (sent, received) from the call's arguments, bound to their names
def _one(a):
    n = _nbytes(a["tensor"])
    return n, n


def _coalesced(a):
    n = sum(_nbytes(t) for t in a["tensors"])
    return n, n


def _reduce_scatter_tensor(a):
    return _nbytes(a["input_tensor"]), _nbytes(a["output_tensor"])


def _all_gather_into_tensor(a):
    inp = _nbytes(a["input_tensor"])
    return inp, _nbytes(a["output_tensor"]) - inp


def _all_gather(a):
    inp = _nbytes(a["tensor"])
    return inp, sum(_nbytes(t) for t in a["tensor_list"]) - inp


def _broadcast(a):
    n = _nbytes(a["tensor"])
    return (n, 0) if dist.get_rank() == a.get("src", 0) else (0, n)


# The backend's methods hide their signatures behind decorators; these are their parameters
# (deepspeed/comm/torch.py, TorchBackend), in order.
COUNTED = {
    "all_reduce": (_one, ("tensor", "op", "group", "async_op")),
    "inference_all_reduce": (_one, ("tensor", "op", "group")),
    "all_reduce_coalesced": (_coalesced, ("tensors", "op", "group", "async_op")),
    "reduce": (_one, ("tensor", "dst", "op", "group", "async_op")),
    "reduce_scatter_tensor": (_reduce_scatter_tensor, ("output_tensor", "input_tensor", "op", "group", "async_op")),
    "all_gather_into_tensor": (_all_gather_into_tensor, ("output_tensor", "input_tensor", "group", "async_op")),
    "all_gather_base": (_all_gather_into_tensor, ("output_tensor", "input_tensor", "group", "async_op")),
    "all_gather": (_all_gather, ("tensor_list", "tensor", "group", "async_op")),
    "broadcast": (_broadcast, ("tensor", "src", "group", "async_op")),
}


def count_deepspeed_collectives(ledger: ByteLedger) -> None:
    """Wrap the live DeepSpeed backend's collectives (idempotent); needs init_distributed() first."""
    from deepspeed.comm import comm as ds_comm

    cdb = ds_comm.cdb
    if cdb is None:
        raise RuntimeError("deepspeed.comm is not initialised")
    if getattr(cdb, "_ds_lowcomm_counted", False):
        cdb._ds_lowcomm_ledger = ledger
        return
    cdb._ds_lowcomm_counted = True
    cdb._ds_lowcomm_ledger = ledger
    for name, (sizes, names) in COUNTED.items():
        original = getattr(cdb, name, None)
        if original is None:
            continue

        def wrapped(*args, _original=original, _name=name, _sizes=sizes, _names=names, **kw):
            outer = getattr(_depth, "value", 0) == 0
            _depth.value = getattr(_depth, "value", 0) + 1
            try:
                return _original(*args, **kw)
            finally:
                _depth.value -= 1
                if outer:  # a nested call is part of the outer one
                    bound = {**dict(zip(_names, args)), **kw}
                    # A call over a one-rank group is counted, with no bytes: nothing left the rank.
                    sent, received = _sizes(bound) if _size(bound.get("group")) > 1 else (0, 0)
                    cdb._ds_lowcomm_ledger.record(f"deepspeed.{_name}", sent, received)

        setattr(cdb, name, wrapped)
