"""Make DeepSpeed see a subset of the job's ranks as its whole world (a "sub-world").

Heterogeneous replicas run different DeepSpeed set-ups in one torch.distributed job: in a 3-rank
job rank 0 may train a whole model with a plain engine while ranks 1-2 train it as a 2-stage
pipeline. DeepSpeed assumes it owns the world: ``PipelineParallelGrid`` requires its topology to
cover ``get_world_size()`` ranks and makes a group for every group of it, ``PipelineModule`` makes a
group of ``range(get_world_size())``, and the engines use the default group for barriers and
broadcasts. So each process enters its sub-world once, before the model is built, and stays there:
:func:`enter_subworld` replaces DeepSpeed's communication backend (``deepspeed.comm.comm.cdb``,
which every ``deepspeed.comm`` function calls) with one that translates between DeepSpeed's view and
the job:

- DeepSpeed's ranks are *virtual*: a process's index in the sub-world's (ascending) global ranks;
  ``get_rank()`` / ``get_world_size()`` of the default group answer in them;
- the default group (``None`` or WORLD) of every collective and barrier becomes the sub-world's own
  group; ranks DeepSpeed passes (``src``, ``dst``, peers, ``new_group``'s ranks) go virtual ->
  global; ranks torch returns (``get_global_rank``, ``recv``'s sender) go global -> virtual;
- groups are created with ``use_local_synchronization=True``: only their members call
  ``new_group``, as the other sub-worlds run other code.

``torch.distributed`` itself is untouched: its default group stays the whole job, with global
ranks, as ds_lowcomm's cross-replica groups need. DeepSpeed's engine, pipeline, ZeRO 1/2 and
checkpoint code reach the network only through ``deepspeed.comm`` (checked against DeepSpeed
0.19.8), so this one backend is the whole boundary.

Group names: for a group made with local synchronization torch names it by hashing its ranks with
the number of groups the process holds, so its members must hold equally many groups when they make
it. DeepSpeed's grids are symmetric (every rank is in one group per axis), so they do.
"""

from __future__ import annotations

import copy
import datetime
import threading

import torch.distributed as dist

from . import backend, internals
from .state import STATE
from .internals import GROUP_METHODS


# Set while a translated call runs: the real backend's own nested calls, and a byte counter's wrapper
# installed on the real backend (below), then pass through with the already translated arguments.
_inside = threading.local()


def _is_world(group) -> bool:
    return group is None or group is dist.GroupMember.WORLD


class _SubWorldBackend:
    """``deepspeed.comm``'s backend seen through the sub-world; everything not translated is the real
    backend's. Attributes set on it go to the real backend: so ``count_deepspeed_collectives`` run
    after entry wraps the real methods, and counts the translated (global) arguments, exactly as when
    it ran before entry."""

    def __init__(self, real, ranks: list[int], group, timeout):
        d = self.__dict__
        d["_sw_real"], d["_sw_ranks"], d["_sw_group"], d["_sw_timeout"] = real, ranks, group, timeout
        d["_sw_virtual"] = {g: v for v, g in enumerate(ranks)}

    def __setattr__(self, name, value):
        setattr(self._sw_real, name, value)

    def __getattr__(self, name):  # only for names not found on the wrapper itself
        if name in GROUP_METHODS:
            return self._translated(name)
        if backend.takes_group(self._sw_real, name):  # one neither translated here nor implemented above
            raise backend.unknown_group_method(self._sw_real, name)
        return getattr(self._sw_real, name)

    def _translated(self, name):
        # The parameters come from the live backend's signature (internals.py checks the group and
        # rank parameters are among them); GROUP_METHODS says which are ranks.
        sig = backend.backend_signature(self._sw_real, name)
        rank_args = GROUP_METHODS[name]
        # What the real backend has now. A byte counter installed after entry wraps *this* (it takes
        # the method it wraps from the wrapper) and puts its wrapper on the real backend; called from
        # inside a translated call, this goes on to the method it was made from, not to the counter.
        underlying = getattr(self._sw_real, name)

        def translated(*args, **kw):
            if getattr(_inside, "value", False):
                return underlying(*args, **kw)
            method = getattr(self._sw_real, name)  # at each call: a counter may be on it since
            bound = sig.bind(*args, **kw)
            bound.apply_defaults()  # a rank left at its default (gather's dst=0) is a virtual rank too
            call = bound.arguments
            if _is_world(call["group"]):
                call["group"] = self._sw_group
            for arg in rank_args:
                if call[arg] is not None:  # recv's src=None: any sender
                    call[arg] = self._global(call[arg])
            _inside.value = True
            try:
                result = method(*bound.args, **bound.kwargs)
            finally:
                _inside.value = False
            if name == "recv" and isinstance(result, int) and result >= 0:
                result = self._sw_virtual.get(result, result)  # the sender, as DeepSpeed numbers it
            return result

        return translated

    def _global(self, virtual: int) -> int:
        if not 0 <= virtual < len(self._sw_ranks):
            raise ValueError(f"rank {virtual} is outside the sub-world of {len(self._sw_ranks)} ranks "
                             f"(global ranks {self._sw_ranks})")
        return self._sw_ranks[virtual]

    def get_rank(self, group=None):
        if _is_world(group):
            return self._sw_virtual[dist.get_rank()]
        return self._sw_real.get_rank(group)

    def get_world_size(self, group=None):
        if _is_world(group):
            return len(self._sw_ranks)
        return self._sw_real.get_world_size(group)

    def get_world_group(self):
        return self._sw_group

    def get_global_rank(self, group, group_rank):
        # DeepSpeed uses the answer as a ``src``/``dst`` later, which we map virtual -> global again.
        if _is_world(group):
            group = self._sw_group
        real = self._sw_real.get_global_rank(group, group_rank)
        if real not in self._sw_virtual:
            raise ValueError(f"global rank {real} of this group is outside the sub-world {self._sw_ranks}")
        return self._sw_virtual[real]

    def new_group(self, ranks):
        # Every sub-world rank calls this for every group of DeepSpeed's grids, members or not; only
        # members take part (local synchronization): the rest of the job never calls it at all.
        # torch returns None to a non-member here, which DeepSpeed keeps only for groups it is not in.
        global_ranks = sorted(self._global(r) for r in ranks)
        return dist.new_group(global_ranks, timeout=self._sw_timeout, use_local_synchronization=True)

    def init_device_mesh(self, mesh_shape, mesh_dim_names):
        # torch builds a DeviceMesh over its own default group, the whole job. Refused with the words
        # DeepSpeed's tensor-parallel set-up (utils/groups.py, _init_tp_mesh_device) answers by making
        # its groups with new_group instead, which goes through the sub-world; a sequence-parallel mesh
        # (deepspeed.initialize's mesh_param) has no such fallback and fails here, by name.
        unsupported = internals.live(internals.DEVICE_MESH_SPLIT_UNSUPPORTED)
        raise RuntimeError(f"{unsupported} (ds_lowcomm sub-world {self._sw_ranks}: a DeviceMesh would span the "
                           "whole job)")

    def destroy_process_group(self, group=None):
        # The world here is the job's: a script's closing deepspeed.comm.destroy_process_group() ends
        # this process's torch.distributed state, as it does without a sub-world.
        return self._sw_real.destroy_process_group(group=None if _is_world(group) else group)

    def batch_isend_irecv(self, p2p_op_list):
        ops = []
        for op in p2p_op_list:
            op = copy.copy(op)  # the caller's objects keep its (virtual) peers
            op.peer = self._global(op.peer)
            if _is_world(op.group):
                op.group = self._sw_group
            ops.append(op)
        _inside.value = True
        try:
            return self._sw_real.batch_isend_irecv(ops)
        finally:
            _inside.value = False


def enter_subworld(ranks: list[int], timeout_s: float | None = None) -> None:
    """Make DeepSpeed see only the global ``ranks`` (ascending, this rank among them) as its world,
    for the rest of the process. Call it before building the model, after torch.distributed is
    initialised, on every rank of ``ranks`` (it creates their group; the other ranks of the job do
    not take part). Calling it again with the same ranks does nothing; other ranks raise.
    ``timeout_s``: how long the sub-world's groups wait for a stalled peer (torch's default if None).
    """
    internals.ensure_checked()
    active = STATE.subworld
    ranks = [int(r) for r in ranks]
    if active is not None:
        if ranks == active._sw_ranks:
            return
        raise RuntimeError(f"this process is already in the sub-world {active._sw_ranks}; "
                           f"it cannot enter {ranks}")
    if not dist.is_initialized():
        raise RuntimeError("enter_subworld needs torch.distributed initialised first")
    # torch orders a group's ranks ascending: keeping the sub-world in that order makes a process's
    # rank in any group DeepSpeed makes agree with the virtual ranks it made the group from.
    if not ranks or ranks != sorted(set(ranks)) or ranks[0] < 0 or ranks[-1] >= dist.get_world_size():
        raise ValueError(f"sub-world ranks must be distinct global ranks in ascending order, got {ranks}")
    if dist.get_rank() not in ranks:
        raise ValueError(f"rank {dist.get_rank()} is not in the sub-world {ranks}")

    if backend.backend() is None:
        # adopts the existing torch.distributed default group (no new rendezvous)
        backend.start_deepspeed_comm(dist.get_backend())
    real = backend.backend()
    backend.check_backend(real)
    timeout = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    group = dist.new_group(ranks, timeout=timeout, use_local_synchronization=True)
    STATE.subworld = _SubWorldBackend(real, ranks, group, timeout)
    # Every deepspeed.comm function reads the backend at each call (internals.LOOKED_UP): this reroutes
    # them all; deepspeed.init_distributed() now finds an initialised backend and does nothing.
    backend.replace_backend(STATE.subworld, real)
    # The byte counter asks where a call came from by file; this module is part of the call path.
    from . import comm_counter

    comm_counter._by_file[_wrapper_file()] = None


def _wrapper_file() -> str:
    return _SubWorldBackend.__getattr__.__code__.co_filename


def active_subworld() -> list[int] | None:
    """The global ranks of the sub-world this process is in, or None."""
    return None if STATE.subworld is None else list(STATE.subworld._sw_ranks)


def to_global(virtual_rank: int) -> int:
    """The global rank of DeepSpeed's (virtual) rank ``virtual_rank`` (itself outside a sub-world)."""
    return virtual_rank if STATE.subworld is None else STATE.subworld._global(virtual_rank)
