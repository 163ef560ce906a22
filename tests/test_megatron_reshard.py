"""Megatron's distributed checkpoints (torch_dist) with ds_lowcomm's state reshard: saved at
TP 1 x DP 2, loaded at TP 2 x DP 1 and at PP 2 x DP 1, by real Megatron-Core modules, optimizer
and dist_checkpointing in 2 real processes (gloo, CPU shim).

The reference is independent of the loader: the parameters (and Megatron's Adam moments) each
replica held when it saved, whole (TP 1, PP 1); after the load each rank's tensors are gathered
across the tensor-parallel group and concatenated along the axis Megatron splits them on, and
the pipeline stages' local layer numbers are shifted to the model's, then compared, bit for bit.
DeMo's momentum, which differs between the replicas, is refused by name at the new replica
count; the outer methods' inner Adam and error feedback start every new replica at the
replicas' mean.
"""

import os

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the 'megatron' extra)")

from lowcomm_task.workers import run_local_workers  # noqa: E402
from tests.megatron_train import train, whole_tensors  # noqa: E402

LAYERS = 2  # megatron_train's GPTModel
CASES = {  # name: (lowcomm, steps before the save): the outer methods save right after a sync
    "stock": (None, 2),
    "adamw": ({"method": "adamw"}, 2),
    "diloco": ({"method": "diloco", "sync_every": 2}, 2),
    "mtdao": ({"method": "mtdao", "sync_every": 2}, 2),
    # one sign bit an element through the compressed all-reduce, and with exchange auto (the
    # all-gather at 2 replicas, the record "auto" whatever it picks); right after a sync, where the
    # replicas' parameters agree and their residuals (what each has still to send) do not
    "dct_diloco": ({"method": "dct_diloco", "sync_every": 2, "topk": 256, "chunk": 16, "transform": "none",
                    "value_dtype": "sign", "exchange": "all_reduce"}, 2),
    "dct_diloco_auto": ({"method": "dct_diloco", "sync_every": 2, "topk": 256, "chunk": 16, "transform": "none",
                         "value_dtype": "sign"}, 2),
    "demo": ({"method": "demo", "topk": 8, "chunk": 16}, 2),
    # bf16: Megatron's fp32 main copies (and their Adam state) follow their bf16 parameters
    "diloco_bf16": ({"method": "diloco", "sync_every": 2}, 2),
    # ds_lowcomm's first format (per rank), mid-interval: loads at its own layout, refused at another
    "sparseloco_v1": ({"method": "sparseloco", "sync_every": 4}, 2),
}
TARGETS = ((2, 1), (1, 2))  # (tp, pp), one replica


def _init(tp, pp):
    from megatron_patches import cpu_shim
    cpu_shim.install()  # before megatron (a no-op with a GPU)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1234)


def _adam_moments(opt, model) -> dict:
    """Megatron's Adam exp_avg of each model parameter (by its name), wherever it sits."""
    from megatron_patches.wrapper import chained, model_params_of_mains, torch_optimizer

    megatron = getattr(opt, "optimizer", opt)
    model_of = model_params_of_mains(megatron)
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for o in chained(megatron):
        adam = torch_optimizer(o)
        if not isinstance(adam, torch.optim.Adam):
            continue
        for p, state in adam.state.items():
            if "exp_avg" in state:
                out[names[id(model_of.get(id(p), p))]] = state["exp_avg"].detach().clone()
    return out


def _residuals(opt, model) -> dict:
    """The outer loop's error feedback of each model parameter (by its name)."""
    from megatron_patches.wrapper import model_params_of_mains

    model_of = model_params_of_mains(getattr(opt, "optimizer", opt))
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(model_of.get(id(p), p))]: opt.outer.state[p]["residual"].detach().clone()
            for p in opt.outer._current_params() if "residual" in opt.outer.state[p]}


def _save_v1(opt, metadata):
    """ds_lowcomm's first torch_dist format, as it was written (every tensor of the wrapper's
    state and its stepped parameters flattened under a key naming the rank): old checkpoints."""
    import torch.distributed as dist

    from megatron_patches import sharded_state as ss
    from megatron_patches.internals import SHARDED_TENSOR, live

    tensors = []
    skeleton = ss.split({"state": opt.state_dict(), "params": opt.stepped_params()}, tensors)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, {"skeleton": skeleton, "specs": [(list(t.shape), str(t.dtype)) for t in tensors]})
    metadata[ss.METADATA_KEY] = {"format": 1, "method": opt.method, "layout": ss.layout(), "ranks": everyone}
    return {ss.TENSORS_KEY: {str(i): live(SHARDED_TENSOR).from_rank_offsets(
        f"ds_lowcomm.rank_{dist.get_rank():05d}.{i}", t.detach().reshape(-1), replica_id=0)
        for i, t in enumerate(tensors) if t.numel()}}


def _state_tensors(opt) -> list:
    from megatron_patches.sharded_state import split

    tensors = []
    split(opt.state_dict(), tensors)
    return [t.clone() for t in tensors]


def _reshard_worker(rank, world, directory):
    from megatron.core import parallel_state as ps

    from ds_lowcomm.checkpoint_io import CheckpointError
    from megatron_patches.checkpoint import load_dist, save_dist

    out = {}
    for case, (lowcomm, steps) in CASES.items():
        path = os.path.join(directory, case)
        _init(1, 1)  # TP 1 x DP 2
        bf16 = case.endswith("_bf16")
        model, opt, _, _ = train(lowcomm, steps, bf16=bf16)
        saved = {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
                 "exp_avg": _adam_moments(opt, model)}
        v1 = case.endswith("_v1")
        if v1:
            saved["state"] = _state_tensors(opt)
            opt.sharded_state_dict = lambda model_sd, is_loading=False, metadata=None: _save_v1(opt, metadata)
        if case.startswith("dct_diloco"):
            saved["residual"] = _residuals(opt, model)
        save_dist(path, steps, [model], opt)
        ps.destroy_model_parallel()
        out[case] = {"saved": saved}
        for tp, pp in ((1, 1),) + TARGETS if v1 or case.startswith("dct_diloco") else TARGETS:
            _init(tp, pp)
            got = {}

            def load(opt, model):
                try:
                    got["iteration"] = load_dist(path, [model], opt)
                except CheckpointError as err:
                    got["refused"] = str(err)
                    return
                got["params"] = whole_tensors(model, {n: p.detach().clone() for n, p in model.named_parameters()})
                got["exp_avg"] = whole_tensors(model, _adam_moments(opt, model))
                if v1:
                    got["state"] = _state_tensors(opt)
                if case.startswith("dct_diloco"):
                    got["residual"] = whole_tensors(model, _residuals(opt, model))

            try:  # after the load, one more step at the new layout (the loaded state steps)
                _, _, losses, _ = train(lowcomm, 1, micro=2 if pp > 1 else 1, bf16=bf16, after_apply=load)
                got["loss_after"] = losses[-1]
            except Exception as err:  # noqa: BLE001  (reported)
                got.setdefault("error", f"{type(err).__name__}: {err}")
            out[case][(tp, pp)] = got
            ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path on every machine (the shim is a no-op with a GPU)
    try:
        return run_local_workers(_reshard_worker, 2, str(tmp_path_factory.mktemp("reshard")), threads=1)
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden


def _assert_equal(got: dict, want: dict, what):
    assert sorted(got) == sorted(want), what
    for name in want:
        assert torch.equal(got[name], want[name]), (what, name)


@pytest.mark.parametrize("case", ["stock", "adamw", "diloco", "mtdao", "diloco_bf16"])
def test_resumes_at_another_tensor_and_pipeline_layout(results, case):
    """TP 1 x DP 2 -> TP 2 x DP 1 and PP 2 x DP 1: every parameter equals the one saved (the
    replicas' are equal where these save), the loaded state steps on."""
    r0, r1 = results
    assert all(torch.equal(r0[case]["saved"]["params"][n], r1[case]["saved"]["params"][n])
               for n in r0[case]["saved"]["params"])
    for r in results:
        for target in TARGETS:
            got = r[case][target]
            assert "refused" not in got and "error" not in got, (target, got.get("refused") or got.get("error"))
            assert got["iteration"] == CASES[case][1]
            mine = {n: t for n, t in r0[case]["saved"]["params"].items() if n in got["params"]}
            assert len(mine) == len(got["params"]) and got["params"], target
            _assert_equal(got["params"], mine, (case, target))
            if case in ("stock", "adamw"):  # Megatron's Adam moments follow too (equal across replicas)
                saved = {n: t for n, t in r0[case]["saved"]["exp_avg"].items() if n in got["exp_avg"]}
                _assert_equal(got["exp_avg"], saved, (case, target, "exp_avg"))
            if target[1] == 1 or r is results[-1]:  # the last pipeline stage reports a loss
                assert got["loss_after"] is not None and got["loss_after"] == got["loss_after"]


@pytest.mark.parametrize("case", ["diloco", "diloco_bf16"])
def test_outer_inner_adam_is_the_replicas_mean(results, case):
    """DiLoCo's inner Adam differs between the replicas (each its own data); one replica resumes
    with their mean moments."""
    r0, r1 = results
    a, b = r0[case]["saved"]["exp_avg"], r1[case]["saved"]["exp_avg"]
    assert any(not torch.equal(a[n], b[n]) for n in a)
    for r in results:
        for target in TARGETS:
            got = r[case][target]["exp_avg"]
            assert got
            for name, t in got.items():
                torch.testing.assert_close(t, ((a[name].double() + b[name].double()) / 2).float(), rtol=0, atol=0)


def test_demo_momentum_cannot_follow_a_new_replica_count(results):
    for r in results:
        for target in TARGETS:
            why = r["demo"][target].get("refused", "")
            assert "demo state that differs between its 2 data-parallel replicas" in why, why
            assert "DeMo's momentum" in why and "cannot follow a new replica count (1)" in why, why


@pytest.mark.parametrize("case", ["dct_diloco", "dct_diloco_auto"])
def test_error_feedback_follows_a_new_replica_count_as_the_replicas_mean(results, case):
    """dct_diloco saved after a sync, through the compressed all-reduce and with exchange auto: at
    the same layout each replica loads its own residuals, bit for bit; at one replica (TP 2 or PP
    2) the residuals are the two replicas' mean (what the next sync would send of them), and it
    steps on."""
    r0, r1 = results
    a, b = r0[case]["saved"]["residual"], r1[case]["saved"]["residual"]
    assert a and any(not torch.equal(a[n], b[n]) for n in a)  # they differ between the replicas
    for r in results:
        same = r[case][(1, 1)]
        assert "refused" not in same and "error" not in same, same.get("refused") or same.get("error")
        _assert_equal(same["residual"], r[case]["saved"]["residual"], (case, "same layout"))
        for target in TARGETS:
            got = r[case][target]
            assert "refused" not in got and "error" not in got, (target, got.get("refused") or got.get("error"))
            assert got["residual"]
            for name, t in got["residual"].items():
                torch.testing.assert_close(t, ((a[name].double() + b[name].double()) / 2).float(), rtol=0, atol=0)
            if target[1] == 1 or r is results[-1]:
                assert got["loss_after"] is not None and got["loss_after"] == got["loss_after"]


def test_first_format_loads_at_its_own_layout_only(results):
    """A checkpoint of ds_lowcomm's first torch_dist format (per rank; sparseloco between syncs)
    loads exactly at its layout (every tensor of the method's state as saved) and is refused at
    another, saying why."""
    for r in results:
        case = r["sparseloco_v1"]
        got = case[(1, 1)]
        assert "refused" not in got and "error" not in got, got
        _assert_equal(got["params"], case["saved"]["params"], "v1")
        assert len(got["state"]) == len(case["saved"]["state"])
        assert all(torch.equal(a, b) for a, b in zip(got["state"], case["saved"]["state"]))
        for target in TARGETS:
            why = case[target].get("refused", "")
            assert "in ds_lowcomm's first format (the method's state per rank)" in why, why
