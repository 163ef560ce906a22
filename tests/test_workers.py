"""run_local_workers (the launcher of compare, the benchmarks and the multi-rank tests): its workers
come from a fork server that imported torch (and its inductor) once, yet each sees its launch as a
spawned process would (the caller's environment and working directory as of the launch), and what
a worker starts itself (a DataLoader's workers) goes with it."""

import multiprocessing
import os
import sys
import time

import torch

from lowcomm_task.workers import run_local_workers


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
