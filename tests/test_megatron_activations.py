"""Compressed pipeline activations in Megatron-Core (megatron_patches/activations.py): real
megatron-core modules and Megatron's own 1F1B schedule (get_forward_backward_func) in two real
processes, one per pipeline stage (TP 1, PP 2, DP 1; gloo, CPU shim)."""

import argparse
import json
import os

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (the 'megatron' extra)")

from ds_lowcomm.settings import ConfigError  # noqa: E402
from lowcomm_task.workers import run_local_workers  # noqa: E402
from megatron_patches.args import activation_settings, add_lowcomm_args, lowcomm_config  # noqa: E402

from tests.megatron_train import BATCH, SEQ, train  # noqa: E402

HIDDEN = 32  # tests/megatron_train.py's hidden_size
STEPS, MICRO = 3, 2  # 2 micro batches: 1F1B's warm-up, steady state and cool-down all run


def _worker(rank, world):
    from megatron_patches import cpu_shim
    cpu_shim.install()  # before megatron (a no-op with a GPU)
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func, schedules
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from ds_lowcomm.codec.activations import ActivationSettings
    from megatron_patches.activations import install_activation_compression, uninstall_activation_compression

    ps.initialize_model_parallel(1, 2)
    model_parallel_cuda_manual_seed(1234)
    assert ps.get_pipeline_model_parallel_world_size() == 2 and ps.get_data_parallel_world_size() == 1
    assert get_forward_backward_func() is schedules.forward_backward_pipelining_without_interleaving
    stock_class = schedules.P2PCommunicator
    out = {"stage": ps.get_pipeline_model_parallel_rank()}

    def run(name, settings, **kw):
        ledger = install_activation_compression(settings) if settings is not None else None
        try:
            _, _, out[f"{name}_losses"], out[f"{name}_digests"] = train(None, STEPS, micro=MICRO, **kw)
        finally:
            uninstall_activation_compression()
        if ledger is not None:
            out[f"{name}_bytes"] = {op: (v["calls"], v["sent"], v["received"])
                                    for op, v in ledger.summary()["by_op"].items()}

    run("stock", None)
    run("none", ActivationSettings())
    run("int8", ActivationSettings(forward="int8", backward="int8"))
    run("stock_bf16", None, bf16=True)
    run("none_bf16", ActivationSettings(), bf16=True)
    run("int8_bf16", ActivationSettings(forward="int8", backward="int8"), bf16=True)
    out["restored"] = schedules.P2PCommunicator is stock_class
    ps.destroy_model_parallel()

    # The interleaved schedule (2 model chunks a stage), with and without overlap_p2p_comm.
    ps.initialize_model_parallel(1, 2, virtual_pipeline_model_parallel_size=2)
    assert get_forward_backward_func() is schedules.forward_backward_pipelining_with_interleaving
    for overlap in (False, True):
        for name, settings in (("stock", None), ("none", ActivationSettings()),
                               ("int8", ActivationSettings(forward="int8", backward="int8"))):
            ledger = install_activation_compression(settings) if settings is not None else None
            try:
                out[("interleaved", name, overlap)] = _interleaved(overlap)
            finally:
                uninstall_activation_compression()
            if ledger is not None:
                out[("interleaved_bytes", name, overlap)] = ledger.sent
    ps.destroy_model_parallel()
    return out


def _interleaved(overlap):
    """One forward_backward of 4 micro batches over 2 chunks a stage (4 layers, fp32, no optimizer):
    the losses (last stage) and a digest of this stage's gradients."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.transformer_config import TransformerConfig

    from ds_lowcomm.checkpoint_io import params_digest
    from tests.megatron_train import VOCAB, batch

    torch.manual_seed(0)
    config = TransformerConfig(num_layers=4, hidden_size=HIDDEN, num_attention_heads=4, use_cpu_initialization=True,
                               pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2,
                               pipeline_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
                               overlap_p2p_comm=overlap, batch_p2p_comm=not overlap)
    chunks = [GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                       max_sequence_length=SEQ, vp_stage=i,
                       pre_process=ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=i),
                       post_process=ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=i)) for i in range(2)]
    gen = torch.Generator().manual_seed(5)
    data = [batch(gen) for _ in range(4)]
    positions = torch.arange(SEQ).expand(BATCH, SEQ)

    def forward_step(data_iterator, model):
        tokens, labels = next(data_iterator)
        per_token = model(tokens, positions, None, labels=labels)
        return per_token, lambda t: (t.float().mean(), {"lm loss": t.float().mean().detach().clone()})

    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=[iter(data), iter(data)],
                                      model=chunks, num_microbatches=4, seq_length=SEQ, micro_batch_size=BATCH)
    grads = [p.grad for m in chunks for p in m.parameters() if p.grad is not None]
    return [float(d["lm loss"]) for d in out], params_digest(grads)


@pytest.fixture(scope="module")
def results():
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # the CPU path on every machine
    try:
        return {r["stage"]: r for r in run_local_workers(_worker, 2, threads=1)}
    finally:
        if hidden is None:
            del os.environ["CUDA_VISIBLE_DEVICES"]
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = hidden


def test_codec_none_is_bit_identical_to_stock(results):
    for stage, r in results.items():
        assert r["restored"]
        for suffix in ("", "_bf16"):  # every step's parameters, bit for bit, and the losses
            assert r[f"none{suffix}_digests"] == r[f"stock{suffix}_digests"], (stage, suffix)
            assert r[f"none{suffix}_losses"] == r[f"stock{suffix}_losses"]
    assert all(loss is not None for loss in results[1]["stock_losses"])  # the last stage reports them


def _expected(micro_tensors: int, per_tensor: int) -> int:
    return STEPS * MICRO * micro_tensors * per_tensor


@pytest.mark.parametrize("dtype_bytes,suffix", [(4, ""), (2, "_bf16")])
def test_int8_close_to_stock_with_the_codec_bytes(results, dtype_bytes, suffix):
    rows, cols = SEQ * BATCH, HIDDEN  # (seq, micro batch, hidden) activations, rows of `hidden`
    int8 = _expected(1, rows * (4 + cols))  # a fp32 scale per row + one byte per value
    raw = _expected(1, rows * cols * dtype_bytes)
    first, last = results[0], results[1]
    calls = STEPS * MICRO
    # The first stage sends activations and receives their gradients; the last the reverse.
    assert first[f"int8{suffix}_bytes"] == {"activation_send": (calls, int8, 0),
                                            "activation_grad_recv": (calls, 0, int8)}
    assert last[f"int8{suffix}_bytes"] == {"activation_recv": (calls, 0, int8),
                                           "activation_grad_send": (calls, int8, 0)}
    if not suffix:  # codec none books the tensors' own bytes
        assert first["none_bytes"]["activation_send"] == (calls, raw, 0)
        assert last["none_bytes"]["activation_grad_send"] == (calls, raw, 0)
    assert int8 < raw / (3 if dtype_bytes == 4 else 1.5)  # 36 bytes a row of 32 vs 128 (fp32), 64 (bf16)
    tol = 0.01 if not suffix else 0.03
    stock, coded = last[f"stock{suffix}_losses"], last[f"int8{suffix}_losses"]
    for a, b in zip(coded, stock):
        assert abs(a - b) <= tol * abs(b), (coded, stock)
    assert coded != stock or suffix  # a lossy codec really was on the wire (fp32: never exact)
    assert first[f"int8{suffix}_digests"] != first[f"stock{suffix}_digests"]


@pytest.mark.parametrize("overlap", [False, True])
def test_interleaved_schedule(results, overlap):
    """The interleaved schedule goes through the same patched _communicate; with overlap_p2p_comm
    it gets completed handles (no overlap, same numbers)."""
    per_tensor = SEQ * BATCH * (4 + HIDDEN)
    for stage, r in results.items():
        assert r[("interleaved", "none", overlap)] == r[("interleaved", "stock", overlap)], stage
        # 3 chunk boundaries (0:a -> 1:a -> 0:b -> 1:b) x 4 micro batches x (activation + gradient),
        # half of it sent by each stage
        assert r[("interleaved_bytes", "int8", overlap)] == 3 * 4 * per_tensor
    stock, coded = results[1][("interleaved", "stock", overlap)][0], results[1][("interleaved", "int8", overlap)][0]
    assert len(stock) == 4 and coded != stock
    for a, b in zip(coded, stock):
        assert abs(a - b) <= 0.01 * abs(b)


def _parse(argv):
    return add_lowcomm_args(argparse.ArgumentParser()).parse_args(argv)


@pytest.mark.parametrize("flag,value,field", [
    ("--lowcomm-activations-forward", "int3", "forward"),
    ("--lowcomm-activations-backward", "fp8", "backward"),
    ("--lowcomm-activations-topk-fraction", "1.5", "topk_fraction"),
    ("--lowcomm-activations-rank", "0", "rank"),
    ("--lowcomm-activations-seed", "-1", "seed"),
])
def test_bad_activation_flag_names_the_field(flag, value, field):
    with pytest.raises(ConfigError, match=rf"lowcomm\.activations\.{field}\b"):
        activation_settings(_parse([flag, value]))


def test_activation_flags_and_config_file(tmp_path):
    assert activation_settings(_parse([])) is None
    acts = activation_settings(_parse(["--lowcomm-activations-backward", "topk",
                                       "--lowcomm-activations-topk-fraction", "0.25"]))
    assert (acts.forward, acts.backward, acts.topk_fraction) == ("none", "topk", 0.25)
    path = tmp_path / "lowcomm.json"
    path.write_text(json.dumps({"lowcomm": {"method": "diloco", "activations": {"forward": "int4", "rank": 8}}}))
    args = _parse(["--lowcomm-config", str(path), "--lowcomm-activations-rank", "4"])
    assert lowcomm_config(args).method == "diloco"  # the activations mapping does not reach LowcommConfig
    acts = activation_settings(args)
    assert (acts.forward, acts.backward, acts.rank) == ("int4", "none", 4)  # flags override the file
    path.write_text(json.dumps({"lowcomm": {"activations": {"forwrd": "int8"}}}))
    assert lowcomm_config(_parse(["--lowcomm-config", str(path)])) is None  # only activations: no method
    with pytest.raises(ConfigError, match=r"lowcomm\.activations.*forwrd"):
        activation_settings(_parse(["--lowcomm-config", str(path)]))
    path.write_text(json.dumps({"lowcomm": {"activations": "int8"}}))  # no mapping: refused, flags or not
    with pytest.raises(ConfigError, match=r"lowcomm\.activations must be a mapping"):
        activation_settings(_parse(["--lowcomm-config", str(path), "--lowcomm-activations-rank", "4"]))
