"""Muon's step inside DeepSpeed at every ZeRO stage and in bf16, from a user's own script: demo's
update muon and DeepSpeed's own Muon (``"optimizer": {"type": "Muon"}``) as the inner optimizer of
an outer method, with each matrix assembled from the replica's ZeRO partitions before
Newton-Schulz. Checked against ZeRO 0 in fp32 (whole matrices, nothing assembled) and against
DeepSpeed's own ZeRO Muon stepping the same data. One launch of 4 real processes (2 replicas of
2 ranks), real DeepSpeed engines, gloo."""

import contextlib
import io
import json
import os
from pathlib import Path

import pytest
import torch

from lowcomm_task.workers import run_local_workers

os.environ.setdefault("DS_ACCELERATOR", "cpu")

STEPS = 4
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# demo's codec lossless here (every component of every block, no transform), so that ZeRO's cut
# pieces and ZeRO 0's whole tensors exchange the same momenta: the stages differ only in where
# Newton-Schulz runs (on a matrix assembled from pieces, or whole)
DEMO = {"method": "demo", "update": "muon", "topk": 64, "chunk": 8, "transform": "none", "decay": 0.9}
DILOCO = {"method": "diloco", "sync_every": 2}
# ds_lowcomm's own inner Muon (torch's Muon on the hidden matrices, AdamW on the rest)
OWN_MUON = {**DILOCO, "inner_optimizer": "muon", "inner_muon_lr": 0.02, "inner_muon_momentum": 0.9}
MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9, "weight_decay": 0.01,
                                   "torch_adam": True}}
ADAMW = {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}}


class Net(torch.nn.Module):
    """An embedding, three hidden matrices with biases and an untied output head, sized so that
    ZeRO 1/2's two partitions cut a matrix in two."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(32, 16)  # names DeepSpeed's own tagging reads (embed, lm_head)
        self.fc1 = torch.nn.Linear(16, 24)
        self.fc2 = torch.nn.Linear(24, 24)
        self.lm_head = torch.nn.Linear(24, 32, bias=False)

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, x, y):
        h = torch.tanh(self.fc2(torch.tanh(self.fc1(self.embed(x)))))
        return torch.nn.functional.cross_entropy(self.lm_head(h).flatten(0, 1), y.flatten())


def _config(lowcomm, optimizer, stage, bf16=False):
    out = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "steps_per_print": 10**6,
           "optimizer": optimizer, "zero_optimization": {"stage": stage}}
    if bf16:
        out["bf16"] = {"enabled": True}
    if lowcomm is not None:
        out["lowcomm"] = lowcomm
    return out


def _batch(rank, step):
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randint(0, 32, (4, 6), generator=g)
    return x, (x * 7 + 3) % 32


def _full_params(engine, stage):
    import deepspeed

    named = dict(engine.module.named_parameters())
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(named.values())):
            return {n: p.detach().float().clone() for n, p in named.items()}
    return {n: p.detach().float().clone() for n, p in named.items()}


def _engine(initialize, lowcomm, optimizer, stage, bf16=False, accumulate=1):
    torch.manual_seed(0)
    model = Net()
    config = _config(lowcomm, optimizer, stage, bf16)
    config.update(train_micro_batch_size_per_gpu=4 // accumulate, gradient_accumulation_steps=accumulate)
    engine, *_ = initialize(model=model, model_parameters=[p for p in model.parameters()], config=config)
    return engine


def _steps(engine, rank, steps, accumulate=1):
    """Each step's batch of 4 (_batch) in ``accumulate`` micro-batches."""
    for step in steps:
        x, y = _batch(rank, step)
        for xs, ys in zip(x.chunk(accumulate), y.chunk(accumulate)):
            engine.backward(engine(xs, ys))
            engine.step()


def _resume_and_accumulate(lowcomm, optimizer, stage, bf16, rank, workdir, name):
    """4 steps (H 2: syncs at steps 2 and 4) with a checkpoint after step 3 (mid-interval), resumed
    from it by a new engine; and the same 4 steps in 2 micro-batches each (gradient accumulation 2)."""
    import torch.distributed as dist

    import ds_lowcomm.deepspeed as dl

    ckpt = os.path.join(workdir, name)
    full = _engine(dl.initialize, lowcomm, optimizer, stage, bf16)
    _steps(full, rank, range(3))
    full.save_checkpoint(ckpt)
    _steps(full, rank, range(3, 4))
    resumed = _engine(dl.initialize, lowcomm, optimizer, stage, bf16)
    resumed.load_checkpoint(ckpt)
    _steps(resumed, rank, range(3, 4))
    accumulated = _engine(dl.initialize, lowcomm, optimizer, stage, bf16, accumulate=2)
    _steps(accumulated, rank, range(4), accumulate=2)
    dist.barrier()
    return {"full": _masters(full), "resumed": _masters(resumed), "accumulated": _masters(accumulated),
            "bytes": (full.lowcomm.ledger.sent, resumed.lowcomm.ledger.sent, accumulated.lowcomm.ledger.sent)}


def _masters(engine):
    """Every parameter's fp32 master, whole (DeepSpeed's public accessor: at ZeRO 1-3, in bf16 too; at
    ZeRO 0 in fp32, where it has none, the parameter is the master)."""
    from deepspeed.utils import safe_get_full_fp32_param

    masters = {n: safe_get_full_fp32_param(p) for n, p in engine.module.named_parameters()}
    return {n: (p if masters[n] is None else masters[n]).detach().float().clone()
            for n, p in engine.module.named_parameters()}


def _run(initialize, lowcomm, optimizer, stage, rank, bf16=False):
    torch.manual_seed(0)
    model = Net()
    engine, *_ = initialize(model=model, model_parameters=[p for p in model.parameters()],
                            config=_config(lowcomm, optimizer, stage, bf16))
    for step in range(STEPS):
        x, y = _batch(rank, step)
        engine.backward(engine(x, y))
        engine.step()
    out = {"params": _full_params(engine, stage)}
    if hasattr(engine, "lowcomm"):
        s = engine.lowcomm.summary()
        out["assembly_bytes"] = s["matrix_assembly_bytes_sent"]
        out["ops"] = {op: row[0] for op, row in engine.lowcomm.ledger.by_op.items() if op != "setup"}
    return out


# Resumed and accumulated, per road: ds_lowcomm's own Muon and DeepSpeed's Muon section, with
# diloco and the one-bit recipe's format (configs/muloco_sign*.json's outer keys, H 2)
SIGN = {**json.loads((CONFIGS / "muloco_sign_zero2_bf16.json").read_text())["lowcomm"], "sync_every": 2}
RESUMED = {("own_muon_sign", 1, False): ({**SIGN, "inner_optimizer": "muon", "inner_muon_lr": 0.02}, ADAMW),
           ("own_muon_sign", 2, True): ({**SIGN, "inner_optimizer": "muon", "inner_muon_lr": 0.02}, ADAMW),
           ("own_muon_diloco", 3, False): (OWN_MUON, ADAMW),
           ("deepspeed_muon_sign", 3, True): (SIGN, MUON),
           # the top-k formats: sparseloco and dct_diloco keeping 8 of each block
           ("own_muon_sparseloco", 2, False): ({"method": "sparseloco", "sync_every": 2, "topk": 8, "chunk": 64,
                                                "inner_optimizer": "muon", "inner_muon_lr": 0.02}, ADAMW),
           ("deepspeed_muon_topk", 1, False): ({"method": "dct_diloco", "sync_every": 2, "topk": 8, "chunk": 8}, MUON),
           # the compressed all-reduce at ZeRO 0: each rank of a replica syncs its own parameters through it
           ("deepspeed_muon_all_reduce", 0, False): ({**SIGN, "exchange": "all_reduce"}, MUON)}
# The top-k formats send the k largest of each block: where fp32 sums of two micro-batches round
# otherwise, a selection near a tie flips (a step of that element in place of another)
TOPK = ("own_muon_sparseloco", "deepspeed_muon_topk")


def _worker(rank, world, workdir):
    import deepspeed
    import torch.distributed as dist
    import torch._dynamo

    import ds_lowcomm.deepspeed as dl

    torch._dynamo.config.disable = True  # DeepSpeed's Muon kernels eager (torch.compile costs minutes on a CPU)
    out = {}
    # DeepSpeed's own Muon at ZeRO 0 over all 4 ranks, built before any ds_lowcomm engine (it keeps
    # its mpu process-wide); our inner Muon in one replica of 4 ranks, before its first sync, must
    # step the same: at ZeRO 0 (DeepSpeed's optimizer on whole matrices) bit for bit, at ZeRO 2
    # (matrices assembled from the partitions) within fp32 rounding
    out["stock_muon_z0"] = _run(deepspeed.initialize, None, MUON, 0, rank)
    dist.barrier()
    for stage in (0, 2):
        out[("one_replica", stage)] = _run(dl.initialize, {"method": "diloco", "sync_every": 100, "replica_size": 4},
                                           MUON, stage, rank)
    printed = contextlib.redirect_stdout(io.StringIO())  # the first engines' printed lines
    lines = printed.__enter__()
    for stage, bf16 in ((0, False), (1, False), (2, False), (3, False), (0, True), (2, True)):
        if stage == 1:
            printed.__exit__(None, None, None)
            out["log_lines"] = lines.getvalue().splitlines()
        out[("demo", stage, bf16)] = _run(dl.initialize, {**DEMO, "replica_size": 2}, ADAMW, stage, rank, bf16)
        out[("diloco_muon", stage, bf16)] = _run(dl.initialize, {**DILOCO, "replica_size": 2}, MUON, stage, rank, bf16)
        out[("diloco_own_muon", stage, bf16)] = _run(dl.initialize, {**OWN_MUON, "replica_size": 2}, ADAMW, stage,
                                                     rank, bf16)
        dist.barrier()
    # the one-bit recipe's shipped configs as a user's script takes them (their optimizer, ZeRO and
    # precision sections, the recipe's outer keys; H 2 so that the 4 steps end on a sync), and the
    # Muon one at ZeRO 1 and 3 too
    for name, stage in (("muloco_sign_zero2_bf16", None), ("muloco_sign_zero2_bf16", 1),
                        ("muloco_sign_zero3_bf16", None), ("muloco_sign_zero1_bf16", None), ("adamw_sign", None)):
        cfg = json.loads((CONFIGS / f"{name}.json").read_text())
        stage = cfg["zero_optimization"]["stage"] if stage is None else stage
        bf16 = bool(cfg.get("bf16", {}).get("enabled"))
        lowcomm = {**cfg["lowcomm"], "sync_every": 2, "replica_size": 2}
        out[(name, stage)] = _run(dl.initialize, lowcomm, cfg["optimizer"], stage, rank, bf16)
        dist.barrier()
    for key, (lowcomm, optimizer) in RESUMED.items():
        _, stage, bf16 = key
        out[("resumed",) + key] = _resume_and_accumulate({**lowcomm, "replica_size": 2}, optimizer, stage, bf16,
                                                         rank, workdir, "-".join(map(str, key)))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_local_workers(_worker, 4, str(tmp_path_factory.mktemp("muon")))


def _max_diff(a, b):
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("kind", ["demo", "diloco_muon", "diloco_own_muon"])
def test_zero_stages_equal_zero0_fp32(runs, kind):
    """ZeRO 1/2/3 (matrices cut between a replica's ranks, assembled for Newton-Schulz) give ZeRO
    0's fp32 parameters within fp32 rounding; bf16 engines within bf16's; every rank the same."""
    ref = runs[0][(kind, 0, False)]["params"]
    for key in [k for k in runs[0] if isinstance(k, tuple) and k[0] == kind]:
        _, stage, bf16 = key
        for rank in range(4):
            got = runs[rank][key]
            # replicas bit-identical after the last sync (demo: every step; diloco: step 4)
            assert all(torch.equal(got["params"][n], runs[0][key]["params"][n]) for n in ref), (key, rank)
            tol = 2e-2 if bf16 else 2e-5
            assert _max_diff(got["params"], ref) < tol, (key, _max_diff(got["params"], ref))
        moved = _max_diff(runs[0][key]["params"], _initial())
        assert moved > 1e-3, (key, moved)
        assembled = runs[0][key]["assembly_bytes"]
        assert (assembled > 0) == (stage >= 1), (key, assembled)  # ZeRO 0 holds whole matrices


@pytest.mark.parametrize("key", [("muloco_sign_zero2_bf16", 2), ("muloco_sign_zero2_bf16", 1),
                                 ("muloco_sign_zero3_bf16", 3), ("muloco_sign_zero1_bf16", 1), ("adamw_sign", 1)])
def test_sign_recipe_configs_train_through_the_engine(runs, key):
    """configs/muloco_sign_zero2_bf16.json and _zero3_bf16.json (DeepSpeed's Muon section as the inner
    optimizer, at the user's dense settings; also at ZeRO 1), configs/muloco_sign_zero1_bf16.json
    (ds_lowcomm's own Muon at ZeRO 1 in bf16) and configs/adamw_sign.json (the user's AdamW)
    train through the real engine: replicas bit-identical after the sync, parameters moved, finite;
    the lowcomm sections are the recipe's outer keys alone (ds_lowcomm.optim.recipes.SIGN_OUTER)."""
    from ds_lowcomm.optim.recipes import SIGN_OUTER

    lowcomm = json.loads((CONFIGS / f"{key[0]}.json").read_text())["lowcomm"]
    own_muon = {k: lowcomm.pop(k) for k in ("inner_optimizer", "inner_muon_lr") if k in lowcomm}
    assert lowcomm == SIGN_OUTER and own_muon in ({}, {"inner_optimizer": "muon", "inner_muon_lr": 0.05})
    params = [runs[rank][key]["params"] for rank in range(4)]
    for n in params[0]:
        assert all(torch.equal(p[n], params[0][n]) for p in params[1:]), (key, n)
        assert torch.isfinite(params[0][n]).all(), (key, n)
    assert _max_diff(params[0], _initial()) > 1e-3
    assert runs[0][key]["ops"], key  # it exchanged


def test_inner_muon_is_deepspeeds_muon(runs):
    """DeepSpeed's Muon as the inner optimizer steps as DeepSpeed's own Muon on the same ranks and
    data (before any sync): bit for bit at ZeRO 0, within fp32 rounding at ZeRO 2 (its matrices
    assembled from the partitions, its momentum kept per partition). DeepSpeed 0.19.8's own ZeRO
    1/2 Muon is not the reference: on this model it steps its matrices 0.17x as far as its own
    ZeRO 0 Muon at the first step (docs/deepspeed.md)."""
    for rank in range(4):
        stock = runs[rank]["stock_muon_z0"]["params"]
        assert _max_diff(runs[rank][("one_replica", 0)]["params"], stock) == 0.0
        # (4 steps of Adam's half, whose small gradients' rounding its normalisation magnifies)
        assert _max_diff(runs[rank][("one_replica", 2)]["params"], stock) < 2e-4
    assert _max_diff(runs[0]["stock_muon_z0"]["params"], _initial()) > 1e-3


@pytest.mark.parametrize("key", list(RESUMED))
def test_muon_roads_resume_exactly_and_accumulate(runs, key):
    """ds_lowcomm's own Muon and DeepSpeed's Muon section inside diloco, the one-bit format and the
    top-k formats (sparseloco, dct_diloco) at ZeRO 1, 2 (bf16) and 3: a checkpoint saved mid-interval and resumed by a new engine gives the
    uninterrupted run bit for bit (the bytes sent too); gradient accumulation 2 (each step's batch
    in two micro-batches) gives accumulation 1's fp32 masters within fp32 rounding (in bf16, the
    median element within 1e-4 and at most 5% of elements, signs flipped by bf16's sums, apart):
    Newton-Schulz runs once per step, on the summed gradient; replicas bit-identical after the
    sync; parameters moved."""
    _, stage, bf16 = key
    results = [runs[rank][("resumed",) + key] for rank in range(4)]
    for rank, r in enumerate(results):
        for n in r["full"]:
            assert torch.equal(r["full"][n], r["resumed"][n]), (key, rank, n)
            assert torch.equal(r["full"][n], results[0]["full"][n]), (key, rank, n)  # replicas equal
        assert r["bytes"][0] == r["bytes"][1] == r["bytes"][2] > 0, (key, r["bytes"])
        diff = torch.cat([(r["accumulated"][n] - r["full"][n]).abs().flatten() for n in r["full"]])
        if bf16 or key[0] in TOPK:  # bf16's sums flip a few near-zero signs; fp32's, a top-k selection near a tie
            assert diff.median() < 1e-4 and (diff > 1e-3).float().mean() < 0.05, (key, diff.median(), diff.max())
        else:
            assert diff.max() < 1e-4, (key, diff.max())
    moved = torch.cat([(results[0]["full"][n] - p).abs().flatten() for n, p in _initial().items()])
    # (the top-k formats move only the elements they send) a Newton-Schulz per micro-batch would
    # differ by about this
    assert moved.max() > 5e-3 and (moved > 1e-3).float().mean() > 0.01, (moved.max(), (moved > 1e-3).float().mean())


def _initial():
    torch.manual_seed(0)
    return {n: p.detach().float().clone() for n, p in Net().named_parameters()}


def _split(lowcomm, optimizer=MUON, **extra):
    from ds_lowcomm.deepspeed.config import split_config

    return split_config({**_config(lowcomm, optimizer, extra.pop("stage", 2)), **extra})


@pytest.mark.parametrize("lowcomm, optimizer, message", [
    ({"method": "mtdao"}, MUON, "optimizer.type Muon: not with lowcomm.method mtdao"),
    ({"method": "adamw"}, MUON, "optimizer.type Muon: not with lowcomm.method adamw"),
    (DEMO, MUON, "optimizer.params.momentum: not with lowcomm.method demo (demo's momentum is lowcomm.decay)"),
    (DEMO, {"type": "Muon", "params": {"lr": 0.02, "betas": [0.9, 0.95]}}, "optimizer.params.betas: not with"),
    (DILOCO, {"type": "Muon", "params": {"lr": 0.02, "per_head_muon": True}}, "per_head_muon must be false"),
    (DILOCO, {"type": "Muon", "params": {"lr": 0.02, "ns_method": "svd"}}, "ns_method"),
    (DILOCO, {"type": "Muon", "params": {"lr": 0.02, "nesterov": False}}, "unknown setting(s) nesterov"),
    (DILOCO, {"type": "Lion", "params": {"lr": 0.02}}, "optimizer.type must be one of Adam, AdamW, Muon"),
])
def test_deepspeed_muon_section_refused_by_name(lowcomm, optimizer, message):
    from ds_lowcomm.settings import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _split(lowcomm, optimizer)


@pytest.mark.parametrize("lowcomm, message", [
    ({"method": "dion"}, "optimizer.type Muon: not with lowcomm.method dion (dion is its own orthonormal"),
    ({**DILOCO, "inner_optimizer": "muon"}, "lowcomm.inner_optimizer muon with optimizer.type Muon"),
    # ds_lowcomm's own inner optimizer's keys: the section's settings are the inner's (issue 54/55)
    ({**DILOCO, "inner_muon_lr": 0.05}, "lowcomm.inner_muon_lr: not with optimizer.type Muon (DeepSpeed's Muon is "
                                        "the inner optimizer, at optimizer.params.muon_lr (or lr))"),
    ({"method": "dct_diloco", "inner_muon_momentum": 0.9}, "lowcomm.inner_muon_momentum: not with optimizer.type Muon"),
    ({"method": "sparseloco", "inner_impl": "apex"}, "lowcomm.inner_impl: not with optimizer.type Muon"),
])
def test_deepspeed_muon_section_with_another_muon_refused(lowcomm, message):
    """At ZeRO 0 fp32, where dion and inner_optimizer muon run: not beside DeepSpeed's Muon section."""
    from ds_lowcomm.settings import ConfigError

    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        _split(lowcomm, MUON, stage=0)


def test_deepspeed_muon_section_carries_over():
    """What carries over: every DeepSpeed Muon key to an outer method's inner optimizer; lr,
    muon_lr, adam_lr, weight_decay and ns_method to demo; with replicas of different shapes,
    Muon's step is refused by name."""
    from ds_lowcomm.settings import ConfigError

    assert _split(DILOCO).muon.deepspeed_params() == {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.9,
                                                      "weight_decay": 0.01}
    demo = _split(DEMO, {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.1,
                                                   "ns_method": "standard"}}, stage=3)
    assert demo.optimizer is None and demo.muon.adam_lr == 1e-3
    with pytest.raises(ConfigError, match="lowcomm.replicas"):
        _split({"method": "demo", "update": "muon", "replicas": [{"ranks": 1}, {"ranks": 1}]}, ADAMW, stage=1)


def test_demo_groups_from_deepspeeds_halves():
    """demo's groups under a Muon section: DeepSpeed's own split (tags by ds_lowcomm's decision:
    the embedding and the named output head to Adam's half), each half's lr and weight decay;
    Muon's half scaled as DeepSpeed scales its update."""
    from ds_lowcomm.deepspeed.muon import MuonSection, demo_groups, tag_params

    model = Net()
    params = list(model.parameters())
    tag_params(model, params)
    section = MuonSection(lr=0.02, adam_lr=1e-3, weight_decay=0.1)
    groups = demo_groups(params, section)
    muon = [g for g in groups if g["update"] == "muon"]
    sign = [g for g in groups if g["update"] == "sign"]
    assert {id(p) for p in muon[0]["params"]} == {id(model.fc1.weight), id(model.fc2.weight)}
    assert muon[0]["lr"] == 0.02 and muon[0]["muon_scale"] == "deepspeed" and sign[0]["lr"] == 1e-3
    assert {id(p) for p in sign[0]["params"]} == {id(p) for p in params} - {id(model.fc1.weight), id(model.fc2.weight)}
    assert all(g["weight_decay"] == 0.1 for g in groups)


def test_the_first_log_line_names_the_inner_optimizer_and_every_setting():
    """What runs is in the run's first lines (DeepSpeed's log_dist on rank 0): which inner optimizer
    at which settings (a Muon section's, ds_lowcomm's own Muon's, or the AdamW section's), then every
    setting the ranks agreed on."""
    from ds_lowcomm.deepspeed.engine import describe_settings

    line = describe_settings(_split(DILOCO), {"lowcomm.sync_every": 2, "optimizer.params.lr": 0.02})
    assert line.startswith("ds_lowcomm: diloco, inner optimizer: DeepSpeed's Muon at optimizer.params")
    assert line.endswith("settings: lowcomm.sync_every=2, optimizer.params.lr=0.02")
    own = describe_settings(_split({**DILOCO, "inner_optimizer": "muon", "inner_muon_lr": 0.05}, ADAMW, stage=0), {})
    assert "torch's Muon at lowcomm.inner_muon_lr 0.05, momentum 0.95; AdamW at optimizer.params.lr 0.003" in own
    assert "optimizer: AdamW at optimizer.params.lr 0.003" in describe_settings(_split(DEMO, ADAMW), {})


def test_the_engine_logs_that_line_first_on_rank_0(runs):
    """initialize prints describe_settings' line on rank 0 alone (at DeepSpeed's default log level,
    WARNING, which hides its INFO lines): one per engine (demo, the Muon section's, ds_lowcomm's own Muon)."""
    ours = [[line.removeprefix("[Rank 0] ") for line in runs[rank]["log_lines"] if "] ds_lowcomm: " in line]
            for rank in range(4)]
    assert ours[1:] == [[], [], []]
    assert len(ours[0]) == 3, ours[0]
    assert ours[0][0].startswith("ds_lowcomm: demo, optimizer: AdamW at optimizer.params.lr 0.003; settings: ")
    assert ours[0][1].startswith("ds_lowcomm: diloco, inner optimizer: DeepSpeed's Muon at optimizer.params")
    assert ours[0][2].startswith("ds_lowcomm: diloco, inner optimizer: torch's Muon at lowcomm.inner_muon_lr 0.02, "
                                 "momentum 0.9; AdamW at optimizer.params.lr 0.003 for the rest; settings: ")
    assert "zero_optimization.stage=0" in ours[0][2] and "lowcomm.sync_every=2" in ours[0][2]
