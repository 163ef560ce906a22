"""The method inside DeepSpeed's ZeRO optimizers (stages 1, 2 and 3).

ZeRO hands the client optimizer one flat fp32 partition per parameter group (stage 3: per
sub-group) and steps it one group at a time, copying each group back to the 16-bit weights
right after its step. Two things follow for a lowcomm method, fixed here:

- Parameter boundaries. A flat partition is the rank's slice of the group's parameters laid
  end to end; transform blocks spanning two parameters would let one's update leak into the
  other (a parameter with zero gradient and no weight decay would move). Each partition is
  declared to the optimizer as its parameter pieces (``LowcommOptimizer.set_pieces``): a
  parameter wholly in the partition keeps its shape, a parameter cut by the partition edge is
  a 1-D piece; padding is neither sent nor moved.
- One exchange per sync. The method is stepped once, over every group, when ZeRO reaches its
  last group (earlier groups' gradients are kept until then); the groups stepped before are then
  copied to the 16-bit weights again, which ZeRO did with their not yet updated values.

Both read ZeRO's internals (``stage_1_and_2.DeepSpeedZeroOptimizer``,
``stage3.DeepSpeedZeroOptimizer_Stage3``), every one through ``internals.py``, which checks them
and checks that ZeRO's ``step`` still calls the ``_optimizer_step`` replaced here; the
configurations that take other paths through those (optimizer offload, torch autocast, ZenFlow)
are refused in ``config.py``/below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..comm import ByteLedger, Matrix, MatrixAssembly, MatrixPiece, Pieces, TorchDistTransport
from ..optim import LowcommOptimizer
from ..settings import ConfigError
from . import internals as ds
from .internals import get, method, replace_method


@dataclass
class MatrixSteps:
    """A method whose step needs whole matrices (Muon's): which parameters are such matrices, and
    what to do with the assembly of their pieces over the replica (``attach(flats, groups,
    assembly)``: this rank's flat partitions in order, each one's param group index; it may
    return a callable run before every step of the method). Its bytes go to ``ledger``."""

    is_matrix: Callable[[torch.Tensor, tuple, int], bool]  # (a parameter, its whole shape, its param group index)
    attach: Callable[[list, list, MatrixAssembly], Callable[[], None] | None]
    ledger: ByteLedger
    timeout_s: float | None


def install(zero, optimizer: LowcommOptimizer, stage: int, matrix_steps: MatrixSteps | None = None) -> None:
    """Declare the partitions' pieces and make ZeRO step the method once per step (with
    ``matrix_steps``, each matrix assembled over the replica first: Muon's step)."""
    scaler, zenflow = (ds.ZERO3_AUTOCAST_SCALER, ds.ZERO3_ZENFLOW) if stage == 3 else (ds.ZERO12_AUTOCAST_SCALER,
                                                                         ds.ZERO12_ZENFLOW)
    if get(zero, scaler) is not None or get(zero, zenflow):
        raise ConfigError("torch_autocast / zenflow: not supported with lowcomm at ZeRO stages 1-3")
    # DeepSpeed's ZeRO 1/2 run their own Muon path for a client optimizer whose class name says
    # muon (_is_muon_group): ours must not, the method steps the partitions
    if "muon" in type(optimizer).__name__.lower():
        raise ConfigError(f"{type(optimizer).__name__}: a class name with 'muon' turns DeepSpeed's own ZeRO Muon on")
    if stage == 3:
        _install_stage3(zero, optimizer, matrix_steps)
    else:
        _install_stage12(zero, optimizer, matrix_steps)


def _assembly(matrices: list[Matrix], group, steps: MatrixSteps) -> MatrixAssembly:
    transport = TorchDistTransport(group, ledger=steps.ledger, timeout_s=steps.timeout_s)
    return MatrixAssembly(matrices, transport, transport.rank, transport.world_size)


def _cols(shape) -> int:
    n = 1
    for d in tuple(shape)[1:]:
        n *= int(d)
    return n


@dataclass(frozen=True)
class Slice:
    """The part of a parameter inside a flat partition."""

    param: torch.Tensor
    start: int  # its first element inside the partition (elements of the parameter, flattened)
    length: int
    at: int  # where that part begins in the partition's flat tensor

    @property
    def whole(self) -> bool:
        return self.length == self.param.numel()


@dataclass(frozen=True)
class Partition:
    """This rank's flat fp32 partition of one ZeRO 1/2 parameter group, and the parameter slices in it."""

    flat: torch.Tensor
    size: int
    slices: tuple[Slice, ...]


def stage12_partitions(zero) -> list[Partition]:
    """ZeRO 1/2: per parameter group, this rank's partition. A group's parameters lie end to end in
    its flat buffer (``round_robin_bit16_groups`` at ``round_robin_bit16_offsets``); rank r of the
    group's data-parallel group holds elements [r * size, (r + 1) * size) of it."""
    groups = get(zero, ds.ZERO12_PARAMS)
    offsets = get(zero, ds.ZERO12_OFFSETS)
    sizes = get(zero, ds.ZERO12_PARTITION_SIZE)
    dp_groups = get(zero, ds.ZERO12_DP_GROUPS)
    flats = get(zero, ds.ZERO12_FP32_PARTITIONS)
    out = []
    for i, params in enumerate(groups):
        size = int(sizes[i])
        first = dist.get_rank(group=dp_groups[i]) * size
        slices = []
        for p, offset in zip(params, offsets[i]):
            offset = int(offset)
            lo, hi = max(offset, first), min(offset + p.numel(), first + size)
            if hi > lo:
                slices.append(Slice(p, lo - offset, hi - lo, lo - first))
        out.append(Partition(flats[i], size, tuple(slices)))
    return out


def stage12_matrices(zero, is_matrix: Callable[[torch.Tensor, tuple, int], bool]) -> tuple[list[Matrix], object]:
    """ZeRO 1/2: every matrix of every group with the pieces each rank of the replica holds (rank
    r holds elements [r * size, (r + 1) * size) of its group's flat buffer), and the group."""
    groups, offsets = get(zero, ds.ZERO12_PARAMS), get(zero, ds.ZERO12_OFFSETS)
    sizes, dp_groups = get(zero, ds.ZERO12_PARTITION_SIZE), get(zero, ds.ZERO12_DP_GROUPS)
    ranks = {tuple(dist.get_process_group_ranks(g)) for g in dp_groups}
    if len(ranks) != 1:
        raise ConfigError("update muon / optimizer.type Muon at ZeRO 1/2: every parameter group must be partitioned "
                          "over the same ranks (MoE expert groups are not supported)")
    matrices = []
    for i, params in enumerate(groups):
        size, world = int(sizes[i]), dist.get_world_size(group=dp_groups[i])
        for p, offset in zip(params, offsets[i]):
            if not is_matrix(p, tuple(p.shape), i):
                continue
            offset, pieces = int(offset), []
            for r in range(world):
                lo, hi = max(offset, r * size), min(offset + p.numel(), (r + 1) * size)
                if hi > lo:
                    pieces.append(MatrixPiece(r, lo - offset, hi - lo, i, lo - r * size))
            matrices.append(Matrix(int(p.shape[0]), _cols(p.shape), tuple(pieces), i))
    return matrices, dp_groups[0]


def _install_stage12(zero, optimizer: LowcommOptimizer, matrix_steps: MatrixSteps | None) -> None:
    if get(zero, ds.ZERO12_CPU_OFFLOAD):
        raise ConfigError("zero_optimization.offload_optimizer: not supported with lowcomm")
    partitions = stage12_partitions(zero)
    for part in partitions:
        # a parameter wholly in the partition keeps its shape, one cut by its edge is a 1-D piece
        optimizer.set_pieces(part.flat, Pieces(part.size, tuple(sorted(
            (s.at, tuple(s.param.shape) if s.whole else (s.length,)) for s in part.slices))))
    flats = get(zero, ds.ZERO12_FP32_PARTITIONS)
    before_step = None
    if matrix_steps is not None:
        matrices, group = stage12_matrices(zero, matrix_steps.is_matrix)
        before_step = matrix_steps.attach(list(flats), list(range(len(flats))),
                                          _assembly(matrices, group, matrix_steps))

    def step_all() -> None:
        if before_step is not None:
            before_step()
        get(zero, ds.ZERO12_OPTIMIZER).step()
        # as ZeRO's _optimizer_step does after its step
        method(zero, ds.ZERO12_LAZY_INIT_HP)()

    def publish(i: int) -> None:  # ZeRO copied group i to the 16-bit weights before it was stepped
        partition_id = dist.get_rank(group=get(zero, ds.ZERO12_DP_GROUPS)[i])
        get(zero, ds.ZERO12_BIT16_PARTITIONS)[i][partition_id].data.copy_(flats[i].data)

    step = _step_at_last_group(flats, len(partitions), step_all, publish)
    replace_method(zero, ds.ZERO12_OPTIMIZER_STEP, lambda group_no: step(group_no))


def _install_stage3(zero, optimizer: LowcommOptimizer, matrix_steps: MatrixSteps | None) -> None:
    if any(get(zero, item) for item in (ds.ZERO3_OFFLOAD_OPTIMIZER, ds.ZERO3_OFFLOAD_PARAM, ds.ZERO3_SWAP_OPTIMIZER)):
        raise ConfigError("zero_optimization.offload_optimizer / offload_param: not supported with lowcomm")
    dp_group = get(zero, ds.ZERO3_DP_GROUP)
    rank, world = dist.get_rank(group=dp_group), dist.get_world_size(group=dp_group)
    flats = get(zero, ds.ZERO3_FP32_FLAT)
    group_of = get(zero, ds.ZERO3_SUBGROUP_TO_GROUP) if matrix_steps is not None else {}
    matrices = []
    for sg, params in enumerate(get(zero, ds.ZERO3_PARAMS)):
        flat = flats[sg]
        # Each parameter's partition (ds_tensor, ceil(numel / ranks) elements) lies end to end in
        # the sub-group's flat buffer; rank r's holds elements [r * size, ...) of the parameter.
        offset, layout = 0, []
        for p in params:
            size, numel = get(p, ds.PARAM_DS_TENSOR).numel(), get(p, ds.PARAM_DS_NUMEL)
            shape = tuple(get(p, ds.PARAM_DS_SHAPE))
            real = max(0, min(size, numel - rank * size))
            if real == numel:
                layout.append((offset, shape))
            elif real:
                layout.append((offset, (real,)))
            if matrix_steps is not None and matrix_steps.is_matrix(p, shape, group_of[sg]):
                pieces = tuple(MatrixPiece(r, r * size, min(size, numel - r * size), sg, offset)
                               for r in range(world) if numel > r * size)
                matrices.append(Matrix(shape[0], _cols(shape), pieces, group_of[sg]))
            offset += size
        optimizer.set_pieces(flat, Pieces(flat.numel(), tuple(layout)))
    before_step = None
    if matrix_steps is not None:
        before_step = matrix_steps.attach(list(flats), [group_of[sg] for sg in range(len(flats))],
                                          _assembly(matrices, dp_group, matrix_steps))

    def step_all() -> None:
        method(zero, ds.ZERO3_SET_FP32_GROUPS)()
        if before_step is not None:
            before_step()
        try:
            get(zero, ds.ZERO3_OPTIMIZER).step()
        finally:
            method(zero, ds.ZERO3_CLEAR_FP32_GROUPS)()

    publish = method(zero, ds.ZERO3_PUBLISH)
    step = _step_at_last_group(flats, len(flats), step_all, publish)
    replace_method(zero, ds.ZERO3_OPTIMIZER_STEP, lambda sub_group_id: step(sub_group_id))


def _step_at_last_group(flats, count: int, step_all, publish):
    """ZeRO's per-group ``_optimizer_step(i)`` replaced: keep each group's gradient (ZeRO drops it
    after the call) until the last group, then step the method once over every group (one
    exchange per sync) and ``publish`` the groups ZeRO already copied to its 16-bit weights."""
    kept: dict[int, torch.Tensor] = {}

    def optimizer_step(i: int) -> None:
        kept[i] = flats[i].grad
        if i < count - 1:
            return
        for j, grad in kept.items():
            flats[j].grad = grad
        kept.clear()
        step_all()
        for j in range(count - 1):
            flats[j].grad = None
            publish(j)

    return optimizer_step
