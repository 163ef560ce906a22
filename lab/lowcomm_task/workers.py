"""Start N real worker processes on this machine, each in a torch.distributed process group.

Used by ``ds-lowcomm compare`` and by the multi-rank tests: ``run_local_workers(fn, n, *args)``
starts n processes, initialises gloo (file store rendezvous, no port to pick), calls
``fn(rank, world_size, *args)`` and returns each rank's return value.

The processes are forked from multiprocessing's fork server, which imports torch, ds_lowcomm and
torch's inductor once (:data:`PRELOAD`): a spawned process spent about two seconds of CPU importing
the first two on every launch, and one that imports DeepSpeed (ds_lowcomm's start-up check of its
internals imports DeepSpeed's Muon, whose kernels are torch.compile'd at import) four more on the
inductor (7 s of a child's import down to 2 here, 2026-12-02). The fork server has run no torch op
and made no CUDA context (importing these makes none), so its children start as clean as spawned
ones; each takes the caller's environment, working directory and sys.path of the launch, as a
spawned one would.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

# Imported once, by the fork server. Not deepspeed nor megatron: each reads the machine at import
# (DeepSpeed picks its accelerator; Megatron's CPU shim must come first), which a test or a
# script may change by the environment before a launch. torch's inductor, which torch.compile
# imports at decoration time (DeepSpeed's Muon kernels and Megatron's fused ones are decorated at
# import): about 600 modules, two to four seconds of CPU in every process that imports either; it
# calls nothing of torch.cuda on import.
PRELOAD = ["torch", "torch.distributed", "ds_lowcomm", "torch._inductor.compile_fx"]


def _worker(rank, world_size, store_dir, fn, args, backend, threads, environ, start_method):
    # The fork server's environment is the one it started with: the caller's, as of this launch.
    os.environ.clear()
    os.environ.update(environ)
    # Processes this one starts (a DataLoader's workers) as the caller's would start them (fork on
    # Linux), not from a fork server of their own, which outlives this process's exit with them.
    mp.set_start_method(start_method, force=True)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    # What torchrun would set (DeepSpeed's engine asks for LOCAL_RANK); one machine, so local == global.
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(threads)
    if backend == "nccl":  # one GPU per rank, as torchrun's LOCAL_RANK would pick
        torch.cuda.set_device(rank % torch.cuda.device_count())
    # A bounded default group: a peer that died or stalled fails the others within minutes, not 30.
    dist.init_process_group(
        backend, init_method=f"file://{store_dir}/store", rank=rank, world_size=world_size,
        timeout=timedelta(seconds=600),
    )
    try:
        result = fn(rank, world_size, *args)
    except BaseException:
        # No barrier here: the other ranks may be inside a collective this rank will never join;
        # exiting lets the parent see the failure and stop them.
        torch.save({"error": traceback.format_exc()}, os.path.join(store_dir, f"result{rank}.pt"))
        dist.destroy_process_group()  # closes this rank's connections: peers fail fast, not at a timeout
        raise
    torch.save({"result": result}, os.path.join(store_dir, f"result{rank}.pt"))
    # Without the barrier before destroying, gloo now and then aborts at exit.
    dist.barrier()
    dist.destroy_process_group()
    # Subgroups and finished async works can keep gloo's threads alive into interpreter teardown,
    # where destroying them aborts the process ("terminate called without an active exception")
    # after the result is already saved; leave without that teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_local_workers(fn, world_size: int, *args, backend: str = "gloo", threads: int | None = None):
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` new processes; return their results.

    ``fn`` must be importable (a module-level function). A failure in any rank raises here
    with that rank's traceback.
    """
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="ds_lowcomm_") as store_dir:
        failure = None
        try:
            mp.set_forkserver_preload(PRELOAD)  # read when the fork server first starts
            mp.start_processes(
                _worker,
                args=(world_size, store_dir, fn, args, backend, threads, dict(os.environ),
                      mp.get_start_method(allow_none=True)),
                nprocs=world_size,
                join=True,
                start_method="forkserver",
            )
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            failure = err  # the ranks' own tracebacks, read below, say more
        outs = {}
        for rank in range(world_size):
            path = os.path.join(store_dir, f"result{rank}.pt")
            if os.path.exists(path):
                outs[rank] = torch.load(path, weights_only=True)  # data only: nothing in a result file runs
        errors = [f"rank {rank} failed:\n{out['error']}" for rank, out in sorted(outs.items()) if "error" in out]
        if errors:  # all of them: the first rank's error may only be a consequence of another's
            raise RuntimeError("\n".join(errors))
        if failure is not None or len(outs) != world_size:
            raise RuntimeError(f"worker processes failed: {failure}")
        results = [outs[rank]["result"] for rank in range(world_size)]
        return results
