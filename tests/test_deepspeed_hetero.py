"""Replicas of different shapes in one job (lowcomm.replicas): a whole-model replica beside
pipelined replicas, synced by parameter name. Real processes, real DeepSpeed engines (each
replica its own DeepSpeed world), gloo.

Layouts: 3 ranks = [1 rank] + [2 stages]; 4 ranks = [1 rank] + [3 stages]; 4 ranks =
[2 ranks ZeRO-1] + [2 stages]."""

import math
import os

import pytest
import torch

from lowcomm_task.workers import run_local_workers

from .test_deepspeed_pipeline import Regression  # the same data as the homogeneous pipeline tests

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def layers(seed):
    torch.manual_seed(seed)  # every rank differently: the start-up broadcast by name must fix it
    return [torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
            torch.nn.Linear(32, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)]


def config(method, replicas, stage=0):
    return {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "steps_per_print": 10**6,
            "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage}, "lowcomm": {**method, "replicas": replicas}}


def _methods_worker(rank, world, methods, replicas):
    return {name: _worker(rank, world, method, replicas, 0, 2, False) for name, method in methods.items()}


def _worker(rank, world, method, replicas, stage, outer_steps, record_locals):
    import deepspeed.comm
    from deepspeed.pipe import PipelineModule

    import ds_lowcomm.deepspeed as dl

    cfg = config(method, replicas, stage)
    from ds_lowcomm.settings import ConfigError

    try:  # ranks that do not add up to the job's: refused on every rank before anything starts
        dl.replica_layout(config(method, [{"ranks": 2}, {"ranks": world}], stage))
        refused = None
    except ConfigError as err:
        refused = str(err)
    place = dl.replica_layout(cfg)
    module = PipelineModule(layers=layers(rank), num_stages=place.pipeline_stages,
                            loss_fn=torch.nn.functional.mse_loss, partition_method="uniform")
    engine, _, loader, _ = dl.initialize(model=module, config=cfg, training_data=Regression())
    names = {id(p): n for n, p in engine.module.named_parameters()}
    locals_ = {}
    if record_locals:  # the replicas' own parameters just before each outer sync (the reference's inputs)
        method_class = type(engine.lowcomm.optimizer)
        combine = method_class._start_combine

        def recording(self, params, deltas):
            locals_[len(locals_)] = {names[id(p)]: p.detach().clone() for p in params}
            return combine(self, params, deltas)

        method_class._start_combine = recording  # this process only
    h = place.spec.inner_steps or method.get("sync_every", 1)
    it = iter(loader) if loader is not None else None  # middle stages read nothing
    data = Regression()
    held_out = [(data.x[i : i + 4], data.y[i : i + 4]) for i in range(0, 64, 4)]

    def evaluate():
        return engine.eval_batch(iter(held_out), num_micro_batches=len(held_out)).item()

    start_loss = evaluate()
    losses, synced = [], []
    for step in range(1, outer_steps * h + 1):
        losses.append(engine.train_batch(it).item())
        if step % h == 0:
            synced.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})
    return {"refused": refused, "replica": place.index, "losses": losses, "eval": (start_loss, evaluate()), "synced": synced, "locals": locals_,
            "bytes": engine.lowcomm.ledger.sent, "activation_bytes": engine.lowcomm.summary()["activation_bytes_sent"],
            "batch": engine.train_batch_size()}


def _agree(results, which):
    """Every parameter, by name, equal across every rank that holds it after outer sync ``which``."""
    seen = {}
    for r in results:
        for name, value in r["synced"][which].items():
            if name in seen:
                assert torch.equal(seen[name], value), name
            seen[name] = value
    return seen


WEIGHTED = {"method": "diloco", "sync_every": 4, "outer_lr": 1.0, "outer_momentum": 0.0}


def test_three_ranks_whole_plus_two_stages_weighted_outer_step():
    """A = rank 0 (4 inner steps), B = ranks 1-2 as 2 stages (2 inner steps, int8 activations).
    After each DiLoCo outer step (outer lr 1, no momentum) every parameter equals the tokens-weighted
    mean of the replicas' own parameters (weights 4 : 2), computed here by name from what each
    replica held before the sync; every parameter agrees across replicas."""
    replicas = [{"ranks": 1}, {"ranks": 2, "pipeline_stages": 2, "inner_steps": 2,
                                "activations": {"forward": "int8", "backward": "int8"}}]
    results = run_local_workers(_worker, 3, WEIGHTED, replicas, 0, 2, True)
    assert [r["replica"] for r in results] == [0, 1, 1]
    assert all("add up to 5 (2 + 3) but the job has 3 ranks" in r["refused"] for r in results)
    assert all(r["batch"] == 8 * 2 for r in results)  # 4 x 2 accumulation x 2 data-parallel ranks (1 per replica)
    for which in range(2):
        agreed = _agree(results, which)
        assert len(agreed) == 8  # 4 Linear layers' weights and biases
        for name, value in agreed.items():
            a = results[0]["locals"][which][name]
            b = next(r["locals"][which][name] for r in results[1:] if name in r["locals"][which])
            expect = (4 * a + 2 * b) / 6
            assert torch.allclose(value, expect, atol=1e-6), (name, (value - expect).abs().max())
            assert not torch.allclose(value, (a + b) / 2, atol=1e-4)  # not an unweighted mean
    assert results[0]["activation_bytes"] == 0 and results[1]["activation_bytes"] > 0
    assert all(r["bytes"] > 0 for r in results)


SPARSELOCO = {"method": "sparseloco", "sync_every": 3, "topk": 32, "chunk": 64}


@pytest.mark.parametrize("layout", ["1+3stages", "2zero1+2stages"])
def test_four_rank_layouts_train_and_agree(layout):
    """SparseLoCo on 4 ranks: parameters agree by name across replicas after every outer step,
    whatever the stage boundaries or ZeRO-1 partition edges; the loss falls on every replica."""
    if layout == "1+3stages":
        replicas, stage = [{"ranks": 1}, {"ranks": 3, "pipeline_stages": 3,
                                          "activations": {"forward": "lowrank", "backward": "int8"}}], 0
    else:
        replicas, stage = [{"ranks": 2}, {"ranks": 2, "pipeline_stages": 2}], 1
    results = run_local_workers(_worker, 4, SPARSELOCO, replicas, stage, 6, False)
    for which in range(6):
        assert len(_agree(results, which)) == 8
    for r in results:  # held-out loss, the same batches before and after (every replica, after a sync)
        assert r["eval"][1] < 0.8 * r["eval"][0], (r["replica"], r["eval"])
    assert len({round(r["eval"][1], 6) for r in results}) == 1  # one model after the last sync


@pytest.mark.parametrize("change, message", [
    ({"replicas": [{"ranks": 3, "pipeline_stages": 2}]}, "lowcomm.replicas[0].pipeline_stages must divide"),
    ({"replicas": [{"ranks": 1}, {"size": 2}]}, "lowcomm.replicas[1]: unknown key(s) size"),
    ({"replicas": [{"ranks": 1, "activations": {"forward": "int8"}}]}, "need pipeline_stages > 1"),
    ({"replicas": [{"ranks": 1}, {"ranks": 1, "inner_steps": 2}], "method": "demo"}, "setting(s) sync_every do not apply to method 'demo'"),
    ({"replicas": [{"ranks": 1}], "replica_size": 1}, "give one"),
    ({"replicas": [{"ranks": 1}], "fragments": 2, "sync_delay": 1}, "lowcomm.fragments must be 1"),
    ({"replicas": [{"ranks": 1}], "sync_every_schedule": [[8, 6]]}, "lowcomm.sync_every_schedule is not supported with lowcomm.replicas"),
    ({"replicas": []}, "non-empty list"),
    ({"replicas": [{"ranks": 0}]}, "lowcomm.replicas[0].ranks must be a positive integer"),
])
def test_bad_replica_layouts_are_refused_by_name(change, message):
    from ds_lowcomm.deepspeed.config import split_config
    from ds_lowcomm.settings import ConfigError

    cfg = config({"method": "diloco", "sync_every": 4}, [{"ranks": 1}])
    cfg["lowcomm"].update(change)
    with pytest.raises(ConfigError) as err:
        split_config(cfg)
    assert message in str(err.value)


def test_zero2_is_refused_with_replicas():
    from ds_lowcomm.deepspeed.config import split_config
    from ds_lowcomm.settings import ConfigError

    with pytest.raises(ConfigError, match="zero_optimization.stage must be 0 or 1 with lowcomm.replicas"):
        split_config(config({"method": "diloco"}, [{"ranks": 1}], stage=2))


def _task_worker(rank, world, workdir):
    from .test_deepspeed import _run, ds_config

    cfg = ds_config("sparseloco")
    del cfg["lowcomm"]["replica_size"]
    cfg["lowcomm"]["replicas"] = [{"ranks": 1}, {"ranks": 2, "pipeline_stages": 2,
                                                  "activations": {"forward": "int8", "backward": "int8"}}]
    save = os.path.join(workdir, "ckpt")
    full = _run(cfg, workdir, "hetero", "--save-dir", save, "--save-at", "4")  # inside the 2nd interval (H 3)
    resumed = _run(cfg, workdir, "hetero", "--save-dir", save, "--resume")
    return {"full": full, "resumed": resumed}


def test_reference_task_with_replicas_of_two_shapes_resumes_exactly(tmp_path):
    """launch/train.py's body on 3 ranks, lowcomm.replicas [1 rank] + [2 stages, int8 activations]:
    the GPT trains (held-out loss below uniform), only the pipelined replica sends activations,
    both replicas send the method's bytes, and a resume from step 4 ends bit-identical (every
    rank's parameters, the ledgers' bytes, the held-out loss)."""
    results = run_local_workers(_task_worker, 3, str(tmp_path))
    full, resumed = results[0]["full"], results[0]["resumed"]
    hist = full["history"]
    assert hist[-1]["val_loss"] < hist[0]["val_loss"] and hist[-1]["val_loss"] < math.log(256), hist
    act = [ledger["activations"]["bytes_sent"] for ledger in full["ledgers"]]
    assert act[0] == 0 and act[1] > 0 and act[2] > 0
    assert all(ledger["method"]["bytes_sent"] > 0 for ledger in full["ledgers"])
    assert full["params_digests"] == resumed["params_digests"]
    # every ledger's totals count the whole run after the resume (the method's, DeepSpeed's own
    # inside a replica, the activations between stages), as the uninterrupted run's
    for kind in ("method", "engine", "activations"):
        assert [l[kind]["bytes_sent"] for l in full["ledgers"]] == [l[kind]["bytes_sent"] for l in resumed["ledgers"]], kind
    assert resumed["history"][-1]["val_loss"] == hist[-1]["val_loss"]


PER_STEP = {"adamw": {"method": "adamw"}, "demo": {"method": "demo", "topk": 4, "chunk": 8},
            "mtdao": {"method": "mtdao", "sync_every": 2, "sync_codec": "topk", "topk": 8, "chunk": 8},
            "dct_diloco": {"method": "dct_diloco", "sync_every": 2, "topk": 8, "chunk": 8}}


def test_every_method_syncs_by_name_across_shapes():
    """The per-step methods (and mtdao's compressed syncs, dct_diloco's), same 3-rank layout with
    int8 activations: after their syncs every parameter agrees by name, and the held-out loss fell."""
    replicas = [{"ranks": 1}, {"ranks": 2, "pipeline_stages": 2, "activations": {"forward": "int8", "backward": "int8"}}]
    results = run_local_workers(_methods_worker, 3, PER_STEP, replicas)
    for name in PER_STEP:
        per_rank = [r[name] for r in results]
        for which in range(2):
            assert len(_agree(per_rank, which)) == 8, name
        assert all(r["eval"][1] < 0.8 * r["eval"][0] for r in per_rank), (name, [r["eval"] for r in per_rank])


def _mismatch_worker(rank, world):
    import ds_lowcomm.deepspeed as dl

    layout = [{"ranks": 1}, {"ranks": 1}] if rank == 0 else [{"ranks": 2}]
    try:
        dl.replica_layout(config({"method": "diloco", "sync_every": 2}, layout))
    except ValueError as err:
        return str(err)
    return None


def test_a_layout_that_differs_on_one_rank_is_refused_on_every_rank():
    for message in run_local_workers(_mismatch_worker, 2):
        assert message is not None and "lowcomm.replicas" in message and "differ across ranks" in message


def _save_worker(rank, world, workdir):
    """Replicas [2 ranks] + [1 rank] (global rank 0 in replica 0): a save whose replica 1 is slow,
    then one whose replica 1 fails."""
    import json
    import time

    import ds_lowcomm.deepspeed as dl

    from .conftest import tiny_loss, tiny_model

    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
           "lowcomm": {"method": "diloco", "sync_every": 2, "timeout_s": 60,
                       "replicas": [{"ranks": 2}, {"ranks": 1}]}}
    dl.replica_layout(cfg)
    engine, *_ = dl.initialize(model=tiny_model(), config=cfg)
    for step in range(2):
        engine.backward(tiny_loss(engine.module, rank, step))
        engine.step()
    ce, out = engine.checkpoint_engine, {}
    real_save = ce.save

    def slow_save(state_dict, path):
        time.sleep(3)
        return real_save(state_dict, path)

    if rank == 2:
        ce.save = slow_save
    engine.save_checkpoint(workdir, tag="slow")
    if rank == 0:  # replica 1's files were complete before `latest` and lowcomm.json moved
        replica1 = os.path.join(workdir, "replica00001", "slow", "mp_rank_00_model_states.pt")
        out["published_after_replica1"] = min(os.path.getmtime(os.path.join(workdir, n))
                                              for n in ("latest", "lowcomm.json")) >= os.path.getmtime(replica1)

    def failing_save(state_dict, path):
        raise OSError(28, "No space left on device")

    if rank == 2:
        ce.save = failing_save
    try:
        engine.save_checkpoint(workdir, tag="failed")
        out["error"] = None
    except Exception as err:  # noqa: BLE001 - the test reads what every rank raised
        out["error"] = str(err)
    if rank == 0:
        with open(os.path.join(workdir, "latest")) as f:
            out["latest"] = f.read().strip()
        with open(os.path.join(workdir, "lowcomm.json")) as f:
            out["meta_latest"] = json.load(f)["latest"]
        out["failed_exported"] = os.path.exists(os.path.join(workdir, "failed"))
    return out


def test_a_replica_slow_or_failing_to_save_never_leaves_latest_naming_an_unfinished_checkpoint(tmp_path):
    """Global rank 0 publishes (`latest`, lowcomm.json, the export) only once every replica's save
    is done: DeepSpeed's closing barrier spans one replica under lowcomm.replicas. A failure in
    replica 1's save stops every rank with the error, and `latest` still names the last good save."""
    results = run_local_workers(_save_worker, 3, str(tmp_path))
    assert results[0]["published_after_replica1"]
    for r in results:
        assert r["error"] is not None and "checkpoint 'failed' not saved" in r["error"], r["error"]
        assert "rank 2: OSError" in r["error"] and "No space left on device" in r["error"], r["error"]
    assert results[0]["latest"] == results[0]["meta_latest"] == "slow"
    assert not results[0]["failed_exported"]


def _sync_count_worker(rank, world):
    """Replicas [1 rank, 4 inner steps] + [1 rank, 2 inner steps], diloco: a loop of syncs x
    place.steps_per_sync steps, then a loop of the same 8 steps on every replica."""
    import ds_lowcomm.deepspeed as dl
    from ds_lowcomm.comm import CollectiveError

    from .conftest import params_digest, tiny_loss, tiny_model

    cfg = {"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "zero_optimization": {"stage": 0},
           "lowcomm": {"method": "diloco", "sync_every": 3, "timeout_s": 120,
                       "replicas": [{"ranks": 1, "inner_steps": 4}, {"ranks": 1, "inner_steps": 2}]}}
    place = dl.replica_layout(cfg)
    out = {"steps_per_sync": place.steps_per_sync}

    def train(steps):
        engine, *_ = dl.initialize(model=tiny_model(), config=cfg)
        for step in range(steps):
            engine.backward(tiny_loss(engine.module, rank, step))
            engine.step()
        engine.lowcomm.done()
        return engine

    engine = train(2 * place.steps_per_sync)  # 2 syncs on each replica
    out["digest"], out["syncs"] = params_digest(engine.module), engine.lowcomm.ledger.by_op["outer_all_reduce"][0]
    try:
        train(8)  # 2 syncs on replica 0, 4 on replica 1
        out["error"] = None
    except CollectiveError as err:
        out["error"] = str(err)
    return out


def test_replicas_that_run_different_numbers_of_syncs_are_told_at_the_first_sync_one_never_joins():
    """place.steps_per_sync is each replica's inner_steps: a loop of 2 syncs x steps_per_sync ends
    with identical parameters. The same 8 steps on every replica make replica 1 (2 inner steps)
    wait at its sync 3 for replica 0, which ran its 2 syncs and is done: replica 1 raises at once,
    naming both ranks and the steps per sync, instead of waiting timeout_s (120 s) for a peer."""
    results = run_local_workers(_sync_count_worker, 2)
    assert [r["steps_per_sync"] for r in results] == [4, 2]
    assert results[0]["digest"] == results[1]["digest"]
    assert [r["syncs"] for r in results] == [2, 2]
    assert results[0]["error"] is None
    message = results[1]["error"]
    assert message is not None and "rank 1 (replica 1) is at its sync 3" in message, message
    assert "rank 0 (replica 0) left the syncs after 2 (done)" in message, message
    assert "steps per sync: replica 0: 4, replica 1: 2" in message, message
