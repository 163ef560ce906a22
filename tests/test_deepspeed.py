"""Every method through real DeepSpeed engines (ZeRO 0/1/2, replicas, bf16), real processes, gloo."""

import glob
import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_lowcomm.config import ConfigError
from ds_lowcomm.deepspeed.config import split_config
from lowcomm_task.spec import TrainSpec
from lowcomm_task.train import train_worker
from lowcomm_task.workers import run_local_workers

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("DS_ACCELERATOR", "cpu")

TINY_ARGS = ["--steps", "6", "--eval-every", "3", "--warmup", "2", "--n-layer", "1", "--n-embd", "32",
             "--n-head", "2", "--seq-len", "32", "--max-train-bytes", "200000"]
LOWCOMM = {
    "adamw": {"method": "adamw"},
    "demo": {"method": "demo", "topk": 4, "chunk": 16, "decay": 0.9, "value_dtype": "int8"},
    "diloco": {"method": "diloco", "sync_every": 3},
    "dct_diloco": {"method": "dct_diloco", "sync_every": 3, "topk": 32, "chunk": 16, "value_dtype": "bf16",
                   "average": "world"},
    "sparseloco": {"method": "sparseloco", "sync_every": 3, "topk": 16, "chunk": 16},
    "mtdao": {"method": "mtdao", "sync_every": 3},
    # the sync of step 3 lands at 5 with the steps between carried: the save at step 4 holds it in
    # flight (its result and each replica's copy at the send, through ZeRO's partitions too)
    "dct_diloco_carry": {"method": "dct_diloco", "sync_every": 3, "sync_delay": 2, "carry_local_steps": True,
                         "topk": 32, "chunk": 16, "value_dtype": "bf16", "average": "world"},
}
CARRIED = {"dct_diloco_carry"}  # replicas keep their own steps since the send: never equal at the end
# Streaming syncs cut the model into parameter fragments: ZeRO 0 only (ZeRO 1/2 hand one flat partition).
ZERO0_ONLY = {"diloco_streaming": {"method": "diloco", "sync_every": 3, "fragments": 3, "sync_delay": 1},
              "demo_muon": {"method": "demo", "topk": 4, "chunk": 8, "update": "muon"},  # embeddings by sign both ways
              # the authors' recipe: its warm start's gradient mean, the switch, lr x4, its own beta2
              "mtdao_recipe": {"method": "mtdao", "sync_every": 3, "momentum_betas": [0.999], "momentum_weights": [0.98],
                               "beta2": 0.999, "switch_step": 2, "switch_lr_scale": 4.0},
              # whole weight matrices too: Dion's factors, and MuLoCo's inner Muon (groups from model_param_groups)
              "dion": {"method": "dion", "rank_fraction": 0.5, "matrix_lr": 0.02},
              "muloco": {"method": "diloco", "sync_every": 3, "inner_optimizer": "muon"}}


def ds_config(method, stage=0, replica_size=1, **extra):
    return {
        "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
        "steps_per_print": 10**6,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.0}},
        "zero_optimization": {"stage": stage},
        "lowcomm": {**{**LOWCOMM, **ZERO0_ONLY}[method], "replica_size": replica_size}, **extra,
    }


def _run(cfg, workdir, name, *more):
    from lowcomm_task.deepspeed_main import parser, run, spec_from_args

    path = Path(workdir) / f"{name}.json"
    if torch.distributed.get_rank() == 0:
        path.write_text(json.dumps(cfg))
    torch.distributed.barrier()
    return run(spec_from_args(parser().parse_args(["--deepspeed_config", str(path), *TINY_ARGS, *more])))


def _stage_worker(rank, world, stage, workdir):
    out = {}
    for method in LOWCOMM:
        # A run without checkpoints: DeepSpeed's save_checkpoint issues collectives of its own
        # (tag validation), which would blur the count of its gradient reduction.
        m = _run(ds_config(method, stage), workdir, f"{method}{stage}")
        # resume: the full run saves at step 4, inside an outer interval (diloco/dct_diloco have H=3)
        save = os.path.join(workdir, f"ckpt_{method}{stage}")
        full = _run(ds_config(method, stage), workdir, f"{method}{stage}", "--save-dir", save, "--save-at", "4")
        resumed = _run(ds_config(method, stage), workdir, f"{method}{stage}", "--save-dir", save, "--resume")
        out[method] = {"metrics": m, "full_digest": full["params_digests"], "resumed_digest": resumed["params_digests"],
                       "full_bytes": full["cross_replica_bytes_sent_per_worker"],
                       "resumed_bytes": resumed["cross_replica_bytes_sent_per_worker"]}
    return out


def _two_rank_worker(rank, world, workdir):
    """One launch of 2 processes for the 2-rank training tests below (a launch costs seconds);
    each run writes its own config and checkpoint names."""
    out = {("stage", stage): _stage_worker(rank, world, stage, workdir) for stage in (0, 1, 2)}
    out["foundation"] = _foundation_match_worker(rank, world, workdir)
    out["bf16"] = _bf16_worker(rank, world, workdir)
    return out


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return run_local_workers(_two_rank_worker, 2, str(tmp_path_factory.mktemp("two_ranks")))


def _four_rank_worker(rank, world, workdir):
    """One launch of 4 processes for the replica tests at every ZeRO stage."""
    return {stage: _replica_worker(rank, world, stage, workdir) for stage in (0, 1, 2)}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    return run_local_workers(_four_rank_worker, 4, str(tmp_path_factory.mktemp("four_ranks")))


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_every_method_at_every_zero_stage(stage, two_ranks):
    results = two_ranks[0][("stage", stage)]
    for method, r in results.items():
        m = r["metrics"]
        hist = m["history"]
        assert hist[-1]["train_loss"] < hist[0]["train_loss"], f"{method}: loss did not fall"
        assert hist[-1]["val_loss"] < math.log(256), method
        # 6 steps = 2 outer intervals: every method promises identical replicas here (but one whose
        # last sync is in flight, the replicas' own steps carried)
        assert len(set(m["params_digests"])) == (2 if method in CARRIED else 1), method
        assert m["ledgers"][0]["method"]["steps"] == 6, method  # one ledger step per engine step
        # The engine's own gradient reduction moved no byte between the two replicas.
        engine = m["engine_ops_during_training"]
        assert all(row[1] == 0 for row in engine.values()), (method, engine)
        if stage == 0:
            assert "deepspeed.all_reduce" not in engine, (method, engine)  # not even called
        # resume is exact: parameters and the method's byte count
        assert r["full_digest"] == r["resumed_digest"], method
        assert r["full_bytes"] == r["resumed_bytes"], method
    # bytes: compressed methods send less than their dense counterparts, measured by the ledger
    b = {k: v["metrics"]["cross_replica_bytes_sent_per_worker"] for k, v in results.items()}
    assert b["demo"] < b["adamw"] / 5 and b["dct_diloco"] < b["diloco"] / 5 and b["diloco"] < b["adamw"]
    assert b["sparseloco"] < b["diloco"] / 10


def _training_bytes(ledger_summary):
    """Bytes sent by the method's collectives (the start-up settings check left out)."""
    return sum(row["sent"] for op, row in ledger_summary["by_op"].items() if op != "setup")


def _foundation_match_worker(rank, world, workdir):
    """ZeRO 0, fp32, one rank per replica: DeepSpeed path == plain torch.distributed path."""
    out = {}
    for method, lowcomm in {**LOWCOMM, **ZERO0_ONLY}.items():
        ds = _run(ds_config(method, 0), workdir, method)
        spec = TrainSpec(lowcomm=lowcomm, lr=3e-3, betas=(0.9, 0.95), steps=6, batch=4, warmup=2, eval_every=3, seed=0,
                         model={"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32}, max_train_bytes=200000,
                         verbose=False)
        plain = train_worker(rank, world, spec)
        out[method] = (ds["params_digests"][rank], plain["params_digest"],
                       _training_bytes(ds["ledgers"][rank]["method"]), _training_bytes(plain["ledger"]))
    # DeepSpeed's gradient_clipping with mtdao's local steps: DeepSpeed clips each replica's gradient
    # before the method's step, as the plain loop's clip_grad does (DeepSpeed's norm rounds otherwise)
    ds = _run(ds_config("mtdao", 0, gradient_clipping=0.05), workdir, "mtdao_clipped")
    plain = train_worker(rank, world, TrainSpec(lowcomm=LOWCOMM["mtdao"], lr=3e-3, betas=(0.9, 0.95), steps=6, batch=4,
                                                warmup=2, eval_every=3, seed=0, clip_grad=0.05, max_train_bytes=200000,
                                                model={"n_layer": 1, "n_embd": 32, "n_head": 2, "seq_len": 32},
                                                verbose=False))
    out["clipped"] = (ds["final_val_loss"], plain["final_val_loss"])
    return out


def test_deepspeed_path_matches_plain_torch_distributed(two_ranks):
    for rank_result in (r["foundation"] for r in two_ranks):
        clipped = rank_result.pop("clipped")
        for method, (ds_digest, plain_digest, ds_bytes, plain_bytes) in rank_result.items():
            assert ds_digest == plain_digest, method
            assert ds_bytes == plain_bytes > 0, method
    # DeepSpeed's gradient_clipping is honoured with mtdao: the plain loop's clip_grad's loss, not the unclipped one's
    ds_loss, plain_loss = clipped
    unclipped = two_ranks[0][("stage", 0)]["mtdao"]["metrics"]["final_val_loss"]
    assert ds_loss == pytest.approx(plain_loss, rel=1e-5)
    assert abs(ds_loss - unclipped) > 100 * abs(ds_loss - plain_loss) and abs(ds_loss - unclipped) > 1e-3


def _replica_worker(rank, world, stage, workdir):
    out = {}
    for method in ("demo", "dct_diloco", "adamw"):
        out[method] = _run(ds_config(method, stage, replica_size=2), workdir, f"r{method}{stage}")
    single = _run(ds_config("demo", stage, replica_size=1), workdir, f"s{stage}")
    return out, single


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_replicas_of_two_ranks_with_zero_inside(stage, four_ranks):
    replicas, single = four_ranks[0][stage]
    for method, m in replicas.items():
        assert m["world_size"] == 4 and m["replica_size"] == 2
        assert len(set(m["params_digests"])) == 1, method  # all four ranks agree after 2 syncs
        assert m["history"][-1]["train_loss"] < m["history"][0]["train_loss"], method
        # DeepSpeed reduced gradients inside each replica: real bytes on the engine's ledger
        assert m["engine_bytes_sent_per_worker"] > 0, method
    # Each rank sends only its share across replicas: about half of what a whole-model sync sends
    # (ZeRO 1/2: its partition; ZeRO 0: the parameters it owns, balanced by size).
    for r in range(4):
        share = _training_bytes(replicas["demo"]["ledgers"][r]["method"]) / _training_bytes(single["ledgers"][r]["method"])
        assert (0.45 < share < 0.55) if stage else (0.3 < share < 0.7), (r, share)


def _bf16_worker(rank, world, workdir):
    out = {}
    for method in ("demo", "diloco", "dct_diloco"):
        m = _run(ds_config(method, 0, bf16={"enabled": True}), workdir, f"bf16{method}")
        out[method] = m
    return out


def test_bf16_engines(two_ranks):
    for method, m in two_ranks[0]["bf16"].items():
        assert len(set(m["params_digests"])) == 1, method
        assert m["history"][-1]["train_loss"] < m["history"][0]["train_loss"], method
        steps = m["ledgers"][0]["method"]["steps"]
        assert steps == 6, (method, steps)  # DeepSpeed's placeholder step at construction is not a step


# --- configuration errors --------------------------------------------------------------------

@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda c: c["lowcomm"].update(topk=10**6), r"lowcomm.topk must be an integer in \[1, 256\]"),
        (lambda c: c["optimizer"].update(type="SGD"), "optimizer.type must be one of Adam, AdamW"),
        (lambda c: c.update(zero_optimization={"stage": 4}), "zero_optimization.stage must be 0, 1, 2 or 3"),
        (lambda c: c.update(zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}}),
         "zero_optimization.offload_optimizer.device must be none"),
        (lambda c: c.pop("optimizer"), "optimizer: a section"),
        (lambda c: c["lowcomm"].update(activations={"forward": "fp8"}), "lowcomm.activations.forward must be one of"),
        (lambda c: c["lowcomm"].update(activations={"fwd": "int8"}), r"lowcomm.activations: unknown setting\(s\) fwd"),
        (lambda c: c["optimizer"]["params"].update(lr=-1), "optimizer.params.lr must be a number > 0"),
        (lambda c: c["lowcomm"].update(method="powersgd"), "lowcomm.method must be one of"),
        (lambda c: (c.update(lowcomm={"method": "diloco", "sync_every": 4, "fragments": 2}),
                    c.update(zero_optimization={"stage": 1})),
         "lowcomm.fragments must be 1 with zero_optimization.stage 1"),
        (lambda c: c["optimizer"]["params"].update(adam_w_mode=False), "optimizer.params.adam_w_mode must be true"),
        (lambda c: c["optimizer"]["params"].update(amsgrad=True), "optimizer.params.amsgrad must be false"),
        (lambda c: c["optimizer"]["params"].update(fused=True),
         r"optimizer.params: unknown key\(s\) fused with lowcomm; allowed: lr, betas, eps, weight_decay, adam_w_mode"),
        (lambda c: c["optimizer"]["params"].update(betas=[0.9, 1.5]), r"optimizer.params.betas\[\] must be a number in"),
        (lambda c: c.update(zero_optimization={"stage": 1}, bf16={"enabled": True}, data_types={"grad_accum_dtype": "fp32"}),
         "data_types.grad_accum_dtype must not be fp32 with bf16 at zero_optimization.stage 1"),
        # (update muon at ZeRO 1-3 and in bf16 runs now: tests/test_deepspeed_muon.py)
        (lambda c: c.update(optimizer={"type": "Lion", "params": {"lr": 1e-3}}),
         "optimizer.type must be one of Adam, AdamW, Muon with lowcomm; got 'Lion'"),
        # (inner_optimizer muon at ZeRO 1-3 and in bf16 runs now: tests/test_deepspeed_muon.py)
        (lambda c: (c.update(lowcomm={"method": "sparseloco", "inner_optimizer": "muon", "replicas": [
            {"ranks": 1}, {"ranks": 2}]}), c.update(zero_optimization={"stage": 1})),
         r"lowcomm.replicas \(replicas of different shapes\): not with lowcomm.inner_optimizer muon at "
         "zero_optimization.stage 1"),
        (lambda c: (c.update(lowcomm={"method": "dion"}), c.update(zero_optimization={"stage": 3})),
         "lowcomm.method dion needs zero_optimization.stage 0 in fp32 .* got stage 3"),
    ],
)
def test_config_errors(mutate, message):
    """Bad sections are refused naming the field; DeepSpeed's Adam switches are honoured or refused."""
    cfg = ds_config("demo")
    mutate(cfg)
    with pytest.raises(ConfigError, match=message):
        split_config(cfg)


def test_adam_switches_that_match_are_honoured():
    cfg = ds_config("demo")
    cfg["optimizer"]["params"].update(adam_w_mode=True, bias_correction=True, amsgrad=False, torch_adam=False)
    assert split_config(cfg).optimizer == split_config(ds_config("demo")).optimizer


def _mismatch_worker(rank, world, workdir):
    cfg = ds_config("demo")
    if rank == 1:
        cfg["lowcomm"]["topk"] = 2
    from ds_lowcomm.deepspeed import initialize
    from lowcomm_task.model import GPT, GPTConfig

    torch.manual_seed(0)
    initialize(model=GPT(GPTConfig(n_layer=1, n_embd=32, n_head=2, seq_len=32)), config=cfg)


def test_mismatched_settings_across_ranks_are_refused(tmp_path):
    with pytest.raises(RuntimeError, match="lowcomm.topk: rank 0 has 4, rank 1 has 2"):
        run_local_workers(_mismatch_worker, 2, str(tmp_path))


def _wrong_resume_worker(rank, world, workdir):
    save = os.path.join(workdir, "ckpt")
    _run(ds_config("demo"), workdir, "a", "--save-dir", save, "--save-at", "3")
    _run(ds_config("dct_diloco"), workdir, "b", "--save-dir", save, "--resume")


def test_resume_with_another_method_is_refused(tmp_path):
    with pytest.raises(RuntimeError, match="method: saved 'demo', now 'dct_diloco'"):
        run_local_workers(_wrong_resume_worker, 2, str(tmp_path))


def _save_worker(rank, world, workdir):
    _run(ds_config("diloco"), workdir, "a", "--save-dir", os.path.join(workdir, "ckpt"), "--save-at", "3")


def _resume_worker(rank, world, workdir):
    _run(ds_config("diloco"), workdir, "a", "--save-dir", os.path.join(workdir, "ckpt"), "--resume")


def test_resume_with_another_world_size_is_refused(tmp_path):
    run_local_workers(_save_worker, 2, str(tmp_path))
    with pytest.raises(RuntimeError, match="world_size: saved 2, now 4"):
        run_local_workers(_resume_worker, 4, str(tmp_path))


# --- the three launchers start launch/train.py ----------------------------------------------------

def _launch(cmd, tmp_path, config):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(config))
    metrics = tmp_path / "metrics.json"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    proc = subprocess.run([*cmd, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(cfg), *TINY_ARGS,
                           "--metrics-out", str(metrics)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=400)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    m = json.loads(metrics.read_text())
    assert m["world_size"] == 2 and m["steps"] == 6
    assert math.isfinite(m["final_val_loss"]) and m["bytes_sent_per_worker"] > 0
    assert len(set(m["params_digests"])) == 1
    return m


def test_user_script_under_the_deepspeed_launcher(tmp_path):
    """examples/deepspeed_user.py, a plain DeepSpeed script but for the import and the config's
    lowcomm section, under the deepspeed launcher at ZeRO 3 (launch/train.py runs under torchrun
    and mpirun below)."""
    config = json.loads((ROOT / "examples" / "deepspeed_user.json").read_text())
    config["zero_optimization"] = {"stage": 3}
    (tmp_path / "cfg.json").write_text(json.dumps(config))
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run([str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", "29533",
                           str(ROOT / "examples" / "deepspeed_user.py"), "--deepspeed_config", "cfg.json",
                           "--steps", "20", "--out", "report.json"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    # DeepSpeed's CPU shared-memory buffers (69 MB a rank) are unlinked once mapped, not left in RAM
    assert not glob.glob("/dev/shm/deepspeed_allreduce_buffer_*_29533_*")
    r = json.loads((tmp_path / "report.json").read_text())
    assert not set(r["first_batches"][0]) & set(r["first_batches"][1])  # every rank its own shard
    assert r["train_batch_size"] == 32  # micro 8 x accumulation 2 x 2 ranks, as in plain DeepSpeed
    assert sum(r["losses"][-5:]) < sum(r["losses"][:5])
    assert r["resumed_at"] == 10 and r["client_losses"] == r["losses"][:10]  # client_state comes back
    assert r["compression_vs_allreduce"] > 10  # demo's payload against a dense fp32 all-reduce


def test_torchrun(tmp_path):
    bindir = Path(sys.executable).parent
    _launch([str(bindir / "torchrun"), "--nproc_per_node", "2", "--master_port", "29534"], tmp_path,
            ds_config("diloco", 1))


@pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (launch/env.sh installs it)")
def test_mpirun(tmp_path):
    _launch(["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", "-x", "MASTER_PORT=29535",
             sys.executable], tmp_path, ds_config("dct_diloco", 2))
