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

import math
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
        numel = math.prod(shape)
        lo, hi = max(offset, start), min(offset + numel, start + size)
        if hi <= lo:
            continue
        whole = lo == offset and hi == offset + numel
        pieces.append((lo - start, tuple(shape) if whole else (hi - lo,)))
    return Pieces(size, tuple(sorted(pieces)))


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

    def step_all() -> None:
        zero.optimizer.step()
        zero._lazy_init_hp_params_optimizer_state()

    def publish(i: int) -> None:  # ZeRO copied group i to the 16-bit weights before it was stepped
        partition_id = dist.get_rank(group=zero.real_dp_process_group[i])
        zero.parallel_partitioned_bit16_groups[i][partition_id].data.copy_(zero.single_partition_of_fp32_groups[i].data)

    zero._optimizer_step = _step_at_last_group(zero.single_partition_of_fp32_groups, groups, step_all, publish)


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

    def step_all() -> None:
        zero._set_fp32_optimizer_param_groups()
        try:
            zero.optimizer.step()
        finally:
            zero._clear_fp32_optimizer_param_groups()

    zero._optimizer_step = _step_at_last_group(zero.fp32_partitioned_groups_flat, subgroups, step_all,
                                               zero._reassign_or_swap_out_partitioned_parameters)


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
