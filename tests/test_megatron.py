"""ds_lowcomm inside Megatron-Core (megatron_patches/): real megatron-core modules and schedules in
real processes (gloo, CPU shim), two replicas = Megatron's two data-parallel ranks, TP 1, PP 1."""

import argparse
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the 'megatron' extra)")

from ds_lowcomm.settings import ConfigError  # noqa: E402
from lowcomm_task.workers import run_local_workers  # noqa: E402
from megatron_patches.args import activation_settings, add_lowcomm_args, lowcomm_config  # noqa: E402

from tests.megatron_train import train  # noqa: E402


def _worker(rank, world):
    from megatron_patches import cpu_shim
    cpu_shim.install()  # before megatron (a no-op with a GPU)
    from megatron.core import parallel_state as ps

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(1234)  # Megatron's RNG tracker (CPU generator under the shim)
    assert ps.get_data_parallel_world_size() == world
    out = {}

    # (a) DiLoCo, H = 2, outer lr 1, no momentum: the sync sets both replicas to the mean of what
    # each held after its second inner step; before it they differ (no gradient all-reduce).
    seen = []
    model, opt, _, _ = train({"method": "diloco", "sync_every": 2, "outer_lr": 1.0, "outer_momentum": 0.0},
                             steps=2, on_inner_step=seen.append)
    out["diloco_inner"] = seen
    out["diloco_final"] = [p.detach().clone() for p in model.parameters()]
    out["diloco_outer_steps"] = opt.outer.outer_steps
    buf = io.BytesIO()  # the wrapper's state (outer + Megatron's) saves and loads back
    torch.save(opt.state_dict(), buf)
    opt.load_state_dict(torch.load(io.BytesIO(buf.getvalue()), weights_only=False))
    out["diloco_state_keys"] = sorted(opt.state_dict()["lowcomm"])

    # (b) SparseLoCo learns over 10 steps with 2 compressed syncs.
    _, opt, losses, _ = train({"method": "sparseloco", "sync_every": 5, "topk": 16, "chunk": 16}, steps=10)
    out["sparseloco_losses"] = losses
    out["sparseloco_outer_steps"] = opt.outer.outer_steps
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results():
    # The CPU path on every machine (the shim is a no-op where a GPU is visible; gloo here).
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    try:
        return run_local_workers(_worker, 2, threads=1)
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden


def test_diloco_sync_is_the_mean_of_the_replicas(results):
    r0, r1 = results
    assert r0["diloco_outer_steps"] == r1["diloco_outer_steps"] == 1
    assert "inner" in r0["diloco_state_keys"]
    # Megatron DDP's gradient all-reduce is off: after the first step the replicas differ.
    first0, first1 = r0["diloco_inner"][0], r1["diloco_inner"][0]
    assert any(not torch.allclose(a, b) for a, b in zip(first0, first1))
    before0, before1 = r0["diloco_inner"][1], r1["diloco_inner"][1]
    for a, b, f0, f1 in zip(before0, before1, r0["diloco_final"], r1["diloco_final"]):
        torch.testing.assert_close(f0, (a + b) / 2, rtol=0, atol=1e-6)
        torch.testing.assert_close(f0, f1, rtol=0, atol=0)


def test_sparseloco_loss_falls(results):
    for r in results:
        assert r["sparseloco_outer_steps"] == 2
        losses = r["sparseloco_losses"]
        assert sum(losses[-2:]) / 2 < 0.85 * sum(losses[:2]) / 2, losses


def test_lowcomm_args():
    parser = add_lowcomm_args(argparse.ArgumentParser())
    cfg = lowcomm_config(parser.parse_args(["--lowcomm-method", "diloco", "--lowcomm-sync-every", "5"]))
    assert cfg.method == "diloco" and cfg.sync_every == 5
    assert cfg.outer_lr == 0.7 and cfg.outer_momentum == 0.9  # the method's own defaults for the rest
    assert lowcomm_config(parser.parse_args([])) is None
    cfg = lowcomm_config(parser.parse_args(["--lowcomm-method", "sparseloco", "--lowcomm-topk", "8",
                                            "--lowcomm-value-dtype", "fp32"]))
    assert (cfg.topk, cfg.value_dtype) == (8, "fp32")
    with pytest.raises(ConfigError, match=r"lowcomm\.sync_every"):
        lowcomm_config(parser.parse_args(["--lowcomm-method", "diloco", "--lowcomm-sync-every", "0"]))
    with pytest.raises(ConfigError, match=r"lowcomm\.sync_every"):
        lowcomm_config(parser.parse_args(["--lowcomm-method", "diloco", "--lowcomm-sync-every", "five"]))
    with pytest.raises(ConfigError, match=r"lowcomm\.method"):
        lowcomm_config(parser.parse_args(["--lowcomm-method", "dilocoo"]))


def test_activation_args():
    parser = add_lowcomm_args(argparse.ArgumentParser())
    acts = activation_settings(parser.parse_args(["--lowcomm-activations-forward", "lowrank",
                                                  "--lowcomm-activations-rank", "8"]))
    assert (acts.forward, acts.backward, acts.rank) == ("lowrank", "none", 8)
    assert activation_settings(parser.parse_args(["--lowcomm-method", "demo"])) is None
    with pytest.raises(ConfigError, match=r"lowcomm\.activations\.forward.*int8"):
        activation_settings(parser.parse_args(["--lowcomm-activations-forward", "int3"]))


def test_lowcomm_config_file(tmp_path):
    path = tmp_path / "lowcomm.json"
    path.write_text('{"lowcomm": {"method": "dct_diloco", "sync_every": 7, "topk": 4, '
                    '"activations": {"forward": "int8"}}}')
    parser = add_lowcomm_args(argparse.ArgumentParser())
    args = parser.parse_args(["--lowcomm-config", str(path), "--lowcomm-topk", "6"])
    cfg = lowcomm_config(args)
    assert (cfg.method, cfg.sync_every, cfg.topk) == ("dct_diloco", 7, 6)
    assert activation_settings(args).forward == "int8"  # the nested mapping, as in a DeepSpeed config


def test_pretrain_gpt_pipeline_with_diloco(tmp_path):
    """launch/pretrain_gpt.py under torchrun: 2 pipeline stages (1F1B over gloo) with the outer loop."""
    root = Path(__file__).resolve().parents[1]
    metrics = tmp_path / "m.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(root / "launch" / "pretrain_gpt.py"), "--pipeline-model-parallel-size", "2", "--train-iters", "8",
           "--global-batch-size", "8", "--seq-length", "32", "--metrics-out", str(metrics),
           "--lowcomm-method", "diloco", "--lowcomm-sync-every", "4", "--lowcomm-outer-momentum", "0",
           "--lowcomm-outer-lr", "1"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = json.loads(metrics.read_text())
    assert (out["pp"], out["dp"], out["outer_steps"]) == (2, 1, 2)
    assert out["lowcomm"]["method"] == "diloco" and out["lowcomm"]["sync_every"] == 4
    losses = out["train_loss"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.5, losses
    assert out["val_loss"] < losses[0]
