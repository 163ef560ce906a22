"""fp16 engines: the loss scaler's overflow decision taken over every replica.

DeepSpeed decides whether a step overflowed over its own data-parallel and model-parallel groups,
which under ds_lowcomm are one replica. An overflow on one replica would then skip ``step()``
there only: a per-step method (adamw, demo, mtdao) would be one exchange short on that replica
while the others wait in theirs, and the outer methods' step counters would drift. So the flag
DeepSpeed computed inside the replica is summed once more over the whole job (one int32 per step,
counted in the method's ledger as ``overflow_flag``), before the wrapper acts on it: every replica
skips or steps together, and their loss scalers, fed the same sequence of decisions, stay equal.

Where DeepSpeed takes the decision (0.19.x): ZeRO 0 wraps the client optimizer in
``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``, whose ``overflow_checker`` (``CheckOverflow``)
answers through ``has_overflow`` (``check`` calls it) or ``check_using_norm``; ZeRO 1, 2 and 3
answer through the optimizer's own ``has_overflow``. Those methods are replaced on the instance.
bf16 engines have no loss scale, but their ZeRO 0 wrappers skip a step whose gradients are not
finite, again over one replica: DeepSpeed wraps a client optimizer in ``FP16_UnfusedOptimizer``
for bf16 too (agreed as above); in ``BF16_Optimizer`` the gradients it takes the norm of
(``get_grads_for_norm``) are checked, the flag summed over the job, and where another replica's
were not finite one infinite entry is added to this rank's list, so that DeepSpeed's own check
skips the step here too (ZeRO 1-3 do not skip bf16 steps; the non-finite guard handles those).
"""

from __future__ import annotations

import torch

from ..comm import ByteLedger, TorchDistTransport
from . import internals

OP = "overflow_flag"

def _agreed(decide, transport: TorchDistTransport):
    """``decide`` (the replica's own answer), then any replica's overflow is everyone's."""
    def agreed(*args, **kwargs):
        flag = torch.tensor([int(bool(decide(*args, **kwargs)))], dtype=torch.int32)
        return bool(transport.all_reduce_sum_(flag, op=OP).item() > 0)

    return agreed


def _bf16_agreed(get_grads_for_norm, transport: TorchDistTransport):
    def agreed(for_clipping=False):
        grads = get_grads_for_norm(for_clipping=for_clipping)
        if for_clipping:  # the clipping pass comes after the decision
            return grads
        non_expert, expert = grads
        tensors = [*non_expert, *(g for gs in expert.values() for g in gs)]
        local = any(not bool(torch.isfinite(g).all()) for g in tensors)
        flag = torch.tensor([int(local)], dtype=torch.int32)
        if transport.all_reduce_sum_(flag, op=OP).item() > 0 and not local:
            device = tensors[0].device if tensors else None
            non_expert = [*non_expert, torch.full((1,), float("inf"), device=device)]
        return non_expert, expert

    return agreed


def overflow_deciders(wrapper, bf16: bool) -> list[tuple[object, str, object]]:
    """(object, method name, agreeing wrapper maker) through which DeepSpeed's ``wrapper`` decides
    to skip a step (module docstring). An fp16 wrapper of another kind is refused, never left
    unagreed."""
    # every one declared (and checked) in internals.py
    fused, unfused = internals.live(internals.FP16_FUSED), internals.live(internals.FP16_UNFUSED)
    if isinstance(wrapper, internals.live(internals.BF16_OPTIMIZER)):
        return [(wrapper, internals.BF16_GRADS_FOR_NORM.attr, _bf16_agreed)]
    if isinstance(wrapper, (fused, unfused)):  # fp16; bf16 too, at ZeRO 0 around a client optimizer
        checker = internals.get(wrapper, internals.FUSED_OVERFLOW_CHECKER if isinstance(wrapper, fused)
                                else internals.UNFUSED_OVERFLOW_CHECKER)
        return [(checker, internals.CHECKER_HAS_OVERFLOW.attr, _agreed),
                (checker, internals.CHECKER_USING_NORM.attr, _agreed)]
    if isinstance(wrapper, (internals.live(internals.ZERO12), internals.live(internals.ZERO3))):
        # the same name at stage 3; with bf16 ZeRO skips no step (the non-finite guard acts)
        return [] if bf16 else [(wrapper, internals.ZERO12_HAS_OVERFLOW.attr, _agreed)]
    if bf16:
        return []
    raise NotImplementedError(f"ds_lowcomm: fp16 with DeepSpeed's {type(wrapper).__name__}: its overflow decision "
                              "cannot be agreed across replicas; use bf16 or fp32")


def agree_on_overflow(engine, num_replicas: int, ledger: ByteLedger, timeout_s: float | None) -> bool:
    """Collective (every rank of the job, at initialize, the same fp16/bf16 settings on every
    rank): make an fp16 or bf16 engine's decision to skip a step a whole-job one. Returns whether
    it did."""
    if num_replicas < 2 or not (engine.fp16_enabled() or engine.bfloat16_enabled()):
        return False
    deciders = overflow_deciders(engine.optimizer, bf16=not engine.fp16_enabled())
    if not deciders:
        return False
    transport = TorchDistTransport(ledger=ledger, timeout_s=timeout_s)  # the whole job (default group)
    for owner, name, agreeing in deciders:
        setattr(owner, name, agreeing(getattr(owner, name), transport))
    return True
