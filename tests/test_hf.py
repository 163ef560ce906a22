"""The Hugging Face Trainer through ds_lowcomm.deepspeed.install() (examples/hf_trainer.py: a
Llama-architecture LlamaForCausalLM of transformers on the reference corpus), 2 ranks under
torchrun, every case in one launch (tests/hf_cases.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="transformers is not installed (the 'hf' extra)")
pytest.importorskip("accelerate", reason="accelerate is not installed (the 'hf' extra)")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf")
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", str(_free_port()),
                           str(ROOT / "tests" / "hf_cases.py"), str(tmp / "cases.json"), str(tmp)],
                          cwd=tmp, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-5000:])
    return json.loads((tmp / "cases.json").read_text())


def test_without_a_lowcomm_section_the_trainer_is_plain_deepspeed(cases):
    """install() routes a config without the section to DeepSpeed's own initialize: the same
    losses and parameters, bit for bit, as with DeepSpeed's own; and DeepSpeed's data parallelism
    (the ranks' parameters alike)."""
    plain, routed = cases["plain"], cases["plain_installed"]
    assert routed["losses"] == plain["losses"] and routed["digests"] == plain["digests"]
    assert len(set(plain["digests"])) == 1 and routed["lowcomm"] is None


def test_demo_through_the_trainer(cases):
    """demo, one rank per replica: the loss falls, the replicas are identical, what crosses between
    them is demo's sparse payload (no DeepSpeed all-reduce); the Trainer's own optimizer (no
    optimizer section) gives the same run; resume_from_checkpoint at step 3 runs the last 3 steps
    to the uninterrupted run's parameters."""
    demo = cases["demo"]
    assert demo["losses"][-1] < demo["losses"][0] - 0.2 and len(set(demo["digests"])) == 1
    method = demo["lowcomm"]
    assert method["engine_bytes_sent_per_step"] == 0 and method["compression_vs_allreduce"] > 100
    assert method["method_ledger"]["by_op"]["sparse_all_gather"]["calls"] == 6
    # the Trainer's own AdamW (no optimizer section: two parameter groups, its scheduler on them), taken over
    assert cases["demo_trainer_optimizer"]["digests"] == demo["digests"]
    resumed = cases["demo_resumed"]
    assert resumed["steps_run"] == 3 and resumed["global_step"] == 6
    assert resumed["digests"] == demo["digests"] and resumed["held_out_loss"] == demo["held_out_loss"]


def test_muon_decision_with_the_trainers_own_groups(cases):
    """update muon with the Trainer's two AdamW groups and an untied output head: the embedding and
    the head step by sign (every element moved by the same lr), the hidden matrices by Muon's
    orthogonalised step (moves of many sizes)."""
    moves = cases["demo_muon_untied_moves"]
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        largest, smallest = moves[name]
        assert largest > 0 and (largest - smallest) / largest < 1e-3, (name, moves[name])
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        largest, smallest = moves[name]
        assert largest > 10 * smallest > 0, (name, moves[name])


def test_muon_decision_for_an_outer_loop_with_the_trainers_own_groups(cases):
    """diloco with inner_optimizer muon (MuLoCo) from the Trainer's own two AdamW groups (no
    use_muon tags of the user's; refused before as untold), 3 steps and a sync: the hidden matrices Muon's, the
    embedding, the untied head and the 1-D parameters AdamW's, as Muon is run."""
    report = cases["diloco_muon_own"]
    tags = report["tags"]
    assert report["method"] == "diloco" and len(set(report["digests"])) == 1
    assert tags["model.embed_tokens.weight"] is False and tags["lm_head.weight"] is False
    assert tags["model.layers.0.self_attn.q_proj.weight"] is True
    assert tags["model.layers.1.mlp.down_proj.weight"] is True
    assert all(tags[n] is False for n in tags if n.endswith("norm.weight"))


def test_diloco_through_the_trainer(cases):
    """diloco with sync_every 3 over 6 steps: the replicas identical after the sync at step 6
    (they trained apart in between: their losses differ from demo's and plain's)."""
    diloco = cases["diloco"]
    assert len(set(diloco["digests"])) == 1 and diloco["losses"][-1] < diloco["losses"][0] - 0.2
    assert diloco["lowcomm"]["method"] == "diloco" and diloco["lowcomm"]["engine_bytes_sent_per_step"] == 0
    assert diloco["digests"] != cases["plain"]["digests"]


@pytest.mark.parametrize("case, stage", [("recipe_own_muon_zero1_bf16", 1), ("recipe_shipped_zero2_bf16", 2)])
def test_the_one_bit_recipe_through_the_trainer_in_bf16(cases, case, stage):
    """The recipe through the Trainer in bf16: ds_lowcomm's own Muon at ZeRO 1 (the Trainer's
    example stage) and examples/hf_trainer_muloco_sign.json (DeepSpeed's Muon section at the
    Trainer's lr, ZeRO 2) as shipped but H 3: the replicas identical after the last sync, every
    step's loss finite and the loss falling, one-bit syncs counted, 80x+ fewer bytes than a dense
    fp32 all-reduce of the same steps."""
    from ds_lowcomm.optim.recipes import SIGN_OUTER

    report = cases[case]
    assert len(set(report["digests"])) == 1, case
    losses = report["losses"]
    assert len(losses) == 6 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0], losses
    summary = report["lowcomm"]
    assert summary["method"] == "dct_diloco" and summary["zero_stage"] == stage, summary
    assert summary["steps"] == 6 and summary["cross_replica_bytes_sent"] > 0
    assert summary["dense_allreduce_bytes_per_step"] / summary["cross_replica_bytes_sent_per_step"] > 80
    assert cases["recipe_shipped_outer"] == SIGN_OUTER


def test_a_plain_engine_after_a_lowcomm_one_is_refused(cases):
    assert cases["plain_after_lowcomm"].startswith("ConfigError: a DeepSpeed config without a lowcomm section, after "
                                                   "a ds_lowcomm engine in this process")


def test_the_readme_command(cases):
    """The README's HF Trainer command (its script and arguments, in the same launch): 20 steps of
    demo on the 64-wide Llama; the loss falls and the replicas agree."""
    readme = cases["readme"]
    assert readme["global_step"] == 20 and readme["lowcomm"]["method"] == "demo"
    assert readme["losses"][-1] < readme["losses"][0] - 0.5 and len(set(readme["digests"])) == 1



def test_lightning_builds_a_ds_lowcomm_engine_through_its_strategy(cases):
    """Lightning's DeepSpeedStrategy stops at its own CUDA-only check on a machine without GPUs, so
    the case runs the strategy's own engine-building code (``_setup_model_and_optimizer``, which
    calls deepspeed.initialize with the optimizer configure_optimizers built): with install() and a
    lowcomm section it returns ds_lowcomm's engine running demo, with the module's AdamW taken over
    (its lr), the loss falls and the 2 replicas end identical, the replicas' traffic demo's sparse
    all-gather; an optimizer ds_lowcomm cannot take over (SGD) is refused by ds_lowcomm, by name."""
    lightning = cases["lightning"]
    assert "error" not in lightning, lightning
    assert lightning["routed"]  # deepspeed.initialize, as Lightning looked it up, was install()'s
    assert lightning["lowcomm"]["method"] == "demo" and lightning["lowcomm"]["num_replicas"] == 2
    assert lightning["lr"] == [0.02]
    assert lightning["lowcomm"]["method_ledger"]["by_op"]["sparse_all_gather"]["calls"] == 6
    assert lightning["lowcomm"]["engine_bytes_sent_per_step"] == 0
    assert lightning["losses"][-1] < lightning["losses"][0] and len(set(lightning["digests"])) == 1
    assert cases["lightning_sgd"]["error"].startswith("ConfigError: optimizer: the framework built a SGD; with a "
                                                     "lowcomm section ds_lowcomm builds the method from an AdamW/Adam")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _accelerate(tmp_path, *extra, probe=False):
    """`accelerate launch` of the example; with ``probe``, through tests/teardown_probe.py (the
    example run as __main__, then what its end left behind written to tmp_path/teardown)."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    script = [str(ROOT / "examples" / "accelerate_user.py")]
    if probe:
        (tmp_path / "teardown").mkdir()
        env["TEARDOWN_PROBE_OUT"] = str(tmp_path / "teardown")
        script.insert(0, str(ROOT / "tests" / "teardown_probe.py"))
    return subprocess.run([str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "2",
                           "--main_process_port", str(_free_port()), "--use_deepspeed", "--deepspeed_config_file",
                           str(ROOT / "examples" / "accelerate_user.json"), *script,
                           "--out", str(tmp_path), *extra],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_accelerate_launch_trains_through_ds_lowcomm_on_cpu(tmp_path):
    """`accelerate launch --use_deepspeed` of examples/accelerate_user.py (2 ranks), with Accelerate's
    own knob for the process group's backend (InitProcessGroupKwargs(backend="gloo"): the
    example's --backend gloo): Accelerate's DeepSpeed path hands deepspeed.initialize to
    ds_lowcomm (install()), which builds its engine with the config's diloco at ZeRO 2: the loss
    falls, the replicas end identical, what crossed between them was diloco's outer all-reduce
    (two syncs in 8 steps, no DeepSpeed gradient all-reduce); save_state after step 4 and a fresh
    launch's load_state go on to the same parameters and losses. The example's end (engine
    released, then the process group destroyed) leaves no process group and no gloo worker thread
    behind on either rank, so none can hold a tensor at interpreter shutdown (pytorch/pytorch#190489:
    that aborted about one resume launch in tens under load)."""
    proc = _accelerate(tmp_path, "--steps", "8", "--save-at", "4", "--backend", "gloo")
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    report = json.loads((tmp_path / "report.json").read_text())
    lowcomm = report["lowcomm"]
    assert lowcomm is not None and lowcomm["method"] == "diloco" and lowcomm["zero_stage"] == 2
    assert lowcomm["num_replicas"] == 2 and lowcomm["engine_bytes_sent_per_step"] == 0
    assert lowcomm["method_ledger"]["by_op"]["outer_all_reduce"]["calls"] == 2
    assert report["steps"] == 8 and report["losses"][-1] < report["losses"][0] - 0.5
    assert len(set(report["digests"])) == 1
    proc = _accelerate(tmp_path, "--steps", "8", "--resume", "--backend", "gloo", probe=True)
    assert proc.returncode == 0, (proc.stdout[-2000:], proc.stderr[-3000:])
    resumed = json.loads((tmp_path / "report_resumed.json").read_text())
    assert resumed["start"] == 4 and resumed["steps"] == 8
    assert resumed["digests"] == report["digests"] and resumed["losses"] == report["losses"][4:]
    for rank in range(2):
        teardown = json.loads((tmp_path / "teardown" / f"rank{rank}.json").read_text())
        assert teardown["destroyed"] and teardown["workers_at_destroy"] >= 2, teardown
        assert not teardown["default_group_alive"] and teardown["workers_after"] == 0, teardown


def test_accelerate_without_a_process_group_is_refused_by_ds_lowcomm(tmp_path):
    """Without the backend knob Accelerate sets no process group up on a machine without GPUs and
    counts one process per rank, so the config it hands on says train_batch_size 8 for 2 ranks
    of 8 each: ds_lowcomm's initialize (reached through install()) refuses it, naming the batch
    sizes, before any rank trains."""
    proc = _accelerate(tmp_path, "--steps", "8")
    assert proc.returncode != 0
    assert ("ConfigError: batch sizes (train_batch_size 8, train_micro_batch_size_per_gpu 8, gradient_accumulation_steps"
            " 1) do not fit 2 data-parallel ranks") in proc.stdout + proc.stderr, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "ds_lowcomm/deepspeed/install.py" in proc.stdout + proc.stderr  # by install()'s route
