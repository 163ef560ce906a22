"""Start N real worker processes on this machine, each in a torch.distributed process group.

Used by ``ds-lowcomm compare`` and by the multi-rank tests: ``run_local_workers(fn, n, *args)``
starts n processes, initialises gloo (file store rendezvous, no port to pick), calls
``fn(rank, world_size, *args)`` and returns each rank's return value. ``run_script(script, argv,
n)`` runs a training script on n ranks as ``torchrun --standalone --nproc_per_node n`` would (the
script makes its own process group), for the tests whose subject is the script, not torchrun.

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

import atexit
import io
import os
import runpy
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_lowcomm.checkpoint_io import atomic_write

# Imported once, by the fork server. Not deepspeed nor megatron: each reads the machine at import
# (DeepSpeed picks its accelerator; Megatron's CPU shim must come first), which a test or a
# script may change by the environment before a launch. torch's inductor, which torch.compile
# imports at decoration time (DeepSpeed's Muon kernels and Megatron's fused ones are decorated at
# import): about 600 modules, two to four seconds of CPU in every process that imports either; it
# calls nothing of torch.cuda on import.
PRELOAD = ["torch", "torch.distributed", "ds_lowcomm", "torch._inductor.compile_fx"]


def _enter(environ, start_method, **rank_vars):
    """What a rank of either launcher sets first. The fork server's environment is the one it
    started with: the rank takes the caller's, as of this launch, and its own variables on top."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(rank_vars)
    # Processes this one starts (a DataLoader's workers) as the caller's would start them (fork on
    # Linux), not from a fork server of their own, which outlives this process's exit with them.
    mp.set_start_method(start_method, force=True)


def exit_without_teardown(code: int = 0):
    """How a rank whose work is done ends (either launcher's, and the training scripts' own).
    First what the interpreter runs at exit: atexit's handlers and multiprocessing's finalizers
    (the Manager that Megatron's checkpoint save starts is shut down by one; without them it
    outlived the launch); CPython's private call, the one its finalisation makes. Then no
    interpreter teardown: subgroups and finished async works can keep gloo's threads alive into
    it, where destroying them aborts the process ("terminate called without an active
    exception") after the rank's work is done."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _save_result(out: dict, store_dir: str, rank: int) -> None:
    # Atomic: when one rank fails, the parent stops the others, maybe mid-write; a torn file
    # would hide the failing rank's error behind an EOFError.
    atomic_write(os.path.join(store_dir, f"result{rank}.pt"), lambda f: torch.save(out, f))


def _worker(rank, world_size, store_dir, fn, args, backend, threads, environ, start_method):
    # What torchrun would set (DeepSpeed's engine asks for LOCAL_RANK); one machine, so local == global.
    _enter(environ, start_method, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
           LOCAL_WORLD_SIZE=str(world_size))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
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
        _save_result({"error": traceback.format_exc()}, store_dir, rank)
        dist.destroy_process_group()  # closes this rank's connections: peers fail fast, not at a timeout
        raise
    _save_result({"result": result}, store_dir, rank)
    # Without the barrier before destroying, gloo now and then aborts at exit.
    dist.barrier()
    dist.destroy_process_group()
    exit_without_teardown(0)


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


def _script_rank(rank, world_size, script, argv, environ, cwd, out_path, err_path, start_method):
    """One rank of :func:`run_script`: the script as ``python script argv`` would run it, its
    output appended to the launch's two files a line at a time, its exit status as the process's."""
    _enter(environ, start_method, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank))
    os.chdir(cwd)
    for fd, path in ((1, out_path), (2, err_path)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    # Written a line at a time (torchrun's ``python -u`` writes a print's text and its newline
    # apart, so two ranks' lines can share one): the ranks' lines interleave whole, as written
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))  # as the interpreter puts a script's folder first
    code = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exit_:  # the interpreter's rules: None is 0, a number itself, anything else printed and 1
        code = 0 if exit_.code is None else exit_.code
        if not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
    except BaseException:  # noqa: BLE001 (what the interpreter does with an uncaught one: printed, status 1)
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)


def run_script(script, argv, nproc: int, *, env=None, cwd=None, timeout: float = 300,
               grace: float = 5.0) -> subprocess.CompletedProcess:
    """Run ``script argv`` on ``nproc`` ranks of this machine as ``torchrun --standalone
    --nproc_per_node nproc`` would, from the fork server of :func:`run_local_workers` (torch,
    ds_lowcomm and inductor imported once: a Megatron launch of the tests took 20 s under torchrun
    and takes 4 here, 2026-12-02).

    Each rank gets torchrun's variables, all but its error file (RANK, LOCAL_RANK, WORLD_SIZE,
    MASTER_ADDR/MASTER_PORT of a TCP store this process holds, as torchrun's agent holds one, ...)
    and makes its own process group. As under torchrun, a rank that fails stops the launch: the others
    get ``grace`` seconds to finish (each prints its own error) and are then terminated. Returns the
    launch's ``CompletedProcess``: the ranks' stdout and stderr, each interleaved as written, and
    the first failed rank's exit status (0 when all succeeded); ``subprocess.TimeoutExpired``
    after ``timeout`` seconds, every rank killed."""
    script = os.path.abspath(script)
    environ = dict(os.environ if env is None else env)
    store = dist.TCPStore("localhost", 0, nproc, is_master=True, wait_for_workers=False)
    # torchrun's variables but its error file (where its @record writes a failure for the agent)
    environ.update(MASTER_ADDR="localhost", MASTER_PORT=str(store.port), TORCHELASTIC_USE_AGENT_STORE="True",
                   TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0",
                   TORCHELASTIC_RUN_ID=f"run_script_{os.getpid()}_{store.port}",
                   TORCHELASTIC_SIGNALS_TO_HANDLE="SIGTERM,SIGINT,SIGHUP,SIGQUIT", TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
                   ROLE_NAME="default", GROUP_RANK="0", GROUP_WORLD_SIZE="1", WORLD_SIZE=str(nproc),
                   LOCAL_WORLD_SIZE=str(nproc), ROLE_WORLD_SIZE=str(nproc))
    environ.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default with several ranks on a machine
    mp.set_forkserver_preload(PRELOAD)
    ctx = mp.get_context("forkserver")
    with tempfile.TemporaryDirectory(prefix="ds_lowcomm_script_") as logs:
        out_path, err_path = os.path.join(logs, "stdout"), os.path.join(logs, "stderr")
        for path in (out_path, err_path):
            open(path, "w").close()
        launch = (list(argv), environ, os.path.abspath(cwd or os.getcwd()), out_path, err_path,
                  mp.get_start_method(allow_none=True))
        ranks = [ctx.Process(target=_script_rank, args=(rank, nproc, script, *launch)) for rank in range(nproc)]
        for rank in ranks:
            rank.start()
        deadline, stop_at, code = time.monotonic() + timeout, None, 0
        try:
            while any(rank.exitcode is None for rank in ranks):
                now = time.monotonic()
                if now > deadline:
                    raise subprocess.TimeoutExpired([script, *argv], timeout)
                failed = [rank.exitcode for rank in ranks if rank.exitcode not in (None, 0)]
                if failed and stop_at is None:
                    code, stop_at = failed[0], now + grace
                if stop_at is not None and now > stop_at:
                    break
                time.sleep(0.05)
        finally:
            for rank in ranks:  # SIGTERM, as torchrun stops its workers; SIGKILL where that is not enough
                if rank.exitcode is None:
                    rank.terminate()
                    rank.join(10)
                if rank.exitcode is None:
                    rank.kill()
                rank.join()
        if code == 0:  # a rank killed by a signal by itself: its negative status, as subprocess reports one
            code = next((rank.exitcode for rank in ranks if rank.exitcode != 0), 0)
        with open(out_path) as out, open(err_path) as err:
            return subprocess.CompletedProcess([script, *argv], code, out.read(), err.read())
