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

Both read ZeRO's internals (deepspeed 0.19: ``stage_1_and_2.DeepSpeedZeroOptimizer``,
``stage3.DeepSpeedZeroOptimizer_Stage3``); the configurations that take other paths through
those (optimizer offload, torch autocast, ZenFlow) are refused in ``config.py``/below.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..comm import Pieces
from ..optim import LowcommOptimizer
from ..settings import ConfigError


def install(zero, optimizer: LowcommOptimizer, stage: int) -> None:
    """Declare the partitions' pieces and make ZeRO step the method once per step."""
    if getattr(zero, "torch_autocast_gradscaler", None) or getattr(zero, "zenflow", False):
        raise ConfigError("torch_autocast / zenflow: not supported with lowcomm at ZeRO stages 1-3")
    if stage == 3:
        _install_stage3(zero, optimizer)
    else:
        _install_stage12(zero, optimizer)


def _pieces(offsets_shapes, start: int, size: int) -> Pieces:
    """The parts of parameters (offset in the group's flat buffer, shape) inside [start, start+size)."""
    pieces = []
    for offset, shape in offsets_shapes:
        numel = _numel(shape)
        lo, hi = max(offset, start), min(offset + numel, start + size)
        if hi <= lo:
            continue
        whole = lo == offset and hi == offset + numel
        pieces.append((lo - start, tuple(shape) if whole else (hi - lo,)))
    return Pieces(size, tuple(sorted(pieces)))


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _install_stage12(zero, optimizer: LowcommOptimizer) -> None:
    if zero.cpu_offload:
        raise ConfigError("zero_optimization.offload_optimizer: not supported with lowcomm")
    groups = len(zero.bit16_groups)
    for i in range(groups):
        flat = zero.single_partition_of_fp32_groups[i]
        partition_id = dist.get_rank(group=zero.real_dp_process_group[i])
        size = int(zero.partition_size[i])
        layout = [(int(off), tuple(meta.shape))
                  for off, meta in zip(zero.round_robin_bit16_offsets[i], zero.round_robin_bit16_meta[i])]
        optimizer.set_pieces(flat, _pieces(layout, partition_id * size, size))

    kept: dict[int, torch.Tensor] = {}

    def optimizer_step(group_no: int) -> None:
        flats = zero.single_partition_of_fp32_groups
        kept[group_no] = flats[group_no].grad  # ZeRO drops it after this call
        if group_no < groups - 1:
            return
        for i, grad in kept.items():
            flats[i].grad = grad
        kept.clear()
        zero.optimizer.step()  # every group at once: one exchange per sync
        for i in range(groups - 1):
            flats[i].grad = None
            partition_id = dist.get_rank(group=zero.real_dp_process_group[i])
            zero.parallel_partitioned_bit16_groups[i][partition_id].data.copy_(flats[i].data)
        zero._lazy_init_hp_params_optimizer_state()

    zero._optimizer_step = optimizer_step


def _install_stage3(zero, optimizer: LowcommOptimizer) -> None:
    if zero.offload_optimizer or getattr(zero, "offload_param", False) or zero.swap_optimizer:
        raise ConfigError("zero_optimization.offload_optimizer / offload_param: not supported with lowcomm")
    rank = dist.get_rank(group=zero.dp_process_group)
    subgroups = len(zero.fp16_groups)
    for sg, params in enumerate(zero.fp16_groups):
        flat = zero.fp32_partitioned_groups_flat[sg]
        # Each parameter's partition (ds_tensor, ceil(numel / ranks) elements) lies end to end in
        # the sub-group's flat buffer; this rank's holds elements [rank * size, ...) of the parameter.
        offset, layout = 0, []
        for p in params:
            size = p.ds_tensor.numel()
            real = max(0, min(size, p.ds_numel - rank * size))
            if real == p.ds_numel:
                layout.append((offset, tuple(p.ds_shape)))
            elif real:
                layout.append((offset, (real,)))
            offset += size
        optimizer.set_pieces(flat, Pieces(flat.numel(), tuple(layout)))

    kept: dict[int, torch.Tensor] = {}

    def optimizer_step(sub_group_id: int) -> None:
        flats = zero.fp32_partitioned_groups_flat
        kept[sub_group_id] = flats[sub_group_id].grad  # ZeRO drops it after this call
        if sub_group_id < subgroups - 1:
            return
        for sg, grad in kept.items():
            flats[sg].grad = grad
        kept.clear()
        zero._set_fp32_optimizer_param_groups()
        try:
            zero.optimizer.step()  # every sub-group at once: one exchange per sync
        finally:
            zero._clear_fp32_optimizer_param_groups()
        for sg in range(subgroups - 1):
            flats[sg].grad = None
            zero._reassign_or_swap_out_partitioned_parameters(sg)

    zero._optimizer_step = optimizer_step
