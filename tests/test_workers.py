"""run_local_workers (the launcher of compare, the benchmarks and the multi-rank tests): its workers
come from a fork server that imported torch (and its inductor) once, yet each sees its launch as a
spawned process would (the caller's environment and working directory as of the launch), and what
a worker starts itself (a DataLoader's workers, a Manager) goes with it. run_script, from the same fork
server, gives a script what torchrun gives it."""

import json
import multiprocessing
import os
import subprocess
import sys
import time

import torch

from lowcomm_task.workers import run_local_workers, run_script


def _seen(rank, world):
    import torch.distributed as dist

    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    return {"env": os.environ.get("DSLC_TEST_LAUNCH"), "cwd": os.getcwd(), "sum": total.item(),
            "inductor": "torch._inductor.compile_fx" in sys.modules, "cuda": torch.cuda.is_initialized()}


def _loader(rank, world):
    loader = torch.utils.data.DataLoader(list(range(32)), batch_size=8, num_workers=2, persistent_workers=True)
    total = sum(int(batch.sum()) for batch in loader)
    return {"total": total, "method": multiprocessing.get_start_method(),
            "pids": [w.pid for w in loader._iterator._workers]}


def _manager(rank, world):
    # Kept as a library's module global keeps one (Megatron's checkpoint save: dist_checkpointing's
    # filesystem_async); multiprocessing's finalizers shut it down at the interpreter's exit.
    multiprocessing.kept = multiprocessing.get_context("spawn").Manager()
    return multiprocessing.kept._process.pid


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie (exited, not yet reaped) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


def test_workers_see_their_launch_and_leave_nothing_behind(tmp_path, monkeypatch):
    first = run_local_workers(_seen, 2)  # the fork server starts here, before the changes below
    assert [r["sum"] for r in first] == [3.0, 3.0]
    # torch's inductor came with the fork server (torch.compile imports it where DeepSpeed's Muon
    # and Megatron's fused kernels are decorated, seconds of CPU a process), and no CUDA state
    assert all(r["inductor"] and not r["cuda"] for r in first), first
    monkeypatch.setenv("DSLC_TEST_LAUNCH", "second")
    monkeypatch.chdir(tmp_path)
    second = run_local_workers(_seen, 2)
    assert all(r["env"] == "second" and r["cwd"] == str(tmp_path) for r in second), second
    # A DataLoader's workers are started as the caller's default would start them (not from a fork
    # server of the worker's own, which outlived it with them), and are gone once the launch returns.
    loaded = run_local_workers(_loader, 2)
    assert all(r["total"] == sum(range(32)) for r in loaded)
    assert {r["method"] for r in loaded} == {multiprocessing.get_start_method()}
    pids = [pid for r in loaded for pid in r["pids"]]
    deadline = time.monotonic() + 30  # a DataLoader worker checks on its parent every 5 s
    while not all(_gone(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert all(_gone(pid) for pid in pids), [pid for pid in pids if not _gone(pid)]
    # What a worker's exit would stop is stopped when it ends (its exit functions ran)
    managers = run_local_workers(_manager, 2)
    assert all(_gone(pid) for pid in managers), managers


# Prints what a launcher gave this rank, sums the ranks over a process group made from it, and
# exits with argv[1] on the last rank (0 elsewhere); with argv[2], the others then hang. With argv[1]
# 0, each leaves a spawned multiprocessing Manager running, which the interpreter's exit shuts down,
# as Megatron's checkpoint save leaves one (dist_checkpointing's filesystem_async).
_SCRIPT = """
import json, multiprocessing, os, sys, time
if __name__ == "__main__":  # a spawned process imports this file again
    import torch, torch.distributed as dist
    mine = {k: v for k, v in os.environ.items() if k not in json.loads(os.environ["DSLC_BASE"])}
    manager = None
    if sys.argv[1] == "0":  # (a rank stopped by a signal would leave it behind, under torchrun too)
        manager = multiprocessing.get_context("spawn").Manager()
        multiprocessing.kept = manager  # alive after the script, as in a library's module global
    dist.init_process_group("gloo")
    total = torch.tensor([dist.get_rank() + 1.0])
    dist.all_reduce(total)
    sys.stdout.write(json.dumps({"env": mine, "sum": total.item(), "main": __name__, "argv": sys.argv[1:],
                                 "cwd": os.getcwd(), "manager": manager and manager._process.pid}) + "\\n")  # one write
    last = dist.get_rank() == dist.get_world_size() - 1
    if last and sys.argv[1] != "0":
        raise SystemExit(int(sys.argv[1]))
    if len(sys.argv) > 2:
        time.sleep(600)  # stuck where no collective would notice the failed rank
    dist.destroy_process_group()
"""


def test_run_script_gives_what_torchrun_gives(tmp_path):
    """A script under run_script sees torchrun's variables (by name: every one torchrun sets but its
    error file; by value where they are not per launch), makes its process group from them, and runs
    as __main__ in the caller's folder, and leaves nothing running that its exit would stop; a failed
    rank's status is the launch's, and the ranks still waiting for it are stopped after the grace,
    not left to the collective's timeout."""
    script = tmp_path / "script.py"
    script.write_text(_SCRIPT)
    env = {**os.environ, "DSLC_BASE": json.dumps(list(os.environ) + ["DSLC_BASE"])}
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "3",
                               str(script), "0"], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert torchrun.returncode == 0, torchrun.stderr[-2000:]
    ours = run_script(script, ["0"], 3, env=env, cwd=tmp_path, timeout=120)
    assert ours.returncode == 0, ours.stderr[-2000:]
    ref = sorted((json.loads(line) for line in torchrun.stdout.splitlines()), key=lambda r: r["env"]["RANK"])
    got = sorted((json.loads(line) for line in ours.stdout.splitlines()), key=lambda r: r["env"]["RANK"])
    per_launch = {"MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"}
    for r, g in zip(ref, got, strict=True):
        assert set(g["env"]) == set(r["env"]) - {"TORCHELASTIC_ERROR_FILE"}
        assert {k: v for k, v in g["env"].items() if k not in per_launch} == \
            {k: v for k, v in r["env"].items() if k not in per_launch | {"TORCHELASTIC_ERROR_FILE"}}
        assert g["sum"] == r["sum"] == 6.0 and g["main"] == "__main__" and g["argv"] == ["0"]
        assert g["cwd"] == r["cwd"] == str(tmp_path)
        assert _gone(g["manager"]) and _gone(r["manager"])  # the exit's finalizers ran, as the interpreter's
    start = time.monotonic()
    failed = run_script(script, ["3", "wait"], 2, env=env, cwd=tmp_path, timeout=120, grace=1.0)
    assert failed.returncode == 3 and len(failed.stdout.splitlines()) == 2, failed
    assert time.monotonic() - start < 60  # the hanging rank stopped after the grace, as torchrun stops it
