"""Helpers shared by the tests: a tiny model and its per-rank batches, a digest of parameters,
one plain SGD step for single-process replays, and the DCT written from its definition."""

import io
import math
import os
import sys

import numpy as np
import pytest
import torch

from ds_lowcomm.checkpoint_io import params_digest  # noqa: F401 (the library's; tests import it from here)

# The venv's tools first, as in an activated venv, for every process the tests start (spawned
# workers and launchers alike). DeepSpeed JIT-builds its shared-memory comm op with whichever
# `ninja` is first on PATH; the launcher tests put the venv's first, the spawned workers found the
# system's, and two ninja versions read each other's build log as stale: every switch between them
# rebuilt the op (about 40 s on two cores) several times per suite.
_VENV_BIN = os.path.dirname(sys.executable)
if os.environ.get("PATH", "").split(os.pathsep)[0] != _VENV_BIN:
    os.environ["PATH"] = _VENV_BIN + os.pathsep + os.environ.get("PATH", "")


def _extension_locks() -> list[str]:
    import glob

    root = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "torch_extensions")
    return glob.glob(os.path.join(root, "**", "lock"), recursive=True)


def _clear_stale_extension_locks() -> None:
    """torch's JIT load of an op (DeepSpeed's shared-memory comm op, at every engine's start) holds
    a ``lock`` file while ninja checks or builds it, even when nothing needs building; a process
    killed inside that window (a test's worker stopped or killed, a session cut off) leaves it
    behind, and every later load of that op waits for it forever (torch's FileBaton has no
    timeout). ds_lowcomm's own starts clear it (ds_lowcomm/deepspeed/backend.py); plain DeepSpeed's
    (the baselines) and the other ops' loads do not: every lock no live process holds, by the
    library's rule."""
    from ds_lowcomm.deepspeed.backend import release_stale_build_lock

    for lock in _extension_locks():
        try:
            release_stale_build_lock(lock, wait_s=0.0)
        except TimeoutError:  # a live process's build
            pass


def _build_deepspeed_comm_op() -> None:
    """Build DeepSpeed's CPU comm op once, here, in one process: otherwise the first engine's ranks
    build it together inside a test, and a rank stopped mid-build leaves a stale lock."""
    try:
        from deepspeed.accelerator import get_accelerator
        from deepspeed.comm.torch import build_shm_op
    except ImportError:
        return
    if get_accelerator().device_name() == "cpu":
        build_shm_op()


def _remove_unmapped_deepspeed_buffers() -> None:
    """DeepSpeed's CPU comm op, under its launcher, makes a 69 MB shared-memory buffer per rank and
    never unlinks it. ds_lowcomm's own engines unlink theirs once mapped; plain DeepSpeed's (the
    baselines) and those of processes a test killed stay in /dev/shm, that is in RAM: about 3 GB
    over a run of the suite, and a CI run on a machine full of a session's leftovers was killed for
    memory. Remove every such buffer no live process maps."""
    import glob

    buffers = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
    if not buffers:
        return
    mapped = set()
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                mapped.update(line.split()[-1] for line in f if "/dev/shm/deepspeed_allreduce_buffer_" in line)
        except OSError:  # the process ended, or is not ours to read
            continue
    for path in buffers - mapped:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass


@pytest.fixture(autouse=True)
def _no_leftover_shared_memory():
    yield
    _remove_unmapped_deepspeed_buffers()
    _clear_stale_extension_locks()


if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the DeepSpeed tests set it


class _SuiteWatchdog:
    """CI gives the whole run 90 minutes and the suite takes about 25: a run still going after
    ``limit_s`` (DSLC_SUITE_LIMIT_S), or a process not gone two minutes after the session's end
    (a thread or child that keeps the interpreter alive), is stuck where no per-test timeout
    reaches (a wait in C code, a hook, the exit). Say where, every thread's stack and the
    processes left, and end the run, failed, instead of being cut off silently."""

    def __init__(self, limit_s: float):
        import threading
        import time

        self.deadline, self.exit_code, self.why = time.monotonic() + limit_s, 3, f"still running after {limit_s:.0f} s"
        threading.Thread(target=self._watch, name="suite-watchdog", daemon=True).start()

    def _watch(self) -> None:
        import faulthandler
        import subprocess
        import time

        while time.monotonic() < self.deadline:
            time.sleep(5)
        print(f"\nconftest: the suite is {self.why}; where it is:", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        subprocess.run(["ps", "-eo", "pid,ppid,etimes,stat,args", "--forest"], stdout=sys.stderr)
        sys.stderr.flush()
        os._exit(self.exit_code)

    def session_ended(self, exitstatus: int) -> None:
        import time

        self.deadline, self.why = time.monotonic() + 120, "not gone 120 s after its end"
        self.exit_code = int(exitstatus) or 3


def _require_the_laboratory() -> None:
    """The tests train the reference task and run the benchmarks: the laboratory (lab/, its own
    distribution) must be installed beside the library, as launch/env.sh does."""
    import importlib.util

    if importlib.util.find_spec("lowcomm_task") is None or importlib.util.find_spec("lowcomm_bench") is None:
        raise pytest.UsageError("the tests need ds_lowcomm's laboratory (lab/: the reference task, the benchmarks): "
                                "run `pip install --no-deps -e lab` after the library (bash launch/env.sh does both)")


def pytest_sessionstart(session):
    _require_the_laboratory()
    session.config._dslc_watchdog = _SuiteWatchdog(float(os.environ.get("DSLC_SUITE_LIMIT_S", 4500)))
    # in pytest only (spawned workers import this module too: a worker stopped while it held the
    # build lock was one more way to leave it behind)
    _clear_stale_extension_locks()
    _build_deepspeed_comm_op()
    _remove_unmapped_deepspeed_buffers()  # an earlier run's


def pytest_sessionfinish(session, exitstatus):
    watchdog = getattr(session.config, "_dslc_watchdog", None)
    if watchdog is not None:
        watchdog.session_ended(exitstatus)


def tiny_model():
    torch.manual_seed(0)  # the same start on every rank
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def tiny_batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def tiny_loss(model, rank, step):
    x, y = tiny_batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def replay_sgd_step(models, step, lr):
    """One plain SGD step of every simulated rank's model on its own batch (for replays)."""
    for rank, model in enumerate(models):
        tiny_loss(model, rank, step).backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
                p.grad = None


def train_tiny(opt, model, rank, start, stop):
    """Steps ``start`` .. ``stop`` - 1 of ``opt`` on tiny_model's ``model`` with this rank's batches."""
    for s in range(start, stop):
        tiny_loss(model, rank, s).backward()
        opt.step()
        opt.zero_grad()


def tiny_checkpoint(opt, model) -> bytes:
    buffer = io.BytesIO()
    torch.save({"optimizer": opt.state_dict(), "model": model.state_dict()}, buffer)
    return buffer.getvalue()


def resumed_tiny(build, rank, checkpoint: bytes, start, stop, edit=lambda sd: sd, after_load=lambda opt: None):
    """A fresh tiny_model and ``build(model)``'s optimizer from ``checkpoint`` (after ``edit``),
    trained from ``start`` to ``stop``; its parameters."""
    saved = torch.load(io.BytesIO(checkpoint), weights_only=False)
    model = tiny_model()
    opt = build(model)  # from the common start (the optimizer checks the ranks agree), then the checkpoint
    model.load_state_dict(saved["model"])
    opt.load_state_dict(edit(saved["optimizer"]))
    after_load(opt)
    train_tiny(opt, model, rank, start, stop)
    return [p.detach().clone() for p in model.parameters()]


def same_bits(a, b) -> bool:
    return all(x.dtype == y.dtype and torch.equal(x.view(torch.int32), y.view(torch.int32)) for x, y in zip(a, b))


def dct_by_definition(n):
    """DCT-II, orthonormal, written from the formula with plain loops."""
    c = np.zeros((n, n))
    for k in range(n):
        scale = math.sqrt(1.0 / n) if k == 0 else math.sqrt(2.0 / n)
        for i in range(n):
            c[k, i] = scale * math.cos(math.pi * (2 * i + 1) * k / (2 * n))
    return c


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A real gloo group of one rank in this process (start-up checks and collectives run on it;
    nothing to send to)."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()
