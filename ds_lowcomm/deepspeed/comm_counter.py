"""Count the bytes of DeepSpeed's own collectives, where DeepSpeed issues them.

Every collective DeepSpeed runs goes through the communication backend object
``deepspeed.comm.comm.cdb``; wrapping its methods records each call in a :class:`ByteLedger`
(same conventions as ours: payload bytes this rank contributes and gets back; nothing over a
group of one rank). This is how the tests see that the engine's gradient all-reduce did not run
when a method communicates itself, and how the adamw baseline's bytes through DeepSpeed compare.

A call whose caller is the user's own code (a ``deepspeed.comm.all_reduce`` in the training
script) is recorded apart, in the user ledger as ``user.<op>``: it is not DeepSpeed's traffic.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import ds_lowcomm

from ..comm import ByteLedger
from . import backend, internals

_depth = threading.local()

# Where a call comes from, by file: deepspeed.comm's own wrappers and torch (decorators) are passed
# through; the first other frame decides: DeepSpeed or ds_lowcomm -> the engine, anything else -> the user.
_by_file: dict[str, bool | None] = {}  # filename -> True (user), False (engine), None (pass through)
_prefixes: list[tuple[str, ...]] = []  # [pass through, engine], filled on first use (deepspeed imported then)


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


def _file_is_user(filename: str) -> bool | None:
    verdict = _by_file.get(filename, ...)
    if verdict is ...:
        if not _prefixes:
            import deepspeed

            _prefixes.append((_package_dir(torch), os.path.join(_package_dir(deepspeed), "comm") + os.sep))
            _prefixes.append((_package_dir(deepspeed), _package_dir(ds_lowcomm)))
        pass_through, engine = _prefixes
        path = filename if filename.startswith("<") else os.path.abspath(filename)
        verdict = None if path.startswith(pass_through) else not path.startswith(engine)
        _by_file[filename] = verdict
    return verdict


def called_by_user(frame) -> bool:
    """Whether the collective whose wrapper's caller is ``frame`` was issued by user code: the first
    frame outward that is neither in ``deepspeed.comm`` nor in torch is outside DeepSpeed and
    ds_lowcomm. (The first frame outside DeepSpeed altogether would not do: a user's
    ``engine.backward`` is on the stack of DeepSpeed's own gradient all-reduce.)"""
    while frame is not None:
        verdict = _file_is_user(frame.f_code.co_filename)
        if verdict is not None:
            return verdict
        frame = frame.f_back
    return False  # only DeepSpeed/torch frames: not the user's


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


# op -> (sent, received) from its arguments, bound by name to the live backend's signature
# (backend.backend_signature); internals.COUNTED_READS declares the names each one reads.
COUNTED = {
    "all_reduce": _one,
    "inference_all_reduce": _one,
    "all_reduce_coalesced": _coalesced,
    "reduce": _one,
    "reduce_scatter_tensor": _reduce_scatter_tensor,
    "all_gather_into_tensor": _all_gather_into_tensor,
    "all_gather_base": _all_gather_into_tensor,
    "all_gather": _all_gather,
    "broadcast": _broadcast,
}
assert COUNTED.keys() == internals.COUNTED_READS.keys()


def count_deepspeed_collectives(ledger: ByteLedger, user_ledger: ByteLedger | None = None) -> None:
    """Wrap the live DeepSpeed backend's collectives (idempotent); needs init_distributed() first.

    DeepSpeed's (and ds_lowcomm's) calls go to ``ledger`` as ``deepspeed.<op>``, the user's own
    calls to ``user_ledger`` as ``user.<op>`` (to ``ledger`` as well when it is None). The wall
    time inside the calls is added to the ledger's ``"comm"`` seconds (an async op's: its launch).
    """
    internals.ensure_checked()
    cdb = backend.backend()
    if cdb is None:
        raise RuntimeError("deepspeed.comm is not initialised")
    real = backend.real_backend()  # under a sub-world: the backend it wraps, whose signatures count
    backend.check_backend(real)
    cdb._ds_lowcomm_ledger = ledger
    cdb._ds_lowcomm_user_ledger = user_ledger if user_ledger is not None else ledger
    if getattr(cdb, "_ds_lowcomm_counted", False):
        return
    cdb._ds_lowcomm_counted = True
    for name, sizes in COUNTED.items():
        original = getattr(cdb, name)
        sig = backend.backend_signature(real, name)

        def wrapped(*args, _original=original, _name=name, _sizes=sizes, _sig=sig, **kw):
            outer = getattr(_depth, "value", 0) == 0
            if outer:  # a nested call is part of the outer one
                user = called_by_user(sys._getframe(1))
                start = time.perf_counter()
            _depth.value = getattr(_depth, "value", 0) + 1
            try:
                return _original(*args, **kw)
            finally:
                _depth.value -= 1
                if outer:
                    bound = _sig.bind(*args, **kw)
                    bound.apply_defaults()
                    bound = bound.arguments
                    # A call over a one-rank group is counted, with no bytes: nothing left the rank.
                    sent, received = _sizes(bound) if _size(bound.get("group")) > 1 else (0, 0)
                    target = cdb._ds_lowcomm_user_ledger if user else cdb._ds_lowcomm_ledger
                    target.record(f"user.{_name}" if user else f"deepspeed.{_name}", sent, received)
                    target.add_time("comm", time.perf_counter() - start)

        setattr(cdb, name, wrapped)
