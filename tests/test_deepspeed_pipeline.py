"""Replicas made of DeepSpeed pipelines: ds_lowcomm.deepspeed.initialize(model=PipelineModule(...)),
engine.train_batch(). Each stage's parameters sync with the same stage of the other replicas only;
the result equals the same method on whole (unpipelined) replicas; tied layers stay tied; resume is
exact. Real processes, real DeepSpeed pipeline engines, gloo."""

import os

import pytest
import torch

from ds_lowcomm.workers import run_local_workers

os.environ.setdefault("DS_ACCELERATOR", "cpu")

METHODS = {
    "adamw": {"method": "adamw"},
    "demo": {"method": "demo", "topk": 4, "chunk": 8, "decay": 0.9},
    "diloco": {"method": "diloco", "sync_every": 3},
    "dct_diloco": {"method": "dct_diloco", "sync_every": 3, "topk": 8, "chunk": 8, "average": "world"},
    "sparseloco": {"method": "sparseloco", "sync_every": 3, "topk": 8, "chunk": 64},
    "mtdao": {"method": "mtdao", "sync_every": 3},
    "diloco_streaming": {"method": "diloco", "sync_every": 4, "fragments": 2, "sync_delay": 1},
}
STEPS = 6


class Regression(torch.utils.data.Dataset):
    def __init__(self, n=512):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.tanh(self.x @ torch.randn(8, 1, generator=g))

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def layers():
    torch.manual_seed(0)
    return [torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
            torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]


def config(method, replica_size, stage=0):
    # No clipping: DeepSpeed's pipeline engine takes the gradient norm of the first stage's parameters
    # only (runtime/utils.py clip_grad_norm_: model-parallel rank 0), the whole model's engine of all.
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
            "gradient_clipping": 0.0,
            # a large eps keeps Adam's first steps continuous in the gradient: the pipeline's backward
            # adds in another order than the whole model's, and sign-like steps would turn those
            # last-bit differences into whole learning-rate steps
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0, "eps": 0.1}},
            "zero_optimization": {"stage": stage}, "lowcomm": {**METHODS[method], "replica_size": replica_size}}


def _pipe_engine(method, stages, replica_size, stage=0):
    import deepspeed
    from deepspeed.pipe import PipelineModule

    import ds_lowcomm.deepspeed as dl

    deepspeed.init_distributed(dist_backend="gloo")  # as for any PipelineModule: before building it
    module = PipelineModule(layers=layers(), num_stages=stages, loss_fn=torch.nn.functional.mse_loss,
                            partition_method="uniform")
    engine, _, loader, _ = dl.initialize(model=module, config=config(method, replica_size, stage),
                                         training_data=Regression())
    return engine, loader


def _named(engine):
    return {n: p.detach().clone() for n, p in engine.module.named_parameters()}


def _pipeline_worker(rank, world, methods, stage):
    import torch.distributed as dist

    out = {}
    for method in methods:
        engine, loader = _pipe_engine(method, 2, 2, stage)
        it = iter(loader) if loader is not None else None
        losses = [engine.train_batch(it).item() for _ in range(STEPS)]
        out[method] = {"params": _named(engine), "losses": losses, "stage": engine.stage_id,
                       "replica": engine.lowcomm.topology.replica,
                       "bytes": engine.lowcomm.ledger.sent, "engine_bytes": engine.lowcomm.engine_ledger.sent}
        dist.barrier()
    return out


def _whole_worker(rank, world, methods):
    """The same model unpipelined (nn.Sequential of the same layers), one rank per replica."""
    import torch.distributed as dist

    import ds_lowcomm.deepspeed as dl

    out = {}
    for method in methods:
        engine, *_ = dl.initialize(model=torch.nn.Sequential(*layers()), config=config(method, 1))
        # the batches DeepSpeed's pipeline loader gives pipeline `rank` (its sampler does not shuffle)
        data = Regression()
        sampler = torch.utils.data.DistributedSampler(data, num_replicas=world, rank=rank, shuffle=False)
        it = iter(torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler))
        for _ in range(STEPS * 2):  # accumulation 2
            x, y = next(it)
            engine.backward(torch.nn.functional.mse_loss(engine(x), y))
            engine.step()
        out[method] = _named(engine)
        dist.barrier()
    return out


def test_pipeline_replicas_match_whole_replicas():
    """4 ranks = 2 replicas of a 2-stage pipeline. After 6 steps (2 outer syncs) each stage agrees
    across replicas, and every parameter equals the same method run on 2 unpipelined replicas of
    1 rank fed the same batches (the reference on whole parameters)."""
    methods = [m for m in METHODS if m != "diloco_streaming"]
    piped = run_local_workers(_pipeline_worker, 4, methods, 0)
    whole = run_local_workers(_whole_worker, 2, methods)[0]
    for method in methods:
        # DeepSpeed's default layout (pipe-major): ranks 0, 1 are stage 0 and 2, 3 stage 1; pipeline
        # (= replica) 0 is ranks 0 and 2, pipeline 1 ranks 1 and 3.
        where = {(piped[r][method]["replica"], piped[r][method]["stage"]): r for r in range(4)}
        assert sorted(where) == [(0, 0), (0, 1), (1, 0), (1, 1)] and where[(0, 0)] == 0, where
        for s in (0, 1):
            pa, pb = piped[where[(0, s)]][method]["params"], piped[where[(1, s)]][method]["params"]
            assert pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa), (method, s)
        together = {**piped[where[(0, 0)]][method]["params"], **piped[where[(0, 1)]][method]["params"]}
        assert together.keys() == whole[method].keys(), method
        for n, p in together.items():
            torch.testing.assert_close(p, whole[method][n], rtol=1e-4, atol=1e-5, msg=f"{method} {n} {(p - whole[method][n]).abs().max().item()}")
        losses = piped[where[(0, 1)]][method]["losses"]  # the last stage holds the loss
        assert losses[-1] < losses[0], (method, losses)
        assert piped[0][method]["bytes"] > 0, method
