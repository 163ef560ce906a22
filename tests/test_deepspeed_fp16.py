"""fp16 DeepSpeed engines across replicas: an overflow on one replica skips the step on every
replica (real DeepSpeed fp16 engines, 2 processes as 2 replicas, gloo).

DeepSpeed refuses fp16 on this CPU (its accelerator reports no fp16 support); the workers lift
that one check, as PLATFORM.md describes: torch runs the fp16 ops on the CPU."""

import os

import torch

from ds_lowcomm.workers import run_local_workers

from .conftest import params_digest, tiny_batch, tiny_model
from .test_deepspeed import LOWCOMM

os.environ.setdefault("DS_ACCELERATOR", "cpu")

STEPS, OVERFLOW_AT = 7, 3  # one skipped step: 6 method steps, the outer methods' (H 3) second sync last
CASES = [(method, 0) for method in LOWCOMM] + [("demo", 1), ("diloco", 1)]  # ZeRO 0 and ZeRO 1 wrappers


def _config(method, stage):
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
            "fp16": {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "lowcomm": {**LOWCOMM[method], "replica_size": 1, "timeout_s": 30}}


def _fp16_worker(rank, world):
    from deepspeed.accelerator import get_accelerator

    import ds_lowcomm.deepspeed as dl

    get_accelerator().is_fp16_supported = lambda: True  # this process only (module docstring)
    out = {}
    for method, stage in CASES:
        model = tiny_model()
        engine, *_ = dl.initialize(model=model, config=_config(method, stage))
        scales = []
        for step in range(1, STEPS + 1):
            x, y = tiny_batch(rank, step)
            loss = torch.nn.functional.mse_loss(engine(x.half()).float(), y)
            if rank == 1 and step == OVERFLOW_AT:
                loss = loss * float("inf")  # this replica's gradients overflow at this step only
            engine.backward(loss)
            engine.step()
            scales.append(float(engine.optimizer.loss_scale))
        out[(method, stage)] = {"skipped": engine.skipped_steps, "scales": scales,
                                "digest": params_digest(engine.module.float()),
                                "flags": engine.lowcomm.summary()["method_ledger"]["by_op"].get("overflow_flag")}
    return out


def test_an_overflow_on_one_replica_skips_the_step_on_every_replica():
    """Rank 1's loss overflows at step 3: both replicas skip that step (DeepSpeed's skipped_steps 1
    on each; before the agreement rank 0 stepped and waited in the exchange until timeout_s), their
    loss scales are equal at every step, and after the last sync their parameters are identical,
    for every method at ZeRO 0 and for demo and diloco at ZeRO 1."""
    results = run_local_workers(_fp16_worker, 2)
    for case in CASES:
        a, b = results[0][case], results[1][case]
        assert a["skipped"] == b["skipped"] == 1, (case, a["skipped"], b["skipped"])
        assert a["scales"] == b["scales"], case
        assert a["scales"][OVERFLOW_AT - 1] == a["scales"][OVERFLOW_AT - 2] / 2, (case, a["scales"])  # the skip halved it
        assert a["digest"] == b["digest"], case
        assert a["flags"]["calls"] == STEPS and a["flags"]["sent"] == 4 * STEPS, (case, a["flags"])  # one int32 a step, counted
