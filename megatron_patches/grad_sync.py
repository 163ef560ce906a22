"""ds_lowcomm in place of Megatron DDP's data-parallel gradient all-reduce, per bucket group.

Megatron-Core's ``DistributedDataParallel`` keeps gradients in contiguous buffers cut into
buckets; each ``_ParamAndGradBucketGroup`` reduces its buckets in ``start_grad_sync`` (called
from the backward hooks as soon as the group's gradients are ready when ``overlap_grad_reduce``
is on) and ``finish_grad_sync`` (called by ``finalize_model_grads`` before the optimizer step;
without overlap it starts and finishes the reduction there). :func:`install_grad_sync` gives
each bucket group instance a :class:`BucketGroupSync` whose two methods stand in for those (the
class and every other group are untouched), so ds_lowcomm's exchange runs exactly where
Megatron's all-reduce ran: with overlap, started during the backward pass and waited for before
the step. Megatron's own gradient checks (``check_for_nan_in_grad``, ``check_for_large_grads``:
Megatron-LM's ``--check-for-nan-in-loss-and-grad``, ``--check-for-large-grads``) run where its
sync would have run them, before anything is exchanged, with the outer-loop methods too (where
the sync is a no-op). What follows in ``finalize_model_grads`` (tensor-parallel layernorm grads, the
pipeline's tied embedding grads) stays Megatron's.

An exchange (``start(params, grads) -> Pending``) leaves in each ``param.main_grad`` what the
optimizer should see: :class:`DenseMean` the mean gradient (the ``adamw`` baseline: exactly
Megatron's all-reduce, counted in the ledger), :class:`DeMoExchange` the mean of everyone's
sent top-k DCT momentum components (DeMo; Megatron's optimizer then takes the sign step).
:func:`switch_off_grad_sync` makes both methods no-ops instead (each replica keeps its own
gradients: the outer-loop methods and MT-DAO).
"""

from __future__ import annotations

from typing import Callable, Protocol, Sequence

import torch

from ds_lowcomm.comm import Pending, Transport, start_all_reduce_mean_
from ds_lowcomm.optim.demo import DeMo

from . import internals as mi


class Exchange(Protocol):
    def start(self, params: list[torch.Tensor], grads: list[torch.Tensor]) -> Pending:
        """Start syncing ``grads`` (laid out as ``params``); after ``wait()`` they hold the result."""


def bucket_groups(model_chunks: Sequence[torch.nn.Module]) -> list:
    """Every gradient bucket group of these Megatron DDP chunks (dense and expert-parallel); a
    chunk that is no DDP (a plain module, for the outer-loop methods) has none."""
    ddp = mi.live(mi.DDP)
    groups = []
    for chunk in model_chunks:
        if isinstance(chunk, ddp):
            groups += list(mi.get(chunk, mi.DDP_BUCKET_GROUPS)) + list(mi.get(chunk, mi.DDP_EXPERT_BUCKET_GROUPS))
    return groups


def check_grads(group) -> None:
    """Megatron's checks of a bucket group's local gradients (NaN / Inf: a RuntimeError, as
    Megatron raises them; unexpectedly large: its rerun state machine), where its config asks."""
    config = mi.get(group, mi.GROUP_DDP_CONFIG)
    nan, large = config.check_for_nan_in_grad, config.check_for_large_grads
    if nan or large:
        mi.method(group, mi.CHECK_GRADS, of_class=True)(check_for_nan_or_inf=nan, check_for_large=large)


def switch_off_grad_sync(model_chunks: Sequence[torch.nn.Module]) -> int:
    """Make Megatron DDP's data-parallel gradient reduction a no-op on these chunks (each
    replica keeps its own gradients; Megatron's gradient checks still run). Returns how many
    bucket groups were switched off."""
    groups = bucket_groups(model_chunks)
    for group in groups:
        checks = ChecksOnly(group)
        mi.replace_method(group, mi.START_GRAD_SYNC, checks.start_grad_sync)
        mi.replace_method(group, mi.FINISH_GRAD_SYNC, checks.finish_grad_sync)
    return len(groups)


class ChecksOnly:
    """A bucket group's sync with nothing exchanged: Megatron's gradient checks alone, once per
    step (at the start with overlap, else at the finish, as Megatron's sync runs)."""

    def __init__(self, group):
        self.group = group
        self.started = False

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        check_grads(self.group)
        self.started = True

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        if not self.started:
            check_grads(self.group)
        self.started = False


class BucketGroupSync:
    """One bucket group's ``start_grad_sync``/``finish_grad_sync``, running ``exchange`` on the
    group's parameters' ``main_grad`` views, in the group's parameter order."""

    def __init__(self, group, exchange: Exchange):
        self.group = group
        self.exchange = exchange
        self.params = [p for bucket in mi.get(group, mi.GROUP_BUCKETS)
                       for p in mi.get(bucket, mi.BUCKET_PARAMS_LIST) if p.numel()]
        self.pending: Pending | None = None

    def start_grad_sync(self, force_all_reduce: bool = False) -> None:
        if self.pending is not None:
            if mi.get(self.group, mi.GROUP_IS_FIRST_BATCH):  # as Megatron: finish_grad_sync started it already
                return
            raise RuntimeError("a gradient exchange is already in flight for this bucket group")
        check_grads(self.group)
        self.pending = self.exchange.start(self.params, [mi.get(p, mi.MAIN_GRAD) for p in self.params])

    def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
        mi.put(self.group, mi.GROUP_PARAM_GATHER_DISPATCHED, False)  # as Megatron's finish_grad_sync
        if self.pending is None:  # no overlap (or its first batch): start it here
            self.start_grad_sync()
        pending, self.pending = self.pending, None
        pending.wait()


def install_grad_sync(model_chunks: Sequence[torch.nn.Module], exchange: Exchange) -> list[BucketGroupSync]:
    """Put ``exchange`` in place of the data-parallel gradient reduction of every bucket group."""
    syncs = []
    for group in bucket_groups(model_chunks):
        sync = BucketGroupSync(group, exchange)
        mi.replace_method(group, mi.START_GRAD_SYNC, sync.start_grad_sync)
        mi.replace_method(group, mi.FINISH_GRAD_SYNC, sync.finish_grad_sync)
        syncs.append(sync)
    return syncs


class DenseMean:
    """The ``adamw`` baseline: the mean gradient over the data-parallel group, dense (what
    Megatron's all-reduce computes), through ds_lowcomm's transport and ledger."""

    def __init__(self, transport: Transport):
        self.transport = transport

    def start(self, params, grads) -> Pending:
        return start_all_reduce_mean_(grads, self.transport, op="all_reduce")


class DeMoExchange:
    """DeMo's exchange on the gradients Megatron hands over: each gradient goes into its
    parameter's momentum (held by ``demo``, a :class:`~ds_lowcomm.optim.demo.DeMo` over the
    model's parameters, scaled by the lr of the parameter's group now), the momenta's
    top-k DCT components travel, and ``main_grad`` becomes everyone's mean of them."""

    def __init__(self, demo: DeMo, groups_of: Callable[[], dict[int, dict]]):
        self.demo = demo
        self.groups_of = groups_of  # id(param) -> its param group, looked up at each exchange

    def start(self, params, grads) -> Pending:
        # The groups as they are now: a checkpoint load (torch's load_state_dict) replaces the
        # group dicts, and the scheduler sets the lr in the new ones.
        groups = self.groups_of()
        pending = self.demo.start_momentum_sync(params, grads, [groups[id(p)]["lr"] for p in params])

        def finish():
            for grad, mean in zip(grads, pending.wait()):
                grad.copy_(mean)
            return grads

        return Pending(finish, None)


__all__ = ["BucketGroupSync", "ChecksOnly", "check_grads", "DeMoExchange", "DenseMean", "bucket_groups", "install_grad_sync",
           "switch_off_grad_sync"]
