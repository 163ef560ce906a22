"""ds_lowcomm checkpoints seen by DeepSpeed's own tools: `latest`, zero_to_fp32, warm starts both ways.

One 2-rank run (real processes, gloo) does all the work (each start costs seconds); the tests
read its results. Method: diloco with H=3 saved after 4 steps, inside an outer interval, so
the two replicas hold different parameters and the export is provably replica 0's.
"""

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest
import torch

from ds_lowcomm.checkpoint_io import CheckpointError, atomic_write, save_file
from lowcomm_task.workers import run_local_workers
from tests.test_deepspeed import ds_config

os.environ.setdefault("DS_ACCELERATOR", "cpu")
STAGES = (0, 1, 2)
TAG = "step4"


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 3)
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, x):
        return (self.b(torch.relu(self.a(x))) * self.scale).pow(2).mean()


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(4, 8, generator=g)


def _train(engine, rank, steps):
    for s in range(steps):
        loss = engine(_batch(rank, s))
        engine.backward(loss)
        engine.step()


def _state(engine):
    return {k: v.detach().clone() for k, v in engine.module.state_dict().items()}


def _plain_config(stage):
    cfg = ds_config("adamw", stage)
    cfg.pop("lowcomm")
    cfg["optimizer"]["params"]["torch_adam"] = True  # no FusedAdam build on CPU
    return cfg


def _worker(rank, world, workdir):
    import deepspeed
    import torch.distributed as dist

    import ds_lowcomm.deepspeed

    out = {}
    for stage in STAGES:
        r = out[stage] = {}
        # 1. a ds_lowcomm checkpoint: diloco, saved inside an outer interval
        torch.manual_seed(0)
        engine, *_ = ds_lowcomm.deepspeed.initialize(model=Tiny(), config=ds_config("diloco", stage))
        _train(engine, rank, 4)
        lowcomm_dir = os.path.join(workdir, f"lowcomm{stage}")
        engine.save_checkpoint(lowcomm_dir, tag=TAG)
        r["saved"] = _state(engine)
        # 2. ... loads into a plain DeepSpeed engine, module only
        torch.manual_seed(1)
        # DeepSpeed keeps the last engine's mpu in a process global (deepspeed.utils.groups.mpu):
        # a plain engine built after a ds_lowcomm one in the same process would take its
        # one-rank data-parallel group. One engine per process has no such issue; here, forget it.
        deepspeed.utils.groups.mpu = None
        plain, *_ = deepspeed.initialize(model=(m := Tiny()), config=_plain_config(stage),
                                         model_parameters=m.parameters())
        path, _ = plain.load_checkpoint(lowcomm_dir, load_module_only=True)
        r["plain_path"] = path
        r["plain_loaded"] = _state(plain)
        # 3. a plain DeepSpeed checkpoint warm-starts a ds_lowcomm engine (module; method state fresh)
        _train(plain, rank, 2)
        plain_dir = os.path.join(workdir, f"plain{stage}")
        plain.save_checkpoint(plain_dir)
        r["plain_saved"] = _state(plain)
        torch.manual_seed(2)
        warm, *_ = ds_lowcomm.deepspeed.initialize(model=Tiny(), config=ds_config("diloco", stage))
        warm.load_checkpoint(plain_dir)
        r["warm_loaded"] = _state(warm)
        inner = warm.lowcomm.optimizer.inner
        r["warm_moments"] = [inner.state[p]["exp_avg"].clone() for g in inner.param_groups for p in g["params"]
                             if p in inner.state]
        if stage == 0:  # plain ZeRO 0 keeps torch AdamW's state whole: it maps onto diloco's inner AdamW
            r["plain_moments"] = [plain.optimizer.state[p]["exp_avg"].clone()
                                  for g in plain.optimizer.param_groups for p in g["params"]]
            module_only, *_ = ds_lowcomm.deepspeed.initialize(model=Tiny(), config=ds_config("diloco", stage))
            module_only.load_checkpoint(plain_dir, load_module_only=True)
            r["module_only_moments"] = len(module_only.lowcomm.optimizer.inner.state)
            r["module_only_loaded"] = _state(module_only)
        _train(warm, rank, 3)  # trains from there: one outer step, replicas agree after it
        r["warm_trained"] = _state(warm)
        # 4. exact resume still works (same run, same data after step 4)
        torch.manual_seed(3)
        again, *_ = ds_lowcomm.deepspeed.initialize(model=Tiny(), config=ds_config("diloco", stage))
        again.load_checkpoint(lowcomm_dir)
        r["resumed"] = _state(again)
        # 5. a crash mid-save (the first file of step 6 dies half-written on every rank): the
        # error comes out, nothing of step 6 is named, and the latest (step 4) still loads exactly
        _train(again, rank, 2)
        again.checkpoint_engine.save = _crashing_save
        try:
            again.save_checkpoint(lowcomm_dir, tag="step6")
        except RuntimeError as err:
            r["crash"] = str(err)
        crashed, *_ = ds_lowcomm.deepspeed.initialize(model=Tiny(), config=ds_config("diloco", stage))
        crashed.load_checkpoint(lowcomm_dir)
        r["after_crash"] = _state(crashed)
        r["tmp_left"] = [n for _, _, files in os.walk(lowcomm_dir) for n in files if ".tmp" in n]
        # 6. a flipped byte in replica 1's files, 7. a pickled call in them (with a digest that
        # matches): refused on every rank, nothing run
        for probe in ("flipped", "malicious"):
            bad_dir = os.path.join(workdir, f"{probe}{stage}")
            if rank == 0:
                shutil.copytree(lowcomm_dir, bad_dir)
                victim = os.path.join(bad_dir, "replica00001", TAG, "mp_rank_00_model_states.pt")
                if probe == "flipped":
                    with open(victim, "r+b") as f:
                        f.seek(os.path.getsize(victim) // 2)
                        byte = f.read(1)
                        f.seek(-1, 1)
                        f.write(bytes([byte[0] ^ 0xFF]))
                else:
                    save_file(_Evil(os.path.join(workdir, "pwned")), victim)  # a valid digest of evil bytes
            dist.barrier()
            victim_engine, *_ = ds_lowcomm.deepspeed.initialize(model=Tiny(), config=ds_config("diloco", stage))
            try:
                victim_engine.load_checkpoint(bad_dir)
                r[probe] = None
            except CheckpointError as err:
                r[probe] = str(err)
        r["pwned"] = os.path.exists(os.path.join(workdir, "pwned"))
    dist.barrier()
    return out


class _Evil:
    """Unpickling it would run a shell command (what a weights_only=False load does)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crashing_save(state_dict, path):
    def write(f):
        f.write(b"half a checkpoint")
        raise RuntimeError(f"simulated crash while writing {os.path.basename(path)}")

    atomic_write(path, write)


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ckpt")
    return workdir, run_local_workers(_worker, 2, str(workdir))


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _params(state):
    return {k: v for k, v in state.items() if k != "scale"}


def test_latest_files_and_layout(run):
    workdir, _ = run
    for stage in STAGES:
        d = workdir / f"lowcomm{stage}"
        for latest in (d / "latest", d / "replica00000" / "latest", d / "replica00001" / "latest"):
            assert latest.read_text().strip() == TAG, latest
        assert (d / "lowcomm.json").exists() and (d / "zero_to_fp32.py").exists()
        assert (d / TAG / "mp_rank_00_model_states.pt").exists()
        assert list((d / TAG).glob("*_optim_states.pt")), stage
        assert not [p for p in d.iterdir() if p.name.startswith(".")], stage  # no temporary left


def test_replicas_differ_in_the_local_phase(run):
    _, results = run
    for stage in STAGES:  # so that the export below is provably replica 0's
        assert not _equal(_params(results[0][stage]["saved"]), _params(results[1][stage]["saved"])), stage


def test_zero_to_fp32_function_gives_replica_0(run):
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    workdir, results = run
    for stage in STAGES:
        sd = get_fp32_state_dict_from_zero_checkpoint(str(workdir / f"lowcomm{stage}"))
        assert _equal(dict(sd), results[0][stage]["saved"]), stage


def test_zero_to_fp32_script_gives_replica_0(run, tmp_path):
    """The script DeepSpeed copies, run by the venv's python. Its command line defaults to
    sharded output, which imports huggingface_hub; where that is not installed the same copied
    file is imported and its converter called with max_shard_size=None."""
    workdir, results = run
    has_hub = importlib.util.find_spec("huggingface_hub") is not None
    for stage in STAGES:
        d = workdir / f"lowcomm{stage}"
        out = tmp_path / f"out{stage}"
        if has_hub:
            cmd = [sys.executable, str(d / "zero_to_fp32.py"), str(d), str(out)]
        else:
            code = ("import importlib.util, sys; s = importlib.util.spec_from_file_location('z', sys.argv[1]); "
                    "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
                    "m.convert_zero_checkpoint_to_fp32_state_dict(sys.argv[2], sys.argv[3], max_shard_size=None)")
            cmd = [sys.executable, "-c", code, str(d / "zero_to_fp32.py"), str(d), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                              env={**os.environ, "DS_ACCELERATOR": "cpu"})
        assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
        sd = torch.load(out / "pytorch_model.bin", weights_only=True)
        assert _equal(sd, results[0][stage]["saved"]), stage


def test_plain_deepspeed_loads_a_lowcomm_checkpoint_module_only(run):
    workdir, results = run
    for stage in STAGES:
        for rank in (0, 1):
            r = results[rank][stage]
            assert r["plain_path"] is not None, stage
            assert _equal(r["plain_loaded"], results[0][stage]["saved"]), (stage, rank)


def test_warm_start_from_a_plain_deepspeed_checkpoint(run):
    _, results = run
    for stage in STAGES:
        assert _equal(results[0][stage]["plain_saved"], results[1][stage]["plain_saved"]), stage  # one model
        for rank in (0, 1):
            r = results[rank][stage]
            assert _equal(r["warm_loaded"], results[0][stage]["plain_saved"]), (stage, rank)
            assert not _equal(r["warm_trained"], r["warm_loaded"]), (stage, rank)
        if stage == 0:  # Adam's moments mapped onto the inner AdamW; not with load_module_only
            for rank in (0, 1):
                r = results[rank][stage]
                assert len(r["warm_moments"]) == 4 and all(
                    torch.equal(a, b) for a, b in zip(r["warm_moments"], r["plain_moments"])), rank
                assert r["module_only_moments"] == 0 and _equal(r["module_only_loaded"], r["warm_loaded"]), rank
        else:  # ZeRO 1/2: partitioned moments do not map; the method starts fresh
            assert results[0][stage]["warm_moments"] == [], stage
        # 3 steps = one outer step of diloco (H=3): replicas agree again
        assert _equal(results[0][stage]["warm_trained"], results[1][stage]["warm_trained"]), stage


def test_exact_resume_still_loads_each_replica(run):
    _, results = run
    for stage in STAGES:
        for rank in (0, 1):
            assert _equal(results[rank][stage]["resumed"], results[rank][stage]["saved"]), (stage, rank)


def test_a_crash_mid_save_leaves_the_previous_checkpoint_latest(run):
    """Issue 15: the save of step 6 dies in its first file on every rank; the error comes out,
    no temporary file is left, ``latest`` still names step 4 and loads it exactly."""
    workdir, results = run
    for stage in STAGES:
        assert (workdir / f"lowcomm{stage}" / "latest").read_text().strip() == TAG
        for rank in (0, 1):
            r = results[rank][stage]
            assert "simulated crash" in r["crash"], r["crash"]
            assert r["tmp_left"] == [], r["tmp_left"]
            assert _equal(r["after_crash"], r["saved"]), (stage, rank)


def test_flipped_bytes_and_pickled_code_are_refused_on_every_rank(run):
    """Issue 15: one flipped byte in replica 1's model file fails its sha256 on every rank (the
    replica 0 ranks too, before any rank loads); a pickled ``os.system`` with a matching digest is
    refused by the weights_only load, naming the global, and never runs."""
    workdir, results = run
    for stage in STAGES:
        for rank in (0, 1):
            r = results[rank][stage]
            assert r["flipped"] is not None and "sha256 differs" in r["flipped"], (stage, rank, r["flipped"])
            assert "replica00001" in r["flipped"]
            assert r["malicious"] is not None and ("os.system" in r["malicious"] or "posix.system" in r["malicious"]), \
                (stage, rank, r["malicious"])
            assert not r["pwned"]
    assert not (workdir / "pwned").exists()
