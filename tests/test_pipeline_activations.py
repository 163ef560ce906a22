"""Activation compression between DeepSpeed pipeline stages (ds_lowcomm.deepspeed.activations):
2 real processes = 2 stages, plain deepspeed.initialize with a PipelineModule, gloo, ZeRO 0.
One launch runs every engine (each launch costs ~10 s); the tests read its results."""

import os

import pytest
import torch

from lowcomm_task.workers import run_local_workers

os.environ.setdefault("DS_ACCELERATOR", "cpu")

MICRO, ACC, DIN, WIDTH = 8, 2, 16, 64  # the stage boundary carries (MICRO, WIDTH) activations
TOPK_FRACTION, RANK = 0.125, 8
PROBED = []  # (dtype, requires_grad) of the input the second stage's first block sees
SIDE = 8  # columns of the second float tensor in the tuple boundary
TUPLES = []  # what the second stage's first block sees of a tuple boundary


class Block(torch.nn.Module):
    def __init__(self, din, dout, index, act=True):
        super().__init__()
        self.linear = torch.nn.Linear(din, dout)
        self.index, self.act = index, act

    def forward(self, x):
        if self.index == 2:
            PROBED.append((x.dtype, x.requires_grad))
        y = self.linear(x)
        return torch.tanh(y) if self.act else y


class TupleOut(Block):
    """Sends (h, a second float tensor, integer ids) across the boundary."""

    def forward(self, x):
        h = super().forward(x)
        return h, 2 * h[:, :SIDE], torch.arange(h.shape[0]) % 3


class TupleIn(Block):
    def forward(self, inputs):
        h, side, ids = inputs
        TUPLES.append((ids.dtype, torch.equal(ids, torch.arange(h.shape[0]) % 3), ids.requires_grad,
                       side.requires_grad, h.requires_grad))
        return torch.tanh(self.linear(h) + side.mean(-1, keepdim=True) + 0.1 * ids.unsqueeze(-1))


def pipeline_model(seed, tuple_boundary=False):
    from deepspeed.pipe import LayerSpec, PipelineModule

    torch.manual_seed(seed)
    layers = [LayerSpec(Block, DIN, WIDTH, 0), LayerSpec(TupleOut if tuple_boundary else Block, WIDTH, WIDTH, 1),
              LayerSpec(TupleIn if tuple_boundary else Block, WIDTH, WIDTH, 2), LayerSpec(Block, WIDTH, 1, 3, act=False)]
    return PipelineModule(layers=layers, num_stages=2, partition_method="uniform",
                          loss_fn=torch.nn.functional.mse_loss)


def batches(n):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(DIN, 1, generator=g)
    out = []
    for _ in range(n * ACC):
        x = torch.randn(MICRO, DIN, generator=g)
        out.append((x, torch.tanh(x @ w)))
    return out


def train(settings=None, steps=3, bf16=False, seed=0, tuple_boundary=False):
    """Returns (losses, final parameters of this stage, ledger summary or None, initial parameters)."""
    import deepspeed

    from ds_lowcomm.comm.ledger import ByteLedger
    from ds_lowcomm.deepspeed.activations import install_activation_compression

    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACC,
              "steps_per_print": 10**6, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.0, "torch_adam": True}}}
    if bf16:
        config["bf16"] = {"enabled": True}
    engine, _, _, _ = deepspeed.initialize(model=pipeline_model(seed, tuple_boundary), config=config)
    initial = [p.detach().clone() for p in engine.module.parameters()]
    ledger = None
    if settings is not None:
        ledger = ByteLedger()
        install_activation_compression(engine, settings, ledger)
    data = batches(steps)
    if bf16:  # the user feeds the bf16 model bf16 inputs
        data = [(x.bfloat16(), y.bfloat16()) for x, y in data]
    losses = []
    for step in range(steps):
        loss = engine.train_batch(data_iter=iter(data[step * ACC:(step + 1) * ACC]))
        losses.append(loss.detach().float().clone())
    params = [p.detach().clone() for p in engine.module.parameters()]
    return losses, params, (ledger.summary() if ledger is not None else None), initial


def _pipeline_worker(rank, world):
    import torch.distributed as dist

    from ds_lowcomm.codec.activations import ActivationSettings
    from ds_lowcomm.settings import ConfigError

    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")  # PipelineModule asks deepspeed.comm for ranks
    out = {}
    out["stock"] = train(None)
    out["none"] = train(ActivationSettings())
    long = 20
    out["none_long"] = train(ActivationSettings(), steps=long)
    out["int8"] = train(ActivationSettings(forward="int8", backward="int8"), steps=long)
    out["topk"] = train(ActivationSettings(forward="topk", topk_fraction=TOPK_FRACTION), steps=long)
    out["lowrank"] = train(ActivationSettings(forward="lowrank", rank=RANK), steps=long)
    PROBED.clear()
    out["bf16"] = train(ActivationSettings(forward="int8", backward="int8"), steps=2, bf16=True)
    out["bf16_probe"] = list(PROBED)
    out["bf16_param_dtype"] = out["bf16"][1][0].dtype
    TUPLES.clear()
    out["tuple"] = train(ActivationSettings(forward="int8", backward="int8"), steps=2, tuple_boundary=True)
    out["tuple_probe"] = list(TUPLES)

    # refusals, on this process: not a pipeline engine, the partitioned path, a second install
    from ds_lowcomm.comm.ledger import ByteLedger
    from ds_lowcomm.deepspeed.activations import install_activation_compression

    refusals = []
    int8 = ActivationSettings(forward="int8")
    try:
        install_activation_compression(torch.nn.Linear(2, 2), int8, ByteLedger())
    except ConfigError as err:
        refusals.append(str(err))
    engine, _, _, _ = deepspeed.initialize(model=pipeline_model(0), config={
        "train_micro_batch_size_per_gpu": 1, "steps_per_print": 10**6,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    engine.is_pipe_partitioned = True  # as DeepSpeed sets it with model parallelism and pipe_partitioned
    try:
        install_activation_compression(engine, int8, ByteLedger())
    except ConfigError as err:
        refusals.append(str(err))
    engine.is_pipe_partitioned = False
    install_activation_compression(engine, int8, ByteLedger())
    try:
        install_activation_compression(engine, int8, ByteLedger())
    except ConfigError as err:
        refusals.append(str(err))
    out["refusals"] = refusals
    dist.barrier()
    return out


@pytest.fixture(scope="module")
def results():
    return run_local_workers(_pipeline_worker, 2)


def test_none_is_bit_identical_to_stock_engine(results):
    for stage in results:
        stock_losses, stock_params, _, _ = stage["stock"]
        losses, params, _, initial = stage["none"]
        assert len(losses) == 3
        assert all(torch.equal(a, b) for a, b in zip(stock_losses, losses))
        assert len(params) == len(stock_params) > 0
        assert all(torch.equal(a, b) for a, b in zip(stock_params, params))
        # the parameters moved on both stages (stage 0's only through the gradients it received)
        assert all(not torch.equal(a, b) for a, b in zip(initial, params))


def _per_micro(summary, op, field):
    row = summary["by_op"][op]
    assert row["calls"] == 20 * ACC  # one record per micro-batch at this boundary
    return row[field] / row["calls"]


def test_compressed_bytes_and_training(results):
    stage0, stage1 = results
    raw = MICRO * WIDTH * 4  # fp32 activations, none
    expected = {
        "none_long": (raw, raw),
        "int8": (MICRO * (WIDTH + 4), MICRO * (WIDTH + 4)),  # fp32 scale per row + one byte a value
        "topk": (MICRO * 8 * (1 + 4), raw),  # k = 64/8 = 8 per row: uint8 index + fp32 value
        "lowrank": (MICRO * RANK * 4, raw),  # rows x rank fp32
    }
    for name, (fwd, bwd) in expected.items():
        s0, s1 = stage0[name][2], stage1[name][2]
        assert _per_micro(s0, "activation_send", "sent") == fwd
        assert _per_micro(s1, "activation_recv", "received") == fwd
        assert _per_micro(s1, "activation_grad_send", "sent") == bwd
        assert _per_micro(s0, "activation_grad_recv", "received") == bwd
        assert "activation_send" not in s1["by_op"] and "activation_grad_send" not in s0["by_op"]
        losses = stage1[name][0]
        assert float(losses[-1]) < 0.7 * float(losses[0]), (name, [float(l) for l in losses])
    # the factors against none: int8 4*64/68, topk 256/40, lowrank 64/8
    none_fwd = stage0["none_long"][2]["by_op"]["activation_send"]["sent"]
    assert none_fwd / stage0["int8"][2]["by_op"]["activation_send"]["sent"] == pytest.approx(4 * WIDTH / (WIDTH + 4))
    assert none_fwd / stage0["topk"][2]["by_op"]["activation_send"]["sent"] == pytest.approx(WIDTH * 4 / (8 * 5))
    assert none_fwd / stage0["lowrank"][2]["by_op"]["activation_send"]["sent"] == pytest.approx(WIDTH / RANK)
    # compressed forward changes training (a lossy codec really was on the wire)
    assert not torch.equal(stage1["int8"][0][-1], stage1["none_long"][0][-1])


def test_bf16_engine_with_int8(results):
    stage0, stage1 = results
    assert stage1["bf16_probe"] and all(p == (torch.bfloat16, True) for p in stage1["bf16_probe"])
    assert stage0["bf16_param_dtype"] == torch.bfloat16
    assert all(torch.isfinite(l).all() for l in stage1["bf16"][0])
    # int8 bytes do not depend on the source dtype: rows * (cols + 4)
    assert stage0["bf16"][2]["by_op"]["activation_send"]["sent"] == 2 * ACC * MICRO * (WIDTH + 4)
    assert stage1["bf16"][2]["by_op"]["activation_grad_send"]["sent"] == 2 * ACC * MICRO * (WIDTH + 4)


def test_tuple_boundary_codes_floats_and_sends_ids_raw(results):
    stage0, stage1 = results
    # ids arrive exact, as int64 without requires_grad; both float tensors arrive requiring grad
    assert stage1["tuple_probe"] and all(p == (torch.int64, True, False, True, True) for p in stage1["tuple_probe"])
    calls = 2 * ACC
    fwd = MICRO * (WIDTH + 4) + MICRO * (SIDE + 4) + MICRO * 8  # int8, int8, raw int64 ids
    bwd = MICRO * (WIDTH + 4) + MICRO * (SIDE + 4)  # no gradient for the ids
    assert stage0["tuple"][2]["by_op"]["activation_send"] == {"calls": calls, "sent": calls * fwd, "received": 0}
    assert stage1["tuple"][2]["by_op"]["activation_recv"]["received"] == calls * fwd
    assert stage1["tuple"][2]["by_op"]["activation_grad_send"]["sent"] == calls * bwd
    assert stage0["tuple"][2]["by_op"]["activation_grad_recv"]["received"] == calls * bwd
    _, params, _, initial = stage0["tuple"]
    assert all(not torch.equal(a, b) for a, b in zip(initial, params))  # stage 0 learnt from both gradients


def test_refusals(results):
    refusals = results[0]["refusals"]
    assert len(refusals) == 3
    assert "PipelineEngine" in refusals[0] and "Linear" in refusals[0]
    assert "pipe_partitioned" in refusals[1]
    assert "already installed" in refusals[2]
