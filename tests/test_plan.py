"""The planner (ds_lowcomm/plan.py): its shapes are the models', its memory figure the optimizer
state the methods really hold, its inputs checked. Its bytes against the ledger of real runs:
tests/test_compare.py (the compare run of every method)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist

from ds_lowcomm import plan as planner
from ds_lowcomm.compare import RECIPES
from ds_lowcomm.optim.registry import LowcommConfig, build_optimizer, model_param_groups
from ds_lowcomm.settings import ConfigError
from ds_lowcomm.task.model import GPT, GPTConfig


def test_the_reference_gpt_shapes_are_the_models():
    for n_layer, n_embd, vocab, seq in ((2, 128, 256, 128), (1, 32, 256, 32), (12, 768, 50257, 1024)):
        with torch.device("meta"):
            model = GPT(GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=n_layer, n_head=4, n_embd=n_embd))
        assert [tuple(p.shape) for p in model.parameters()] == planner.gpt_shapes(n_layer, n_embd, vocab, seq)


def test_the_llama_shapes_are_transformers():
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")
    for name, kw in (("llama-8b", dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336,
                                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False)),
                     ("llama-1b", dict(hidden_size=2048, num_hidden_layers=16, intermediate_size=8192,
                                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True))):
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(transformers.LlamaConfig(vocab_size=128256, **kw))
        shapes = [tuple(p.shape) for p in model.parameters()]
        assert sorted(shapes) == sorted(planner.model_shapes(name)), name
    assert abs(sum(math.prod(s) for s in planner.model_shapes("llama-8b")) - 8.03e9) < 0.01e9


@pytest.fixture(scope="module")
def one_rank_world(tmp_path_factory):
    """A real gloo group of one rank in this process (its collectives run; nothing to send to)."""
    if dist.is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("store") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("method,extra", [
    ("adamw", {}), ("demo", {}), ("demo", {"state_dtype": "bf16"}), ("demo", {"value_dtype": "sign"}),
    ("demo", {"value_dtype": "fp32"}), ("diloco", {}), ("diloco", {"outer_optimizer": "adam"}), ("dct_diloco", {}),
    ("dct_diloco", {"value_dtype": "fp16"}), ("sparseloco", {}), ("mtdao", {}),
    ("mtdao", {"sync_codec": "topk", "topk": 8, "chunk": 8}), ("dion", {}), ("dion", {"value_dtype": "bf16"}),
    ("diloco", {"inner_optimizer": "muon"}), ("sparseloco", {"inner_optimizer": "muon"})])
def test_the_memory_figure_is_the_optimizer_state(one_rank_world, method, extra):
    """The planner's state bytes per element x the model's elements = the tensors the method holds
    after a sync (its own state and, for the outer methods, the inner AdamW's and the outer
    optimizer's), step counters left out; and its bytes per sync are the ledger's, op by op (every
    value format: sign and sparse fp32 here, the others also in test_compare.py's 2-rank run)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_embd=32, seq_len=32))
    raw = {**RECIPES[method]["lowcomm"], **extra, "method": method}
    if "sync_every" in raw:
        raw["sync_every"] = 2
    cfg = LowcommConfig.from_dict(raw)
    opt = build_optimizer(cfg, model_param_groups(cfg, model, model.parameters()), lr=1e-3)
    x = torch.randint(0, 256, (2, 33))
    for _ in range(3):  # past a sync
        loss = torch.nn.functional.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    held = 0
    inner = getattr(opt, "inner", None)
    states = [opt.state, *(o.state for o in getattr(inner, "optimizers", [inner]) if o is not None)]
    for state in states:
        for per_param in state.values():
            held += sum(t.numel() * t.element_size() for t in dict(per_param).values()
                        if isinstance(t, torch.Tensor) and t.dim() > 0)
    elements = sum(p.numel() for p in model.parameters())
    shapes = [tuple(p.shape) for p in model.parameters()]
    matrices = planner.hidden_matrices("reference", shapes)  # the GPT's: its embeddings lead
    assert planner.state_bytes_per_element(method, cfg.effective(), 4, shapes, matrices) * elements == pytest.approx(held)
    counted = {op: (calls, sent) for op, (calls, sent, _) in opt.ledger.by_op.items() if op != "setup"}
    assert counted == planner.planned_ledger(method, cfg.effective(), shapes, steps=3, matrices=matrices)


def test_bad_inputs_name_the_field():
    for change, field in ((dict(model="gpt-9"), "model"), (dict(replicas=0), "replicas"),
                          (dict(link_gbit=-1.0), "link_gbit"), (dict(compute_s=0), "compute_s"),
                          (dict(zero_stage=4), "zero_stage"), (dict(methods={"lamb": {}}), "methods"),
                          (dict(grad_bytes=3), "grad_bytes"), (dict(latency_ms=-1), "latency_ms")):
        with pytest.raises(ConfigError, match=field):
            planner.plan(planner.PlanInputs(**change))
    with pytest.raises(ConfigError, match="topk"):  # a method's own settings, checked as the config's
        planner.plan(planner.PlanInputs(methods={"demo": {"topk": 0}}))


def test_the_plan_command_writes_its_table_and_json(tmp_path, capsys):
    """The README's plan command (8B, 4 replicas of 8 GPUs, 10 Gbit/s per replica, 10 ms): its
    table's 10 Gbit/s row, adamw's ring arithmetic, the added state."""
    from ds_lowcomm.cli import main

    readme = ["plan", "--model", "llama-8b", "--replicas", "4", "--gpus-per-replica", "8", "--link-gbit", "1.25",
              "--latency-ms", "10", "--compute-s", "1.995", "--grad-bytes", "2"]
    assert main([*readme, "--json", str(tmp_path / "plan.json")]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "plan.json").read_text())
    rows = {r["method"]: r for r in result["rows"]}
    assert "llama-8b" in out and set(rows) == set(RECIPES)
    assert {m: round(r["speedup_vs_adamw"], 1) for m, r in rows.items()} == {
        "adamw": 1.0, "demo": 6.0, "diloco": 4.4, "dct_diloco": 6.3, "sparseloco": 6.8, "mtdao": 2.0,
        "dion": 1.4}
    assert round(result["comm_compute_ratio"], 1) == 10.1
    # adamw's comm: its health flag's all-gather (n-1 rounds, a latency each) and a ring all-reduce
    # of bf16 gradients (each worker's 1/8), 2(n-1) rounds of 1/n
    grads = 2 * result["parameters"] / 8
    expect = 3 * 10e-3 + 6 * (10e-3 + grads / 4 * planner.WIRE_OVERHEAD * 8 / 1.25e9)
    assert rows["adamw"]["comm_s_per_step"] == pytest.approx(expect, rel=1e-3)
    assert rows["diloco"]["added_state_bytes_per_gpu"] == pytest.approx(2 * 4 * result["parameters"] / 8)
    assert main(["plan", "--replicas", "0"]) == 2


def test_the_check_against_the_measurements_holds_its_bytes():
    """bench plan_check over the committed network measurements: every row's bytes per step within
    0.5% of the ledger's (docs/planning.md); the step times are reported there, not asserted."""
    from pathlib import Path

    from ds_lowcomm.bench.plan_check import BYTES_WITHIN, network_rows

    bench = Path(__file__).resolve().parents[1] / "docs" / "bench"
    rows = network_rows(bench / "network-2h.csv") + network_rows(bench / "network-4h.csv")
    assert len(rows) == 24
    for r in rows:
        assert abs(r["predicted_bytes_per_step"] / r["measured_bytes_per_step"] - 1) <= BYTES_WITHIN, r


def test_the_hf_benchmark_configs_and_verdict():
    """bench hf: plain DeepSpeed's config has no lowcomm section; a method's is its compare recipe
    with one rank per replica, overrides on top; the verdict compares bytes at plain DeepSpeed's loss."""
    from ds_lowcomm.bench.hf import entry_config, target_verdict

    plain, lr = entry_config("deepspeed")
    assert "lowcomm" not in plain and lr == RECIPES["adamw"]["lr"]
    demo, lr = entry_config("demo", {"lr": 4e-3, "lowcomm": {"decay": 0.999}})
    assert lr == 4e-3 and demo["lowcomm"] == {**RECIPES["demo"]["lowcomm"], "replica_size": 1, "decay": 0.999}
    rows = [{"entry": "deepspeed", "link": "x", "held_out_loss": 2.0, "bytes_sent_per_worker": 1000},
            {"entry": "demo", "link": "x", "held_out_loss": 1.99, "bytes_sent_per_worker": 10},
            {"entry": "diloco", "link": "x", "held_out_loss": 2.01, "bytes_sent_per_worker": 1}]
    verdict = target_verdict(rows)["per_link"]["x"]
    assert verdict["reach"] == {"demo": 100.0} and verdict["met"]
