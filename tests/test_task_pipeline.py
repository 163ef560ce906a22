"""The reference task as a DeepSpeed pipeline: the GPT's pipeline layers equal the plain GPT;
launch/train.py --pipeline-stages trains end to end (int8 activations, replicas of one pipeline,
stage-matched digests, exact resume); ds-lowcomm compare refuses bad combinations. Real processes,
real DeepSpeed pipeline engines, gloo."""

import json
import math
import os

import pytest
import torch

from ds_lowcomm.config import ConfigError
from lowcomm_task.workers import run_local_workers

from .test_deepspeed import TINY_ARGS, _run, ds_config

os.environ.setdefault("DS_ACCELERATOR", "cpu")

TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "seq_len": 32}


def _batch(cfg, n=4):
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, cfg.vocab_size, (n, cfg.seq_len + 1), generator=g)
    return data[:, :-1], data[:, 1:]


def _layers_worker(rank, world):
    import deepspeed
    import torch.distributed as dist

    import ds_lowcomm.deepspeed as dl
    from lowcomm_task.model import GPT, GPTConfig, gpt_loss, gpt_pipeline_module

    deepspeed.init_distributed(dist_backend="gloo")
    cfg = GPTConfig(**TINY)
    x, y = _batch(cfg)
    torch.manual_seed(0)
    gpt = GPT(cfg)
    plain = gpt(x, y).item()
    # 1 stage (2 pipelines): the whole model on each rank, its forward called directly
    one = gpt_pipeline_module(gpt, 1)
    one_loss = gpt_loss(one(x), y).item()
    one_count = sum(p.numel() for p in one.parameters())
    # 2 stages: through the pipeline engine, held-out (eval_batch) then training (train_batch) loss
    torch.manual_seed(0)
    two = gpt_pipeline_module(GPT(cfg), 2)
    cfg_ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "lowcomm": {"method": "adamw", "replica_size": 2}}
    engine, *_ = dl.initialize(model=two, config=cfg_ds)
    eval_loss = engine.eval_batch(iter([(x, y)]), num_micro_batches=1).item()
    train_loss = engine.train_batch(iter([(x, y)])).item()
    names = sorted(n for n, _ in engine.module.named_parameters())
    stage_count = sum(p.numel() for p in engine.module.parameters())
    dist.barrier()
    return {"plain": plain, "one": one_loss, "eval": eval_loss, "train": train_loss, "stage": engine.stage_id,
            "names": names, "one_count": one_count, "stage_count": stage_count, "gpt_count": gpt.num_params()}


def test_gpt_pipeline_layers_equal_the_plain_gpt():
    """Same seed -> same loss on one batch: a 1-stage PipelineModule of the GPT's layers, and a
    2-stage pipeline engine (eval_batch and train_batch), against the plain GPT; the token embedding
    and the head stay one tied weight (on both stages of the 2-stage pipeline)."""
    results = run_local_workers(_layers_worker, 2)
    for r in results:
        assert r["one"] == r["plain"]  # the same operations in the same order
        assert r["eval"] == pytest.approx(r["plain"], rel=1e-6, abs=1e-6)
        assert r["train"] == pytest.approx(r["plain"], rel=1e-6, abs=1e-6)
        assert r["one_count"] == r["gpt_count"]  # one tied weight, not two
    by_stage = {r["stage"]: r for r in results}
    assert sorted(by_stage) == [0, 1]
    first, last = by_stage[0]["names"], by_stage[1]["names"]
    assert "tied_modules.tok.weight" in first and "tied_modules.tok.weight" in last
    assert "1.pos.weight" in first and not any(n.startswith("1.") for n in last)
    assert any(n.startswith(f"{2 + TINY['n_layer']}.") for n in last)  # the final norm on the last stage
    vocab_embd = 256 * TINY["n_embd"]
    assert by_stage[0]["stage_count"] + by_stage[1]["stage_count"] == results[0]["gpt_count"] + vocab_embd


def _launch_worker(rank, world, workdir):
    cfg = ds_config("demo", 0, replica_size=2)
    cfg["lowcomm"]["activations"] = {"forward": "int8", "backward": "int8"}
    demo = _run(cfg, workdir, "demo_pipe", "--pipeline-stages", "2")
    # resume: save at step 4, inside diloco's second interval (H=3); replica_size from --pipeline-stages
    dil = ds_config("diloco", 0)
    del dil["lowcomm"]["replica_size"]
    save = os.path.join(workdir, "ckpt_diloco")
    full = _run(dil, workdir, "diloco_pipe", "--pipeline-stages", "2", "--save-dir", save, "--save-at", "4")
    resumed = _run(dil, workdir, "diloco_pipe", "--pipeline-stages", "2", "--save-dir", save, "--resume")
    return {"demo": demo, "full": full, "resumed": resumed}


def test_launch_train_with_pipeline_stages(tmp_path):
    """launch/train.py's body on 4 ranks with --pipeline-stages 2 (2 replicas of one pipeline):
    demo with int8 activations trains, evaluates through the pipeline, the stage-matched ranks of
    the two replicas end equal, activation bytes are in the metrics; diloco resumes exactly."""
    results = run_local_workers(_launch_worker, 4, str(tmp_path))
    m = results[0]["demo"]
    hist = m["history"]
    assert m["pipeline_stages"] == 2 and m["replica_size"] == 2 and m["world_size"] == 4
    assert hist[-1]["train_loss"] < hist[0]["train_loss"], hist
    assert all(math.isfinite(h["val_loss"]) for h in hist) and hist[-1]["val_loss"] < math.log(256)
    # demo syncs every step: each stage's ranks agree across the replicas; the two stages differ
    digests = {}
    for stage, digest in zip(m["stages"], m["params_digests"]):
        digests.setdefault(stage, set()).add(digest)
    assert sorted(digests) == [0, 1] and all(len(d) == 1 for d in digests.values()), digests
    assert digests[0] != digests[1]
    assert m["activation_bytes_sent_per_worker"] > 0
    assert m["cross_replica_bytes_sent_per_worker"] > 0
    assert all(r["demo"]["history"][-1]["val_loss"] == hist[-1]["val_loss"] for r in results)  # every stage's
    ops = {op for ledger in m["ledgers"] for op in ledger["activations"]["by_op"]}
    assert {"activation_send", "activation_recv", "activation_grad_send", "activation_grad_recv"} <= ops
    full, resumed = results[0]["full"], results[0]["resumed"]
    assert full["replica_size"] == 2  # the default: one pipeline per replica
    assert full["params_digests"] == resumed["params_digests"]
    assert full["cross_replica_bytes_sent_per_worker"] == resumed["cross_replica_bytes_sent_per_worker"]
    assert resumed["history"][-1]["val_loss"] == full["history"][-1]["val_loss"]


def test_pipeline_flags_refused():
    from ds_lowcomm.cli import _parser
    from lowcomm_task.compare import build_specs
    from lowcomm_task.spec import TrainSpec

    args = _parser().parse_args(["compare", "--pipeline-stages", "2", "--workers", "3"])
    assert args.pipeline_stages == 2
    with pytest.raises(ConfigError, match="--workers must be a multiple of --pipeline-stages"):
        build_specs(["demo"], TrainSpec.from_args(args), {}, 3)
    assert build_specs(["demo"], TrainSpec.from_args(args), {}, 4)[0].pipeline_stages == 2
    with pytest.raises(ConfigError, match="--pipeline-stages must be >= 0"):
        TrainSpec.from_args(_parser().parse_args(["compare", "--pipeline-stages", "-1"]))
    with pytest.raises(ConfigError, match=r"demo.lowcomm.activations: codecs between pipeline stages need"):
        build_specs(["demo"], TrainSpec(), {"demo": {"lowcomm": {"activations": {"forward": "int8"}}}}, 2)
    with pytest.raises(ConfigError, match="activations.forward"):
        build_specs(["demo"], TrainSpec(pipeline_stages=2), {"demo": {"lowcomm": {"activations": {"forward": "x"}}}}, 2)


def test_compare_with_pipeline_stages(tmp_path):
    """ds-lowcomm compare --pipeline-stages 2 --workers 4: each method through pipelines."""
    from ds_lowcomm.cli import main

    out = tmp_path / "cmp"
    assert main(["compare", "--pipeline-stages", "2", "--workers", "4", "--methods", "demo", "--steps", "2",
                 "--eval-every", "2", "--warmup", "1", "--n-layer", "1", "--n-embd", "32", "--seq-len", "32",
                 "--batch", "4", "--out", str(out)]) == 0
    row, = json.loads((out / "results.json").read_text())
    assert row["pipeline_stages"] == 2 and row["replicas_identical"]  # demo syncs every step, stage by stage
    assert row["activation_bytes_sent_per_worker"] > 0 and row["bytes_sent_per_worker"] > 0
    assert math.isfinite(row["final_val_loss"]) and row["num_params"] > 0
