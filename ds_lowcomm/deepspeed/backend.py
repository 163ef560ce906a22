"""DeepSpeed's communication backend, as ds_lowcomm starts, swaps and reads it.

- Starting it (:func:`init_distributed`): ``deepspeed.init_distributed``, after a build lock left
  by a killed process is cleared (:func:`release_stale_comm_op_lock`; ``install()`` clears it too,
  for the frameworks that start DeepSpeed themselves), then this rank's shared-memory buffer
  unlinked.
- The sub-world's swap (:func:`replace_backend`, :func:`real_backend`) and what it and the byte
  counter read of the live backend (:func:`backend_signature`, :func:`takes_group`,
  :func:`check_backend`, :func:`unknown_group_method`).

Every DeepSpeed and torch internal used here is declared in ``internals.py`` and reached through it.
"""

from __future__ import annotations

import inspect
import os
import re
import time
import warnings
from typing import Any

from ..reflect import FrameworkInternalsError, Internal, internals_error, resolve, signature
from . import internals

# How long a start waits for a JIT build lock that a live process on this machine holds (its build
# takes a minute or two): past it, the holder is stuck, and the start fails naming it.
JIT_LOCK_WAIT_S = 1800.0
# A lock no process here holds, on a file system other processes may share (NFS, Lustre...): its
# holder may be on another machine, still building; past this age it is taken as a killed one's.
UNSEEN_HOLDER_STALE_S = 600.0
# How long a lock must stay unheld, the same file, to be a killed process's rather than one whose
# holder has closed it and is about to remove it (torch's FileBaton.release: close, then remove).
STALE_CONFIRM_S = 1.0
# File systems only this machine writes: there, a lock no process here holds has no holder at all.
LOCAL_FILE_SYSTEMS = frozenset({"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "ramfs", "overlay", "zfs", "f2fs",
                                "bcachefs", "jfs", "reiserfs"})


# --- The backend and the sub-world's swap ----------------------------------------------------------------
def backend():
    """DeepSpeed's communication backend, which every ``deepspeed.comm`` function calls (None before
    ``init_distributed``)."""
    return internals.live(internals.CDB)


_stands_for: dict[int, Any] = {}  # id(a replacement backend) -> the real backend it wraps


def replace_backend(new, real) -> None:
    """Make every ``deepspeed.comm`` function call ``new``, which wraps the backend ``real`` (they
    read the module global at each call: ``internals.LOOKED_UP``)."""
    import importlib

    _stands_for[id(new)] = real
    setattr(importlib.import_module(internals.CDB.module), internals.CDB.name, new)


def real_backend():
    """The backend DeepSpeed made (under the sub-world's replacement, if there is one)."""
    cdb = backend()
    return _stands_for.get(id(cdb), cdb)


def _on(real, name: str, params=None, match="call", use="") -> Internal:
    cls = type(real)
    return Internal(cls.__module__, f"{cls.__qualname__}.{name}", "method", params, match, use)


_signatures: dict[tuple[type, str], inspect.Signature] = {}


def backend_signature(real, name: str) -> inspect.Signature:
    """The parameters (``self`` left out) of method ``name`` of the live backend ``real``'s class,
    under its decorators."""
    key = (type(real), name)
    if key not in _signatures:
        sig = signature(resolve(internals.DISTRIBUTION, _on(real, name)), name)
        _signatures[key] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return _signatures[key]


def takes_group(real, name: str) -> bool:
    """Whether the live backend's class has a method ``name`` with a ``group`` parameter."""
    fn = inspect.getattr_static(type(real), name, None)
    if isinstance(fn, (staticmethod, classmethod)):
        fn = fn.__func__
    return inspect.isfunction(fn) and "group" in signature(fn, name).parameters


def check_backend(real) -> None:
    """The declared backend methods against the live backend's own class (a subclass of TorchBackend
    may redefine them): present, with the parameters ds_lowcomm reads."""
    if type(real) is internals.live(internals.TORCH_BACKEND):
        return  # checked by internals.ensure_checked()
    found = []
    for item in internals.BACKEND_METHODS:
        try:
            resolve(internals.DISTRIBUTION, _on(real, item.attr, item.params, item.match, item.use))
        except FrameworkInternalsError as err:
            found.append(str(err))
    if found:
        raise FrameworkInternalsError("\n".join(found))


def unknown_group_method(real, name: str) -> FrameworkInternalsError:
    """The error for a backend method that takes a process group and is not in
    ``internals.GROUP_METHODS``."""
    item = _on(real, name, use="the sub-world translates the group and ranks of the backend methods it knows")
    return internals_error(internals.DISTRIBUTION, item, "takes a process group but the ds_lowcomm sub-world does "
                           "not know it: passed on untranslated it would run over the whole job, across replicas, so "
                           "it is refused (internals.GROUP_METHODS lists the known ones with their rank parameters)")


# --- Starting it --------------------------------------------------------------------------------------------
def _holders(lock: str, owner_uid: int) -> list[int] | None:
    """The processes on this machine that hold ``lock`` open (torch's FileBaton keeps the file it
    created open until it releases it), or None where that cannot be seen: no /proc, or a lock of
    another user, whose processes' descriptors are not readable."""
    if not os.path.isdir("/proc/self/fd") or (owner_uid != os.geteuid() and os.geteuid() != 0):
        return None
    target, found = os.path.realpath(lock), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # gone, or not ours
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{pid}/fd/{fd}") == target:
                    found.append(int(pid))
                    break
            except OSError:
                continue
    return found


def _file_system(path: str) -> str | None:
    """The type of the file system ``path`` is on (/proc/self/mountinfo), or None."""
    try:
        with open("/proc/self/mountinfo") as f:
            mounts = f.read().splitlines()
    except OSError:
        return None
    path, best, kind = os.path.realpath(path), "", None
    for line in mounts:
        fields, _, rest = line.partition(" - ")
        parts = fields.split()
        if len(parts) < 5 or not rest:
            continue
        point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), parts[4])  # \040: a space
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, rest.split()[0]
    return kind


def release_stale_build_lock(lock: str, wait_s: float = JIT_LOCK_WAIT_S,
                             unseen_holder_stale_s: float = UNSEEN_HOLDER_STALE_S, poll_s: float = 0.25) -> bool:
    """Make sure torch's JIT load will not wait forever on the build lock ``lock``; True if it was
    removed as stale.

    torch's FileBaton waits for the lock file with no timeout, so a process killed while it held it
    (a replica stopped by fault tolerance, an elastic restart, a job cancelled) left every later
    start on the machine hanging. Here: a lock no process on this machine holds, on a file system
    only this machine writes, is a killed process's: removed at once, with a warning. A lock a live
    process here holds is waited for, at most ``wait_s``, then a TimeoutError names it and its
    holder. Where holders cannot all be seen (a shared file system, another user's lock), a lock
    older than ``unseen_holder_stale_s`` that no process here holds is taken as stale.
    Two starts may race to remove the same stale lock (both find it gone or remove it once)."""
    deadline = time.monotonic() + wait_s
    unheld = None  # the lock file (inode, mtime) last seen with no holder
    while True:
        try:
            stat = os.stat(lock)
        except FileNotFoundError:
            return False
        holders = _holders(lock, stat.st_uid)
        age = time.time() - stat.st_mtime
        local = _file_system(lock) in LOCAL_FILE_SYSTEMS
        if not holders and (age > unseen_holder_stale_s or (holders == [] and local)):
            # A holder releasing the lock closes it and then removes it: seen between the two (a
            # busy machine may preempt it there), it looks unheld; removing it then would fail the
            # holder's own remove. Stale only if the same file is still there, unheld, a while later.
            if unheld != (stat.st_ino, stat.st_mtime_ns):
                unheld = (stat.st_ino, stat.st_mtime_ns)
                time.sleep(STALE_CONFIRM_S)
                continue
            try:
                os.remove(lock)
            except FileNotFoundError:  # released, or removed by another start meanwhile
                return False
            seen = "no process on this machine holds it" if holders == [] else "its holder cannot be seen"
            warnings.warn(f"ds_lowcomm: removed the stale JIT build lock {lock} ({seen}, {age:.0f} s old: left by a "
                          f"process killed while torch loaded the op; torch would have waited for it forever)",
                          RuntimeWarning, stacklevel=2)
            return True
        unheld = None
        if time.monotonic() >= deadline:
            who = f"process(es) {', '.join(map(str, holders))} on this machine" if holders else "a process not seen here"
            raise TimeoutError(f"torch's JIT build lock {lock} is still held by {who} after {wait_s:.0f} s (a build "
                               f"takes a minute or two): that process is stuck; end it, or remove the lock file "
                               f"once no build runs")
        time.sleep(poll_s)


def comm_op_lock() -> str | None:
    """The build lock torch takes when DeepSpeed's backend JIT-loads its CPU comm op, or None where
    the accelerator has no such op."""
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder(internals.SHM_COMM_BUILDER)
    if builder is None:
        return None
    internals.TORCH_JIT.ensure_checked()
    name = internals.get(builder, internals.OP_BUILDER_NAME)
    directory = internals.TORCH_JIT.live(internals.TORCH_BUILD_DIRECTORY)(name, False)
    return os.path.join(directory, internals.JIT_LOCK_NAME)


def release_stale_comm_op_lock() -> None:
    """Before DeepSpeed's backend starts in this process (:func:`comm_op_lock`,
    :func:`release_stale_build_lock`); nothing once it is up (it loads nothing more)."""
    if backend() is None:
        lock = comm_op_lock()
        if lock is not None:
            release_stale_build_lock(lock)


def start_deepspeed_comm(dist_backend: str) -> None:
    """``deepspeed.init_distributed``, after a stale build lock of its CPU comm op is cleared."""
    import deepspeed

    release_stale_comm_op_lock()
    deepspeed.init_distributed(dist_backend=dist_backend)


_shm_released = False


def init_distributed(dist_backend: str) -> None:
    """:func:`start_deepspeed_comm`, then this rank's shared-memory buffer unlinked (every rank calls it).

    On the CPU accelerator with every rank on one host, DeepSpeed maps a 69 MB shared-memory
    all-reduce buffer per rank (``internals.SHM_BUFFER_NAME``) and never unlinks it: each launch on
    a new port left its buffers in /dev/shm, that is in RAM, until the machine restarts (a CI run of
    this suite leaked 15 GB and was killed for memory). Each rank returns from DeepSpeed's set-up
    only after mapping every peer's buffer, so after one barrier the names can go: the mappings live
    on until the processes exit, and the memory goes with them, however they exit."""
    import torch.distributed as dist

    global _shm_released
    start_deepspeed_comm(dist_backend)
    if _shm_released or internals.get(real_backend(), internals.SHM_COMM_OP) is None:  # the same on every rank
        return
    dist.barrier()
    name = internals.SHM_BUFFER_NAME.format(uid=os.getuid(), addr=os.environ.get("MASTER_ADDR", ""),
                                            port=os.environ.get("MASTER_PORT", ""), rank=dist.get_rank())
    try:
        os.unlink(os.path.join("/dev/shm", name))
    except FileNotFoundError:  # ranks on several hosts: DeepSpeed made no buffer
        pass
    _shm_released = True
