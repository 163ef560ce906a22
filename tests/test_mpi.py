"""The MPI transport under a real mpirun (2 and 4 ranks) against the torch.distributed transport on
the same inputs, and launch/train.py with "transport": "mpi"."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = [
    pytest.mark.skipif(shutil.which("mpirun") is None, reason="mpirun not installed (launch/env.sh installs it)"),
    pytest.mark.skipif(__import__("importlib").util.find_spec("mpi4py") is None,
                       reason="mpi4py not installed (pip install 'ds_lowcomm[mpi]')"),
]
ALL_GATHER_ONLY = {"demo", "dct_diloco", "sparseloco", "dct_diloco_streaming"}
ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1",
       "DS_ACCELERATOR": "cpu"}


def _mpirun(n, port, *argv, cwd=None):
    env = {**os.environ, **ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(n), "-x", f"MASTER_PORT={port}",
           sys.executable, *argv]
    proc = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-4000:])
    return proc


@pytest.mark.parametrize("ranks", [2, 4])
def test_mpi_transport_equals_torch_transport(ranks, tmp_path):
    check_mpi_equals_torch(ranks, tmp_path, "cpu")


def check_mpi_equals_torch(ranks, tmp_path, device):
    _mpirun(ranks, 29540 + ranks, str(ROOT / "tests" / "mpi_worker.py"), str(tmp_path), device)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    for r in results:
        assert r["world"] == ranks and r["mpi_rank"] == r["rank"]
        # sparse all-gather: same bits, same residuals (error feedback), same ledger
        for case, checks in r["sparse"].items():
            assert all(checks.values()), (case, checks)
        assert r["non_blocking"]
        assert r["broadcasts"]
        # dense all-reduce: each library sums in its own order; with 2 ranks a + b is a + b
        if ranks == 2:
            assert r["dense"]["bit_identical"], r["dense"]
        assert r["dense"]["max_abs_diff"] < 1e-2  # bf16 rounding at most; fp32 to the last bits
        # whole trainings (8 steps of every method): the same bytes; methods that only all-gather
        # (the sparse ones) give the same parameters bit for bit; those with a dense all-reduce
        # (adamw, diloco, mtdao's second moment) to float rounding: at 4 ranks each library sums in
        # its own order, and even at 2 ranks one mtdao run in several differed by 3e-8.
        for method, checks in r["train"].items():
            assert checks["bytes_equal"], method
            if method in ALL_GATHER_ONLY:
                assert checks["bit_identical"], (method, checks)
            assert checks["max_abs_diff"] < 1e-6, (method, checks)


def _launch(tmp_path, name, ranks, port, lowcomm_overrides, *more):
    cfg = json.loads((ROOT / "configs" / "dct_diloco.json").read_text())
    cfg["lowcomm"].update(sync_every=3, **lowcomm_overrides)
    cfg["train_micro_batch_size_per_gpu"] = 4
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(cfg))
    metrics = tmp_path / f"{name}.metrics.json"
    _mpirun(ranks, port, str(ROOT / "launch" / "train.py"), "--deepspeed_config", str(path), "--steps", "6",
            "--eval-every", "3", "--warmup", "2", "--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "32",
            "--max-train-bytes", "200000", "--metrics-out", str(metrics), *more, cwd=tmp_path)
    return json.loads(metrics.read_text())


def test_deepspeed_training_over_mpi_equals_torch_distributed(tmp_path):
    over_mpi = _launch(tmp_path, "mpi", 2, 29550, {"transport": "mpi"})
    over_torch = _launch(tmp_path, "torch", 2, 29551, {"transport": "torch"})
    assert over_mpi["final_val_loss"] == over_torch["final_val_loss"]
    assert over_mpi["params_digests"] == over_torch["params_digests"]
    assert over_mpi["cross_replica_bytes_sent_per_worker"] == over_torch["cross_replica_bytes_sent_per_worker"] > 0
    # the method's traffic went over MPI: torch.distributed carried DeepSpeed's start-up only
    ops = over_mpi["ledgers"][0]["method"]["by_op"]
    assert ops["outer_sparse_all_gather"]["calls"] == 2


def test_replicas_over_mpi(tmp_path):
    m = _launch(tmp_path, "replicas", 4, 29552, {"transport": "mpi", "replica_size": 2})
    assert m["world_size"] == 4 and m["replica_size"] == 2
    assert len(set(m["params_digests"])) == 1  # every rank of both replicas agrees after 2 syncs
    assert m["cross_replica_bytes_sent_per_worker"] > 0 and m["engine_bytes_sent_per_worker"] > 0


def test_pipeline_replicas_over_mpi(tmp_path):
    """2 replicas of a 2-stage pipeline under mpirun, the method over MPI: DeepSpeed numbers the
    ranks stage-major, so a replica is ranks {0, 2} or {1, 3} and the MPI communicator of each
    stage must pair the same stage of both replicas; int8 activations between stages."""
    m = _launch(tmp_path, "pipe", 4, 29553, {"transport": "mpi", "replica_size": 2,
                                             "activations": {"forward": "int8", "backward": "int8"}},
                "--pipeline-stages", "2", "--n-layer", "2")
    assert m["stages"] == [0, 0, 1, 1]
    d = m["params_digests"]
    assert d[0] == d[1] != d[2] == d[3]  # each stage agrees across replicas after the sync at step 6
    assert m["cross_replica_bytes_sent_per_worker"] > 0 and m["activation_bytes_sent_per_worker"] > 0


def test_a_stalled_peer_fails_the_mpi_collective_within_the_timeout(tmp_path):
    """lowcomm.timeout_s reaches the MPI transport too (MPI itself would wait forever): rank 0
    fails after about 2 s naming the operation, while rank 1 sleeps 30 s; and again in a broadcast
    from rank 1."""
    env = {**os.environ, **ENV, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable,
           str(ROOT / "tests" / "mpi_stall_worker.py"), str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0  # rank 0 left with its failure; mpirun stopped the job
    r = json.loads((tmp_path / "rank0.json").read_text())
    assert r["error"] is not None and "sparse_all_gather" in r["error"] and "within 2 s" in r["error"], r
    assert 1.9 < r["waited_s"] < 10, r
    assert "replica_broadcast" in r["broadcast_error"] and "within 2 s" in r["broadcast_error"], r
    assert 1.9 < r["broadcast_waited_s"] < 10, r
