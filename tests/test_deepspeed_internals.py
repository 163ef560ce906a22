"""The supported DeepSpeed versions and every DeepSpeed internal the integration uses
(ds_lowcomm/deepspeed/internals.py): the declared list against the installed deepspeed, the named
error where one is missing, renamed, no longer called or rewritten, the list against the
package's own code, the version check and its escape, the sub-world's refusal of a
group-taking backend method it does not know (real processes, gloo), and a start that clears the
JIT build lock a killed process left (backend.py), where plain DeepSpeed waits forever. The pins in pyproject.toml
against versions.SUPPORTED (read from the package's metadata) are tested once, in
test_megatron_internals.py."""

import ast
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from ds_lowcomm import reflect, versions
from ds_lowcomm.reflect import FrameworkInternalsError
from ds_lowcomm.versions import ALLOW_ENV, UnsupportedVersionError
from lowcomm_task.workers import run_local_workers

from .internals_scan import own_names

os.environ.setdefault("DS_ACCELERATOR", "cpu")

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ds_lowcomm" / "deepspeed"
RANGE = "deepspeed>=0.19.8,<0.20"


@pytest.fixture
def internals(monkeypatch):
    from ds_lowcomm.deepspeed import internals

    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(internals._INTERNALS, "checked", False)  # check again, in this test's state
    return internals


def test_declared_internals_match_the_installed_deepspeed(internals):
    import deepspeed
    import torch
    from deepspeed.comm.torch import TorchBackend

    from ds_lowcomm.deepspeed import backend as ds_backend

    assert internals.problems() == []
    assert internals.ensure_checked() == deepspeed.__version__
    assert internals.TORCH_JIT.problems() == [] and internals.TORCH_JIT.ensure_checked() == torch.__version__
    assert len(internals.ITEMS) > 100 and internals.LOOKED_UP and internals.COPIED
    # The group-taking backend methods the sub-world knows are exactly the installed ones: a method
    # a DeepSpeed release adds shows up here (and is refused by the sub-world until it is added).
    taking_group = {name for name in dir(TorchBackend) if not name.startswith("_")
                    and ds_backend.takes_group(object.__new__(TorchBackend), name)}
    assert taking_group == {*internals.GROUP_METHODS, *internals.SUBWORLD_OWN} - {"get_world_group", "new_group",
                                                                                 "init_device_mesh",
                                                                                 "batch_isend_irecv"}
    # Signatures are read under DeepSpeed's decorators (stage_on_cpu's wrapper takes *args, **kwargs).
    backend = object.__new__(TorchBackend)
    assert list(ds_backend.backend_signature(backend, "all_reduce").parameters) == ["tensor", "op", "group",
                                                                                   "async_op"]
    assert list(ds_backend.backend_signature(backend, "gather").parameters) == ["tensor", "gather_list", "dst",
                                                                               "group", "async_op"]
    # The stored-attribute check tells a stored attribute from one that is only read.
    engine = internals.live(internals.ENGINE)
    assert internals.stored_by_class(engine, "tput_timer")
    assert not internals.stored_by_class(engine, "module_state_dict")


def _raises_named(internals, *words):
    with pytest.raises(FrameworkInternalsError) as err:
        internals.ensure_checked()
    message = str(err.value)
    for word in (*words, "deepspeed 0.19.8", RANGE):
        assert word in message, (word, message)
    return message


def test_a_missing_or_changed_internal_stops_with_its_name(internals, monkeypatch):
    from deepspeed.comm.torch import TorchBackend
    from deepspeed.runtime.pipe.engine import PipelineEngine
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    with monkeypatch.context() as m:  # renamed away
        m.delattr(DeepSpeedZeroOptimizer, "_optimizer_step")
        _raises_named(internals, "deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer._optimizer_step",
                      "is missing")
    with monkeypatch.context() as m:  # another signature, under the same decorator
        m.setattr(TorchBackend, "broadcast", lambda self, tensor, source, group=None, async_op=False: None)
        _raises_named(internals, "deepspeed.comm.torch.TorchBackend.broadcast", "(tensor, source, group, async_op)",
                      "src")
    with monkeypatch.context() as m:  # ZeRO no longer steps through _optimizer_step: replacing it would do nothing
        m.setattr(DeepSpeedZeroOptimizer, "step", lambda self, closure=None: self.optimizer.step())
        _raises_named(internals, "DeepSpeedZeroOptimizer._optimizer_step",
                      "no longer read by deepspeed.runtime.zero.stage_1_and_2.DeepSpeedZeroOptimizer.step")
    with monkeypatch.context() as m:  # a body activations.py copied, changed
        def _exec_send_grads(self, buffer_id):
            self.pipe_buffers["inputs"][buffer_id] = None
        m.setattr(PipelineEngine, "_exec_send_grads", _exec_send_grads)
        _raises_named(internals, "PipelineEngine._exec_send_grads", "another body", "activations.py")
    with monkeypatch.context() as m:  # two at once: one error listing everything they break
        m.delattr(PipelineEngine, "_build_data_iter")
        m.delattr(DeepSpeedZeroOptimizer, "_lazy_init_hp_params_optimizer_state")
        message = _raises_named(internals, "3 private deepspeed internals changed:",
                                "PipelineEngine._build_data_iter (ds_lowcomm builds the pipeline loader",
                                "DeepSpeedZeroOptimizer._lazy_init_hp_params_optimizer_state (ds_lowcomm links")
        # the third: _build_data_iter again, as the reader of mpu and dp_world_size (named once)
        assert message.count("PipelineEngine._build_data_iter is missing") == 1
    internals.ensure_checked()  # all back


def test_an_instance_attribute_is_checked_where_it_is_read_and_written(internals):
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
    from deepspeed.utils.timer import ThroughputTimer

    timer = ThroughputTimer(DeepSpeedThroughputTimerConfig(), batch_size=4)
    internals.put(timer, internals.TIMER_BATCH_SIZE, 8)
    assert timer.batch_size == 8
    del timer.batch_size  # as if a release renamed it: neither read as a default nor created anew
    for use in (lambda: internals.get(timer, internals.TIMER_BATCH_SIZE),
                lambda: internals.put(timer, internals.TIMER_BATCH_SIZE, 16)):
        with pytest.raises(FrameworkInternalsError, match=r"ThroughputTimer\.batch_size .* is missing on a "
                                                          r"ThroughputTimer.*deepspeed>=0\.19\.8,<0\.20"):
            use()
    assert not hasattr(timer, "batch_size")


def test_the_deepspeed_version_is_checked_first(internals, monkeypatch):
    import ds_lowcomm.deepspeed as glue

    monkeypatch.setattr(versions, "_warned", set())
    real = versions.installed_version
    monkeypatch.setattr(versions, "installed_version", lambda name: "0.20.1" if name == "deepspeed" else real(name))
    # initialize(config=None) and replica_layout({}) would refuse their config: the version comes first
    for call in (lambda: glue.initialize(model=None), lambda: glue.replica_layout({}),
                 lambda: versions.check_supported("deepspeed")):
        with pytest.raises(UnsupportedVersionError) as err:
            call()
        assert f"deepspeed 0.20.1 is installed; ds_lowcomm supports {RANGE}" in str(err.value)
        assert ALLOW_ENV in str(err.value)
    assert versions.check_supported("deepspeed", installed="0.19.9+cpu") == "0.19.9+cpu"
    monkeypatch.setenv(ALLOW_ENV, "1")
    with pytest.warns(RuntimeWarning, match=r"deepspeed 0\.20\.1 is installed.*>=0\.19\.8,<0\.20.*going on"):
        assert internals.ensure_checked() == "0.20.1"  # and the internals are still checked


# Public DeepSpeed the glue imports directly; every other DeepSpeed name goes through internals.py.
PUBLIC_IMPORTS = {"deepspeed": None, "deepspeed.pipe": {"PipelineModule"}, "deepspeed.accelerator": {"get_accelerator"},
                  "deepspeed.runtime.pipe.engine": {"PipelineEngine"}, "deepspeed.utils": {"RepeatingLoader"}}
NOT_DEEPSPEED = {"_getframe", "_get_default_group"}  # sys's and torch's


def test_every_deepspeed_internal_goes_through_internals_py():
    """Outside internals.py: deepspeed is imported only for public names, no private name of anyone
    but ds_lowcomm's own is read, and no attribute of a DeepSpeed object is probed with a default
    (getattr(x, name, default) / hasattr), so a renamed internal cannot go unnoticed. Every
    declared item is used."""
    from ds_lowcomm.deepspeed import internals

    own, bad, used = own_names((ROOT / "ds_lowcomm").rglob("*.py"), subscript_keys=True), [], set()
    declared = {name for name, value in vars(internals).items() if isinstance(value, (reflect.Internal, tuple))}
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "internals.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.name}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed"):
                if not {a.name for a in node.names} <= (PUBLIC_IMPORTS.get(node.module) or set()):
                    bad.append(f"{where}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import) and any(a.name.startswith("deepspeed") for a in node.names):
                if any(a.name not in PUBLIC_IMPORTS for a in node.names):
                    bad.append(f"{where}: import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Attribute):
                if (node.attr.startswith("_") and not node.attr.startswith("__") and node.attr not in own
                        and node.attr not in NOT_DEEPSPEED):
                    bad.append(f"{where}: .{node.attr}")
                if isinstance(node.value, ast.Name) and node.value.id in ("ds", "internals") and node.attr in declared:
                    used.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                probe = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
                name = node.args[1] if probe and len(node.args) > 1 else None
                known = (isinstance(name, ast.Constant) and name.value in own) or (
                    isinstance(name, ast.Name) and name.id in own)
                if probe and not known and ast.unparse(node.args[0]) not in ("args", "kwargs.get('args')"):  # argparse namespaces (initialize's args=)
                    bad.append(f"{where}: {ast.unparse(node)}")
    assert not bad, "DeepSpeed internals reached around ds_lowcomm/deepspeed/internals.py:\n" + "\n".join(bad)
    # declared for internals.py's own use (the backend, the checks) or for the glue's
    internal_use = {"MODULE_GRID", "ITEMS", "LOOKED_UP", "COPIED", "TORCH_FILE_BATON",
                    "PIPE_INSTANCE", "EXEC_SEND_ACTIVATIONS", "EXEC_RECV_ACTIVATIONS", "EXEC_SEND_GRADS",
                    "EXEC_RECV_GRADS", "SEND_ACTIVATION", "RECV_ACTIVATION", "SEND_GRAD", "RECV_GRAD",
                    "SEND_OUTPUT_TIMER", "RECV_INPUT_TIMER", "SEND_GRAD_TIMER", "RECV_GRAD_TIMER",
                    "CHECK_OVERFLOW", "GRID", "PIPELINE_ENGINE", "ENGINE",
                    "ZERO3_HAS_OVERFLOW",  # overflow.py replaces it by ZERO12_HAS_OVERFLOW's name, the same
                    # muon.py: the body it follows (COPIED), the constructor it calls through MUON_WITH_AUX_ADAM
                    "MUON_UPDATE", "MUON_WITH_AUX_ADAM_INIT"}
    unused = sorted(n for n in declared - used - internal_use if n.isupper())
    assert not unused, f"declared in internals.py but used nowhere: {unused}"


def _subworld_worker(rank, world):
    import torch
    import torch.distributed as dist
    import deepspeed.comm as ds_dist
    from deepspeed.comm.torch import TorchBackend

    from ds_lowcomm.deepspeed import backend as ds_backend
    from ds_lowcomm.deepspeed.subworld import enter_subworld

    enter_subworld([rank], timeout_s=60)  # each rank its own world: nothing of DeepSpeed's crosses ranks
    backend, out = ds_backend.backend(), {}
    t = torch.tensor([float(rank + 1)])
    ds_dist.all_reduce(t)
    out["all_reduce"] = t.item()
    # gather's dst left at its default, DeepSpeed's (virtual) rank 0: this rank, not the job's rank 0
    gathered = [torch.zeros(1)]
    backend.gather(torch.tensor([rank + 10.0]), gathered)
    out["gather"] = gathered[0].item()
    out["initialized"] = backend.is_initialized()  # no group: passed on
    # a group-taking method DeepSpeed might add in a release, which the sub-world does not know
    TorchBackend.all_reduce_twice = lambda self, tensor, op=None, group=None, async_op=False: None
    try:
        backend.all_reduce_twice(t)
        out["unknown"] = None
    except Exception as err:  # noqa: BLE001 (its type and words are the result)
        out["unknown"] = f"{type(err).__name__}: {err}"
    dist.barrier()
    return out


def test_subworld_refuses_a_group_method_it_does_not_know():
    for rank, out in enumerate(run_local_workers(_subworld_worker, 2, threads=1)):
        assert out["all_reduce"] == rank + 1  # within the sub-world only
        assert out["gather"] == rank + 10
        assert out["initialized"] is True
        assert out["unknown"].startswith("FrameworkInternalsError: deepspeed 0.19.8: method "
                                         "deepspeed.comm.torch.TorchBackend.all_reduce_twice"), out["unknown"]
        assert "takes a process group" in out["unknown"] and "across replicas" in out["unknown"]
        assert RANGE in out["unknown"]


# --- A JIT build lock left by a killed process (backend.py) -------------------------------------------------
# torch's FileBaton.try_acquire, as written there (without torch's import time): the file created
# exclusively and kept open until release
HOLD = ("import os, sys, time; os.open(sys.argv[1], os.O_CREAT | os.O_EXCL); print('held', flush=True); "
        "time.sleep(600)")


def _held_by_a_process(lock) -> subprocess.Popen:
    """A process that takes ``lock`` as torch's JIT load does and keeps it."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def _killed(holder: subprocess.Popen) -> None:
    holder.send_signal(signal.SIGKILL)  # inside the window: the lock stays
    holder.wait()


def test_a_build_lock_is_waited_for_while_held_and_removed_once_its_holder_is_gone(tmp_path, monkeypatch):
    from ds_lowcomm.deepspeed import backend as ds_backend

    lock = tmp_path / "lock"
    holder = _held_by_a_process(lock)
    try:
        with pytest.raises(TimeoutError, match=rf"{lock} is still held by process\(es\) {holder.pid} on this "
                                               r"machine after 1 s"):
            ds_backend.release_stale_build_lock(str(lock), wait_s=1.0)
        assert lock.exists()
    finally:
        _killed(holder)
    with pytest.warns(RuntimeWarning, match=rf"removed the stale JIT build lock {lock} \(no process on this "
                                            r"machine holds it"):
        assert ds_backend.release_stale_build_lock(str(lock), wait_s=0.0)
    assert not lock.exists()
    assert not ds_backend.release_stale_build_lock(str(lock))  # none: nothing to do
    # On a file system other machines may share, a young lock nobody here holds may be a build
    # running elsewhere: waited for, up to the age at which it counts as stale.
    _killed(_held_by_a_process(lock))
    monkeypatch.setattr(ds_backend, "_file_system", lambda path: "nfs4")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(TimeoutError, match="held by a process not seen here"):
            ds_backend.release_stale_build_lock(str(lock), wait_s=0.5)
    with pytest.warns(RuntimeWarning, match="removed the stale JIT build lock"):
        assert ds_backend.release_stale_build_lock(str(lock), wait_s=0.0, unseen_holder_stale_s=0.0)


def test_a_lock_seen_between_its_holders_close_and_remove_is_left_to_its_holder(tmp_path):
    """torch's FileBaton.release closes the lock, then removes it: a start that looks in between (a
    busy machine preempting the holder there) sees it unheld. Removing it then made the holder's
    own remove fail (its rank died, its peer aborted): the lock is stale only if it stays unheld."""
    import threading

    from ds_lowcomm.deepspeed import backend as ds_backend

    lock = tmp_path / "lock"
    lock.write_text("")
    errors = []

    def holder_finishes_its_release():
        time.sleep(0.3)
        try:
            os.remove(lock)
        except OSError as err:
            errors.append(err)

    releasing = threading.Thread(target=holder_finishes_its_release)
    releasing.start()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not ds_backend.release_stale_build_lock(str(lock), wait_s=0.0)
    releasing.join()
    assert errors == [] and not lock.exists()


START = """
import faulthandler, os, sys
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
import deepspeed, torch.distributed as dist
from ds_lowcomm.deepspeed import backend
faulthandler.dump_traceback_later(float(sys.argv[3]), exit=True)  # where it waits, then out
if sys.argv[1] == "plain":
    deepspeed.init_distributed(dist_backend="gloo")
else:
    backend.init_distributed("gloo")
faulthandler.cancel_dump_traceback_later()
print("started", backend.real_backend().shm_comm_op is not None, flush=True)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_engine_start_clears_the_lock_a_killed_process_left_where_deepspeed_hangs():
    """The real lock of DeepSpeed's CPU comm op, left by a process killed holding it: plain
    DeepSpeed's start waits on it forever (seen waiting in torch's FileBaton); ds_lowcomm's start
    removes it, says so, and loads the op."""
    from ds_lowcomm.deepspeed import backend as ds_backend

    lock = ds_backend.comm_op_lock()
    assert lock is not None and os.path.basename(os.path.dirname(lock)) == "deepspeed_shm_comm"
    _killed(_held_by_a_process(lock))
    try:
        plain = subprocess.run([sys.executable, "-c", START, "plain", str(_free_port()), "5"], capture_output=True,
                               text=True, timeout=120)
        assert plain.returncode != 0 and "started" not in plain.stdout
        assert "file_baton.py" in plain.stderr and "in wait" in plain.stderr, plain.stderr[-2000:]
        assert os.path.exists(lock)
        ours = subprocess.run([sys.executable, "-c", START, "ds_lowcomm", str(_free_port()), "200"],
                              capture_output=True, text=True, timeout=240)
        assert ours.returncode == 0, ours.stderr[-3000:]
        assert ours.stdout.strip().endswith("started True")  # the op loaded
        assert f"removed the stale JIT build lock {lock} (no process on this machine holds it" in ours.stderr
        assert not os.path.exists(lock)
    finally:
        if os.path.exists(lock):
            os.remove(lock)
