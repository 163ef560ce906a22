"""Replicas made of DeepSpeed pipelines: ds_lowcomm.deepspeed.initialize(model=PipelineModule(...)),
engine.train_batch(). Each stage's parameters sync with the same stage of the other replicas only;
the result equals the same method on whole (unpipelined) replicas; tied layers stay tied; resume is
exact. Real processes, real DeepSpeed pipeline engines, gloo."""

import os

import pytest
import torch

from lowcomm_task.workers import run_local_workers

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
    1 rank fed the same batches (the reference on whole parameters). One method of each kind (a
    per-step sparse exchange, an outer sync with error feedback, mtdao's own syncs): adamw and
    dct_diloco run across a pipelined replica in test_deepspeed_hetero's by-name test, diloco's
    streaming form in the tied-layers test below (each launch of 4 pipeline ranks costs ~15 s)."""
    methods = ["demo", "sparseloco", "mtdao"]
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


class Wide(Regression):
    """8-dimensional targets, for a model whose first and last layers are one tied Linear(8, 8)."""

    def __init__(self, n=512):
        super().__init__(n)
        self.y = torch.tanh(self.x.flip(1))


def _tied_module():
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import ProcessTopology

    torch.manual_seed(0)
    specs = [TiedLayerSpec("ends", torch.nn.Linear, 8, 8), LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, 8, 32),
             LayerSpec(torch.nn.Tanh), LayerSpec(torch.nn.Linear, 32, 8), LayerSpec(torch.nn.Tanh),
             TiedLayerSpec("ends", torch.nn.Linear, 8, 8)]
    # data-major: each pipeline (replica) is consecutive ranks, 0-1 and 2-3 (README)
    return PipelineModule(layers=specs, topology=ProcessTopology(axes=["data", "pipe"], dims=[2, 2]),
                          loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")


def _tied_weight(engine):
    return next(p for n, p in engine.module.named_parameters() if n.startswith("tied_modules.ends.weight"))


RESUMED = {  # method, ZeRO stage, activation codecs
    "demo": (1, {"forward": "int8", "backward": "int8"}),
    "dct_diloco": (1, None),
    "diloco_streaming": (0, {"forward": "topk", "backward": "none", "topk_fraction": 0.5}),
}


def _resume_worker(rank, world, workdir):
    import deepspeed
    import torch.distributed as dist

    import ds_lowcomm.deepspeed as dl
    from ds_lowcomm.settings import ConfigError

    deepspeed.init_distributed(dist_backend="gloo")
    out = {}
    for method, (stage, activations) in RESUMED.items():
        cfg = config(method, 2, stage)
        if activations:
            cfg["lowcomm"]["activations"] = activations
        ckpt = os.path.join(workdir, method)
        if method == "demo":  # ZeRO 2 is refused by name before any engine is built
            try:
                dl.initialize(model=_tied_module(), config={**cfg, "zero_optimization": {"stage": 2}})
                out["zero2"] = None
            except ConfigError as err:
                out["zero2"] = str(err)

        def engine_and_data():
            engine, _, loader, _ = dl.initialize(model=_tied_module(), config=cfg, training_data=Wide())
            return engine, (iter(loader) if loader is not None else None)

        full, it = engine_and_data()
        losses = [full.train_batch(it).item() for _ in range(4)]
        full.save_checkpoint(ckpt)  # mid-interval for the outer methods, a fragment in flight for streaming
        losses += [full.train_batch(it).item() for _ in range(4)]
        resumed, it2 = engine_and_data()
        resumed.load_checkpoint(ckpt)
        if it2 is not None:  # the loader restarts; skip what the full run read before its save
            for _ in range(4 * 2):
                next(it2)
        resumed_losses = [resumed.train_batch(it2).item() for _ in range(4)]
        s = full.lowcomm.summary()
        out[method] = {
            "exact": all(torch.equal(a, b) for a, b in zip(full.module.parameters(), resumed.module.parameters())),
            "losses": losses, "resumed_losses": resumed_losses,
            "tied": _tied_weight(full).detach().clone(), "stage": full.stage_id,
            "replica": full.lowcomm.topology.replica, "activation_bytes": s["activation_bytes_sent"],
            "activation_ops": sorted(s["activation_ledger"]["by_op"]),
        }
        dist.barrier()
    return out


def test_pipeline_replicas_tied_layers_zero1_streaming_activations_resume(tmp_path):
    results = run_local_workers(_resume_worker, 4, str(tmp_path))
    assert [r["demo"]["replica"] for r in results] == [0, 0, 1, 1]  # the module's topology decides
    for method, (stage, activations) in RESUMED.items():
        by = {(r[method]["replica"], r[method]["stage"]): r[method] for r in results}
        for r in by.values():
            assert r["exact"], method
            assert r["resumed_losses"] == r["losses"][4:], method
            assert r["activation_bytes"] > 0, method  # stage 0 sends activations, stage 1 their gradients
        assert by[(0, 0)]["activation_ops"] == ["activation_grad_recv", "activation_send"], method
        assert by[(0, 1)]["activation_ops"] == ["activation_grad_send", "activation_recv"], method
        # the tied Linear lives on both stages of a replica and stays one weight (across replicas
        # too for demo, which syncs every step; the outer methods end in a local phase here)
        for replica in (0, 1):
            assert torch.equal(by[(replica, 0)]["tied"], by[(replica, 1)]["tied"]), (method, replica)
        if method == "demo":
            assert torch.equal(by[(0, 0)]["tied"], by[(1, 0)]["tied"])
            last = by[(0, 1)]["losses"]  # (training itself: test_pipeline_replicas_match_whole_replicas)
            assert last[-1] < last[0], (method, last)
    assert "zero_optimization.stage must be 0 or 1 with DeepSpeed's pipeline engine" in results[0]["zero2"]
    # int8 sends 8 + 4 bytes per row of 8 values (codes and a scale), none 32
    assert results[0]["demo"]["activation_bytes"] < results[0]["dct_diloco"]["activation_bytes"] / 2


def _inside_worker(rank, world):
    engine, loader = _pipe_engine("demo", 2, 4, 0)
    it = iter(loader) if loader is not None else None
    for _ in range(3):
        engine.train_batch(it)
    return {"replica": engine.lowcomm.topology.replica, "stage": engine.stage_id, "params": _named(engine),
            "dp": (engine.grid.data_parallel_id, engine.grid.data_parallel_size),
            "bytes": engine.lowcomm.ledger.sent}


def test_two_pipelines_per_replica():
    """8 ranks = 2 replicas x (2 pipelines x 2 stages), ZeRO 0: DeepSpeed averages gradients over the
    replica's 2 pipelines of a stage; the 2 ranks of a stage in a replica split the cross-replica
    sync by owner (ReplicaShard over that stage's group) and share the result; after 3 demo steps
    all 4 ranks of a stage hold the same parameters."""
    results = run_local_workers(_inside_worker, 8)
    for stage in (0, 1):
        mine = [r for r in results if r["stage"] == stage]
        assert sorted((r["replica"], r["dp"]) for r in mine) == [(0, (0, 2)), (0, (1, 2)), (1, (0, 2)), (1, (1, 2))]
        assert all(all(torch.equal(r["params"][n], mine[0]["params"][n]) for n in r["params"]) for r in mine)
        owners = {r["dp"][0]: r["bytes"] for r in mine if r["replica"] == 0}
        assert owners[0] > 0 and owners[1] > 0  # both pipelines of a replica sync a share
