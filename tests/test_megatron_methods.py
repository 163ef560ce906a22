"""Every ds_lowcomm method inside Megatron-Core (megatron_patches.apply), real megatron-core
modules, DDP, optimizer and schedules in real processes (gloo, CPU shim): TP 1 and 2, PP 1 and 2,
two replicas (Megatron's data-parallel ranks).

- The lossless setting (``adamw``: the dense mean in place of DDP's all-reduce) equals stock
  Megatron data-parallel training bit for bit, step for step, in every layout, with and without
  ``overlap_grad_reduce``, fp32 and bf16.
- DeMo in the bucket-level sync keeps the replicas identical and learns; with overlap it computes
  the same bits as without. MT-DAO and DCT-DiLoCo learn and agree after their syncs.
- Bytes per step equal the DeepSpeed path's for the same model (the same GPTModel in a
  ds_lowcomm DeepSpeed engine).
- Refusals are clear; pretrain_gpt's checkpoints resume exactly.
"""

import json
import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the 'megatron' extra)")

from ds_lowcomm.optim.recipes import SIGN_OUTER  # noqa: E402
from lowcomm_task.workers import run_local_workers, run_script  # noqa: E402
from tests.megatron_train import BATCH, SEQ, batch, coordinates, train  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
DEMO = {"method": "demo", "topk": 8, "chunk": 16, "decay": 0.9, "value_dtype": "int8"}
MTDAO = {"method": "mtdao", "sync_every": 2}
DCT_DILOCO = {"method": "dct_diloco", "sync_every": 3, "topk": 32, "chunk": 16}
STREAMING = {"method": "diloco", "sync_every": 4, "fragments": 2, "sync_delay": 1}
DILOCO_BF16 = {"method": "diloco", "sync_every": 2}
DEMO_MUON = {**DEMO, "update": "muon", "mean_momentum": 0.5}
SIGN = {**SIGN_OUTER, "sync_every": 3}  # the one-bit recipe's outer settings (dct_diloco, sign values), H 3
# configs/megatron/muloco_sign.json as shipped (--lowcomm-config), at H 3 and this model's inner settings
MULOCO_SHIPPED = json.loads((Path(__file__).resolve().parents[1] / "configs" / "megatron" / "muloco_sign.json").read_text())
MULOCO_SIGN = {**MULOCO_SHIPPED, "sync_every": 3, "inner_muon_lr": 0.02, "inner_muon_momentum": 0.9}


def _check_whole_matrices(record):
    """after_apply: beside demo's tensor-parallel assembly of each split matrix, the reference: the
    shards all-gathered across the tensor-parallel group, the whole matrix orthogonalised here and
    this rank's shard of it taken; the largest difference is recorded."""
    def install(opt, model):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from ds_lowcomm.optim.demo import orthogonalize
        from megatron_patches.internals import tensor_parallel_shard

        demo, tp = opt.demo, ps.get_tensor_model_parallel_world_size()
        assembled = demo.matrix_directions
        params = {id(p): p for p in model.parameters()}

        def directions(means, fn):
            out = assembled(means, fn)
            for i, direction in out.items():
                dim, q = tensor_parallel_shard(params[i]), means[i]
                shards = [torch.empty_like(q) for _ in range(tp)]
                dist.all_gather(shards, q.contiguous(), group=ps.get_tensor_model_parallel_group())
                ref = orthogonalize(torch.cat(shards, dim)).chunk(tp, dim)[ps.get_tensor_model_parallel_rank()]
                record["max_diff"] = max(record.get("max_diff", 0.0), (ref - direction).abs().max().item())
                record["matrices"] = len(out)
            return out

        demo.matrix_directions = directions if assembled is not None else None
    return install


def _check_muloco(record, lr=1e-2, weight_decay=0.01):
    """after_apply for MULOCO_SIGN (ds_lowcomm's Muon in place of Megatron's Adam): every inner step
    checked against an independent reference, the largest difference recorded. Whole matrices
    (TP 1): a replay of each step here by torch's own Muon (hidden matrices, by name) and AdamW
    (the rest) with Megatron's settings, from the same parameters and gradients, their states
    carried from step to step. TP 2: each split matrix's
    update equals gathering the momentum-blended shards, torch's Muon update of the whole matrix
    here, and this rank's shard of it."""
    def install(opt, model):
        import torch.distributed as dist
        from megatron.core import parallel_state as ps

        from ds_lowcomm.optim.muon import muon_update
        from megatron_patches.internals import tensor_parallel_shard
        from megatron_patches.wrapper import chained, torch_optimizer

        inner = torch_optimizer(chained(opt.optimizer)[0])
        names = {id(p): n for n, p in model.named_parameters()}
        tp = ps.get_tensor_model_parallel_world_size()
        record.update(max_diff=0.0, steps=0, matrices=len(inner.muon.param_groups[0]["params"]))
        if tp > 1:
            prepare, muon = inner.prepare, inner.muon

            def checked():
                group = muon.param_groups[0]
                beta, mains = group["momentum"], [p for g in muon.param_groups for p in g["params"]]
                blends = {}
                for p in mains:
                    buf = muon.state[p].get("momentum_buffer", torch.zeros_like(p)).lerp(p.grad, 1 - beta)
                    blends[id(p)] = p.grad.lerp(buf, beta)
                prepare()
                for p in mains:
                    dim, x = tensor_parallel_shard(p), blends[id(p)]
                    shards = [torch.empty_like(x) for _ in range(tp)]
                    dist.all_gather(shards, x.contiguous(), group=ps.get_tensor_model_parallel_group())
                    ref = muon_update(torch.cat(shards, dim), group).chunk(tp, dim)[ps.get_tensor_model_parallel_rank()]
                    record["max_diff"] = max(record["max_diff"], (ref - p.grad).abs().max().item())
                record["steps"] += 1
            inner.prepare = checked
            return
        stepped = [p for g in inner.param_groups for p in g["params"]]
        replay = {id(p): p.detach().clone() for p in stepped}

        def hidden(p):
            return p.dim() == 2 and "embedding" not in names[id(p)] and "output_layer" not in names[id(p)]

        # (Megatron's wd_mult 0 on biases and 1-D reaches the groups through its scheduler, which
        # this harness does not run: every group at the config's weight decay)
        muon = torch.optim.Muon([replay[id(p)] for p in stepped if hidden(p)], lr=0.02, momentum=0.9, nesterov=True,
                                weight_decay=weight_decay)
        adamw = torch.optim.AdamW([replay[id(p)] for p in stepped if not hidden(p)], lr=lr, weight_decay=weight_decay)
        record["replayed_matrices"] = sum(len(g["params"]) for g in muon.param_groups)
        step = inner.step

        def checked(closure=None):
            for p in stepped:
                replay[id(p)].copy_(p.detach())
                replay[id(p)].grad = p.grad.detach().clone()
            out = step(closure)
            muon.step()
            adamw.step()
            record["max_diff"] = max(record["max_diff"], max((replay[id(p)] - p).abs().max().item() for p in stepped))
            record["steps"] += 1
            return out
        inner.step = checked
    return install


def _init(tp, pp):
    from megatron_patches import cpu_shim
    cpu_shim.install()  # before megatron (a no-op with a GPU)
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    ps.initialize_model_parallel(tp, pp)
    model_parallel_cuda_manual_seed(1234)


def _bytes(opt):
    return [opt.ledger.step_bytes(i)[0] for i in range(opt.ledger.steps)]


def _layout_worker(rank, world, tp, pp):
    from megatron.core import parallel_state as ps

    _init(tp, pp)
    micro = 2 if pp > 1 else 1  # 1F1B with two micro batches in flight
    out = {"coord": coordinates()}
    model, _, out["stock"], out["stock_digests"] = train(None, 3, micro=micro)
    out["numel"] = sum(p.numel() for p in model.parameters())
    _, opt, out["adamw"], out["adamw_digests"] = train({"method": "adamw"}, 3, micro=micro)
    out["adamw_bytes"] = _bytes(opt)
    _, opt, out["demo"], out["demo_digests"] = train(DEMO, 6, micro=micro)
    out["demo_bytes"] = _bytes(opt)
    _, opt, out["sign"], out["sign_digests"] = train(SIGN, 6, micro=micro)  # the sign format, every layout
    out["sign_bytes"] = _bytes(opt)
    out["muloco_check"] = {}  # MuLoCo: the same outer settings around ds_lowcomm's Muon in Megatron's optimizer
    _, opt, out["muloco"], out["muloco_digests"] = train(MULOCO_SIGN, 6, micro=micro,
                                                         after_apply=_check_muloco(out["muloco_check"]))
    out["muloco_ops"] = {op: row[0] for op, row in opt.ledger.by_op.items()}
    if pp == 1:  # DeMo's Muon step through Megatron's path (a split matrix orthogonalised whole at TP 2)
        out["muon_check"] = {}
        _, opt, out["demo_muon"], out["demo_muon_digests"] = train(DEMO_MUON, 6,
                                                                   after_apply=_check_whole_matrices(out["muon_check"]))
        out["demo_muon_ops"] = {op: row[0] for op, row in opt.ledger.by_op.items()}
    if pp > 1:
        out["activations"] = _activations(micro)
    if (tp, pp) == (2, 1):
        out["reshard"] = _reshard_per_replica_state()
    if (tp, pp) == (1, 1):
        _, _, out["adamw_overlap"], _ = train({"method": "adamw"}, 3, overlap=True)
        _, _, _, out["demo_overlap_digests"] = train(DEMO, 6, overlap=True)
        _, _, out["stock_bf16"], _ = train(None, 3, bf16=True)
        _, _, out["adamw_bf16"], _ = train({"method": "adamw"}, 3, bf16=True)
        _, _, out["demo_bf16"], out["demo_bf16_digests"] = train(DEMO, 6, bf16=True)
        _, opt, out["mtdao"], out["mtdao_digests"] = train(MTDAO, 6)
        out["mtdao_bytes"] = _bytes(opt)
        _, opt, out["dct_diloco"], out["dct_diloco_digests"] = train(DCT_DILOCO, 6)
        _, opt, out["streaming"], _ = train(STREAMING, 8)
        _, _, out["diloco_bf16"], out["diloco_bf16_digests"] = train(DILOCO_BF16, 4, bf16=True)
        out["streaming_bytes"] = _bytes(opt)
        out["deepspeed_bytes"] = {m: _deepspeed_bytes(cfg) for m, cfg in (("adamw", {"method": "adamw"}),
                                                                           ("demo", DEMO))}
    ps.destroy_model_parallel()
    return out


def _reshard_per_replica_state():
    """Each replica's own state follows a new tensor/pipeline layout with the same replicas:
    DCT-DiLoCo in the sign format (recipes.SIGN_OUTER) between syncs (its residuals, the replicas' parameters; DeMo's momenta go the same
    way) saved at TP 2 x DP 2 in torch_dist, loaded at PP 2 x DP 2. Returns each replica's whole
    parameters and residuals as saved and as loaded (megatron_train.whole_tensors: the shards
    gathered, the stage's layers renumbered)."""
    import tempfile

    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_patches.checkpoint import load_dist, save_dist
    from tests.megatron_train import whole_tensors

    where = [tempfile.mkdtemp(prefix="reshard") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where)

    def observed(opt, model):
        names = {id(p): n for n, p in model.named_parameters()}
        state = {names[id(p)]: s["residual"].clone() for p, s in opt.outer.state.items() if "residual" in s}
        return {"params": whole_tensors(model, {n: p.detach().clone() for n, p in model.named_parameters()}),
                "residual": whole_tensors(model, state)}

    out = {}
    for name, lowcomm, steps in (("dct_diloco", SIGN, 4),):  # the sign format, 1 step past a sync
        path = f"{where[0]}/{name}"
        model, opt, _, _ = train(lowcomm, steps)
        saved = observed(opt, model)
        save_dist(path, steps, [model], opt)
        dp = ps.get_data_parallel_rank()
        ps.destroy_model_parallel()
        _init(1, 2)
        got = {}

        def load(opt, model):
            load_dist(path, [model], opt)
            got.update(observed(opt, model))
        train(lowcomm, 1, micro=2, after_apply=load)
        out[name] = {"saved": saved, "loaded": got, "dp": (dp, ps.get_data_parallel_rank())}
        ps.destroy_model_parallel()
        _init(2, 1)
    return out


def _activations(micro):
    """Megatron's pipeline p2p with the activation codecs (megatron_patches/activations.py)."""
    from ds_lowcomm.codec.activations import ActivationSettings
    from megatron_patches.activations import install_activation_compression, uninstall_activation_compression

    out = {}
    for name, codec in (("none", "none"), ("int8", "int8")):
        ledger = install_activation_compression(ActivationSettings(forward=codec, backward=codec))
        try:
            _, _, out[f"{name}_losses"], out[f"{name}_digests"] = train({"method": "demo", **DEMO}, 3, micro=micro)
        finally:
            uninstall_activation_compression()
        out[f"{name}_bytes"] = {op: v["sent"] for op, v in ledger.summary()["by_op"].items()}
    _, _, out["demo_losses"], out["demo_digests"] = train({"method": "demo", **DEMO}, 3, micro=micro)
    return out


def _deepspeed_bytes(lowcomm):
    """The same GPTModel (fp32, TP 1) in a ds_lowcomm DeepSpeed engine: bytes of its first step."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ds_lowcomm.deepspeed import initialize
    from tests.megatron_train import VOCAB

    torch.manual_seed(1234)
    config = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, use_cpu_initialization=True,
                               params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                     max_sequence_length=SEQ)
    ds = {"train_micro_batch_size_per_gpu": BATCH, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
          "steps_per_print": 10**6, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
          "zero_optimization": {"stage": 0}, "lowcomm": lowcomm}
    engine, *_ = initialize(model=model, config=ds)
    tokens, labels = batch(torch.Generator().manual_seed(7))
    loss = engine(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None, labels=labels).mean()
    engine.backward(loss)
    engine.step()
    return _bytes(engine.lowcomm)


def _run(world, fn, *args):
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path on every machine (the shim is a no-op with a GPU)
    try:
        return run_local_workers(fn, world, *args, threads=1)
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden


LAYOUTS = {"tp1_pp1": (1, 1, 2), "tp2_pp1": (2, 1, 4), "tp1_pp2": (1, 2, 4)}  # (tp, pp, processes): 2 replicas


@pytest.fixture(scope="module", params=list(LAYOUTS))
def layout(request):
    tp, pp, world = LAYOUTS[request.param]
    return (tp, pp), _run(world, _layout_worker, tp, pp)


def _last_stage(results):
    return [r for r in results if r["stock"][0] is not None]


def _replicas_agree(results, key):
    by_position = {}
    for r in results:
        by_position.setdefault(r["coord"][:2], []).append(r[key])
    for position, runs in by_position.items():
        assert len(runs) == 2, position
        assert runs[0] == runs[1], f"replicas differ at (tp, pp) {position}"


def test_lossless_setting_equals_stock_megatron_step_for_step(layout):
    (tp, pp), results = layout
    for r in _last_stage(results):
        assert r["adamw"] == r["stock"], (tp, pp)  # bit for bit
    for r in results:
        assert r["adamw_digests"] == r["stock_digests"]
        # Stock Megatron's all-reduce, counted where it is sent: every gradient in fp32, plus the
        # non-finite guard's one-byte health flag of the exchange.
        assert r["adamw_bytes"] == [4 * r["numel"] + 1] * 3
    if (tp, pp) == (1, 1):
        for r in results:
            assert r["adamw_overlap"] == r["stock"]
            assert r["adamw_bf16"] == r["stock_bf16"]


def test_demo_in_the_bucket_sync(layout):
    (tp, pp), results = layout
    _replicas_agree(results, "demo_digests")
    for r in _last_stage(results):
        losses = r["demo"]
        assert sum(losses[-2:]) / 2 < 0.95 * sum(losses[:2]) / 2, losses
    for r in results:
        assert 0 < r["demo_bytes"][0] < r["adamw_bytes"][0] / 4 and len(set(r["demo_bytes"])) == 1
    if (tp, pp) == (1, 1):
        for r in results:
            assert r["demo_overlap_digests"] == r["demo_digests"]  # overlap moves time, not bits
        _replicas_agree(results, "demo_bf16_digests")
        for r in results:
            assert r["demo_bf16"][-1] < r["demo_bf16"][0]


def test_demo_muon_through_megatrons_path(layout):
    """update muon (with mean momentum) through Megatron's optimizer: SignDescent steps by DeMo's
    rule with DeMo's state; the replicas stay identical and the loss falls; at TP 2 every matrix
    Megatron splits across the tensor-parallel group is orthogonalised whole (equal to gathering
    it and orthogonalising here), its shards assembled by one all-to-all each way."""
    (tp, pp), results = layout
    if pp > 1:
        pytest.skip("checked without pipeline stages")
    _replicas_agree(results, "demo_muon_digests")
    for r in _last_stage(results):
        losses = r["demo_muon"]
        assert sum(losses[-2:]) / 2 < 0.95 * sum(losses[:2]) / 2, losses
    for r in results:
        if tp == 1:
            assert "max_diff" not in r["muon_check"] and "tp_matrix_assembly" not in r["demo_muon_ops"]
        else:  # the 2 layers' qkv, proj, fc1, fc2 (the embedding and output layer step by sign)
            # (directions' entries are O(1): fp32 rounding of two Newton-Schulz orders)
            assert r["muon_check"]["matrices"] == 8 and r["muon_check"]["max_diff"] < 1e-4, r["muon_check"]
            assert r["demo_muon_ops"]["tp_matrix_assembly"] == 2 * 6


def test_sign_format_dct_diloco_in_every_layout(layout):
    """The one-bit recipe's outer settings (recipes.SIGN_OUTER: dct_diloco, top-k of 8x8 chunks
    untransformed, sign values, H 3 here) around Megatron's Adam at TP 1, TP 2 and PP 2 with 2
    replicas: the replicas differ between syncs and hold the same bits after each; bytes only at a
    sync; the loss falls."""
    (tp, pp), results = layout
    by_position = {}
    for r in results:
        by_position.setdefault(r["coord"][:2], []).append(r)
    for position, (a, b) in by_position.items():
        same = [x == y for x, y in zip(a["sign_digests"], b["sign_digests"])]
        assert same == [False, False, True] * 2, (position, same)
    for r in results:
        assert [n > 0 for n in r["sign_bytes"]] == [False, False, True] * 2, r["sign_bytes"]
        assert r["sign_bytes"][2] < r["numel"] // 4, r["sign_bytes"]  # about a bit per value, plus indices' share
    for r in _last_stage(results):
        assert r["sign"][-1] < r["sign"][0], r["sign"]


def test_muloco_with_ds_lowcomms_muon_in_megatrons_optimizer(layout):
    """MuLoCo on Megatron (lowcomm.inner_optimizer muon, the one-bit recipe's outer settings):
    Megatron's Adam swapped for ds_lowcomm's Muon + AdamW. Whole matrices (TP 1, PP 2): every inner
    step equals a replay by torch's Muon and AdamW on the same gradients within fp32 rounding; TP 2:
    each matrix Megatron splits is orthogonalised whole (equal to gathering it), its shards
    assembled over the tensor-parallel group. The replicas hold the same bits after each sync and
    the loss falls."""
    assert {k: v for k, v in MULOCO_SHIPPED.items() if not k.startswith("inner_")} == SIGN_OUTER
    (tp, pp), results = layout
    by_position = {}
    for r in results:
        by_position.setdefault(r["coord"][:2], []).append(r)
    for position, (a, b) in by_position.items():
        same = [x == y for x, y in zip(a["muloco_digests"], b["muloco_digests"])]
        assert same == [False, False, True] * 2, (position, same)
    for r in results:
        check = r["muloco_check"]
        assert check["steps"] == 6 and check["matrices"] == 8 // pp, check  # qkv, proj, fc1, fc2 per layer
        assert check["max_diff"] < 1e-6, check
        if tp == 1:
            assert check["replayed_matrices"] == check["matrices"] and "tp_matrix_assembly" not in r["muloco_ops"]
        else:
            assert r["muloco_ops"]["tp_matrix_assembly"] == 2 * 6, r["muloco_ops"]
    for r in _last_stage(results):
        assert r["muloco"][-1] < r["muloco"][0] - 0.5, r["muloco"]


def test_pipeline_activation_codecs(layout):
    """Codec none: bit-identical to Megatron's own p2p. int8 both ways: close, and the bytes each
    stage sends are exactly the codec's (a fp32 scale per row + one byte per value)."""
    (tp, pp), results = layout
    if pp == 1:
        pytest.skip("no pipeline boundary")
    rows, cols = SEQ * BATCH, 32  # (seq, micro batch, hidden) activations
    for r in results:
        acts = r["activations"]
        assert acts["none_digests"] == acts["demo_digests"]
        sent = {k: v for k, v in acts["int8_bytes"].items() if k.endswith("send")}
        stage_first = r["coord"][1] == 0
        op = "activation_send" if stage_first else "activation_grad_send"
        assert sent == {op: 3 * 2 * rows * (4 + cols)}, sent  # 3 steps x 2 micro batches
        assert acts["none_bytes"][op] == 3 * 2 * rows * cols * 4
        if not stage_first:
            for a, b in zip(acts["int8_losses"], acts["demo_losses"]):
                assert abs(a - b) < 0.01 * b


def test_bytes_equal_the_deepspeed_path(layout):
    (tp, pp), results = layout
    if (tp, pp) != (1, 1):
        pytest.skip("the DeepSpeed engine runs the same model at TP 1, PP 1")
    for r in results:
        assert r["deepspeed_bytes"]["adamw"] == r["adamw_bytes"][:1]
        assert r["deepspeed_bytes"]["demo"] == r["demo_bytes"][:1]


def test_mtdao_dct_diloco_and_streaming_diloco(layout):
    (tp, pp), results = layout
    if (tp, pp) != (1, 1):
        pytest.skip("the outer methods' layouts are covered at TP 1, PP 1 and by test_megatron.py")
    r0, r1 = results
    # diloco_bf16: the bf16 model parameters (what the digests hash) agree after each sync, so
    # the synced fp32 main parameters were copied into them.
    for key, synced_steps in (("mtdao_digests", (1, 3, 5)), ("dct_diloco_digests", (2, 5)),
                              ("diloco_bf16_digests", (1, 3))):
        for step in range(len(r0[key])):
            same = r0[key][step] == r1[key][step]
            assert same == (step in synced_steps), (key, step)  # apart between syncs, identical after
    for key in ("mtdao", "dct_diloco"):
        assert r0[key][-1] < r0[key][0], r0[key]
    # MT-DAO averages parameters + first moment + second moment every 2 steps: 3 fp32 copies.
    assert r0["mtdao_bytes"] == [0, 12 * r0["numel"] + 1] * 3  # + the exchange's health flag byte
    # Streaming DiLoCo, 2 fragments, H = 4: one fragment on the wire every 2 steps, both make the model.
    sent = r0["streaming_bytes"]
    assert [b > 0 for b in sent] == [False, True] * 4 and sent[1] + sent[3] == 4 * r0["numel"] + 2, sent
    assert r0["streaming"][-1] < r0["streaming"][0]


def test_per_replica_state_follows_a_new_tensor_and_pipeline_layout(layout):
    """Saved at TP 2 x DP 2, loaded at PP 2 x DP 2: each replica's parameters and its own state
    (DCT-DiLoCo's residuals and parameters between syncs, which differ between the replicas) as
    that replica saved them, every tensor whole and equal."""
    (tp, pp), results = layout
    if (tp, pp) != (2, 1):
        pytest.skip("run from the TP 2 x DP 2 launch")
    for method, key in (("dct_diloco", "residual"),):
        by_replica = {}
        for r in results:
            case = r["reshard"][method]
            by_replica.setdefault(case["dp"][0], case["saved"])  # what each replica saved, whole
        a, b = by_replica[0], by_replica[1]
        assert any(not torch.equal(a[key][n], b[key][n]) for n in a[key]), method  # each replica its own
        assert any(not torch.equal(a["params"][n], b["params"][n]) for n in a["params"])
        for r in results:
            case = r["reshard"][method]
            saved = by_replica[case["dp"][1]]
            for what in ("params", key):
                got = case["loaded"][what]
                assert got and all(torch.equal(got[n], saved[what][n]) for n in got), (method, what)


def _refusal_worker(rank, world):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ds_lowcomm.settings import ConfigError
    from megatron_patches import apply
    from tests.megatron_train import VOCAB

    _init(1, 1)
    errors = {}

    def build(distributed=False, fp16=False, per_token=False):
        torch.manual_seed(0)
        dtype = torch.float16 if fp16 else torch.float32
        config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                                   params_dtype=dtype, fp16=fp16, calculate_per_token_loss=per_token)
        model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                         max_sequence_length=SEQ)
        model = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=distributed),
                                        model)
        return model, get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, fp16=fp16), [model])

    cases = {"distributed_optimizer": (dict(distributed=True), {"method": "demo"}),
             "per_token_loss": (dict(per_token=True), {"method": "adamw"}),
             "mpi": ({}, {"method": "diloco", "transport": "mpi"}),
             "two_chunks": ({}, {"method": "demo"}),
             "demo_overlap": ({}, {"method": "demo", "overlap": True}),
             # (demo's update rules and mean momentum run through SignDescent now: test above)
             "dion": ({}, {"method": "dion"}),
             "inner_muon_torch": ({}, {"method": "diloco", "inner_optimizer": "muon"})}
    for name, (kwargs, lowcomm) in cases.items():
        try:
            model, opt = build(**kwargs)
            if name == "inner_muon_torch":  # ds_lowcomm's Muon swaps the Adam inside Megatron's optimizer
                opt = torch.optim.AdamW(model.parameters())
            apply([model, model] if name == "two_chunks" else [model], opt, lowcomm)
        except ConfigError as err:
            errors[name] = str(err)
        except Exception as err:  # noqa: BLE001  (reported: the test wants a ConfigError)
            errors[name] = f"{type(err).__name__}: {err}"
    # MuLoCo's two halves under Megatron's own lr scheduler (warmup 4, linear decay to min_lr by 10):
    # each from its own peak (--lr for AdamW's groups, inner_muon_lr for Muon's), the same shape
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
    from megatron_patches.wrapper import chained, torch_optimizer

    model, _ = build()
    megatron_opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4), [model])
    opt = apply([model], megatron_opt, {"method": "diloco", "inner_optimizer": "muon", "inner_muon_lr": 0.02})
    scheduler = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=4,
                                        lr_decay_steps=10, lr_decay_style="linear", start_wd=0.01, end_wd=0.01,
                                        wd_incr_steps=10, wd_incr_style="constant")
    halves = torch_optimizer(chained(megatron_opt)[0]).optimizers
    errors["scheduled_lrs"] = []
    for steps in (2, 8):  # after 2 steps: half way up; after 10: the floor
        scheduler.step(steps)
        errors["scheduled_lrs"].append([sorted({g["lr"] for g in half.param_groups}) for half in halves])
    # Megatron's NaN check on the local gradients (--check-for-nan-in-loss-and-grad), stock and
    # with ds_lowcomm in place of its grad sync (with and without overlap) or with it switched off.
    for name, lowcomm, overlap in (("nan_stock", None, False), ("nan_demo", DEMO, False),
                                   ("nan_demo_overlap", DEMO, True), ("nan_diloco", {"method": "diloco"}, False),
                                   ("nan_diloco_overlap", {"method": "diloco"}, True)):
        try:
            train(lowcomm, 1, overlap=overlap, nan_in_grads=True)
            errors[name] = "trained"
        except Exception as err:  # noqa: BLE001
            errors[name] = f"{type(err).__name__}: {err}"
    return errors


def test_unsupported_megatron_features_are_refused_clearly():
    """(And, sharing the launch: MuLoCo's Muon and AdamW halves under Megatron's lr scheduler.)"""
    errors = _run(2, _refusal_worker)[0]
    assert "distributed optimizer" in errors["distributed_optimizer"]
    assert "calculate_per_token_loss" in errors["per_token_loss"]
    assert "lowcomm.transport" in errors["mpi"]
    assert "virtual pipeline" in errors["two_chunks"]
    assert "lowcomm.overlap must be false" in errors["demo_overlap"]
    assert "lowcomm.method 'dion' is not supported with Megatron-Core" in errors["dion"]
    assert "lowcomm.inner_optimizer muon on Megatron-Core swaps the Adam inside Megatron's" in errors["inner_muon_torch"]
    (muon_up, adamw_up), (muon_floor, adamw_floor) = errors["scheduled_lrs"]
    assert muon_up == [pytest.approx(0.01)] and adamw_up == [pytest.approx(5e-4)], errors["scheduled_lrs"]
    assert muon_floor == [pytest.approx(2e-3)] and adamw_floor == [pytest.approx(1e-4)], errors["scheduled_lrs"]
    nan = "found NaN in local grad norm for bucket #0 in backward pass before data-parallel communication"
    for name in ("nan_stock", "nan_demo", "nan_demo_overlap", "nan_diloco", "nan_diloco_overlap"):
        assert errors[name].startswith("RuntimeError: Rank ") and nan in errors[name], (name, errors[name])


def _pretrain(tmp_path, name, *args, fails=False, nproc=2):
    """launch/pretrain_gpt.py on ``nproc`` ranks: its metrics; with ``fails``, its output (it must fail).
    Launched as torchrun would (run_script: torchrun's variables, a rank's failure stops the launch)
    from the fork server that imported torch once; test_megatron.py runs it under torchrun itself."""
    metrics = tmp_path / f"{name}.json"
    argv = ["--train-iters", "6", "--seq-length", "32", "--hidden-size", "32", "--metrics-out", str(metrics), *args]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    run = run_script(ROOT / "launch" / "pretrain_gpt.py", argv, nproc, env=env, cwd=ROOT, timeout=300)
    if fails:
        assert run.returncode != 0 and not metrics.exists(), run.stdout[-3000:]
        return run.stdout + run.stderr
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return {**json.loads(metrics.read_text()), "stdout": run.stdout}


@pytest.mark.parametrize("tp, pp", [(2, 3), (0, 1)])
def test_pretrain_gpt_refuses_a_layout_the_world_size_cannot_hold(tp, pp):
    """TP x PP must divide the ranks started (4 here): a clear error naming both flags, before
    Megatron is imported (it gave its own traceback from initialize_model_parallel)."""
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), "--tensor-model-parallel-size", str(tp),
           "--pipeline-model-parallel-size", str(pp)]
    run = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "WORLD_SIZE": "4" if tp else "2"}, capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert (f"configuration error: --tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} must be "
            f">= 1 and divide the world size ({4 if tp else 2} ranks started)") in run.stderr


def test_pretrain_gpt_says_why_megatrons_muon_cannot_be_built():
    """--optimizer muon needs NVIDIA's emerging-optimizers at the API megatron-core 0.16 calls (its
    v0.1.0 release); the package index's 0.3.0 needs Python >= 3.12 and renamed those keywords. Where
    it cannot be built the launcher stops before any rank communicates, saying why."""
    from megatron_patches.install import megatron_muon_unavailable

    why = megatron_muon_unavailable()
    if why is None:
        pytest.skip("Megatron-Core's Muon can be built here")
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain_gpt.py"), "--optimizer", "muon", *SIGN_ARGS]
    run = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "CUDA_VISIBLE_DEVICES": "", "WORLD_SIZE": "1"},
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stderr[-2000:]
    assert f"configuration error: --optimizer muon: Megatron-Core's Muon cannot be built here: {why}" in run.stderr
    assert "emerging-optimizers" in why


class _PickledCall:
    def __reduce__(self):  # loading this with pickle would call os.getpid
        return os.getpid, ()


DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
# the one-bit recipe's outer settings as flags (SIGN_OUTER at H 4)
SIGN_ARGS = [a for k, v in {**SIGN_OUTER, "sync_every": 4}.items()
             for a in (f"--lowcomm-{k.replace('_', '-')}", str(v))]
RESUME_CASES = {  # MuLoCo (diloco) resumes in torch_dist at TP 2 x DP 2
    # a warmup (the lr set in the param groups each iteration, as Megatron's scheduler does): DeMo
    # reads the groups after the load replaced them
    "demo-torch_dist": ["--lowcomm-method", "demo", "--lowcomm-topk", "8", "--lowcomm-chunk", "16",
                        "--lr-warmup-iters", "15", "--lowcomm-update", "muon", "--lowcomm-mean-momentum", "0.5"],
    "sparseloco-torch_dist": ["--lowcomm-method", "sparseloco", "--lowcomm-sync-every", "4"],
    "sparseloco-torch": ["--lowcomm-method", "sparseloco", "--lowcomm-sync-every", "4", "--ckpt-format", "torch"],
    "stock-torch_dist": [],
    # MuLoCo (diloco around ds_lowcomm's Muon in place of Megatron's Adam; its momenta and Adam's
    # moments in the checkpoint by parameter; each split matrix orthogonalised whole), both halves
    # warmed up from their own peaks
    "muloco-tp2xdp2-torch_dist": ["--lowcomm-method", "diloco", "--lowcomm-sync-every", "4",
                                  "--tensor-model-parallel-size", "2", "--lowcomm-inner-optimizer", "muon",
                                  "--lowcomm-inner-muon-lr", "0.02", "--lr-warmup-iters", "15"],
    "sign-torch_dist": SIGN_ARGS,
}


def _resume(tmp_path, args, nproc=2):
    """Save at iteration 10 of 20 (dropout on), resume from 10: both runs' metrics."""
    save = tmp_path / "ckpt"
    full = _pretrain(tmp_path, "full", "--train-iters", "20", "--save", str(save), "--save-interval", "10",
                     *DROPOUT, *args, nproc=nproc)
    (save / "latest_checkpointed_iteration.txt").write_text("10\n")  # as if the run had stopped after 10
    resumed = _pretrain(tmp_path, "resumed", "--train-iters", "20", "--load", str(save), *DROPOUT, *args, nproc=nproc)
    return save, full, resumed


@pytest.mark.parametrize("case", list(RESUME_CASES))
def test_pretrain_gpt_resumes_exactly(tmp_path, case):
    """Megatron-LM's checkpoint formats (torch_dist: Megatron-Core's dist_checkpointing, the
    method's state through the optimizer's sharded_state_dict; torch: a file per rank),
    saved at iteration 10 (inside the outer methods' 4-step interval: the replicas differ), with
    dropout on: resumed to 20, the same parameters, losses and bytes as the run straight through.
    TP 2 x DP 2 on 4 ranks trains and resumes too (MuLoCo: ds_lowcomm's Muon in Megatron's optimizer)."""
    args = RESUME_CASES[case]
    nproc = 4 if "tp2" in case else 2
    save, full, resumed = _resume(tmp_path, args, nproc)
    assert resumed["params_digest"] == full["params_digest"]
    assert resumed["train_loss"] == full["train_loss"][10:]
    assert resumed["val_loss"] == full["val_loss"]
    assert full["train_loss"][-1] < full["train_loss"][0] - 0.5
    if args:
        assert resumed["bytes_sent_per_step"] == full["bytes_sent_per_step"]
    if case == "sign-torch_dist":  # the run's first log line: Megatron's optimizer and every setting honoured
        first = full["stdout"].splitlines()[0]
        assert first.startswith("ds_lowcomm: dct_diloco on Megatron-Core, inner optimizer: Megatron's FP32Optimizer "
                                "of AdamW (lr 0.003, betas (0.9, 0.999), eps 1e-08, weight_decay 0.01), clip_grad 0.0; "
                                "settings: method=dct_diloco, transport=torch"), first
        assert "value_dtype=sign, transform=none" in first and "sync_every=4" in first and "inner_muon" not in first  # Adam inside: no Muon keys
    if case == "muloco-tp2xdp2-torch_dist":
        first = full["stdout"].splitlines()[0]
        assert first.startswith("ds_lowcomm: diloco on Megatron-Core, inner optimizer: Megatron's FP32Optimizer of "
                                "Muon (lr 0.02, eps 1e-07, momentum 0.95, nesterov True, weight_decay 0.01) + AdamW "
                                "(lr 0.003, betas (0.9, 0.999)"), first
        assert "inner_optimizer=muon, inner_muon_lr=0.02, inner_muon_momentum=0.95" in first
    if case == "stock-torch_dist":  # a stock checkpoint with a method's flags: refused by name
        out = _pretrain(tmp_path, "flags", "--load", str(save), "--lowcomm-method", "diloco", fails=True)
        assert out.count("holds no ds_lowcomm state") >= 2 and "iteration 11/" not in out, out[-3000:]
    if not case.startswith("sparseloco"):
        return
    if case.endswith("torch_dist"):
        # Loading it without the method's flags: a clear error on every rank, before any iteration
        # (both formats ask sharded_state.method_problem)
        out = _pretrain(tmp_path, "no_flags", "--load", str(save), *args[4:], fails=True)
        assert out.count("holds ds_lowcomm's sparseloco state; this run has no --lowcomm-* flags") >= 2, out[-3000:]
        assert "iteration 11/" not in out and "KeyError" not in out
        # One byte of rank 1's own file changed: every rank refuses the checkpoint before iteration 11
        path = next(save.glob("iter_0000010/__1_*.distcp"))
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        out = _pretrain(tmp_path, "tampered", "--train-iters", "20", "--load", str(save), *args, fails=True)
        assert out.count(f"rank 1: {path}: sha256 differs") >= 2, out[-3000:]
        assert "iteration 11/" not in out and "a peer stalled" not in out
        # PyTorch's loader unpickles .metadata: one holding a pickled call (digest recomputed) is refused first
        from ds_lowcomm.checkpoint_io import write_digest

        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
        metadata = save / "iter_0000010" / ".metadata"
        metadata.write_bytes(pickle.dumps(_PickledCall()))
        write_digest(metadata)
        out = _pretrain(tmp_path, "pickled", "--train-iters", "20", "--load", str(save), *args, fails=True)
        assert out.count(f"{metadata} holds objects other than checkpoint metadata") >= 2, out[-3000:]
        assert "iteration 11/" not in out
        return
    # One rank's file replaced by a pickled call (its digest recomputed): every rank refuses it
    from ds_lowcomm.checkpoint_io import load_file, save_file
    from megatron_patches.checkpoint import rank_file

    path = rank_file(save, 10, rank=1)
    save_file({**load_file(path), "rng": _PickledCall()}, path)
    out = _pretrain(tmp_path, "tampered", "--train-iters", "20", "--load", str(save), *args, fails=True)
    assert out.count("rank 1: " + str(path) + " holds objects other than tensors") >= 2, out[-3000:]
    assert "iteration 11/" not in out and "a peer stalled" not in out


def test_pretrain_gpt_fp16(tmp_path):
    """--fp16: Megatron's fp16 parameters, fp32 main copies and dynamic loss scale, with an outer
    method (an overflow skips that replica's local step, counted); demo is refused by name."""
    out = _pretrain(tmp_path, "fp16", "--fp16", "--train-iters", "24", "--initial-loss-scale", "65536",
                    "--lowcomm-method", "diloco", "--lowcomm-sync-every", "4")
    assert out["train_loss"][-1] < out["train_loss"][0] - 0.5, out["train_loss"]
    assert 0 <= out["skipped_iterations"] < 12 and len(out["bytes_sent_per_step"]) == 24
    err = _pretrain(tmp_path, "fp16_demo", "--fp16", "--lowcomm-method", "demo", fails=True)
    assert "lowcomm.method 'demo' with fp16 is not supported" in err and "iteration 1/" not in err
