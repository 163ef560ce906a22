"""The Hugging Face Trainer through ds_lowcomm.deepspeed.install() (examples/hf_trainer.py: a
Llama-architecture LlamaForCausalLM of transformers on the reference corpus), 2 ranks under
torchrun, every case in one launch (tests/hf_cases.py)."""

from __future__ import annotations

import json
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
    proc = subprocess.run([str(Path(sys.executable).parent / "torchrun"), "--nproc_per_node", "2", "--master_port", "29541",
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


def test_diloco_through_the_trainer(cases):
    """diloco with sync_every 3 over 6 steps: the replicas identical after the sync at step 6
    (they trained apart in between: their losses differ from demo's and plain's)."""
    diloco = cases["diloco"]
    assert len(set(diloco["digests"])) == 1 and diloco["losses"][-1] < diloco["losses"][0] - 0.2
    assert diloco["lowcomm"]["method"] == "diloco" and diloco["lowcomm"]["engine_bytes_sent_per_step"] == 0
    assert diloco["digests"] != cases["plain"]["digests"]


def test_a_plain_engine_after_a_lowcomm_one_is_refused(cases):
    assert cases["plain_after_lowcomm"].startswith("ConfigError: a DeepSpeed config without a lowcomm section, after "
                                                   "a ds_lowcomm engine in this process")


def test_the_readme_command(cases):
    """The README's HF Trainer command (its script and arguments, in the same launch): 20 steps of
    demo on the 64-wide Llama; the loss falls and the replicas agree."""
    readme = cases["readme"]
    assert readme["global_step"] == 20 and readme["lowcomm"]["method"] == "demo"
    assert readme["losses"][-1] < readme["losses"][0] - 0.5 and len(set(readme["digests"])) == 1



def test_lightning_stops_at_its_cuda_check():
    """Lightning's DeepSpeedStrategy runs on CUDA GPUs only: on this CPU machine a Trainer with the
    strategy (its config carrying a lowcomm section, ds_lowcomm installed) stops at Lightning's own
    check, before deepspeed.initialize; the rest is to be checked on a GPU (docs/frameworks.md)."""
    pl = pytest.importorskip("lightning.pytorch")
    import torch
    from lightning.pytorch.strategies import DeepSpeedStrategy

    import ds_lowcomm.deepspeed as dl

    class Regression(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randn(16, 1))
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 0},
              "lowcomm": {"method": "demo", "topk": 4, "chunk": 4}}
    dl.install()
    try:
        trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=DeepSpeedStrategy(config=config), max_steps=1,
                             logger=False, enable_checkpointing=False, enable_progress_bar=False)
        with pytest.raises(RuntimeError, match="The DeepSpeed strategy is only supported on CUDA GPUs"):
            trainer.fit(Regression(), torch.utils.data.DataLoader(data, batch_size=4))
    finally:
        dl.uninstall()


def test_accelerate_launch_reaches_ds_lowcomm_and_stops_on_a_cpu_machine(tmp_path):
    """`accelerate launch --use_deepspeed` of examples/accelerate_user.py (2 ranks): on a machine
    without GPUs Accelerate's state counts one process per rank (it sets DeepSpeed's process group
    up on GPUs only), so its DeepSpeed config says train_batch_size 8 for 2 ranks of 8 each. The
    call reaches ds_lowcomm's initialize (install() routed it) and stops there, naming the batch
    sizes: where Accelerate's DeepSpeed path stops on CPU (docs/frameworks.md); the rest is for a GPU."""
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "",
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run([str(Path(sys.executable).parent / "accelerate"), "launch", "--num_processes", "2",
                           "--main_process_port", "29542", "--use_deepspeed", "--deepspeed_config_file",
                           str(ROOT / "examples" / "accelerate_user.json"), str(ROOT / "examples" / "accelerate_user.py"),
                           "--out", str(tmp_path), "--steps", "8"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode != 0
    assert ("ConfigError: batch sizes (train_batch_size 8, train_micro_batch_size_per_gpu 8, gradient_accumulation_steps"
            " 1) do not fit 2 data-parallel ranks") in proc.stdout + proc.stderr, (proc.stdout[-2000:], proc.stderr[-3000:])
    assert "ds_lowcomm/deepspeed/install.py" in proc.stdout + proc.stderr  # by install()'s route
