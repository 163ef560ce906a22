"""lowcomm.timeout_s bounds every wait the library issues, on the plain torch.distributed path too
(an optimizer from build_optimizer over the user's default group, whose own timeout is torch's 30
minutes): a stopped peer ends every waiting rank with the library's error naming the operation."""

import os
import signal
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ds_lowcomm.comm import CollectiveError, ReplicaShard, TorchDistTransport
from ds_lowcomm.comm.settings import CommSettings
from ds_lowcomm.optim.registry import LowcommConfig, build_optimizer
from ds_lowcomm.settings import ConfigError

from .conftest import tiny_loss, tiny_model

STALL_STEP = 3


def _stalling_worker(rank, world, store_dir, where, timeout_s):
    """Rank 1 stops itself (SIGSTOP: a hung loader, a paused VM) before ``build_optimizer`` (its
    start-up check) or at step STALL_STEP; rank 0 records what its next library call did.
    ``where == "shard"``: both ranks form one replica (ZeRO 0's layout: each syncs the parameters
    it owns across replicas, over a group of itself alone here, then broadcasts them to the other
    over the default group); rank 1 stops at step STALL_STEP."""
    # No timeout given: the default group waits torch's default 30 minutes, as in a plain script.
    dist.init_process_group("gloo", init_method=f"file://{store_dir}/store", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = tiny_model()
    torch.optim.SGD(model.parameters(), lr=0.1)  # torch's first optimizer imports torch._dynamo (seconds): untimed
    method = {"method": "demo", "topk": 4, "chunk": 8}
    if where == "all_reduce":  # one sign bit an element through the compressed all-reduce, a sync every step
        where, method = "step", {"method": "dct_diloco", "sync_every": 1, "topk": 64, "chunk": 8, "transform": "none",
                                 "value_dtype": "sign", "exchange": "all_reduce"}
    cfg = LowcommConfig.from_dict({**method, "timeout_s": timeout_s})
    result = {"error": None, "steps": 0}
    start = time.monotonic()
    try:
        if where == "build" and rank == 1:
            os.kill(os.getpid(), signal.SIGSTOP)
        parts = {}
        if where == "shard":
            singles = [dist.new_group([r]) for r in range(world)]  # collective: every rank makes each
            parts = dict(transport=TorchDistTransport(singles[rank]),
                         shard=ReplicaShard(rank, world, TorchDistTransport()))
        opt = build_optimizer(cfg, model.parameters(), lr=1e-3, **parts)
        for step in range(STALL_STEP + 2):
            if where != "build" and rank == 1 and step == STALL_STEP:
                os.kill(os.getpid(), signal.SIGSTOP)
            tiny_loss(model, rank, step).backward()
            start = time.monotonic()
            opt.step()
            opt.zero_grad()
            result["steps"] = step + 1
    except CollectiveError as err:
        result.update(error=str(err), waited=time.monotonic() - start)
    except BaseException:  # anything else: for the parent to show
        result.update(crash=traceback.format_exc())
    torch.save(result, os.path.join(store_dir, f"result{rank}.pt"))
    os._exit(0)  # no barrier or teardown: the peer is stopped


def _run_with_a_stopped_peer(where: str, timeout_s: float, deadline_s: float = 120.0) -> dict:
    """Rank 0's result; rank 1 (stopped) is killed once rank 0 is done or the deadline passed (wide:
    on two busy cores the workers' start alone has taken 40 s; the wait itself is timed inside)."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="ds_lowcomm_") as store_dir:
        procs = [ctx.Process(target=_stalling_worker, args=(r, 2, store_dir, where, timeout_s)) for r in range(2)]
        for p in procs:
            p.start()
        try:
            procs[0].join(timeout=deadline_s)
            still_waiting = procs[0].is_alive()
        finally:
            for p in procs:  # SIGKILL ends a stopped process too
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join()
        assert not still_waiting, f"rank 0 still waiting {deadline_s:g} s after start (lowcomm.timeout_s {timeout_s:g})"
        path = os.path.join(store_dir, "result0.pt")
        assert os.path.exists(path), f"rank 0 left without a result (exit code {procs[0].exitcode})"
        result = torch.load(path, weights_only=True)
        assert "crash" not in result, result["crash"]
        return result


@pytest.mark.parametrize("where, timeout_s, steps, op", [
    ("step", 5.0, STALL_STEP, "sparse_all_gather"),  # DeMo's exchange at step 3
    ("all_reduce", 3.0, STALL_STEP, "outer_compressed_all_reduce_scatter"),  # its first phase, an all-to-all
    ("build", 3.0, 0, "setup"),  # build_optimizer's check that every rank has the same settings
    ("shard", 3.0, STALL_STEP, "replica_broadcast"),  # the owners' broadcast inside a replica
])
def test_a_stopped_peer_ends_the_plain_path_wait_within_timeout_s(where, timeout_s, steps, op):
    result = _run_with_a_stopped_peer(where, timeout_s)
    assert result["error"] is not None, result
    assert result["steps"] == steps, result  # the steps before the stall went through
    assert 0.8 * timeout_s < result["waited"] < 3 * timeout_s, result
    error = result["error"]
    assert error.startswith(f"{op}:") and "ranks [0, 1]" in error and "a peer stalled or died" in error, error
    assert f"lowcomm.timeout_s = {timeout_s:g}" in error, error


@pytest.mark.parametrize("value", [0, -1, "10", float("inf"), True])
def test_timeout_s_is_checked(value):
    with pytest.raises(ConfigError, match=r"lowcomm\.timeout_s must be a number > 0; got "):
        LowcommConfig.from_dict({"method": "demo", "timeout_s": value})
    with pytest.raises(ConfigError, match=r"comm\.timeout_s must be a number > 0; got "):
        CommSettings.from_flat({"timeout_s": value}, where="comm")
