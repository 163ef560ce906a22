"""fp16 DeepSpeed engines across replicas: an overflow on one replica skips the step on every
replica (real DeepSpeed fp16 engines, 2 processes as 2 replicas, gloo).

DeepSpeed refuses fp16 on this CPU (its accelerator reports no fp16 support); the workers lift
that one check, as PLATFORM.md describes: torch runs the fp16 ops on the CPU."""

import os

import torch

from lowcomm_task.workers import run_local_workers

from .conftest import params_digest, tiny_batch, tiny_model
from .test_deepspeed import CARRIED, LOWCOMM

os.environ.setdefault("DS_ACCELERATOR", "cpu")

STEPS, OVERFLOW_AT = 7, 3  # one skipped step: 6 method steps, the outer methods' (H 3) second sync last
# (method, ZeRO stage, precision): DeepSpeed's ZeRO 0 and ZeRO 1 fp16 wrappers, ZeRO 0's bf16 one
# (carry_local_steps' replicas keep their own steps: never equal after the last sync, and the same skip)
CASES = ([(method, 0, "fp16") for method in LOWCOMM if method not in CARRIED] + [("demo", 1, "fp16"), ("diloco", 1, "fp16")]
         + [("demo", 0, "bf16"), ("diloco", 0, "bf16")])
PIPELINE_CASES = [("demo", 0, "bf16"), ("diloco", 0, "bf16")]  # pipeline engines: DeepSpeed's BF16_Optimizer
FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 1}


def _config(method, stage, precision):
    return {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
            "steps_per_print": 10**6, "zero_optimization": {"stage": stage},
            precision: FP16 if precision == "fp16" else {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
            "lowcomm": {**LOWCOMM[method], "replica_size": 1, "timeout_s": 30}}


def _fp16_worker(rank, world):
    from deepspeed.accelerator import get_accelerator

    import ds_lowcomm.deepspeed as dl

    get_accelerator().is_fp16_supported = lambda: True  # this process only (module docstring)
    out = {}
    for method, stage, precision in CASES:
        model = tiny_model()
        engine, *_ = dl.initialize(model=model, config=_config(method, stage, precision))
        half = torch.float16 if precision == "fp16" else torch.bfloat16
        scales = []
        for step in range(1, STEPS + 1):
            x, y = tiny_batch(rank, step)
            loss = torch.nn.functional.mse_loss(engine(x.to(half)).float(), y)
            if rank == 1 and step == OVERFLOW_AT:
                loss = loss * float("inf")  # this replica's gradients overflow at this step only
            engine.backward(loss)
            engine.step()
            scales.append(float(engine.optimizer.loss_scale) if precision == "fp16" else None)
        out[(method, stage, precision)] = {"skipped": engine.skipped_steps, "scales": scales,
                                "digest": params_digest(engine.module.float()),
                                "flags": engine.lowcomm.summary()["method_ledger"]["by_op"].get("overflow_flag")}
    for method, stage, precision in PIPELINE_CASES:
        out[("pipeline", method, stage, precision)] = _pipeline_run(rank, method, stage, precision)
    return out


def _pipeline_run(rank, method, stage, precision):
    """One-stage pipelines as replicas: DeepSpeed wraps a bf16 pipeline's optimizer in BF16_Optimizer."""
    from deepspeed.pipe import PipelineModule

    import ds_lowcomm.deepspeed as dl

    from .test_deepspeed_pipeline import layers

    overflow = [False]

    def loss_fn(out, y):
        loss = torch.nn.functional.mse_loss(out.float(), y)
        return loss * float("inf") if overflow[0] else loss

    module = PipelineModule(layers=layers(), num_stages=1, loss_fn=loss_fn, partition_method="uniform")
    engine, *_ = dl.initialize(model=module, config=_config(method, stage, precision))
    for step in range(1, STEPS + 1):
        overflow[0] = rank == 1 and step == OVERFLOW_AT
        x = torch.randn(8, 8, generator=torch.Generator().manual_seed(100 * rank + step))
        engine.train_batch(iter([(x.bfloat16(), torch.tanh(x.sum(1, keepdim=True)))]))
    return {"skipped": engine.skipped_steps, "scales": [None], "wrapper": type(engine.optimizer).__name__,
            "digest": params_digest(engine.module.float()),
            "flags": engine.lowcomm.summary()["method_ledger"]["by_op"].get("overflow_flag")}


def test_an_overflow_on_one_replica_skips_the_step_on_every_replica():
    """Rank 1's loss overflows at step 3: both replicas skip that step (DeepSpeed's skipped_steps 1
    on each; before the agreement rank 0 stepped and waited in the exchange until timeout_s), their
    loss scales are equal at every step, and after the last sync their parameters are identical,
    for every method at ZeRO 0 and for demo and diloco at ZeRO 1. bf16 (ZeRO 0's wrapper skips a
    step whose gradient norm is not finite; FP16_UnfusedOptimizer around ours, BF16_Optimizer in
    pipelines): the same, without a loss scale."""
    results = run_local_workers(_fp16_worker, 2)
    assert {results[0][("pipeline", *case)]["wrapper"] for case in PIPELINE_CASES} == {"BF16_Optimizer"}
    for case in CASES + [("pipeline", *case) for case in PIPELINE_CASES]:
        a, b = results[0][case], results[1][case]
        assert a["skipped"] == b["skipped"] == 1, (case, a["skipped"], b["skipped"])
        assert a["scales"] == b["scales"], case
        if "fp16" in case:  # the skip halved the loss scale
            assert a["scales"][OVERFLOW_AT - 1] == a["scales"][OVERFLOW_AT - 2] / 2, (case, a["scales"])
        assert a["digest"] == b["digest"], case
        assert a["flags"]["calls"] == STEPS and a["flags"]["sent"] == 4 * STEPS, (case, a["flags"])  # one int32 a step, counted
